// The CUDA dequantization kernel's launcher (cuda_dequant.cu), for cuda_backend.cpp: plain
// arguments only, so the .cu side includes nothing of strata (nvcc compiles it as C++17).
#pragma once

#include <cstdint>

namespace strata::cuda {

/// What the kernel needs of a compressed copy (Note [Compressed copies]).
struct DequantShape {
  bool int4 = false;
  int out = 0;  ///< 0: f32, 1: bf16, 2: f16
  std::uint64_t rows = 0, cols = 0, groups_per_row = 0, row_stride = 0, group = 0;
};

/// Enqueues the kernel on `stream` (a cudaStream_t): reads the compressed copy at `src` (device
/// memory) and writes rows x cols values to `dst`. Returns the launch's cudaError_t as an int.
int launch_dequantize(void* stream, const void* src, void* dst, const DequantShape& shape);

}  // namespace strata::cuda
