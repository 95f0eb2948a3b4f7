// IoEngine: asynchronous reads and writes of byte ranges of files. Two engines: io_uring
// (liburing; registered files and fixed buffers) and POSIX (a thread pool of pread/pwrite).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/io/file.h"
#include "strata/io/io_options.h"
#include "strata/io/pages.h"

namespace strata {

enum class IoOp : std::uint8_t { Read, Write };

/// Read or write `bytes` at `offset` of `file` into or from `buffer`. The file and the buffer
/// must stay valid until the request completes. For a file opened with O_DIRECT, offset, bytes
/// and buffer must be 4 KiB aligned (SwapSpace takes care of that for its callers).
struct IoRequest {
  IoOp op = IoOp::Read;
  const File* file = nullptr;
  std::uint64_t offset = 0;
  std::size_t bytes = 0;
  void* buffer = nullptr;
};

/// Runs once when a request completes: `error` is null on success, else an IoError naming the
/// file, offset and bytes of the failed operation. It runs on an engine thread: keep it short
/// and never block in it on another request of the same engine.
using IoCallback = std::function<void(std::exception_ptr error)>;

struct IoStats {
  std::uint64_t requests = 0;       ///< submitted
  std::uint64_t operations = 0;     ///< chunk reads/writes issued, resubmissions included
  std::uint64_t resubmissions = 0;  ///< short transfers, -EAGAIN and -EINTR re-queued
  std::uint64_t failed_requests = 0;
  std::uint64_t bytes_read = 0;  ///< by requests that succeeded
  std::uint64_t bytes_written = 0;
};

/// Contract:
/// - submit() returns at once; each request completes on its own (no all-or-nothing wait).
/// - A request is split into chunks of `block_size`, or less where the file's device would split
///   such a chunk from that buffer (Note [Request sizes]); up to `queue_depth` chunks are in
///   flight per ring (per worker pool for POSIX). Short transfers, -EAGAIN and -EINTR are
///   resubmitted for the remainder. EOF inside a read is an error (the bytes are not there).
/// - A failure (EIO, ENOSPC, ...) fails that request only; the engine keeps serving others.
/// - Thread-safe: any thread may submit. Destruction waits for every submitted request.
class IoEngine {
 public:
  virtual ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  [[nodiscard]] EngineKind kind() const noexcept { return kind_; }
  [[nodiscard]] const IoOptions& options() const noexcept { return options_; }

  /// Starts `request`; `done` runs exactly once. Invalid requests (null file or buffer,
  /// misalignment under O_DIRECT) throw strata::Error before anything starts.
  void submit(const IoRequest& request, IoCallback done);
  /// As above; the future's get() rethrows the request's IoError.
  std::future<void> submit(const IoRequest& request);
  /// Reads or writes synchronously (submit + wait).
  void run(const IoRequest& request) { submit(request).get(); }

  /// A buffer registered with the engine, as registered_buffers() lists it.
  struct RegisteredBuffer {
    const void* data = nullptr;
    std::size_t bytes = 0;
    std::size_t run_bytes = kPageBytes;  ///< its physically contiguous runs (Note [Request sizes])
    bool fixed = true;                   ///< offered to io_uring as fixed buffers
  };
  /// Registers [data, data + bytes) so requests whose buffer lies inside get chunks sized for
  /// `run_bytes`, the buffer's physically contiguous runs (kHugePageBytes when it is all in huge
  /// pages, as contiguous_run_bytes() says; else kPageBytes) and, when `fixed`, fixed-buffer ops
  /// (io_uring; split into iovecs of at most 1 GiB; the kernel pins the memory, so not for a
  /// lazily touched arena). The memory must stay mapped until unregister_buffer(data).
  void register_buffer(void* data, std::size_t bytes, std::size_t run_bytes = kPageBytes,
                       bool fixed = true);
  void unregister_buffer(void* data);
  /// What is registered now, in registration order.
  [[nodiscard]] std::vector<RegisteredBuffer> registered_buffers() const;
  /// Registers a file's descriptor (io_uring registered files). Unregister before closing it.
  virtual void register_file(const File& file) = 0;
  virtual void unregister_file(const File& file) = 0;

  [[nodiscard]] IoStats stats() const noexcept;
  /// What the engine runs with, for people: "io_uring (defer_taskrun, 64 fixed buffers, ...)".
  [[nodiscard]] virtual std::string describe() const = 0;

 protected:
  IoEngine(EngineKind kind, IoOptions options);

  /// Everything an engine tracks for one request.
  struct Pending {
    IoRequest request;
    IoCallback done;
    std::uint64_t issued = 0;     ///< bytes handed to operations so far
    std::uint64_t completed = 0;  ///< bytes transferred
    unsigned in_flight = 0;       ///< operations not yet completed
    std::size_t chunk = 0;        ///< chunk bytes, set by the engine when it starts the request
    std::exception_ptr error;     ///< first failure
  };
  virtual void do_submit(std::unique_ptr<Pending> pending) = 0;
  virtual void do_register_buffer(const RegisteredBuffer& buffer) = 0;
  virtual void do_unregister_buffer(void* data) = 0;
  /// The chunk for a request into or from memory of `run_bytes` contiguous runs: block_size,
  /// capped where the file's device would split it (Note [Request sizes]).
  [[nodiscard]] std::size_t chunk_bytes(const IoRequest& request,
                                        std::size_t run_bytes) const noexcept {
    return request.file->device().chunk_bytes(options_.block_size, run_bytes);
  }

  /// Applies the configured fault injection to one completed operation: returns the result the
  /// engine should act on (the real one, -EIO, -ENOSPC or a shortened count).
  std::int64_t inject(IoOp op, std::int64_t result, std::size_t bytes) noexcept;
  /// The same for one wait of the io_uring engine's for completions (FaultSpec::Op::Ring).
  int inject_ring(int result) noexcept;
  /// Records a failure of the operation [offset, offset + bytes) of `pending` (first one wins).
  static void fail(Pending& pending, std::uint64_t offset, std::size_t bytes, int error);
  /// Runs the callback and updates the statistics; `pending` is done.
  void finish(std::unique_ptr<Pending> pending) noexcept;
  void count_operation(bool resubmission) noexcept {
    operations_.fetch_add(1, std::memory_order_relaxed);
    if (resubmission) resubmissions_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  EngineKind kind_;
  IoOptions options_;
  std::atomic<std::uint64_t> reads_seen_{0}, writes_seen_{0}, ring_waits_seen_{0};
  std::atomic<std::uint64_t> requests_{0}, operations_{0}, resubmissions_{0}, failed_{0};
  std::atomic<std::uint64_t> bytes_read_{0}, bytes_written_{0};
  mutable std::mutex registered_mutex_;  // registration only; never taken per request
  std::vector<RegisteredBuffer> registered_;
};

/// Builds the engine `options.engine` asks for. Auto tries io_uring and falls back to POSIX when
/// the kernel refuses it (ENOSYS, EPERM, disabled by sysctl), saying so once on stderr.
/// @throws strata::Error naming the key for invalid options; unsupported for an explicit
///         `uring` the kernel refuses.
std::unique_ptr<IoEngine> make_io_engine(const IoOptions& options);

}  // namespace strata
