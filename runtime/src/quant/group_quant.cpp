// Group-wise int8/int4 quantization (Note [Compressed copies] in strata/quant/group_quant.h):
// the layout, the quantizer (scalar, in double, run once) and the dequantizer, one loop
// compiled for AVX-512F, AVX2 and the x86-64 baseline as the CPU Adam is (Note [Adam kernel
// dispatch]), f16 output through F16C (Note [f16 through F16C]); this file is compiled with
// -ffp-contract=off so every variant rounds alike.
#include "strata/quant/group_quant.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "strata/base/error.h"
#include "strata/base/half.h"

namespace strata::quant {

std::string_view to_string(Bits bits) noexcept {
  return bits == Bits::Int4 ? "int4" : "int8";
}

Bits parse_bits(std::string_view text, std::string_view key) {
  if (text == "int8") return Bits::Int8;
  if (text == "int4") return Bits::Int4;
  STRATA_FAIL(Errc::invalid_argument, key, ": \"", text, "\" is not a compression (int8 or int4)");
}

bool compressible(DType dtype) noexcept {
  return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16;
}

Layout layout(const Scheme& scheme, std::uint64_t rows, std::uint64_t cols) {
  STRATA_EXPECTS(scheme.group >= 1, "compression group size must be at least 1");
  STRATA_EXPECTS(scheme.bits != Bits::Int4 || scheme.group % 2 == 0,
                 "int4 compression needs an even group size (two codes a byte), got ",
                 scheme.group);
  STRATA_EXPECTS(cols >= 1 || rows == 0, "a compressed tensor's rows need at least one element");
  Layout l;
  l.group = scheme.group;
  l.rows = rows;
  l.cols = cols;
  l.groups_per_row = (cols + scheme.group - 1) / scheme.group;
  l.row_code_bytes = scheme.bits == Bits::Int8 ? cols : (cols + 1) / 2;
  l.row_stride = (4 * l.groups_per_row + l.row_code_bytes + 3) / 4 * 4;
  STRATA_EXPECTS(rows == 0 || l.row_stride <= std::numeric_limits<std::uint64_t>::max() / rows,
                 "a compressed tensor of ", rows, " rows of ", cols, " elements is too large");
  l.bytes = rows * l.row_stride;
  return l;
}

Layout layout(const Scheme& scheme, std::span<const std::int64_t> shape) {
  std::uint64_t rows = 1, cols = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    STRATA_EXPECTS(shape[i] >= 0, "a negative dimension (", shape[i], ")");
    if (i + 1 == shape.size())
      cols = static_cast<std::uint64_t>(shape[i]);
    else
      rows *= static_cast<std::uint64_t>(shape[i]);
  }
  if (cols == 0) rows = 0;
  return layout(scheme, rows, cols);
}

// ---- quantize ---------------------------------------------------------------------------------

namespace {

constexpr std::uint16_t kF16Inf = 0x7C00;

// The next f16 toward +inf / -inf of a finite one (bit patterns: sign-magnitude).
std::uint16_t f16_up(std::uint16_t h) {
  if (h == 0x8000) return 0x0001;  // -0 -> smallest positive
  return (h & 0x8000) ? static_cast<std::uint16_t>(h - 1) : static_cast<std::uint16_t>(h + 1);
}
std::uint16_t f16_down(std::uint16_t h) {
  if (h == 0x0000) return 0x8001;  // +0 -> smallest negative
  return (h & 0x8000) ? static_cast<std::uint16_t>(h + 1) : static_cast<std::uint16_t>(h - 1);
}
bool f16_finite(std::uint16_t h) {
  return (h & 0x7C00) != kF16Inf;
}

// The largest f16 <= x (x finite; may come out -inf).
std::uint16_t f16_floor(double x) {
  std::uint16_t h = float_to_f16(static_cast<float>(x));
  while (f16_finite(h) && f16_to_float(h) > x)
    h = f16_down(h);
  while (f16_finite(h) && f16_finite(f16_up(h)) && f16_to_float(f16_up(h)) <= x)
    h = f16_up(h);
  return h;
}
// The smallest f16 >= x (x finite, >= 0; may come out +inf).
std::uint16_t f16_ceil(double x) {
  std::uint16_t h = float_to_f16(static_cast<float>(x));
  while (f16_finite(h) && f16_to_float(h) < x)
    h = f16_up(h);
  while (f16_finite(h) && f16_finite(f16_down(h)) && f16_to_float(f16_down(h)) >= x && h != 0x0000)
    h = f16_down(h);
  return h == 0x8000 ? 0x0000 : h;
}

float load(DType dtype, const void* src, std::uint64_t i) {
  switch (dtype) {
    case DType::F32:
      return static_cast<const float*>(src)[i];
    case DType::BF16:
      return bf16_to_float(static_cast<const std::uint16_t*>(src)[i]);
    default:
      return f16_to_float(static_cast<const std::uint16_t*>(src)[i]);
  }
}

}  // namespace

