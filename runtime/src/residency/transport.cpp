// Transport: the ways across, one per pair of tiers, in one table (way_across). A way carries a
// move that start_load (moves.cpp) has begun, from the source copy into the destination's
// allocated space, and calls finish_move when the bytes have landed (or failed). It touches
// only the two copies' bytes and the links; never the table's bookkeeping or the space.
//
//   from \ to  Device                   Host               Nvme
//   Device     -                        stream copy (d2h)  chunk pipeline (d2h, then write)
//   Host       stream copy (h2d)        -                  one write
//   Nvme       chunk pipeline (read,    one read           -
//              then h2d; or direct)
//
// A compressed tensor (Note [Compressed copies]) moves as stored between Host and Nvme, reaches
// the device from its host copy only, dequantized on the h2d stream (ensure() brings it to the
// host first), and never goes down from the device (it is read-only: its device copy is never
// the newest alone).
//
// A new way (GPUDirect Storage's cuFile for Nvme <-> Device) is one new function and its entry
// in the table.

#include <algorithm>
#include <array>

#include "impl.h"
#include "strata/base/error.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

Runtime::Impl::Way Runtime::Impl::way_across(Tier src, Tier dst) {
  static constexpr std::array<std::array<Way, kTiers>, kTiers> kWays = [] {
    std::array<std::array<Way, kTiers>, kTiers> w{};  // [from][to]; null: no way
    w[idx(Tier::Host)][idx(Tier::Device)] = &Impl::copy_on_stream;
    w[idx(Tier::Device)][idx(Tier::Host)] = &Impl::copy_on_stream;
    w[idx(Tier::Nvme)][idx(Tier::Host)] = &Impl::one_io;
    w[idx(Tier::Host)][idx(Tier::Nvme)] = &Impl::one_io;
    w[idx(Tier::Nvme)][idx(Tier::Device)] = &Impl::start_pipeline;  // chunk_pipeline.cpp
    w[idx(Tier::Device)][idx(Tier::Nvme)] = &Impl::start_pipeline;
    return w;
  }();
  return kWays[idx(src)][idx(dst)];
}

std::uint64_t Runtime::Impl::stream_span(std::atomic<std::uint64_t>& last, Track track,
                                         std::uint64_t enqueued, std::uint64_t bytes, TensorId id) {
  const std::uint64_t end = steady_ns();
  const std::uint64_t start = std::min(end, std::max(enqueued, last.exchange(end)));
  notify([&](Observer& o) { o.span(track, start, end, bytes, id); });
  return end - start;
}

Stream::DequantJob Runtime::Impl::dequant_job(const TensorState& t) {
  return {quant::bits_of(t.desc.compression.codec), t.layout, t.desc.dtype};
}

void Runtime::Impl::copy_on_stream(TensorState& t, Tier dst, Tier src, std::uint64_t version) {
  Copy& d = t.copies[idx(dst)];
  const Copy& s = t.copies[idx(src)];
  const bool up = dst == Tier::Device;
  const std::uint64_t bytes = t.stored;  // Note [Compressed copies]: what crosses the link
  TensorState* tp = &t;
  Stream& stream = up ? backend->h2d_stream() : backend->d2h_stream();
  auto event = std::shared_ptr<Event>(backend->create_event());
  const std::uint64_t enqueued = steady_ns();
  if (t.compressed()) {
    if (!up)
      STRATA_FAIL(Errc::internal, "tensor \"", t.desc.name,
                  "\" is compressed: its device copy never goes down (it is read-only)");
    try {
      stream.dequantize_async(d.ptr, s.ptr, bytes, dequant_job(t));
    } catch (...) {  // refused at once (no scratch on CUDA): the move ends, failed
      const std::exception_ptr e = std::current_exception();
      io_after_unlock_.push_back([=, this] { finish_move(*tp, dst, src, e, version); });
      return;
    }
    stream.record(*event);
    d.event = event;
    d.ready = true;
    stream.launch_host_func([this, tp, dst, src, version, enqueued, bytes] {
      const std::uint64_t ns = stream_span(h2d_last_ns, Track::Dequant, enqueued, bytes, tp->id);
      notify([&](Observer& o) {
        o.landed_compressed(tp->id, bytes, tp->desc.bytes, Tier::Device, ns);
      });
      finish_move(*tp, dst, src, nullptr, version);
    });
    return;
  }
  stream.copy_async(d.ptr, s.ptr, bytes, up ? CopyKind::HostToDevice : CopyKind::DeviceToHost);
  stream.record(*event);
  d.event = event;
  if (up) d.ready = true;  // a device lease may go out now: its users wait on the event
  stream.launch_host_func([this, tp, dst, src, version, enqueued, bytes, up] {
    stream_span(up ? h2d_last_ns : d2h_last_ns, up ? Track::H2D : Track::D2H, enqueued, bytes,
                tp->id);
    finish_move(*tp, dst, src, nullptr, version);
  });
}

void Runtime::Impl::one_io(TensorState& t, Tier dst, Tier src, std::uint64_t version) {
  const bool read = src == Tier::Nvme;
  const ExtentId extent = read ? t.copies[idx(src)].extent : t.copies[idx(dst)].extent;
  std::byte* ptr = read ? t.copies[idx(dst)].ptr : t.copies[idx(src)].ptr;
  const std::uint64_t bytes = t.stored;  // as stored on both (Note [Compressed copies])
  TensorState* tp = &t;
  const std::uint64_t submitted = steady_ns();
  // Submitted after the lock is released: an I/O that fails at once completes inline, and its
  // completion takes the lock.
  io_after_unlock_.push_back([=, this] {
    auto done = [=, this](std::exception_ptr e) {
      span(read ? Track::NvmeRead : Track::NvmeWrite, submitted, bytes, tp->id);
      if (!e && tp->compressed())
        notify([&](Observer& o) { o.landed_compressed(tp->id, bytes, bytes, dst, 0); });
      finish_move(*tp, dst, src, e, version);
    };
    if (read)
      swap->read(extent, 0, ptr, bytes, std::move(done));
    else
      swap->write(extent, 0, ptr, bytes, std::move(done));
  });
}

}  // namespace strata
