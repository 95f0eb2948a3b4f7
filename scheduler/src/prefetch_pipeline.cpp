#include "strata/scheduler/prefetch_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <unordered_set>
#include <utility>

#include "strata/io/error.h"
#include "strata/io/thread_name.h"

namespace strata {
namespace {

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

}  // namespace

// The schedule and the first step not yet ended, shared with the eviction policy, which the
// runtime calls with its own lock held: this lock is always taken last. Distances count from the
// first step not ended: once a step has ended its tensors are far (their next use is the next
// iteration's), and the planner's prefetches for the steps after it evict them first, not the
// next steps' tensors staged or prefetched ahead.
struct PrefetchPipeline::Oracle {
  std::mutex mutex;
  std::shared_ptr<const Schedule> schedule;
  const std::atomic<std::size_t>* cursor = nullptr;  // PrefetchPipeline::open_

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
  oracle_->cursor = &open_;
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
  std::unordered_set<TensorId> host, written;
  std::uint64_t host_bytes = 0;
  written_.clear();
  for (const Step& step : schedule_.steps())
    for (const TensorUse& u : step.uses) {
      if (u.tier == Tier::Host && host.insert(u.tensor).second)
        host_bytes += rt_.describe(u.tensor).bytes;
      if (u.use != Use::Read && written.insert(u.tensor).second) written_.push_back(u.tensor);
    }
  host_pressure_ = rt_.swap() != nullptr && host_bytes > rt_.tier_stats(Tier::Host).capacity_bytes;
}

void PrefetchPipeline::update_open() {
  open_.store(std::max(cursor_.load(), completed_));
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
  host_prefetch_log_.emplace_back();
  started_ = false;
  if (!schedule_.empty()) {
    cursor_.store(iteration_ * schedule_.size());
    next_to_issue_ = std::max(next_to_issue_, iteration_ * schedule_.size());
    next_to_stage_ = std::max(next_to_stage_, iteration_ * schedule_.size());
    next_to_claim_ = std::max(next_to_claim_, iteration_ * schedule_.size());
    completed_ = std::max(completed_, iteration_ * schedule_.size());
    update_open();
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
        next_to_stage_ = std::max(next_to_stage_, found);
        next_to_claim_ = std::max(next_to_claim_, found);
        update_open();
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
  {
    std::lock_guard lock(mutex_);
    step_begin_ns_ = now_ns();
    // Note [Arrival in pieces]: only now may the next step's tensors claim this step's room (a
    // claim made while this step was still acquiring could take room it needs, and wait for
    // leases that it would never release).
    if (out.traced_) {
      leased_step_ = out.step_;
      plan_requested_ = true;
    }
  }
  wake_.notify_all();
  return out;
}

void PrefetchPipeline::end_step(StepLeases leases) {
  const std::uint64_t end = now_ns();
  {
    std::lock_guard lock(mutex_);
    leased_step_ = static_cast<std::size_t>(-1);  // its leases end now: no more claims on them
  }
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
    update_open();
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
  // The step's leases have ended: its room is free for the next device prefetch, and one that
  // failed for lack of room is retried now rather than when the next step begins.
  plan_requested_ = true;
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
  if (!schedule_.empty()) {
    next_to_issue_ = std::max(next_to_issue_, iteration_ * schedule_.size());
    next_to_stage_ = std::max(next_to_stage_, iteration_ * schedule_.size());
    next_to_claim_ = std::max(next_to_claim_, iteration_ * schedule_.size());
  }
  plan_requested_ = true;
  wake_.notify_all();
}

bool PrefetchPipeline::planner_has_work() const {
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
// staged ones. A staging is speculative (Runtime::stage): it only drops clean copies that the
// schedule's farthest-next-use policy ranks after the staged tensor, never writes anything back
// and never waits; when that finds no room it is tried again when a step ends or begins. With
// that policy a staged tensor is nearer than anything an ended step used, so it is never the host
// tier's first victim. When the device window moves on, its next tensor needs only the host ->
// device copy (the runtime waits for a staging still landing rather than read NVMe twice), and
// NVMe reads go on while the device is full. A tensor already on the device or the host is not
// staged. Both levels stop at the iteration's end when across_iterations is off, and
// fixed_lookahead steps ahead in Fixed mode; None stages nothing.
void PrefetchPipeline::plan() {
  name_this_thread("plan");
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
          if (u.tensor == tensor && u.use != Use::Read) return k;
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
      for (const TensorUse& u : schedule_.steps()[j % n].uses)
        if (u.tier == Tier::Device && u.use != Use::Write) window_read.insert(u.tensor);
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
      if (host_level.insert(t).second) host_level_bytes += rt_.describe(t).bytes;
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
        if (u.tier == Tier::Device && u.use == Use::Write) continue;  // nothing comes to the host
        if (host_level.contains(u.tensor) ||
            std::any_of(fresh.begin(), fresh.end(),
                        [&](const TensorUse* f) { return f->tensor == u.tensor; }))
          continue;
        fresh.push_back(&u);
        fresh_bytes += rt_.describe(u.tensor).bytes;
      }
      if (static_cast<double>(host_level_bytes + fresh_bytes) > host_budget) break;
      for (const TensorUse* u : fresh) {
        host_level.insert(u->tensor);
        if (u->tier == Tier::Device) staged_bytes += rt_.describe(u->tensor).bytes;
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
        if (u.tier == Tier::Device && u.use == Use::Read && !used_again(u.tensor))
          replaceable.push_back(u.tensor);
      bool any = false;
      if (!replaceable.empty())
        for (const TensorUse& u : then)
          if (u.tier == Tier::Device && u.use == Use::Read &&
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
    if (issue.empty()) continue;
    const std::size_t log_index = prefetch_log_.size() - 1;  // the log may grow meanwhile
    issuing_ = true;
    lock.unlock();
    std::vector<bool> done(issue.size(), false);
    bool device_failed = false, host_failed = false;
    std::size_t pieces_failed = Schedule::kNever;  // issued again as an ordinary prefetch
    std::size_t restage_from = Schedule::kNever;
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
    for (std::size_t i = 0; i < issue.size(); ++i) {
      if (!done[i]) continue;
      if (issue[i].staged) {
        host_prefetch_log_[log_index].push_back(issue[i].tensor);
        ++stats_.host_prefetches;
      } else if (issue[i].pieces) {
        prefetch_log_[log_index].push_back(issue[i].tensor);
        ++stats_.arrivals_in_pieces;
      } else {
        prefetch_log_[log_index].push_back(issue[i].tensor);
        ++stats_.prefetches;
      }
    }
    if (device_failed) next_to_issue_ = std::min(next_to_issue_, current + 1);
    if (pieces_failed != Schedule::kNever) next_to_issue_ = std::min(next_to_issue_, pieces_failed);
    if (host_failed) next_to_stage_ = std::min(next_to_stage_, restage_from);
  }
}

void PrefetchPipeline::write_back_loop() {
  name_this_thread("write-back");
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

std::vector<std::vector<TensorId>> PrefetchPipeline::host_prefetch_log() const {
  std::lock_guard lock(mutex_);
  return host_prefetch_log_;
}

}  // namespace strata
