// The residency core's construction and its tensor table's lookups: the pinned slab (staging
// slots, then the host tier), the I/O engine and swap space, per-tier facts (used bytes,
// dirty, the tier below, a move's source) and occupancy statistics. Makes no room and starts no
// move.

#include <algorithm>
#include <cstdio>
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

Runtime::Impl::Impl(RuntimeOptions o) : options(std::move(o)) {
  options.validate();
  if (const std::string note = options.fit_staging_to_budget(); !note.empty()) {
    options.validate();  // the shrunk chunk against nvme.stripe
    if (!options.quiet) std::fprintf(stderr, "strata: %s\n", note.c_str());
  }
  options.backend.quiet = options.backend.quiet || options.quiet;
  backend = make_backend(options.backend);
  // One pinned slab: staging slots at its start, the host tier after them.
  slab = backend->allocate_pinned(options.host_budget_bytes);
  const std::size_t staging = options.staging_chunk_bytes * options.staging_chunks;
  for (unsigned i = 0; i < options.staging_chunks; ++i)
    staging_free.push_back(static_cast<std::byte*>(slab.data()) + i * options.staging_chunk_bytes);
  host_pool = std::make_unique<MemoryPool>(std::string(to_string(Tier::Host)),
                                           static_cast<std::byte*>(slab.data()) + staging,
                                           options.host_budget_bytes - staging, kPageBytes);
  if (!options.nvme.paths.empty()) {
    options.io.quiet = options.io.quiet || options.quiet;
    io = make_io_engine(options.io);
    io->register_buffer(slab.data(), slab.size(), contiguous_run_bytes(slab.data(), slab.size()));
    // Note [Direct NVMe to device]: reads may land in a host-addressable device's memory;
    // registered only to size their chunks (a lazily touched arena is not pinned).
    if (backend->info().host_addressable)
      io->register_buffer(backend->device_pool().base(), backend->info().budget_bytes,
                          backend->info().host_run_bytes, /*fixed=*/false);
    options.nvme.checksums = options.checksums;
    options.nvme.direct = options.io.direct;
    swap = std::make_unique<SwapSpace>(options.nvme, *io);
  }
  if (options.eviction == EvictionKind::FarthestNextUse) {
    // Until a schedule supplies next uses (the scheduler sets its own policy), every tensor
    // is equally far: the policy then falls back to least recently used.
    policy = std::make_shared<FarthestNextUsePolicy>(
        [](TensorId) { return std::numeric_limits<std::uint64_t>::max(); });
  }
}

Runtime::Impl::~Impl() {
  {
    std::unique_lock lock(mutex);
    drained.wait(lock, [&] { return moves_in_flight == 0; });
  }
  backend->h2d_stream().synchronize();
  backend->d2h_stream().synchronize();
  for (auto& [id, t] : tensors) {
    for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme})
      free_space(*t, tier);
  }
  tensors.clear();
  swap.reset();
  if (io) {
    io->unregister_buffer(slab.data());
    if (backend->info().host_addressable) io->unregister_buffer(backend->device_pool().base());
  }
}

TensorState& Runtime::Impl::get(TensorId id) {
  const auto it = tensors.find(id);
  if (it == tensors.end()) STRATA_FAIL(Errc::not_found, "no tensor ", id);
  return *it->second;
}

void Runtime::Impl::require_tier(Tier t, const char* what) const {
  if (!has_tier(t))
    STRATA_FAIL(Errc::invalid_argument, what,
                ": the Nvme tier is not configured (set nvme.paths and nvme.capacity)");
}

std::uint64_t Runtime::Impl::used(Tier t) const {
  if (t == Tier::Device) return backend->device_stats().current_bytes;
  if (t == Tier::Host) return host_pool->stats().current_bytes;
  return swap ? swap->stats().current_bytes : 0;
}

void Runtime::Impl::note_occupancy(Tier t) {
  const std::uint64_t u = used(t);
  notify([&](Observer& o) { o.occupancy(t, u); });
}

void Runtime::Impl::add_observer(std::shared_ptr<Observer> observer) {
  const std::size_t n = observer_count.load(std::memory_order_relaxed);
  STRATA_EXPECTS(observer != nullptr, "add_observer: a null observer");
  STRATA_EXPECTS(n < kMaxObservers, "add_observer: ", kMaxObservers - 2,
                 " observers are already added, which is the most there may be");
  observer_slots[n] = observer.get();
  observer_owners.push_back(std::move(observer));
  observer_count.store(n + 1, std::memory_order_release);
}

void Runtime::Impl::span(Track track, std::uint64_t start, std::uint64_t bytes,
                         TensorId id) const noexcept {
  const std::uint64_t end = steady_ns();
  notify([&](Observer& o) { o.span(track, std::min(start, end), end, bytes, id); });
}

bool Runtime::Impl::dirty(const TensorState& t, Tier tier) const {
  if (!t.current(tier)) return false;
  for (std::size_t below = idx(tier) + 1; below < kTiers; ++below)
    if (t.current(static_cast<Tier>(below))) return false;
  return true;
}

std::optional<Tier> Runtime::Impl::below(Tier tier) const {
  if (tier == Tier::Device) return Tier::Host;
  if (tier == Tier::Host && swap) return Tier::Nvme;
  return std::nullopt;
}

MemoryPool* Runtime::Impl::pool(Tier t) {
  return t == Tier::Device ? &backend->device_pool() : t == Tier::Host ? host_pool.get() : nullptr;
}

Tier Runtime::Impl::source_for(const TensorState& t, Tier dst) const {
  static constexpr std::array<std::array<Tier, 2>, kTiers> kOrder{{
      {Tier::Host, Tier::Nvme},    // to Device
      {Tier::Device, Tier::Nvme},  // to Host
      {Tier::Host, Tier::Device},  // to Nvme
  }};
  // Note [Compressed copies]: a compressed tensor's device copy is never a source.
  const auto usable = [&](Tier s) { return !(t.compressed() && s == Tier::Device); };
  for (Tier s : kOrder[idx(dst)])
    if (usable(s) && t.current(s) && t.copies[idx(s)].state == CopyState::Valid) return s;
  for (Tier s : kOrder[idx(dst)])
    if (usable(s) && t.current(s)) return s;
  STRATA_FAIL(Errc::internal, "tensor \"", t.desc.name, "\" has no current copy");
}

}  // namespace strata
