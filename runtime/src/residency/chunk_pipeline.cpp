// The chunk pipeline (Note [Chunk pipeline]): NVMe <-> device moves chunk by chunk through the
// host copy, the device copy itself or staging slots, and host -> device moves in pieces as
// their room is granted. Never makes room and never evicts.

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

// Note [Chunk pipeline]: NVMe -> device moves read chunk k into a landing buffer (the tensor's
// host copy when the host tier had room, else a staging slot of the pinned slab), then copy it
// to the device on the h2d stream; while that copy runs the next chunks are being read. A
// slot goes back to the pipeline (or to the next waiting one) when its device copy is done.
// Device -> NVMe write-backs run the same pipeline the other way (d2h, then write).

void Runtime::Impl::start_pipeline(TensorState& t, Tier dst, Tier src, std::uint64_t version) {
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
    if (options.host_copy_on_the_way && h.state == CopyState::Absent && try_alloc(t, Tier::Host)) {
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

std::size_t Runtime::Impl::next_chunk(const Pipeline& p) const {
  for (std::size_t k = 0; k < p.chunks; ++k) {
    if (p.started[k]) continue;
    const std::size_t from = k * p.chunk;
    const std::size_t to =
        static_cast<std::size_t>(std::min<std::uint64_t>(p.bytes, from + p.chunk));
    if (!p.down || held(p.t->id, from, to)) return k;
  }
  return p.chunks;
}

void Runtime::Impl::pump(const std::shared_ptr<Pipeline>& p) {
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

void Runtime::Impl::give_back_slot(const std::shared_ptr<Pipeline>& p, std::byte* slot) {
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

void Runtime::Impl::copy_chunk_up(const std::shared_ptr<Pipeline>& p, std::uint64_t offset,
                                  std::byte* landing, std::size_t len) {
  Stream& h2d = backend->h2d_stream();
  const std::uint64_t enqueued = steady_ns();
  h2d.copy_async(p->device + offset, landing, len, CopyKind::HostToDevice);
  if (++p->enqueued == p->chunks && !p->error) {
    h2d.record(*p->event);
    Copy& d = p->t->copies[idx(Tier::Device)];
    d.event = p->event;
    d.ready = true;  // device leases may go out: the last copy is on the stream
    ready_cv.notify_all();
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

void Runtime::Impl::launch_chunk(const std::shared_ptr<Pipeline>& p, std::size_t k,
                                 std::byte* landing) {
  const std::uint64_t offset = k * p->chunk;
  const std::size_t len = static_cast<std::size_t>(std::min(p->chunk, p->bytes - offset));
  const TensorId id = p->t->id;
  if (p->from_host != nullptr) {  // host -> device, chunk by chunk as room is held
    copy_chunk_up(p, offset, landing, len);
    return;
  }
  if (p->down) {
    const std::uint64_t submitted = steady_ns();
    io_after_unlock_.push_back([this, p, k, landing, offset, len, id, submitted] {
      auto done = [=, this](std::exception_ptr e) {
        span(Track::NvmeRead, submitted, len, id);
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
    const std::uint64_t enqueued = steady_ns();
    d2h.copy_async(landing, p->device + offset, len, CopyKind::DeviceToHost);
    d2h.launch_host_func([this, p, landing, offset, len, id, enqueued] {
      stream_span(d2h_last_ns, Track::D2H, enqueued, len, id);
      const std::uint64_t submitted = steady_ns();
      swap->write(p->extent, offset, landing, len, [=, this](std::exception_ptr e) {
        span(Track::NvmeWrite, submitted, len, id);
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

void Runtime::Impl::chunk_done(std::unique_lock<std::mutex>& lock,
                               const std::shared_ptr<Pipeline>& p) {
  // Finished once: between this unlock and finish_move's lock, a claimed copy's release may look
  // at the failed arrival again (finish_failed_arrival) and would finish it a second time.
  const bool finished = !p->finished && p->in_flight == 0 && (p->error || p->done == p->chunks);
  if (finished) {
    p->finished = true;
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
        notify([&](Observer& o) { o.landed(p->t->id, p->bytes, p->src, Tier::Host); });
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

}  // namespace strata
