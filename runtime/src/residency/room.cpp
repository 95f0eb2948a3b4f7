// Making room (Note [Making room]): space for a copy on a tier, found by an explicit loop over a
// stack of frames that picks victims, drops clean ones and writes dirty ones back to the tier
// below before dropping them. The policy (eviction_policies.cpp) picks; space.cpp allocates,
// frees and compacts; the write-backs are moves (moves.cpp). Blocks, releasing the lock while
// it waits.

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "impl.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/pages.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

// Note [Making room]
// ~~~~~~~~~~~~~~~~~~
// Room on a tier may need a victim evicted, and a dirty victim needs room on the tier below
// for its write-back, which may need a victim there, and so on down. This is one loop over a
// stack of frames, not functions calling each other:
//   Room{t, tier}    find space for t's copy on `tier`: a free block, else compaction, else a
//                    victim the policy picks (an Evict frame on top), else wait for copies
//                    still landing, else out of memory.
//   Evict{t, tier}   drop t's copy on `tier`. A dirty copy is marked Evicting and pinned, a
//                    target below is chosen (the host, or NVMe when the host cannot take it),
//                    room is made there (a Room frame on top), the write-back runs, and then the
//                    copy goes.
// The frame on top is the one that can move next; the stack is at most five frames deep (room
// on the device, a device victim, room on the host, a host victim, room on NVMe). An error
// unwinds it: each victim marked Evicting is Valid again, still dirty and still there, so
// nothing is lost. Two errors are caught on the way: out of memory while making room on the
// host for a write-back makes that write-back go straight to NVMe (if there is NVMe); out of
// memory below a request's own Room frame (no tier can take its dirty victim) leaves that frame
// to clean victims only, and when those do not make room either, the error names what was asked
// and the write-back's failure.
struct Runtime::Impl::RoomFrame {
  enum class Kind : std::uint8_t { Room, Evict };
  // An Evict frame's progress.
  enum class Stage : std::uint8_t { Start, ChooseTarget, RoomMade, Drop };
  Kind kind;
  TensorState* t;
  Tier tier;
  Stage stage = Stage::Start;
  Tier target = Tier::Host;
  bool marked = false;         // Evicting and pinned by this frame
  bool host_room = false;      // a Room frame for the host is on top of this one, NVMe behind it
  bool clean_only = false;     // a Room frame whose dirty victim found no room below: clean ones
  std::optional<Tier> pinned;  // the root Room frame: the tier of t's copy its caller pinned
};

void Runtime::Impl::make_room(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier,
                              std::optional<Tier> keep) {
  std::vector<RoomFrame> frames;
  frames.push_back({RoomFrame::Kind::Room, &t, tier});
  frames.back().pinned = keep;
  if (!keep) return run_frames(lock, frames);
  Copy& kept = t.copies[idx(*keep)];
  ++kept.pins;  // the load's source stays while room is made (and so does the tensor)
  try {
    run_frames(lock, frames);
  } catch (...) {
    unpin(kept);
    throw;
  }
  unpin(kept);
}

void Runtime::Impl::evict_copy(std::unique_lock<std::mutex>& lock, TensorState& t, Tier tier) {
  std::vector<RoomFrame> frames;
  frames.push_back({RoomFrame::Kind::Evict, &t, tier});
  run_frames(lock, frames);
}

