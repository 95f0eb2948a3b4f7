// An independent Adam/AdamW in double precision, for the CPU Adam tests: the exact trajectory the
// fp32 kernel approximates, and beside it a bound on how far an fp32 kernel may be from it.
//
// Note [Adam error bound]: every fp32 operation of the kernel (and every constant rounded to
// fp32 once) may be off by at most u = 2^-24 of its result. The reference follows the kernel's
// operations one by one, in double, and carries for each state a first-order forward error bound
// E: the error carried in from the last step, scaled by what multiplies it, plus u times the
// magnitude of each rounded result. The kernel is correct when |kernel - reference| <= E on
// every element. This is tight (no slack factor; only second-order terms, u^2, are left out):
// for v (f32 gradients) it is 4u of v after one step and grows by at most 4u a step, while one
// constant computed in fp32, such as 1 - beta2 as 1.0f - 0.999f (1.3e-5 relative), is over 50
// times that after one step and 5 times after ten; a wrong formula (a bias correction, eps inside
// the sqrt) is off by far more.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "strata/optim/adam.h"

namespace strata::optim::testing {

inline constexpr double kUnitRoundoff = 0x1p-24;  // fp32, round to nearest

/// The hyperparameters as a Python script writes them (doubles): the exact values.
struct Hyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  ///< AdamW

  AdamConfig config() const {
    AdamConfig c;
    c.lr = lr;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.eps = eps;
    c.weight_decay = weight_decay;
    c.decoupled_weight_decay = decoupled;
    return c;
  }
};

/// Adam over whole arrays in double, torch.optim.Adam/AdamW's formulas, with the bounds E of
/// Note [Adam error bound] for p, m and v.
class DoubleAdam {
 public:
  explicit DoubleAdam(const std::vector<float>& params)
      : p_(params.begin(), params.end()),
        m_(params.size(), 0.0),
        v_(params.size(), 0.0),
        p_err_(params.size(), 0.0),
        m_err_(params.size(), 0.0),
        v_err_(params.size(), 0.0) {}

  /// One step (t counts from 1) with these gradients (already widened exactly from their dtype).
  void step(const Hyper& h, const std::vector<double>& grads, std::uint64_t t) {
    const double u = kUnitRoundoff;
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(t));
    const double step_size = h.lr / bc1, inv_sqrt_bc2 = 1.0 / std::sqrt(bc2);
    const double decay = 1.0 - h.lr * h.weight_decay;
    const double c1 = 1.0 - h.beta1, c2 = 1.0 - h.beta2;
    for (std::size_t i = 0; i < p_.size(); ++i) {
      double p = p_[i], ep = p_err_[i];
      double g = grads[i], eg = 0.0;
      if (h.decoupled) {  // p *= decay: the constant and the product
        p *= decay;
        ep = ep * decay + 2 * u * std::abs(p);
      } else if (h.weight_decay != 0.0) {  // g += wd p: the constant, the product and the sum
        g += h.weight_decay * p_[i];
        eg = h.weight_decay * ep + 2 * u * h.weight_decay * std::abs(p_[i]) + u * std::abs(g);
      }
      const double m = h.beta1 * m_[i] + c1 * g;
      m_err_[i] = h.beta1 * m_err_[i] + 2 * u * h.beta1 * std::abs(m_[i]) + c1 * eg +
                  2 * u * c1 * std::abs(g) + u * std::abs(m);
      const double v = h.beta2 * v_[i] + c2 * g * g;
      v_err_[i] = h.beta2 * v_err_[i] + 2 * u * h.beta2 * v_[i] + 2 * c2 * std::abs(g) * eg +
                  3 * u * c2 * g * g + u * v;
      // denom = sqrt(v) * inv_sqrt_bc2 + eps (sqrt, the constant, the product, eps, the sum)
      const double s = std::sqrt(v);
      const double es =
          (v > 0 ? std::min(v_err_[i] / (2 * s), std::sqrt(v_err_[i])) : std::sqrt(v_err_[i])) +
          u * s;
      const double q = s * inv_sqrt_bc2, d = q + h.eps;
      const double ed = es * inv_sqrt_bc2 + 2 * u * q + u * h.eps + u * d;
      // p -= step_size * m / denom (the constant, the product, the quotient, the difference)
      const double w = step_size * m / d;
      const double ew = step_size * m_err_[i] / d + std::abs(w) * ed / d + 3 * u * std::abs(w);
      p -= w;
      p_[i] = p;
      p_err_[i] = ep + ew + u * std::abs(p);
      m_[i] = m;
      v_[i] = v;
    }
  }

  const std::vector<double>& params() const { return p_; }
  const std::vector<double>& exp_avg() const { return m_; }
  const std::vector<double>& exp_avg_sq() const { return v_; }
  const std::vector<double>& params_bound() const { return p_err_; }
  const std::vector<double>& exp_avg_bound() const { return m_err_; }
  const std::vector<double>& exp_avg_sq_bound() const { return v_err_; }

 private:
  std::vector<double> p_, m_, v_;
  std::vector<double> p_err_, m_err_, v_err_;
};

/// bf16 of a finite float, round to nearest even, chosen between the two neighbours by distance
/// (not the add-and-shift trick the library uses).
inline std::uint16_t bf16_nearest_even(float f) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t down = bits & 0xFFFF0000u, up = down + 0x10000u;  // toward 0, away from 0
  const double x = f, lo = std::bit_cast<float>(down), hi = std::bit_cast<float>(up);
  const double dlo = std::abs(x - lo), dhi = std::abs(hi - x);
  const std::uint32_t pick = dlo < dhi ? down : dhi < dlo ? up : ((down >> 16) & 1u) ? up : down;
  return static_cast<std::uint16_t>(pick >> 16);
}

/// f16 of a float through the compiler's _Float16 (round to nearest even).
inline std::uint16_t f16_nearest_even(float f) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
}

inline double f16_value(std::uint16_t h) {
  return static_cast<double>(std::bit_cast<_Float16>(h));
}

inline double bf16_value(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace strata::optim::testing
