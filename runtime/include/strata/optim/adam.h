// CPU Adam and AdamW over fp32 master weights, as PyTorch defines them, for ZeRO-style offload:
// one pass over memory, vectorised for the CPU it runs on (chosen at run time), parallel over
// chunks with oneTBB.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/base/half.h"
#include "strata/runtime/tensor.h"

namespace strata::optim {

/// Hyperparameters in double, as a Python script gives them to torch.optim: the step's constants
/// (1 - beta1, 1 - beta2, the bias corrections, the step size, 1 - lr * weight_decay) are
/// computed from them in double and rounded to fp32 once (Note [Adam step constants]).
struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  /// false: Adam (weight decay added to the gradient, torch.optim.Adam);
  /// true: AdamW (decoupled: p *= 1 - lr * weight_decay, torch.optim.AdamW).
  bool decoupled_weight_decay = false;
};

/// One optimizer step over `count` elements. `step` counts from 1 (bias correction).
/// Gradients are F32, BF16 or F16; `param_copy`, when not null, receives the updated params as
/// `copy_dtype` (BF16 or F16, round to nearest even) in the same pass: the copy the device gets.
struct AdamArgs {
  float* params = nullptr;
  float* exp_avg = nullptr;     ///< m
  float* exp_avg_sq = nullptr;  ///< v
  const void* grads = nullptr;
  DType grad_dtype = DType::F32;
  std::size_t count = 0;
  std::uint64_t step = 1;
  void* param_copy = nullptr;
  DType copy_dtype = DType::BF16;
};

/// Adam on parameters stored in 16 bits with no fp32 master copy (Note [Adam in 16 bits]):
/// params BF16 or F16, the moments F32 or 16-bit (both the same dtype), gradients F32, BF16 or
/// F16. Each block is widened to fp32, stepped by the same kernel and rounded back (nearest even).
struct Adam16Args {
  void* params = nullptr;
  DType param_dtype = DType::BF16;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType state_dtype = DType::F32;
  const void* grads = nullptr;
  DType grad_dtype = DType::F32;
  std::size_t count = 0;
  std::uint64_t step = 1;
};

/// Elements per oneTBB task (grain size of the blocked range): 256 KiB of each fp32 state.
inline constexpr std::size_t kAdamChunkElements = std::size_t{1} << 16;

/// The vector kernel's variants (Note [Adam kernel dispatch]): one loop compiled for AVX-512F,
/// for AVX2, and for the x86-64 baseline (SSE2).
enum class AdamIsa { avx512f, avx2, baseline };
/// How f16 gradients and copies convert (Note [f16 through F16C]): with the F16C instructions a
/// block at a time around the loop, or element by element inside it.
enum class F16Path { f16c, in_loop };
struct AdamVariant {
  AdamIsa isa = AdamIsa::baseline;
  F16Path f16 = F16Path::in_loop;
};

/// Runs the step with all threads (oneTBB) and the variant adam_native_variant() names.
/// @throws strata::Error (invalid_argument) for null buffers, step 0 or unsupported dtypes.
void adam_step(const AdamConfig& config, const AdamArgs& args);
/// The same with the variant forced: every variant computes the same bits (the tests check it).
/// @throws strata::Error (unsupported) when this CPU cannot run `variant`.
void adam_step(const AdamConfig& config, const AdamArgs& args, AdamVariant variant);
/// One step over 16-bit params (Adam16Args), with all threads and the native variant.
/// @throws strata::Error (invalid_argument) for null buffers, step 0 or unsupported dtypes.
void adam_step(const AdamConfig& config, const Adam16Args& args);
/// The same with the variant forced; every variant computes the same bits.
void adam_step(const AdamConfig& config, const Adam16Args& args, AdamVariant variant);
/// The plain scalar formula, element by element, in the kernel's fp32 operations.
void adam_step_reference(const AdamConfig& config, const AdamArgs& args);

/// The widest variant this CPU runs: what adam_step(config, args) uses.
AdamVariant adam_native_variant() noexcept;
/// Whether this CPU can run `variant`.
bool adam_supports(AdamVariant variant) noexcept;
/// "avx512f", "avx2" or "baseline".
std::string_view isa_name(AdamIsa isa) noexcept;
/// isa_name(adam_native_variant().isa).
std::string_view adam_isa() noexcept;

/// The half-precision conversions (strata/base/half.h), by their old names here too.
using strata::bf16_to_float;
using strata::f16_to_float;
using strata::float_to_bf16;
using strata::float_to_f16;

}  // namespace strata::optim