void Runtime::Impl::run_frames(std::unique_lock<std::mutex>& lock, std::vector<RoomFrame>& frames) {
  std::exception_ptr below;  // a dirty victim's write-back found no room
  while (!frames.empty()) {
    try {
      if (frames.back().kind == RoomFrame::Kind::Room)
        room_step(lock, frames);
      else
        evict_step(lock, frames);
    } catch (const OutOfMemoryError&) {
      // The nearest write-back that was making room on the host goes to NVMe instead; the
      // frames above it are undone. Without one, everything is undone.
      std::size_t k = frames.size();
      while (k > 0 && !frames[k - 1].host_room)
        --k;
      if (k == 0) {
        RoomFrame& root = frames.front();
        if (frames.size() > 1 && root.kind == RoomFrame::Kind::Room && !root.clean_only) {
          below = std::current_exception();
          unwind(frames, 1);
          frames.front().clean_only = true;
          continue;
        }
        const RoomFrame asked = root;
        unwind(frames, 0);
        if (below) rethrow_for(asked.t, asked.tier, below);
        throw;
      }
      unwind(frames, k);
      RoomFrame& f = frames.back();
      f.host_room = false;
      f.target = Tier::Nvme;
      if (f.t->copies[idx(Tier::Nvme)].mapped) free_space(*f.t, Tier::Nvme);  // never a model
      frames.push_back({RoomFrame::Kind::Room, f.t, Tier::Nvme});
    } catch (...) {
      unwind(frames, 0);
      throw;
    }
  }
}

void Runtime::Impl::rethrow_for(const TensorState* t, Tier tier, std::exception_ptr below) {
  std::string here, why;
  try {
    throw;
  } catch (const Error& e) {
    here = e.what();
  }
  try {
    std::rethrow_exception(below);
  } catch (const Error& e) {
    why = e.what();
  }
  const auto [free, largest] = free_on(tier);
  throw OutOfMemoryError(
      std::string(to_string(tier)), t->bytes_on(tier), free, largest,
      detail::concat("tensor \"", t->desc.name, "\" cannot be placed on ", to_string(tier),
                     ": its clean copies do not make room (", here,
                     "), and a dirty copy's write-back found no room below (", why, ")"));
}

void Runtime::Impl::unwind(std::vector<RoomFrame>& frames, std::size_t keep) {
  while (frames.size() > keep) {
    RoomFrame& f = frames.back();
    if (f.marked) {
      Copy& c = f.t->copies[idx(f.tier)];
      c.state = CopyState::Valid;  // still dirty, still here: nothing lost
      unpin(c);
      on_gone();
    }
    frames.pop_back();
  }
}

void Runtime::Impl::room_step(std::unique_lock<std::mutex>& lock, std::vector<RoomFrame>& frames) {
  const RoomFrame f = frames.back();
  TensorState& t = *f.t;
  const Tier tier = f.tier;
  if (try_alloc(t, tier)) {
    frames.pop_back();
    return;
  }
  // Free bytes that would hold it, in holes: slide a copy down (without the lock), look again.
  if (MemoryPool* p = pool(tier); p != nullptr &&
                                  p->stats().free_bytes >= align_up(t.bytes_on(tier), kPageBytes) &&
                                  compact(lock, tier))
    return;
  // Copies still landing are shown to the policy too: if it would rather evict one of those,
  // wait for it to land; otherwise evict its choice now, without waiting for the link.
  auto candidates = evictable(tier, t);
  if (f.clean_only) std::erase_if(candidates, [&](TensorState* c) { return dirty(*c, tier); });
  std::vector<TensorState*> landing;
  for (auto& [id, o] : tensors) {
    const Copy& c = o->copies[idx(tier)];
    if (o.get() != &t && c.state == CopyState::Loading && c.leases == 0 && c.pins == 0)
      landing.push_back(o.get());
  }
  if (!candidates.empty()) {
    std::vector<EvictionCandidate> view;
    for (TensorState* c : candidates)
      view.push_back({c->id, c->bytes_on(tier), c->copies[idx(tier)].last_use, dirty(*c, tier),
                      c->held_above(tier)});
    for (TensorState* c : landing)
      view.push_back({c->id, c->bytes_on(tier), c->copies[idx(tier)].last_use, false, false});
    const std::size_t pick = policy->choose(tier, view);
    if (pick >= candidates.size()) {
      room.wait(lock);  // the policy's victim is still landing
      return;
    }
    frames.push_back({RoomFrame::Kind::Evict, candidates[pick], tier});
    return;
  }
  // Copies still arriving become evictable once they land; wait for them, else give up. The
  // pins and evictions this request holds itself (its caller's pin on the requester's source,
  // the victims it is writing back) end only when it does: counted as arriving, they were
  // waited for forever (an acquire on the host when the host held only dirty copies and NVMe
  // was full). Another thread's pins and evictions are still waited for.
  const RoomFrame& root = frames.front();
  const auto marked_here = [&](const TensorState* o) {  // this request's victims on this tier
    return static_cast<unsigned>(std::count_if(
        frames.begin(), frames.end(),
        [&](const RoomFrame& fr) { return fr.marked && fr.t == o && fr.tier == tier; }));
  };
  bool arriving = false;
  for (auto& [id, o] : tensors) {
    const Copy& c = o->copies[idx(tier)];
    if (o.get() == &t || c.leases > 0) continue;
    const unsigned marked = marked_here(o.get());
    const unsigned own_pins = marked + (o.get() == root.t && root.pinned == tier ? 1 : 0);
    if (c.state == CopyState::Loading || c.pins > own_pins ||
        (c.state == CopyState::Evicting && marked == 0))
      arriving = true;
  }
  if (!arriving) out_of_memory(tier, t);
  room.wait(lock);
  // Room may have come below too: dirty victims may go again.
  frames.back().clean_only = false;
}

