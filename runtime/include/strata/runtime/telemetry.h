// Telemetry: a bounded ring of timed events (copies, I/O, evictions, compute spans, occupancy
// changes), exportable as Chrome trace JSON (Perfetto, chrome://tracing). It hears the residency
// core as an Observer (observer.h); compute spans come from the caller (record()).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "strata/runtime/observer.h"
#include "strata/runtime/stats.h"
#include "strata/runtime/tier.h"

namespace strata {

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

/// Thread-safe. record() takes a short lock (one per copy or I/O, never per byte); when the ring
/// is full the oldest events are overwritten and counted as dropped.
class Telemetry final : public Observer {
 public:
  explicit Telemetry(std::size_t capacity);

  /// Nanoseconds since this telemetry was created (steady clock).
  [[nodiscard]] std::uint64_t now_ns() const noexcept;
  /// `ns`, a steady_ns() reading, on this telemetry's clock (0 before its creation).
  [[nodiscard]] std::uint64_t since_origin(std::uint64_t ns) const noexcept {
    return ns > origin_ns_ ? ns - origin_ns_ : 0;
  }
  void record(const TraceEvent& event) noexcept;

  // Observer: the core's spans, evictions (instants on the eviction track) and occupancy.
  void span(Track track, std::uint64_t start_ns, std::uint64_t end_ns, std::uint64_t bytes,
            TensorId tensor) noexcept override;
  void evicted(TensorId tensor, std::uint64_t bytes, Tier tier) noexcept override;
  void occupancy(Tier tier, std::uint64_t used_bytes) noexcept override;

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
