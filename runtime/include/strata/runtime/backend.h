// Backend: the one interface through which strata reaches a device — device memory, pinned host
// memory, streams, events, async copies and host callbacks. Two implementations: `cuda` (cudart)
// and `host` (a budgeted host arena with worker-thread streams). Only runtime/src/backends/cuda*
// includes CUDA headers; everything else sees this file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "strata/quant/group_quant.h"
#include "strata/runtime/memory_pool.h"

namespace strata {

enum class BackendKind { Auto, Host, Cuda };

std::string_view to_string(BackendKind kind) noexcept;
/// Parses "auto", "host" or "cuda"; throws strata::Error naming `key` otherwise.
BackendKind parse_backend_kind(std::string_view text, std::string_view key = "backend");

/// Direction of a copy. Host pointers may be pageable or pinned; pinned ones are faster on CUDA.
enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice, HostToHost };

struct BackendOptions {
  BackendKind kind = BackendKind::Auto;
  /// Bytes of device memory strata may use: a hard limit. 0 picks a default: 1 GiB on the host
  /// backend, 90% of the free memory on the CUDA backend.
  std::size_t device_budget_bytes = 0;
  /// Host backend only: host<->device copies take the wall time they would over a link of this
  /// many GB/s (10^9 bytes/s), each direction its own link; 0 = as fast as memcpy.
  double link_gbps = 0.0;
  int device_ordinal = 0;
  /// Do not print the backend choice on stderr.
  bool quiet = false;
};

struct DeviceInfo {
  BackendKind kind = BackendKind::Host;
  std::string name;  ///< "host arena" or the CUDA device's name
  int ordinal = 0;
  std::size_t total_bytes = 0;    ///< physical memory of the device (host: RAM)
  std::size_t budget_bytes = 0;   ///< the device tier's hard limit
  double link_gbps = 0.0;         ///< host backend pacing; 0 when unpaced or unknown
  bool host_addressable = false;  ///< device pointers may be dereferenced on the host
  /// Host-addressable devices: the physically contiguous runs of the device memory, which size
  /// the chunks of NVMe reads landing in it (Note [Request sizes]); 0 otherwise.
  std::size_t host_run_bytes = 0;
};

/// Marks a point in a stream's work. Thread-safe. Destroying an event with waits pending is
/// allowed; the waits still complete.
class Event {
 public:
  virtual ~Event() = default;
  /// Blocks the calling thread until the work captured by the last record() has run. Returns at
  /// once for an event never recorded.
  virtual void synchronize() = 0;
  /// True when the work captured by the last record() has run (or it was never recorded).
  [[nodiscard]] virtual bool ready() = 0;
};

/// An in-order queue of device work. Every call only enqueues and returns; work runs in
/// submission order. Thread-safe: several threads may enqueue onto one stream.
class Stream {
 public:
  explicit Stream(std::string name) : name_(std::move(name)) {}
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// Copies `bytes` from src to dst once the work before it has run. Both buffers must stay
  /// valid until then.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind) = 0;
  /// Sets `bytes` of device memory at dst to `value`.
  virtual void memset_async(void* dst, int value, std::size_t bytes) = 0;
  /// Captures the work enqueued so far; `event` completes when it has run.
  virtual void record(Event& event) = 0;
  /// Later work on this stream waits for `event`'s captured work; the host does not block.
  virtual void wait(Event& event) = 0;
  /// Runs `fn` once on a host thread after the work enqueued before it, functions in the order
  /// launched; later work on the stream need not wait for it. `fn` may call the backend (on
  /// CUDA it runs on a thread of the stream's own, not CUDA's callback thread). An exception
  /// from `fn` is reported by the next synchronize(), which returns once every function
  /// launched before it has run.
  virtual void launch_host_func(std::function<void()> fn) = 0;
  /// Makes a compressed tensor's device copy (Note [Compressed copies]): reads `src_bytes` of
  /// codes and groups from pinned host memory at src and writes the dequantized values
  /// (job.dtype, job.layout's rows x cols) to device memory at dst, once the work before it has
  /// run; as a copy, it crosses the host-to-device link with the compressed bytes only. The host
  /// backend runs strata::quant's CPU kernel on the stream's worker. Default: unsupported.
  struct DequantJob {
    quant::Bits bits = quant::Bits::Int8;
    quant::Layout layout;
    DType dtype = DType::F32;
  };
  virtual void dequantize_async(void* dst, const void* src, std::size_t src_bytes,
                                const DequantJob& job);
  /// Blocks until all work enqueued so far has run; rethrows a failure of that work.
  virtual void synchronize() = 0;

