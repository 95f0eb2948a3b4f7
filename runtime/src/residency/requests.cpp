// Residency requests: making a tier hold (or receive) a tensor's newest bytes, starting the move
// and making the room it needs, and discarding a tensor's bytes everywhere.

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>

#include "impl.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/device_limits.h"
#include "strata/io/pages.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

bool Runtime::Impl::leased_elsewhere(const TensorState& t, Tier own) {
  for (Tier tier : {Tier::Device, Tier::Host}) {
    const unsigned mine = tier == own ? 1 : 0;
    if (t.copies[idx(tier)].leases > mine) return true;
  }
  return false;
}

bool Runtime::Impl::discard(std::unique_lock<std::mutex>& lock, TensorState& t, Lease* own) {
  const Tier own_tier = own != nullptr ? own->tier() : Tier::Nvme;
  STRATA_EXPECTS(!t.copies[idx(Tier::Nvme)].mapped, "discard \"", t.desc.name,
                 "\": it is a read-only mapping of a file");
  STRATA_EXPECTS(!t.compressed(), "discard \"", t.desc.name,
                 "\": it is stored compressed and read-only (nothing could refill it)");
  const auto check_leases = [&] {
    for (Tier tier : {Tier::Device, Tier::Host})
      STRATA_EXPECTS(t.copies[idx(tier)].leases == 0, "discard \"", t.desc.name,
                     "\": it is leased on ", to_string(tier));
  };
  if (own == nullptr) check_leases();
  settled.wait(lock, [&] { return t.idle(); });
  if (own == nullptr) {
    check_leases();  // leased while the moves finished
  } else {
    if (leased_elsewhere(t, own_tier)) return false;
    Copy& c = t.copies[idx(own_tier)];
    --c.leases;
    if (writes(own->access()) && c.write_leases > 0) --c.write_leases;
  }
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme})
    free_space(t, tier);
  t.discarded = true;
  on_gone();
  return true;
}

// Note [A device prefetch does not wait for NVMe]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A compressed tensor reaches the device only from its host copy (Note [Compressed copies]). A
// device prefetch of one whose host copy is not current waited for the NVMe read to land before
// it started the device load: the planner, which issues prefetches one after another, had one
// read in flight at a time and stalled behind each. Now the prefetch starts the host load (or
// finds it landing), makes room for the device copy as any device prefetch does (evicting by the
// policy, waiting for write-backs: on the prefetching thread) and begins the device move behind
// the host load: the device copy is Loading, not ready, its room held. finish_move, when the
// host copy lands, carries the device move from it (pinned from then on), or fails it with the
// host load's error; either way under the lock, with no waiting. An acquire meanwhile leases
// the Loading device copy as it would any load's. A compaction's sliding copy is Loading but no
// move's: it is waited for.
Runtime::Impl::Chained Runtime::Impl::chain_through_host(std::unique_lock<std::mutex>& lock,
                                                         TensorState& t, bool wait_for_room) {
  const Copy& h = t.copies[idx(Tier::Host)];
  Copy& d = t.copies[idx(Tier::Device)];
  const auto landing = [&] {
    return h.state == CopyState::Loading && h.version == t.version && !h.sliding;
  };
  // Room made for a device move that does not begin goes back (an Absent copy holding room is
  // nobody's victim).
  const auto give_up = [&] {
    if (d.state == CopyState::Absent && d.leases == 0 && d.has_space()) free_space(t, Tier::Device);
    return Chained::not_started;
  };
  bool asked = false;  // the host load, once: a failed one is the acquire's to retry
  for (;;) {
    if (t.current(Tier::Host)) return Chained::host_current;
    if (d.state == CopyState::Loading || d.state == CopyState::Evicting || t.current(Tier::Device))
      return Chained::started;                          // on its way already
    if (h.state == CopyState::Loading && !landing()) {  // sliding, or an older version's load
      settled.wait(lock);
      continue;
    }
    if (!landing()) {
      if (asked || t.discarded) return give_up();  // it failed (or landed and went)
      asked = true;
      try {
        ensure(lock, t, Tier::Host, /*count=*/false, Access::Read, /*prefetch=*/true,
               /*lease=*/false);
      } catch (...) {  // no room on the host: nor for the device move behind it
        give_up();
        throw;
      }
      continue;
    }
    if (!d.has_space()) {
      if (!wait_for_room) {
        if (!try_alloc(t, Tier::Device)) return give_up();
      } else {
        // Its NVMe copy is kept while room is made, as a load's source is: the tensor stays (no
        // destroy meanwhile), whatever its host copy does.
        make_room(lock, t, Tier::Device, Tier::Nvme);  // may wait: look again
        continue;
      }
    }
    begin_move(t, Tier::Device, Tier::Host);
    t.device_after_host = true;
    d.last_use = ++clock;
    return Chained::started;
  }
}

