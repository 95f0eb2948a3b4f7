// Note [Adam kernel dispatch]: the kernel is one plain loop that GCC vectorises, compiled three
// times: for AVX-512F, for AVX2 and for the x86-64 baseline (`target` attributes on three thin
// functions that inline the same loop, `flatten` so every helper is inlined into each). The
// widest one this CPU runs is picked at run time, so the binary is not tied to the build
// machine's -march, and each can be forced (adam_step with an AdamVariant) so the tests run
// every one. The file is compiled with -fno-math-errno, so sqrt vectorises, and with
// -ffp-contract=off: no FMA, every variant rounds the same operations in the same order, so all
// compute the scalar reference (adam_step_reference) bit for bit. Formulas follow
// torch.optim.Adam/AdamW (foreach=False):
//   Adam:  g += wd * p
//   AdamW: p *= 1 - lr * wd
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// Note [Adam step constants]: the per-step constants (1 - b1, 1 - b2, lr / (1 - b1^t),
// 1 / sqrt(1 - b2^t), 1 - lr * wd) are computed in double from double hyperparameters and
// rounded to fp32 once, as PyTorch does with Python floats. In fp32, 1.0f - 0.999f is
// 0.00099998713, not 0.001: every v would be 1.3e-5 (relative) away from the exact trajectory,
// over two hundred times fp32's unit roundoff (tests/optim/adam_precision_test.cpp).
//
// Note [Adam in 16 bits]: params kept only in bf16 or f16 (no master copy) are stepped a block
// of 1024 at a time: widened into fp32 on the stack, with the moments when they are 16-bit too,
// run through the same kernel, whose param copy writes the rounded params back in place, and the
// moments rounded back. Each value is rounded once per step, so the result is torch.optim.Adam's
// fp32 step on the widened values, rounded (tests/python/test_pipeline_optim.py checks this
// against torch); torch on bf16 params instead rounds after every operation of the formula.
#include "strata/optim/adam.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "strata/base/error.h"

