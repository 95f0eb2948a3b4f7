#include "strata/base/units.h"

#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>

#include "strata/base/error.h"

namespace strata {
namespace {

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())))
    s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.remove_suffix(1);
  return s;
}

}  // namespace

std::uint64_t parse_bytes(std::string_view text, std::string_view what) {
  const std::string_view s = trim(text);
  auto bad = [&](const char* why) -> Error {
    return Error(Errc::invalid_argument,
                 detail::concat(what, ": cannot read \"", text, "\" as a byte size (", why,
                                "; e.g. 4096, \"512MiB\", \"2GB\")"));
  };
  std::size_t i = 0;
  std::uint64_t whole = 0;
  bool digits = false;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
    const std::uint64_t d = static_cast<std::uint64_t>(s[i] - '0');
    if (whole > (std::numeric_limits<std::uint64_t>::max() - d) / 10) throw bad("too large");
    whole = whole * 10 + d;
    digits = true;
    ++i;
  }
  double fraction = 0.0;
  if (i < s.size() && s[i] == '.') {
    ++i;
    double scale = 0.1;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
      fraction += scale * (s[i] - '0');
      scale /= 10;
      digits = true;
      ++i;
    }
  }
  if (!digits) throw bad(s.starts_with('-') ? "negative" : "no number");
  const std::string_view unit = trim(s.substr(i));

  struct Unit {
    std::string_view name;
    std::uint64_t factor;
  };
  static constexpr std::array<Unit, 14> kUnits{{{"", 1},
                                                {"b", 1},
                                                {"k", KiB},
                                                {"kib", KiB},
                                                {"m", MiB},
                                                {"mib", MiB},
                                                {"g", GiB},
                                                {"gib", GiB},
                                                {"t", 1024 * GiB},
                                                {"tib", 1024 * GiB},
                                                {"kb", 1000},
                                                {"mb", 1000 * 1000},
                                                {"gb", 1000 * 1000 * 1000},
                                                {"tb", 1000ULL * 1000 * 1000 * 1000}}};
  for (const Unit& u : kUnits) {
    if (!iequals(unit, u.name)) continue;
    if (whole > std::numeric_limits<std::uint64_t>::max() / u.factor) throw bad("too large");
    const double extra = std::round(fraction * static_cast<double>(u.factor));
    if (u.factor == 1 && fraction != 0.0) throw bad("fractional bytes");
    return whole * u.factor + static_cast<std::uint64_t>(extra);
  }
  throw bad("unknown unit");
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr std::array<const char*, 5> kNames{"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < KiB) return detail::concat(bytes, " B");
  double value = static_cast<double>(bytes) / KiB;
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < kNames.size()) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", value, kNames[unit]);
  return buf;
}

}  // namespace strata
