// Telemetry: per-tier counters and a bounded ring of timed events (copies, I/O, evictions,
// compute spans, occupancy changes), exportable as Chrome trace JSON (Perfetto,
// chrome://tracing) and as a JSON stats object.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "strata/runtime/tier.h"

namespace strata {

/// The lanes a timeline shows; each is a track in the Chrome trace.
enum class Track : std::uint8_t { Compute, H2D, D2H, D2D, NvmeRead, NvmeWrite, Eviction, Count };
std::string_view to_string(Track track) noexcept;

struct TraceEvent {
  std::uint64_t start_ns = 0;  ///< steady clock, since the telemetry's creation
  std::uint64_t end_ns = 0;
  Track track = Track::Compute;
  std::uint64_t bytes = 0;
  std::uint64_t tensor = 0;
  std::uint64_t name_id = 0;  ///< compute spans: an index the caller chose (step number)
};

struct OccupancySample {
  std::uint64_t time_ns = 0;
  Tier tier = Tier::Device;
  std::uint64_t used_bytes = 0;
};

/// Counters of one tier. Bytes are the tensors' bytes.
struct TierStats {
  std::uint64_t capacity_bytes = 0;
  std::uint64_t used_bytes = 0;
  std::uint64_t peak_bytes = 0;
  std::uint64_t leased_bytes = 0;
  std::uint64_t bytes_in = 0;     ///< moved into this tier
  std::uint64_t bytes_out = 0;    ///< written back from this tier to the one below
  std::uint64_t moves = 0;        ///< copies that arrived in this tier
  std::uint64_t evictions = 0;    ///< copies dropped or demoted to make room (or asked)
  std::uint64_t write_backs = 0;  ///< dirty copies written to the tier below
  std::uint64_t hits = 0;         ///< acquires that found a current copy
  std::uint64_t misses = 0;       ///< acquires that had to move the tensor
  std::uint64_t compactions = 0;  ///< copies slid to close holes
};

/// Bytes moved, named after the path they took: NVMe chunks landing in a kept host copy count as
/// nvme_to_host and then host_to_device; chunks through staging slots or landing in the device
/// copy directly (Note [Direct NVMe to device]) count as nvme_to_device.
struct TransferStats {
  std::uint64_t bytes_host_to_device = 0;
  std::uint64_t bytes_device_to_host = 0;
  std::uint64_t bytes_nvme_to_host = 0;
  std::uint64_t bytes_host_to_nvme = 0;
  std::uint64_t bytes_nvme_to_device = 0;
  std::uint64_t bytes_device_to_nvme = 0;
};

/// Thread-safe. record() takes a short lock (one per copy or I/O, never per byte); when the ring
/// is full the oldest events are overwritten and counted as dropped.
class Telemetry {
 public:
  explicit Telemetry(std::size_t capacity);

  /// Nanoseconds since this telemetry was created (steady clock).
  [[nodiscard]] std::uint64_t now_ns() const noexcept;
  void record(const TraceEvent& event);
  void occupancy(Tier tier, std::uint64_t used_bytes);

  [[nodiscard]] std::vector<TraceEvent> events() const;
  [[nodiscard]] std::vector<OccupancySample> occupancy_samples() const;
  [[nodiscard]] std::uint64_t dropped() const;
  void clear();

  /// Chrome trace JSON: one track per stream and I/O queue, counters for tier occupancy.
  [[nodiscard]] std::string chrome_trace_json() const;
  /// Writes chrome_trace_json() to `path`; throws IoError naming the path.
  void write_chrome_trace(const std::string& path) const;

 private:
  std::uint64_t origin_ns_;
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::vector<TraceEvent> ring_;
  std::size_t next_ = 0;
  std::uint64_t dropped_ = 0;
  std::vector<OccupancySample> occupancy_;
  std::size_t occupancy_next_ = 0;
};

}  // namespace strata
