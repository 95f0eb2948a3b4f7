// The CUDA dequantization kernel (Note [Compressed copies] in strata/quant/group_quant.h): a
// compressed copy in device memory into its full-width device copy, one thread an element (a
// grid-stride loop). float(q) * s + m with __fmul_rn and __fadd_rn (no FMA contraction) and
// round-to-nearest-even conversions, so the values are the CPU kernel's, bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_dequant.h"

namespace strata::cuda {
namespace {

using Shape = DequantShape;

__device__ inline void store(float* out, std::uint64_t i, float v) { out[i] = v; }
__device__ inline void store(__nv_bfloat16* out, std::uint64_t i, float v) {
  out[i] = __float2bfloat16_rn(v);
}
__device__ inline void store(__half* out, std::uint64_t i, float v) { out[i] = __float2half_rn(v); }

template <bool kInt4, typename Out>
__global__ void dequantize_kernel(const std::uint8_t* __restrict__ src, Out* __restrict__ out,
                                  Shape s) {
  const std::uint64_t n = s.rows * s.cols;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t r = i / s.cols, c = i - r * s.cols, g = c / s.group;
    const std::uint8_t* row = src + r * s.row_stride;
    const __half* groups = reinterpret_cast<const __half*>(row);  // rows start 4-aligned
    const float m = __half2float(groups[2 * g]), step = __half2float(groups[2 * g + 1]);
    const std::uint8_t* codes = row + 4 * s.groups_per_row;
    const unsigned q = kInt4 ? (codes[c / 2] >> (4 * (c & 1))) & 0x0Fu : codes[c];
    store(out, i, __fadd_rn(__fmul_rn(static_cast<float>(q), step), m));
  }
}

template <bool kInt4>
cudaError_t launch(cudaStream_t stream, const std::uint8_t* src, void* dst, const Shape& s) {
  const std::uint64_t n = s.rows * s.cols;
  const unsigned threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(n / threads + 1 < 65535 * 16 ? n / threads + 1 : 65535 * 16);
  switch (s.out) {
    case 0:
      dequantize_kernel<kInt4><<<blocks, threads, 0, stream>>>(src, static_cast<float*>(dst), s);
      break;
    case 1:
      dequantize_kernel<kInt4>
          <<<blocks, threads, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), s);
      break;
    default:
      dequantize_kernel<kInt4><<<blocks, threads, 0, stream>>>(src, static_cast<__half*>(dst), s);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

int launch_dequantize(void* stream, const void* src, void* dst, const DequantShape& shape) {
  if (shape.rows == 0 || shape.cols == 0) return 0;
  const auto* bytes = static_cast<const std::uint8_t*>(src);
  auto* st = static_cast<cudaStream_t>(stream);
  return static_cast<int>(shape.int4 ? launch<true>(st, bytes, dst, shape)
                                     : launch<false>(st, bytes, dst, shape));
}

}  // namespace strata::cuda
