// CPU Adam: every kernel variant (each ISA, each f16 path) against the float64 reference of
// tests/optim/adam_reference.h within its error bound, and bit for bit against the library's
// scalar reference; the conversions; argument checks.
#include "strata/optim/adam.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "optim/adam_reference.h"
#include "strata/base/error.h"

namespace strata::optim {
namespace {

using testing::bf16_nearest_even;
using testing::bf16_value;
using testing::DoubleAdam;
using testing::f16_nearest_even;
using testing::f16_value;
using testing::Hyper;

struct Case {
  DType grad;
  bool adamw;
  double weight_decay;
  bool copy;
  DType copy_dtype;
};

std::string case_name(const Case& c) {
  return std::string(to_string(c.grad)) + (c.adamw ? "_AdamW" : "_Adam") +
         (c.weight_decay != 0.0 ? "_Decay" : "_NoDecay") +
         (c.copy ? "_Copy" + std::string(to_string(c.copy_dtype)) : "_NoCopy");
}

std::string variant_name(AdamVariant v) {
  return std::string(isa_name(v.isa)) + (v.f16 == F16Path::f16c ? "_F16C" : "_InLoop");
}

std::vector<AdamVariant> all_variants() {
  std::vector<AdamVariant> out;
  for (AdamIsa isa : {AdamIsa::avx512f, AdamIsa::avx2, AdamIsa::baseline})
    for (F16Path f16 : {F16Path::f16c, F16Path::in_loop})
      out.push_back({isa, f16});
  return out;
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (DType grad : {DType::F32, DType::BF16, DType::F16})
    for (bool adamw : {false, true})
      for (double wd : {0.0, 0.01}) {
        out.push_back({grad, adamw, wd, false, DType::BF16});
        out.push_back({grad, adamw, wd, true, DType::BF16});
        out.push_back({grad, adamw, wd, true, DType::F16});
      }
  return out;
}

// The fp32 state one kernel updates.
struct State {
  std::vector<float> p, m, v;
  std::vector<std::uint16_t> copy;
};

struct Grads {
  std::vector<float> f32;
  std::vector<std::uint16_t> half;  // bf16 or f16 bits
  std::vector<double> exact;        // what the kernel should read, widened exactly
};

// Normal gradients over six decades (and some zeros), rounded to the dtype by the test's own
// conversions.
Grads make_grads(std::size_t n, DType dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> decade(-4, 1);
  Grads g;
  g.f32.resize(n);
  g.half.resize(n);
  g.exact.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = i % 97 == 5 ? 0.0f : normal(rng) * std::pow(10.0f, decade(rng));
    if (dtype == DType::F32) {
      g.f32[i] = x;
      g.exact[i] = x;
    } else if (dtype == DType::BF16) {
      g.half[i] = bf16_nearest_even(x);
      g.exact[i] = bf16_value(g.half[i]);
    } else {
      g.half[i] = f16_nearest_even(x);
      g.exact[i] = f16_value(g.half[i]);
    }
  }
  return g;
}

AdamArgs args_for(State& s, const Grads& g, const Case& c, std::uint64_t step) {
  AdamArgs a;
  a.params = s.p.data();
  a.exp_avg = s.m.data();
  a.exp_avg_sq = s.v.data();
  a.grads = c.grad == DType::F32 ? static_cast<const void*>(g.f32.data()) : g.half.data();
  a.grad_dtype = c.grad;
  a.count = s.p.size();
  a.step = step;
  a.param_copy = c.copy ? s.copy.data() : nullptr;
  a.copy_dtype = c.copy_dtype;
  return a;
}

// The first element whose bits differ, or -1.
template <typename T>
long first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<long>(i);
  return -1;
}

// The first element further from the float64 reference than its bound, or -1.
long first_outside(const std::vector<float>& got, const std::vector<double>& want,
                   const std::vector<double>& bound) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(static_cast<double>(got[i]) - want[i]) <= bound[i])) return static_cast<long>(i);
  return -1;
}

class AdamVariantTest : public ::testing::TestWithParam<std::tuple<AdamVariant, Case>> {};

// Sizes around the vector widths (4, 8, 16 floats), the F16C block (1024) and the oneTBB chunk.
constexpr std::size_t kSizes[] = {1,
                                  3,
                                  4,
                                  7,
                                  8,
                                  9,
                                  15,
                                  16,
                                  17,
                                  31,
                                  33,
                                  63,
                                  65,
                                  1023,
                                  1025,
                                  4099,
                                  kAdamChunkElements + 13,
                                  2 * kAdamChunkElements + 7};
constexpr std::uint64_t kSteps = 5;

