// What the residency core reports, and to whom: an Observer hears a few named events (a span
// of a copy or I/O, a copy landing, an eviction, a write-back, a request's hit or miss, a
// compaction, a tier's occupancy). The Runtime's statistics and its trace (Telemetry) are
// observers; Runtime::add_observer adds others (a progress bar, a test's recorder). The core
// includes this header and nothing of telemetry.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

#include "strata/runtime/tensor.h"
#include "strata/runtime/tier.h"

namespace strata {

/// The lanes a timeline shows; each is a track in the Chrome trace.
enum class Track : std::uint8_t {
  Compute,
  H2D,
  D2H,
  D2D,
  NvmeRead,
  NvmeWrite,
  Eviction,
  Dequant,  ///< a compressed copy dequantized into its device copy
  Count
};
std::string_view to_string(Track track) noexcept;

/// The clock every span is measured on: nanoseconds of std::chrono::steady_clock.
inline std::uint64_t steady_ns() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

/// Called on whichever thread did the work (a caller, a stream's worker, an I/O completion),
/// sometimes with the residency core's lock held: a method must be quick, thread-safe, must not
/// throw and must not call back into the Runtime. Every method does nothing by default. Bytes
/// are the tensor's bytes (or a chunk's, for spans of a chunked move).
class Observer {
 public:
  virtual ~Observer() = default;
  /// A copy on a stream or an I/O request finished: it ran over [start_ns, end_ns) of
  /// steady_ns(). `track` names the link (H2D, D2H, NvmeRead, NvmeWrite).
  virtual void span(Track track, std::uint64_t start_ns, std::uint64_t end_ns, std::uint64_t bytes,
                    TensorId tensor) noexcept {
    (void)track, (void)start_ns, (void)end_ns, (void)bytes, (void)tensor;
  }
  /// A copy of the tensor landed on `to`, read from `from`. A move that passes through a kept
  /// host copy lands twice (Nvme -> Host, then Host -> Device).
  virtual void landed(TensorId tensor, std::uint64_t bytes, Tier from, Tier to) noexcept {
    (void)tensor, (void)bytes, (void)from, (void)to;
  }
  /// A compressed tensor's copy (Note [Compressed copies]) landed on `to` with `stored_bytes`
  /// moved (reported beside landed(), which counts the same bytes); on the device it was
  /// dequantized into `bytes`, the stream busy with that for `dequant_ns` (an arrival in pieces
  /// sums its chunks'; 0 elsewhere). The trace has each dequantization's span.
  virtual void landed_compressed(TensorId tensor, std::uint64_t stored_bytes, std::uint64_t bytes,
                                 Tier to, std::uint64_t dequant_ns) noexcept {
    (void)tensor, (void)stored_bytes, (void)bytes, (void)to, (void)dequant_ns;
  }
  /// The tensor's copy on `tier` was dropped to make room (or because it was asked to be).
  virtual void evicted(TensorId tensor, std::uint64_t bytes, Tier tier) noexcept {
    (void)tensor, (void)bytes, (void)tier;
  }
  /// The tensor's dirty copy on `from` was written to the tier below.
  virtual void written_back(TensorId tensor, std::uint64_t bytes, Tier from) noexcept {
    (void)tensor, (void)bytes, (void)from;
  }
  /// A lease or prefetch asked `tier` for a tensor: `hit` when it was there or on its way.
  virtual void requested(TensorId tensor, Tier tier, bool hit) noexcept {
    (void)tensor, (void)tier, (void)hit;
  }
  /// The tensor's copy on `tier` slid down into a hole before it.
  virtual void compacted(TensorId tensor, std::uint64_t bytes, Tier tier) noexcept {
    (void)tensor, (void)bytes, (void)tier;
  }
  /// `tier` now holds `used_bytes` (after an allocation or a free).
  virtual void occupancy(Tier tier, std::uint64_t used_bytes) noexcept {
    (void)tier, (void)used_bytes;
  }
};

}  // namespace strata
