// ZeRO-Offload training of an MLP on strata: fp32 master weights and Adam moments homed on the
// host or on NVMe, forward and backward on the device tier, Adam on the CPU, overlapped layer by
// layer by the prefetch pipeline. The same training without offload (`reference`) runs the same
// kernels in the same order on plain memory, so the losses of both are bitwise equal. Each step
// reports what it did from its own spans, and so its lower bound (step_bound.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "step_bound.h"

namespace strata::examples {

enum class Offload { None, Host, Nvme };
Offload parse_offload(const std::string& text);  // "none" | "host" | "nvme"; throws naming it

struct TrainConfig {
  int layers = 16;
  int hidden = 512;
  int batch = 64;
  int steps = 30;
  float lr = 1e-3f;
  std::uint64_t seed = 1;
  Offload offload = Offload::Nvme;
  bool reference = false;  ///< everything resident in plain memory, no runtime
  /// Byte budgets; 0 picks the defaults that README documents (nvme: host = states / 4).
  std::size_t device_budget = 0;
  std::size_t host_budget = 0;
  std::string nvme_dir;  ///< empty: a temporary directory under /var/tmp, removed at the end
  std::string backend = "host";
  /// Rows of each layer per optimizer sub-group (Note [Sub-groups] in trainer.cpp); 0: the whole
  /// layer when its optimizer step fits the host budget, else the most rows that fit.
  int sub_group_rows = 0;
  std::vector<std::string> io_faults;     ///< tests: "write:N:enospc", ...
  std::function<void(int step)> on_step;  ///< called as each training step begins (tests)
  bool keep_state = false;                ///< return the final weights and moments (tests)
  bool quiet = true;
};

struct TrainResult {
  std::vector<double> losses;  ///< per step, before that step's update
  /// Per step, what it did, from its own spans (Note [Step bound] in step_bound.cpp).
  std::vector<StepPhases> steps;
  double step_s = 0;     ///< median of steps[i].step_s
  LinkBytes link_bytes;  ///< moved during the steps, from the telemetry's spans
  std::uint64_t bytes_nvme_read = 0, bytes_nvme_written = 0;  ///< during training (I/O engine)
  std::uint64_t peak_device_bytes = 0, peak_host_bytes = 0;
  std::uint64_t params = 0;       ///< weights and biases
  std::uint64_t state_bytes = 0;  ///< fp32 master weights + both moments
  std::size_t device_budget = 0;  ///< as used (defaults resolved)
  std::size_t host_budget = 0;
  int sub_group_rows = 0;     ///< as used: rows of W (and their biases) per sub-group
  int sub_groups = 1;         ///< per layer
  std::string stats_json;     ///< the runtime's stats at the end ("{}" for reference)
  std::string pipeline_json;  ///< the pipeline's stats ("{}" for reference)
  /// With keep_state, per layer at the end: the fp32 parameters (W [H, H] row-major, out x in,
  /// then b [H]) and the Adam moments [m | v].
  std::vector<std::vector<float>> final_params, final_moments;
};

/// The task, for checks written apart from the trainer: step `step`'s batch x [batch, hidden] and
/// its target (row-major), and layer `layer`'s initial parameters (as TrainResult::params).
void task_batch(const TrainConfig& config, int step, float* x, float* target);
std::vector<float> task_initial_params(const TrainConfig& config, int layer);

/// Trains and returns the losses and measurements. Throws strata::Error with a message naming
/// the problem for a working set that cannot fit a budget, an unusable NVMe directory or a
/// failed write-back; states already written stay where they were.
TrainResult train(const TrainConfig& config);

}  // namespace strata::examples
