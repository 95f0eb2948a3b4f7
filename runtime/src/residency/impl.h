// Runtime::Impl, the residency core: the tensor table, per-tier space, the moves between tiers
// and the leases, under one mutex. Copies and I/O run outside the mutex and report back through
// callbacks that take it briefly. This header declares the core's state and operations; each
// group is defined in the file its heading names (all under runtime/src/residency/):
//   table.cpp           construction, lookups, tier facts, occupancy
//   space.cpp           allocating, freeing, compacting, making room by eviction and write-back
//   arrival.cpp         a device copy that lands in pieces over copies it replaces
//   moves.cpp           starting a move between two tiers and finishing it
//   transport.cpp       the ways across, one per pair of tiers (stream copies, one I/O)
//   chunk_pipeline.cpp  NVMe <-> device moves (and host -> device in pieces) chunk by chunk
//   requests.cpp        making a tier hold a tensor's newest bytes; discarding them
//   leases.cpp          Lease and LeaseFuture, and ending a lease
// The public API (runtime/src/runtime.cpp) takes the mutex and calls these.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "state.h"
#include "strata/runtime/memory_pool.h"
#include "strata/runtime/observer.h"
#include "strata/runtime/runtime.h"

namespace strata {

struct Runtime::Impl {
  using CopyState = residency::CopyState;
  using Copy = residency::Copy;
  using TensorState = residency::TensorState;
  static constexpr std::size_t kTiers = residency::kTiers;

  struct Pipeline;

  RuntimeOptions options;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<IoEngine> io;
  std::unique_ptr<SwapSpace> swap;
  PinnedBuffer slab;
  std::unique_ptr<MemoryPool> host_pool;
  std::vector<std::byte*> staging_free;
  std::deque<std::shared_ptr<Pipeline>> staging_waiters;
  // Note [Arrival in pieces]: device copies whose block is still partly held by claimed copies.
  struct Arrival {
    std::byte* base = nullptr;
    std::size_t bytes = 0;  // the block's size (rounded to the device granule)
    std::vector<std::pair<std::size_t, std::size_t>> owned;  // pool blocks held: [offset, length)
    std::shared_ptr<Pipeline> pipeline;                      // the move landing in it, once started
  };
  std::unordered_map<TensorId, Arrival> arrivals;

  mutable std::mutex mutex;
  // Note [Waits]: one condition variable per kind of wait, each notified only by the events that
  // can end that kind, so a lease's release or a chunk landing does not wake every waiter:
  //   ready_cv   a copy became ready for its leases, or failed    LeaseFuture::get
  //   drained    the last move in flight finished                 synchronize, ~Impl
  //   unpinned   a copy's pins reached zero                       waits on pins alone
  //   settled    a move finished, a pin or a copy went, a write   waits on a copy's state:
  //              ended                                            ensure, evict, read, write,
  //                                                               write_back, idle()
  //   room       space may have come free, or a copy may have     make_room
  //              become evictable (a move, a pin, a lease ended)
  // A waiter whose predicate mixes kinds waits on the one its every event notifies (settled
  // hears unpins too). on_moved(), on_gone() and unpin() notify; nothing else does, except the
  // chunk pipeline's ready_cv and end_lease's room.
  std::condition_variable ready_cv, drained, unpinned, settled, room;
  std::unordered_map<TensorId, std::unique_ptr<TensorState>> tensors;
  TensorId next_id = 1;
  std::uint64_t clock = 0;
  int moves_in_flight = 0;
  std::shared_ptr<EvictionPolicy> policy = std::make_shared<LruPolicy>();
  std::atomic<std::uint64_t> h2d_last_ns{0}, d2h_last_ns{0};
  // Observers (observer.h): the Runtime's statistics and trace, then add_observer's. Append-only
  // (appends take `mutex`), so notify() reads them without a lock from any thread: a slot is
  // written before the count that shows it.
  static constexpr std::size_t kMaxObservers = 8;
  std::array<Observer*, kMaxObservers> observer_slots{};
  std::atomic<std::size_t> observer_count{0};
  std::vector<std::shared_ptr<Observer>> observer_owners;
  // I/O submissions queued while the lock was held; run by the caller after unlocking (an I/O
  // completion may run inline on failure and take the lock).
  std::vector<std::function<void()>> io_after_unlock_;