void quantize(const Scheme& scheme, const Layout& l, DType dtype, const void* src, void* dst,
              std::string_view tensor, std::uint64_t row_begin, std::uint64_t row_end) {
  STRATA_EXPECTS(compressible(dtype), "tensor '", tensor, "': ", to_string(dtype),
                 " cannot be compressed (only f32, bf16 and f16 can)");
  STRATA_EXPECTS(row_begin <= row_end && row_end <= l.rows, "tensor '", tensor, "': rows [",
                 row_begin, ", ", row_end, ") outside its ", l.rows);
  const double levels = scheme.bits == Bits::Int8 ? 255.0 : 15.0;
  const bool int4 = scheme.bits == Bits::Int4;
  auto* out = static_cast<std::uint8_t*>(dst);
  for (std::uint64_t r = row_begin; r < row_end; ++r) {
    std::uint8_t* row = out + r * l.row_stride;
    std::uint8_t* codes = row + 4 * l.groups_per_row;
    std::memset(row, 0, l.row_stride);
    for (std::uint64_t g = 0; g < l.groups_per_row; ++g) {
      const std::uint64_t lo_col = g * scheme.group;
      const std::uint64_t n = std::min<std::uint64_t>(scheme.group, l.cols - lo_col);
      const std::uint64_t base = r * l.cols + lo_col;
      double lo = std::numeric_limits<double>::infinity(), hi = -lo;
      for (std::uint64_t i = 0; i < n; ++i) {
        const double x = load(dtype, src, base + i);
        if (!std::isfinite(x))
          STRATA_FAIL(Errc::invalid_argument, "tensor '", tensor, "': element ", lo_col + i,
                      " of row ", r, " is ", x, "; only finite values can be compressed");
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      const std::uint16_t m16 = f16_floor(lo);
      const double m = f16_to_float(m16);
      const std::uint16_t s16 = f16_finite(m16) ? f16_ceil((hi - m) / levels) : kF16Inf;
      if (!f16_finite(m16) || !f16_finite(s16))
        STRATA_FAIL(Errc::invalid_argument, "tensor '", tensor, "': row ", r, " group ", g,
                    " spans [", lo, ", ", hi, "], beyond what an fp16 min and scale hold (",
                    to_string(scheme.bits),
                    "); keep this tensor full width (leave it out of the compress rule)");
      const double s = f16_to_float(s16);
      std::memcpy(row + 4 * g, &m16, 2);
      std::memcpy(row + 4 * g + 2, &s16, 2);
      for (std::uint64_t i = 0; i < n; ++i) {
        double q = 0.0;
        if (s > 0.0)
          q = std::clamp(std::nearbyint((static_cast<double>(load(dtype, src, base + i)) - m) / s),
                         0.0, levels);
        // An f16 tensor's values come back as f16: a code whose value rounds past 65504 (a
        // group reaching fp16's limit, its step rounded up) takes the one below.
        if (dtype == DType::F16)
          while (q > 0.0 && float_to_f16(static_cast<float>(q) * static_cast<float>(s) +
                                         static_cast<float>(m)) == 0x7C00u)
            q -= 1.0;
        const auto code = static_cast<std::uint8_t>(q);
        const std::uint64_t c = lo_col + i;
        if (int4)
          codes[c / 2] |= static_cast<std::uint8_t>(code << (4 * (c & 1)));
        else
          codes[c] = code;
      }
    }
  }
}

void quantize(const Scheme& scheme, const Layout& l, DType dtype, const void* src, void* dst,
              std::string_view tensor) {
  quantize(scheme, l, dtype, src, dst, tensor, 0, l.rows);
}

// ---- dequantize -------------------------------------------------------------------------------

namespace {

// Note [Dequantizing a row in chunks]: a row goes kChunk elements at a time (whole groups when
// the group is shorter). A chunk's group headers (m and s, fp16) widen in one pass (F16C when the
// CPU has it) and its int4 codes unpack in one pass; then each group's run of codes widens with
// its s and m. Converting two halves and unpacking a group at a time cost int4 -> 16-bit about
// half its speed (a group of 64 is 128 output bytes). The AVX-512F and AVX2 variants run each
// group with intrinsics, 16 or 8 codes at a time, straight into the output dtype: GCC
// vectorises the plain loop with 128- and 256-bit registers only, and a bf16 loop fused with
// the widening ran at half the speed of fp32. They compute what the plain loops do (convert,
// multiply, add; no FMA; bf16 by the same integer rounding, f16 by vcvtps2ph), so every variant
// gives the same bits. The baseline widens into fp32 and narrows once a chunk.
constexpr std::uint64_t kChunk = 1024;  // elements; even, so int4 chunks start on a byte

// Codes of `n` (even, or the row's end) int4 elements from `packed` into one byte each.
// SSE2 (the x86-64 baseline): 16 bytes -> 32 codes in order (low nibble first).
inline void unpack_int4(const std::uint8_t* packed, std::uint8_t* codes, std::uint64_t n) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  std::uint64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + i / 2));
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i + 16), _mm_unpackhi_epi8(lo, hi));
  }
  for (; i < n; ++i)
    codes[i] = (packed[i / 2] >> (4 * (i & 1))) & 0x0F;
}

