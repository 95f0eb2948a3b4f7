// Runtime: the residency manager. Every tensor lives in the fastest tier that has room and moves
// between Device, Host (pinned) and Nvme when asked or when room is needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/io/io_engine.h"
#include "strata/io/swap_space.h"
#include "strata/runtime/backend.h"
#include "strata/runtime/config.h"
#include "strata/runtime/observer.h"
#include "strata/runtime/stats.h"
#include "strata/runtime/tensor.h"
#include "strata/runtime/tier.h"

namespace strata {

class Runtime;
class Telemetry;  // strata/runtime/telemetry.h
namespace detail {
class Statistics;
}

/// The right to use a tensor's bytes on one tier. While it lives the copy stays there (it is
/// never evicted or moved). Write access makes this copy the tensor's newest when the lease ends
/// (the copies on other tiers become stale and are never used again as they are). Move-only;
/// releasing twice is harmless. Thread-safe to release from any thread.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease() { release(); }

  /// Device tier: a device pointer (host-addressable on the host backend); Host tier: pinned.
  [[nodiscard]] void* data() const noexcept { return data_; }
  template <typename T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] TensorId tensor() const noexcept { return tensor_; }
  [[nodiscard]] Tier tier() const noexcept { return tier_; }
  [[nodiscard]] Access access() const noexcept { return access_; }
  [[nodiscard]] explicit operator bool() const noexcept { return runtime_ != nullptr; }
  /// The copy that brought the bytes to this tier, for a stream to wait on
  /// (stream.wait(*lease.event())); null when the bytes were already there. Device leases may be
  /// handed out while that copy is still running on its stream.
  [[nodiscard]] Event* event() const noexcept { return event_.get(); }
  /// Blocks the calling thread until the bytes are there.
  void wait() const;
  void release() noexcept;
  /// Ends the lease and, when it is the tensor's only one, discards the tensor's bytes
  /// (Runtime::discard) before anyone can evict and write them back. Returns false, having only
  /// released, when others lease it too or it is a read-only file mapping.
  bool discard();

 private:
  friend class Runtime;
  friend class LeaseFuture;
  Runtime* runtime_ = nullptr;
  void* data_ = nullptr;
  std::uint64_t bytes_ = 0;
  TensorId tensor_ = 0;
  Tier tier_ = Tier::Device;
  Access access_ = Access::Read;
  std::shared_ptr<Event> event_;
};

/// A lease to come. get() once. Destroying an unclaimed future gives the lease back.
class LeaseFuture {
 public:
  LeaseFuture() = default;
  LeaseFuture(LeaseFuture&& other) noexcept;
  LeaseFuture& operator=(LeaseFuture&& other) noexcept;
  ~LeaseFuture();
  /// Blocks until the lease can be used (device: the final copy is enqueued, see
  /// Lease::event(); host: the bytes are there). Rethrows a failed move (IoError, ...); the
  /// tensor keeps its other copies.
  Lease get();
  [[nodiscard]] bool ready() const;
  [[nodiscard]] bool valid() const noexcept { return runtime_ != nullptr; }

 private:
  friend class Runtime;
  Runtime* runtime_ = nullptr;
  TensorId tensor_ = 0;
  Tier tier_ = Tier::Device;
  Access access_ = Access::Read;
};

/// A copy that could be evicted from a tier.
struct EvictionCandidate {
  TensorId tensor = 0;
  std::uint64_t bytes = 0;
  std::uint64_t last_use = 0;  ///< a logical clock: larger is more recent
  bool dirty = false;          ///< evicting it costs a write-back
  /// A current copy on a faster tier stays: this copy is a duplicate, not needed while that one
  /// stays (Note [Duplicates go first]).
  bool above = false;
};

/// Chooses eviction victims. Called with the runtime's lock held: it must not call back into
/// the runtime.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  /// Index in `candidates` (never empty) of the copy to evict from `tier`.
  virtual std::size_t choose(Tier tier, const std::vector<EvictionCandidate>& candidates) = 0;
};