TEST_P(AdamVariantTest, MatchesFloat64ReferenceWithinBoundAndScalarReferenceBitForBit) {
  const auto [variant, c] = GetParam();
  if (!adam_supports(variant))
    GTEST_SKIP() << "this CPU cannot run the " << variant_name(variant)
                 << " variant: not tested here (adam_isa() is " << adam_isa() << ")";
  Hyper h;
  h.lr = 1e-2;
  h.weight_decay = c.weight_decay;
  h.decoupled = c.adamw;
  const AdamConfig cfg = h.config();
  for (std::size_t n : kSizes) {
    SCOPED_TRACE("count " + std::to_string(n));
    std::mt19937 rng(static_cast<unsigned>(n) * 7919u + static_cast<unsigned>(c.grad));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    State vec;
    for (std::size_t i = 0; i < n; ++i)
      vec.p.push_back(normal(rng));
    vec.m.assign(n, 0.0f);
    vec.v.assign(n, 0.0f);
    vec.copy.assign(n, 0);
    State scalar = vec;
    DoubleAdam exact(vec.p);
    for (std::uint64_t t = 1; t <= kSteps; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      const Grads g = make_grads(n, c.grad, rng);
      adam_step(cfg, args_for(vec, g, c, t), variant);
      adam_step_reference(cfg, args_for(scalar, g, c, t));
      exact.step(h, g.exact, t);

      long i = first_difference(vec.p, scalar.p);
      ASSERT_EQ(i, -1) << "params[" << i << "] " << vec.p[i] << " vs scalar " << scalar.p[i];
      i = first_difference(vec.m, scalar.m);
      ASSERT_EQ(i, -1) << "exp_avg[" << i << "] " << vec.m[i] << " vs scalar " << scalar.m[i];
      i = first_difference(vec.v, scalar.v);
      ASSERT_EQ(i, -1) << "exp_avg_sq[" << i << "] " << vec.v[i] << " vs scalar " << scalar.v[i];
      i = first_difference(vec.copy, scalar.copy);
      ASSERT_EQ(i, -1) << "param copy[" << i << "] " << vec.copy[i] << " vs " << scalar.copy[i];

      i = first_outside(vec.p, exact.params(), exact.params_bound());
      ASSERT_EQ(i, -1) << "params[" << i << "] " << vec.p[i] << ", float64 " << exact.params()[i]
                       << ", bound " << exact.params_bound()[i];
      i = first_outside(vec.m, exact.exp_avg(), exact.exp_avg_bound());
      ASSERT_EQ(i, -1) << "exp_avg[" << i << "] " << vec.m[i] << ", float64 " << exact.exp_avg()[i]
                       << ", bound " << exact.exp_avg_bound()[i];
      i = first_outside(vec.v, exact.exp_avg_sq(), exact.exp_avg_sq_bound());
      ASSERT_EQ(i, -1) << "exp_avg_sq[" << i << "] " << vec.v[i] << ", float64 "
                       << exact.exp_avg_sq()[i] << ", bound " << exact.exp_avg_sq_bound()[i];

      if (c.copy) {  // the updated fp32 params, rounded to nearest even by the test's own code
        for (std::size_t k = 0; k < n; ++k) {
          const std::uint16_t want = c.copy_dtype == DType::BF16 ? bf16_nearest_even(vec.p[k])
                                                                 : f16_nearest_even(vec.p[k]);
          ASSERT_EQ(vec.copy[k], want) << "param copy[" << k << "] of " << vec.p[k];
        }
      } else {
        ASSERT_EQ(vec.copy, std::vector<std::uint16_t>(n, 0)) << "no copy was asked for";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryVariant, AdamVariantTest,
                         ::testing::Combine(::testing::ValuesIn(all_variants()),
                                            ::testing::ValuesIn(all_cases())),
                         [](const ::testing::TestParamInfo<AdamVariantTest::ParamType>& param) {
                           return variant_name(std::get<0>(param.param)) + "_" +
                                  case_name(std::get<1>(param.param));
                         });

TEST(Adam, DefaultStepRunsTheNativeVariant) {
  const AdamVariant native = adam_native_variant();
  EXPECT_TRUE(adam_supports(native));
  EXPECT_EQ(adam_isa(), isa_name(native.isa));
  if (__builtin_cpu_supports("avx512f"))
    EXPECT_EQ(native.isa, AdamIsa::avx512f);
  else if (__builtin_cpu_supports("avx2"))
    EXPECT_EQ(native.isa, AdamIsa::avx2);
  else
    EXPECT_EQ(native.isa, AdamIsa::baseline);
  EXPECT_EQ(native.f16 == F16Path::f16c,
            __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"));
  EXPECT_TRUE(adam_supports({AdamIsa::baseline, F16Path::in_loop}));
}

TEST(Adam, RefusesAVariantThisCpuCannotRun) {
  float x[4] = {1, 2, 3, 4}, m[4] = {}, v[4] = {}, g[4] = {1, 1, 1, 1};
  AdamArgs a;
  a.params = x;
  a.exp_avg = m;
  a.exp_avg_sq = v;
  a.grads = g;
  a.count = 4;
  int refused = 0;
  for (AdamVariant variant : all_variants()) {
    if (adam_supports(variant)) continue;
    ++refused;
    try {
      adam_step({}, a, variant);
      ADD_FAILURE() << variant_name(variant) << " ran on a CPU that cannot run it";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::unsupported) << e.what();
    }
    EXPECT_EQ(x[0], 1.0f) << "nothing is written when the variant is refused";
  }
  if (refused == 0) GTEST_SKIP() << "this CPU runs every variant: nothing to refuse";
}

TEST(Adam, ConversionsRoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f16_to_float(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_float(float_to_f16(65504.0f)), 65504.0f);
  EXPECT_EQ(float_to_f16(1e6f), 0x7C00);                   // overflow: inf
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  for (std::uint32_t h = 0; h < 0x7C00; ++h)  // every finite f16 round-trips
    ASSERT_EQ(float_to_f16(f16_to_float(static_cast<std::uint16_t>(h))), h) << h;
}

TEST(Adam, ConversionsAgreeWithIndependentRounding) {
  // The library's conversions against the test's (neighbour distance for bf16, the compiler's
  // _Float16 for f16) on floats around every rounding case and on random finite floats.
  std::uint32_t seed = 777;
  for (int k = 0; k < 2000000; ++k) {
    seed = seed * 1664525u + 1013904223u;
    std::uint32_t bits = seed;
    if (k % 2 == 0) bits = (bits & 0xFFFF0000u) | (0x8000u + (seed >> 28) - 8u);  // near halfway
    const float f = std::bit_cast<float>(bits);
    if (!std::isfinite(f) || std::abs(f) > 3e38f) continue;
    ASSERT_EQ(float_to_bf16(f), bf16_nearest_even(f)) << std::hex << bits;
    ASSERT_EQ(float_to_f16(f), f16_nearest_even(f)) << std::hex << bits;
  }
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0) continue;  // NaN
    ASSERT_EQ(static_cast<double>(f16_to_float(x)), f16_value(x)) << std::hex << h;
  }
}

// The F16C instructions the f16 paths use (Note [f16 through F16C]) agree with the software
// conversions on every f16 value (NaNs included) and on floats around every rounding case.
__attribute__((target("avx,f16c"))) void hardware_f16(const std::uint16_t* h, float* f,
                                                      const float* in, std::uint16_t* out) {
  _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm256_cvtps_ph(_mm256_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT));
}

