// Arrival in pieces: a device copy placed over free space and over copies it replaces, landing
// chunk by chunk as the replaced copies' leases end (Note [Arrival in pieces]). Claims and
// grants room; the chunks themselves run in chunk_pipeline.cpp.

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

void Runtime::Impl::grant(TensorId claimant) {
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
    r.owned.emplace_back(static_cast<std::size_t>(lo - r.base), static_cast<std::size_t>(hi - lo));
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

bool Runtime::Impl::held(TensorId id, std::size_t from, std::size_t to) const {
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

bool Runtime::Impl::prefetch_replacing(std::unique_lock<std::mutex>& lock, TensorState& t,
                                       const std::vector<TensorId>& replaceable) {
  for (;;) {
    const Copy& c = t.copies[idx(Tier::Device)];
    if (c.state == CopyState::Loading || c.state == CopyState::Evicting || t.current(Tier::Device))
      return true;  // there, or on its way
    if (t.discarded) return false;
    // As ensure(): a device load waits for a host copy that is landing, and reads it (a
    // compressed tensor's begins behind it: Note [A device prefetch does not wait for NVMe]).
    const Copy& h = t.copies[idx(Tier::Host)];
    if (h.state == CopyState::Loading && h.version == t.version && (!t.compressed() || h.sliding)) {
      settled.wait(lock);
      continue;
    }
    break;
  }
  Copy& d = t.copies[idx(Tier::Device)];
  // Note [Compressed copies]: a compressed tensor reaches the device from its host copy only,
  // brought from NVMe first (behind a host load: Note [A device prefetch does not wait for
  // NVMe]), dequantized whole; it does not arrive in pieces, so it needs free device room.
  // (Built and measured: on hf-vs-accelerate's Llama, int8 prefill passes read 0.21-0.25 of full
  // width without pieces and up to 0.46 with them, when host copies pinned as the sources of
  // pieces waiting for leases pushed out the ones the next pass reuses; no faster.)
  if (t.compressed()) {
    if (!t.current(Tier::Host)) {
      const Chained how = chain_through_host(lock, t, /*wait_for_room=*/false);
      if (how != Chained::host_current) return how == Chained::started;
      if (d.state == CopyState::Loading || t.current(Tier::Device)) return true;
    }
    if (!try_alloc(t, Tier::Device)) return false;
    start_load(lock, t, Tier::Device, Tier::Host);
    d.last_use = ++clock;
    run_after_unlock(lock);
    return true;
  }
  const Tier src = source_for(t, Tier::Device);
  if (!try_alloc(t, Tier::Device)) {
    // Free blocks and the replaceable copies' blocks, by address.
    const std::size_t need = align_up(t.desc.bytes, tunables::kDeviceAlignment);
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
      parts.emplace(oc.ptr, std::make_pair(align_up(o.desc.bytes, tunables::kDeviceAlignment), &o));
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

void Runtime::Impl::finish_failed_arrival(std::unique_lock<std::mutex>& lock, TensorId claimant) {
  const auto a = arrivals.find(claimant);
  if (a == arrivals.end() || !a->second.pipeline) return;
  auto p = a->second.pipeline;
  if (p->error && p->in_flight == 0) chunk_done(lock, p);
}

bool Runtime::Impl::droppable(const TensorState& o) {
  const Copy& c = o.copies[idx(Tier::Device)];
  return c.claimed_by != 0 && c.leases == 0 && c.pins == 0 && c.state == CopyState::Valid;
}

bool Runtime::Impl::drop_if_claimed(std::unique_lock<std::mutex>& lock, TensorState& o) {
  if (!droppable(o)) return false;
  const TensorId claimant = o.copies[idx(Tier::Device)].claimed_by;
  drop_claimed(o);
  finish_failed_arrival(lock, claimant);
  if (!lock.owns_lock()) lock.lock();
  return true;
}

void Runtime::Impl::drop_claimed(TensorState& o) {
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
  notify([&](Observer& ob) { ob.evicted(o.id, o.desc.bytes, Tier::Device); });
  free_space(o, Tier::Device);  // grants the claimant its part
  on_gone();
}

}  // namespace strata