 private:
  std::string name_;
};

/// Page-aligned host memory, locked (pinned) where the system allows. Move-only RAII.
class PinnedBuffer {
 public:
  using Release = void (*)(void* data, std::size_t bytes) noexcept;
  PinnedBuffer() = default;
  PinnedBuffer(void* data, std::size_t bytes, bool locked, Release release) noexcept
      : data_(data), bytes_(bytes), locked_(locked), release_(release) {}
  PinnedBuffer(PinnedBuffer&& other) noexcept { swap(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    PinnedBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~PinnedBuffer() {
    if (data_ != nullptr) release_(data_, bytes_);
  }
  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  /// False when locking was refused (RLIMIT_MEMLOCK); the memory still works, unpinned.
  [[nodiscard]] bool locked() const noexcept { return locked_; }

 private:
  void swap(PinnedBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    std::swap(locked_, other.locked_);
    std::swap(release_, other.release_);
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool locked_ = false;
  Release release_ = nullptr;
};

/// A device and the means to move bytes to and from it.
///
/// Device memory comes from one reservation of the budget, sub-allocated by a MemoryPool, so the
/// budget is a hard limit on both backends; allocate_device() throws OutOfMemoryError (tier
/// "Device") beyond it. The backend owns three streams — h2d, d2h (copies, each its own) and
/// compute — and callers may create more. All members are thread-safe.
class Backend {
 public:
  virtual ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  [[nodiscard]] const DeviceInfo& info() const noexcept { return info_; }
  [[nodiscard]] BackendKind kind() const noexcept { return info_.kind; }

  /// Device memory from the budget; aligned to max(alignment, 256).
  void* allocate_device(std::size_t bytes, std::size_t alignment = 0);
  void deallocate_device(void* ptr);
  [[nodiscard]] PoolStats device_stats() const { return device_pool_->stats(); }
  [[nodiscard]] MemoryPool& device_pool() noexcept { return *device_pool_; }

  /// Page-aligned (4 KiB) host memory, pinned for fast copies where possible, so the same
  /// buffers serve O_DIRECT I/O. Allocate large slabs and sub-allocate: pinning is slow.
  virtual PinnedBuffer allocate_pinned(std::size_t bytes) = 0;
  virtual std::unique_ptr<Stream> create_stream(std::string name) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  /// Makes a stream this backend did not create wait for `event` without blocking the host: a
  /// CUDA stream handle from another library (torch's current stream, DLPack's `stream`; 1 and
  /// 2 are the legacy and per-thread default streams). The host backend has no foreign
  /// streams: it waits on the host. Used by DLPack export (Note [DLPack and streams]).
  virtual void wait_on_foreign_stream(Event& event, std::uintptr_t stream);
  /// A blocking copy through the plainest path (cudaMemcpy; memcpy on the host backend, paced
  /// like a stream copy). The reference the benchmarks compare streams against.
  virtual void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind) = 0;

  Stream& h2d_stream() noexcept { return *h2d_; }
  Stream& d2h_stream() noexcept { return *d2h_; }
  Stream& compute_stream() noexcept { return *compute_; }

 protected:
  explicit Backend(DeviceInfo info) : info_(std::move(info)) {}
  /// Called by the derived constructor once the device reservation exists.
  void start(void* device_base, std::size_t budget_bytes);
  /// Called first by the derived destructor: drains and destroys the owned streams.
  void stop() noexcept;

  DeviceInfo info_;

 private:
  std::unique_ptr<MemoryPool> device_pool_;
  std::unique_ptr<Stream> h2d_, d2h_, compute_;
};

/// Builds the backend `options.kind` asks for. Auto picks CUDA when a device is usable, else
/// host, and says which on stderr once per process (unless options.quiet).
/// @throws strata::Error (unsupported) for kind Cuda without a usable device or CUDA build.
std::unique_ptr<Backend> make_backend(const BackendOptions& options);

/// True when this build contains the CUDA backend.
bool cuda_backend_compiled() noexcept;
/// Number of usable CUDA devices; 0 with the reason in *why when there are none.
int cuda_device_count(std::string* why = nullptr) noexcept;

}  // namespace strata