TEST(Adam, F16CAgreesWithTheSoftwareConversions) {
  if (!__builtin_cpu_supports("f16c") || !__builtin_cpu_supports("avx"))
    GTEST_SKIP() << "this CPU has no F16C: the f16 paths use the software conversions only";
  std::uint32_t seed = 12345;
  for (std::uint32_t base = 0; base < 0x10000; base += 8) {
    std::uint16_t h[8];
    float in[8], f[8];
    std::uint16_t out[8];
    for (int k = 0; k < 8; ++k) {
      h[k] = static_cast<std::uint16_t>(base + k);
      seed = seed * 1664525u + 1013904223u;
      // Floats near f16 values (halfway cases, subnormals, overflow) and random bit patterns.
      const std::uint32_t bits = (k % 2 == 0) ? std::bit_cast<std::uint32_t>(f16_to_float(h[k])) +
                                                    ((seed >> 20) & 0x1FFFu) - 0x1000u
                                              : seed;
      in[k] = std::bit_cast<float>(bits);
    }
    hardware_f16(h, f, in, out);
    for (int k = 0; k < 8; ++k) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(f16_to_float(h[k])),
                std::bit_cast<std::uint32_t>(f[k]))
          << std::hex << h[k];
      ASSERT_EQ(float_to_f16(in[k]), out[k]) << std::hex << std::bit_cast<std::uint32_t>(in[k]);
    }
  }
}

