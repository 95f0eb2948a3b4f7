// The host backend: the device tier is a budgeted host arena, a stream is an in-order worker
// thread, an event is a completion counter, a copy is memcpy, optionally paced to a link rate.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "backends.h"
#include "strata/base/error.h"
#include "strata/base/thread_name.h"

namespace strata::detail {
namespace {

using Clock = std::chrono::steady_clock;

// Note [Link pacing]: on the host backend a host<->device copy is a memcpy, far faster than
// PCIe. To make overlap behave as it would over a real link, each direction is a PacedLink: a
// copy reserves the next free slot of bytes / rate seconds on the link, runs its memcpy, then
// sleeps until its slot ends. Copies on different streams in the same direction share the link
// (they queue), as they would on a real bus; a sleep waits without spinning a core.
class PacedLink {
 public:
  explicit PacedLink(double gbps) : bytes_per_s_(gbps * 1e9) {}
  /// The time by which a copy of `bytes` starting now may complete; Clock::time_point{} when the
  /// link is unpaced.
  Clock::time_point reserve(std::size_t bytes) {
    if (bytes_per_s_ <= 0.0) return {};
    const auto duration = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / bytes_per_s_));
    std::lock_guard lock(mutex_);
    const auto begin = std::max(Clock::now(), free_at_);
    free_at_ = begin + duration;
    return free_at_;
  }

 private:
  double bytes_per_s_;
  std::mutex mutex_;
  Clock::time_point free_at_{};
};

struct Links {
  explicit Links(double gbps) : h2d(gbps), d2h(gbps) {}
  PacedLink h2d, d2h;

  PacedLink* for_kind(CopyKind kind) noexcept {
    if (kind == CopyKind::HostToDevice) return &h2d;
    if (kind == CopyKind::DeviceToHost) return &d2h;
    return nullptr;  // device-to-device and host-to-host do not cross the link
  }
  void paced_copy(void* dst, const void* src, std::size_t bytes, CopyKind kind) {
    PacedLink* link = for_kind(kind);
    const auto done_by = link != nullptr ? link->reserve(bytes) : Clock::time_point{};
    if (bytes > 0) std::memcpy(dst, src, bytes);
    if (done_by != Clock::time_point{}) std::this_thread::sleep_until(done_by);
  }
};

// Completion counter shared by an event and the stream tasks that signal or wait on it, so an
// event destroyed with work pending is safe.
struct EventState {
  std::atomic<std::uint64_t> recorded{0};
  std::atomic<std::uint64_t> completed{0};

  void complete(std::uint64_t ticket) noexcept {
    std::uint64_t seen = completed.load();
    while (seen < ticket && !completed.compare_exchange_weak(seen, ticket)) {
    }
    completed.notify_all();
  }
  void wait_for(std::uint64_t ticket) const noexcept {
    std::uint64_t seen = completed.load();
    while (seen < ticket) {
      completed.wait(seen);
      seen = completed.load();
    }
  }
};

