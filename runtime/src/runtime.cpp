// The residency manager. One mutex guards all residency state; copies and I/O run outside it and
// report back through callbacks that take it briefly.
//
// Note [Versions]: a tensor has a version, bumped when a write lease ends (or write()). Each copy
// records the version it holds. A copy is current when its version equals the tensor's; a stale
// copy is never used as a source and may be dropped at no cost. A current copy is dirty when no
// lower tier holds a current copy: evicting it needs a write-back first. This replaces per-tier
// dirty flags and makes "write back once" hold by construction: after a write-back the lower
// copy is current, so the upper one is clean until the next write.
#include "strata/runtime/runtime.h"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "strata/io/device_limits.h"
#include "strata/io/error.h"
#include "strata/io/pages.h"
#include "strata/io/units.h"

namespace strata {

// ---------------------------------------------------------------------------------------------
// Policies

std::size_t LruPolicy::choose(Tier, const std::vector<EvictionCandidate>& c) {
  return static_cast<std::size_t>(
      std::min_element(c.begin(), c.end(),
                       [](const auto& a, const auto& b) { return a.last_use < b.last_use; }) -
      c.begin());
}

std::size_t FarthestNextUsePolicy::choose(Tier, const std::vector<EvictionCandidate>& c) {
  std::size_t best = 0;
  std::uint64_t best_next = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    const std::uint64_t next = next_use_(c[i].tensor);
    if (i == 0 || next > best_next || (next == best_next && c[i].last_use < c[best].last_use)) {
      best = i;
      best_next = next;
    }
  }
  return best;
}

// Note [One move into a copy]: a move starts only into a copy that is neither Loading nor
// Evicting nor current already. A second move into a Loading copy races with the first: the
// first's completion marks the copy Valid and hands out leases (LeaseFuture::get) while the
// second is still writing the same bytes, and the second overwrites whatever a write lease put
// there meanwhile (unseen by Note [Versions]: it records the newer version). A move into a
// current copy rewrites bytes that leases may be using; one into an Evicting copy rewrites bytes
// its write-back is reading, and evict_copy then frees the block under it. ensure() checks this
// after its make_room; write_back() must too, because its make_room may wait with the lock
// released (the host is full and its victims go to NVMe) while a lease or prefetch on the lower
// tier starts, and lands, the same device -> host move. The ZeRO-Offload example did exactly
// that: Adam read a gradient's host lease while the d2h stream rewrote it.

// ---------------------------------------------------------------------------------------------
// State

namespace {

enum class CopyState : std::uint8_t { Absent, Loading, Valid, Evicting };
constexpr std::size_t kTiers = 3;
constexpr std::size_t idx(Tier t) {
  return static_cast<std::size_t>(t);
}

struct Copy {
  CopyState state = CopyState::Absent;
  std::uint64_t version = 0;
  std::byte* ptr = nullptr;  // device / host space
  ExtentId extent = 0;       // nvme space
  bool mapped = false;       // nvme: a read-only mapping of a file
  unsigned leases = 0;
  unsigned write_leases = 0;  // of `leases`, those that write
  unsigned pins = 0;          // sources of moves in flight
  TensorId claimed_by = 0;    // Note [Arrival in pieces]: dropped for it when its leases end
  bool ready = false;         // a lease may be handed out
  std::shared_ptr<Event> event;
  std::exception_ptr error;  // the last load failed
  std::uint64_t last_use = 0;
  [[nodiscard]] bool has_space() const { return ptr != nullptr || extent != 0; }
};

struct TensorState {
  TensorId id = 0;
  TensorDesc desc;
  Tier home = Tier::Host;
  std::uint64_t version = 1;
  std::array<Copy, kTiers> copies;
  int moves = 0;           // in flight
  bool discarded = false;  // no bytes anywhere until the next write
  [[nodiscard]] bool current(Tier t) const {
    const Copy& c = copies[idx(t)];
    return (c.state == CopyState::Valid || c.state == CopyState::Evicting) && c.version == version;
  }
};

}  // namespace

struct Runtime::Impl {
  struct Pipeline;

  RuntimeOptions options;
  Telemetry telemetry;
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
  std::condition_variable changed;
  std::unordered_map<TensorId, std::unique_ptr<TensorState>> tensors;
  TensorId next_id = 1;
  std::uint64_t clock = 0;
  int moves_in_flight = 0;
  std::array<TierStats, kTiers> stats{};
  std::array<std::array<std::uint64_t, kTiers>, kTiers> path_bytes{};  // [from][to]
  std::shared_ptr<EvictionPolicy> policy = std::make_shared<LruPolicy>();
  std::atomic<std::uint64_t> h2d_last_ns{0}, d2h_last_ns{0};

  explicit Impl(RuntimeOptions o) : options(std::move(o)), telemetry(options.trace_events) {
    options.validate();
    options.backend.quiet = options.backend.quiet || options.quiet;
    backend = make_backend(options.backend);
    // One pinned slab: staging slots at its start, the host tier after them.
    slab = backend->allocate_pinned(options.host_budget_bytes);
    const std::size_t staging = options.staging_chunk_bytes * options.staging_chunks;
    for (unsigned i = 0; i < options.staging_chunks; ++i)
      staging_free.push_back(static_cast<std::byte*>(slab.data()) +
                             i * options.staging_chunk_bytes);
    host_pool = std::make_unique<MemoryPool>(std::string(to_string(Tier::Host)),
                                             static_cast<std::byte*>(slab.data()) + staging,
                                             options.host_budget_bytes - staging, kPageBytes);
    if (!options.nvme.paths.empty()) {
      options.io.quiet = options.io.quiet || options.quiet;
      io = make_io_engine(options.io);
      io->register_buffer(slab.data(), slab.size(), contiguous_run_bytes(slab.data(), slab.size()));
      // Note [Direct NVMe to device]: reads may land in a host-addressable device's memory;
      // registered only to size their chunks (a lazily touched arena is not pinned).
      if (backend->info().host_addressable)
        io->register_buffer(backend->device_pool().base(), backend->info().budget_bytes,
                            backend->info().host_run_bytes, /*fixed=*/false);
      options.nvme.checksums = options.checksums;
      options.nvme.direct = options.io.direct;
      swap = std::make_unique<SwapSpace>(options.nvme, *io);
    }
    stats[idx(Tier::Device)].capacity_bytes = backend->info().budget_bytes;
    stats[idx(Tier::Host)].capacity_bytes = host_pool->capacity();
    stats[idx(Tier::Nvme)].capacity_bytes = swap ? swap->stats().capacity_bytes : 0;
    if (options.eviction == EvictionKind::FarthestNextUse) {
      // Until a schedule supplies next uses (the scheduler sets its own policy), every tensor
      // is equally far: the policy then falls back to least recently used.
      policy = std::make_shared<FarthestNextUsePolicy>(
          [](TensorId) { return std::numeric_limits<std::uint64_t>::max(); });
    }
  }

