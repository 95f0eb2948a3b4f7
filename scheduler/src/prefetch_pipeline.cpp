#include "strata/scheduler/prefetch_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <unordered_set>
#include <utility>

#include "strata/io/error.h"

namespace strata {
namespace {

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

}  // namespace

// The schedule and the step being computed, shared with the eviction policy, which the runtime
// calls with its own lock held: this lock is always taken last.
struct PrefetchPipeline::Oracle {
  std::mutex mutex;
  std::shared_ptr<const Schedule> schedule;
  const std::atomic<std::size_t>* cursor = nullptr;

  std::uint64_t distance(TensorId tensor) {
    std::shared_ptr<const Schedule> s;
    {
      std::lock_guard lock(mutex);
      s = schedule;
    }
    if (!s || s->empty()) return std::numeric_limits<std::uint64_t>::max();
    const std::size_t local = cursor->load() % s->size();
    const std::size_t next = s->next_use(tensor, local, /*cyclic=*/true);
    return next == Schedule::kNever ? std::numeric_limits<std::uint64_t>::max() : next - local;
  }
};

Lease& StepLeases::of(TensorId tensor) {
  for (std::size_t i = 0; i < uses_.size(); ++i)
    if (uses_[i].tensor == tensor) return leases_[i];
  STRATA_FAIL(Errc::not_found, "step does not use tensor ", tensor);
}

void StepLeases::wait() const {
  for (const Lease& l : leases_)
    l.wait();
}

void StepLeases::wait_on(Stream& stream) const {
  for (const Lease& l : leases_)
    if (Event* e = l.event()) stream.wait(*e);
}

PrefetchPipeline::PrefetchPipeline(Runtime& runtime, PipelineOptions options)
    : rt_(runtime), options_(options) {
  STRATA_EXPECTS(options_.budget_fraction > 0 && options_.budget_fraction <= 1,
                 "budget_fraction: ", options_.budget_fraction, " is outside (0, 1]");
  STRATA_EXPECTS(options_.prefetch != PrefetchMode::Fixed || options_.fixed_lookahead >= 1,
                 "fixed_lookahead: must be >= 1");
  oracle_ = std::make_shared<Oracle>();
  oracle_->cursor = &cursor_;
  if (options_.belady) {
    rt_.set_eviction_policy(std::make_shared<FarthestNextUsePolicy>(
        [oracle = oracle_](TensorId t) { return oracle->distance(t); }));
  }
  planner_ = std::thread([this] { plan(); });
  writer_ = std::thread([this] { write_back_loop(); });
}

PrefetchPipeline::~PrefetchPipeline() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  planner_.join();
  writer_.join();
  if (options_.belady) rt_.set_eviction_policy(std::make_shared<LruPolicy>());
}

void PrefetchPipeline::publish_schedule() {
  {
    std::lock_guard lock(oracle_->mutex);
    oracle_->schedule = std::make_shared<const Schedule>(schedule_);
  }
  std::unordered_set<TensorId> host;
  std::uint64_t host_bytes = 0;
  for (const Step& step : schedule_.steps())
    for (const TensorUse& u : step.uses)
      if (u.tier == Tier::Host && host.insert(u.tensor).second)
        host_bytes += rt_.describe(u.tensor).bytes;
  host_pressure_ = rt_.swap() != nullptr && host_bytes > rt_.tier_stats(Tier::Host).capacity_bytes;
}

void PrefetchPipeline::set_schedule(Schedule schedule) {
  {
    std::lock_guard lock(mutex_);
    schedule_ = std::move(schedule);
    recording_ = Schedule{};
    publish_schedule();
    plan_requested_ = true;
  }
  wake_.notify_all();
}

void PrefetchPipeline::begin_iteration() {
  std::lock_guard lock(mutex_);
  prefetch_log_.emplace_back();
  started_ = false;
  if (!schedule_.empty()) {
    cursor_.store(iteration_ * schedule_.size());
    next_to_issue_ = std::max(next_to_issue_, iteration_ * schedule_.size());
    completed_ = std::max(completed_, iteration_ * schedule_.size());
  }
  plan_requested_ = true;
  wake_.notify_all();
}