class HostEvent final : public Event {
 public:
  HostEvent() : state_(std::make_shared<EventState>()) {}
  void synchronize() override { state_->wait_for(state_->recorded.load()); }
  bool ready() override { return state_->completed.load() >= state_->recorded.load(); }
  [[nodiscard]] const std::shared_ptr<EventState>& state() const noexcept { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

HostEvent& as_host_event(Event& event) {
  auto* host = dynamic_cast<HostEvent*>(&event);
  STRATA_EXPECTS(host != nullptr, "host backend: event was not created by the host backend");
  return *host;
}

class HostStream final : public Stream {
 public:
  HostStream(std::string name, std::shared_ptr<Links> links)
      : Stream(std::move(name)), links_(std::move(links)), worker_([this] { run(); }) {}

  ~HostStream() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    worker_.join();  // drains the queue first: pending work completes, as on CUDA
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind) override {
    STRATA_EXPECTS(bytes == 0 || (dst != nullptr && src != nullptr), "stream ", name(),
                   ": copy of ", bytes, " bytes with a null pointer");
    enqueue([links = links_.get(), dst, src, bytes, kind] {
      links->paced_copy(dst, src, bytes, kind);
    });
  }

  void dequantize_async(void* dst, const void* src, std::size_t src_bytes,
                        const DequantJob& job) override {
    STRATA_EXPECTS(dst != nullptr && src != nullptr, "stream ", name(),
                   ": dequantize with a null pointer");
    STRATA_EXPECTS(src_bytes == job.layout.bytes, "stream ", name(), ": dequantize of ", src_bytes,
                   " bytes, the layout has ", job.layout.bytes);
    enqueue([links = links_.get(), dst, src, src_bytes, job] {
      PacedLink* link = links->for_kind(CopyKind::HostToDevice);
      const auto done_by = link != nullptr ? link->reserve(src_bytes) : Clock::time_point{};
      quant::dequantize(job.bits, job.layout, src, job.dtype, dst, 0, job.layout.rows);
      if (done_by != Clock::time_point{}) std::this_thread::sleep_until(done_by);
    });
  }

  void memset_async(void* dst, int value, std::size_t bytes) override {
    STRATA_EXPECTS(bytes == 0 || dst != nullptr, "stream ", name(), ": memset of ", bytes,
                   " bytes at a null pointer");
    enqueue([dst, value, bytes] {
      if (bytes > 0) std::memset(dst, value, bytes);
    });
  }

  void record(Event& event) override {
    auto state = as_host_event(event).state();
    const std::uint64_t ticket = state->recorded.fetch_add(1) + 1;
    enqueue([state = std::move(state), ticket] { state->complete(ticket); });
  }

  void wait(Event& event) override {
    auto state = as_host_event(event).state();
    const std::uint64_t ticket = state->recorded.load();
    if (state->completed.load() >= ticket) return;
    enqueue([state = std::move(state), ticket] { state->wait_for(ticket); });
  }

  void launch_host_func(std::function<void()> fn) override {
    STRATA_EXPECTS(fn != nullptr, "stream ", name(), ": empty host function");
    enqueue(std::move(fn));
  }

  void synchronize() override {
    const std::uint64_t target = submitted_.load();
    std::uint64_t seen = finished_.load();
    while (seen < target) {
      finished_.wait(seen);
      seen = finished_.load();
    }
    std::exception_ptr failure;
    {
      std::lock_guard lock(mutex_);
      failure = std::exchange(failure_, nullptr);
    }
    if (failure) std::rethrow_exception(failure);
  }

 private:
  void enqueue(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(task));
      submitted_.fetch_add(1);
    }
    wake_.notify_one();
  }

  void run() {
    name_this_thread(name());
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr failure;
      try {
        task();
      } catch (...) {
        failure = std::current_exception();
      }
      task = nullptr;
      lock.lock();
      if (failure && !failure_) failure_ = failure;
      finished_.fetch_add(1);
      finished_.notify_all();
    }
  }

  std::shared_ptr<Links> links_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> finished_{0};
  std::thread worker_;  // last: starts after the members it uses exist
};

void release_locked_pages(void* data, std::size_t bytes) noexcept {
  unmap_pages(data, bytes);  // munmap also unlocks
}

class HostBackend final : public Backend {
 public:
  explicit HostBackend(const BackendOptions& options)
      : Backend(make_info(options)), links_(std::make_shared<Links>(options.link_gbps)) {
    HugePages used = HugePages::Off;
    arena_ =
        map_pages(info_.budget_bytes, "Device", /*reserve_only=*/true, default_huge_pages(), &used);
    // Advised huge pages come with each 2 MiB's first touch, an O_DIRECT read's included.
    info_.host_run_bytes = used == HugePages::Off ? kPageBytes : kHugePageBytes;
    start(arena_, info_.budget_bytes);
  }

  ~HostBackend() override {
    stop();
    unmap_pages(arena_, info_.budget_bytes);
  }

  PinnedBuffer allocate_pinned(std::size_t bytes) override {
    STRATA_EXPECTS(bytes > 0, "allocate_pinned: 0 bytes");
    void* data = map_pages(bytes, "Host (pinned)", /*reserve_only=*/false);
    const bool locked = lock_pages(data, bytes);
    return PinnedBuffer(data, bytes, locked, &release_locked_pages);
  }

  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<HostStream>(std::move(name), links_);
  }

  std::unique_ptr<Event> create_event() override { return std::make_unique<HostEvent>(); }

  void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind) override {
    links_->paced_copy(dst, src, bytes, kind);
  }

 private:
  static DeviceInfo make_info(const BackendOptions& options) {
    DeviceInfo info;
    info.kind = BackendKind::Host;
    info.name = "host arena";
    info.ordinal = 0;
    info.total_bytes = physical_memory_bytes();
    info.budget_bytes =
        options.device_budget_bytes != 0 ? options.device_budget_bytes : std::size_t{1} << 30;
    STRATA_EXPECTS(info.budget_bytes >= 4096, "device_budget: ", info.budget_bytes,
                   " bytes is smaller than one 4 KiB page");
    info.budget_bytes = info.budget_bytes / 256 * 256;
    info.link_gbps = options.link_gbps;
    info.host_addressable = true;
    return info;
  }

  std::shared_ptr<Links> links_;
  void* arena_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(const BackendOptions& options) {
  return std::make_unique<HostBackend>(options);
}

}  // namespace strata::detail