  ~Impl() {
    {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] { return moves_in_flight == 0; });
    }
    backend->h2d_stream().synchronize();
    backend->d2h_stream().synchronize();
    for (auto& [id, t] : tensors) {
      for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme})
        free_space(*t, tier);
    }
    tensors.clear();
    swap.reset();
    if (io) {
      io->unregister_buffer(slab.data());
      if (backend->info().host_addressable) io->unregister_buffer(backend->device_pool().base());
    }
  }

  // ---- helpers (lock held) ----

  TensorState& get(TensorId id) {
    const auto it = tensors.find(id);
    if (it == tensors.end()) STRATA_FAIL(Errc::not_found, "no tensor ", id);
    return *it->second;
  }

  bool has_tier(Tier t) const { return t != Tier::Nvme || swap != nullptr; }

  void require_tier(Tier t, const char* what) const {
    if (!has_tier(t))
      STRATA_FAIL(Errc::invalid_argument, what,
                  ": the Nvme tier is not configured (set nvme.paths and nvme.capacity)");
  }

  std::uint64_t used(Tier t) const {
    if (t == Tier::Device) return backend->device_stats().current_bytes;
    if (t == Tier::Host) return host_pool->stats().current_bytes;
    return swap ? swap->stats().current_bytes : 0;
  }

  void note_occupancy(Tier t) {
    const std::uint64_t u = used(t);
    TierStats& s = stats[idx(t)];
    s.used_bytes = u;
    s.peak_bytes = std::max(s.peak_bytes, u);
    telemetry.occupancy(t, u);
  }

  bool try_alloc(TensorState& t, Tier tier) {
    Copy& c = t.copies[idx(tier)];
    if (c.has_space()) return true;
    const std::uint64_t bytes = t.desc.bytes;
    if (tier == Tier::Device) {
      c.ptr = static_cast<std::byte*>(backend->device_pool().try_allocate(bytes, 256));
    } else if (tier == Tier::Host) {
      c.ptr = static_cast<std::byte*>(host_pool->try_allocate(bytes, kPageBytes));
    } else {
      try {
        c.extent = swap->allocate(bytes);
        c.mapped = false;
      } catch (const OutOfMemoryError&) {
        return false;
      }
    }
    if (c.has_space()) note_occupancy(tier);
    return c.has_space();
  }

  void free_space(TensorState& t, Tier tier) {
    Copy& c = t.copies[idx(tier)];
    const TensorId claimant = tier == Tier::Device ? c.claimed_by : 0;
    if (c.ptr != nullptr) {
      if (tier == Tier::Device) {
        if (const auto a = arrivals.find(t.id); a != arrivals.end()) {
          for (const auto& [offset, length] : a->second.owned)
            backend->deallocate_device(a->second.base + offset);
          arrivals.erase(a);
          for (auto& [id, o] : tensors)  // its claims lapse: those copies stay
            if (o->copies[idx(Tier::Device)].claimed_by == t.id)
              o->copies[idx(Tier::Device)].claimed_by = 0;
        } else {
          backend->deallocate_device(c.ptr);
        }
      } else {
        host_pool->deallocate(c.ptr);
      }
    }
    if (c.extent != 0) swap->release(c.extent);
    const bool had = c.has_space();
    c = Copy{};
    if (had) note_occupancy(tier);
    if (claimant != 0) grant(claimant);
  }

  // Note [Arrival in pieces]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~
  // When the device cannot hold the next step's tensor beside the current step's, most of it
  // could still land while the current step computes: Runtime::prefetch_replacing places its
  // copy over free space and over copies the caller says it will not need again (clean, not
  // leased for writing: the current step's weights), which are "claimed". The parts that are
  // free are allocated at once and their chunks start; a claimed copy is dropped when its last
  // lease ends (not kept as it would be otherwise), and its part is granted to the claimant at
  // that moment, under the same lock, so nothing else takes it. The arriving copy's device
  // block is several pool blocks until the last part is granted; then they become one. Its
  // device leases go out only when every chunk has landed, as for any move.

  // Takes every free part of the claimant's block; starts its chunks now in room.
  void grant(TensorId claimant) {
    const auto a = arrivals.find(claimant);
    if (a == arrivals.end()) return;
    Arrival& r = a->second;
    MemoryPool& pool = backend->device_pool();
    for (const auto& [fp, fb] : pool.free_blocks()) {
      std::byte* lo = std::max(fp, r.base);
      std::byte* hi = std::min(fp + fb, r.base + r.bytes);
      if (lo >= hi) continue;
      if (!pool.allocate_at(lo, static_cast<std::size_t>(hi - lo)))
        STRATA_FAIL(Errc::internal, "arrival in pieces: a free block could not be taken");
      r.owned.emplace_back(static_cast<std::size_t>(lo - r.base),
                           static_cast<std::size_t>(hi - lo));
    }
    std::size_t owned = 0;
    for (const auto& [offset, length] : r.owned)
      owned += length;
    std::shared_ptr<Pipeline> p = r.pipeline;
    if (owned == r.bytes) {  // whole: one block again
      for (const auto& [offset, length] : r.owned)
        pool.deallocate(r.base + offset);
      if (!pool.allocate_at(r.base, r.bytes))
        STRATA_FAIL(Errc::internal, "arrival in pieces: the whole block could not be taken");
      arrivals.erase(a);
    }
    note_occupancy(Tier::Device);
    if (p) pump(p);
  }

  // Is [from, to) of the tensor's device copy held (not waiting for a claimed copy)?
  bool held(TensorId id, std::size_t from, std::size_t to) const {
    const auto a = arrivals.find(id);
    if (a == arrivals.end()) return true;
    std::vector<std::pair<std::size_t, std::size_t>> owned = a->second.owned;
    std::sort(owned.begin(), owned.end());
    std::size_t at = from;
    for (const auto& [offset, length] : owned) {
      if (offset > at) break;
      at = std::max(at, offset + length);
      if (at >= to) return true;
    }
    return at >= to;
  }

  bool dirty(const TensorState& t, Tier tier) const {
    if (!t.current(tier)) return false;
    for (std::size_t below = idx(tier) + 1; below < kTiers; ++below)
      if (t.current(static_cast<Tier>(below))) return false;
    return true;
  }

  // The tier a dirty copy on `tier` is written back to; nullopt when there is none.
  std::optional<Tier> below(Tier tier) const {
    if (tier == Tier::Device) return Tier::Host;
    if (tier == Tier::Host && swap) return Tier::Nvme;
    return std::nullopt;
  }

  MemoryPool* pool(Tier t) {
    return t == Tier::Device ? &backend->device_pool()
           : t == Tier::Host ? host_pool.get()
                             : nullptr;
  }

  // ---- making room ----

  std::vector<TensorState*> evictable(Tier tier, const TensorState& exclude) {
    std::vector<TensorState*> out;
    for (auto& [id, t] : tensors) {
      if (t.get() == &exclude) continue;
      const Copy& c = t->copies[idx(tier)];
      if (!c.has_space() || c.leases > 0 || c.pins > 0) continue;
      if (c.state != CopyState::Valid) continue;
      if (dirty(*t, tier) && !below(tier)) continue;  // the only copy, nowhere to go
      out.push_back(t.get());
    }
    return out;
  }

  [[noreturn]] void out_of_memory(Tier tier, const TensorState& t) {
    std::string leased;
    std::uint64_t leased_bytes = 0;
    for (auto& [id, other] : tensors) {
      const Copy& c = other->copies[idx(tier)];
      if (!c.has_space()) continue;
      if (c.leases > 0 || c.pins > 0 || c.state == CopyState::Loading) {
        leased +=
            detail::concat(leased.empty() ? "" : ", ", "\"", other->desc.name, "\" (",
                           other->desc.bytes, " bytes", c.leases ? ", leased" : ", in use", ")");
        leased_bytes += other->desc.bytes;
      }
    }
    std::uint64_t free = 0, largest = 0;
    if (MemoryPool* p = pool(tier)) {
      const PoolStats s = p->stats();
      free = s.free_bytes;
      largest = s.largest_free_bytes;
    } else if (swap) {
      const RangeStats s = swap->stats();
      free = s.free_bytes;
      largest = s.largest_free_bytes;
    }
    throw OutOfMemoryError(
        std::string(to_string(tier)), t.desc.bytes, free, largest,
        detail::concat("tensor \"", t.desc.name,
                       "\" cannot be placed: everything else on the tier "
                       "is in use (",
                       leased_bytes, " bytes: ",
                       leased.empty() ? "nothing; the tier is smaller than the tensor" : leased,
                       ")"));
  }

  // Slides unleased copies down into the holes before them until a block of `bytes` exists.
  bool compact(Tier tier, std::uint64_t bytes) {
    MemoryPool* p = pool(tier);
    std::map<std::byte*, TensorState*> by_address;
    for (auto& [id, t] : tensors)
      if (t->copies[idx(tier)].ptr != nullptr)
        by_address.emplace(t->copies[idx(tier)].ptr, t.get());
    bool moved = false;
    for (auto& [addr, t] : by_address) {
      Copy& c = t->copies[idx(tier)];
      if (c.leases > 0 || c.pins > 0 || c.state != CopyState::Valid) continue;
      // The free block that ends where this copy starts, if any.
      std::byte* gap = nullptr;
      for (const auto& [fp, fb] : p->free_blocks())
        if (fp + fb == c.ptr) gap = fp;
      if (gap == nullptr) continue;
      const std::size_t size = align_up(t->desc.bytes, tier == Tier::Host ? kPageBytes : 256);
      const std::size_t step = static_cast<std::size_t>(c.ptr - gap);  // no chunk overlaps
      std::byte* old = c.ptr;
      p->deallocate(old);
      if (!p->allocate_at(gap, size)) {  // cannot happen: [gap, old + size) is free
        STRATA_FAIL(Errc::internal, "compaction lost a block on tier ", to_string(tier));
      }
      const CopyKind kind = tier == Tier::Device ? CopyKind::DeviceToDevice : CopyKind::HostToHost;
      for (std::size_t at = 0; at < size; at += step)
        backend->copy(gap + at, old + at, std::min(step, size - at), kind);
      c.ptr = gap;
      ++stats[idx(tier)].compactions;
      moved = true;
      if (p->stats().largest_free_bytes >= bytes) break;
    }
    return moved;
  }

  // Places t's copy on `tier` from free space, compacting when the free bytes would hold it but
  // no free block does; false when only evictions can make room.
  bool place(TensorState& t, Tier tier) {
    for (;;) {
      if (try_alloc(t, tier)) return true;
      MemoryPool* p = pool(tier);
      if (p == nullptr || p->stats().free_bytes < align_up(t.desc.bytes, kPageBytes) ||
          !compact(tier, t.desc.bytes))
        return false;
    }
  }

  // Makes space for t's copy on `tier`; may evict (with write-backs) and block.
  void make_room(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier) {
    for (;;) {
      if (place(t, tier)) return;
      // Copies still landing are shown to the policy too: if it would rather evict one of those,
      // wait for it to land; otherwise evict its choice now, without waiting for the link.
      auto candidates = evictable(tier, t);
      std::vector<TensorState*> landing;
      for (auto& [id, o] : tensors) {
        const Copy& c = o->copies[idx(tier)];
        if (o.get() != &t && c.state == CopyState::Loading && c.leases == 0 && c.pins == 0)
          landing.push_back(o.get());
      }
      if (!candidates.empty()) {
        std::vector<EvictionCandidate> view;
        for (TensorState* c : candidates)
          view.push_back({c->id, c->desc.bytes, c->copies[idx(tier)].last_use, dirty(*c, tier)});
        for (TensorState* c : landing)
          view.push_back({c->id, c->desc.bytes, c->copies[idx(tier)].last_use, false});
        const std::size_t pick = policy->choose(tier, view);
        if (pick >= candidates.size()) {
          changed.wait(lock);  // the policy's victim is still landing
          continue;
        }
        evict_copy(lock, *candidates[pick], tier);
        continue;
      }
      // Copies still arriving become evictable once they land; wait for them, else give up.
      bool arriving = false;
      for (auto& [id, o] : tensors) {
        const Copy& c = o->copies[idx(tier)];
        if (o.get() != &t && c.leases == 0 &&
            (c.state == CopyState::Loading || c.state == CopyState::Evicting || c.pins > 0))
          arriving = true;
      }
      if (!arriving) out_of_memory(tier, t);
      changed.wait(lock);
    }
  }

  // Runtime::stage: room for t's copy on `tier` from free space, compaction, or clean copies the
  // policy ranks before t itself (t is shown to it as a candidate: if it would go first, the
  // staging would evict something needed sooner). Never writes back, never waits.
  bool stage(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier) {
    if (t.discarded) return false;
    for (std::size_t i = 0; i <= idx(tier); ++i) {  // already here, or on a faster tier
      const CopyState s = t.copies[i].state;
      if (s == CopyState::Loading || s == CopyState::Evicting || t.current(static_cast<Tier>(i)))
        return false;
    }
    bool below_current = false;
    for (std::size_t i = idx(tier) + 1; i < kTiers; ++i)
      below_current = below_current || t.current(static_cast<Tier>(i));
    if (!below_current) return false;
    for (;;) {
      if (place(t, tier)) break;
      auto candidates = evictable(tier, t);
      std::erase_if(candidates, [&](TensorState* c) { return dirty(*c, tier); });
      if (candidates.empty()) return false;
      std::vector<EvictionCandidate> view;
      for (TensorState* c : candidates)
        view.push_back({c->id, c->desc.bytes, c->copies[idx(tier)].last_use, false});
      view.push_back({t.id, t.desc.bytes, 0, false});
      const std::size_t pick = policy->choose(tier, view);
      if (pick >= candidates.size()) return false;
      evict_copy(lock, *candidates[pick], tier);  // clean: dropped, the lock kept
    }
    start_load(lock, t, tier, source_for(t, tier));
    t.copies[idx(tier)].last_use = ++clock;
    run_after_unlock(lock);
    return true;
  }

  // Runtime::prefetch_replacing (Note [Arrival in pieces]). Lock held.
  bool prefetch_replacing(std::unique_lock<std::mutex>& lock, TensorState& t,
                          const std::vector<TensorId>& replaceable) {
    for (;;) {
      const Copy& c = t.copies[idx(Tier::Device)];
      if (c.state == CopyState::Loading || c.state == CopyState::Evicting ||
          t.current(Tier::Device))
        return true;  // there, or on its way
      if (t.discarded) return false;
      // As ensure(): a device load waits for a host copy that is landing, and reads it.
      const Copy& h = t.copies[idx(Tier::Host)];
      if (h.state == CopyState::Loading && h.version == t.version) {
        changed.wait(lock);
        continue;
      }
      break;
    }
    Copy& d = t.copies[idx(Tier::Device)];
    const Tier src = source_for(t, Tier::Device);
    if (!place(t, Tier::Device)) {
      // Free blocks and the replaceable copies' blocks, by address.
      const std::size_t need = align_up(t.desc.bytes, std::size_t{256});
      std::map<std::byte*, std::pair<std::size_t, TensorState*>> parts;  // start -> (bytes, copy)
      for (const auto& [fp, fb] : backend->device_pool().free_blocks())
        parts.emplace(fp, std::make_pair(fb, nullptr));
      for (TensorId id : replaceable) {
        const auto it = tensors.find(id);
        if (it == tensors.end() || it->second.get() == &t) continue;
        TensorState& o = *it->second;
        const Copy& oc = o.copies[idx(Tier::Device)];
        // A copy still landing (the current step's, leased before its copy finished) is taken
        // too: it is dropped only once it has landed and its leases have ended.
        const bool landing = oc.state == CopyState::Loading && oc.version == o.version;
        if (oc.ptr == nullptr || (oc.state != CopyState::Valid && !landing) || oc.pins > 0 ||
            oc.write_leases > 0 || oc.claimed_by != 0 || dirty(o, Tier::Device) ||
            arrivals.contains(o.id))
          continue;
        parts.emplace(oc.ptr, std::make_pair(align_up(o.desc.bytes, std::size_t{256}), &o));
      }
      // The placement in a run of adjacent parts that covers the most free bytes.
      std::byte* best = nullptr;
      std::size_t best_free = 0;
      std::vector<std::pair<std::byte*, std::pair<std::size_t, TensorState*>>> run;
      const auto consider = [&] {
        if (run.empty()) return;
        std::byte* lo = run.front().first;
        std::byte* hi = run.back().first + run.back().second.first;
        if (static_cast<std::size_t>(hi - lo) < need) return;
        std::vector<std::byte*> starts = {lo, hi - need};
        for (const auto& [at, part] : run)
          if (part.second == nullptr) {
            if (at + need <= hi) starts.push_back(at);
            if (at + part.first >= lo + need) starts.push_back(at + part.first - need);
          }
        for (std::byte* a : starts) {
          std::size_t free = 0;
          for (const auto& [at, part] : run)
            if (part.second == nullptr) {
              std::byte* x = std::max(at, a);
              std::byte* y = std::min(at + part.first, a + need);
              if (x < y) free += static_cast<std::size_t>(y - x);
            }
          if (best == nullptr || free > best_free) best = a, best_free = free;
        }
      };
      for (const auto& part : parts) {
        if (!run.empty() && run.back().first + run.back().second.first != part.first) {
          consider();
          run.clear();
        }
        run.push_back(part);
      }
      consider();
      if (best == nullptr) return false;
      // Claim: unleased replaceable copies in the range are dropped now, leased ones later.
      arrivals[t.id] = Arrival{best, need, {}, nullptr};
      d.ptr = best;
      for (const auto& [at, part] : parts) {
        TensorState* o = part.second;
        if (o == nullptr || at + part.first <= best || at >= best + need) continue;
        o->copies[idx(Tier::Device)].claimed_by = t.id;
        drop_if_claimed(lock, *o);
      }
      grant(t.id);  // the free parts (or all of it, when nothing claimed is leased)
    }
    start_load(lock, t, Tier::Device, src);
    d.last_use = ++clock;
    run_after_unlock(lock);
    return true;
  }

  // A claim that failed (drop_claimed) with nothing of its move in flight: finish it now. May
  // unlock.
  void finish_failed_arrival(std::unique_lock<std::mutex>& lock, TensorId claimant) {
    const auto a = arrivals.find(claimant);
    if (a == arrivals.end() || !a->second.pipeline) return;
    auto p = a->second.pipeline;
    if (p->error && p->in_flight == 0) chunk_done(lock, p);
  }

  // A claimed device copy goes once it has landed, its leases have ended and no move reads it.
  static bool droppable(const TensorState& o) {
    const Copy& c = o.copies[idx(Tier::Device)];
    return c.claimed_by != 0 && c.leases == 0 && c.pins == 0 && c.state == CopyState::Valid;
  }

  // Drops o's device copy if it is claimed and droppable, and finishes the claimant's move if
  // that made it fail with nothing in flight. Returns with the lock held; true if it dropped.
  bool drop_if_claimed(std::unique_lock<std::mutex>& lock, TensorState& o) {
    if (!droppable(o)) return false;
    const TensorId claimant = o.copies[idx(Tier::Device)].claimed_by;
    drop_claimed(o);
    finish_failed_arrival(lock, claimant);
    if (!lock.owns_lock()) lock.lock();
    return true;
  }

  // A claimed copy whose last lease ended: dropped (clean), its room granted to the claimant;
  // if a write made it dirty meanwhile, the claim fails instead and the copy stays.
  void drop_claimed(TensorState& o) {
    Copy& oc = o.copies[idx(Tier::Device)];
    const TensorId claimant = oc.claimed_by;
    if (dirty(o, Tier::Device)) {
      oc.claimed_by = 0;
      const auto a = arrivals.find(claimant);
      if (a != arrivals.end() && a->second.pipeline) {
        auto p = a->second.pipeline;
        if (!p->error)
          p->error = std::make_exception_ptr(
              Error(Errc::invalid_argument,
                    detail::concat("tensor ", claimant, ": the device room it claimed from \"",
                                   o.desc.name, "\" was written, so it cannot be dropped")));
      }
      return;
    }
    ++stats[idx(Tier::Device)].evictions;
    const std::uint64_t now = telemetry.now_ns();
    telemetry.record({now, now, Track::Eviction, o.desc.bytes, o.id, idx(Tier::Device)});
    free_space(o, Tier::Device);  // grants the claimant its part
    changed.notify_all();
  }

  // Drops t's copy on `tier`, writing it back below first when it is dirty. Blocks.
  void evict_copy(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier) {
    Copy& c = t.copies[idx(tier)];
    if (dirty(t, tier)) {
      c.state = CopyState::Evicting;
      ++c.pins;
      try {
        write_back(lock, t, tier);
      } catch (...) {
        --c.pins;
        c.state = CopyState::Valid;  // still dirty, still here: nothing lost
        changed.notify_all();
        throw;
      }
      --c.pins;
      // Moves that took this copy as their source while it was written back finish first.
      changed.wait(lock, [&] { return c.pins == 0; });
    }
    ++stats[idx(tier)].evictions;
    const std::uint64_t now = telemetry.now_ns();
    telemetry.record({now, now, Track::Eviction, t.desc.bytes, t.id, idx(tier)});
    free_space(t, tier);
    changed.notify_all();
  }

  // Writes t's newest copy on `tier` to the tier below (Host, or Nvme when the host is full).
  void write_back(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier) {
    Tier target;
    for (;;) {
      target = *below(tier);
      if (target == Tier::Host && swap) {
        // Prefer keeping a host copy; go straight to NVMe when the host cannot take it.
        try {
          make_room(lock, t, Tier::Host);
        } catch (const OutOfMemoryError&) {
          target = Tier::Nvme;
        }
      }
      Copy& dst = t.copies[idx(target)];
      if (target == Tier::Nvme && dst.mapped) free_space(t, Tier::Nvme);  // never write a model
      make_room(lock, t, target);
      // Note [One move into a copy]: make_room may have waited with the lock released, and a
      // lease or prefetch may meanwhile have started (or finished) this very move into `dst`.
      if (dst.state == CopyState::Loading || dst.state == CopyState::Evicting) {
        changed.wait(lock);
        continue;
      }
      if (!dirty(t, tier)) {  // that move landed (or a write lease below made this one stale)
        if (dst.state == CopyState::Absent && dst.leases == 0 && dst.pins == 0)
          free_space(t, target);  // the room made for it
        return;
      }
      break;
    }
    Copy& dst = t.copies[idx(target)];
    start_load(lock, t, target, tier);
    run_after_unlock(lock);
    changed.wait(lock, [&] { return dst.state != CopyState::Loading; });
    if (dst.error) std::rethrow_exception(dst.error);
    ++stats[idx(tier)].write_backs;
    stats[idx(tier)].bytes_out += t.desc.bytes;
  }

  // ---- moves ----

  Tier source_for(const TensorState& t, Tier dst) const {
    static constexpr std::array<std::array<Tier, 2>, kTiers> kOrder{{
        {Tier::Host, Tier::Nvme},    // to Device
        {Tier::Device, Tier::Nvme},  // to Host
        {Tier::Host, Tier::Device},  // to Nvme
    }};
    for (Tier s : kOrder[idx(dst)])
      if (t.current(s) && t.copies[idx(s)].state == CopyState::Valid) return s;
    for (Tier s : kOrder[idx(dst)])
      if (t.current(s)) return s;
    STRATA_FAIL(Errc::internal, "tensor \"", t.desc.name, "\" has no current copy");
  }

  // Completion of a move into `dst` (any thread).
  // `via`: the tier the bytes passed through on the way (a kept host copy), if any.
  void finish_move(TensorState& t, Tier dst, Tier src, std::exception_ptr error,
                   std::uint64_t version, std::optional<Tier> via = std::nullopt) {
    std::unique_lock lock(mutex);
    Copy& c = t.copies[idx(dst)];
    --t.copies[idx(src)].pins;
    if (error) {
      c.error = error;
      c.state = CopyState::Absent;
      c.ready = false;
      c.event.reset();
      if (c.leases == 0) {
        const std::exception_ptr keep = c.error;
        free_space(t, dst);
        t.copies[idx(dst)].error = keep;
      } else if (dst == Tier::Device && arrivals.contains(t.id)) {
        // An arrival in pieces gives its room and its claims back even while leases wait on it
        // (they get the error): kept, it would hold copies it claimed until someone asked again.
        const Copy kept = c;
        stats[idx(dst)].leased_bytes -= t.desc.bytes;
        free_space(t, dst);
        Copy& now = t.copies[idx(dst)];
        now.error = kept.error;
        now.leases = kept.leases;  // their releases end them; no space is left to account
        now.write_leases = kept.write_leases;
      }
    } else {
      c.state = CopyState::Valid;
      c.version = std::max(c.version, version);  // a write lease may have ended during the load
      c.ready = true;
      ++stats[idx(dst)].moves;
      stats[idx(dst)].bytes_in += t.desc.bytes;
      if (via) {
        path_bytes[idx(src)][idx(*via)] += t.desc.bytes;
        path_bytes[idx(*via)][idx(dst)] += t.desc.bytes;
      } else {
        path_bytes[idx(src)][idx(dst)] += t.desc.bytes;
      }
    }
    --t.moves;
    --moves_in_flight;
    // Note [Arrival in pieces]: a claimed copy whose leases ended while it landed or was a
    // move's source goes now.
    if (dst == Tier::Device || src == Tier::Device) drop_if_claimed(lock, t);
    changed.notify_all();
    run_after_unlock(lock);
  }

  // Records a stream copy's span: it began when the previous work on its stream finished.
  void stream_span(std::atomic<std::uint64_t>& last, Track track, std::uint64_t enqueued,
                   std::uint64_t bytes, TensorId id) {
    const std::uint64_t end = telemetry.now_ns();
    const std::uint64_t start = std::max(enqueued, last.exchange(end));
    telemetry.record({std::min(start, end), end, track, bytes, id, 0});
  }

  void start_load(std::unique_lock<std::mutex>& lock, TensorState& t, Tier dst, Tier src) {
    (void)lock;
    Copy& d = t.copies[idx(dst)];
    Copy& s = t.copies[idx(src)];
    if (d.state == CopyState::Loading || d.state == CopyState::Evicting || t.current(dst)) {
      STRATA_FAIL(Errc::internal, "tensor \"", t.desc.name, "\": a move into its ", to_string(dst),
                  " copy, which is current or has a move in flight (Note [One move into a copy])");
    }
    ++s.pins;
    d.state = CopyState::Loading;
    d.version = t.version;
    d.ready = false;
    d.error = nullptr;
    d.event.reset();
    ++t.moves;
    ++moves_in_flight;
    const std::uint64_t version = t.version;
    const std::uint64_t bytes = t.desc.bytes;
    TensorState* tp = &t;

    if (src == Tier::Host && dst == Tier::Device && arrivals.contains(t.id)) {
      start_pipeline(t, dst, src, version);  // Note [Arrival in pieces]
      return;
    }
    if ((src == Tier::Host && dst == Tier::Device) || (src == Tier::Device && dst == Tier::Host)) {
      const bool up = dst == Tier::Device;
      Stream& stream = up ? backend->h2d_stream() : backend->d2h_stream();
      auto event = std::shared_ptr<Event>(backend->create_event());
      const std::uint64_t enqueued = telemetry.now_ns();
      stream.copy_async(d.ptr, s.ptr, bytes, up ? CopyKind::HostToDevice : CopyKind::DeviceToHost);
      stream.record(*event);
      d.event = event;
      if (up) d.ready = true;  // a device lease may go out now: its users wait on the event
      stream.launch_host_func([this, tp, dst, src, version, enqueued, bytes, up] {
        stream_span(up ? h2d_last_ns : d2h_last_ns, up ? Track::H2D : Track::D2H, enqueued, bytes,
                    tp->id);
        finish_move(*tp, dst, src, nullptr, version);
      });
      return;
    }
    if ((src == Tier::Nvme && dst == Tier::Host) || (src == Tier::Host && dst == Tier::Nvme)) {
      const bool read = src == Tier::Nvme;
      const ExtentId extent = read ? s.extent : d.extent;
      std::byte* ptr = read ? d.ptr : s.ptr;
      const std::uint64_t submitted = telemetry.now_ns();
      io_after_unlock_.push_back([=, this] {
        auto done = [=, this](std::exception_ptr e) {
          telemetry.record({submitted, telemetry.now_ns(),
                            read ? Track::NvmeRead : Track::NvmeWrite, bytes, tp->id, 0});
          finish_move(*tp, dst, src, e, version);
        };
        if (read)
          swap->read(extent, 0, ptr, bytes, std::move(done));
        else
          swap->write(extent, 0, ptr, bytes, std::move(done));
      });
      return;
    }
    // Nvme <-> Device: a pipeline of chunks.
    start_pipeline(t, dst, src, version);
  }

  // I/O submissions queued while the lock was held; run by the caller after unlocking (an I/O
  // completion may run inline on failure and take the lock).
  std::vector<std::function<void()>> io_after_unlock_;

  void run_after_unlock(std::unique_lock<std::mutex>& lock) {
    while (!io_after_unlock_.empty()) {
      auto work = std::move(io_after_unlock_);
      io_after_unlock_.clear();
      lock.unlock();
      for (auto& w : work)
        w();
      lock.lock();
    }
  }

  // Note [Chunk pipeline]: NVMe -> device moves read chunk k into a landing buffer (the tensor's
  // host copy when the host tier had room, else a staging slot of the pinned slab), then copy it
  // to the device on the h2d stream; while that copy runs the next chunks are being read. A
  // slot goes back to the pipeline (or to the next waiting one) when its device copy is done.
  // Device -> NVMe write-backs run the same pipeline the other way (d2h, then write).
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
  };

  void start_pipeline(TensorState& t, Tier dst, Tier src, std::uint64_t version) {
    auto p = std::make_shared<Pipeline>();
    p->t = &t;
    p->down = dst == Tier::Device;
    p->dst = dst;
    p->src = src;
    p->version = version;
    p->bytes = t.desc.bytes;
    p->chunk = options.staging_chunk_bytes;
    p->chunks = static_cast<std::size_t>((p->bytes + p->chunk - 1) / p->chunk);
    p->started.assign(p->chunks, false);
    p->max_in_flight = options.staging_chunks;  // waiting pipelines get slots as they free
    p->extent = t.copies[idx(Tier::Nvme)].extent;
    p->device = t.copies[idx(Tier::Device)].ptr;
    if (const auto a = arrivals.find(t.id); a != arrivals.end() && p->down) a->second.pipeline = p;
    if (src == Tier::Host) {  // Note [Arrival in pieces]: chunk k is copied once its room is held
      p->from_host = t.copies[idx(Tier::Host)].ptr;
      p->max_in_flight = p->chunks;
      p->event = std::shared_ptr<Event>(backend->create_event());
    } else if (p->down) {
      // Keep a host copy on the way when the host tier has room without evicting anything
      // (unless options.host_copy_on_the_way is off).
      Copy& h = t.copies[idx(Tier::Host)];
      if (options.host_copy_on_the_way && h.state == CopyState::Absent &&
          try_alloc(t, Tier::Host)) {
        h.state = CopyState::Loading;
        h.version = version;
        p->host = h.ptr;
      }
      // Note [Direct NVMe to device]: a host-addressable device with no link model (the host
      // backend, unpaced) is host memory. When no host copy is kept on the way, the chunks land
      // in the device copy itself, as GPUDirect Storage would: one copy fewer than staging then
      // copying, and no memcpy on the cores the compute uses. Device leases wait for the whole
      // read (no stream event). A paced link or a CUDA device always stages.
      p->direct =
          p->host == nullptr && backend->info().host_addressable && backend->info().link_gbps == 0;
      if (!p->direct)
        p->event = std::shared_ptr<Event>(backend->create_event());  // device leases wait on it
    }
    // Note [Reads in the order asked]: a move that lands in a copy (the host copy on the way, or
    // the device copy directly) needs no staging slot, so all its chunks go to the engine at
    // once. The engine serves requests in the order submitted, so the tensor asked for first
    // (the planner asks in step order) is read first, instead of its later chunks queueing
    // behind the next steps' reads as they did when it was limited to staging_chunks in flight.
    if (p->host != nullptr || p->direct) p->max_in_flight = p->chunks;
    pump(p);
  }

  // The first chunk not launched whose device room is held; chunks() when there is none.
  std::size_t next_chunk(const Pipeline& p) const {
    for (std::size_t k = 0; k < p.chunks; ++k) {
      if (p.started[k]) continue;
      const std::size_t from = k * p.chunk;
      const std::size_t to =
          static_cast<std::size_t>(std::min<std::uint64_t>(p.bytes, from + p.chunk));
      if (!p.down || held(p.t->id, from, to)) return k;
    }
    return p.chunks;
  }

  // Starts as many chunks as slots and held room allow (lock held; I/O queued for after unlock).
  void pump(const std::shared_ptr<Pipeline>& p) {
    while (p->launched < p->chunks && !p->error && p->in_flight < p->max_in_flight) {
      const std::size_t k = next_chunk(*p);
      if (k == p->chunks) return;  // the rest waits for room (Note [Arrival in pieces])
      std::byte* landing = nullptr;
      if (p->from_host != nullptr) {
        landing = const_cast<std::byte*>(p->from_host) + k * p->chunk;
      } else if (p->host != nullptr) {
        landing = p->host + k * p->chunk;
      } else if (p->direct) {
        landing = p->device + k * p->chunk;
      } else if (!p->slots.empty()) {
        landing = p->slots.back();
        p->slots.pop_back();
      } else if (!staging_free.empty()) {
        landing = staging_free.back();
        staging_free.pop_back();
      } else {
        if (p->in_flight == 0) staging_waiters.push_back(p);
        return;
      }
      p->started[k] = true;
      ++p->launched;
      ++p->in_flight;
      launch_chunk(p, k, landing);
    }
  }

  void give_back_slot(const std::shared_ptr<Pipeline>& p, std::byte* slot) {
    if (p->host != nullptr || p->direct || p->from_host != nullptr) return;
    if (p->launched < p->chunks && !p->error) {
      p->slots.push_back(slot);
      return;
    }
    staging_free.push_back(slot);
    while (!staging_waiters.empty() && !staging_free.empty()) {
      auto w = staging_waiters.front();
      staging_waiters.pop_front();
      pump(w);
    }
  }

  // Copies a chunk from host memory (`landing`) up into the device copy on the h2d stream; the
  // last one enqueued records the event device leases wait on. Lock held.
  void copy_chunk_up(const std::shared_ptr<Pipeline>& p, std::uint64_t offset, std::byte* landing,
                     std::size_t len) {
    Stream& h2d = backend->h2d_stream();
    const std::uint64_t enqueued = telemetry.now_ns();
    h2d.copy_async(p->device + offset, landing, len, CopyKind::HostToDevice);
    if (++p->enqueued == p->chunks && !p->error) {
      h2d.record(*p->event);
      Copy& d = p->t->copies[idx(Tier::Device)];
      d.event = p->event;
      d.ready = true;  // device leases may go out: the last copy is on the stream
      changed.notify_all();
    }
    h2d.launch_host_func([this, p, landing, enqueued, len, id = p->t->id] {
      stream_span(h2d_last_ns, Track::H2D, enqueued, len, id);
      std::unique_lock lock(mutex);
      --p->in_flight;
      ++p->done;
      give_back_slot(p, landing);  // a staging slot, when the chunk came through one
      pump(p);
      chunk_done(lock, p);
    });
  }

  void launch_chunk(const std::shared_ptr<Pipeline>& p, std::size_t k, std::byte* landing) {
    const std::uint64_t offset = k * p->chunk;
    const std::size_t len = static_cast<std::size_t>(std::min(p->chunk, p->bytes - offset));
    const TensorId id = p->t->id;
    if (p->from_host != nullptr) {  // host -> device, chunk by chunk as room is held
      copy_chunk_up(p, offset, landing, len);
      return;
    }
    if (p->down) {
      const std::uint64_t submitted = telemetry.now_ns();
      io_after_unlock_.push_back([this, p, k, landing, offset, len, id, submitted] {
        auto done = [=, this](std::exception_ptr e) {
          telemetry.record({submitted, telemetry.now_ns(), Track::NvmeRead, len, id, 0});
          if (e) {
            std::unique_lock lock(mutex);
            if (!p->error) p->error = e;
            --p->in_flight;
            give_back_slot(p, landing);
            chunk_done(lock, p);
            return;
          }
          if (p->direct) {  // already in the device copy
            std::unique_lock lock(mutex);
            --p->in_flight;
            ++p->done;
            pump(p);
            chunk_done(lock, p);
            return;
          }
          std::lock_guard lock(mutex);
          copy_chunk_up(p, offset, landing, len);
        };
        // A read refused before it starts (a torn extent) fails this chunk like an I/O error,
        // so that queued I/O never throws (Lease::release runs it too).
        try {
          swap->read(p->extent, offset, landing, len, done);
        } catch (...) {
          done(std::current_exception());
        }
      });
    } else {
      Stream& d2h = backend->d2h_stream();
      const std::uint64_t enqueued = telemetry.now_ns();
      d2h.copy_async(landing, p->device + offset, len, CopyKind::DeviceToHost);
      d2h.launch_host_func([this, p, landing, offset, len, id, enqueued] {
        stream_span(d2h_last_ns, Track::D2H, enqueued, len, id);
        const std::uint64_t submitted = telemetry.now_ns();
        swap->write(p->extent, offset, landing, len, [=, this](std::exception_ptr e) {
          telemetry.record({submitted, telemetry.now_ns(), Track::NvmeWrite, len, id, 0});
          std::unique_lock lock(mutex);
          if (e && !p->error) p->error = e;
          --p->in_flight;
          ++p->done;
          give_back_slot(p, landing);
          pump(p);
          chunk_done(lock, p);
        });
      });
    }
  }

  // After a chunk: run queued I/O, and finish the pipeline when nothing is left in flight.
  void chunk_done(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Pipeline>& p) {
    const bool finished = p->in_flight == 0 && (p->error || p->done == p->chunks);
    if (finished) {
      std::erase(staging_waiters, p);
      for (std::byte* s : p->slots)
        staging_free.push_back(s);
      p->slots.clear();
      if (p->host != nullptr) {
        Copy& h = p->t->copies[idx(Tier::Host)];
        if (p->error) {
          if (h.leases == 0) free_space(*p->t, Tier::Host);
        } else {
          h.state = CopyState::Valid;
          h.ready = true;
          ++stats[idx(Tier::Host)].moves;
          stats[idx(Tier::Host)].bytes_in += p->bytes;
        }
      }
      // Slots freed: let waiting pipelines go.
      while (!staging_waiters.empty() && !staging_free.empty()) {
        auto w = staging_waiters.front();
        staging_waiters.pop_front();
        pump(w);
      }
    }
    run_after_unlock(lock);
    if (finished) {
      lock.unlock();
      finish_move(*p->t, p->dst, p->src, p->error, p->version,
                  p->host != nullptr ? std::optional<Tier>(Tier::Host) : std::nullopt);
    }
  }

  // ---- residency requests ----

  // Makes t current on `tier` (starting a move if needed); returns with space reserved.
  // Leases on `t` other than one on `own` (the caller's).
  static bool leased_elsewhere(const TensorState& t, Tier own) {
    for (Tier tier : {Tier::Device, Tier::Host}) {
      const unsigned mine = tier == own ? 1 : 0;
      if (t.copies[idx(tier)].leases > mine) return true;
    }
    return false;
  }

  // Frees every copy of `t` with no write-back and marks it discarded. `own`, when not null, is
  // the caller's lease on it, which ends here; while the moves in flight finish, that lease keeps
  // anyone from evicting (and so writing back) the dead bytes. False when someone else leased it
  // meanwhile (then nothing changed); throws for a mapping or other leases without `own`.
  bool discard(std::unique_lock<std::mutex>& lock, TensorState& t, Lease* own) {
    const Tier own_tier = own != nullptr ? own->tier() : Tier::Nvme;
    STRATA_EXPECTS(!t.copies[idx(Tier::Nvme)].mapped, "discard \"", t.desc.name,
                   "\": it is a read-only mapping of a file");
    const auto check_leases = [&] {
      for (Tier tier : {Tier::Device, Tier::Host})
        STRATA_EXPECTS(t.copies[idx(tier)].leases == 0, "discard \"", t.desc.name,
                       "\": it is leased on ", to_string(tier));
    };
    if (own == nullptr) check_leases();
    changed.wait(lock, [&] {
      if (t.moves != 0) return false;
      for (const Copy& c : t.copies)
        if (c.pins != 0 || c.state == CopyState::Evicting) return false;
      return true;
    });
    if (own == nullptr) {
      check_leases();  // leased while the moves finished
    } else {
      if (leased_elsewhere(t, own_tier)) return false;
      Copy& c = t.copies[idx(own_tier)];
      --c.leases;
      if (writes(own->access()) && c.write_leases > 0) --c.write_leases;
      stats[idx(own_tier)].leased_bytes -= t.desc.bytes;
    }
    for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme})
      free_space(t, tier);
    t.discarded = true;
    changed.notify_all();
    return true;
  }

  // Makes `tier` hold (or receive) the tensor's newest bytes. `access` Write only makes space
  // (write-discard); `prefetch` requests are dropped for discarded tensors instead of failing.
  void ensure(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier, bool count,
              Access access, bool prefetch = false) {
    for (;;) {
      Copy& c = t.copies[idx(tier)];
      if (c.state == CopyState::Evicting ||
          (c.state == CopyState::Loading && c.version != t.version)) {
        changed.wait(lock);
        continue;
      }
      if (c.state == CopyState::Loading) {
        if (count) ++stats[idx(tier)].hits;  // already on its way (a prefetch hit)
        return;
      }
      if (t.current(tier)) {
        if (count) ++stats[idx(tier)].hits;
        c.ready = true;
        return;
      }
      if (access == Access::Write || t.discarded) {
        if (access != Access::Write) {
          if (prefetch) return;
          STRATA_FAIL(Errc::invalid_argument, "tensor \"", t.desc.name,
                      "\" was discarded: its bytes are gone until a write lease "
                      "(Access::Write) or write() fills it");
        }
        if (count) ++stats[idx(tier)].hits;  // nothing to move
        count = false;
        make_room(lock, t, tier);
        const Copy& now = t.copies[idx(tier)];
        if (now.state == CopyState::Loading || now.state == CopyState::Evicting || t.current(tier))
          continue;
        Copy& fresh = t.copies[idx(tier)];
        fresh.state = CopyState::Valid;  // bytes unspecified until the write lease ends
        fresh.version = t.version;
        fresh.ready = true;
        fresh.error = nullptr;
        fresh.event.reset();
        fresh.last_use = ++clock;
        return;
      }
      // A write lease on a copy still finishing its load makes that copy the only current one
      // before it is Valid: wait for the load to land rather than pick no source.
      if (!t.current(Tier::Device) && !t.current(Tier::Host) && !t.current(Tier::Nvme)) {
        changed.wait(lock);
        continue;
      }
      // A device load while the tensor's host copy is landing (a prefetch staged it from NVMe
      // ahead of the device) waits for that copy and moves from it: NVMe is read once.
      if (tier == Tier::Device) {
        const Copy& h = t.copies[idx(Tier::Host)];
        if (h.state == CopyState::Loading && h.version == t.version) {
          changed.wait(lock);
          continue;
        }
      }
      if (count) ++stats[idx(tier)].misses;
      count = false;  // one request counts once, however often it loops
      const Tier src = source_for(t, tier);
      ++t.copies[idx(src)].pins;  // keep the source while room is made
      try {
        make_room(lock, t, tier);
      } catch (...) {
        --t.copies[idx(src)].pins;
        throw;
      }
      --t.copies[idx(src)].pins;
      // make_room may have waited: another thread may have loaded the copy, or be loading it.
      // Start over rather than load into a copy that readers may already be using.
      const Copy& now = t.copies[idx(tier)];
      if (now.state == CopyState::Loading || now.state == CopyState::Evicting || t.current(tier))
        continue;
      start_load(lock, t, tier, source_for(t, tier));
      t.copies[idx(tier)].last_use = ++clock;  // a prefetch announces a use: not LRU's victim
      run_after_unlock(lock);
      return;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Lease / LeaseFuture

Lease::Lease(Lease&& o) noexcept {
  *this = std::move(o);
}

Lease& Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    release();
    runtime_ = std::exchange(o.runtime_, nullptr);
    data_ = o.data_;
    bytes_ = o.bytes_;
    tensor_ = o.tensor_;
    tier_ = o.tier_;
    access_ = o.access_;
    event_ = std::move(o.event_);
  }
  return *this;
}

