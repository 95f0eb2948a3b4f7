// The Runtime's public API: creating, mapping and destroying tensors, leases and prefetches,
// read/write, statistics. Each call takes the residency core's mutex and asks the core
// (runtime/src/residency/, impl.h) to act; the rules about copies, room and moves live there.
#include "strata/runtime/runtime.h"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "residency/impl.h"
#include "statistics.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/device_limits.h"
#include "strata/io/pages.h"
#include "strata/runtime/telemetry.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

Runtime::Runtime(RuntimeOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))),
      telemetry_(std::make_shared<Telemetry>(impl_->options.trace_events)),
      statistics_(std::make_shared<detail::Statistics>()) {
  std::lock_guard lock(impl_->mutex);
  impl_->add_observer(statistics_);
  impl_->add_observer(telemetry_);
}

std::unique_ptr<Runtime> Runtime::from_json(std::string_view json) {
  return std::make_unique<Runtime>(RuntimeOptions::from_json(json));
}

Runtime::~Runtime() = default;

Backend& Runtime::backend() noexcept {
  return *impl_->backend;
}
Telemetry& Runtime::telemetry() noexcept {
  return *telemetry_;
}
void Runtime::add_observer(std::shared_ptr<Observer> observer) {
  std::lock_guard lock(impl_->mutex);
  impl_->add_observer(std::move(observer));
}
IoEngine* Runtime::io() noexcept {
  return impl_->io.get();
}
SwapSpace* Runtime::swap() noexcept {
  return impl_->swap.get();
}
const RuntimeOptions& Runtime::options() const noexcept {
  return impl_->options;
}

void Runtime::set_eviction_policy(std::shared_ptr<EvictionPolicy> policy) {
  STRATA_EXPECTS(policy != nullptr, "set_eviction_policy: null policy");
  std::lock_guard lock(impl_->mutex);
  impl_->policy = std::move(policy);
}

namespace {
TensorDesc checked(const TensorDesc& desc) {
  TensorDesc d = desc;
  std::uint64_t from_shape = dtype_bytes(d.dtype);
  for (std::int64_t n : d.shape) {
    STRATA_EXPECTS(n >= 0, "tensor \"", d.name, "\": negative dimension ", n);
    from_shape *= static_cast<std::uint64_t>(n);
  }
  if (d.bytes == 0 && !d.shape.empty()) d.bytes = from_shape;
  STRATA_EXPECTS(d.bytes > 0, "tensor \"", d.name, "\": 0 bytes");
  STRATA_EXPECTS(d.shape.empty() || d.bytes == from_shape, "tensor \"", d.name, "\": ", d.bytes,
                 " bytes do not match its shape and dtype (", from_shape, " bytes)");
  return d;
}

// Note [Compressed copies]: where a compressed tensor's Host and Nvme bytes are, checked once.
void set_storage(TensorState& t) {
  const TensorDesc& d = t.desc;
  t.stored = d.bytes;
  if (d.compression.codec == Codec::None) return;
  STRATA_EXPECTS(quant::compressible(d.dtype), "tensor \"", d.name, "\": ", to_string(d.dtype),
                 " cannot be compressed (", to_string(d.compression.codec),
                 "); only f32, bf16 and f16 can");
  STRATA_EXPECTS(!d.shape.empty(), "tensor \"", d.name,
                 "\": a compressed tensor needs its shape (groups run along the last dimension)");
  t.layout = quant::layout(quant::scheme_of(d.compression), std::span<const std::int64_t>(d.shape));
  t.stored = t.layout.bytes;
}

[[noreturn]] void refuse_compressed(const TensorState& t, std::string_view what) {
  STRATA_FAIL(
      Errc::invalid_argument, what, " \"", t.desc.name, "\": it is stored compressed (",
      to_string(t.desc.compression.codec), ", groups of ", t.desc.compression.group,
      ") and read-only; lease it on the Device tier, where it is dequantized, or read() it");
}
}  // namespace

