// Shared helpers of strata-bench subcommands.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// The median of `xs` (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> xs) {
  if (xs.empty()) return 0;
  std::sort(xs.begin(), xs.end());
  const std::size_t k = xs.size() / 2;
  return xs.size() % 2 == 1 ? xs[k] : 0.5 * (xs[k - 1] + xs[k]);
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