namespace strata::optim {

namespace {

struct Scalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay_factor, step_size,
      inv_sqrt_bc2;
  bool decoupled;
};

// Note [Adam step constants]: in double, rounded to fp32 once.
Scalars scalars(const AdamConfig& c, std::uint64_t step) {
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(c.beta1, t);
  const double bc2 = 1.0 - std::pow(c.beta2, t);
  Scalars s{};
  s.beta1 = static_cast<float>(c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.eps = static_cast<float>(c.eps);
  s.weight_decay = static_cast<float>(c.weight_decay);
  s.decay_factor = static_cast<float>(1.0 - c.lr * c.weight_decay);
  s.step_size = static_cast<float>(c.lr / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.decoupled = c.decoupled_weight_decay;
  return s;
}

// The element update, shared by the vector kernel and the reference.
inline float update(const Scalars& s, float& p, float& m, float& v, float g) {
  if (s.decoupled) {
    p *= s.decay_factor;
  } else {
    g += s.weight_decay * p;
  }
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  const float denom = std::sqrt(v) * s.inv_sqrt_bc2 + s.eps;
  p -= s.step_size * m / denom;
  return p;
}

template <typename LoadGrad, typename StoreCopy>
inline void run(const Scalars& s, float* __restrict p, float* __restrict m, float* __restrict v,
                std::size_t n, LoadGrad load, StoreCopy store) {
  for (std::size_t i = 0; i < n; ++i)
    store(i, update(s, p[i], m[i], v[i], load(i)));
}

// The kernel's signature: `copy` is 0 (none), 1 (bf16) or 2 (f16); grads 0 f32, 1 bf16, 2 f16.
using Kernel = void (*)(const Scalars& s, float* __restrict p, float* __restrict m,
                        float* __restrict v, const void* __restrict grads, int grad_kind,
                        std::uint16_t* __restrict copy, int copy_kind, std::size_t n);

// The loop every variant inlines (Note [Adam kernel dispatch]).
[[gnu::always_inline]] inline void kernel_body(const Scalars& s, float* __restrict p,
                                               float* __restrict m, float* __restrict v,
                                               const void* __restrict grads, int grad_kind,
                                               std::uint16_t* __restrict copy, int copy_kind,
                                               std::size_t n) {
  const auto* gf = static_cast<const float*>(grads);
  const auto* gh = static_cast<const std::uint16_t*>(grads);
  auto none = [](std::size_t, float) {};
  auto bf16 = [copy](std::size_t i, float x) { copy[i] = float_to_bf16(x); };
  auto f16 = [copy](std::size_t i, float x) { copy[i] = float_to_f16(x); };
  auto g32 = [gf](std::size_t i) { return gf[i]; };
  auto gb = [gh](std::size_t i) { return bf16_to_float(gh[i]); };
  auto gh16 = [gh](std::size_t i) { return f16_to_float(gh[i]); };
  auto with_grads = [&](auto load) {
    if (copy_kind == 1)
      run(s, p, m, v, n, load, bf16);
    else if (copy_kind == 2)
      run(s, p, m, v, n, load, f16);
    else
      run(s, p, m, v, n, load, none);
  };
  if (grad_kind == 0)
    with_grads(g32);
  else if (grad_kind == 1)
    with_grads(gb);
  else
    with_grads(gh16);
}

__attribute__((target("avx512f"), flatten)) void kernel_avx512f(
    const Scalars& s, float* __restrict p, float* __restrict m, float* __restrict v,
    const void* __restrict grads, int grad_kind, std::uint16_t* __restrict copy, int copy_kind,
    std::size_t n) {
  kernel_body(s, p, m, v, grads, grad_kind, copy, copy_kind, n);
}

__attribute__((target("avx2"), flatten)) void kernel_avx2(const Scalars& s, float* __restrict p,
                                                          float* __restrict m, float* __restrict v,
                                                          const void* __restrict grads,
                                                          int grad_kind,
                                                          std::uint16_t* __restrict copy,
                                                          int copy_kind, std::size_t n) {
  kernel_body(s, p, m, v, grads, grad_kind, copy, copy_kind, n);
}

__attribute__((flatten)) void kernel_baseline(const Scalars& s, float* __restrict p,
                                              float* __restrict m, float* __restrict v,
                                              const void* __restrict grads, int grad_kind,
                                              std::uint16_t* __restrict copy, int copy_kind,
                                              std::size_t n) {
  kernel_body(s, p, m, v, grads, grad_kind, copy, copy_kind, n);
}

Kernel kernel_for(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::avx512f:
      return kernel_avx512f;
    case AdamIsa::avx2:
      return kernel_avx2;
    case AdamIsa::baseline:
      break;
  }
  return kernel_baseline;
}

// Note [f16 through F16C] (strata/base/half.h): f16 gradients and copies convert a block at a
// time around the f32 kernel when the CPU has F16C; else element by element in the kernel.
// One chunk with f16 gradients and/or an f16 copy, through F16C a block at a time.
void f16_chunk(Kernel kernel, const Scalars& s, float* p, float* m, float* v, const void* grads,
               int gk, std::uint16_t* copy, int ck, std::size_t n) {
  constexpr std::size_t kBlock = 1024;
  alignas(64) float g[kBlock];
  for (std::size_t b = 0; b < n; b += kBlock) {
    const std::size_t len = std::min(kBlock, n - b);
    const void* gb = nullptr;
    int kind = gk;
    if (gk == 2) {
      f16_to_f32_block(static_cast<const std::uint16_t*>(grads) + b, g, len);
      gb = g;
      kind = 0;
    } else {
      gb = static_cast<const std::byte*>(grads) + b * (gk == 0 ? 4 : 2);
    }
    kernel(s, p + b, m + b, v + b, gb, kind, ck == 1 ? copy + b : nullptr, ck == 1 ? 1 : 0, len);
    if (ck == 2) f32_to_f16_block(p + b, copy + b, len);
  }
}

int grad_kind(DType d) {
  if (d == DType::F32) return 0;
  if (d == DType::BF16) return 1;
  if (d == DType::F16) return 2;
  STRATA_FAIL(Errc::invalid_argument, "adam: gradients must be f32, bf16 or f16, not ",
              to_string(d));
}

int copy_kind(const AdamArgs& a) {
  if (a.param_copy == nullptr) return 0;
  if (a.copy_dtype == DType::BF16) return 1;
  if (a.copy_dtype == DType::F16) return 2;
  STRATA_FAIL(Errc::invalid_argument, "adam: the param copy must be bf16 or f16, not ",
              to_string(a.copy_dtype));
}

void check(const AdamArgs& a) {
  STRATA_EXPECTS(a.step >= 1, "adam: step counts from 1, got ", a.step);
  STRATA_EXPECTS(a.count == 0 || (a.params && a.exp_avg && a.exp_avg_sq && a.grads),
                 "adam: a null buffer for ", a.count, " elements");
}

std::size_t grad_bytes(DType d) {
  return d == DType::F32 ? 4 : 2;
}

}  // namespace

void adam_step(const AdamConfig& config, const AdamArgs& a) {
  adam_step(config, a, adam_native_variant());
}

void adam_step(const AdamConfig& config, const AdamArgs& a, AdamVariant variant) {
  check(a);
  if (!adam_supports(variant))
    STRATA_FAIL(Errc::unsupported, "adam: this CPU cannot run the ", isa_name(variant.isa),
                variant.f16 == F16Path::f16c ? " variant with F16C" : " variant");
  const Scalars s = scalars(config, a.step);
  const int gk = grad_kind(a.grad_dtype), ck = copy_kind(a);
  const Kernel kernel = kernel_for(variant.isa);
  const bool f16_blocks = (gk == 2 || ck == 2) && variant.f16 == F16Path::f16c;
  tbb::parallel_for(
      tbb::blocked_range<std::size_t>(0, a.count, kAdamChunkElements),
      [&](const tbb::blocked_range<std::size_t>& r) {
        const std::size_t b = r.begin(), n = r.size();
        const void* grads = static_cast<const std::byte*>(a.grads) + b * grad_bytes(a.grad_dtype);
        std::uint16_t* copy = ck == 0 ? nullptr : static_cast<std::uint16_t*>(a.param_copy) + b;
        if (f16_blocks)
          f16_chunk(kernel, s, a.params + b, a.exp_avg + b, a.exp_avg_sq + b, grads, gk, copy, ck,
                    n);
        else
          kernel(s, a.params + b, a.exp_avg + b, a.exp_avg_sq + b, grads, gk, copy, ck, n);
      });
}

namespace {

int kind_16(DType d, const char* what) {
  if (d == DType::BF16) return 1;
  if (d == DType::F16) return 2;
  STRATA_FAIL(Errc::invalid_argument, "adam: ", what, " must be bf16 or f16, not ", to_string(d));
}

void widen(const std::uint16_t* src, int kind, bool f16c, float* dst, std::size_t n) {
  if (kind == 1) {
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = bf16_to_float(src[i]);
  } else if (f16c) {
    f16_to_f32_block(src, dst, n);
  } else {
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = f16_to_float(src[i]);
  }
}

void narrow(const float* src, int kind, bool f16c, std::uint16_t* dst, std::size_t n) {
  if (kind == 1) {
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = float_to_bf16(src[i]);
  } else if (f16c) {
    f32_to_f16_block(src, dst, n);
  } else {
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = float_to_f16(src[i]);
  }
}

}  // namespace

void adam_step(const AdamConfig& config, const Adam16Args& a) {
  adam_step(config, a, adam_native_variant());
}

void adam_step(const AdamConfig& config, const Adam16Args& a, AdamVariant variant) {
  STRATA_EXPECTS(a.step >= 1, "adam: step counts from 1, got ", a.step);
  STRATA_EXPECTS(a.count == 0 || (a.params && a.exp_avg && a.exp_avg_sq && a.grads),
                 "adam: a null buffer for ", a.count, " elements");
  if (!adam_supports(variant))
    STRATA_FAIL(Errc::unsupported, "adam: this CPU cannot run the ", isa_name(variant.isa),
                variant.f16 == F16Path::f16c ? " variant with F16C" : " variant");
  const int pk = kind_16(a.param_dtype, "16-bit params");
  const int sk = a.state_dtype == DType::F32 ? 0 : kind_16(a.state_dtype, "the moments");
  const int gk = grad_kind(a.grad_dtype);
  const Scalars s = scalars(config, a.step);
  const Kernel kernel = kernel_for(variant.isa);
  const bool f16c = variant.f16 == F16Path::f16c;
  const bool f16_blocks = (gk == 2 || pk == 2) && f16c;
  tbb::parallel_for(
      tbb::blocked_range<std::size_t>(0, a.count, kAdamChunkElements),
      [&](const tbb::blocked_range<std::size_t>& r) {
        constexpr std::size_t kBlock = 1024;
        alignas(64) float p[kBlock], m[kBlock], v[kBlock];
        for (std::size_t b = r.begin(); b < r.end(); b += kBlock) {
          const std::size_t n = std::min(kBlock, r.end() - b);
          auto* params = static_cast<std::uint16_t*>(a.params) + b;
          widen(params, pk, f16c, p, n);
          float* pm = m;
          float* pv = v;
          if (sk == 0) {
            pm = static_cast<float*>(a.exp_avg) + b;
            pv = static_cast<float*>(a.exp_avg_sq) + b;
          } else {
            widen(static_cast<const std::uint16_t*>(a.exp_avg) + b, sk, f16c, m, n);
            widen(static_cast<const std::uint16_t*>(a.exp_avg_sq) + b, sk, f16c, v, n);
          }
          const void* grads = static_cast<const std::byte*>(a.grads) + b * grad_bytes(a.grad_dtype);
          if (f16_blocks)
            f16_chunk(kernel, s, p, pm, pv, grads, gk, params, pk, n);
          else
            kernel(s, p, pm, pv, grads, gk, params, pk, n);
          if (sk != 0) {
            narrow(m, sk, f16c, static_cast<std::uint16_t*>(a.exp_avg) + b, n);
            narrow(v, sk, f16c, static_cast<std::uint16_t*>(a.exp_avg_sq) + b, n);
          }
        }
      });
}

void adam_step_reference(const AdamConfig& config, const AdamArgs& a) {
  check(a);
  const Scalars s = scalars(config, a.step);
  const int gk = grad_kind(a.grad_dtype), ck = copy_kind(a);
  for (std::size_t i = 0; i < a.count; ++i) {
    const float g = gk == 0   ? static_cast<const float*>(a.grads)[i]
                    : gk == 1 ? bf16_to_float(static_cast<const std::uint16_t*>(a.grads)[i])
                              : f16_to_float(static_cast<const std::uint16_t*>(a.grads)[i]);
    const float p = update(s, a.params[i], a.exp_avg[i], a.exp_avg_sq[i], g);
    if (ck == 1) static_cast<std::uint16_t*>(a.param_copy)[i] = float_to_bf16(p);
    if (ck == 2) static_cast<std::uint16_t*>(a.param_copy)[i] = float_to_f16(p);
  }
}

AdamVariant adam_native_variant() noexcept {
  AdamVariant v;
  v.isa = __builtin_cpu_supports("avx512f") ? AdamIsa::avx512f
          : __builtin_cpu_supports("avx2")  ? AdamIsa::avx2
                                            : AdamIsa::baseline;
  v.f16 = has_f16c() ? F16Path::f16c : F16Path::in_loop;
  return v;
}

bool adam_supports(AdamVariant variant) noexcept {
  const bool isa = variant.isa == AdamIsa::baseline ||
                   (variant.isa == AdamIsa::avx2 && __builtin_cpu_supports("avx2")) ||
                   (variant.isa == AdamIsa::avx512f && __builtin_cpu_supports("avx512f"));
  return isa && (variant.f16 == F16Path::in_loop || has_f16c());
}

std::string_view isa_name(AdamIsa isa) noexcept {
  switch (isa) {
    case AdamIsa::avx512f:
      return "avx512f";
    case AdamIsa::avx2:
      return "avx2";
    case AdamIsa::baseline:
      break;
  }
  return "baseline";
}

std::string_view adam_isa() noexcept {
  return isa_name(adam_native_variant().isa);
}

}  // namespace strata::optim