TensorId Runtime::create_tensor(const TensorDesc& desc, Tier home, const void* init) {
  Impl& rt = *impl_;
  auto state = std::make_unique<TensorState>();
  state->desc = checked(desc);
  state->home = home;
  set_storage(*state);
  STRATA_EXPECTS(!state->compressed() || home != Tier::Device, "create_tensor \"", desc.name,
                 "\": a compressed tensor is homed on Host or Nvme (its Device copy is made from "
                 "those)");
  std::unique_lock lock(rt.mutex);
  rt.require_tier(home, "create_tensor");
  state->id = rt.next_id++;
  TensorState& t = *state;
  rt.tensors.emplace(t.id, std::move(state));
  Copy& c = t.copies[idx(home)];
  try {
    rt.make_room(lock, t, home);
    ++c.pins;  // nobody evicts it while it is being filled
    lock.unlock();
    const std::uint64_t bytes = t.stored;
    PageBuffer packed;
    if (t.compressed() && init != nullptr) {  // quantized once, here
      packed = PageBuffer(bytes);
      quant::quantize(quant::scheme_of(t.desc.compression), t.layout, t.desc.dtype, init,
                      packed.data(), t.desc.name);
      init = packed.data();
    }  // zeros quantize to zeros: min 0, step 0, codes 0
    if (home == Tier::Nvme) {
      if (init != nullptr) {
        rt.swap->write(c.extent, 0, init, bytes).get();
      } else {
        const std::size_t zeros_bytes = std::min<std::uint64_t>(bytes, 4 * MiB);
        PageBuffer zeros(zeros_bytes);
        for (std::uint64_t at = 0; at < bytes; at += zeros_bytes)
          rt.swap
              ->write(c.extent, at, zeros.data(), std::min<std::uint64_t>(zeros_bytes, bytes - at))
              .get();
      }
    } else if (home == Tier::Host) {
      if (init != nullptr)
        std::memcpy(c.ptr, init, bytes);
      else
        std::memset(c.ptr, 0, bytes);
    } else {
      Stream& s = rt.backend->h2d_stream();
      if (init != nullptr)
        rt.backend->copy(c.ptr, init, bytes, CopyKind::HostToDevice);
      else {
        s.memset_async(c.ptr, 0, bytes);
        s.synchronize();
      }
    }
    lock.lock();
    rt.unpin(c);
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();
    rt.free_space(t, home);
    rt.tensors.erase(t.id);
    throw;
  }
  c.state = CopyState::Valid;
  c.version = t.version;
  c.ready = true;
  c.last_use = ++rt.clock;
  return t.id;
}

TensorId Runtime::map_tensor(const TensorDesc& desc, const std::string& path,
                             std::uint64_t offset) {
  Impl& rt = *impl_;
  auto state = std::make_unique<TensorState>();
  state->desc = checked(desc);
  state->home = Tier::Nvme;
  set_storage(*state);  // a compressed tensor's file holds its stored bytes
  std::lock_guard lock(rt.mutex);
  rt.require_tier(Tier::Nvme, "map_tensor");
  Copy& c = state->copies[idx(Tier::Nvme)];
  c.extent = rt.swap->map_file(path, offset, state->stored);
  c.mapped = true;
  c.state = CopyState::Valid;
  c.version = state->version;
  c.ready = true;
  state->id = rt.next_id++;
  const TensorId id = state->id;
  rt.tensors.emplace(id, std::move(state));
  return id;
}

