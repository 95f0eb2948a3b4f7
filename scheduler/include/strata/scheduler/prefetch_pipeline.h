// PrefetchPipeline: runs a training or inference loop's steps over the residency manager,
// prefetching each step's tensors ahead of it so that copies overlap with compute.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/runtime/runtime.h"
#include "strata/scheduler/schedule.h"

namespace strata {

enum class PrefetchMode {
  None,   ///< fetch on demand when a step begins: nothing is prefetched, at either level
  Auto,   ///< as far ahead as the budgets allow (device window, then host staging beyond it)
  Fixed,  ///< a fixed lookahead of `fixed_lookahead` steps, at both levels (for comparison)
};

struct PipelineOptions {
  PrefetchMode prefetch = PrefetchMode::Auto;
  std::size_t fixed_lookahead = 2;
  /// Fraction of the device budget the prefetch window's working set may take, and of the host
  /// tier's capacity the host window's (0 < f <= 1).
  double budget_fraction = 1.0;
  /// Bytes of the device budget, and of the host tier's capacity, that the windows leave to
  /// what the caller leases inside its steps beside the steps' own tensors (an expert cache, a
  /// KV cache's pages): each window's working set stays within (budget x budget_fraction) less
  /// its reserve. A reserve as large as that leaves no window: nothing is prefetched there.
  std::uint64_t device_reserve_bytes = 0;
  std::uint64_t host_reserve_bytes = 0;
  /// On the write-back thread, overlapping with later steps: a tensor written on the device and
  /// not used on the device again this iteration goes down to the host (a gradient the CPU
  /// optimizer reads next); one written on the host and not used there again goes down to NVMe
  /// when the schedule's host working set exceeds the host budget (optimizer states).
  bool write_back = true;
  /// After a tensor's last use in an iteration, when its next use (in this iteration or the
  /// next) is a pure Write, its bytes are dead: discard them (Runtime::discard), so that no
  /// tier ever writes them back. Off by default: a caller that reads such a tensor between
  /// iterations (outside the steps) would find it discarded.
  bool discard_dead = false;
  /// While the device window's first step runs, bring the device tensors of the step after the
  /// window over the room of the running step's tensors that no step up to it uses again
  /// (Runtime::prefetch_replacing): most of that layer lands during this step, the rest as its
  /// leases end. False: it waits for the whole room (staged on the host meanwhile).
  bool arrival_in_pieces = true;
  /// Use the schedule's farthest-next-use eviction policy for the runtime.
  bool belady = true;
  /// Near the end of an iteration, prefetch the next one's first steps (the steady state of a
  /// training or inference loop). False: the window stops at the iteration's last step, so that
  /// after end_iteration() and drain() nothing more is brought in (a benchmark that starts each
  /// iteration cold).
  bool across_iterations = true;
};

struct PipelineStats {
  std::uint64_t steps = 0;
  std::uint64_t divergences = 0;      ///< steps that differed from the recorded trace
  std::uint64_t resyncs = 0;          ///< divergences resolved by finding the step further on
  std::uint64_t on_demand = 0;        ///< steps served without the trace
  std::uint64_t prefetches = 0;       ///< prefetch requests issued (each use at its tier)
  std::uint64_t host_prefetches = 0;  ///< device-tier tensors staged on the host ahead
  /// Device prefetches of the step after the device window that arrive in pieces, over the room
  /// of the running step's tensors (Runtime::prefetch_replacing)
  std::uint64_t arrivals_in_pieces = 0;
  std::uint64_t ready_at_begin = 0;  ///< step inputs already resident or arriving at begin
  std::uint64_t inputs = 0;          ///< step inputs in all
  std::uint64_t write_backs = 0;     ///< evictions issued by the write-back thread
  std::uint64_t discards = 0;        ///< dead tensors discarded (discard_dead)
  std::uint64_t deferred = 0;        ///< prefetches held back until their writer ended
  /// Planner requests that failed for another reason than room (an I/O error writing a victim
  /// back, a tensor the schedule names that no longer exists); end_iteration rethrows the first
  std::uint64_t prefetch_failures = 0;
  std::uint64_t max_window_bytes = 0;  ///< the largest prefetch working set (<= the budget)
  /// The same for the host tier: host-tier uses, the device window's tensors (their host copies)
  /// and the tensors staged beyond it (<= the host budget).
  std::uint64_t max_host_window_bytes = 0;
  std::size_t max_lookahead_steps = 0;       ///< device window: steps past the first unfinished
  std::size_t max_host_lookahead_steps = 0;  ///< host staging: steps past the first unfinished
  double measured_gbps = 0;                  ///< bytes into the device per second while moving
  double compute_s_per_step = 0;             ///< mean time between begin_step and end_step
  std::size_t needed_lookahead_steps = 0;    ///< transfer time per step / compute time per step
};

/// The leases of one step's inputs.
class StepLeases {
 public:
  [[nodiscard]] std::size_t size() const noexcept { return leases_.size(); }
  [[nodiscard]] Lease& operator[](std::size_t i) { return leases_.at(i); }
  /// The lease of `tensor`; throws strata::Error (not_found) if the step does not use it.
  [[nodiscard]] Lease& of(TensorId tensor);
  /// Host side: blocks until every input is there (the host backend's "stream wait").
  void wait() const;
  /// Device side: `stream` waits for every input's copy (cudaStreamWaitEvent on CUDA); the
  /// host does not block.
  void wait_on(Stream& stream) const;

