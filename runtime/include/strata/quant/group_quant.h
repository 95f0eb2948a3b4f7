// Group-wise affine quantization (FlexGen's scheme) of a tensor's copy on the slow tiers: int8 or
// int4 codes along the last dimension, a min and a scale in fp16 per group of `group` elements;
// the layout of a compressed copy, the quantizer (once, when the copy is made) and the
// dequantizer (on every arrival, vectorised for the CPU it runs on, chosen at run time).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "strata/runtime/tensor.h"

namespace strata::quant {

// Note [Compressed copies]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor of shape [..., K] is `rows` = numel / K rows of `cols` = K elements (a scalar: one row
// of one). Each row is cut into groups of `group` elements; the last group of a row is shorter
// when `group` does not divide K. A group keeps m (fp16, the largest fp16 <= its smallest value)
// and s (fp16, the smallest fp16 >= (its largest value - m) / L), L = 2^bits - 1, and a code per
// element, q = clamp(rint((x - m) / s), 0, L) computed in double (0 when s is 0; for an f16
// tensor, one less while float(q) * s + m would round to f16's infinity). So, in exact
// arithmetic, |q s + m - x| <= s / 2: half the group's own step. Dequantization computes
// float(q) * s + m in fp32 (a multiply, then an add: no FMA, so every variant rounds alike) and
// rounds to the output dtype (nearest even); the bound then grows by those roundings.
//
// The bytes are row-major and each row is self-contained, so any run of whole rows is a run of
// bytes and can be dequantized on its own (a chunk that has arrived):
//   row r at r * row_stride: [m, s] as 2 fp16 per group, then the codes (int8: one a byte;
//   int4: two a byte, element 2i in the low nibble, a row's odd last nibble 0), padded to 4.
// Values must be finite, and m and s must fit fp16 (|values| up to 65504, a group's range up
// to 65504 L): the error names the tensor, the row and the group otherwise.

enum class Bits : std::uint8_t { Int8 = 8, Int4 = 4 };
std::string_view to_string(Bits bits) noexcept;
/// "int8" or "int4"; throws naming `key` otherwise.
Bits parse_bits(std::string_view text, std::string_view key = "compress");

struct Scheme {
  Bits bits = Bits::Int8;
  std::uint32_t group = 64;  ///< elements a group; even for int4 (groups start on a byte)
};

/// A descriptor's codec (Int8 or Int4) as bits, and back; the scheme its compression asks for.
constexpr Bits bits_of(Codec codec) noexcept {
  return codec == Codec::Int4 ? Bits::Int4 : Bits::Int8;
}
constexpr Codec codec_of(Bits bits) noexcept {
  return bits == Bits::Int4 ? Codec::Int4 : Codec::Int8;
}
constexpr Scheme scheme_of(const Compression& c) noexcept {
  return {bits_of(c.codec), c.group};
}

/// Where a compressed copy's bytes are (Note [Compressed copies]).
struct Layout {
  std::uint64_t group = 0;  ///< the scheme's group size
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
  std::uint64_t groups_per_row = 0;
  std::uint64_t row_code_bytes = 0;
  std::uint64_t row_stride = 0;  ///< bytes a row: 4 a group, then its codes, padded to 4
  std::uint64_t bytes = 0;       ///< rows * row_stride
};

/// @throws strata::Error (invalid_argument) for a group of 0, an odd group with int4, or a
/// size that overflows.
Layout layout(const Scheme& scheme, std::uint64_t rows, std::uint64_t cols);
/// rows x cols of `shape`: cols its last dimension (1 for a scalar), rows the rest.
Layout layout(const Scheme& scheme, std::span<const std::int64_t> shape);

/// Whether `dtype` can be compressed (and is what a dequantized copy is): F32, BF16, F16.
bool compressible(DType dtype) noexcept;

/// Quantizes rows [row_begin, row_end) of `src` (the whole tensor, `dtype`) into `dst` (the whole
/// compressed copy, layout.bytes). Rows are independent: callers may split them over threads.
/// @throws strata::Error (invalid_argument) naming `tensor`, the row and the group for a value
/// that is not finite or beyond fp16's min and scale, or a dtype not compressible.
void quantize(const Scheme& scheme, const Layout& layout, DType dtype, const void* src, void* dst,
              std::string_view tensor, std::uint64_t row_begin, std::uint64_t row_end);
/// All rows.
void quantize(const Scheme& scheme, const Layout& layout, DType dtype, const void* src, void* dst,
              std::string_view tensor);

/// The dequantizer's variants: one loop compiled for AVX-512F, for AVX2 and for the x86-64
/// baseline; f16 output through F16C when the CPU has it. All give the same bits.
enum class Isa : std::uint8_t { avx512f, avx2, baseline };
Isa native_isa() noexcept;
bool supports(Isa isa) noexcept;
std::string_view to_string(Isa isa) noexcept;

/// Dequantizes rows [row_begin, row_end): `src` points at row row_begin's bytes, `out` at row
/// row_begin's first element of the output (`dtype`: F32, BF16 or F16). Single-threaded: the
/// caller splits rows over threads or chunks.
void dequantize(Bits bits, const Layout& layout, const void* src, DType dtype, void* out,
                std::uint64_t row_begin, std::uint64_t row_end);
/// The same with the variant forced (the tests run each).
/// @throws strata::Error (unsupported) when this CPU cannot run `isa`.
void dequantize(Bits bits, const Layout& layout, const void* src, DType dtype, void* out,
                std::uint64_t row_begin, std::uint64_t row_end, Isa isa);

}  // namespace strata::quant