  // ---- table.cpp (lock held, except the constructor, the destructor and notify) ----

  explicit Impl(RuntimeOptions o);
  ~Impl();
  TensorState& get(TensorId id);
  bool has_tier(Tier t) const { return t != Tier::Nvme || swap != nullptr; }
  void require_tier(Tier t, const char* what) const;
  std::uint64_t used(Tier t) const;
  void note_occupancy(Tier t);
  // Ends one pin of `c` (a move's source, or a copy kept while room is made); the last one wakes
  // whoever waits for the copy to be free of pins (evict, discard, write). Every unpin goes
  // through here: a decrement without the wake-up left evict() and discard() asleep on a
  // condition that had become true (the ZeRO pipeline test hung about once in 200 runs).
  void unpin(Copy& c) {
    if (--c.pins == 0) {
      unpinned.notify_all();
      settled.notify_all();
      room.notify_all();
    }
  }
  // A move finished (landed or failed; moves_in_flight already counts it out).
  void on_moved() {
    ready_cv.notify_all();
    settled.notify_all();
    room.notify_all();
    if (moves_in_flight == 0) drained.notify_all();
  }
  // A copy was freed, stopped being written back, or was written: states and room changed.
  void on_gone() {
    settled.notify_all();
    room.notify_all();
  }
  // A current copy with no current copy below it: evicting it needs a write-back.
  bool dirty(const TensorState& t, Tier tier) const;
  // The tier a dirty copy on `tier` is written back to; nullopt when there is none.
  std::optional<Tier> below(Tier tier) const;
  MemoryPool* pool(Tier t);
  void add_observer(std::shared_ptr<Observer> observer);
  // Tells every observer: notify([&](Observer& o) { o.evicted(...); }). Any thread, any lock.
  template <class F>
  void notify(F&& tell) const noexcept {
    const std::size_t n = observer_count.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i)
      tell(*observer_slots[i]);
  }
  void requested(const TensorState& t, Tier tier, bool hit) const noexcept {
    notify([&](Observer& o) { o.requested(t.id, tier, hit); });
  }
  // A span on `track` that began at `start` (steady_ns()) and ends now.
  void span(Track track, std::uint64_t start, std::uint64_t bytes, TensorId id) const noexcept;
  // The tier a move into `dst` reads from: a current copy, settled ones first.
  Tier source_for(const TensorState& t, Tier dst) const;

  // ---- space.cpp (lock held) ----

  bool try_alloc(TensorState& t, Tier tier);
  // Frees t's copy on `tier` (no write-back); a device copy claimed for an arrival in pieces
  // grants its room to the claimant.
  void free_space(TensorState& t, Tier tier);
  std::vector<TensorState*> evictable(Tier tier, const TensorState& exclude);
  [[noreturn]] void out_of_memory(Tier tier, const TensorState& t);
  // Free bytes on `tier`, and the largest free run.
  std::pair<std::uint64_t, std::uint64_t> free_on(Tier tier);
  // Note [Compaction without the lock]: slides one unleased copy down into the hole before it,
  // copying with the lock released. False when no copy can slide.
  bool compact(std::unique_lock<std::mutex>& lock, Tier tier);
  // Runtime::stage: room for t's copy on `tier` from a free block or clean copies the policy
  // ranks before t itself (t is shown to it as a candidate: if it would go first, the staging
  // would evict something needed sooner). Never writes back, compacts or waits.
  bool stage(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier);
  // Note [A device prefetch does not wait for NVMe]: for a device prefetch of compressed t whose
  // host copy is not current, starts the host load (or finds it landing) and begins the device
  // move behind it, in room made (`wait_for_room`: make_room, which may wait) or free
  // (try_alloc). `started`: the device copy is on its way; `host_current`: the caller loads it
  // the usual way; `not_started`: no room without waiting, or the host load failed at once.
  enum class Chained : std::uint8_t { started, host_current, not_started };
  Chained chain_through_host(std::unique_lock<std::mutex>& lock, TensorState& t,
                             bool wait_for_room);

  // ---- room.cpp (Note [Making room]; lock held) ----