void Lease::wait() const {
  if (event_) event_->synchronize();
}

void Lease::release() noexcept {
  if (runtime_ == nullptr) return;
  Runtime::Impl& rt = *runtime_->impl_;
  {
    std::unique_lock lock(rt.mutex);
    const auto it = rt.tensors.find(tensor_);
    if (it != rt.tensors.end()) {
      TensorState& t = *it->second;
      Copy& c = t.copies[idx(tier_)];
      if (c.leases > 0) --c.leases;
      if (writes(access_) && c.write_leases > 0) --c.write_leases;
      c.last_use = ++rt.clock;
      if (writes(access_)) {
        t.version += 1;  // Note [Versions]: every other copy is now stale
        c.version = t.version;
        t.discarded = false;
      }
      if (c.leases == 0 && c.ptr != nullptr) rt.stats[idx(tier_)].leased_bytes -= t.desc.bytes;
      // Note [Arrival in pieces]: a claimed copy goes when its last lease ends; the claimant's
      // chunks into its room start (their I/O after the unlock, and never throws).
      if (tier_ == Tier::Device && rt.drop_if_claimed(lock, t)) rt.run_after_unlock(lock);
    }
  }
  rt.changed.notify_all();
  runtime_ = nullptr;
  event_.reset();
}

LeaseFuture::LeaseFuture(LeaseFuture&& o) noexcept {
  *this = std::move(o);
}

