// The tensor table's records: a tensor's descriptor, its version and one copy per tier (state,
// space, leases, pins, version). Plain data; every rule about them lives in the residency core
// (impl.h) and runs under its mutex. Includes nothing of telemetry, I/O or the backends.
//
// Note [Versions]: a tensor has a version, bumped when a write lease ends (or write()). Each copy
// records the version it holds. A copy is current when its version equals the tensor's; a stale
// copy is never used as a source and may be dropped at no cost. A current copy is dirty when no
// lower tier holds a current copy: evicting it needs a write-back first. This replaces per-tier
// dirty flags and makes "write back once" hold by construction: after a write-back the lower
// copy is current, so the upper one is clean until the next write.
//
// Note [One move into a copy]: a move starts only into a copy that is neither Loading nor
// Evicting nor current already. A second move into a Loading copy races with the first: the
// first's completion marks the copy Valid and hands out leases (LeaseFuture::get) while the
// second is still writing the same bytes, and the second overwrites whatever a write lease put
// there meanwhile (unseen by Note [Versions]: it records the newer version). A move into a
// current copy rewrites bytes that leases may be using; one into an Evicting copy rewrites bytes
// its write-back is reading, and evict_copy then frees the block under it. ensure() checks this
// after its make_room; write_back() must too, because its make_room may wait with the lock
// released (the host is full and its victims go to NVMe) while a lease or prefetch on the lower
// tier starts, and lands, the same device -> host move. The ZeRO-Offload example did exactly
// that: Adam read a gradient's host lease while the d2h stream rewrote it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>

#include "strata/io/swap_space.h"
#include "strata/quant/group_quant.h"
#include "strata/runtime/backend.h"
#include "strata/runtime/tensor.h"
#include "strata/runtime/tier.h"

namespace strata::residency {

enum class CopyState : std::uint8_t { Absent, Loading, Valid, Evicting };
constexpr std::size_t kTiers = 3;
constexpr std::size_t idx(Tier t) {
  return static_cast<std::size_t>(t);
}

struct Copy {
  CopyState state = CopyState::Absent;
  std::uint64_t version = 0;
  std::byte* ptr = nullptr;  // device / host space
  ExtentId extent = 0;       // nvme space
  bool mapped = false;       // nvme: a read-only mapping of a file
  unsigned leases = 0;
  unsigned write_leases = 0;  // of `leases`, those that write
  unsigned pins = 0;          // sources of moves in flight
  TensorId claimed_by = 0;    // Note [Arrival in pieces]: dropped for it when its leases end
  bool ready = false;         // a lease may be handed out
  bool sliding = false;       // Note [Compaction without the lock]: Loading, but no move
  std::shared_ptr<Event> event;
  std::exception_ptr error;  // the last load failed
  std::uint64_t last_use = 0;
  [[nodiscard]] bool has_space() const { return ptr != nullptr || extent != 0; }
};

struct TensorState {
  TensorId id = 0;
  TensorDesc desc;
  /// Note [Compressed copies]: the bytes of its Host and Nvme copies (desc.bytes when it is not
  /// compressed) and, when it is, where they are. Every move carries `stored` bytes: a
  /// compressed tensor's reach the device as they are (more than its full width for tiny rows).
  std::uint64_t stored = 0;
  quant::Layout layout;
  Tier home = Tier::Host;
  std::uint64_t version = 1;
  std::array<Copy, kTiers> copies;
  int moves = 0;           // in flight
  bool discarded = false;  // no bytes anywhere until the next write
  /// Note [A device prefetch does not wait for NVMe]: its device move was begun behind its host
  /// load; when that lands, the device move is carried (or fails with it).
  bool device_after_host = false;
  [[nodiscard]] bool compressed() const { return desc.compression.codec != Codec::None; }
  /// The bytes of its copy on `t`: the Device copy is full width, the others as stored.
  [[nodiscard]] std::uint64_t bytes_on(Tier t) const {
    return t == Tier::Device ? desc.bytes : stored;
  }
  [[nodiscard]] bool current(Tier t) const {
    const Copy& c = copies[idx(t)];
    return (c.state == CopyState::Valid || c.state == CopyState::Evicting) && c.version == version;
  }
  /// A current copy on a tier faster than `t` that stays (not being evicted, not claimed for
  /// another tensor's arrival in pieces): the copy on `t` is a duplicate, not needed while that
  /// one stays (Note [Duplicates go first], eviction_policies.cpp).
  [[nodiscard]] bool held_above(Tier t) const {
    for (std::size_t i = 0; i < idx(t); ++i) {
      const Copy& c = copies[i];
      if (c.state == CopyState::Valid && c.claimed_by == 0 && current(static_cast<Tier>(i)))
        return true;
    }
    return false;
  }
  /// Nobody works on it: no move in flight, no copy pinned (a read, a move's source) and none
  /// being written back (an eviction holds a reference to this state across its waits).
  [[nodiscard]] bool idle() const {
    if (moves != 0) return false;
    for (const Copy& c : copies)
      if (c.pins != 0 || c.state == CopyState::Evicting) return false;
    return true;
  }
};

}  // namespace strata::residency
