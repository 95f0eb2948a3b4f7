// Schedule: the ordered steps of one iteration and the tensors each step touches. The planner
// (prefetch) and the farthest-next-use eviction policy read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/runtime/tensor.h"
#include "strata/runtime/tier.h"

namespace strata {

/// How a step uses a tensor.
struct TensorUse {
  TensorId tensor = 0;
  Access access = Access::Read;  ///< Write is write-discard: nothing is brought for it
  Tier tier = Tier::Device;      ///< where the step needs it
  friend bool operator==(const TensorUse&, const TensorUse&) = default;
};

struct Step {
  std::string name;
  std::vector<TensorUse> uses;
};

/// An ordered list of steps with an index of where each tensor is used.
///
/// Thread safety: const members may be called concurrently; mutation is single-threaded.
class Schedule {
 public:
  static constexpr std::size_t kNever = std::numeric_limits<std::size_t>::max();

  Schedule() = default;
  explicit Schedule(std::vector<Step> steps);

  /// Appends a step; throws strata::Error (invalid_argument) when it names a tensor twice.
  void append(Step step);
  [[nodiscard]] const std::vector<Step>& steps() const noexcept { return steps_; }
  [[nodiscard]] std::size_t size() const noexcept { return steps_.size(); }
  [[nodiscard]] bool empty() const noexcept { return steps_.empty(); }

  /// The first step at or after `step` that uses `tensor`, or kNever. Wraps around when `cyclic`
  /// (the next iteration repeats this one): the distance then counts steps into the next one.
  [[nodiscard]] std::size_t next_use(std::uint64_t tensor, std::size_t step,
                                     bool cyclic = false) const;
  /// The last step that uses `tensor`, or kNever.
  [[nodiscard]] std::size_t last_use(std::uint64_t tensor) const;

 private:
  std::vector<Step> steps_;
  std::unordered_map<std::uint64_t, std::vector<std::size_t>> uses_;  // tensor -> steps, sorted
};

}  // namespace strata
