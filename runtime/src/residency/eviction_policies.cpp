// The eviction policies the runtime ships: least recently used, and farthest next use (Belady,
// from a schedule's next uses), each taking duplicates of a faster tier's copies first. A
// policy only ranks candidates; the core (space.cpp, room.cpp) evicts.
#include "strata/runtime/runtime.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace strata {

// Note [Duplicates go first]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A copy whose tensor has a current copy on a faster tier is not needed while that copy stays
// (a lease on the faster tier uses it; a lease on this tier copies it back down), so both
// policies evict a clean duplicate before any copy that is the only one on or above its tier
// (stage(), a speculative move, does not: space.cpp). The tiers then hold more distinct
// tensors (exclusive caching, as Wong and Wilkes, USENIX ATC'02, argue for a storage
// hierarchy). Dropping it costs a read from below only if the faster copy is evicted before
// the next use. This matters where a loop keeps tensors of its own beside a schedule's:
// the schedule does not know them, so Belady ranks them farthest, and without this rule the
// host copies of dense blocks already on the device tier pushed the expert cache's experts off
// the host tier on every token (bench/moe-vs-accelerate.py: 0 of 64 experts a token found).
namespace {

bool spare(const EvictionCandidate& c) {
  return c.above && !c.dirty;
}

}  // namespace

std::size_t LruPolicy::choose(Tier, const std::vector<EvictionCandidate>& c) {
  return static_cast<std::size_t>(std::min_element(c.begin(), c.end(),
                                                   [](const auto& a, const auto& b) {
                                                     if (spare(a) != spare(b)) return spare(a);
                                                     return a.last_use < b.last_use;
                                                   }) -
                                  c.begin());
}

std::size_t FarthestNextUsePolicy::choose(Tier, const std::vector<EvictionCandidate>& c) {
  std::size_t best = 0;
  std::uint64_t best_next = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    const std::uint64_t next = next_use_(c[i].tensor);
    const bool better =
        spare(c[i]) != spare(c[best])
            ? spare(c[i])
            : next > best_next || (next == best_next && c[i].last_use < c[best].last_use);
    if (i == 0 || better) {
      best = i;
      best_next = next;
    }
  }
  return best;
}

}  // namespace strata