  // Makes space for t's copy on `tier`: a free block, else compaction when the free bytes would
  // hold it, else evictions (dirty victims written back first). Blocks; may release the lock.
  // `keep`: t's copy there (a load's source) is pinned while room is made, and making room does
  // not wait for that pin.
  void make_room(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier,
                 std::optional<Tier> keep = std::nullopt);
  // Drops t's copy on `tier`, writing it back below first when it is dirty (to the host, or to
  // NVMe when the host cannot take it). Blocks; may release the lock.
  void evict_copy(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier);
  struct RoomFrame;
  // Runs the frames until none is left; on an error, undoes them (unwind) and rethrows.
  void run_frames(std::unique_lock<std::mutex>& lock, std::vector<RoomFrame>& frames);
  // Pops frames down to `keep`, each marked victim Valid again (still dirty, still there).
  void unwind(std::vector<RoomFrame>& frames, std::size_t keep);
  // In a catch of the OutOfMemoryError of t's room on `tier` with clean victims only: throws one
  // for t on `tier` (what was asked) naming both it and `below`, the dirty victim's write-back
  // that found no room.
  [[noreturn]] void rethrow_for(const TensorState* t, Tier tier, std::exception_ptr below);
  void room_step(std::unique_lock<std::mutex>& lock, std::vector<RoomFrame>& frames);
  void evict_step(std::unique_lock<std::mutex>& lock, std::vector<RoomFrame>& frames);

  // ---- arrival.cpp (Note [Arrival in pieces]; lock held) ----

  // Runtime::prefetch_replacing.
  bool prefetch_replacing(std::unique_lock<std::mutex>& lock, TensorState& t,
                          const std::vector<TensorId>& replaceable);
  // Takes every free part of the claimant's block; starts its chunks now in room.
  void grant(TensorId claimant);
  // Is [from, to) of the tensor's device copy held (not waiting for a claimed copy)?
  bool held(TensorId id, std::size_t from, std::size_t to) const;
  // A claim that failed (drop_claimed) with nothing of its move in flight: finish it now. May
  // unlock.
  void finish_failed_arrival(std::unique_lock<std::mutex>& lock, TensorId claimant);
  // A claimed device copy goes once it has landed, its leases have ended and no move reads it.
  static bool droppable(const TensorState& o);
  // Drops o's device copy if it is claimed and droppable, and finishes the claimant's move if
  // that made it fail with nothing in flight. Returns with the lock held; true if it dropped.
  bool drop_if_claimed(std::unique_lock<std::mutex>& lock, TensorState& o);
  // A claimed copy whose last lease ended: dropped (clean), its room granted to the claimant;
  // if a write made it dirty meanwhile, the claim fails instead and the copy stays.
  void drop_claimed(TensorState& o);

  // ---- moves.cpp ----

  // Starts moving t's newest bytes from `src` into its (allocated) copy on `dst` by the way
  // across (transport.cpp). Lock held; I/O is queued for run_after_unlock.
  void start_load(std::unique_lock<std::mutex>& lock, TensorState& t, Tier dst, Tier src);
  // start_load's two halves: the records (dst Loading, a move in flight; the source is not
  // pinned) and the carrying (the way across, or the chunk pipeline of an arrival in pieces).
  void begin_move(TensorState& t, Tier dst, Tier src);
  void carry(TensorState& t, Tier dst, Tier src);
  // A move into `dst` failed: the copy keeps the error; its room goes unless leases wait on it.
  void fail_landing(TensorState& t, Tier dst, std::exception_ptr error);
  // Completion of a move into `dst` (any thread; takes the lock).
  // `via`: the tier the bytes passed through on the way (a kept host copy), if any.
  void finish_move(TensorState& t, Tier dst, Tier src, std::exception_ptr error,
                   std::uint64_t version, std::optional<Tier> via = std::nullopt);
  // Runs io_after_unlock_ with the lock released; returns with it held.
  void run_after_unlock(std::unique_lock<std::mutex>& lock);

  // ---- transport.cpp (lock held) ----

