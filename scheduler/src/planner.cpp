// The planner thread: from the schedule and the steps that have begun and ended, it issues the
// device window's prefetches, stages the steps beyond it on the host tier (Note [Two-level
// prefetch]) and lets the next step arrive in pieces; the runtime does the moves. It never
// blocks a step: it calls the runtime with the pipeline's lock released.
#include <algorithm>
#include <unordered_set>
#include <utility>

#include "pipeline_impl.h"
#include "strata/base/error.h"
#include "strata/base/thread_name.h"

namespace strata {

bool PrefetchPipeline::Impl::planner_has_work() const {
  return plan_requested_ && !schedule_.empty() && options_.prefetch != PrefetchMode::None &&
         !prefetch_log_.empty();
}

// Note [Two-level prefetch]: the planner looks ahead at two distances, as ZeRO-Infinity does
// (NVMe -> pinned, pinned -> GPU). The device window is the run of steps, from the first one not
// ended, whose distinct device-tier tensors fit the device budget (and host-tier ones the host
// budget); each of its steps' uses is prefetched to its own tier, once, in order. Beyond it the
// steps go on at the host level: their device-tier tensors that are read (and not written by an
// unfinished earlier step) are staged on the host tier, NVMe -> host, while the host window fits
// the host budget. The host window counts the host-tier uses, every tensor the schedule writes
// (its write-back lands on the host, or it lives there), the device window's read tensors (a
// staged tensor keeps its host copy once it is on the device, and its next use is near) and the
// staged ones, each at its full width. (A compressed tensor's host copy is smaller, Note
// [Compressed copies]; counted at its stored bytes, the host level staged every layer ahead of
// a Llama of 12 layers on a host tier a sixth of the model, and each staging evicted a host copy
// the next pass would have reused: NVMe reads per decode rose from 174 to 236 MB, 0.26x to 0.35x
// of full width, at the same speed. Kept at full width, the host tier stays a cache.) A staging
// is speculative (Runtime::stage): it only drops clean copies that the
// schedule's farthest-next-use policy ranks after the staged tensor, never writes anything back
// and never waits; when that finds no room it is tried again when a step ends or begins. With
// that policy a staged tensor is nearer than anything an ended step used, so it is never the host
// tier's first victim. When the device window moves on, its next tensor needs only the host ->
// device copy (the runtime waits for a staging still landing rather than read NVMe twice), and
// NVMe reads go on while the device is full. A tensor already on the device or the host is not
// staged. Both levels stop at the iteration's end when across_iterations is off, and
// fixed_lookahead steps ahead in Fixed mode; None stages nothing.
void PrefetchPipeline::Impl::plan() {
  name_this_thread("plan");
  const double budget = std::max(
      0.0, static_cast<double>(rt_.backend().info().budget_bytes) * options_.budget_fraction -
               static_cast<double>(options_.device_reserve_bytes));
  const double host_budget =
      std::max(0.0, static_cast<double>(rt_.tier_stats(Tier::Host).capacity_bytes) *
                            options_.budget_fraction -
                        static_cast<double>(options_.host_reserve_bytes));
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || planner_has_work(); });
    if (stopping_) return;
    plan_requested_ = false;
    drained_.notify_all();  // drain() sees the request taken (the lock is held until issuing_)
    try {
      plan_pass(lock, budget, host_budget);
    } catch (const Error&) {
      // A pass that could not be planned (the schedule names a tensor the runtime no longer
      // has): counted and reported by end_iteration; the steps are served on demand meanwhile.
      if (!lock.owns_lock()) lock.lock();
      issuing_ = false;
      drained_.notify_all();
      note_failure(std::current_exception());
    }
  }
}

void PrefetchPipeline::Impl::note_failure(std::exception_ptr error) {
  ++stats_.prefetch_failures;
  if (!first_prefetch_error_) first_prefetch_error_ = std::move(error);
}