// Note [A lease is taken before the unlock]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An acquire's lease is counted on the copy before ensure() lets go of the lock. Starting a
// load ends by unlocking to submit its I/O; counted after that, the lease came too late when
// the load landed at once (a host memcpy) and another thread's make_room evicted the unleased
// copy meanwhile: the lease then sat on an absent copy and LeaseFuture::get waited forever
// (stream_inference-like loops under the prefetch pipeline hung about one run in two).
void Runtime::Impl::ensure(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier,
                           bool count, Access access, bool prefetch, bool lease) {
  int host_loads = 0;  // Note [Compressed copies]
  const auto take = [&](Copy& c) {
    if (!lease) return;
    ++c.leases;  // no eviction now
    if (writes(access)) ++c.write_leases;
  };
  for (;;) {
    Copy& c = t.copies[idx(tier)];
    if (c.state == CopyState::Evicting ||
        (c.state == CopyState::Loading && c.version != t.version)) {
      settled.wait(lock);
      continue;
    }
    if (c.state == CopyState::Loading) {
      if (count) requested(t, tier, true);  // already on its way (a prefetch hit)
      take(c);
      return;
    }
    if (t.current(tier)) {
      if (count) requested(t, tier, true);
      c.ready = true;
      take(c);
      return;
    }
    if (access == Access::Write || t.discarded) {
      if (access != Access::Write) {
        if (prefetch) return;
        STRATA_FAIL(Errc::invalid_argument, "tensor \"", t.desc.name,
                    "\" was discarded: its bytes are gone until a write lease "
                    "(Access::Write) or write() fills it");
      }
      if (count) requested(t, tier, true);  // nothing to move
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
      take(fresh);
      return;
    }
    // A write lease on a copy still finishing its load makes that copy the only current one
    // before it is Valid: wait for the load to land rather than pick no source.
    if (!t.current(Tier::Device) && !t.current(Tier::Host) && !t.current(Tier::Nvme)) {
      settled.wait(lock);
      continue;
    }
    // A device load while the tensor's host copy is landing (a prefetch staged it from NVMe
    // ahead of the device) waits for that copy and moves from it: NVMe is read once.
    if (tier == Tier::Device) {
      const Copy& h = t.copies[idx(Tier::Host)];
      // Note [A device prefetch does not wait for NVMe]
      if (prefetch && !lease && t.compressed() && !t.current(Tier::Host)) {
        if (chain_through_host(lock, t, /*wait_for_room=*/true) != Chained::host_current) return;
        continue;
      }
      if (h.state == CopyState::Loading && h.version == t.version) {
        settled.wait(lock);
        continue;
      }
      // Note [Compressed copies]: a compressed tensor reaches the device from its host copy
      // (dequantized on the way); from NVMe it lands on the host first. A failed host load
      // ends here, with its error.
      // Its host copy is clean, so other threads' room-making may drop it before this one
      // wakes: a few retries, then an error rather than loads that evict each other forever.
      if (t.compressed() && !t.current(Tier::Host)) {
        if (host_loads > 0 && h.error) std::rethrow_exception(h.error);
        if (host_loads == 4)
          STRATA_FAIL(Errc::out_of_memory, "tensor \"", t.desc.name,
                      "\": its compressed host copy was dropped 4 times before it reached the "
                      "device (the host tier is too small for the compressed tensors loaded at "
                      "once): raise the host budget");
        ++host_loads;
        ensure(lock, t, Tier::Host, false, Access::Read, prefetch, /*lease=*/false);
        continue;
      }
    }
    if (count) requested(t, tier, false);
    count = false;  // one request counts once, however often it loops
    make_room(lock, t, tier, source_for(t, tier));  // the source kept while room is made
    // make_room may have waited: another thread may have loaded the copy, or be loading it.
    // Start over rather than load into a copy that readers may already be using.
    const Copy& now = t.copies[idx(tier)];
    if (now.state == CopyState::Loading || now.state == CopyState::Evicting || t.current(tier))
      continue;
    start_load(lock, t, tier, source_for(t, tier));
    t.copies[idx(tier)].last_use = ++clock;  // a prefetch announces a use: not LRU's victim
    take(t.copies[idx(tier)]);
    run_after_unlock(lock);
    return;
  }
}

}  // namespace strata
