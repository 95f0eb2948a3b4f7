// CPU Adam's precision against a float64 Adam: the step's constants (1 - beta1, 1 - beta2, the
// bias corrections, the step size, 1 - lr * weight_decay) must be computed in double and rounded
// to fp32 once, as PyTorch does, or the moments drift from the exact trajectory by the error of
// the constant (1.0f - 0.999f is 0.00099998713: 1.3e-5 relative) on every element.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "optim/adam_reference.h"
#include "strata/optim/adam.h"

namespace strata::optim {
namespace {

using testing::DoubleAdam;
using testing::Hyper;
using testing::kUnitRoundoff;

TEST(AdamPrecision, SecondMomentStaysWithinFp32RoundingOfTheFloat64Trajectory) {
  constexpr std::size_t kCount = std::size_t{1} << 20;
  constexpr std::uint64_t kSteps = 10;
  Hyper h;  // torch.optim.AdamW's defaults but the learning rate
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  h.decoupled = true;

  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(kCount), m(kCount, 0.0f), v(kCount, 0.0f), g(kCount);
  for (float& x : p)
    x = normal(rng);
  DoubleAdam ref(p);
  std::vector<double> g64(kCount);
  for (std::uint64_t t = 1; t <= kSteps; ++t) {
    for (std::size_t i = 0; i < kCount; ++i)
      g64[i] = g[i] = normal(rng);
    AdamArgs a;
    a.params = p.data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.grads = g.data();
    a.count = kCount;
    a.step = t;
    adam_step(h.config(), a);
    ref.step(h, g64, t);
  }

  // With f32 gradients and decoupled decay, each step rounds v four times along each path
  // (beta2 and the product; 1 - beta2 and two products; then the sum), and the error carried in
  // is scaled by beta2 < 1, so |v - v64| <= 4 t u v64 (Note [Adam error bound]): 2.4e-6 after
  // 10 steps. 1 - beta2 computed in fp32 alone puts every element 1.3e-5 away.
  const double bound = 4.0 * static_cast<double>(kSteps) * kUnitRoundoff;
  double worst_v = 0.0, sum_sq_v = 0.0, worst_m = 0.0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < kCount; ++i) {
    const double rel = std::abs(v[i] - ref.exp_avg_sq()[i]) / ref.exp_avg_sq()[i];
    sum_sq_v += rel * rel;
    if (rel > worst_v) {
      worst_v = rel;
      worst_at = i;
    }
    // m may cancel to near zero: it is checked against its bound, not relative to itself.
    worst_m = std::max(worst_m, std::abs(m[i] - ref.exp_avg()[i]) / ref.exp_avg_bound()[i]);
  }
  const double rms_v = std::sqrt(sum_sq_v / kCount);
  RecordProperty("v_max_rel_error", std::to_string(worst_v));
  RecordProperty("v_rms_rel_error", std::to_string(rms_v));
  EXPECT_LE(worst_v, bound) << "exp_avg_sq[" << worst_at << "] = " << v[worst_at]
                            << ", float64 reference " << ref.exp_avg_sq()[worst_at]
                            << " (rms relative error over all elements " << rms_v << ")";
  EXPECT_LE(worst_m, 1.0) << "exp_avg is further from the float64 reference than its bound";
  std::printf(
      "v relative error against float64 after %llu steps: max %.3g, rms %.3g (bound %.3g)\n",
      static_cast<unsigned long long>(kSteps), worst_v, rms_v, bound);
}

}  // namespace
}  // namespace strata::optim