/// Least recently used first, a clean duplicate of a faster tier's copy before any other.
class LruPolicy final : public EvictionPolicy {
 public:
  std::size_t choose(Tier tier, const std::vector<EvictionCandidate>& candidates) override;
};

/// Farthest next use first (Belady), from a caller-supplied oracle — e.g. the scheduler's
/// schedule, a clean duplicate of a faster tier's copy before any other. Ties (and tensors with
/// no known next use) fall back to least recently used.
class FarthestNextUsePolicy final : public EvictionPolicy {
 public:
  /// Steps until `tensor` is next used; a huge value for never.
  using NextUse = std::function<std::uint64_t(TensorId tensor)>;
  explicit FarthestNextUsePolicy(NextUse next_use) : next_use_(std::move(next_use)) {}
  std::size_t choose(Tier tier, const std::vector<EvictionCandidate>& candidates) override;

 private:
  NextUse next_use_;
};

/// Contract:
/// - create_tensor() places a tensor (zeroed or from `init`) on its home tier; later it moves up
///   when acquired or prefetched and down when room is needed or evict() asks.
/// - acquire() returns a LeaseFuture; moves are asynchronous and ordered by events. A Write
///   (write-discard) lease moves nothing: the holder overwrites every byte. NVMe to
///   device is a pipeline of chunks through pinned staging (or through the tensor's host copy
///   when the host tier has room): the device copy of chunk k overlaps the NVMe read of k+1.
/// - Budgets are hard. A full tier evicts unleased copies chosen by the policy (LRU by
///   default); when free bytes suffice but no block does, unleased copies are slid together
///   (compaction) first. A clean victim is dropped (weights only read are never written back);
///   a dirty one is written to the tier below first, once. When everything is leased the error
///   names the tier, the bytes needed and the leased tensors with their sizes.
/// - A failed write-back (EIO, ENOSPC) leaves the tensor dirty where it was and reports the
///   error: nothing is lost. A failed load leaves the tensor's other copies as they were.
/// - Thread-safe: any thread may create, acquire, release, prefetch, evict and destroy.
///   Eviction write-backs run in the thread that needs the room.
class Runtime {
 public:
  explicit Runtime(RuntimeOptions options);
  static std::unique_ptr<Runtime> from_json(std::string_view json);
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  ~Runtime();

  /// A new tensor homed on `home`, holding `init` (desc.bytes bytes) or zeros.
  TensorId create_tensor(const TensorDesc& desc, Tier home, const void* init = nullptr);
  /// A new tensor homed on `home` with no bytes yet, as discard() leaves one: it takes no room
  /// and writes nothing until its first lease, which must be Access::Write (or a write()). For
  /// bytes made where they are used, e.g. a KV cache's next page, homed on NVMe and filled on
  /// the device: create_tensor() would first write zeros to NVMe that nobody reads.
  TensorId create_unwritten(const TensorDesc& desc, Tier home);
  /// A read-only tensor homed in an existing file (bytes at `offset`, any alignment): no copy is
  /// made and nothing is ever written back to the file. Needs nvme.paths.
  TensorId map_tensor(const TensorDesc& desc, const std::string& path, std::uint64_t offset);
  /// Frees every copy. Throws if the tensor is leased; waits for its moves in flight.
  void destroy_tensor(TensorId tensor);

