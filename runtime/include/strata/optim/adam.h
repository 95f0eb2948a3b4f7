// CPU Adam and AdamW over fp32 master weights, as PyTorch defines them, for ZeRO-style offload:
// one pass over memory, vectorised for the CPU it runs on (chosen at run time), parallel over
// chunks with oneTBB.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/runtime/tensor.h"

namespace strata::optim {

struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
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

/// Runs the step with all threads (oneTBB) and the widest vector unit the CPU has.
/// @throws strata::Error (invalid_argument) for null buffers, step 0 or unsupported dtypes.
void adam_step(const AdamConfig& config, const AdamArgs& args);
/// The plain scalar formula, element by element: the reference the tests compare against.
void adam_step_reference(const AdamConfig& config, const AdamArgs& args);
/// The instruction set the vector kernel runs with here ("avx512f", "avx2", "default").
std::string_view adam_isa() noexcept;

/// Conversions used for gradients and param copies (round to nearest even).
/// Inline: it is a shift, and loops that call it vectorise.
inline float bf16_to_float(std::uint16_t v) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(v) << 16);
}
std::uint16_t float_to_bf16(float f) noexcept;
float f16_to_float(std::uint16_t v) noexcept;
std::uint16_t float_to_f16(float f) noexcept;

}  // namespace strata::optim
