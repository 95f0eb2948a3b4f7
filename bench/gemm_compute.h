// The overlap bench's real compute: one single-precision GEMM per layer (OpenBLAS cblas_sgemm)
// whose B matrix is the streamed layer's bytes, checked exactly against a reference computed
// from the generator that wrote them; and that generator, which fills the synthetic layers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata::bench {

/// Writes layer `layer`'s synthetic weights: float32 small integers ±1..±8 (every 4 bytes one
/// value; a tail of fewer than 4 bytes gets a byte pattern). Each value is a function of the
/// layer and its index alone, so a reference can recompute any of them (layer_weight).
void fill_layer(std::byte* data, std::size_t bytes, std::size_t layer);
/// Element `index` of layer `layer` as fill_layer writes it.
float layer_weight(std::size_t layer, std::uint64_t index);

/// C (m x n) = A (m x k) · W (k x n), all row-major float32; W is the layer's first k·n floats
/// (an "in x out" weight, as a Linear layer's transposed weight).
struct GemmShape {
  std::size_t m = 0, n = 0, k = 0;
  [[nodiscard]] double flops() const {
    return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  }
};

/// The shape for a layer of `layer_bytes`: k and n as given (0: k the largest power of two at
/// most sqrt(layer floats), n the rest of the layer's floats over k); m as given. Throws
/// invalid_argument naming --gemm-k / --gemm-n when k·n floats do not fit in the layer, or k is
/// too large to be checked exactly.
GemmShape gemm_shape(std::size_t layer_bytes, std::size_t m, std::size_t n, std::size_t k);

/// The m whose GEMM takes about `target_s` (at least 1), timed here on `weights` in turn (give
/// layers that together exceed the last-level cache, so that B comes from memory as a streamed
/// layer's does): a fixed-point iteration on m · target / t(m), which converges as
/// t(m) = a + b·m with a >= 0.
std::size_t calibrate_gemm_m(GemmShape shape, const std::vector<const std::byte*>& weights,
                             double target_s);

/// OpenBLAS's thread count (it reads OPENBLAS_NUM_THREADS at start).
int blas_threads();

/// Note [Exact GEMM check]: A holds integers ±1..±amax and W integers ±1..±8 with
/// k · 8 · amax <= 2^24, so every product and partial sum is an integer below 2^24, exact in
/// float32 in any order, with or without FMA: the GEMM's outputs equal the reference exactly,
/// and a wrong weight (stale, zero, another layer's) changes every output that reads it. The
/// checked outputs are rows 0 and m-1 at columns 0, 256, 512, ... and n-1: each reads a whole
/// column of W, and every 1 KiB of a row of W holds a checked column, so every 4 KiB of the
/// layer's bytes the GEMM reads holds a weight a checked output depends on. The references
/// come from layer_weight in int64, never from the streamed bytes.
class GemmCompute {
 public:
  /// A, C and every layer's reference outputs (layers 0 .. layers-1).
  GemmCompute(GemmShape shape, std::size_t layers);

  /// C = A · W for layer `layer` whose bytes are at `weights` (k·n floats, 4-byte aligned);
  /// returns whether every checked output equals its reference exactly.
  bool run(std::size_t layer, const std::byte* weights);

  [[nodiscard]] const GemmShape& shape() const noexcept { return shape_; }
  /// Outputs checked per layer.
  [[nodiscard]] std::size_t checked_outputs() const noexcept { return rows_.size() * cols_.size(); }

 private:
  GemmShape shape_;
  std::vector<float> a_, c_;
  std::vector<std::size_t> rows_, cols_;
  std::vector<float> reference_;  // [layer][row][col]
};

}  // namespace strata::bench
