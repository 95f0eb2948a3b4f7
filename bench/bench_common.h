// Shared helpers of strata-bench subcommands.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace strata::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Prints the result object on stdout (one line, machine-readable).
inline void print_json(const nlohmann::json& result) {
  std::printf("%s\n", result.dump().c_str());
  std::fflush(stdout);
}

inline bool stderr_is_terminal() {
  return ::isatty(STDERR_FILENO) == 1;
}

}  // namespace strata::bench