void Runtime::destroy_tensor(TensorId id) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  for (const Copy& c : t.copies)
    STRATA_EXPECTS(c.leases == 0, "destroy_tensor \"", t.desc.name, "\": it is leased");
  // Nobody may still be working on it: a move (moves), a read or a move that took a copy as its
  // source (pins), an eviction writing a copy back (Evicting; it holds a reference to this
  // state across its waits). Waiting for moves alone freed the state under an eviction that
  // was waiting for a reader's pin (a hang, then a use after free, in the 8-thread test).
  rt.settled.wait(lock, [&] { return t.idle(); });
  for (const Copy& c : t.copies)  // leased while it waited
    STRATA_EXPECTS(c.leases == 0, "destroy_tensor \"", t.desc.name, "\": it is leased");
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme})
    rt.free_space(t, tier);
  rt.tensors.erase(id);
  rt.on_gone();
}

LeaseFuture Runtime::acquire(TensorId id, Tier tier, Access access) {
  Impl& rt = *impl_;
  STRATA_EXPECTS(tier != Tier::Nvme,
                 "acquire: tier Nvme has no addressable bytes; acquire on "
                 "Device or Host (prefetch and evict reach Nvme)");
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  if (t.compressed() && (writes(access) || tier != Tier::Device))
    refuse_compressed(t, writes(access) ? "acquire for write of" : "acquire on Host of");
  if (writes(access)) {
    for (Tier other : {Tier::Device, Tier::Host})
      STRATA_EXPECTS(other == tier || t.copies[idx(other)].leases == 0, "acquire for write of \"",
                     t.desc.name, "\" on ", to_string(tier), ": it is leased on ", to_string(other),
                     "; release that lease first");
  }
  rt.ensure(lock, t, tier, /*count=*/true, access, /*prefetch=*/false, /*lease=*/true);
  Copy& c = t.copies[idx(tier)];
  // A writer must not change bytes that a move is still copying out of this tier.
  if (writes(access)) rt.unpinned.wait(lock, [&] { return c.pins == 0; });
  c.last_use = ++rt.clock;
  LeaseFuture f;
  f.runtime_ = this;
  f.tensor_ = id;
  f.tier_ = tier;
  f.access_ = access;
  return f;
}

void Runtime::prefetch(TensorId id, Tier tier) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  rt.require_tier(tier, "prefetch");
  TensorState& t = rt.get(id);
  rt.ensure(lock, t, tier, /*count=*/false, Access::Read, /*prefetch=*/true);
}

bool Runtime::prefetch_replacing(TensorId id, const std::vector<TensorId>& replaceable) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  return rt.prefetch_replacing(lock, t, replaceable);
}

bool Runtime::stage(TensorId id, Tier tier) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  STRATA_EXPECTS(tier != Tier::Nvme, "stage: to the device or the host tier");
  TensorState& t = rt.get(id);
  return rt.stage(lock, t, tier);
}

bool Runtime::evict(TensorId id, Tier tier) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  Copy& c = t.copies[idx(tier)];
  // One wait for both: waiting for the pins after the state, the copy could go meanwhile and a
  // new load start into the same copy, which was then freed under that load (it landed as a
  // Valid copy with no bytes: the compressed prefetch test under six threads caught it).
  rt.settled.wait(lock, [&] {
    return c.state != CopyState::Loading && c.state != CopyState::Evicting && c.pins == 0;
  });
  if (!c.has_space()) return false;
  STRATA_EXPECTS(c.leases == 0, "evict \"", t.desc.name, "\" from ", to_string(tier),
                 ": it is leased there");
  if (rt.dirty(t, tier) && !rt.below(tier)) {
    STRATA_FAIL(Errc::invalid_argument, "evict \"", t.desc.name, "\" from ", to_string(tier),
                ": it is the only copy and there is no tier below");
  }
  const bool dirty = rt.dirty(t, tier);
  rt.evict_copy(lock, t, tier);
  return dirty;
}

