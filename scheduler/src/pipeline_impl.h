// PrefetchPipeline::Impl: the pipeline's state (the schedule, the planner's cursors, the
// write-back queue, statistics) and its operations. The step API is defined in
// prefetch_pipeline.cpp, the planner thread's loop in planner.cpp. One mutex guards the state;
// the eviction policy reads the schedule through the Oracle, whose lock is always taken last.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "strata/base/tunables.h"
#include "strata/scheduler/prefetch_pipeline.h"

namespace strata {

struct PrefetchPipeline::Impl {
  Impl(Runtime& runtime, PipelineOptions options);
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  // The public operations (prefetch_pipeline.cpp).
  void set_schedule(Schedule schedule);
  void begin_iteration();
  StepLeases begin_step(const std::string& name, std::vector<TensorUse> uses);
  void end_step(StepLeases leases);
  void end_iteration();
  void drain();
  [[nodiscard]] PipelineStats stats() const;
  [[nodiscard]] std::vector<std::vector<TensorId>> prefetch_log() const;
  [[nodiscard]] std::vector<std::vector<TensorId>> host_prefetch_log() const;

  struct Oracle;
  void plan();  // planner.cpp
  void plan_pass(std::unique_lock<std::mutex>& lock, double budget, double host_budget);
  /// A planner request that failed for another reason than room: counted; the first is kept.
  void note_failure(std::exception_ptr error);  // mutex_ held
  [[nodiscard]] bool planner_has_work() const;  // mutex_ held
  void write_back_loop();
  void publish_schedule();
  void update_open();  // mutex_ held: open_ after cursor_ or completed_ moved
  /// After global step `step`, is `tensor`'s next use (cyclic) a pure Write?
  [[nodiscard]] bool dead_after(TensorId tensor, std::size_t step) const;

  Runtime& rt_;
  PipelineOptions options_;
  Schedule schedule_;
  Schedule recording_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;     // planner and write-back threads
  std::condition_variable drained_;  // write-backs done
  std::size_t iteration_ = 0;
  std::atomic<std::size_t> cursor_{0};  ///< global step index: iteration * N + step
  /// The first global step that has not ended (max of cursor_ and completed_): the eviction
  /// policy's "now", so that a step's tensors are far once it has ended.
  std::atomic<std::size_t> open_{0};
  bool started_ = false;           // a step of this iteration has begun
  std::size_t next_to_issue_ = 0;  ///< global step whose tensors the planner issues next
  std::size_t next_to_stage_ = 0;  ///< global step whose device tensors it stages next
  std::size_t next_to_claim_ = 0;  ///< global step whose device tensors may arrive in pieces next
  struct WriteBack {
    TensorId tensor;
    Tier tier;
  };
  struct Deferred {
    TensorId tensor;
    Tier tier;
    std::size_t writer;  ///< global step that must end first
  };
  std::deque<WriteBack> write_back_queue_;
  std::vector<Deferred> deferred_;
  std::size_t completed_ = 0;      ///< global steps before this one have ended
  bool host_pressure_ = false;     ///< the schedule's host working set exceeds the host budget
  std::vector<TensorId> written_;  ///< tensors the schedule writes: room held for them on the host
  std::size_t write_backs_in_flight_ = 0;
  std::exception_ptr last_write_back_error_;  ///< the first write-back failure since end_iteration
  std::exception_ptr first_prefetch_error_;   ///< the first planner failure since end_iteration
  bool stopping_ = false;
  bool plan_requested_ = false;  // the cursor moved: the planner looks again
  bool issuing_ = false;         // the planner is calling the runtime, the lock released
  PipelineStats stats_;
  /// The prefetch logs of the last kLogIterations iterations (a ring: a long run keeps a
  /// bounded log); logs_dropped_ iterations' logs have left it.
  static constexpr std::size_t kLogIterations = tunables::kPrefetchLogIterations;
  std::deque<std::vector<TensorId>> prefetch_log_;
  std::deque<std::vector<TensorId>> host_prefetch_log_;
  std::size_t logs_dropped_ = 0;
  std::uint64_t last_step_ns_ = 0;
  std::uint64_t step_begin_ns_ = 0;
  /// The step that holds all its leases (begin_step done, end_step not yet); kNever: none.
  std::size_t leased_step_ = static_cast<std::size_t>(-1);
  std::uint64_t device_bytes_in_at_begin_ = 0;
  std::shared_ptr<Oracle> oracle_;  // the schedule as the eviction policy sees it
  std::thread planner_;
  std::thread writer_;
};

}  // namespace strata
