#include "strata/optim/adam.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <bit>

#include <cmath>
#include <random>
#include <vector>

#include "strata/io/error.h"

namespace strata::optim {
namespace {

struct State {
  std::vector<float> p, m, v;
  std::vector<float> g32;
  std::vector<std::uint16_t> g16, copy;
};

State make_state(std::size_t n, DType grad, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  for (std::size_t i = 0; i < n; ++i) {
    s.p.push_back(normal(rng));
    s.m.push_back(0.1f * normal(rng));
    s.v.push_back(std::abs(0.01f * normal(rng)));
    const float g = normal(rng);
    s.g32.push_back(g);
    s.g16.push_back(grad == DType::BF16 ? float_to_bf16(g) : float_to_f16(g));
  }
  s.copy.assign(n, 0);
  return s;
}

AdamArgs args_for(State& s, DType grad, bool copy, DType copy_dtype, std::uint64_t step) {
  AdamArgs a;
  a.params = s.p.data();
  a.exp_avg = s.m.data();
  a.exp_avg_sq = s.v.data();
  a.grads = grad == DType::F32 ? static_cast<const void*>(s.g32.data()) : s.g16.data();
  a.grad_dtype = grad;
  a.count = s.p.size();
  a.step = step;
  a.param_copy = copy ? s.copy.data() : nullptr;
  a.copy_dtype = copy_dtype;
  return a;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float tol = 1e-6f * std::max(std::abs(want[i]), 1e-30f);
    ASSERT_LE(std::abs(got[i] - want[i]), tol) << what << "[" << i << "]";
  }
}

struct Case {
  DType grad;
  bool adamw;
  bool copy;
  DType copy_dtype;
};

class AdamTest : public ::testing::TestWithParam<Case> {};

TEST_P(AdamTest, MatchesTheScalarReferenceOnEveryElement) {
  const Case c = GetParam();
  AdamConfig cfg;
  cfg.lr = 3e-3f;
  cfg.weight_decay = 0.01f;
  cfg.decoupled_weight_decay = c.adamw;
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{1023}, std::size_t{100003}}) {
    State vec = make_state(n, c.grad, static_cast<unsigned>(n));
    State ref = vec;
    for (std::uint64_t step = 1; step <= 3; ++step) {
      adam_step(cfg, args_for(vec, c.grad, c.copy, c.copy_dtype, step));
      adam_step_reference(cfg, args_for(ref, c.grad, c.copy, c.copy_dtype, step));
    }
    expect_close(vec.p, ref.p, "params");
    expect_close(vec.m, ref.m, "exp_avg");
    expect_close(vec.v, ref.v, "exp_avg_sq");
    if (c.copy) {
      EXPECT_EQ(vec.copy, ref.copy);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AdamTest,
                         ::testing::Values(Case{DType::F32, false, false, DType::BF16},
                                           Case{DType::F32, true, true, DType::BF16},
                                           Case{DType::BF16, false, true, DType::F16},
                                           Case{DType::BF16, true, false, DType::BF16},
                                           Case{DType::F16, false, false, DType::BF16},
                                           Case{DType::F16, true, true, DType::F16}));

TEST(Adam, ReferenceFollowsTorchsFormula) {
  // One element, one step, by hand: torch.optim.Adam(lr=0.1, weight_decay=0.5).
  float p = 1.0f, m = 0.0f, v = 0.0f, g = 0.2f;
  AdamConfig cfg;
  cfg.lr = 0.1f;
  cfg.weight_decay = 0.5f;
  AdamArgs a;
  a.params = &p;
  a.exp_avg = &m;
  a.exp_avg_sq = &v;
  a.grads = &g;
  a.count = 1;
  adam_step_reference(cfg, a);
  // In fp32 as torch computes it: (1 - beta) in float, bias corrections 1 - beta^1.
  const double b1 = 0.9f, b2 = 0.999f;
  const double gg = 0.2 + 0.5 * 1.0;  // L2 decay joins the gradient
  const double mm = static_cast<float>(1.0f - 0.9f) * gg;
  const double vv = static_cast<float>(1.0f - 0.999f) * gg * gg;
  const double expect = 1.0 - (0.1 / (1 - b1)) * mm / (std::sqrt(vv) / std::sqrt(1 - b2) + 1e-8);
  EXPECT_NEAR(p, expect, 1e-5);
  EXPECT_NEAR(m, mm, 1e-6 * mm);
  EXPECT_NEAR(v, vv, 1e-6 * vv);
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
  EXPECT_FALSE(adam_isa().empty());
}

}  // namespace
}  // namespace strata::optim
