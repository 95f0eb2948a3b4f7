// The overlap bench's GEMM compute and the generator of its synthetic layers (gemm_compute.h).
#include "gemm_compute.h"

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "bench_common.h"
#include "strata/base/error.h"

namespace strata::bench {
namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr std::uint64_t kActivationStream = ~0ULL;  // the generator stream of A
constexpr std::size_t kCheckedColumnStride = 256;   // floats: 1 KiB of a row of W
constexpr std::int64_t kExactLimit = std::int64_t{1} << 24;
constexpr std::int64_t kWeightMax = 8;

// splitmix64's finalizer: a 64-bit word from a counter.
std::uint64_t mix(std::uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

std::uint64_t word(std::uint64_t stream, std::uint64_t index) {
  return mix(kGolden * (stream + 1) + index);
}

// One 4-bit draw: magnitude 1..8, the high bit the sign.
float weight_from_nibble(unsigned nibble) {
  const float magnitude = static_cast<float>(1 + (nibble & 7U));
  return (nibble & 8U) != 0 ? -magnitude : magnitude;
}

// A's largest magnitude: k · 8 · amax <= 2^24 (Note [Exact GEMM check]).
std::int64_t activation_max(std::size_t k) {
  return std::min<std::int64_t>(8, kExactLimit / (kWeightMax * static_cast<std::int64_t>(k)));
}

float activation(std::uint64_t index, std::int64_t amax) {
  const std::uint64_t x = word(kActivationStream, index);
  const auto magnitude = static_cast<float>(1 + static_cast<std::int64_t>(x >> 1) % amax);
  return (x & 1U) != 0 ? -magnitude : magnitude;
}

void fill_activation(std::vector<float>& a, std::size_t k) {
  const std::int64_t amax = activation_max(k);
  for (std::size_t i = 0; i < a.size(); ++i)
    a[i] = activation(i, amax);
}

void sgemm(const GemmShape& s, const float* a, const float* w, float* c) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(s.m),
              static_cast<int>(s.n), static_cast<int>(s.k), 1.0F, a, static_cast<int>(s.k), w,
              static_cast<int>(s.n), 0.0F, c, static_cast<int>(s.n));
}

}  // namespace

void fill_layer(std::byte* data, std::size_t bytes, std::size_t layer) {
  const std::size_t floats = bytes / sizeof(float);
  auto* out = reinterpret_cast<float*>(data);
  for (std::size_t w = 0; w * 16 < floats; ++w) {
    const std::uint64_t x = word(layer, w);
    const std::size_t end = std::min(floats, w * 16 + 16);
    for (std::size_t e = w * 16; e < end; ++e)
      out[e] = weight_from_nibble(static_cast<unsigned>(x >> (4 * (e & 15))) & 15U);
  }
  for (std::size_t i = floats * sizeof(float); i < bytes; ++i)
    data[i] = std::byte(layer + i);
}

float layer_weight(std::size_t layer, std::uint64_t index) {
  return weight_from_nibble(static_cast<unsigned>(word(layer, index >> 4) >> (4 * (index & 15))) &
                            15U);
}

GemmShape gemm_shape(std::size_t layer_bytes, std::size_t m, std::size_t n, std::size_t k) {
  const std::size_t floats = layer_bytes / sizeof(float);
  STRATA_EXPECTS(floats >= 1, "--layer-bytes: a GEMM needs at least one float32 per layer");
  if (k == 0 && n == 0) {
    k = std::bit_floor(static_cast<std::size_t>(std::sqrt(static_cast<double>(floats))));
  } else if (k == 0) {
    k = floats / n;
  }
  if (n == 0) n = floats / k;
  STRATA_EXPECTS(k >= 1 && n >= 1 && k * n <= floats, "--gemm-k ", k, " x --gemm-n ", n,
                 " float32 weights do not fit in a layer of ", layer_bytes, " bytes (", floats,
                 " floats)");
  STRATA_EXPECTS(activation_max(k) >= 1, "--gemm-k: ", k, " is above the ",
                 kExactLimit / kWeightMax,
                 " at which the GEMM's outputs are exact in float32 and can be checked");
  return {m, n, k};
}

std::size_t calibrate_gemm_m(GemmShape shape, const std::vector<const std::byte*>& weights,
                             double target_s) {
  constexpr std::size_t kMaxM = 1 << 16;
  STRATA_EXPECTS(!weights.empty(), "calibrate_gemm_m: no weights");
  std::size_t next_weights = 0;
  std::vector<float> a, c;
  auto time_m = [&](std::size_t m) {
    shape.m = m;
    a.resize(m * shape.k);
    c.resize(m * shape.n);
    fill_activation(a, shape.k);
    sgemm(shape, a.data(), reinterpret_cast<const float*>(weights[0]), c.data());  // threads up
    std::vector<double> t;
    for (int i = 0; i < 5; ++i) {
      const auto* w = reinterpret_cast<const float*>(weights[next_weights++ % weights.size()]);
      const auto start = Clock::now();
      sgemm(shape, a.data(), w, c.data());
      t.push_back(seconds_since(start));
    }
    std::nth_element(t.begin(), t.begin() + 2, t.end());
    return t[2];  // the median
  };
  std::size_t m = 16;
  for (int i = 0; i < 5; ++i) {
    const double t = time_m(m);
    const auto next = static_cast<std::size_t>(std::clamp(
        std::round(static_cast<double>(m) * target_s / t), 1.0, static_cast<double>(kMaxM)));
    if (next == m || std::abs(static_cast<double>(next) - static_cast<double>(m)) <
                         0.03 * static_cast<double>(m))
      return next;
    m = next;
  }
  return m;
}

int blas_threads() {
  return openblas_get_num_threads();
}

GemmCompute::GemmCompute(GemmShape shape, std::size_t layers)
    : shape_(shape), a_(shape.m * shape.k), c_(shape.m * shape.n) {
  STRATA_EXPECTS(shape.m >= 1 && shape.n >= 1 && shape.k >= 1, "GEMM: empty shape ", shape.m, " x ",
                 shape.n, " x ", shape.k);
  fill_activation(a_, shape.k);
  rows_ = {0};
  if (shape.m > 1) rows_.push_back(shape.m - 1);
  for (std::size_t j = 0; j < shape.n; j += kCheckedColumnStride)
    cols_.push_back(j);
  if (cols_.back() != shape.n - 1) cols_.push_back(shape.n - 1);
  reference_.reserve(layers * checked_outputs());
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t r : rows_) {
      for (std::size_t j : cols_) {
        std::int64_t sum = 0;  // integers: exact (Note [Exact GEMM check])
        for (std::size_t kk = 0; kk < shape.k; ++kk)
          sum += static_cast<std::int64_t>(a_[r * shape.k + kk]) *
                 static_cast<std::int64_t>(layer_weight(l, kk * shape.n + j));
        reference_.push_back(static_cast<float>(sum));
      }
    }
  }
}

bool GemmCompute::run(std::size_t layer, const std::byte* weights) {
  sgemm(shape_, a_.data(), reinterpret_cast<const float*>(weights), c_.data());
  const float* expected = reference_.data() + layer * checked_outputs();
  bool ok = true;
  for (std::size_t r : rows_)
    for (std::size_t j : cols_)
      ok &= c_[r * shape_.n + j] == *expected++;
  return ok;
}

}  // namespace strata::bench
