// Half-precision conversions (bf16 and IEEE f16 <-> fp32, round to nearest even), shared by the
// kernels that widen and narrow 16-bit tensors: CPU Adam, dequantization, the examples; and
// f16 blocks through the F16C instructions (src/half.cpp).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata {

inline float bf16_to_float(std::uint16_t v) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(v) << 16);
}

/// Branch-free, so loops that call it vectorise. NaNs stay NaN (made quiet).
inline std::uint16_t float_to_bf16(float f) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<std::uint16_t>(nan ? (bits >> 16) | 0x40u : rounded >> 16);  // quiet NaN
}

/// Exact for every f16 value; NaNs made quiet, as vcvtph2ps does.
inline float f16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
  } else if (exp == 0x1F) {  // inf, or NaN made quiet (as vcvtph2ps does)
    bits = sign | 0x7F800000u | (mant != 0 ? 0x400000u : 0u) | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// Round to nearest even; overflow to inf; NaNs made quiet keeping the payload's top, as
/// vcvtps2ph does.
inline std::uint16_t float_to_f16(float f) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u)  // inf, or NaN made quiet keeping the payload's top (as vcvtps2ph)
    return static_cast<std::uint16_t>(sign | 0x7C00u |
                                      (abs > 0x7F800000u ? 0x200u | ((abs >> 13) & 0x3FFu) : 0u));
  if (abs >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // overflow: inf
  if (abs < 0x38800000u) {  // subnormal or zero in f16
    if (abs < 0x33000000u) return sign;
    const std::uint32_t exp = abs >> 23, mant = (abs & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126 - exp;  // 14 + (113 - exp) ... to a 10-bit mantissa
    const std::uint32_t half = 1u << (shift - 1);
    std::uint32_t m = mant >> shift;
    const std::uint32_t rest = mant & ((1u << shift) - 1);
    if (rest > half || (rest == half && (m & 1u))) ++m;
    return static_cast<std::uint16_t>(sign | m);
  }
  std::uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xFFFu + ((v >> 13) & 1u);       // round to nearest even
  return static_cast<std::uint16_t>(sign | (v >> 13));
}

// Note [f16 through F16C]: f16 values convert 8 at a time with the F16C instructions (exact for
// every non-NaN value, round to nearest even; f16_to_float and float_to_f16 treat NaNs as they
// do), a block at a time around a kernel's f32 loop, when the CPU has them.

/// Whether this CPU has F16C (and AVX): f16_to_f32_block and f32_to_f16_block need it.
bool has_f16c() noexcept;
/// n f16 values widened, 8 at a time with F16C (the tail element by element).
void f16_to_f32_block(const std::uint16_t* src, float* dst, std::size_t n) noexcept;
/// n floats narrowed to f16, 8 at a time with F16C (the tail element by element).
void f32_to_f16_block(const float* src, std::uint16_t* dst, std::size_t n) noexcept;

}  // namespace strata
