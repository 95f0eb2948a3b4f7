// The eviction policies the runtime ships: least recently used, and farthest next use (Belady,
// from a schedule's next uses). A policy only ranks candidates; the core (space.cpp) evicts.
#include "strata/runtime/runtime.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace strata {

std::size_t LruPolicy::choose(Tier, const std::vector<EvictionCandidate>& c) {
  return static_cast<std::size_t>(
      std::min_element(c.begin(), c.end(),
                       [](const auto& a, const auto& b) { return a.last_use < b.last_use; }) -
      c.begin());
}

std::size_t FarthestNextUsePolicy::choose(Tier, const std::vector<EvictionCandidate>& c) {
  std::size_t best = 0;
  std::uint64_t best_next = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    const std::uint64_t next = next_use_(c[i].tensor);
    if (i == 0 || next > best_next || (next == best_next && c[i].last_use < c[best].last_use)) {
      best = i;
      best_next = next;
    }
  }
  return best;
}

}  // namespace strata