  // A way across: carries a begun move of t's bytes (at `version`) from its `src` copy into its
  // `dst` copy, and calls finish_move when they land. Queues I/O for after the unlock.
  using Way = void (Impl::*)(TensorState& t, Tier dst, Tier src, std::uint64_t version);
  // The way from `src` to `dst`; null when there is none (the same tier).
  static Way way_across(Tier src, Tier dst);
  // Device <-> host: one copy on the h2d or d2h stream.
  void copy_on_stream(TensorState& t, Tier dst, Tier src, std::uint64_t version);
  // Note [Compressed copies]: the dequantization of compressed t's host copy.
  static Stream::DequantJob dequant_job(const TensorState& t);
  // Host <-> NVMe: one read or write of the whole extent.
  void one_io(TensorState& t, Tier dst, Tier src, std::uint64_t version);
  // Records a stream copy's span: it began when the previous work on its stream finished.
  // Returns its length in ns.
  std::uint64_t stream_span(std::atomic<std::uint64_t>& last, Track track, std::uint64_t enqueued,
                            std::uint64_t bytes, TensorId id);

  // ---- chunk_pipeline.cpp (Note [Chunk pipeline]; lock held) ----

  // One chunked move in flight.
  struct Pipeline {
    TensorState* t = nullptr;
    bool down = true;  // Nvme -> Device
    Tier dst = Tier::Device, src = Tier::Nvme;
    std::uint64_t version = 0;
    ExtentId extent = 0;
    std::byte* device = nullptr;
    std::byte* host = nullptr;  // landing in the host copy, or null for staging
    bool direct = false;        // Note [Direct NVMe to device]: landing in the device copy
    const std::byte* from_host = nullptr;  // Note [Arrival in pieces]: host -> device in chunks
    std::uint64_t bytes = 0, chunk = 0;
    std::size_t chunks = 0, launched = 0, enqueued = 0, done = 0, in_flight = 0, max_in_flight = 2;
    std::vector<bool> started;      // chunks launched (in order, except while room is arriving)
    std::vector<std::byte*> slots;  // staging slots held and free for the next chunk
    std::exception_ptr error;
    std::shared_ptr<Event> event;
    bool finished = false;  // chunk_done finished it: finish_move runs once
  };
  // The way across for NVMe <-> device (and host -> device in pieces).
  void start_pipeline(TensorState& t, Tier dst, Tier src, std::uint64_t version);
  // The first chunk not launched whose device room is held; chunks() when there is none.
  std::size_t next_chunk(const Pipeline& p) const;
  // Starts as many chunks as slots and held room allow (lock held; I/O queued for after unlock).
  void pump(const std::shared_ptr<Pipeline>& p);
  void give_back_slot(const std::shared_ptr<Pipeline>& p, std::byte* slot);
  // Copies a chunk from host memory (`landing`) up into the device copy on the h2d stream; the
  // last one enqueued records the event device leases wait on.
  void copy_chunk_up(const std::shared_ptr<Pipeline>& p, std::uint64_t offset, std::byte* landing,
                     std::size_t len);
  void launch_chunk(const std::shared_ptr<Pipeline>& p, std::size_t k, std::byte* landing);
  // After a chunk: run queued I/O, and finish the pipeline when nothing is left in flight.
  void chunk_done(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Pipeline>& p);

  // ---- leases.cpp ----

  // Ends one lease on `tier` of `tensor`, held with `held` access (takes the lock). `wrote`: the
  // holder wrote its bytes (a Lease released, not a LeaseFuture dropped unclaimed), so the
  // tensor's version moves on (Note [Versions]).
  void end_lease(TensorId tensor, Tier tier, Access held, bool wrote) noexcept;

  // ---- requests.cpp (lock held) ----

  // Leases on `t` other than one on `own` (the caller's).
  static bool leased_elsewhere(const TensorState& t, Tier own);
  // Frees every copy of `t` with no write-back and marks it discarded. `own`, when not null, is
  // the caller's lease on it, which ends here; while the moves in flight finish, that lease keeps
  // anyone from evicting (and so writing back) the dead bytes. False when someone else leased it
  // meanwhile (then nothing changed); throws for a mapping or other leases without `own`.
  bool discard(std::unique_lock<std::mutex>& lock, TensorState& t, Lease* own);
  // Makes `tier` hold (or receive) the tensor's newest bytes (starting a move if needed);
  // returns with space reserved. `access` Write only makes space (write-discard); `prefetch`
  // requests are dropped for discarded tensors instead of failing. `lease`: the copy is leased
  // (Note [A lease is taken before the unlock]).
  void ensure(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier, bool count,
              Access access, bool prefetch = false, bool lease = false);
};

}  // namespace strata
