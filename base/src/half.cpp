// f16 blocks through the F16C instructions (Note [f16 through F16C] in strata/base/half.h): the
// only code of base built for a target beyond the x86-64 baseline, called only when has_f16c().
#include "strata/base/half.h"

#include <immintrin.h>

namespace strata {

bool has_f16c() noexcept {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}

__attribute__((target("avx,f16c"))) void f16_to_f32_block(const std::uint16_t* src, float* dst,
                                                          std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i)
    dst[i] = f16_to_float(src[i]);
}

__attribute__((target("avx,f16c"))) void f32_to_f16_block(const float* src, std::uint16_t* dst,
                                                          std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(dst + i),
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i)
    dst[i] = float_to_f16(src[i]);
}

}  // namespace strata