LeaseFuture& LeaseFuture::operator=(LeaseFuture&& o) noexcept {
  if (this != &o) {
    this->~LeaseFuture();
    runtime_ = std::exchange(o.runtime_, nullptr);
    tensor_ = o.tensor_;
    tier_ = o.tier_;
    access_ = o.access_;
  }
  return *this;
}

LeaseFuture::~LeaseFuture() {
  if (runtime_ == nullptr) return;
  // Unclaimed: give the lease back.
  Lease lease;
  lease.runtime_ = runtime_;
  lease.tensor_ = tensor_;
  lease.tier_ = tier_;
  lease.access_ = Access::Read;
  runtime_ = nullptr;
}

bool LeaseFuture::ready() const {
  if (runtime_ == nullptr) return false;
  Runtime::Impl& rt = *runtime_->impl_;
  std::lock_guard lock(rt.mutex);
  const Copy& c = rt.get(tensor_).copies[idx(tier_)];
  return c.ready || c.error != nullptr;
}

Lease LeaseFuture::get() {
  STRATA_EXPECTS(runtime_ != nullptr, "LeaseFuture::get on an empty or used future");
  Runtime::Impl& rt = *runtime_->impl_;
  Lease lease;
  lease.runtime_ = std::exchange(runtime_, nullptr);  // the lease now owns the pin
  lease.tensor_ = tensor_;
  lease.tier_ = tier_;
  lease.access_ = access_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(tensor_);
  Copy& c = t.copies[idx(tier_)];
  rt.changed.wait(lock, [&] { return c.ready || c.error != nullptr; });
  if (!c.ready) {
    const std::exception_ptr error = c.error;
    lock.unlock();
    std::rethrow_exception(error);  // ~Lease gives the pin back
  }
  lease.data_ = c.ptr;
  lease.bytes_ = t.desc.bytes;
  lease.event_ = c.state == CopyState::Valid ? nullptr : c.event;
  return lease;
}