void Runtime::Impl::evict_step(std::unique_lock<std::mutex>& lock, std::vector<RoomFrame>& frames) {
  RoomFrame& f = frames.back();
  TensorState& t = *f.t;
  Copy& c = t.copies[idx(f.tier)];
  switch (f.stage) {
    case RoomFrame::Stage::Start:
      if (!dirty(t, f.tier)) {
        f.stage = RoomFrame::Stage::Drop;
        return;
      }
      c.state = CopyState::Evicting;
      ++c.pins;
      f.marked = true;
      f.stage = RoomFrame::Stage::ChooseTarget;
      return;
    case RoomFrame::Stage::ChooseTarget: {
      // The host when it can take the copy (kept, the next load is cheap), else NVMe.
      f.target = *below(f.tier);
      f.host_room = f.target == Tier::Host && swap != nullptr;
      if (f.target == Tier::Nvme && t.copies[idx(Tier::Nvme)].mapped)
        free_space(t, Tier::Nvme);  // never write a model
      f.stage = RoomFrame::Stage::RoomMade;
      const RoomFrame room_below{RoomFrame::Kind::Room, &t, f.target};
      frames.push_back(room_below);  // invalidates f
      return;
    }
    case RoomFrame::Stage::RoomMade: {
      f.host_room = false;
      Copy& dst = t.copies[idx(f.target)];
      // Note [One move into a copy]: making room may have waited with the lock released, and a
      // lease or prefetch may meanwhile have started (or finished) this very move into `dst`.
      if (dst.state == CopyState::Loading || dst.state == CopyState::Evicting) {
        settled.wait(lock);
        f.stage = RoomFrame::Stage::ChooseTarget;
        return;
      }
      if (!dirty(t, f.tier)) {  // that move landed (or a write lease below made this one stale)
        if (dst.state == CopyState::Absent && dst.leases == 0 && dst.pins == 0)
          free_space(t, f.target);  // the room made for it
        f.stage = RoomFrame::Stage::Drop;
        return;
      }
      const Tier from = f.tier, target = f.target;
      start_load(lock, t, target, from);
      run_after_unlock(lock);
      settled.wait(lock, [&] { return dst.state != CopyState::Loading; });
      if (dst.error) std::rethrow_exception(dst.error);
      notify([&](Observer& o) { o.written_back(t.id, t.bytes_on(from), from); });
      frames.back().stage = RoomFrame::Stage::Drop;
      return;
    }
    case RoomFrame::Stage::Drop: {
      if (f.marked) {
        f.marked = false;
        unpin(c);
        // Moves that took this copy as their source while it was written back finish first.
        unpinned.wait(lock, [&] { return c.pins == 0; });
      }
      const Tier tier = f.tier;
      frames.pop_back();
      notify([&](Observer& o) { o.evicted(t.id, t.bytes_on(tier), tier); });
      free_space(t, tier);
      on_gone();
      return;
    }
  }
}

}  // namespace strata
