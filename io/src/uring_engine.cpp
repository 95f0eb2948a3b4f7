// The io_uring engine. One ring, owned by one engine thread that submits, reaps and resubmits;
// callers hand it requests through a locked queue and an eventfd.
//
// Note [One slot, one SQE]: as in fio, the engine has `queue_depth` slots; a slot holds one chunk
// operation (request, file offset, buffer, length) and is named by the SQE's user_data. A short
// transfer, -EAGAIN or -EINTR re-queues the same slot for the remainder; a completed slot goes
// back to the free list and the next chunk of the oldest request takes it. A failed request stops
// issuing chunks and completes, with its first error, once its slots are back.
//
// Note [One chunk, one device request]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// io_uring plugs a submission of more than two SQEs, and the block layer merges neighbouring
// requests in a plug: a sequential stream submitted 16 chunks at a time reached a virtio disk as
// about five 3.2 MiB requests instead of sixteen 1 MiB ones, fewer commands in flight than the
// queue depth asked, and read slower than fio (which submits one at a time) with the same
// buffers. So a chunk that continues the previous SQE's file range is submitted apart from it;
// chunks of unrelated ranges (random I/O, other files) still share one submission. Each chunk is
// already as large as the device takes whole (Note [Request sizes]); the queue depth is what
// the device sees.
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engines.h"
#include "strata/base/error.h"
#include "strata/base/thread_name.h"
#include "strata/base/tunables.h"
#include "strata/base/units.h"
#include "uring_setup.h"

namespace strata::detail {
namespace {

constexpr unsigned kMaxFixedBuffers = tunables::kFixedBuffers;
constexpr unsigned kMaxFixedFiles = tunables::kFixedFiles;
constexpr std::size_t kMaxIovecBytes = std::size_t{1} << 30;  // the kernel's limit per buffer
constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};

class UringEngine final : public IoEngine {
 public:
  explicit UringEngine(const IoOptions& options) : IoEngine(EngineKind::Uring, options) {
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0)
      STRATA_FAIL(Errc::unsupported, "io_uring engine: eventfd failed: ", std::strerror(errno));
    std::promise<void> started;
    auto ready = started.get_future();
    thread_ = std::thread([this, &started] { run(started); });
    try {
      ready.get();
    } catch (...) {
      thread_.join();
      ::close(wake_fd_);
      throw;
    }
  }