// One look at the schedule: the window, the host level and the arrival in pieces; issues what
// they need. Lock held on entry and on return (released while the runtime is called).
void PrefetchPipeline::Impl::plan_pass(std::unique_lock<std::mutex>& lock, double budget,
                                       double host_budget) {
  const std::size_t n = schedule_.size();
  const std::size_t current = cursor_.load();
  // The first step not ended: a step whose leases have ended no longer holds the window.
  const std::size_t start = std::max(current, completed_);
  // The device window: steps from `start` on whose distinct tensors fit the budgets.
  std::unordered_set<TensorId> window, host_window, window_read;
  std::uint64_t window_bytes = 0, host_window_bytes = 0;
  struct Issue {
    TensorId tensor;
    Tier tier;
    std::size_t step;     // kNever for a held-back prefetch
    bool staged;          // a device-tier tensor brought to the host ahead of the device window
    bool pieces = false;  // Note [Arrival in pieces]: over the room of `replaceable`
  };
  std::vector<TensorId> replaceable;
  std::vector<Issue> issue;
  // Held-back prefetches whose writer has ended go first.
  std::erase_if(deferred_, [&](const Deferred& d) {
    if (d.writer >= completed_) return false;
    issue.push_back({d.tensor, d.tier, Schedule::kNever, false});
    return true;
  });
  // The latest unfinished step before `j` that writes `tensor`, or kNever.
  const auto pending_writer = [&](TensorId tensor, std::size_t j) {
    for (std::size_t k = j; k-- > std::max(completed_, current);)
      for (const TensorUse& u : schedule_.steps()[k % n].uses)
        if (u.tensor == tensor && u.access != Access::Read) return k;
    return Schedule::kNever;
  };
  const std::size_t window_end = options_.across_iterations ? start + n : (current / n + 1) * n;
  const auto beyond_fixed = [&](std::size_t j) {
    return options_.prefetch == PrefetchMode::Fixed && j > start + options_.fixed_lookahead;
  };
  std::size_t last = start;
  std::size_t j = start;
  for (; j < window_end && !beyond_fixed(j); ++j) {
    std::vector<TensorId> fresh, fresh_host;
    std::uint64_t fresh_bytes = 0, fresh_host_bytes = 0;
    for (const TensorUse& u : schedule_.steps()[j % n].uses) {
      if (u.tier == Tier::Device && !window.contains(u.tensor)) {
        fresh.push_back(u.tensor);
        fresh_bytes += rt_.tensor_bytes(u.tensor);
      } else if (u.tier == Tier::Host && !host_window.contains(u.tensor)) {
        fresh_host.push_back(u.tensor);
        fresh_host_bytes += rt_.tensor_bytes(u.tensor);
      }
    }
    if (static_cast<double>(window_bytes + fresh_bytes) > budget) break;
    if (static_cast<double>(host_window_bytes + fresh_host_bytes) > host_budget) break;
    window.insert(fresh.begin(), fresh.end());
    window_bytes += fresh_bytes;
    host_window.insert(fresh_host.begin(), fresh_host.end());
    host_window_bytes += fresh_host_bytes;
    for (const TensorUse& u : schedule_.steps()[j % n].uses)
      if (u.tier == Tier::Device && u.access != Access::Write) window_read.insert(u.tensor);
    last = j;
    // Every step of the schedule is issued once, in order, even one that has just begun (the
    // prefetch then joins its load): the order does not depend on how the threads interleave.
    if (j >= next_to_issue_) {
      for (const TensorUse& u : schedule_.steps()[j % n].uses) {
        if (u.access == Access::Write) continue;  // write-discard: nothing to bring
        const std::size_t writer = pending_writer(u.tensor, j);
        if (writer != Schedule::kNever) {
          deferred_.push_back({u.tensor, u.tier, writer});
          ++stats_.deferred;
        } else {
          issue.push_back({u.tensor, u.tier, j, false});
        }
      }
      next_to_issue_ = j + 1;
    }
  }
  // The host level, from the first step the device window could not take.
  std::unordered_set<TensorId> host_level = host_window;
  std::uint64_t host_level_bytes = host_window_bytes, staged_bytes = 0;
  const auto hold = [&](TensorId t) {
    if (host_level.insert(t).second) host_level_bytes += rt_.tensor_bytes(t);
  };
  for (TensorId t : written_)
    hold(t);
  for (TensorId t : window_read)
    hold(t);
  std::size_t host_last = last;
  for (; j < window_end && !beyond_fixed(j) && options_.prefetch != PrefetchMode::None; ++j) {
    const std::vector<TensorUse>& uses = schedule_.steps()[j % n].uses;
    std::vector<const TensorUse*> fresh;  // uses whose tensors enter the host window here
    std::uint64_t fresh_bytes = 0;
    for (const TensorUse& u : uses) {
      if (u.tier == Tier::Device && u.access == Access::Write)
        continue;  // nothing comes to the host
      if (host_level.contains(u.tensor) ||
          std::any_of(fresh.begin(), fresh.end(),
                      [&](const TensorUse* f) { return f->tensor == u.tensor; }))
        continue;
      fresh.push_back(&u);
      fresh_bytes += rt_.tensor_bytes(u.tensor);
    }
    if (static_cast<double>(host_level_bytes + fresh_bytes) > host_budget) break;
    for (const TensorUse* u : fresh) {
      host_level.insert(u->tensor);
      if (u->tier == Tier::Device) staged_bytes += rt_.tensor_bytes(u->tensor);
    }
    host_level_bytes += fresh_bytes;
    host_last = j;
    // Staged once, in order, and never after its step was issued at the device level.
    if (j >= next_to_stage_ && j >= next_to_issue_) {
      for (const TensorUse* u : fresh)
        if (u->tier == Tier::Device && pending_writer(u->tensor, j) == Schedule::kNever)
          issue.push_back({u->tensor, Tier::Host, j, true});
      next_to_stage_ = j + 1;
    }
  }
  // Note [Arrival in pieces]: the step after the device window cannot have room beside the
  // window's; while the window's first step runs, that step's tensors are placed over the room
  // of the running step's tensors that no step up to it uses again, so that most of them
  // lands now and the rest as those leases end.
  const std::size_t next = last + 1;
  if (options_.prefetch != PrefetchMode::None && options_.arrival_in_pieces && started_ &&
      start == current && leased_step_ == current && completed_ <= current && next < window_end &&
      !beyond_fixed(next) && next >= next_to_claim_ && next >= next_to_issue_) {
    const std::vector<TensorUse>& now = schedule_.steps()[current % n].uses;
    const std::vector<TensorUse>& then = schedule_.steps()[next % n].uses;
    // Used again by a step up to `next` (the window's, or next's own): not replaced.
    const auto used_again = [&](TensorId t) {
      for (std::size_t k = current + 1; k <= next; ++k)
        for (const TensorUse& u : schedule_.steps()[k % n].uses)
          if (u.tensor == t) return true;
      return false;
    };
    for (const TensorUse& u : now)
      if (u.tier == Tier::Device && u.access == Access::Read && !used_again(u.tensor))
        replaceable.push_back(u.tensor);
    bool any = false;
    if (!replaceable.empty())
      for (const TensorUse& u : then)
        if (u.tier == Tier::Device && u.access == Access::Read &&
            pending_writer(u.tensor, next) == Schedule::kNever) {
          issue.push_back({u.tensor, Tier::Device, next, false, true});
          any = true;
        }
    if (any) {
      next_to_claim_ = next + 1;
      next_to_issue_ = next + 1;  // issued here, once; a claim that fails is issued again
    }
  }
  stats_.max_window_bytes = std::max(stats_.max_window_bytes, window_bytes);
  stats_.max_host_window_bytes =
      std::max(stats_.max_host_window_bytes, host_window_bytes + staged_bytes);
  stats_.max_lookahead_steps = std::max(stats_.max_lookahead_steps, last - start);
  stats_.max_host_lookahead_steps = std::max(stats_.max_host_lookahead_steps, host_last - start);
  if (issue.empty()) return;
  // The iteration this pass logs to: the log may move on (and drop its oldest) meanwhile.
  const std::size_t log_iteration = logs_dropped_ + prefetch_log_.size() - 1;
  issuing_ = true;
  lock.unlock();
  std::vector<bool> done(issue.size(), false);
  bool device_failed = false, host_failed = false;
  std::size_t pieces_failed = Schedule::kNever;  // issued again as an ordinary prefetch
  std::size_t restage_from = Schedule::kNever;
  std::vector<std::exception_ptr> failures;  // stage and prefetch_replacing say "no room" by false
  for (std::size_t i = 0; i < issue.size(); ++i) {
    const Issue& e = issue[i];
    if (e.staged) {
      if (host_failed) {
        restage_from = std::min(restage_from, e.step);
        continue;
      }
      // Already on the device (or on its way there) or on the host: nothing to stage.
      if (rt_.resident(e.tensor, Tier::Device) || rt_.resident(e.tensor, Tier::Host)) continue;
      try {
        done[i] = rt_.stage(e.tensor, Tier::Host);
      } catch (const Error&) {
        done[i] = false;
      }
      if (!done[i]) {
        host_failed = true;  // no room on the host now: staged again from this step
        restage_from = std::min(restage_from, e.step);
      }
      continue;
    }
    if (e.pieces) {
      try {
        done[i] = rt_.prefetch_replacing(e.tensor, replaceable);
      } catch (const Error&) {
        done[i] = false;
      }
      if (!done[i]) pieces_failed = std::min(pieces_failed, e.step);
      continue;
    }
    if (device_failed) continue;
    try {
      rt_.prefetch(e.tensor, e.tier);
      done[i] = true;
    } catch (const Error&) {
      device_failed = true;  // no room right now (leases): retried when a step ends or begins
    }
  }
  lock.lock();
  issuing_ = false;
  drained_.notify_all();
  for (std::exception_ptr& f : failures)
    note_failure(std::move(f));
  const bool logged = log_iteration >= logs_dropped_;
  const std::size_t log_index = log_iteration - (logged ? logs_dropped_ : 0);
  for (std::size_t i = 0; i < issue.size(); ++i) {
    if (!done[i]) continue;
    if (issue[i].staged) {
      if (logged) host_prefetch_log_[log_index].push_back(issue[i].tensor);
      ++stats_.host_prefetches;
    } else if (issue[i].pieces) {
      if (logged) prefetch_log_[log_index].push_back(issue[i].tensor);
      ++stats_.arrivals_in_pieces;
    } else {
      if (logged) prefetch_log_[log_index].push_back(issue[i].tensor);
      ++stats_.prefetches;
    }
  }
  if (device_failed) next_to_issue_ = std::min(next_to_issue_, current + 1);
  if (pieces_failed != Schedule::kNever) next_to_issue_ = std::min(next_to_issue_, pieces_failed);
  if (host_failed) next_to_stage_ = std::min(next_to_stage_, restage_from);
}

}  // namespace strata