void Runtime::read(TensorId id, void* dst, std::size_t bytes) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  STRATA_EXPECTS(bytes <= t.desc.bytes, "read of ", bytes, " bytes from \"", t.desc.name, "\" of ",
                 t.desc.bytes, " bytes");
  STRATA_EXPECTS(!t.discarded, "read of \"", t.desc.name,
                 "\": it was discarded and not written since");
  rt.settled.wait(lock, [&] {
    for (Tier s : {Tier::Device, Tier::Host, Tier::Nvme})
      if (t.current(s) && t.copies[idx(s)].state == CopyState::Valid) return true;
    return false;
  });
  Tier src = Tier::Nvme;
  for (Tier s : {Tier::Device, Tier::Host, Tier::Nvme})
    if (t.current(s) && t.copies[idx(s)].state == CopyState::Valid) {
      src = s;
      break;
    }
  Copy& c = t.copies[idx(src)];
  ++c.pins;
  lock.unlock();
  std::exception_ptr error;
  try {
    if (src == Tier::Device) {
      rt.backend->copy(dst, c.ptr, bytes, CopyKind::DeviceToHost);
    } else if (t.compressed()) {  // the stored bytes (the host copy, pinned), dequantized here
      PageBuffer packed;
      const std::byte* from = c.ptr;
      if (src == Tier::Nvme) {
        packed = PageBuffer(t.stored);
        rt.swap->read(c.extent, 0, packed.data(), t.stored).get();
        from = packed.data();
      }
      std::vector<std::byte> part(bytes < t.desc.bytes ? t.desc.bytes : 0);  // a prefix asked
      quant::dequantize(quant::bits_of(t.desc.compression.codec), t.layout, from, t.desc.dtype,
                        part.empty() ? dst : part.data(), 0, t.layout.rows);
      if (!part.empty()) std::memcpy(dst, part.data(), bytes);
    } else if (src == Tier::Host) {
      std::memcpy(dst, c.ptr, bytes);
    } else {
      rt.swap->read(c.extent, 0, dst, bytes).get();
    }
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  rt.unpin(c);
  if (error) std::rethrow_exception(error);
}

void Runtime::write(TensorId id, const void* src, std::size_t bytes) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(id);
  if (t.compressed()) refuse_compressed(t, "write into");
  STRATA_EXPECTS(bytes == t.desc.bytes, "write of ", bytes, " bytes into \"", t.desc.name, "\" of ",
                 t.desc.bytes, " bytes: write the whole tensor");
  for (const Copy& c : t.copies)
    STRATA_EXPECTS(c.leases == 0, "write into \"", t.desc.name, "\": it is leased");
  // Into the fastest tier that has space for it, else its home.
  Tier tier = t.home;
  if (t.copies[idx(Tier::Device)].has_space())
    tier = Tier::Device;
  else if (t.copies[idx(Tier::Host)].has_space())
    tier = Tier::Host;
  Copy& c = t.copies[idx(tier)];
  const auto settled = [&] {
    return c.pins == 0 && c.state != CopyState::Loading && c.state != CopyState::Evicting;
  };
  for (;;) {
    rt.settled.wait(lock, settled);
    if (tier == Tier::Nvme && c.mapped) rt.free_space(t, Tier::Nvme);  // never write a model
    rt.make_room(lock, t, tier);
    if (settled()) break;  // make_room may have released the lock: look again
  }
  for (const Copy& other : t.copies)  // leased while make_room had the lock released
    STRATA_EXPECTS(other.leases == 0, "write into \"", t.desc.name, "\": it is leased");
  ++c.pins;
  c.state = CopyState::Loading;
  lock.unlock();
  std::exception_ptr error;
  try {
    if (tier == Tier::Device)
      rt.backend->copy(c.ptr, src, bytes, CopyKind::HostToDevice);
    else if (tier == Tier::Host)
      std::memcpy(c.ptr, src, bytes);
    else
      rt.swap->write(c.extent, 0, src, bytes).get();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  rt.unpin(c);
  if (error) {
    // The old bytes may be partly overwritten; the tensor's other copies still hold them.
    c.state = CopyState::Absent;
    c.version = 0;
    rt.on_gone();
    std::rethrow_exception(error);
  }
  t.version += 1;
  t.discarded = false;
  c.state = CopyState::Valid;
  c.version = t.version;
  c.ready = true;
  c.last_use = ++rt.clock;
  rt.on_gone();
}

