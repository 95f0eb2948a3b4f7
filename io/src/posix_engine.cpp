// The POSIX engine: a pool of threads doing pread/pwrite, for kernels without io_uring or when
// asked for. Each worker takes the next chunk of the oldest request.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "engines.h"
#include "strata/base/error.h"
#include "strata/base/thread_name.h"
#include "strata/base/units.h"

namespace strata::detail {
namespace {

class PosixEngine final : public IoEngine {
 public:
  explicit PosixEngine(const IoOptions& options) : IoEngine(EngineKind::Posix, options) {
    workers_.reserve(options.threads);
    for (unsigned i = 0; i < options.threads; ++i)
      workers_.emplace_back([this] { work(); });
  }

  ~PosixEngine() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_)
      w.join();
  }

  void register_file(const File&) override {}
  void unregister_file(const File&) override {}

  std::string describe() const override {
    return concat("posix (", options().threads, " threads of pread/pwrite, block ",
                  format_bytes(options().block_size), ")");
  }

 private:
  void do_submit(std::unique_ptr<Pending> pending) override {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(pending.release());
    }
    wake_.notify_all();
  }
  // Only to size chunks (Note [Request sizes]): pread has no fixed buffers.
  void do_register_buffer(const RegisteredBuffer& b) override {
    std::lock_guard lock(mutex_);
    regions_.push_back(b);
  }
  void do_unregister_buffer(void* data) override {
    std::lock_guard lock(mutex_);
    std::erase_if(regions_, [data](const RegisteredBuffer& b) { return b.data == data; });
  }
  // The contiguous run of `p`'s buffer; under mutex_.
  std::size_t run_bytes_of(const Pending& p) const noexcept {
    const auto* begin = static_cast<const std::byte*>(p.request.buffer);
    for (const RegisteredBuffer& b : regions_) {
      const auto* base = static_cast<const std::byte*>(b.data);
      if (begin >= base && begin + p.request.bytes <= base + b.bytes) return b.run_bytes;
    }
    return kPageBytes;
  }

  // One chunk: transfers it completely (resubmitting short, EINTR and EAGAIN results) or fails.
  // Returns 0 or a positive errno; sets *eof when a read found the end of the file.
  int transfer(const IoRequest& r, std::uint64_t offset, std::byte* buf, std::size_t len) {
    bool again = false;
    while (len > 0) {
      count_operation(again);
      again = true;
      const ssize_t n = r.op == IoOp::Read
                            ? ::pread(r.file->fd(), buf, len, static_cast<off_t>(offset))
                            : ::pwrite(r.file->fd(), buf, len, static_cast<off_t>(offset));
      const std::int64_t result = inject(r.op, n < 0 ? -errno : n, len);
      if (result == -EINTR || result == -EAGAIN) continue;
      if (result < 0) return static_cast<int>(-result);
      if (result == 0) return -1;  // end of file (read) or no progress (write)
      offset += static_cast<std::uint64_t>(result);
      buf += result;
      len -= static_cast<std::size_t>(result);
    }
    return 0;
  }

  void work() {
    name_this_thread("io");
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Pending* p = queue_.front();
      const std::uint64_t start = p->issued;
      if (p->chunk == 0) p->chunk = chunk_bytes(p->request, run_bytes_of(*p));
      const std::size_t len = std::min<std::uint64_t>(p->chunk, p->request.bytes - start);
      p->issued += len;
      ++p->in_flight;
      if (p->issued == p->request.bytes) queue_.pop_front();
      lock.unlock();

      const std::uint64_t offset = p->request.offset + start;
      auto* buffer = static_cast<std::byte*>(p->request.buffer) + start;
      const int error = transfer(p->request, offset, buffer, len);

      lock.lock();
      if (error != 0) {
        fail(*p, offset, len, error < 0 ? 0 : error);
        // Stop issuing the rest of a failed request.
        if (!queue_.empty() && p->issued < p->request.bytes) {
          std::erase(queue_, p);
          p->issued = p->request.bytes;
        }
      } else {
        p->completed += len;
      }
      if (--p->in_flight == 0 && p->issued == p->request.bytes) {
        std::unique_ptr<Pending> done(p);
        lock.unlock();
        finish(std::move(done));
        lock.lock();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending*> queue_;
  std::vector<RegisteredBuffer> regions_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoEngine> make_posix_engine(const IoOptions& options) {
  return std::make_unique<PosixEngine>(options);
}

}  // namespace strata::detail
