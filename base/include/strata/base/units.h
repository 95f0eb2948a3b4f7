// Byte sizes with units, as written in configuration and on the command line.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

/// Parses a byte size: a non-negative number (integer or decimal) followed by an optional unit.
/// Binary units: K, KiB, M, MiB, G, GiB, T, TiB (powers of 1024; the bare letters follow fio).
/// Decimal units: KB, MB, GB, TB (powers of 1000). B or no unit means bytes. Case-insensitive,
/// spaces between number and unit allowed.
/// @throws strata::Error (invalid_argument) naming `what` and the text, for a negative, empty,
///         malformed or overflowing size.
std::uint64_t parse_bytes(std::string_view text, std::string_view what = "size");

/// Formats bytes for people: "512 B", "4.0 KiB", "1.50 GiB".
std::string format_bytes(std::uint64_t bytes);

/// Rounds `value` up to a multiple of `alignment` (a power of two).
constexpr std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) noexcept {
  return (value + alignment - 1) & ~(alignment - 1);
}
constexpr bool is_pow2(std::uint64_t value) noexcept {
  return value != 0 && (value & (value - 1)) == 0;
}

inline constexpr std::uint64_t KiB = 1024;
inline constexpr std::uint64_t MiB = 1024 * KiB;
inline constexpr std::uint64_t GiB = 1024 * MiB;

}  // namespace strata