 private:
  friend class PrefetchPipeline;
  std::vector<Lease> leases_;
  std::vector<TensorUse> uses_;
  std::size_t step_ = 0;
  bool traced_ = false;
};

/// Contract:
/// - A schedule is given (set_schedule) or recorded from the first iteration and replayed.
/// - begin_step() acquires the step's tensors and returns their leases; end_step() releases
///   them. A planner thread prefetches the next steps' tensors, with the schedule's
///   farthest-next-use eviction, and never lets the window's working set exceed the budget
///   (device uses against the device budget, host uses against the host budget).
/// - Two prefetch distances (Note [Two-level prefetch]): beyond the device window, the next
///   steps' device-tier tensors are staged on the host tier (NVMe -> host) as far ahead as the
///   host budget allows, so that when room frees on the device only the host -> device copy
///   remains. The planner looks again whenever a step begins or ends; a step that has ended no
///   longer holds the window, so the next device prefetch is issued as its leases end.
/// - Write uses are write-discard: nothing is prefetched for them. A use of a tensor that an
///   earlier, unfinished step of the window writes (on any tier) is prefetched only once that
///   step has ended: a prefetch never fetches bytes about to become stale.
/// - A step that differs from the trace (skipped, reordered, unexpected tensors) is resynced
///   to the trace when its name appears further on, else served on demand; the trace is kept
///   and the run never hangs.
/// - One thread drives the steps; the planner and write-back threads are internal.
class PrefetchPipeline {
 public:
  explicit PrefetchPipeline(Runtime& runtime, PipelineOptions options = {});
  PrefetchPipeline(const PrefetchPipeline&) = delete;
  PrefetchPipeline& operator=(const PrefetchPipeline&) = delete;
  ~PrefetchPipeline();

  void set_schedule(Schedule schedule);
  /// The schedule replayed; empty while the first iteration is being recorded.
  [[nodiscard]] const Schedule& schedule() const noexcept;
  [[nodiscard]] bool recording() const noexcept;

  void begin_iteration();
  StepLeases begin_step(const std::string& name, std::vector<TensorUse> uses);
  void end_step(StepLeases leases);
  /// Waits for this iteration's write-backs; a recording becomes the schedule. Rethrows the
  /// first write-back that failed (IoError: EIO, ENOSPC); its tensor stays dirty where it was.
  /// Else rethrows the first planner request that failed other than for room
  /// (PipelineStats::prefetch_failures), once; the steps were served on demand meanwhile.
  void end_iteration();

  /// Waits until the planner is not issuing prefetches and no write-back is queued or running.
  /// With across_iterations off and called after end_iteration(), nothing is issued after it
  /// returns until the next begin_iteration() (then Runtime::synchronize() waits for the moves).
  void drain();

  [[nodiscard]] PipelineStats stats() const;
  /// Tensors in the order the planner prefetched them, per iteration, for the last 64
  /// iterations (tests, tools).
  [[nodiscard]] std::vector<std::vector<TensorId>> prefetch_log() const;
  /// Device-tier tensors in the order the planner staged them on the host tier ahead of the
  /// device window, per iteration, for the last 64 iterations (tests, tools).
  [[nodiscard]] std::vector<std::vector<TensorId>> host_prefetch_log() const;

 private:
  struct Impl;  // scheduler/src/pipeline_impl.h
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
