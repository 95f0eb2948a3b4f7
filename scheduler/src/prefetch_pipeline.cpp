// PrefetchPipeline's step API: setting or recording the schedule, begin_step (leases for the
// step's uses, resyncing a step that left the trace), end_step, end_iteration, and the
// write-back thread that takes written tensors down. The planner thread is in planner.cpp.
#include "strata/scheduler/prefetch_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <unordered_set>
#include <utility>

#include "pipeline_impl.h"
#include "strata/base/error.h"
#include "strata/base/thread_name.h"

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
struct PrefetchPipeline::Impl::Oracle {
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

PrefetchPipeline::Impl::Impl(Runtime& runtime, PipelineOptions options)
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

PrefetchPipeline::Impl::~Impl() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  planner_.join();
  writer_.join();
  if (options_.belady) rt_.set_eviction_policy(std::make_shared<LruPolicy>());
}

void PrefetchPipeline::Impl::publish_schedule() {
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
        host_bytes += rt_.tensor_bytes(u.tensor);
      if (u.access != Access::Read && written.insert(u.tensor).second) written_.push_back(u.tensor);
    }
  host_pressure_ = rt_.swap() != nullptr && host_bytes > rt_.tier_stats(Tier::Host).capacity_bytes;
}

void PrefetchPipeline::Impl::update_open() {
  open_.store(std::max(cursor_.load(), completed_));
}

void PrefetchPipeline::Impl::set_schedule(Schedule schedule) {
  {
    std::lock_guard lock(mutex_);
    schedule_ = std::move(schedule);
    recording_ = Schedule{};
    publish_schedule();
    plan_requested_ = true;
  }
  wake_.notify_all();
}

void PrefetchPipeline::Impl::begin_iteration() {
  std::lock_guard lock(mutex_);
  prefetch_log_.emplace_back();
  host_prefetch_log_.emplace_back();
  if (prefetch_log_.size() > kLogIterations) {
    prefetch_log_.pop_front();
    host_prefetch_log_.pop_front();
    ++logs_dropped_;
  }
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

StepLeases PrefetchPipeline::Impl::begin_step(const std::string& name,
                                              std::vector<TensorUse> uses) {
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
    out.leases_.push_back(rt_.acquire(u.tensor, u.tier, u.access).get());
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

void PrefetchPipeline::Impl::end_step(StepLeases leases) {
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
      bytes += rt_.tensor_bytes(u.tensor);
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
      if (!options_.write_back || u.access == Access::Read || dead[i]) continue;
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

bool PrefetchPipeline::Impl::dead_after(TensorId tensor, std::size_t step) const {
  const std::size_t n = schedule_.size();
  const std::size_t local = step % n;
  const std::size_t next = schedule_.next_use(tensor, local + 1, /*cyclic=*/true);
  if (next == Schedule::kNever) return false;
  for (const TensorUse& v : schedule_.steps()[next % n].uses)
    if (v.tensor == tensor) return v.access == Access::Write;
  return false;
}

void PrefetchPipeline::Impl::end_iteration() {
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
  // The iteration is over either way: a planner failure is reported once, after it.
  if (first_prefetch_error_) std::rethrow_exception(std::exchange(first_prefetch_error_, nullptr));
}

void PrefetchPipeline::Impl::write_back_loop() {
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

void PrefetchPipeline::Impl::drain() {
  std::unique_lock lock(mutex_);
  drained_.wait(lock, [&] {
    return !issuing_ && !planner_has_work() && write_back_queue_.empty() &&
           write_backs_in_flight_ == 0;
  });
}

PipelineStats PrefetchPipeline::Impl::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::vector<std::vector<TensorId>> PrefetchPipeline::Impl::prefetch_log() const {
  std::lock_guard lock(mutex_);
  return {prefetch_log_.begin(), prefetch_log_.end()};
}

std::vector<std::vector<TensorId>> PrefetchPipeline::Impl::host_prefetch_log() const {
  std::lock_guard lock(mutex_);
  return {host_prefetch_log_.begin(), host_prefetch_log_.end()};
}

// ---------------------------------------------------------------------------------------------
// PrefetchPipeline: the contract (prefetch_pipeline.h) over Impl.

PrefetchPipeline::PrefetchPipeline(Runtime& runtime, PipelineOptions options)
    : impl_(std::make_unique<Impl>(runtime, options)) {}
PrefetchPipeline::~PrefetchPipeline() = default;
const Schedule& PrefetchPipeline::schedule() const noexcept {
  return impl_->schedule_;
}
bool PrefetchPipeline::recording() const noexcept {
  return impl_->schedule_.empty();
}
void PrefetchPipeline::set_schedule(Schedule schedule) {
  impl_->set_schedule(std::move(schedule));
}
void PrefetchPipeline::begin_iteration() {
  impl_->begin_iteration();
}
StepLeases PrefetchPipeline::begin_step(const std::string& name, std::vector<TensorUse> uses) {
  return impl_->begin_step(name, std::move(uses));
}
void PrefetchPipeline::end_step(StepLeases leases) {
  impl_->end_step(std::move(leases));
}
void PrefetchPipeline::end_iteration() {
  impl_->end_iteration();
}
void PrefetchPipeline::drain() {
  impl_->drain();
}
PipelineStats PrefetchPipeline::stats() const {
  return impl_->stats();
}
std::vector<std::vector<TensorId>> PrefetchPipeline::prefetch_log() const {
  return impl_->prefetch_log();
}
std::vector<std::vector<TensorId>> PrefetchPipeline::host_prefetch_log() const {
  return impl_->host_prefetch_log();
}

}  // namespace strata
