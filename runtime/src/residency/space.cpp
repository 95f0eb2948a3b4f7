// Per-tier space: allocating and freeing a copy's block, compaction (Note [Compaction without
// the lock]), the copies that may be evicted, the out-of-memory error that names what holds the
// tier, and staging (room from free space and clean copies only). Making room with write-backs
// is room.cpp. Starts a move only to stage a tensor.

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>

#include "impl.h"
#include "strata/base/error.h"
#include "strata/base/tunables.h"
#include "strata/base/units.h"
#include "strata/io/device_limits.h"
#include "strata/io/pages.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

bool Runtime::Impl::try_alloc(TensorState& t, Tier tier) {
  Copy& c = t.copies[idx(tier)];
  if (c.has_space()) return true;
  const std::uint64_t bytes = t.bytes_on(tier);
  if (tier == Tier::Device) {
    c.ptr = static_cast<std::byte*>(
        backend->device_pool().try_allocate(bytes, tunables::kDeviceAlignment));
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

void Runtime::Impl::free_space(TensorState& t, Tier tier) {
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

std::vector<TensorState*> Runtime::Impl::evictable(Tier tier, const TensorState& exclude) {
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

std::pair<std::uint64_t, std::uint64_t> Runtime::Impl::free_on(Tier tier) {
  if (MemoryPool* p = pool(tier)) {
    const PoolStats s = p->stats();
    return {s.free_bytes, s.largest_free_bytes};
  }
  if (tier == Tier::Nvme && swap) {
    const RangeStats s = swap->stats();
    return {s.free_bytes, s.largest_free_bytes};
  }
  return {0, 0};
}

void Runtime::Impl::out_of_memory(Tier tier, const TensorState& t) {
  const auto [free, largest] = free_on(tier);
  if (tier == Tier::Nvme) {  // the last tier: nothing there is evicted
    std::uint64_t held = 0;
    std::size_t count = 0;
    for (auto& [id, other] : tensors)
      if (other->copies[idx(Tier::Nvme)].extent != 0) {
        held += other->stored;
        ++count;
      }
    throw OutOfMemoryError(
        "Nvme", t.bytes_on(tier), free, largest,
        detail::concat("tensor \"", t.desc.name,
                       "\" cannot be placed on NVMe, the last tier "
                       "(nothing there is evicted): ",
                       count, " tensors hold ", held, " bytes of it; raise nvme.capacity"));
  }
  std::string leased;
  std::uint64_t leased_bytes = 0;
  for (auto& [id, other] : tensors) {
    const Copy& c = other->copies[idx(tier)];
    if (!c.has_space()) continue;
    if (c.leases > 0 || c.pins > 0 || c.state == CopyState::Loading) {
      leased +=
          detail::concat(leased.empty() ? "" : ", ", "\"", other->desc.name, "\" (",
                         other->bytes_on(tier), " bytes", c.leases ? ", leased" : ", in use", ")");
      leased_bytes += other->bytes_on(tier);
    }
  }
  throw OutOfMemoryError(
      std::string(to_string(tier)), t.bytes_on(tier), free, largest,
      detail::concat("tensor \"", t.desc.name,
                     "\" cannot be placed: everything else on the tier "
                     "is in use (",
                     leased_bytes, " bytes: ",
                     leased.empty() ? "nothing; the tier is smaller than the tensor" : leased,
                     ")"));
}

// Note [Compaction without the lock]: a copy slides down into the hole before it while the
// lock is released, so a large host copy (10 ms and more) does not stop every acquire, release
// and I/O completion meanwhile. Before unlocking, the hole is allocated (and the old block stays
// allocated), and the copy becomes Loading, not ready, and pinned: no lease goes out on it (a
// LeaseFuture waits for ready, and gets the new address), no eviction, write, discard or move
// takes it, and nothing else is placed over either block. After the copy, under the lock, the
// two blocks become the one at the hole. Callers re-check whatever they decided before.
bool Runtime::Impl::compact(std::unique_lock<std::mutex>& lock, Tier tier) {
  MemoryPool* p = pool(tier);
  if (p == nullptr) return false;
  std::map<std::byte*, TensorState*> by_address;
  for (auto& [id, t] : tensors)
    if (t->copies[idx(tier)].ptr != nullptr) by_address.emplace(t->copies[idx(tier)].ptr, t.get());
  for (auto& [addr, t] : by_address) {
    Copy& c = t->copies[idx(tier)];
    if (c.leases > 0 || c.pins > 0 || c.state != CopyState::Valid || c.claimed_by != 0 ||
        arrivals.contains(t->id))
      continue;
    // The free block that ends where this copy starts, if any.
    std::byte* gap = nullptr;
    for (const auto& [fp, fb] : p->free_blocks())
      if (fp + fb == c.ptr) gap = fp;
    if (gap == nullptr) continue;
    const std::size_t size =
        align_up(t->bytes_on(tier), tier == Tier::Host ? kPageBytes : tunables::kDeviceAlignment);
    const std::size_t step = static_cast<std::size_t>(c.ptr - gap);  // no chunk overlaps
    const bool overlap = step < size;
    std::byte* old = c.ptr;
    if (!p->allocate_at(gap, overlap ? step : size))  // cannot happen: [gap, old) is free
      STRATA_FAIL(Errc::internal, "compaction lost a block on tier ", to_string(tier));
    c.state = CopyState::Loading;
    c.ready = false;
    c.sliding = true;
    ++c.pins;
    TensorState& moving = *t;
    lock.unlock();
    std::exception_ptr error;
    try {
      const CopyKind kind = tier == Tier::Device ? CopyKind::DeviceToDevice : CopyKind::HostToHost;
      for (std::size_t at = 0; at < size; at += step)
        backend->copy(gap + at, old + at, std::min(step, size - at), kind);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    Copy& now = moving.copies[idx(tier)];
    if (error) {
      p->deallocate(gap);  // the old block still holds the bytes
    } else {
      p->deallocate(old);
      if (overlap) {
        p->deallocate(gap);
        if (!p->allocate_at(gap, size))  // cannot happen: [gap, old + size) is free
          STRATA_FAIL(Errc::internal, "compaction lost a block on tier ", to_string(tier));
      }
      now.ptr = gap;
      now.event.reset();
      notify([&](Observer& o) { o.compacted(moving.id, moving.bytes_on(tier), tier); });
    }
    now.state = CopyState::Valid;
    now.ready = true;
    now.sliding = false;
    unpin(now);
    ready_cv.notify_all();
    if (error) std::rethrow_exception(error);
    return true;
  }
  return false;
}

bool Runtime::Impl::stage(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier) {
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
  // Note [Compressed copies]: to the device from a current host copy only.
  if (tier == Tier::Device && t.compressed() && !t.current(Tier::Host)) return false;
  for (;;) {
    if (try_alloc(t, tier)) break;
    auto candidates = evictable(tier, t);
    std::erase_if(candidates, [&](TensorState* c) { return dirty(*c, tier); });
    if (candidates.empty()) return false;
    std::vector<EvictionCandidate> view;
    for (TensorState* c : candidates)
      // Not marked as duplicates (Note [Duplicates go first]): the requester, last used never,
      // would then lose to each of them in turn, and a stage that still finds no room would
      // have dropped them for nothing.
      view.push_back({c->id, c->bytes_on(tier), c->copies[idx(tier)].last_use, false, false});
    view.push_back({t.id, t.bytes_on(tier), 0, false, false});
    const std::size_t pick = policy->choose(tier, view);
    if (pick >= candidates.size()) return false;
    evict_copy(lock, *candidates[pick], tier);  // clean: dropped, the lock kept
  }
  start_load(lock, t, tier, source_for(t, tier));
  t.copies[idx(tier)].last_use = ++clock;
  run_after_unlock(lock);
  return true;
}

}  // namespace strata