StepLeases PrefetchPipeline::begin_step(const std::string& name, std::vector<TensorUse> uses) {
  StepLeases out;
  {
    std::unique_lock lock(mutex_);
    ++stats_.steps;
    const std::uint64_t now = now_ns();
    if (schedule_.empty()) {
      recording_.append({name, uses});  // first iteration: record, serve on demand
    } else {
      const std::size_t n = schedule_.size();
      const std::size_t expected = started_ ? cursor_.load() + 1 : iteration_ * n;
      const std::size_t base = expected / n * n;
      std::size_t found = Schedule::kNever;
      for (std::size_t k = expected % n; k < n; ++k) {
        if (schedule_.steps()[k].name == name) {
          found = base + k;
          break;
        }
      }
      if (found == expected && schedule_.steps()[expected % n].uses == uses) {
        out.traced_ = true;
      } else if (found != Schedule::kNever) {
        ++stats_.divergences;  // skipped steps or different tensors: resync to the trace
        ++stats_.resyncs;
        out.traced_ = true;
      } else {
        ++stats_.divergences;  // not in the trace: on demand, the trace stays as it was
        ++stats_.on_demand;
      }
      if (found != Schedule::kNever) {
        cursor_.store(found);
        next_to_issue_ = std::max(next_to_issue_, found);  // skipped steps are not prefetched
      }
      started_ = true;
      out.step_ = cursor_.load();
      // Measured link rate: bytes that arrived on the device since the last step began.
      const TierStats d = rt_.tier_stats(Tier::Device);
      if (last_step_ns_ != 0 && now > last_step_ns_) {
        const double seconds = static_cast<double>(now - last_step_ns_) / 1e9;
        const double gbps =
            static_cast<double>(d.bytes_in - device_bytes_in_at_begin_) / seconds / 1e9;
        if (gbps > 0)
          stats_.measured_gbps =
              stats_.measured_gbps == 0 ? gbps : 0.8 * stats_.measured_gbps + 0.2 * gbps;
      }
      device_bytes_in_at_begin_ = d.bytes_in;
    }
    last_step_ns_ = now;
    plan_requested_ = true;
    stats_.inputs += uses.size();
    for (const TensorUse& u : uses)
      if (rt_.resident(u.tensor, u.tier)) ++stats_.ready_at_begin;
  }
  wake_.notify_all();
  out.uses_ = uses;
  for (const TensorUse& u : uses) {
    const Access a = u.use == Use::Read    ? Access::Read
                     : u.use == Use::Write ? Access::Write
                                           : Access::ReadWrite;
    out.leases_.push_back(rt_.acquire(u.tensor, u.tier, a).get());
  }
  std::lock_guard lock(mutex_);
  step_begin_ns_ = now_ns();
  return out;
}

void PrefetchPipeline::end_step(StepLeases leases) {
  const std::uint64_t end = now_ns();
  // schedule_ changes only on this (the driving) thread: no lock needed to read it here.
  const bool traced = leases.traced_ && !schedule_.empty();
  std::uint64_t discarded = 0;
  std::vector<bool> dead(leases.leases_.size(), false);  // bytes no later step reads
  for (std::size_t i = 0; i < leases.leases_.size(); ++i) {
    dead[i] = traced && options_.discard_dead && dead_after(leases.uses_[i].tensor, leases.step_);
    if (dead[i]) {
      if (leases.leases_[i].discard()) ++discarded;
    } else {
      leases.leases_[i].release();
    }
  }
  std::lock_guard lock(mutex_);
  stats_.discards += discarded;
  const double compute = static_cast<double>(end - step_begin_ns_) / 1e9;
  stats_.compute_s_per_step =
      stats_.compute_s_per_step == 0 ? compute : 0.8 * stats_.compute_s_per_step + 0.2 * compute;
  if (stats_.compute_s_per_step > 0 && stats_.measured_gbps > 0 && !schedule_.empty()) {
    std::uint64_t bytes = 0;
    for (const TensorUse& u : leases.uses_)
      bytes += rt_.describe(u.tensor).bytes;
    const double transfer = static_cast<double>(bytes) / (stats_.measured_gbps * 1e9);
    stats_.needed_lookahead_steps =
        static_cast<std::size_t>(std::ceil(transfer / stats_.compute_s_per_step));
  }
  if (traced) {
    const std::size_t n = schedule_.size();
    const std::size_t local = leases.step_ % n;
    completed_ = std::max(completed_, leases.step_ + 1);
    // Is `tensor` used on `tier` by a later step of this iteration?
    const auto used_later_on = [&](TensorId tensor, Tier tier) {
      for (std::size_t k = local + 1; k < n; ++k)
        for (const TensorUse& u : schedule_.steps()[k].uses)
          if (u.tensor == tensor && u.tier == tier) return true;
      return false;
    };
    for (std::size_t i = 0; i < leases.uses_.size(); ++i) {
      const TensorUse& u = leases.uses_[i];
      if (!options_.write_back || u.use == Use::Read || dead[i]) continue;
      if (u.tier == Tier::Device && !used_later_on(u.tensor, Tier::Device))
        write_back_queue_.push_back({u.tensor, Tier::Device});
      else if (u.tier == Tier::Host && host_pressure_ && !used_later_on(u.tensor, Tier::Host))
        write_back_queue_.push_back({u.tensor, Tier::Host});
    }
  }
  wake_.notify_all();
}

