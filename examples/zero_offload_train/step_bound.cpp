#include "step_bound.h"

#include <algorithm>

namespace strata::examples {

// Note [Step bound]: what one training step does (trainer.cpp), with L layers, as a chain:
//
//   prep -> F_0 -> ... -> F_{L-1} -> loss -> S_{L-1} -> ... -> S_0 -> S_{-1} -> end_iteration
//
// - prep makes the batch on the host and copies it to the device.
// - F_i, the forward of layer i, needs W[i] on the device: a host-to-device copy of its master
//   weights (which the last step's Adam updated), or an NVMe read when the host no longer holds
//   them.
// - S_k, the backward segment of layer k, runs B_k (the backward of layer k; it needs W[k] on
//   the device again, re-read when the device budget evicted it after the forward) on the
//   trainer's thread beside A_{k+1} (Adam of layer k + 1; it needs W[k+1] and the moments
//   S[k+1] on the host, read from NVMe, and the gradient G[k+1] that B_{k+1} wrote, copied
//   device to host). The segment ends when both have ended (optimizer.wait(), end_step), so it
//   lasts at least max(B_k, A_{k+1}). S_{-1} is A_0 alone.
// - The links (the drive, host to device, device to host) work beside all of it, as far ahead
//   as the budgets let the planner go: weight and state reads, gradients going down, updated
//   weights and moments written back. Some of that falls in the forward (the backward's first
//   state reads, the last step's final write-backs), the rest in the backward and in
//   end_iteration (which waits for this step's write-backs).
//
// Given each phase's busy time measured in that step, no schedule of the step's work, as it was
// placed, is shorter than this critical path: the forward part lasts at least its compute chain
// and at least each link's busy time in it; the backward part at least the segments' sum and at
// least each link's busy time in it:
//
//   bound = max(prep + sum F + loss, nvme_f, h2d_f, d2h_f)
//         + max(sum_k max(B_k, A_{k+1}), nvme_b, h2d_b, d2h_b)
//
// Link times are busy times: the union of the link's spans clipped to the part (a queue of
// requests in flight counts once, not per request). The drive is one resource: its reads and
// writes share it, so its busy time is the union of both. Every term is therefore time inside
// the part it is charged to, and bound <= step for every step unless a span was mis-measured
// (a clock, a span charged to the wrong step): step_vs_bound below 1/1.02 is a measurement error
// and the example refuses it. Above 1 is time on the critical path when nothing was busy: a
// phase waiting for an input, or a hand-over between threads. The in-memory reference has no
// links and runs B_k then A_k one after the other.

double StepPhases::forward_part_s() const {
  return std::max({prep_s + forward_s + loss_s, nvme.forward_s, host_to_device.forward_s,
                   device_to_host.forward_s});
}

double StepPhases::backward_part_s() const {
  return std::max({backward_optimizer_s, nvme.backward_s, host_to_device.backward_s,
                   device_to_host.backward_s});
}

double StepPhases::bound_s() const {
  return forward_part_s() + backward_part_s();
}

double busy_s(std::vector<TraceEvent> spans, std::uint64_t from_ns, std::uint64_t to_ns) {
  for (TraceEvent& e : spans) {
    e.start_ns = std::clamp(e.start_ns, from_ns, to_ns);
    e.end_ns = std::clamp(e.end_ns, from_ns, to_ns);
  }
  std::erase_if(spans, [](const TraceEvent& e) { return e.end_ns <= e.start_ns; });
  std::sort(spans.begin(), spans.end(),
            [](const TraceEvent& a, const TraceEvent& b) { return a.start_ns < b.start_ns; });
  std::uint64_t busy = 0, open_start = 0, open_end = 0;
  bool open = false;
  for (const TraceEvent& e : spans) {
    if (open && e.start_ns <= open_end) {
      open_end = std::max(open_end, e.end_ns);
      continue;
    }
    if (open) busy += open_end - open_start;
    open = true;
    open_start = e.start_ns;
    open_end = e.end_ns;
  }
  if (open) busy += open_end - open_start;
  return static_cast<double>(busy) * 1e-9;
}

namespace {

std::vector<TraceEvent> spans_of(const std::vector<TraceEvent>& events,
                                 std::initializer_list<Track> tracks, const StepWindow& w) {
  std::vector<TraceEvent> out;
  for (const TraceEvent& e : events)
    if (std::find(tracks.begin(), tracks.end(), e.track) != tracks.end() && e.start_ns < w.end_ns &&
        e.end_ns > w.start_ns)
      out.push_back(e);
  return out;
}

LinkBusy link_busy(const std::vector<TraceEvent>& spans, const StepWindow& w) {
  return {busy_s(spans, w.start_ns, w.backward_ns), busy_s(spans, w.backward_ns, w.end_ns)};
}

}  // namespace

void add_link_busy(const std::vector<TraceEvent>& events, const StepWindow& window,
                   StepPhases& phases) {
  phases.nvme = link_busy(spans_of(events, {Track::NvmeRead, Track::NvmeWrite}, window), window);
  phases.host_to_device = link_busy(spans_of(events, {Track::H2D}, window), window);
  phases.device_to_host = link_busy(spans_of(events, {Track::D2H}, window), window);
}

LinkBytes link_bytes(const std::vector<TraceEvent>& events,
                     const std::vector<StepWindow>& windows) {
  LinkBytes b;
  for (const TraceEvent& e : events) {
    const bool inside = std::any_of(windows.begin(), windows.end(), [&](const StepWindow& w) {
      return e.end_ns >= w.start_ns && e.end_ns < w.end_ns;
    });
    if (!inside) continue;
    switch (e.track) {
      case Track::NvmeRead:
        b.nvme_read += e.bytes;
        break;
      case Track::NvmeWrite:
        b.nvme_write += e.bytes;
        break;
      case Track::H2D:
        b.host_to_device += e.bytes;
        break;
      case Track::D2H:
        b.device_to_host += e.bytes;
        break;
      default:
        break;
    }
  }
  return b;
}

}  // namespace strata::examples