// 16-bit params (no master copy): the step equals the fp32 scalar reference on the widened
// values, rounded to nearest even by the test's own rounding, bit for bit, for every variant,
// param dtype, moment dtype and gradient dtype. 3000 elements cross the 1024-element blocks.
TEST(Adam, SixteenBitParamsEqualTheFp32StepRounded) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t n = 3000;
  for (AdamVariant variant : all_variants()) {
    if (!adam_supports(variant)) continue;
    for (DType pd : {DType::BF16, DType::F16})
      for (DType sd : {DType::F32, DType::BF16, DType::F16})
        for (DType gd : {DType::F32, DType::BF16, DType::F16}) {
          SCOPED_TRACE(variant_name(variant) + " params " + std::string(to_string(pd)) +
                       " moments " + std::string(to_string(sd)) + " grads " +
                       std::string(to_string(gd)));
          const auto round16 = [&](float f, DType d) {
            return d == DType::BF16 ? bf16_nearest_even(f) : f16_nearest_even(f);
          };
          const auto value16 = [&](std::uint16_t h, DType d) {
            return static_cast<float>(d == DType::BF16 ? bf16_value(h) : f16_value(h));
          };
          std::vector<std::uint16_t> p16(n), m16(n), v16(n), g16(n);
          std::vector<float> p32(n), m32(n), v32(n), g32(n);
          for (std::size_t i = 0; i < n; ++i) {
            p16[i] = round16(normal(rng), pd);
            p32[i] = value16(p16[i], pd);
            const float m = 0.1f * normal(rng), v = 0.01f * std::abs(normal(rng));
            m32[i] = sd == DType::F32 ? m : value16(m16[i] = round16(m, sd), sd);
            v32[i] = sd == DType::F32 ? v : value16(v16[i] = round16(v, sd), sd);
            const float g = normal(rng);
            g32[i] = gd == DType::F32 ? g : value16(g16[i] = round16(g, gd), gd);
          }
          std::vector<float> ms = m32, vs = v32;  // the moments the 16-bit step uses when f32
          Adam16Args a;
          a.params = p16.data();
          a.param_dtype = pd;
          a.exp_avg = sd == DType::F32 ? static_cast<void*>(ms.data()) : m16.data();
          a.exp_avg_sq = sd == DType::F32 ? static_cast<void*>(vs.data()) : v16.data();
          a.state_dtype = sd;
          a.grads = gd == DType::F32 ? static_cast<const void*>(g32.data()) : g16.data();
          a.grad_dtype = gd;
          a.count = n;
          a.step = 3;
          const AdamConfig cfg{1e-2, 0.9, 0.999, 1e-8, 0.01, true};
          adam_step(cfg, a, variant);
          AdamArgs r;
          r.params = p32.data();
          r.exp_avg = m32.data();
          r.exp_avg_sq = v32.data();
          r.grads = g32.data();
          r.count = n;
          r.step = 3;
          adam_step_reference(cfg, r);
          for (std::size_t i = 0; i < n; ++i) {
            ASSERT_EQ(p16[i], round16(p32[i], pd)) << i;
            if (sd == DType::F32) {
              ASSERT_EQ(std::bit_cast<std::uint32_t>(ms[i]), std::bit_cast<std::uint32_t>(m32[i]));
              ASSERT_EQ(std::bit_cast<std::uint32_t>(vs[i]), std::bit_cast<std::uint32_t>(v32[i]));
            } else {
              ASSERT_EQ(m16[i], round16(m32[i], sd)) << i;
              ASSERT_EQ(v16[i], round16(v32[i], sd)) << i;
            }
          }
        }
  }
}

TEST(Adam, SixteenBitParamsRejectOtherDtypes) {
  std::uint16_t x[4] = {};
  Adam16Args a;
  a.params = a.exp_avg = a.exp_avg_sq = x;
  a.grads = x;
  a.count = 4;
  a.param_dtype = DType::F32;
  EXPECT_THROW(adam_step({}, a), Error);
  a.param_dtype = DType::BF16;
  a.state_dtype = DType::I32;
  EXPECT_THROW(adam_step({}, a), Error);
  a.state_dtype = DType::BF16;
  a.step = 0;
  EXPECT_THROW(adam_step({}, a), Error);
}

TEST(Adam, RejectsBadArguments) {
  AdamArgs a;
  a.count = 4;
  EXPECT_THROW(adam_step({}, a), Error);
  float x[4] = {};
  a.params = a.exp_avg = a.exp_avg_sq = x;
  a.grads = x;
  a.step = 0;
  EXPECT_THROW(adam_step({}, a), Error);
  a.step = 1;
  a.grad_dtype = DType::I32;
  EXPECT_THROW(adam_step({}, a), Error);
  a.grad_dtype = DType::F32;
  a.param_copy = x;
  a.copy_dtype = DType::F32;
  EXPECT_THROW(adam_step({}, a), Error);
  EXPECT_FALSE(adam_isa().empty());
}

}  // namespace
}  // namespace strata::optim
