// The Runtime's statistics, counted as an Observer of the residency core: per-tier moves, bytes,
// evictions, write-backs, hits and misses, compactions and peak occupancy, and bytes per path.
// Relaxed atomics, no lock: a counter is read whole, and the Runtime reads them all under the
// core's lock, after the events it reports on. Gauges of the present (capacity, used and leased
// bytes) are not events: Runtime::tier_stats reads them from the core.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "strata/runtime/observer.h"
#include "strata/runtime/stats.h"

namespace strata::detail {

class Statistics final : public Observer {
 public:
  void landed(TensorId, std::uint64_t bytes, Tier from, Tier to) noexcept override {
    Counters& c = tiers_[at(to)];
    add(c.moves, 1);
    add(c.bytes_in, bytes);
    add(paths_[at(from)][at(to)], bytes);
  }
  void landed_compressed(TensorId, std::uint64_t stored_bytes, std::uint64_t bytes, Tier to,
                         std::uint64_t dequant_ns) noexcept override {
    Counters& c = tiers_[at(to)];
    add(c.bytes_in_compressed, stored_bytes);
    if (to != Tier::Device) return;  // the host and NVMe keep the stored bytes
    add(c.dequantizations, 1);
    add(c.bytes_dequantized, bytes);
    add(c.dequant_ns, dequant_ns);
  }
  void evicted(TensorId, std::uint64_t, Tier tier) noexcept override {
    add(tiers_[at(tier)].evictions, 1);
  }
  void written_back(TensorId, std::uint64_t bytes, Tier from) noexcept override {
    add(tiers_[at(from)].write_backs, 1);
    add(tiers_[at(from)].bytes_out, bytes);
  }
  void requested(TensorId, Tier tier, bool hit) noexcept override {
    add(hit ? tiers_[at(tier)].hits : tiers_[at(tier)].misses, 1);
  }
  void compacted(TensorId, std::uint64_t, Tier tier) noexcept override {
    add(tiers_[at(tier)].compactions, 1);
  }
  void occupancy(Tier tier, std::uint64_t used_bytes) noexcept override {
    std::atomic<std::uint64_t>& peak = tiers_[at(tier)].peak;
    std::uint64_t seen = peak.load(std::memory_order_relaxed);
    while (seen < used_bytes &&
           !peak.compare_exchange_weak(seen, used_bytes, std::memory_order_relaxed)) {
    }
  }

  /// The counters of `tier`; capacity, used and leased bytes are left 0 for the caller.
  [[nodiscard]] TierStats tier(Tier tier) const noexcept {
    const Counters& c = tiers_[at(tier)];
    TierStats s;
    s.peak_bytes = get(c.peak);
    s.bytes_in = get(c.bytes_in);
    s.bytes_out = get(c.bytes_out);
    s.moves = get(c.moves);
    s.evictions = get(c.evictions);
    s.write_backs = get(c.write_backs);
    s.hits = get(c.hits);
    s.misses = get(c.misses);
    s.compactions = get(c.compactions);
    s.bytes_in_compressed = get(c.bytes_in_compressed);
    s.dequantizations = get(c.dequantizations);
    s.bytes_dequantized = get(c.bytes_dequantized);
    s.dequant_ns = get(c.dequant_ns);
    return s;
  }
  [[nodiscard]] TransferStats transfers() const noexcept {
    const auto path = [&](Tier from, Tier to) { return get(paths_[at(from)][at(to)]); };
    TransferStats s;
    s.bytes_host_to_device = path(Tier::Host, Tier::Device);
    s.bytes_device_to_host = path(Tier::Device, Tier::Host);
    s.bytes_nvme_to_host = path(Tier::Nvme, Tier::Host);
    s.bytes_host_to_nvme = path(Tier::Host, Tier::Nvme);
    s.bytes_nvme_to_device = path(Tier::Nvme, Tier::Device);
    s.bytes_device_to_nvme = path(Tier::Device, Tier::Nvme);
    return s;
  }

 private:
  static constexpr std::size_t kTiers = 3;
  struct Counters {
    std::atomic<std::uint64_t> peak{0}, bytes_in{0}, bytes_out{0}, moves{0}, evictions{0},
        write_backs{0}, hits{0}, misses{0}, compactions{0}, bytes_in_compressed{0},
        dequantizations{0}, bytes_dequantized{0}, dequant_ns{0};
  };
  static constexpr std::size_t at(Tier t) noexcept { return static_cast<std::size_t>(t); }
  static void add(std::atomic<std::uint64_t>& c, std::uint64_t n) noexcept {
    c.fetch_add(n, std::memory_order_relaxed);
  }
  static std::uint64_t get(const std::atomic<std::uint64_t>& c) noexcept {
    return c.load(std::memory_order_relaxed);
  }
  std::array<Counters, kTiers> tiers_{};
  std::array<std::array<std::atomic<std::uint64_t>, kTiers>, kTiers> paths_{};
};

}  // namespace strata::detail
