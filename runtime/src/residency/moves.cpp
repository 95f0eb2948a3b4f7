// Moves between tiers: starting one (the copy becomes Loading, its source pinned; the way
// across, from transport.cpp, carries the bytes) and finishing it (the copy becomes Valid, or
// keeps the error, and waiters wake). Never makes room: the caller has allocated the
// destination.

#include <algorithm>

#include "impl.h"
#include "strata/base/error.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

void Runtime::Impl::finish_move(TensorState& t, Tier dst, Tier src, std::exception_ptr error,
                                std::uint64_t version, std::optional<Tier> via) {
  std::unique_lock lock(mutex);
  Copy& c = t.copies[idx(dst)];
  unpin(t.copies[idx(src)]);
  if (error) {
    fail_landing(t, dst, error);
  } else {
    c.state = CopyState::Valid;
    c.version = std::max(c.version, version);  // a write lease may have ended during the load
    c.ready = true;
    // A move through a kept host copy reported its first leg when that copy landed.
    notify([&](Observer& o) { o.landed(t.id, t.stored, via.value_or(src), dst); });
  }
  if (dst == Tier::Host && t.device_after_host) {
    // Note [A device prefetch does not wait for NVMe]: the device move begun behind this load
    // goes on from the landed host copy, or fails with it.
    t.device_after_host = false;
    std::exception_ptr failed = error;
    if (!failed) {
      Copy& h = t.copies[idx(Tier::Host)];
      ++h.pins;  // the source, from now on
      try {
        carry(t, Tier::Device, Tier::Host);
      } catch (...) {
        // Refused before anything was queued: creating its event. (A stream that refuses to
        // record or to take a host function after the copy was queued is broken: CUDA's
        // sticky errors, or no memory for a closure; the failure is reported either way.)
        unpin(h);
        failed = std::current_exception();
      }
    }
    if (failed) {
      fail_landing(t, Tier::Device, failed);
      --t.moves;
      --moves_in_flight;
    }
  }
  --t.moves;
  --moves_in_flight;
  // Note [Arrival in pieces]: a claimed copy whose leases ended while it landed or was a
  // move's source goes now.
  if (dst == Tier::Device || src == Tier::Device) drop_if_claimed(lock, t);
  on_moved();
  run_after_unlock(lock);
}

void Runtime::Impl::start_load(std::unique_lock<std::mutex>& lock, TensorState& t, Tier dst,
                               Tier src) {
  (void)lock;
  begin_move(t, dst, src);
  ++t.copies[idx(src)].pins;
  carry(t, dst, src);
}

void Runtime::Impl::fail_landing(TensorState& t, Tier dst, std::exception_ptr error) {
  Copy& c = t.copies[idx(dst)];
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
    free_space(t, dst);
    Copy& now = t.copies[idx(dst)];
    now.error = kept.error;
    now.leases = kept.leases;  // their releases end them; no space is left to account
    now.write_leases = kept.write_leases;
  }
}

void Runtime::Impl::begin_move(TensorState& t, Tier dst, Tier src) {
  Copy& d = t.copies[idx(dst)];
  if (d.state == CopyState::Loading || d.state == CopyState::Evicting || t.current(dst)) {
    STRATA_FAIL(Errc::internal, "tensor \"", t.desc.name, "\": a move into its ", to_string(dst),
                " copy, which is current or has a move in flight (Note [One move into a copy])");
  }
  if (t.compressed() && (src == Tier::Device || (src == Tier::Nvme && dst == Tier::Device)))
    STRATA_FAIL(Errc::internal, "tensor \"", t.desc.name, "\" is compressed: no way from ",
                to_string(src), " to ", to_string(dst), " (Note [Compressed copies])");
  if (way_across(src, dst) == nullptr) {
    STRATA_FAIL(Errc::internal, "tensor \"", t.desc.name, "\": no way across from ", to_string(src),
                " to ", to_string(dst));
  }
  d.state = CopyState::Loading;
  d.version = t.version;
  d.ready = false;
  d.error = nullptr;
  d.event.reset();
  ++t.moves;
  ++moves_in_flight;
}

void Runtime::Impl::carry(TensorState& t, Tier dst, Tier src) {
  const std::uint64_t version = t.copies[idx(dst)].version;
  // Note [Arrival in pieces]: a copy landing in pieces goes chunk by chunk, whatever its way.
  if (src == Tier::Host && dst == Tier::Device && arrivals.contains(t.id)) {
    start_pipeline(t, dst, src, version);
    return;
  }
  (this->*way_across(src, dst))(t, dst, src, version);
}

void Runtime::Impl::run_after_unlock(std::unique_lock<std::mutex>& lock) {
  while (!io_after_unlock_.empty()) {
    auto work = std::move(io_after_unlock_);
    io_after_unlock_.clear();
    lock.unlock();
    for (auto& w : work)
      w();
    lock.lock();
  }
}

}  // namespace strata
