#include "strata/scheduler/schedule.h"

#include <algorithm>
#include <unordered_set>

#include "strata/base/error.h"

namespace strata {

Schedule::Schedule(std::vector<Step> steps) {
  for (Step& step : steps)
    append(std::move(step));
}

void Schedule::append(Step step) {
  std::unordered_set<std::uint64_t> seen;
  for (const TensorUse& u : step.uses) {
    STRATA_EXPECTS(seen.insert(u.tensor).second, "schedule step ", steps_.size(), " (\"", step.name,
                   "\") names tensor ", u.tensor, " twice; give it once with Access::ReadWrite");
  }
  const std::size_t index = steps_.size();
  for (const TensorUse& u : step.uses)
    uses_[u.tensor].push_back(index);
  steps_.push_back(std::move(step));
}

std::size_t Schedule::next_use(std::uint64_t tensor, std::size_t step, bool cyclic) const {
  const auto it = uses_.find(tensor);
  if (it == uses_.end()) return kNever;
  const std::vector<std::size_t>& at = it->second;
  const auto next = std::lower_bound(at.begin(), at.end(), step);
  if (next != at.end()) return *next;
  return cyclic ? steps_.size() + at.front() : kNever;
}

std::size_t Schedule::last_use(std::uint64_t tensor) const {
  const auto it = uses_.find(tensor);
  return it == uses_.end() ? kNever : it->second.back();
}

}  // namespace strata
