#include "strata/runtime/telemetry.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>

#include <nlohmann/json.hpp>

#include "strata/base/error.h"

namespace strata {

std::string_view to_string(Track track) noexcept {
  switch (track) {
    case Track::Compute:
      return "compute";
    case Track::H2D:
      return "host-to-device";
    case Track::D2H:
      return "device-to-host";
    case Track::D2D:
      return "device-to-device";
    case Track::NvmeRead:
      return "nvme read";
    case Track::NvmeWrite:
      return "nvme write";
    case Track::Eviction:
      return "eviction";
    case Track::Dequant:
      return "dequantize";
    case Track::Count:
      break;
  }
  return "?";
}

Telemetry::Telemetry(std::size_t capacity) : origin_ns_(steady_ns()), capacity_(capacity) {
  ring_.reserve(capacity_);  // record() and occupancy() never allocate (they are noexcept)
  occupancy_.reserve(capacity_);
}

std::uint64_t Telemetry::now_ns() const noexcept {
  return steady_ns() - origin_ns_;
}

void Telemetry::record(const TraceEvent& event) noexcept {
  std::lock_guard lock(mutex_);
  if (ring_.size() < capacity_) {
    ring_.push_back(event);
  } else {
    ring_[next_] = event;
    next_ = (next_ + 1) % capacity_;
    ++dropped_;
  }
}

void Telemetry::span(Track track, std::uint64_t start_ns, std::uint64_t end_ns, std::uint64_t bytes,
                     TensorId tensor) noexcept {
  record({since_origin(start_ns), since_origin(end_ns), track, bytes, tensor, 0});
}

void Telemetry::evicted(TensorId tensor, std::uint64_t bytes, Tier tier) noexcept {
  const std::uint64_t now = now_ns();
  record({now, now, Track::Eviction, bytes, tensor, static_cast<std::uint64_t>(tier)});
}

void Telemetry::occupancy(Tier tier, std::uint64_t used_bytes) noexcept {
  const OccupancySample s{now_ns(), tier, used_bytes};
  std::lock_guard lock(mutex_);
  if (occupancy_.size() < capacity_) {
    occupancy_.push_back(s);
  } else {
    occupancy_[occupancy_next_] = s;
    occupancy_next_ = (occupancy_next_ + 1) % capacity_;
  }
}

std::vector<TraceEvent> Telemetry::events() const {
  std::lock_guard lock(mutex_);
  std::vector<TraceEvent> out(ring_.begin() + static_cast<std::ptrdiff_t>(next_), ring_.end());
  out.insert(out.end(), ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(next_));
  return out;
}

std::vector<OccupancySample> Telemetry::occupancy_samples() const {
  std::lock_guard lock(mutex_);
  std::vector<OccupancySample> out(
      occupancy_.begin() + static_cast<std::ptrdiff_t>(occupancy_next_), occupancy_.end());
  out.insert(out.end(), occupancy_.begin(),
             occupancy_.begin() + static_cast<std::ptrdiff_t>(occupancy_next_));
  return out;
}

std::uint64_t Telemetry::dropped() const {
  std::lock_guard lock(mutex_);
  return dropped_;
}

void Telemetry::clear() {
  std::lock_guard lock(mutex_);
  ring_.clear();
  next_ = 0;
  dropped_ = 0;
  occupancy_.clear();
  occupancy_next_ = 0;
}

std::string Telemetry::chrome_trace_json() const {
  using nlohmann::json;
  json events = json::array();
  for (int t = 0; t < static_cast<int>(Track::Count); ++t) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", t},
                      {"args", {{"name", std::string(to_string(static_cast<Track>(t)))}}}});
  }
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "strata"}}}});
  std::uint64_t async_id = 0;
  for (const TraceEvent& e : this->events()) {
    const double ts = static_cast<double>(e.start_ns) / 1e3;
    const double dur = static_cast<double>(e.end_ns - std::min(e.end_ns, e.start_ns)) / 1e3;
    const std::string name = e.track == Track::Compute ? "step " + std::to_string(e.name_id)
                                                       : std::string(to_string(e.track)) + " t" +
                                                             std::to_string(e.tensor);
    const json args{{"bytes", e.bytes}, {"tensor", e.tensor}};
    if (e.track == Track::NvmeRead || e.track == Track::NvmeWrite) {
      // I/O requests overlap on their queue: async begin/end pairs, not nested slices.
      ++async_id;
      const int tid = static_cast<int>(e.track);
      events.push_back({{"name", name},
                        {"cat", "io"},
                        {"ph", "b"},
                        {"id", async_id},
                        {"pid", 1},
                        {"tid", tid},
                        {"ts", ts},
                        {"args", args}});
      events.push_back({{"name", name},
                        {"cat", "io"},
                        {"ph", "e"},
                        {"id", async_id},
                        {"pid", 1},
                        {"tid", tid},
                        {"ts", ts + dur}});
    } else {
      events.push_back({{"name", name},
                        {"ph", "X"},
                        {"pid", 1},
                        {"tid", static_cast<int>(e.track)},
                        {"ts", ts},
                        {"dur", dur},
                        {"args", args}});
    }
  }
  for (const OccupancySample& s : occupancy_samples()) {
    events.push_back({{"name", std::string(to_string(s.tier)) + " bytes"},
                      {"ph", "C"},
                      {"pid", 1},
                      {"ts", static_cast<double>(s.time_ns) / 1e3},
                      {"args", {{"used", s.used_bytes}}}});
  }
  return json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

void Telemetry::write_chrome_trace(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError(Errc::io_error, path, 0, 0, errno, "open for the trace");
  const std::string text = chrome_trace_json();
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  if (!out) throw IoError(Errc::io_error, path, 0, text.size(), errno, "write of the trace");
}

}  // namespace strata