// ---------------------------------------------------------------------------------------------
// Runtime

Runtime::Runtime(RuntimeOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

std::unique_ptr<Runtime> Runtime::from_json(std::string_view json) {
  return std::make_unique<Runtime>(RuntimeOptions::from_json(json));
}

Runtime::~Runtime() = default;

Backend& Runtime::backend() noexcept {
  return *impl_->backend;
}
Telemetry& Runtime::telemetry() noexcept {
  return impl_->telemetry;
}
IoEngine* Runtime::io() noexcept {
  return impl_->io.get();
}
SwapSpace* Runtime::swap() noexcept {
  return impl_->swap.get();
}
const RuntimeOptions& Runtime::options() const noexcept {
  return impl_->options;
}

void Runtime::set_eviction_policy(std::shared_ptr<EvictionPolicy> policy) {
  STRATA_EXPECTS(policy != nullptr, "set_eviction_policy: null policy");
  std::lock_guard lock(impl_->mutex);
  impl_->policy = std::move(policy);
}

namespace {
TensorDesc checked(const TensorDesc& desc) {
  TensorDesc d = desc;
  std::uint64_t from_shape = dtype_bytes(d.dtype);
  for (std::int64_t n : d.shape) {
    STRATA_EXPECTS(n >= 0, "tensor \"", d.name, "\": negative dimension ", n);
    from_shape *= static_cast<std::uint64_t>(n);
  }
  if (d.bytes == 0 && !d.shape.empty()) d.bytes = from_shape;
  STRATA_EXPECTS(d.bytes > 0, "tensor \"", d.name, "\": 0 bytes");
  STRATA_EXPECTS(d.shape.empty() || d.bytes == from_shape, "tensor \"", d.name, "\": ", d.bytes,
                 " bytes do not match its shape and dtype (", from_shape, " bytes)");
  return d;
}
}  // namespace

TensorId Runtime::create_tensor(const TensorDesc& desc, Tier home, const void* init) {
  Impl& rt = *impl_;
  auto state = std::make_unique<TensorState>();
  state->desc = checked(desc);
  state->home = home;
  std::unique_lock lock(rt.mutex);
  rt.require_tier(home, "create_tensor");
  state->id = rt.next_id++;
  TensorState& t = *state;
  rt.tensors.emplace(t.id, std::move(state));
  Copy& c = t.copies[idx(home)];
  try {
    rt.make_room(lock, t, home);
    ++c.pins;  // nobody evicts it while it is being filled
    lock.unlock();
    const std::uint64_t bytes = t.desc.bytes;
    if (home == Tier::Nvme) {
      if (init != nullptr) {
        rt.swap->write(c.extent, init, bytes).get();
      } else {
        const std::size_t zeros_bytes = std::min<std::uint64_t>(bytes, 4 * MiB);
        PageBuffer zeros(zeros_bytes);
        for (std::uint64_t at = 0; at < bytes; at += zeros_bytes)
          rt.swap
              ->write(c.extent, zeros.data(), std::min<std::uint64_t>(zeros_bytes, bytes - at), at)
              .get();
      }
    } else if (home == Tier::Host) {
      if (init != nullptr)
        std::memcpy(c.ptr, init, bytes);
      else
        std::memset(c.ptr, 0, bytes);
    } else {
      Stream& s = rt.backend->h2d_stream();
      if (init != nullptr)
        rt.backend->copy(c.ptr, init, bytes, CopyKind::HostToDevice);
      else {
        s.memset_async(c.ptr, 0, bytes);
        s.synchronize();
      }
    }
    lock.lock();
    --c.pins;
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();
    rt.free_space(t, home);
    rt.tensors.erase(t.id);
    throw;
  }
  c.state = CopyState::Valid;
  c.version = t.version;
  c.ready = true;
  c.last_use = ++rt.clock;
  return t.id;
}

TensorId Runtime::map_tensor(const TensorDesc& desc, const std::string& path,
                             std::uint64_t offset) {
  Impl& rt = *impl_;
  auto state = std::make_unique<TensorState>();
  state->desc = checked(desc);
  state->home = Tier::Nvme;
  std::lock_guard lock(rt.mutex);
  rt.require_tier(Tier::Nvme, "map_tensor");
  Copy& c = state->copies[idx(Tier::Nvme)];
  c.extent = rt.swap->map_file(path, offset, state->desc.bytes);
  c.mapped = true;
  c.state = CopyState::Valid;
  c.version = state->version;
  c.ready = true;
  state->id = rt.next_id++;
  const TensorId id = state->id;
  rt.tensors.emplace(id, std::move(state));
  return id;
}

void Runtime::destroy_tensor(TensorId id) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  for (const Copy& c : t.copies)
    STRATA_EXPECTS(c.leases == 0, "destroy_tensor \"", t.desc.name, "\": it is leased");
  rt.changed.wait(lock, [&] { return t.moves == 0; });
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme})
    rt.free_space(t, tier);
  rt.tensors.erase(id);
  rt.changed.notify_all();
}