  ~UringEngine() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake();
    thread_.join();
    ::close(wake_fd_);
  }

  void register_file(const File& file) override {
    control({Control::Kind::RegisterFile, nullptr, 0, 0, false, file.fd(), {}});
  }
  void unregister_file(const File& file) override {
    control({Control::Kind::UnregisterFile, nullptr, 0, 0, false, file.fd(), {}});
  }

  std::string describe() const override {
    return concat("io_uring (", setup_flags_, "; queue depth ", options().queue_depth, ", block ",
                  format_bytes(options().block_size), ", fixed buffers ",
                  fixed_buffers_ ? "on" : "off", ", fixed files ", fixed_files_ ? "on" : "off",
                  ")");
  }

 private:
  struct Control {
    enum class Kind { RegisterBuffer, UnregisterBuffer, RegisterFile, UnregisterFile };
    Kind kind;
    std::byte* data;
    std::size_t bytes;
    std::size_t run_bytes;
    bool fixed;
    int fd;
    std::promise<void> done;
  };
  struct Slot {
    Pending* pending = nullptr;
    std::uint64_t offset = 0;  // file offset of the remaining bytes
    std::byte* buffer = nullptr;
    std::size_t bytes = 0;
  };
  struct BufferRegion {
    std::byte* base;
    std::size_t bytes;
    std::size_t run_bytes;
    unsigned first_index;
    unsigned count;  // fixed buffers; 0 when it got none (table full, or fixed buffers off)
  };

  void wake() noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  void do_submit(std::unique_ptr<Pending> pending) override {
    bool wake_engine = false;
    std::string stopped;
    {
      std::lock_guard lock(mutex_);
      if (broken_.empty()) {
        incoming_.push_back(pending.release());
        // Note [Waking the engine]: the engine thread itself (a completion callback) takes it
        // before it next sleeps.
        if (std::this_thread::get_id() != engine_id_)
          wake_engine = std::exchange(wake_needed_, false);
      } else {
        stopped = broken_;
      }
    }
    if (pending) {  // Note [A broken ring]: the engine has stopped
      const IoRequest& r = pending->request;
      fail_stopped(*pending, r.offset, r.bytes, broken_errno_, stopped);
      finish(std::move(pending));
      return;
    }
    if (wake_engine) wake();
  }
  void do_register_buffer(const RegisteredBuffer& b) override {
    control({Control::Kind::RegisterBuffer,
             static_cast<std::byte*>(const_cast<void*>(b.data)),
             b.bytes,
             b.run_bytes,
             b.fixed,
             -1,
             {}});
  }
  void do_unregister_buffer(void* data) override {
    control({Control::Kind::UnregisterBuffer, static_cast<std::byte*>(data), 0, 0, false, -1, {}});
  }

  void control(Control c) {
    auto done = c.done.get_future();
    {
      std::lock_guard lock(mutex_);
      if (!broken_.empty()) throw Error(Errc::io_error, broken_);  // Note [A broken ring]
      controls_.push_back(std::move(c));
    }
    wake();
    done.get();
  }

  // ---- everything below runs on the engine thread ----

  void run(std::promise<void>& started) {
    name_this_thread("io");
    engine_id_ = std::this_thread::get_id();
    const unsigned entries = options().queue_depth + 2;  // chunks + the wake-up read
    const RingSetup setup = setup_ring(&ring_, entries, options().sqpoll);
    if (setup.rc < 0) {
      started.set_exception(std::make_exception_ptr(
          Error(Errc::unsupported,
                concat("io_uring engine: io_uring_queue_init failed: ", std::strerror(-setup.rc),
                       " (kernel without io_uring, or disabled by "
                       "kernel.io_uring_disabled)"))));
      return;
    }
    setup_flags_ = setup.flags;
    fixed_buffers_ = io_uring_register_buffers_sparse(&ring_, kMaxFixedBuffers) == 0;
    fixed_files_ = io_uring_register_files_sparse(&ring_, kMaxFixedFiles) == 0;
    buffer_used_.assign(kMaxFixedBuffers, false);
    file_used_.assign(kMaxFixedFiles, false);
    slots_.resize(options().queue_depth);
    for (unsigned i = options().queue_depth; i-- > 0;)
      free_slots_.push_back(i);
    started.set_value();

    bool stopping = false;
    for (;;) {
      stopping = take_incoming() || stopping;
      if (!wake_armed_) arm_wake();
      fill();
      if (stopping && queue_.empty() && retry_.empty() && in_flight_ == 0) break;
      unsubmitted_ = 0;
      // Note [Waking the engine]: a request that arrived since take_incoming() is taken now.
      if (!may_sleep()) {
        io_uring_submit(&ring_);
        reap();
        continue;
      }
      const int rc = inject_ring(io_uring_submit_and_wait(&ring_, 1));
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) {
        stop_on_error(-rc);  // Note [A broken ring]
        break;
      }
      reap();
    }
    io_uring_queue_exit(&ring_);
  }

  // Note [A broken ring]
  // ~~~~~~~~~~~~~~~~~~~~~
  // An error the loop does not expect from io_uring_submit_and_wait (anything but EINTR,
  // EAGAIN, EBUSY, ETIME) would come back on every turn: the loop used to spin on it, printing
  // it each time. Instead the engine stops. Requests not yet in the kernel fail now; operations
  // in the kernel are waited for (up to kDrainSeconds: the ring may not deliver them) and fail
  // if they do not complete; new requests fail at once and controls throw, all with the errno
  // and the call that failed. The ring is torn down; the engine stays an object that says so.
  static constexpr int kDrainSeconds = tunables::kBrokenRingDrainSeconds;

  void stop_on_error(int err) {
    const std::string why =
        concat("the io_uring engine stopped: io_uring_submit_and_wait failed: ", std::strerror(err),
               " (errno ", err, ")");
    std::vector<Pending*> incoming;
    std::vector<Control> controls;
    {
      std::lock_guard lock(mutex_);
      broken_ = why;
      broken_errno_ = err;
      incoming.swap(incoming_);
      controls.swap(controls_);
    }
    for (Control& c : controls)
      c.done.set_exception(std::make_exception_ptr(Error(Errc::io_error, why)));
    queue_.insert(queue_.end(), incoming.begin(), incoming.end());
    std::deque<Pending*> queued;
    queued.swap(queue_);
    for (Pending* p : queued) {  // partly issued ones finish when their operations end
      fail_stopped(*p, p->request.offset + p->issued, p->request.bytes - p->issued, err, why);
      p->issued = p->request.bytes;
      maybe_finish(p);
    }
    const auto fail_retries = [&] {
      for (unsigned index : retry_)
        fail_slot(index, err, why);
      retry_.clear();
    };
    fail_retries();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kDrainSeconds);
    while (in_flight_ > 0 && std::chrono::steady_clock::now() < deadline) {
      __kernel_timespec wait{0, 100'000'000};
      io_uring_cqe* cqe = nullptr;
      const int w = io_uring_wait_cqe_timeout(&ring_, &cqe, &wait);
      if (w < 0 && w != -ETIME && w != -EINTR) break;
      reap();
      fail_retries();
    }
    for (unsigned index = 0; index < slots_.size(); ++index)
      if (slots_[index].pending != nullptr) {  // still in the kernel: given up on
        --in_flight_;
        fail_slot(index, err, why);
      }
  }

  // Fails the operation in `index` (not in the kernel any more, or given up on) and frees it.
  void fail_slot(unsigned index, int err, const std::string& why) {
    Slot& s = slots_[index];
    Pending* p = s.pending;
    fail_stopped(*p, s.offset, s.bytes, err, why);
    s = Slot{};
    free_slots_.push_back(index);
    --p->in_flight;
    maybe_finish(p);
  }

  static void fail_stopped(Pending& p, std::uint64_t offset, std::size_t bytes, int err,
                           const std::string& why) {
    if (p.error) return;
    p.error = std::make_exception_ptr(
        IoError(Errc::io_error, p.request.file->path(), offset, bytes, err,
                concat(p.request.op == IoOp::Read ? "read" : "write", " (", why, ")")));
  }

  // Note [Waking the engine]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~
  // A submitter wakes the engine (an eventfd write, whose armed read completes in the ring) only
  // when the engine may wait without it: nothing in flight, or a ring slot free that the new
  // request could take at once. When every slot is busy, the next completion wakes the engine,
  // and it takes the new requests then; a sequential stream kept 2 x qd deep at 512 KiB no
  // longer pays an eventfd write and an engine wake-up per request. Decided under mutex_ just
  // before the engine sleeps, so a request is either seen by it or wakes it. A request submitted
  // on the engine thread (from a completion callback) never wakes it: the loop takes incoming_
  // and checks it again under mutex_ before it sleeps. A pipeline that submits the next request
  // as one completes (strata-bench io, Note [Submitting from completions]) then runs on this
  // thread alone, which on a VM with idle vCPUs is what reading at fio's rate took.
  bool may_sleep() {
    std::lock_guard lock(mutex_);
    if (!incoming_.empty() || !controls_.empty() || stopping_) return false;
    wake_needed_ = in_flight_ == 0 || !free_slots_.empty() || !retry_.empty();
    return true;
  }

  // Moves new requests and controls in; returns true once the engine is asked to stop.
  bool take_incoming() {
    std::vector<Pending*> incoming;
    std::vector<Control> controls;
    bool stopping = false;
    {
      std::lock_guard lock(mutex_);
      incoming.swap(incoming_);
      controls.swap(controls_);
      stopping = stopping_;
    }
    queue_.insert(queue_.end(), incoming.begin(), incoming.end());
    for (Control& c : controls) {
      try {
        apply(c);
        c.done.set_value();
      } catch (...) {
        c.done.set_exception(std::current_exception());
      }
    }
    return stopping;
  }

  void apply(Control& c) {
    switch (c.kind) {
      case Control::Kind::RegisterBuffer: {
        // Without fixed buffers (off, or the table full) plain reads and writes still work; the
        // region still sizes its chunks.
        BufferRegion region{c.data, c.bytes, c.run_bytes, 0, 0};
        const unsigned count =
            static_cast<unsigned>((c.bytes + kMaxIovecBytes - 1) / kMaxIovecBytes);
        const unsigned first = fixed_buffers_ && c.fixed ? find_free_run(buffer_used_, count) : ~0u;
        if (first == ~0u) {
          regions_.push_back(region);
          return;
        }
        std::vector<iovec> iovs(count);
        for (unsigned i = 0; i < count; ++i) {
          iovs[i].iov_base = c.data + i * kMaxIovecBytes;
          iovs[i].iov_len = std::min(kMaxIovecBytes, c.bytes - i * kMaxIovecBytes);
        }
        const int rc =
            io_uring_register_buffers_update_tag(&ring_, first, iovs.data(), nullptr, count);
        if (rc < 0) {
          throw Error(Errc::io_error, concat("io_uring: registering ", c.bytes, " bytes at ",
                                             static_cast<void*>(c.data),
                                             " as fixed buffers failed: ", std::strerror(-rc),
                                             " (is the memory locked and RLIMIT_MEMLOCK "
                                             "large enough?)"));
        }
        for (unsigned i = 0; i < count; ++i)
          buffer_used_[first + i] = true;
        region.first_index = first;
        region.count = count;
        regions_.push_back(region);
        return;
      }
      case Control::Kind::UnregisterBuffer: {
        for (auto it = regions_.begin(); it != regions_.end(); ++it) {
          if (it->base != c.data) continue;
          std::vector<iovec> empty(it->count, iovec{nullptr, 0});
          if (it->count != 0)
            io_uring_register_buffers_update_tag(&ring_, it->first_index, empty.data(), nullptr,
                                                 it->count);
          for (unsigned i = 0; i < it->count; ++i)
            buffer_used_[it->first_index + i] = false;
          regions_.erase(it);
          return;
        }
        return;
      }
      case Control::Kind::RegisterFile: {
        if (!fixed_files_ || files_.contains(c.fd)) return;
        const unsigned slot = find_free_run(file_used_, 1);
        if (slot == ~0u) return;
        if (io_uring_register_files_update(&ring_, slot, &c.fd, 1) < 0) return;
        file_used_[slot] = true;
        files_.emplace(c.fd, static_cast<int>(slot));
        return;
      }
      case Control::Kind::UnregisterFile: {
        const auto it = files_.find(c.fd);
        if (it == files_.end()) return;
        int none = -1;
        io_uring_register_files_update(&ring_, static_cast<unsigned>(it->second), &none, 1);
        file_used_[static_cast<unsigned>(it->second)] = false;
        files_.erase(it);
        return;
      }
    }
  }

  static unsigned find_free_run(const std::vector<bool>& used, unsigned count) {
    for (unsigned i = 0; i + count <= used.size(); ++i) {
      unsigned n = 0;
      while (n < count && !used[i + n])
        ++n;
      if (n == count) return i;
    }
    return ~0u;
  }

  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // never with entries = depth + 2, but stay safe
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  void arm_wake() {
    io_uring_sqe* sqe = next_sqe();
    io_uring_prep_read(sqe, wake_fd_, &wake_value_, sizeof wake_value_, 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    wake_armed_ = true;
  }

  const BufferRegion* region_of(const std::byte* buffer, std::size_t bytes) const noexcept {
    for (const BufferRegion& r : regions_)
      if (buffer >= r.base && buffer + bytes <= r.base + r.bytes) return &r;
    return nullptr;
  }

  int fixed_index(const std::byte* buffer, std::size_t bytes) const noexcept {
    for (const BufferRegion& r : regions_) {
      if (buffer < r.base || buffer + bytes > r.base + r.bytes || r.count == 0) continue;
      const std::size_t at = static_cast<std::size_t>(buffer - r.base);
      const std::size_t iov = at / kMaxIovecBytes;
      if ((at + bytes - 1) / kMaxIovecBytes != iov) return -1;  // crosses an iovec boundary
      return static_cast<int>(r.first_index + iov);
    }
    return -1;
  }

  void prep(unsigned index, bool resubmission) {
    Slot& s = slots_[index];
    const IoRequest& r = s.pending->request;
    // Note [One chunk, one device request]: a chunk that continues the one before it goes to
    // the kernel in a submission of its own.
    if (unsubmitted_ > 0 && r.file->fd() == last_fd_ && s.offset == last_end_) {
      io_uring_submit(&ring_);
      unsubmitted_ = 0;
    }
    last_fd_ = r.file->fd();
    last_end_ = s.offset + s.bytes;
    io_uring_sqe* sqe = next_sqe();
    int fd = r.file->fd();
    bool fixed_file = false;
    if (const auto it = files_.find(fd); it != files_.end()) {
      fd = it->second;
      fixed_file = true;
    }
    const int buf_index = fixed_index(s.buffer, s.bytes);
    const auto len = static_cast<unsigned>(s.bytes);
    if (r.op == IoOp::Read) {
      if (buf_index >= 0)
        io_uring_prep_read_fixed(sqe, fd, s.buffer, len, s.offset, buf_index);
      else
        io_uring_prep_read(sqe, fd, s.buffer, len, s.offset);
    } else {
      if (buf_index >= 0)
        io_uring_prep_write_fixed(sqe, fd, s.buffer, len, s.offset, buf_index);
      else
        io_uring_prep_write(sqe, fd, s.buffer, len, s.offset);
    }
    if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, index);
    ++in_flight_;
    count_operation(resubmission);
    ++unsubmitted_;
  }

  void fill() {
    for (unsigned index : retry_)
      prep(index, /*resubmission=*/true);
    retry_.clear();
    while (!queue_.empty()) {
      Pending* p = queue_.front();
      if (p->error) {  // a failed request issues nothing more
        queue_.pop_front();
        p->issued = p->request.bytes;
        maybe_finish(p);
        continue;
      }
      if (free_slots_.empty()) break;
      const unsigned index = free_slots_.back();
      free_slots_.pop_back();
      if (p->chunk == 0) {
        const BufferRegion* region =
            region_of(static_cast<const std::byte*>(p->request.buffer), p->request.bytes);
        p->chunk = chunk_bytes(p->request, region != nullptr ? region->run_bytes : kPageBytes);
      }
      const std::size_t len = std::min<std::uint64_t>(p->chunk, p->request.bytes - p->issued);
      slots_[index] = {p, p->request.offset + p->issued,
                       static_cast<std::byte*>(p->request.buffer) + p->issued, len};
      p->issued += len;
      ++p->in_flight;
      if (p->issued == p->request.bytes) queue_.pop_front();
      prep(index, /*resubmission=*/false);
    }
  }

  void reap() {
    unsigned head = 0, seen = 0;
    io_uring_cqe* cqe = nullptr;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      complete(io_uring_cqe_get_data64(cqe), cqe->res);
    }
    io_uring_cq_advance(&ring_, seen);
  }

  void complete(std::uint64_t tag, int res) {
    if (tag == kWakeTag) {
      wake_armed_ = false;  // re-armed after the queue is read
      return;
    }
    --in_flight_;
    const auto index = static_cast<unsigned>(tag);
    Slot& s = slots_[index];
    Pending* p = s.pending;
    const std::int64_t result = inject(p->request.op, res, s.bytes);
    if (result == -EAGAIN || result == -EINTR) {
      retry_.push_back(index);
      return;
    }
    if (result < 0) {
      fail(*p, s.offset, s.bytes, static_cast<int>(-result));
    } else if (result == 0) {
      fail(*p, s.offset, s.bytes, 0);
    } else if (static_cast<std::size_t>(result) < s.bytes) {
      s.offset += static_cast<std::uint64_t>(result);
      s.buffer += result;
      s.bytes -= static_cast<std::size_t>(result);
      retry_.push_back(index);
      return;
    } else {
      p->completed += s.bytes;
    }
    s = Slot{};
    free_slots_.push_back(index);
    --p->in_flight;
    maybe_finish(p);
  }

  void maybe_finish(Pending* p) {
    if (p->in_flight == 0 && p->issued == p->request.bytes) finish(std::unique_ptr<Pending>(p));
  }

  // shared with callers
  std::mutex mutex_;
  std::vector<Pending*> incoming_;
  std::vector<Control> controls_;
  bool stopping_ = false;
  std::string broken_;       // Note [A broken ring]: why the engine stopped; empty while it runs
  int broken_errno_ = 0;     // set with broken_, never changed after
  bool wake_needed_ = true;  // the engine may sleep without a wake-up from a submitter
  int wake_fd_ = -1;
  std::thread::id engine_id_;  // set before the constructor returns, never changed after

  // engine thread only (describe() reads the setup facts after start-up)
  io_uring ring_{};
  std::string setup_flags_;
  bool fixed_buffers_ = false, fixed_files_ = false;
  unsigned unsubmitted_ = 0;  // SQEs prepared since the last submit
  int last_fd_ = -1;          // file and end of the last SQE prepared
  std::uint64_t last_end_ = 0;
  std::vector<bool> buffer_used_, file_used_;
  std::vector<BufferRegion> regions_;
  std::unordered_map<int, int> files_;  // fd -> registered index
  std::vector<Slot> slots_;
  std::vector<unsigned> free_slots_;
  std::vector<unsigned> retry_;
  std::deque<Pending*> queue_;
  unsigned in_flight_ = 0;
  std::uint64_t wake_value_ = 0;
  bool wake_armed_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(const IoOptions& options) {
  return std::make_unique<UringEngine>(options);
}

}  // namespace strata::detail