// float_to_bf16 without its NaN case: q s + m is finite (m and s are finite fp16, q <= 255).
inline std::uint16_t round_bf16(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  return static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The plain loops: one group's run of codes with its s and m; a chunk's fp32 values to bf16.
inline void block_f32(const std::uint8_t* __restrict c, float s, float m, float* __restrict out,
                      std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(c[i]) * s + m;
}
inline void narrow_bf16(const float* __restrict wide, std::uint16_t* __restrict out,
                        std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i)
    out[i] = round_bf16(wide[i]);
}

enum class Out : std::uint8_t { f32, bf16, f16 };

// Elements [i, n) of one group's run, one at a time: the SIMD loops' remainder.
template <Out O>
inline void group_tail(const std::uint8_t* c, float s, float m, void* out, std::uint64_t i,
                       std::uint64_t n) {
  for (; i < n; ++i) {
    const float x = static_cast<float>(c[i]) * s + m;
    if constexpr (O == Out::f32)
      static_cast<float*>(out)[i] = x;
    else if constexpr (O == Out::bf16)
      static_cast<std::uint16_t*>(out)[i] = round_bf16(x);
    else
      static_cast<std::uint16_t*>(out)[i] = float_to_f16(x);
  }
}

// One group's run into `out` (f32, bf16 or f16 elements), 16 at a time.
template <Out O>
__attribute__((target("avx512f"))) inline void group_avx512f(const std::uint8_t* __restrict c,
                                                             float s, float m, void* out,
                                                             std::uint64_t n) {
  const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
  auto* o16 = static_cast<std::uint16_t*>(out);
  auto* o32 = static_cast<float*>(out);
  std::uint64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i q =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
    const __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), vs), vm);
    if constexpr (O == Out::f32) {
      _mm512_storeu_ps(o32 + i, x);
    } else if constexpr (O == Out::bf16) {
      const __m512i b = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
      const __m512i r = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o16 + i), _mm512_cvtepi32_epi16(r));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o16 + i),
                          _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  group_tail<O>(c, s, m, out, i, n);
}

