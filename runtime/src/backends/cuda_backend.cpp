// The CUDA backend (cudart): the only translation unit that includes CUDA headers.
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "backends.h"
#include "cuda_dequant.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/memory_limits.h"

namespace strata::detail {
namespace {

[[noreturn]] void throw_cuda(const char* call, cudaError_t status) {
  throw Error(Errc::cuda_error, concat(call, " failed: ", cudaGetErrorString(status), " (",
                                       cudaGetErrorName(status), ")"));
}

}  // namespace
}  // namespace strata::detail

/// Checks a CUDA runtime call; on failure throws strata::Error(cuda_error) naming the call.
#define STRATA_CUDA_TRY(call)                              \
  do {                                                     \
    const cudaError_t strata_status_ = (call);             \
    if (strata_status_ != cudaSuccess) [[unlikely]]        \
      ::strata::detail::throw_cuda(#call, strata_status_); \
  } while (0)

namespace strata::detail {
namespace {

// Marks a span in Nsight Systems.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

cudaMemcpyKind to_cuda(CopyKind kind) noexcept {
  switch (kind) {
    case CopyKind::HostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::DeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::DeviceToDevice:
      return cudaMemcpyDeviceToDevice;
    case CopyKind::HostToHost:
      return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;
}

const char* copy_label(CopyKind kind) noexcept {
  switch (kind) {
    case CopyKind::HostToDevice:
      return "strata:h2d";
    case CopyKind::DeviceToHost:
      return "strata:d2h";
    case CopyKind::DeviceToDevice:
      return "strata:d2d";
    case CopyKind::HostToHost:
      return "strata:h2h";
  }
  return "strata:copy";
}

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) {
    STRATA_CUDA_TRY(cudaSetDevice(device));
    STRATA_CUDA_TRY(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void synchronize() override { STRATA_CUDA_TRY(cudaEventSynchronize(event_)); }
  bool ready() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    STRATA_CUDA_TRY(status);
    return true;
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

CudaEvent& as_cuda_event(Event& event) {
  auto* cuda = dynamic_cast<CudaEvent*>(&event);
  STRATA_EXPECTS(cuda != nullptr, "cuda backend: event was not created by the cuda backend");
  return *cuda;
}

// Note [Host functions leave CUDA's thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A function given to cudaLaunchHostFunc runs on CUDA's callback thread, where it may make no
// CUDA call: CUDA may deadlock (on the H200, strata-bench overlap with 1 MiB layers hung for
// minutes: the h2d chunk callback pumps the next chunk, cudaMemcpyAsync and cudaLaunchHostFunc
// from inside the callback). So the callback CUDA runs only hands the function to this stream's
// own host thread, which runs the functions in the order they were launched, each after the
// work enqueued before it, and may call CUDA and take the runtime's lock like any thread.
// synchronize() waits for the stream and then for that thread to have run every function
// launched before it, so "synchronized" still means "every callback has run" (the host
// backend's worker queue gives the same). Later work on the stream does not wait for a
// function: nothing in strata needs it to (Stream::launch_host_func says so).
class CudaStream final : public Stream {
 public:
  CudaStream(std::string name, int device) : Stream(std::move(name)), device_(device) {
    STRATA_CUDA_TRY(cudaSetDevice(device_));
    STRATA_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    host_ = std::thread([this] { run_host_functions(); });
  }
  ~CudaStream() override {
    cudaStreamSynchronize(stream_);  // every callback has queued its function
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    queued_.notify_all();
    host_.join();  // runs what is queued first
    cudaStreamDestroy(stream_);
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind) override {
    if (bytes == 0) return;
    NvtxRange range(copy_label(kind));
    STRATA_CUDA_TRY(cudaSetDevice(device_));
    STRATA_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), stream_));
  }
  // Note [Compressed copies]: the compressed bytes cross the link into a scratch block of CUDA's
  // stream-ordered pool (beside the device budget: the stored bytes: 0.27 or 0.14 of an fp32
  // tensor, 0.53 or 0.28 of a 16-bit one, freed in stream order once the kernel has read it), and
  // the kernel writes the device copy.
  void dequantize_async(void* dst, const void* src, std::size_t src_bytes,
                        const DequantJob& job) override {
    STRATA_EXPECTS(src_bytes == job.layout.bytes, "stream ", name(), ": dequantize of ", src_bytes,
                   " bytes, the layout has ", job.layout.bytes);
    if (src_bytes == 0) return;
    NvtxRange range("dequantize");
    STRATA_CUDA_TRY(cudaSetDevice(device_));
    void* scratch = nullptr;
    STRATA_CUDA_TRY(cudaMallocAsync(&scratch, src_bytes, stream_));
    const cudaError_t copied =
        cudaMemcpyAsync(scratch, src, src_bytes, cudaMemcpyHostToDevice, stream_);
    if (copied != cudaSuccess) {
      cudaFreeAsync(scratch, stream_);
      ::strata::detail::throw_cuda("cudaMemcpyAsync of a compressed copy", copied);
    }
    const quant::Layout& l = job.layout;
    const cuda::DequantShape shape{job.bits == quant::Bits::Int4,
                                   job.dtype == DType::F32    ? 0
                                   : job.dtype == DType::BF16 ? 1
                                                              : 2,
                                   l.rows,
                                   l.cols,
                                   l.groups_per_row,
                                   l.row_stride,
                                   l.group};
    const int launched = cuda::launch_dequantize(stream_, scratch, dst, shape);
    STRATA_CUDA_TRY(cudaFreeAsync(scratch, stream_));
    if (launched != 0)
      ::strata::detail::throw_cuda("the dequantize kernel's launch",
                                   static_cast<cudaError_t>(launched));
  }
  void memset_async(void* dst, int value, std::size_t bytes) override {
    if (bytes == 0) return;
    STRATA_CUDA_TRY(cudaSetDevice(device_));
    STRATA_CUDA_TRY(cudaMemsetAsync(dst, value, bytes, stream_));
  }
  void record(Event& event) override {
    STRATA_CUDA_TRY(cudaEventRecord(as_cuda_event(event).get(), stream_));
  }
  void wait(Event& event) override {
    STRATA_CUDA_TRY(cudaStreamWaitEvent(stream_, as_cuda_event(event).get(), 0));
  }
  void launch_host_func(std::function<void()> fn) override {
    STRATA_EXPECTS(fn != nullptr, "stream ", name(), ": empty host function");
    auto* task = new Task{std::move(fn), this};
    {
      std::lock_guard lock(mutex_);
      ++launched_;
    }
    const cudaError_t status = cudaLaunchHostFunc(stream_, &CudaStream::trampoline, task);
    if (status != cudaSuccess) {
      delete task;
      {
        std::lock_guard lock(mutex_);
        --launched_;
      }
      throw_cuda("cudaLaunchHostFunc", status);
    }
  }
  void synchronize() override {
    std::uint64_t target = 0;
    {
      std::lock_guard lock(mutex_);
      target = launched_;
    }
    STRATA_CUDA_TRY(cudaStreamSynchronize(stream_));
    std::exception_ptr failure;
    {
      std::unique_lock lock(mutex_);
      finished_cv_.wait(lock, [&] { return finished_ >= target; });
      failure = std::exchange(failure_, nullptr);
    }
    if (failure) std::rethrow_exception(failure);
  }

 private:
  struct Task {
    std::function<void()> fn;
    CudaStream* stream;
  };
  // On CUDA's callback thread: no CUDA call, only the hand-over (Note [Host functions leave
  // CUDA's thread]).
  static void CUDART_CB trampoline(void* data) {
    auto* task = static_cast<Task*>(data);
    CudaStream* self = task->stream;
    {
      std::lock_guard lock(self->mutex_);
      self->ready_.push_back(task);
    }
    self->queued_.notify_one();
  }
  void run_host_functions() {
    std::unique_lock lock(mutex_);
    for (;;) {
      queued_.wait(lock, [&] { return stopping_ || !ready_.empty(); });
      if (ready_.empty()) return;  // stopping, and nothing left
      Task* task = ready_.front();
      ready_.pop_front();
      lock.unlock();
      std::exception_ptr failure;
      try {
        task->fn();
      } catch (...) {
        failure = std::current_exception();
      }
      delete task;
      lock.lock();
      if (failure && !failure_) failure_ = failure;
      ++finished_;
      finished_cv_.notify_all();
    }
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::mutex mutex_;
  std::condition_variable queued_, finished_cv_;
  std::deque<Task*> ready_;     // handed over by CUDA's callbacks, in stream order
  std::uint64_t launched_ = 0;  // host functions launched on the stream
  std::uint64_t finished_ = 0;  // ... and run by host_
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread host_;  // last: started once the members above exist
};

void release_registered_pages(void* data, std::size_t bytes) noexcept {
  cudaHostUnregister(data);
  unmap_pages(data, bytes);
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& options) : Backend(make_info(options)) {
    const int device = info_.ordinal;
    STRATA_CUDA_TRY(cudaSetDevice(device));
    const cudaError_t status = cudaMalloc(&reservation_, info_.budget_bytes);
    if (status != cudaSuccess) {
      std::size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      throw OutOfMemoryError("Device", info_.budget_bytes, free, free,
                             concat("cudaMalloc of the device budget on device ", device,
                                    " failed: ", cudaGetErrorString(status)));
    }
    start(reservation_, info_.budget_bytes);
  }

  ~CudaBackend() override {
    stop();
    cudaSetDevice(info_.ordinal);
    cudaFree(reservation_);
  }

  void wait_on_foreign_stream(Event& event, std::uintptr_t stream) override {
    STRATA_CUDA_TRY(cudaSetDevice(info_.ordinal));
    STRATA_CUDA_TRY(
        cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), as_cuda_event(event).get(), 0));
  }

  PinnedBuffer allocate_pinned(std::size_t bytes) override {
    STRATA_EXPECTS(bytes > 0, "allocate_pinned: 0 bytes");
    // mmap + cudaHostRegister rather than cudaHostAlloc: the pages are 4 KiB aligned for O_DIRECT
    // (2 MiB aligned, in huge pages, from kHugePageBytes on) and registrable with io_uring as well
    // as pinned for DMA. The whole mapping is registered: it is whole huge pages (Note [Huge
    // pages]), and pinning part of one would leave the driver a partial page.
    void* data = map_pages(bytes, "Host (pinned)", /*reserve_only=*/false);
    const std::size_t length = mapped_bytes(bytes);
    const cudaError_t status = cudaHostRegister(data, length, cudaHostRegisterPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();  // a failed registration is not sticky; start later calls clean
      unmap_pages(data, bytes);
      // Note [Memory limits]: name what was asked and what the limits leave.
      const MemoryLimits limits = read_memory_limits();
      const std::size_t room = std::min(limits.lockable_bytes(), limits.cgroup.room_bytes());
      const std::size_t free = room == kUnlimitedBytes ? 0 : room;
      throw OutOfMemoryError(
          "Host (pinned)", bytes, free, free,
          concat("cudaHostRegister of ", length, " bytes (", format_bytes(length),
                 ") failed: ", cudaGetErrorString(status), " (", cudaGetErrorName(status), "); ",
                 describe_memory_limits(limits),
                 room < length
                     ? ". Raise RLIMIT_MEMLOCK (ulimit -l unlimited, LimitMEMLOCK=infinity in a "
                       "systemd unit, --ulimit memlock=-1 with docker run) or the memory "
                       "cgroup's limit, or lower the pinned budget"
                     : ". The limits allow it, so the system could not pin it: free memory or "
                       "lower the pinned budget"));
    }
    return PinnedBuffer(data, bytes, true, &release_registered_pages);
  }

  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<CudaStream>(std::move(name), info_.ordinal);
  }

  std::unique_ptr<Event> create_event() override {
    return std::make_unique<CudaEvent>(info_.ordinal);
  }

  void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind) override {
    NvtxRange range(copy_label(kind));
    STRATA_CUDA_TRY(cudaSetDevice(info_.ordinal));
    STRATA_CUDA_TRY(cudaMemcpy(dst, src, bytes, to_cuda(kind)));
  }

 private:
  static DeviceInfo make_info(const BackendOptions& options) {
    std::string why;
    const int count = cuda_device_count_impl(&why);
    if (options.device_ordinal >= count) {
      STRATA_FAIL(Errc::unsupported, "backend cuda: no CUDA device ", options.device_ordinal, " (",
                  count, " usable", why.empty() ? "" : "; ", why, ")");
    }
    DeviceInfo info;
    info.kind = BackendKind::Cuda;
    info.ordinal = options.device_ordinal;
    cudaDeviceProp prop{};
    STRATA_CUDA_TRY(cudaGetDeviceProperties(&prop, info.ordinal));
    info.name = prop.name;
    STRATA_CUDA_TRY(cudaSetDevice(info.ordinal));
    std::size_t free = 0, total = 0;
    STRATA_CUDA_TRY(cudaMemGetInfo(&free, &total));
    info.total_bytes = total;
    info.budget_bytes =
        options.device_budget_bytes != 0 ? options.device_budget_bytes : free / 10 * 9;
    if (info.budget_bytes > free) {
      throw OutOfMemoryError("Device", info.budget_bytes, free, free,
                             concat("device_budget exceeds the free memory of device ",
                                    info.ordinal, " (", prop.name, ")"));
    }
    info.budget_bytes = info.budget_bytes / 256 * 256;
    info.host_addressable = false;
    return info;
  }

  void* reservation_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

int cuda_device_count_impl(std::string* why) noexcept {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why != nullptr) *why = concat("cudaGetDeviceCount: ", cudaGetErrorString(status));
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "no CUDA devices";
  return count;
}

bool cuda_compiled() noexcept {
  return true;
}

}  // namespace strata::detail