LeaseFuture Runtime::acquire(TensorId id, Tier tier, Access access) {
  Impl& rt = *impl_;
  STRATA_EXPECTS(tier != Tier::Nvme,
                 "acquire: tier Nvme has no addressable bytes; acquire on "
                 "Device or Host (prefetch and evict reach Nvme)");
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  if (writes(access)) {
    for (Tier other : {Tier::Device, Tier::Host})
      STRATA_EXPECTS(other == tier || t.copies[idx(other)].leases == 0, "acquire for write of \"",
                     t.desc.name, "\" on ", to_string(tier), ": it is leased on ", to_string(other),
                     "; release that lease first");
  }
  rt.ensure(lock, t, tier, /*count=*/true, access);
  Copy& c = t.copies[idx(tier)];
  if (c.leases++ == 0) rt.stats[idx(tier)].leased_bytes += t.desc.bytes;  // no eviction now
  if (writes(access)) ++c.write_leases;
  // A writer must not change bytes that a move is still copying out of this tier.
  if (writes(access)) rt.changed.wait(lock, [&] { return c.pins == 0; });
  c.last_use = ++rt.clock;
  LeaseFuture f;
  f.runtime_ = this;
  f.tensor_ = id;
  f.tier_ = tier;
  f.access_ = access;
  return f;
}