// As group_avx512f, 8 at a time, into f32 or bf16 (f16 needs F16C: the caller narrows).
template <Out O>
__attribute__((target("avx2"))) inline void group_avx2(const std::uint8_t* __restrict c, float s,
                                                       float m, void* out, std::uint64_t n) {
  static_assert(O != Out::f16);
  const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
  auto* o16 = static_cast<std::uint16_t*>(out);
  auto* o32 = static_cast<float*>(out);
  std::uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i q =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
    const __m256 x = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), vs), vm);
    if constexpr (O == Out::f32) {
      _mm256_storeu_ps(o32 + i, x);
    } else {
      const __m256i b = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
      const __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
      // Pack to 16 bits (every value fits: no saturation), lanes back in order.
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o16 + i), _mm256_castsi256_si128(p));
    }
  }
  group_tail<O>(c, s, m, out, i, n);
}

struct Job {
  bool int4;
  std::uint64_t group;
  const Layout* l;
  const std::uint8_t* src;
  DType dtype;
  void* out;
  std::uint64_t rows;
};

template <Isa V, Out O>
inline void dequantize_body(const Job& j) {
  alignas(64) std::uint8_t codes[kChunk];
  alignas(64) float wide[kChunk];
  alignas(64) std::uint16_t heads[2 * (kChunk + 1)];  // m, s of the groups a chunk touches
  alignas(64) float ms[2 * (kChunk + 1)];             // (at most n + 1 of them), widened
  const Layout& l = *j.l;
  const bool f16c = has_f16c();
  const std::uint64_t group = j.group;
  constexpr std::size_t elem = O == Out::f32 ? 4 : 2;
  // The variants that write the output dtype group by group; the others widen into `wide`.
  constexpr bool direct = O == Out::f32 || V == Isa::avx512f || (V == Isa::avx2 && O == Out::bf16);
  // Whole groups a chunk when they fit, so a chunk's runs are whole groups but at the row's end.
  const std::uint64_t chunk = group <= kChunk ? kChunk / group * group : kChunk;
  for (std::uint64_t r = 0; r < j.rows; ++r) {
    const std::uint8_t* row = j.src + r * l.row_stride;
    const std::uint8_t* packed = row + 4 * l.groups_per_row;
    const std::uint64_t out_row = r * l.cols;
    for (std::uint64_t c0 = 0; c0 < l.cols; c0 += chunk) {
      const std::uint64_t n = std::min(chunk, l.cols - c0);
      const std::uint64_t g0 = c0 / group, g_n = (c0 + n - 1) / group - g0 + 1;
      std::memcpy(heads, row + 4 * g0, 4 * g_n);  // the caller's bytes may be at any address
      if (f16c) {
        f16_to_f32_block(heads, ms, 2 * g_n);
      } else {
        for (std::uint64_t i = 0; i < 2 * g_n; ++i)
          ms[i] = f16_to_float(heads[i]);
      }
      const std::uint8_t* c = packed + c0;
      if (j.int4) {  // c0 is even (chunk is even, or a multiple of an even group)
        unpack_int4(packed + c0 / 2, codes, n);
        c = codes;
      }
      std::byte* out = static_cast<std::byte*>(j.out) + (out_row + c0) * elem;
      for (std::uint64_t i = 0, g = 0; i < n; ++g) {
        const std::uint64_t end = std::min(n, (g0 + g + 1) * group - c0);
        const float m = ms[2 * g], s = ms[2 * g + 1];
        if constexpr (V == Isa::avx512f)
          group_avx512f<O>(c + i, s, m, out + i * elem, end - i);
        else if constexpr (V == Isa::avx2 && direct)
          group_avx2<O>(c + i, s, m, out + i * elem, end - i);
        else if constexpr (direct)
          block_f32(c + i, s, m, reinterpret_cast<float*>(out) + i, end - i);
        else
          block_f32(c + i, s, m, wide + i, end - i);
        i = end;
      }
      if constexpr (!direct) {
        auto* o = reinterpret_cast<std::uint16_t*>(out);
        if constexpr (O == Out::bf16) {
          narrow_bf16(wide, o, n);
        } else if (f16c) {
          f32_to_f16_block(wide, o, n);
        } else {
          for (std::uint64_t i = 0; i < n; ++i)
            o[i] = float_to_f16(wide[i]);
        }
      }
    }
  }
}