TensorId Runtime::create_unwritten(const TensorDesc& desc, Tier home) {
  Impl& rt = *impl_;
  auto state = std::make_unique<TensorState>();
  state->desc = checked(desc);
  state->home = home;
  set_storage(*state);
  STRATA_EXPECTS(!state->compressed(), "create_unwritten \"", desc.name,
                 "\": a compressed tensor is read-only; create it from its bytes");
  std::lock_guard lock(rt.mutex);
  rt.require_tier(home, "create_unwritten");
  state->id = rt.next_id++;
  state->discarded = true;  // every copy absent: the first lease writes (requests.cpp)
  const TensorId id = state->id;
  rt.tensors.emplace(id, std::move(state));
  return id;
}

void Runtime::discard(TensorId id) {
  Impl& rt = *impl_;
  std::unique_lock lock(rt.mutex);
  rt.discard(lock, rt.get(id), nullptr);
}

bool Lease::discard() {
  if (runtime_ == nullptr) return false;
  Runtime::Impl& rt = *runtime_->impl_;
  bool done = false;
  {
    std::unique_lock lock(rt.mutex);
    const auto it = rt.tensors.find(tensor_);
    if (it != rt.tensors.end() && !rt.leased_elsewhere(*it->second, tier_) &&
        !it->second->copies[idx(Tier::Nvme)].mapped && !it->second->compressed())
      done = rt.discard(lock, *it->second, this);
    rt.run_after_unlock(lock);  // a claimant granted the room of this copy (Arrival in pieces)
  }
  if (!done) {
    release();
    return false;
  }
  runtime_ = nullptr;
  event_.reset();
  return true;
}

bool Runtime::discarded(TensorId id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->get(id).discarded;
}

void Runtime::synchronize() {
  std::unique_lock lock(impl_->mutex);
  impl_->drained.wait(lock, [&] { return impl_->moves_in_flight == 0; });
}

TensorDesc Runtime::describe(TensorId id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->get(id).desc;
}

std::uint64_t Runtime::tensor_bytes(TensorId id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->get(id).desc.bytes;
}

std::uint64_t Runtime::tensor_bytes(TensorId id, Tier tier) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->get(id).bytes_on(tier);
}

bool Runtime::resident(TensorId id, Tier tier) const {
  std::lock_guard lock(impl_->mutex);
  const TensorState& t = impl_->get(id);
  const Copy& c = t.copies[idx(tier)];
  return c.version == t.version && (c.state == CopyState::Valid || c.state == CopyState::Loading);
}

std::vector<TensorId> Runtime::tensors() const {
  std::lock_guard lock(impl_->mutex);
  std::vector<TensorId> out;
  for (const auto& [id, t] : impl_->tensors)
    out.push_back(id);
  std::sort(out.begin(), out.end());
  return out;
}

TierStats Runtime::tier_stats(Tier tier) const {
  std::lock_guard lock(impl_->mutex);
  const Impl& rt = *impl_;
  TierStats s = statistics_->tier(tier);
  s.used_bytes = rt.used(tier);
  if (tier == Tier::Device) s.capacity_bytes = rt.backend->info().budget_bytes;
  if (tier == Tier::Host) s.capacity_bytes = rt.host_pool->capacity();
  if (tier == Tier::Nvme) s.capacity_bytes = rt.swap ? rt.swap->stats().capacity_bytes : 0;
  for (const auto& [id, t] : rt.tensors) {
    const Copy& c = t->copies[idx(tier)];
    if (c.leases > 0 && c.has_space()) s.leased_bytes += t->bytes_on(tier);
  }
  return s;
}

TransferStats Runtime::transfer_stats() const {
  std::lock_guard lock(impl_->mutex);
  return statistics_->transfers();
}