void Runtime::prefetch(TensorId id, Tier tier) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  rt.require_tier(tier, "prefetch");
  TensorState& t = rt.get(id);
  rt.ensure(lock, t, tier, /*count=*/false, Access::Read, /*prefetch=*/true);
}

bool Runtime::prefetch_replacing(TensorId id, const std::vector<TensorId>& replaceable) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  return rt.prefetch_replacing(lock, t, replaceable);
}

bool Runtime::stage(TensorId id, Tier tier) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  STRATA_EXPECTS(tier != Tier::Nvme, "stage: to the device or the host tier");
  TensorState& t = rt.get(id);
  return rt.stage(lock, t, tier);
}

bool Runtime::evict(TensorId id, Tier tier) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  Copy& c = t.copies[idx(tier)];
  rt.changed.wait(lock,
                  [&] { return c.state != CopyState::Loading && c.state != CopyState::Evicting; });
  if (!c.has_space()) return false;
  STRATA_EXPECTS(c.leases == 0, "evict \"", t.desc.name, "\" from ", to_string(tier),
                 ": it is leased there");
  if (rt.dirty(t, tier) && !rt.below(tier)) {
    STRATA_FAIL(Errc::invalid_argument, "evict \"", t.desc.name, "\" from ", to_string(tier),
                ": it is the only copy and there is no tier below");
  }
  rt.changed.wait(lock, [&] { return c.pins == 0; });
  if (!c.has_space()) return false;
  const bool dirty = rt.dirty(t, tier);
  rt.evict_copy(lock, t, tier);
  return dirty;
}