bool PrefetchPipeline::dead_after(TensorId tensor, std::size_t step) const {
  const std::size_t n = schedule_.size();
  const std::size_t local = step % n;
  const std::size_t next = schedule_.next_use(tensor, local + 1, /*cyclic=*/true);
  if (next == Schedule::kNever) return false;
  for (const TensorUse& v : schedule_.steps()[next % n].uses)
    if (v.tensor == tensor) return v.use == Use::Write;
  return false;
}

void PrefetchPipeline::end_iteration() {
  std::unique_lock lock(mutex_);
  drained_.wait(lock, [&] { return write_back_queue_.empty() && write_backs_in_flight_ == 0; });
  if (last_write_back_error_) {
    // The copies that failed stay dirty where they were; the caller decides what to do.
    std::rethrow_exception(std::exchange(last_write_back_error_, nullptr));
  }
  if (schedule_.empty() && !recording_.empty()) {
    schedule_ = std::move(recording_);
    recording_ = Schedule{};
    publish_schedule();
  }
  ++iteration_;
  started_ = false;
  if (!schedule_.empty()) next_to_issue_ = std::max(next_to_issue_, iteration_ * schedule_.size());
  plan_requested_ = true;
  wake_.notify_all();
}

bool PrefetchPipeline::planner_has_work() const {
  return plan_requested_ && !schedule_.empty() && options_.prefetch != PrefetchMode::None &&
         !prefetch_log_.empty();
}