std::string Runtime::residency_json() const {
  using nlohmann::json;
  static constexpr const char* kStates[] = {"absent", "loading", "valid", "evicting"};
  std::lock_guard lock(impl_->mutex);
  json tensors = json::array();
  for (const auto& [id, t] : impl_->tensors) {
    json copies = json::object();
    for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme}) {
      const residency::Copy& c = t->copies[residency::idx(tier)];
      if (c.state == residency::CopyState::Absent && !c.has_space() && c.leases == 0) continue;
      copies[std::string(to_string(tier))] = {{"state", kStates[static_cast<int>(c.state)]},
                                              {"version", c.version},
                                              {"ready", c.ready},
                                              {"leases", c.leases},
                                              {"write_leases", c.write_leases},
                                              {"pins", c.pins},
                                              {"claimed_by", c.claimed_by},
                                              {"error", c.error != nullptr},
                                              {"event_ready", c.event ? c.event->ready() : true}};
    }
    tensors.push_back({{"id", id},
                       {"name", t->desc.name},
                       {"version", t->version},
                       {"moves", t->moves},
                       {"arriving", impl_->arrivals.contains(id)},
                       {"copies", copies}});
  }
  return json{{"moves_in_flight", impl_->moves_in_flight}, {"tensors", tensors}}.dump();
}

std::string Runtime::stats_json() const {
  using nlohmann::json;
  json tiers = json::object();
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme}) {
    if (!impl_->has_tier(tier)) continue;
    const TierStats s = tier_stats(tier);
    tiers[std::string(to_string(tier))] = {{"capacity_bytes", s.capacity_bytes},
                                           {"used_bytes", s.used_bytes},
                                           {"peak_bytes", s.peak_bytes},
                                           {"leased_bytes", s.leased_bytes},
                                           {"bytes_in", s.bytes_in},
                                           {"bytes_out", s.bytes_out},
                                           {"moves", s.moves},
                                           {"evictions", s.evictions},
                                           {"write_backs", s.write_backs},
                                           {"hits", s.hits},
                                           {"misses", s.misses},
                                           {"compactions", s.compactions},
                                           {"bytes_in_compressed", s.bytes_in_compressed},
                                           {"dequantizations", s.dequantizations},
                                           {"bytes_dequantized", s.bytes_dequantized},
                                           {"dequant_ns", s.dequant_ns}};
  }
  json out{{"backend", std::string(to_string(impl_->backend->kind()))},
           {"device", impl_->backend->info().name},
           {"tensors", tensors().size()},
           {"tiers", tiers},
           {"pinned_bytes", impl_->slab.size()},
           {"pinned_huge_page_bytes", huge_page_bytes(impl_->slab.data(), impl_->slab.size())},
           {"transfers",
            [&] {
              const TransferStats x = transfer_stats();
              return json{{"bytes_host_to_device", x.bytes_host_to_device},
                          {"bytes_device_to_host", x.bytes_device_to_host},
                          {"bytes_nvme_to_host", x.bytes_nvme_to_host},
                          {"bytes_host_to_nvme", x.bytes_host_to_nvme},
                          {"bytes_nvme_to_device", x.bytes_nvme_to_device},
                          {"bytes_device_to_nvme", x.bytes_device_to_nvme}};
            }()},
           {"trace_events_dropped", telemetry_->dropped()}};
  if (impl_->io) {
    const IoStats io = impl_->io->stats();
    out["io"] = {{"engine", impl_->io->describe()},       {"requests", io.requests},
                 {"operations", io.operations},           {"resubmissions", io.resubmissions},
                 {"failed_requests", io.failed_requests}, {"bytes_read", io.bytes_read},
                 {"bytes_written", io.bytes_written}};
    if (impl_->swap) out["io"]["bytes_bounced"] = impl_->swap->bounced_bytes();
  }
  return out.dump();
}

}  // namespace strata
