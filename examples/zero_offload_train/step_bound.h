// The lower bound of one training step, derived from that same step's own spans: the compute
// the trainer ran and the busy time of each link the runtime's telemetry recorded
// (Note [Step bound] in step_bound.cpp says what the step does and why this is its critical path).
#pragma once

#include <cstdint>
#include <vector>

#include "strata/runtime/telemetry.h"

namespace strata::examples {

/// One step's window on the telemetry clock: [start_ns, backward_ns) is the forward part (batch,
/// forward of every layer, loss), [backward_ns, end_ns) the backward part (backward of every
/// layer beside Adam of the one above, and end_iteration's wait for the write-backs).
struct StepWindow {
  std::uint64_t start_ns = 0;
  std::uint64_t backward_ns = 0;
  std::uint64_t end_ns = 0;
};

/// Busy time of one link in the two parts of a step: the union of its spans, clipped to each.
struct LinkBusy {
  double forward_s = 0;
  double backward_s = 0;
};

/// What one step did, in seconds. Compute times are sums of the step's spans; link times are
/// busy times (at least one of the link's spans open), so a link's queue depth is not counted
/// twice.
struct StepPhases {
  double step_s = 0;
  double prep_s = 0;     ///< the batch made on the host and copied to the device
  double forward_s = 0;  ///< every layer's forward kernel
  double loss_s = 0;
  double backward_s = 0;   ///< every layer's backward kernel (the trainer's thread)
  double optimizer_s = 0;  ///< every layer's Adam (the optimizer's thread)
  /// Per backward segment, the longer of its backward and its Adam (they run side by side and
  /// both end before the next segment begins), summed; backward_s + optimizer_s when the two
  /// run one after the other (the in-memory reference).
  double backward_optimizer_s = 0;
  LinkBusy nvme;  ///< the drive: NVMe reads and writes together
  LinkBusy host_to_device;
  LinkBusy device_to_host;

  /// max(prep + forward + loss, each link's busy time in the forward part).
  [[nodiscard]] double forward_part_s() const;
  /// max(backward_optimizer, each link's busy time in the backward part).
  [[nodiscard]] double backward_part_s() const;
  /// forward_part_s() + backward_part_s(): no schedule of this step's work, as it was placed,
  /// ends sooner.
  [[nodiscard]] double bound_s() const;
};

/// Wall time in [from_ns, to_ns) during which at least one span was open, in seconds.
double busy_s(std::vector<TraceEvent> spans, std::uint64_t from_ns, std::uint64_t to_ns);

/// Fills `phases.nvme`, `host_to_device` and `device_to_host` from the telemetry's events.
void add_link_busy(const std::vector<TraceEvent>& events, const StepWindow& window,
                   StepPhases& phases);

/// Bytes each link moved in spans that ended inside one of `windows`, named after the path.
struct LinkBytes {
  std::uint64_t nvme_read = 0;  ///< NVMe to host memory (a host copy, a staging slot or a
                                ///< host-addressable device copy)
  std::uint64_t nvme_write = 0;
  std::uint64_t host_to_device = 0;
  std::uint64_t device_to_host = 0;
};
LinkBytes link_bytes(const std::vector<TraceEvent>& events, const std::vector<StepWindow>& windows);

}  // namespace strata::examples