  /// Brings the tensor to `tier` (Device or Host) and leases it there.
  LeaseFuture acquire(TensorId tensor, Tier tier, Access access);
  /// Starts moving the tensor to `tier` and returns (making room may evict first).
  void prefetch(TensorId tensor, Tier tier);
  /// Starts moving the tensor to the device even when the device holds no room for it beside
  /// `replaceable` copies that the caller will not need again soon (the current step's weights,
  /// for the next step's): its copy is placed over free space and over those copies' room; the
  /// free parts land at once, chunk by chunk, and each replaceable copy is dropped when its last
  /// lease ends (instead of staying resident), its part landing then (Note [Arrival in pieces]).
  /// Only clean copies not leased for writing are taken. A device lease on the tensor waits for
  /// the whole copy, and so does synchronize(): release the replaceable leases first, and ask for
  /// no more device room before (a step that still has tensors to lease must not be replaced).
  /// Returns true when the move started (or the tensor is there or on its way); false, having
  /// changed nothing, when even that finds no room. Never writes back.
  bool prefetch_replacing(TensorId tensor, const std::vector<TensorId>& replaceable);
  /// A speculative prefetch (staging ahead, e.g. NVMe -> host before the device has room): starts
  /// moving the tensor to `tier` (Device or Host) only if room can be made there by dropping
  /// clean copies that the eviction policy would give up before this one, never by a write-back
  /// and never by waiting. Returns true when the move started; false, having moved nothing, when
  /// it did not (no such room now, or the tensor is already on `tier` or a faster one, or on its
  /// way there).
  bool stage(TensorId tensor, Tier tier);
  /// Demotes: writes the copy on `tier` back below if it is the newest, then drops it. Blocks.
  /// Returns true when a write-back happened (false: the copy was clean, or not there).
  bool evict(TensorId tensor, Tier tier);
  /// Declares the tensor's bytes dead (a gradient the optimizer has consumed): every copy is
  /// dropped with no write-back, and its space freed. The next lease must be Access::Write (or a
  /// write()); reading before that is an error naming the tensor. Throws if it is leased or a
  /// read-only file mapping; waits for its moves in flight.
  void discard(TensorId tensor);
  [[nodiscard]] bool discarded(TensorId tensor) const;
  /// Copies the tensor's newest bytes to / from a user buffer, whichever tier holds them.
  void read(TensorId tensor, void* dst, std::size_t bytes);
  void write(TensorId tensor, const void* src, std::size_t bytes);
  /// Waits until no move is in flight.
  void synchronize();

  /// A copy of the tensor's descriptor (taken under the lock: valid after destroy_tensor).
  [[nodiscard]] TensorDesc describe(TensorId tensor) const;
  /// describe(tensor).bytes without copying the descriptor (planners ask it per step).
  [[nodiscard]] std::uint64_t tensor_bytes(TensorId tensor) const;
  /// The bytes its copy on `tier` takes: tensor_bytes(tensor), but a compressed tensor's host
  /// and NVMe copies hold its stored bytes (Note [Compressed copies]).
  [[nodiscard]] std::uint64_t tensor_bytes(TensorId tensor, Tier tier) const;
  /// True when `tier` holds the tensor's newest bytes (or is loading them).
  [[nodiscard]] bool resident(TensorId tensor, Tier tier) const;
  [[nodiscard]] std::vector<TensorId> tensors() const;
  [[nodiscard]] TierStats tier_stats(Tier tier) const;
  /// Bytes moved so far, per path (which tier to which).
  [[nodiscard]] TransferStats transfer_stats() const;
  [[nodiscard]] std::string stats_json() const;
  /// Every tensor's copies as JSON (state, version, ready, leases, pins, claims, moves in
  /// flight, arrivals in pieces): what to look at when a wait does not end.
  [[nodiscard]] std::string residency_json() const;
  void set_eviction_policy(std::shared_ptr<EvictionPolicy> policy);

  [[nodiscard]] Backend& backend() noexcept;
  /// The trace of copies, I/O, evictions and occupancy (include strata/runtime/telemetry.h).
  [[nodiscard]] Telemetry& telemetry() noexcept;
  /// Adds an observer of the residency core's events (observer.h), beside the statistics and the
  /// trace; it lives as long as the Runtime. At most 6 may be added.
  void add_observer(std::shared_ptr<Observer> observer);
  /// Null when no NVMe tier is configured.
  [[nodiscard]] IoEngine* io() noexcept;
  [[nodiscard]] SwapSpace* swap() noexcept;
  [[nodiscard]] const RuntimeOptions& options() const noexcept;

 private:
  friend class Lease;
  friend class LeaseFuture;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<Telemetry> telemetry_;
  std::shared_ptr<detail::Statistics> statistics_;
};

}  // namespace strata