void PrefetchPipeline::plan() {
  const double budget =
      static_cast<double>(rt_.backend().info().budget_bytes) * options_.budget_fraction;
  const double host_budget =
      static_cast<double>(rt_.tier_stats(Tier::Host).capacity_bytes) * options_.budget_fraction;
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || planner_has_work(); });
    if (stopping_) return;
    plan_requested_ = false;
    drained_.notify_all();  // drain() sees the request taken (the lock is held until issuing_)
    const std::size_t n = schedule_.size();
    const std::size_t current = cursor_.load();
    // The window: steps from the current one on whose distinct tensors fit the budget.
    std::unordered_set<TensorId> window, host_window;
    std::uint64_t window_bytes = 0, host_window_bytes = 0;
    std::vector<std::pair<TensorId, Tier>> issue;
    // Held-back prefetches whose writer has ended go first.
    std::erase_if(deferred_, [&](const Deferred& d) {
      if (d.writer >= completed_) return false;
      issue.emplace_back(d.tensor, d.tier);
      return true;
    });
    // The latest unfinished step before `j` that writes `tensor`, or kNever.
    const auto pending_writer = [&](TensorId tensor, std::size_t j) {
      for (std::size_t k = j; k-- > std::max(completed_, current);)
        for (const TensorUse& u : schedule_.steps()[k % n].uses)
          if (u.tensor == tensor && u.use != Use::Read) return k;
      return Schedule::kNever;
    };
    std::size_t last = current;
    const std::size_t window_end = options_.across_iterations ? current + n : (current / n + 1) * n;
    for (std::size_t j = current; j < window_end; ++j) {
      if (options_.prefetch == PrefetchMode::Fixed && j > current + options_.fixed_lookahead) break;
      std::vector<TensorId> fresh, fresh_host;
      std::uint64_t fresh_bytes = 0, fresh_host_bytes = 0;
      for (const TensorUse& u : schedule_.steps()[j % n].uses) {
        if (u.tier == Tier::Device && !window.contains(u.tensor)) {
          fresh.push_back(u.tensor);
          fresh_bytes += rt_.describe(u.tensor).bytes;
        } else if (u.tier == Tier::Host && !host_window.contains(u.tensor)) {
          fresh_host.push_back(u.tensor);
          fresh_host_bytes += rt_.describe(u.tensor).bytes;
        }
      }
      if (static_cast<double>(window_bytes + fresh_bytes) > budget) break;
      if (static_cast<double>(host_window_bytes + fresh_host_bytes) > host_budget) break;
      window.insert(fresh.begin(), fresh.end());
      window_bytes += fresh_bytes;
      host_window.insert(fresh_host.begin(), fresh_host.end());
      host_window_bytes += fresh_host_bytes;
      last = j;
      // Every step of the schedule is issued once, in order, even one that has just begun (the
      // prefetch then joins its load): the order does not depend on how the threads interleave.
      if (j >= next_to_issue_) {
        for (const TensorUse& u : schedule_.steps()[j % n].uses) {
          if (u.use == Use::Write) continue;  // write-discard: nothing to bring
          const std::size_t writer = pending_writer(u.tensor, j);
          if (writer != Schedule::kNever) {
            deferred_.push_back({u.tensor, u.tier, writer});
            ++stats_.deferred;
          } else {
            issue.emplace_back(u.tensor, u.tier);
          }
        }
        next_to_issue_ = j + 1;
      }
    }
    stats_.max_window_bytes = std::max(stats_.max_window_bytes, window_bytes);
    stats_.max_host_window_bytes = std::max(stats_.max_host_window_bytes, host_window_bytes);
    stats_.max_lookahead_steps = std::max(stats_.max_lookahead_steps, last - current);
    if (issue.empty()) continue;
    const std::size_t log_index = prefetch_log_.size() - 1;  // the log may grow meanwhile
    issuing_ = true;
    lock.unlock();
    std::size_t issued = 0;
    for (const auto& [tensor, tier] : issue) {
      try {
        rt_.prefetch(tensor, tier);
        ++issued;
      } catch (const Error&) {
        break;  // no room right now (leases): retried when the cursor moves
      }
    }
    lock.lock();
    issuing_ = false;
    drained_.notify_all();
    for (std::size_t i = 0; i < issued; ++i)
      prefetch_log_[log_index].push_back(issue[i].first);
    stats_.prefetches += issued;
    if (issued < issue.size()) {
      next_to_issue_ = std::min(next_to_issue_, current + 1);  // again when the next step begins
    }
  }
}

void PrefetchPipeline::write_back_loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !write_back_queue_.empty(); });
    if (write_back_queue_.empty()) return;  // stopping
    const WriteBack job = write_back_queue_.front();
    write_back_queue_.pop_front();
    ++write_backs_in_flight_;
    lock.unlock();
    bool done = false;
    try {
      // Device: d2h stream, then NVMe through the io engine when the host is full; host: NVMe.
      // False when the copy was clean already (an eviction for room wrote it back first).
      done = rt_.evict(job.tensor, job.tier);
    } catch (const Error& e) {
      // A failed write-back (I/O error, no room below) leaves the copy dirty where it was and
      // is reported by end_iteration(). A copy leased again meanwhile (invalid_argument) is not
      // a failure: it goes down later, with an eviction for room.
      if (e.code() != Errc::invalid_argument && !last_write_back_error_)
        last_write_back_error_ = std::current_exception();
    }
    lock.lock();
    --write_backs_in_flight_;
    if (done) ++stats_.write_backs;
    drained_.notify_all();
  }
}

void PrefetchPipeline::drain() {
  std::unique_lock lock(mutex_);
  drained_.wait(lock, [&] {
    return !issuing_ && !planner_has_work() && write_back_queue_.empty() &&
           write_backs_in_flight_ == 0;
  });
}

PipelineStats PrefetchPipeline::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::vector<std::vector<TensorId>> PrefetchPipeline::prefetch_log() const {
  std::lock_guard lock(mutex_);
  return prefetch_log_;
}

}  // namespace strata
