// Streaming inference of an MLP stored in a safetensors file: layers.{i}.weight [out, in] and
// layers.{i}.bias [out] (F32, F16 or BF16), y = relu(W x + b) after every layer but the last,
// computed in fp32. The streamed run maps the file's tensors into a Runtime (the file is their
// NVMe home) and prefetches them layer by layer; the reference reads every weight into memory
// with plain reads. Both run the same kernels in the same order: their outputs are bitwise equal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/base/error.h"
#include "strata/runtime/safetensors.h"
#include "strata/runtime/tensor.h"
#include "strata/scheduler/overlap_metrics.h"

namespace strata::examples {

struct LayerSpec {
  const safetensors::TensorInfo* weight = nullptr;
  const safetensors::TensorInfo* bias = nullptr;
  int in = 0, out = 0;
};

struct ModelSpec {
  std::vector<LayerSpec> layers;
  std::uint64_t model_bytes = 0;  ///< the layers' bytes in the file
  [[nodiscard]] int input_dim() const { return layers.front().in; }
  [[nodiscard]] int output_dim() const { return layers.back().out; }
  [[nodiscard]] int max_dim() const;
  [[nodiscard]] std::uint64_t largest_layer_bytes(std::size_t* which = nullptr) const;
};

/// Checks that the header describes a streamable MLP (consecutive layers from 0, a bias for every
/// weight, matching shapes, F32/F16/BF16). Throws strata::Error naming the tensor and problem.
ModelSpec describe_model(const safetensors::Header& header, const std::string& path);

/// Writes a synthetic model of `layers` layers of `hidden` x `hidden` (He-uniform weights, small
/// biases) a few MiB at a time, never holding a layer. Returns the file's size.
std::uint64_t generate_model(const std::string& path, int layers, int hidden, DType dtype,
                             std::uint64_t seed = 1);

// The roofline and the measuring rule (strata/scheduler/overlap_metrics.h), under the names
// callers use here.
using strata::assess_roofline;
using strata::kMaxRoofline;
using strata::MeasureRule;

struct InferenceConfig {
  std::string model;
  std::vector<float> input;  ///< [batch, in], row-major
  int batch = 1;
  std::size_t device_budget = 0;  ///< 0: model / 8, at least what one layer needs
  std::size_t host_budget = 0;    ///< 0: 64 MiB
  std::string backend = "host";
  std::string prefetch = "auto";  ///< none | auto | K (a fixed lookahead of K layers)
  /// Timed passes, each from cold (after one warm-up pass): at least this many, and more until
  /// each measured figure's passes add up to min_seconds (Note [Measuring until the figures
  /// hold]).
  int passes = 3;
  double min_seconds = strata::tunables::kMinMeasureSeconds;
  bool measure = true;  ///< compute_s and transfer_s alone, interleaved with the passes
  /// With measure: a roofline above this is reported as untrusted (a warning, figures_trusted
  /// false). DESIGN's bound is 1.02; the command line only lets it be made stricter.
  double max_roofline = kMaxRoofline;
  std::string trace;  ///< Chrome trace of the last pass
  std::string svg;    ///< SVG timeline of the last pass
  bool quiet = true;
  /// "" (full width), "int8" or "int4": the layers' weights compressed on the host and NVMe
  /// tiers, dequantized into their device copies (Note [Compressed copies]); biases stay full.
  std::string compress;
  std::uint32_t compress_group = 64;
  std::string compress_cache;  ///< the compressed cache's directory ("": the model's)
};

struct InferenceResult {
  std::vector<float> output;  ///< [batch, out]
  ModelSpec model;
  std::size_t device_budget = 0, host_budget = 0;
  double step_s = 0;  ///< median of the timed passes
  /// Median of the compute-only passes: each layer's compute alone, its own weights resident.
  double compute_s = 0;
  double transfer_s = 0;  ///< median of the transfer-only passes: every layer, nothing computed
  double roofline = 0;  ///< max(compute_s, transfer_s) / step_s of the medians (0 without measure)
  /// False when the roofline is above max_roofline: the figures are a measurement error, and
  /// `warning` says which (the run's output is still right).
  bool figures_trusted = true;
  std::string warning;
  int passes_run = 0;                 ///< timed passes run (at least passes)
  double gbps_nvme_read = 0;          ///< bytes_nvme_read / the timed passes' time
  std::uint64_t bytes_nvme_read = 0;  ///< read from NVMe (the model file) in the timed passes
  double samples_per_s = 0;
  std::vector<double> step_runs_s;  ///< every timed pass, in order (step_s is their median)
  /// The prefetch pipeline over the timed streamed passes: layers staged on the host ahead of
  /// the device window, and device prefetches that arrived in pieces (Note [Arrival in pieces]).
  std::uint64_t host_prefetches = 0, arrivals_in_pieces = 0;
  /// CPU time the hypervisor stole during the timed passes, all CPUs summed: on a shared VM a
  /// slow pass next to a large steal is the machine, not the pipeline.
  double cpu_steal_s = 0;
  std::uint64_t peak_device_bytes = 0;
  bool passes_agree = true;
  /// With --compress: the cache (built this run, and why) and the weights' stored and full bytes.
  bool cache_rebuilt = false;
  std::string cache_why;
  std::uint64_t compressed_stored_bytes = 0, compressed_full_bytes = 0;
  std::uint64_t dequant_ns = 0;  ///< the device tier's dequantization time, whole run  ///< every
                                 ///< pass that computed (timed or compute-only) gave one output
};

/// Streams the model through the runtime's pipeline.
InferenceResult run_streamed(const InferenceConfig& config);
/// Reads every weight into memory with plain reads and runs the same forward pass.
std::vector<float> run_reference(const std::string& model, const std::vector<float>& input,
                                 int batch);

/// CRC32C of the output's bytes, as 8 hex digits.
std::string output_checksum(const std::vector<float>& output);
/// The process's peak resident set (VmHWM), in bytes; 0 when unknown.
std::uint64_t peak_rss_bytes();

}  // namespace strata::examples
