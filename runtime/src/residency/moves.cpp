// Moves between tiers: starting one (a stream copy for device <-> host, one read or write for
// host <-> NVMe, the chunk pipeline otherwise) and finishing it (the copy becomes Valid, or keeps
// the error, and waiters wake). Never makes room: the caller has allocated the destination.

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>

#include "impl.h"
#include "strata/io/device_limits.h"
#include "strata/io/error.h"
#include "strata/io/pages.h"
#include "strata/io/units.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

void Runtime::Impl::finish_move(TensorState& t, Tier dst, Tier src, std::exception_ptr error,
                                std::uint64_t version, std::optional<Tier> via) {
  std::unique_lock lock(mutex);
  Copy& c = t.copies[idx(dst)];
  unpin(t.copies[idx(src)]);
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
    // A move through a kept host copy reported its first leg when that copy landed.
    notify([&](Observer& o) { o.landed(t.id, t.desc.bytes, via.value_or(src), dst); });
  }
  --t.moves;
  --moves_in_flight;
  // Note [Arrival in pieces]: a claimed copy whose leases ended while it landed or was a
  // move's source goes now.
  if (dst == Tier::Device || src == Tier::Device) drop_if_claimed(lock, t);
  changed.notify_all();
  run_after_unlock(lock);
}

void Runtime::Impl::stream_span(std::atomic<std::uint64_t>& last, Track track,
                                std::uint64_t enqueued, std::uint64_t bytes, TensorId id) {
  const std::uint64_t end = steady_ns();
  const std::uint64_t start = std::max(enqueued, last.exchange(end));
  notify([&](Observer& o) { o.span(track, std::min(start, end), end, bytes, id); });
}

void Runtime::Impl::start_load(std::unique_lock<std::mutex>& lock, TensorState& t, Tier dst,
                               Tier src) {
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
    const std::uint64_t enqueued = steady_ns();
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
    const std::uint64_t submitted = steady_ns();
    io_after_unlock_.push_back([=, this] {
      auto done = [=, this](std::exception_ptr e) {
        span(read ? Track::NvmeRead : Track::NvmeWrite, submitted, bytes, tp->id);
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
