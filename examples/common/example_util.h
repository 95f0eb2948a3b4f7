// Small pieces both examples use: timing (and the CPU time the hypervisor stole meanwhile), a
// counter-based random generator that gives the same numbers in every run, and a temporary
// directory under /var/tmp removed with its contents.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "strata/base/error.h"

namespace strata::examples {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// CPU time stolen from this machine's CPUs by the hypervisor since boot, all CPUs summed
/// (/proc/stat's steal column); 0 where it is not reported. A pass that lost CPU this way ran
/// slower for reasons outside the program: the figures say how much.
inline double cpu_steal_seconds() {
  std::ifstream stat("/proc/stat");
  std::string line;
  if (!std::getline(stat, line) || line.rfind("cpu ", 0) != 0) return 0;
  std::istringstream in(line.substr(4));
  std::uint64_t v[8] = {};  // user nice system idle iowait irq softirq steal
  for (std::uint64_t& x : v)
    if (!(in >> x)) return 0;
  const long hz = ::sysconf(_SC_CLK_TCK);
  return hz > 0 ? static_cast<double>(v[7]) / static_cast<double>(hz) : 0;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Element `i` of random stream `stream`, uniform in [-1, 1).
inline float uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t i) {
  const std::uint64_t r = splitmix(splitmix(seed ^ splitmix(stream)) + i);
  return static_cast<float>(r >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/// A fresh directory /var/tmp/<prefix>-XXXXXX, removed with everything in it.
class OwnedDir {
 public:
  explicit OwnedDir(const std::string& prefix) {
    std::string tmpl = "/var/tmp/" + prefix + "-XXXXXX";
    STRATA_EXPECTS(::mkdtemp(tmpl.data()) != nullptr,
                   "cannot make a temporary directory under /var/tmp: ", std::strerror(errno));
    path_ = tmpl;
  }
  ~OwnedDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  OwnedDir(const OwnedDir&) = delete;
  OwnedDir& operator=(const OwnedDir&) = delete;
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace strata::examples