template <Isa V>
inline void dequantize_as(const Job& j) {
  if (j.dtype == DType::F32)
    dequantize_body<V, Out::f32>(j);
  else if (j.dtype == DType::BF16)
    dequantize_body<V, Out::bf16>(j);
  else
    dequantize_body<V, Out::f16>(j);
}

__attribute__((target("avx512f"), flatten)) void dequantize_avx512f(const Job& j) {
  dequantize_as<Isa::avx512f>(j);
}
__attribute__((target("avx2"), flatten)) void dequantize_avx2(const Job& j) {
  dequantize_as<Isa::avx2>(j);
}
__attribute__((flatten)) void dequantize_baseline(const Job& j) {
  dequantize_as<Isa::baseline>(j);
}

}  // namespace

// The widest variant the CPU runs, unless STRATA_QUANT_ISA names a narrower one that it runs
// (the tests load a model once per variant and compare the outputs bit for bit).
Isa native_isa() noexcept {
  static const Isa isa = [] {
    const Isa widest = __builtin_cpu_supports("avx512f") ? Isa::avx512f
                       : __builtin_cpu_supports("avx2")  ? Isa::avx2
                                                         : Isa::baseline;
    const char* forced = std::getenv("STRATA_QUANT_ISA");
    if (forced == nullptr) return widest;
    for (Isa v : {Isa::baseline, Isa::avx2, Isa::avx512f})
      if (to_string(v) == forced && supports(v)) return v;
    return widest;
  }();
  return isa;
}

bool supports(Isa isa) noexcept {
  return isa == Isa::baseline || (isa == Isa::avx2 && __builtin_cpu_supports("avx2")) ||
         (isa == Isa::avx512f && __builtin_cpu_supports("avx512f"));
}

std::string_view to_string(Isa isa) noexcept {
  switch (isa) {
    case Isa::avx512f:
      return "avx512f";
    case Isa::avx2:
      return "avx2";
    case Isa::baseline:
      break;
  }
  return "baseline";
}

void dequantize(Bits bits, const Layout& l, const void* src, DType dtype, void* out,
                std::uint64_t row_begin, std::uint64_t row_end) {
  dequantize(bits, l, src, dtype, out, row_begin, row_end, native_isa());
}

void dequantize(Bits bits, const Layout& l, const void* src, DType dtype, void* out,
                std::uint64_t row_begin, std::uint64_t row_end, Isa isa) {
  STRATA_EXPECTS(compressible(dtype), "dequantize: ", to_string(dtype),
                 " is not an output dtype (f32, bf16 or f16)");
  STRATA_EXPECTS(row_begin <= row_end && row_end <= l.rows, "dequantize: rows [", row_begin, ", ",
                 row_end, ") outside ", l.rows);
  if (!supports(isa))
    STRATA_FAIL(Errc::unsupported, "dequantize: this CPU cannot run the ", to_string(isa),
                " variant");
  if (row_begin == row_end) return;
  STRATA_EXPECTS(src && out, "dequantize: a null buffer");
  const Job job{bits == Bits::Int4, l.group, &l, static_cast<const std::uint8_t*>(src), dtype, out,
                row_end - row_begin};
  switch (isa) {
    case Isa::avx512f:
      return dequantize_avx512f(job);
    case Isa::avx2:
      return dequantize_avx2(job);
    case Isa::baseline:
      return dequantize_baseline(job);
  }
}

}  // namespace strata::quant