void Runtime::read(TensorId id, void* dst, std::size_t bytes) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  STRATA_EXPECTS(bytes <= t.desc.bytes, "read of ", bytes, " bytes from \"", t.desc.name, "\" of ",
                 t.desc.bytes, " bytes");
  STRATA_EXPECTS(!t.discarded, "read of \"", t.desc.name,
                 "\": it was discarded and not written since");
  rt.changed.wait(lock, [&] {
    for (Tier s : {Tier::Device, Tier::Host, Tier::Nvme})
      if (t.current(s) && t.copies[idx(s)].state == CopyState::Valid) return true;
    return false;
  });
  Tier src = Tier::Nvme;
  for (Tier s : {Tier::Device, Tier::Host, Tier::Nvme})
    if (t.current(s) && t.copies[idx(s)].state == CopyState::Valid) {
      src = s;
      break;
    }
  Copy& c = t.copies[idx(src)];
  ++c.pins;
  lock.unlock();
  std::exception_ptr error;
  try {
    if (src == Tier::Device)
      rt.backend->copy(dst, c.ptr, bytes, CopyKind::DeviceToHost);
    else if (src == Tier::Host)
      std::memcpy(dst, c.ptr, bytes);
    else
      rt.swap->read(c.extent, dst, bytes).get();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  --c.pins;
  rt.changed.notify_all();
  if (error) std::rethrow_exception(error);
}

void Runtime::write(TensorId id, const void* src, std::size_t bytes) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  STRATA_EXPECTS(bytes == t.desc.bytes, "write of ", bytes, " bytes into \"", t.desc.name, "\" of ",
                 t.desc.bytes, " bytes: write the whole tensor");
  for (const Copy& c : t.copies)
    STRATA_EXPECTS(c.leases == 0, "write into \"", t.desc.name, "\": it is leased");
  // Into the fastest tier that has space for it, else its home.
  Tier tier = t.home;
  if (t.copies[idx(Tier::Device)].has_space())
    tier = Tier::Device;
  else if (t.copies[idx(Tier::Host)].has_space())
    tier = Tier::Host;
  Copy& c = t.copies[idx(tier)];
  rt.changed.wait(lock, [&] {
    return c.pins == 0 && c.state != CopyState::Loading && c.state != CopyState::Evicting;
  });
  if (tier == Tier::Nvme && c.mapped) rt.free_space(t, Tier::Nvme);  // never write a model
  rt.make_room(lock, t, tier);
  ++c.pins;
  c.state = CopyState::Loading;
  lock.unlock();
  std::exception_ptr error;
  try {
    if (tier == Tier::Device)
      rt.backend->copy(c.ptr, src, bytes, CopyKind::HostToDevice);
    else if (tier == Tier::Host)
      std::memcpy(c.ptr, src, bytes);
    else
      rt.swap->write(c.extent, src, bytes).get();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  --c.pins;
  if (error) {
    // The old bytes may be partly overwritten; the tensor's other copies still hold them.
    c.state = CopyState::Absent;
    c.version = 0;
    rt.changed.notify_all();
    std::rethrow_exception(error);
  }
  t.version += 1;
  t.discarded = false;
  c.state = CopyState::Valid;
  c.version = t.version;
  c.ready = true;
  c.last_use = ++rt.clock;
  rt.changed.notify_all();
}

void Runtime::discard(TensorId id) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  rt.discard(lock, rt.get(id), nullptr);
}

bool Lease::discard() {
  if (runtime_ == nullptr) return false;
  Runtime::Impl& rt = *runtime_->impl_;
  bool done = false;
  {
    std::unique_lock lock(rt.mutex);
    const auto it = rt.tensors.find(tensor_);
    if (it != rt.tensors.end() && !rt.leased_elsewhere(*it->second, tier_) &&
        !it->second->copies[idx(Tier::Nvme)].mapped)
      done = rt.discard(lock, *it->second, this);
    rt.run_after_unlock(lock);  // a claimant granted the room of this copy (Arrival in pieces)
  }
  if (!done) {
    release();
    return false;
  }
  rt.changed.notify_all();
  runtime_ = nullptr;
  event_.reset();
  return true;
}

bool Runtime::discarded(TensorId id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->get(id).discarded;
}

void Runtime::synchronize() {
  std::unique_lock lock(impl_->mutex);
  impl_->changed.wait(lock, [&] { return impl_->moves_in_flight == 0; });
}

const TensorDesc& Runtime::describe(TensorId id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->get(id).desc;
}

bool Runtime::resident(TensorId id, Tier tier) const {
  std::lock_guard lock(impl_->mutex);
  const TensorState& t = impl_->get(id);
  const Copy& c = t.copies[idx(tier)];
  return c.version == t.version && (c.state == CopyState::Valid || c.state == CopyState::Loading);
}

std::vector<TensorId> Runtime::tensors() const {
  std::lock_guard lock(impl_->mutex);
  std::vector<TensorId> out;
  for (const auto& [id, t] : impl_->tensors)
    out.push_back(id);
  std::sort(out.begin(), out.end());
  return out;
}

TierStats Runtime::tier_stats(Tier tier) const {
  std::lock_guard lock(impl_->mutex);
  TierStats s = impl_->stats[idx(tier)];
  s.used_bytes = impl_->used(tier);
  return s;
}

TransferStats Runtime::transfer_stats() const {
  std::lock_guard lock(impl_->mutex);
  const auto& b = impl_->path_bytes;
  TransferStats s;
  s.bytes_host_to_device = b[idx(Tier::Host)][idx(Tier::Device)];
  s.bytes_device_to_host = b[idx(Tier::Device)][idx(Tier::Host)];
  s.bytes_nvme_to_host = b[idx(Tier::Nvme)][idx(Tier::Host)];
  s.bytes_host_to_nvme = b[idx(Tier::Host)][idx(Tier::Nvme)];
  s.bytes_nvme_to_device = b[idx(Tier::Nvme)][idx(Tier::Device)];
  s.bytes_device_to_nvme = b[idx(Tier::Device)][idx(Tier::Nvme)];
  return s;
}

std::string Runtime::stats_json() const {
  using nlohmann::json;
  json tiers = json::object();
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme}) {
    if (!impl_->has_tier(tier)) continue;
    const TierStats s = tier_stats(tier);
    tiers[std::string(to_string(tier))] = {{"capacity_bytes", s.capacity_bytes},
                                           {"used_bytes", s.used_bytes},
                                           {"peak_bytes", s.peak_bytes},
                                           {"leased_bytes", s.leased_bytes},
                                           {"bytes_in", s.bytes_in},
                                           {"bytes_out", s.bytes_out},
                                           {"moves", s.moves},
                                           {"evictions", s.evictions},
                                           {"write_backs", s.write_backs},
                                           {"hits", s.hits},
                                           {"misses", s.misses},
                                           {"compactions", s.compactions}};
  }
  json out{{"backend", std::string(to_string(impl_->backend->kind()))},
           {"device", impl_->backend->info().name},
           {"tensors", tensors().size()},
           {"tiers", tiers},
           {"pinned_bytes", impl_->slab.size()},
           {"pinned_huge_page_bytes", huge_page_bytes(impl_->slab.data(), impl_->slab.size())},
           {"transfers",
            [&] {
              const TransferStats x = transfer_stats();
              return json{{"bytes_host_to_device", x.bytes_host_to_device},
                          {"bytes_device_to_host", x.bytes_device_to_host},
                          {"bytes_nvme_to_host", x.bytes_nvme_to_host},
                          {"bytes_host_to_nvme", x.bytes_host_to_nvme},
                          {"bytes_nvme_to_device", x.bytes_nvme_to_device},
                          {"bytes_device_to_nvme", x.bytes_device_to_nvme}};
            }()},
           {"trace_events_dropped", impl_->telemetry.dropped()}};
  if (impl_->io) {
    const IoStats io = impl_->io->stats();
    out["io"] = {{"engine", impl_->io->describe()},       {"requests", io.requests},
                 {"operations", io.operations},           {"resubmissions", io.resubmissions},
                 {"failed_requests", io.failed_requests}, {"bytes_read", io.bytes_read},
                 {"bytes_written", io.bytes_written}};
    if (impl_->swap) out["io"]["bytes_bounced"] = impl_->swap->bounced_bytes();
  }
  return out.dump();
}

}  // namespace strata
