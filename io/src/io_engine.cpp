#include "strata/io/io_engine.h"

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <mutex>
#include <vector>

#include "callback_future.h"
#include "engines.h"
#include "strata/base/error.h"
#include "strata/io/pages.h"
#include "strata/base/units.h"

namespace strata {

std::string_view to_string(EngineKind kind) noexcept {
  switch (kind) {
    case EngineKind::Auto:
      return "auto";
    case EngineKind::Uring:
      return "uring";
    case EngineKind::Posix:
      return "posix";
  }
  return "?";
}

EngineKind parse_engine_kind(std::string_view text, std::string_view key) {
  if (text == "auto") return EngineKind::Auto;
  if (text == "uring" || text == "io_uring") return EngineKind::Uring;
  if (text == "posix") return EngineKind::Posix;
  STRATA_FAIL(Errc::invalid_argument, key, ": unknown engine \"", text,
              "\" (expected auto, uring or posix)");
}

FaultSpec parse_fault(std::string_view text, std::string_view key) {
  auto bad = [&] {
    return Error(Errc::invalid_argument,
                 detail::concat(key, ": cannot read fault \"", text,
                                "\" (expected OP:N:KIND with OP read|write|ring, N >= 1, KIND "
                                "eio|enospc|short (not short for ring), e.g. \"read:3:eio\")"));
  };
  const auto c1 = text.find(':');
  const auto c2 = c1 == std::string_view::npos ? c1 : text.find(':', c1 + 1);
  if (c2 == std::string_view::npos) throw bad();
  const std::string_view op = text.substr(0, c1), n = text.substr(c1 + 1, c2 - c1 - 1),
                         kind = text.substr(c2 + 1);
  FaultSpec spec;
  if (op == "read")
    spec.op = FaultSpec::Op::Read;
  else if (op == "write")
    spec.op = FaultSpec::Op::Write;
  else if (op == "ring")
    spec.op = FaultSpec::Op::Ring;
  else
    throw bad();
  const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), spec.nth);
  if (ec != std::errc{} || end != n.data() + n.size() || spec.nth == 0) throw bad();
  if (kind == "eio")
    spec.kind = FaultSpec::Kind::Eio;
  else if (kind == "enospc")
    spec.kind = FaultSpec::Kind::Enospc;
  else if (kind == "short" && spec.op != FaultSpec::Op::Ring)
    spec.kind = FaultSpec::Kind::Short;
  else
    throw bad();
  return spec;
}

void IoOptions::validate() const {
  STRATA_EXPECTS(block_size >= kPageBytes && block_size <= GiB && block_size % kPageBytes == 0,
                 "io.block: ", block_size,
                 " bytes is not a multiple of 4 KiB between 4 KiB and 1 GiB");
  STRATA_EXPECTS(queue_depth >= 1 && queue_depth <= 4096, "io.queue_depth: ", queue_depth,
                 " is outside 1..4096");
  STRATA_EXPECTS(threads >= 1 && threads <= 256, "io.threads: ", threads, " is outside 1..256");
  STRATA_EXPECTS(faults.empty() || fault_injection_available(),
                 "io.faults: this strata was built without fault injection "
                 "(-DSTRATA_FAULT_INJECTION=OFF)");
}

IoEngine::IoEngine(EngineKind kind, IoOptions options)
    : kind_(kind), options_(std::move(options)) {}

IoEngine::~IoEngine() = default;

void IoEngine::submit(const IoRequest& request, IoCallback done) {
  STRATA_EXPECTS(request.file != nullptr && request.file->is_open(),
                 "io request without an open file");
  STRATA_EXPECTS(request.bytes == 0 || request.buffer != nullptr, request.file->path(),
                 ": io request of ", request.bytes, " bytes with a null buffer");
  STRATA_EXPECTS(done != nullptr, request.file->path(), ": io request without a callback");
  if (request.file->direct()) {
    const auto address = reinterpret_cast<std::uintptr_t>(request.buffer);
    STRATA_EXPECTS(request.offset % kPageBytes == 0 && request.bytes % kPageBytes == 0 &&
                       address % kPageBytes == 0,
                   request.file->path(), ": O_DIRECT ", request.op == IoOp::Read ? "read" : "write",
                   " needs 4 KiB alignment; got offset ", request.offset, ", ", request.bytes,
                   " bytes, buffer ", request.buffer);
  }
  requests_.fetch_add(1, std::memory_order_relaxed);
  auto pending = std::make_unique<Pending>();
  pending->request = request;
  pending->done = std::move(done);
  if (request.bytes == 0) {
    finish(std::move(pending));
    return;
  }
  do_submit(std::move(pending));
}

void IoEngine::register_buffer(void* data, std::size_t bytes, std::size_t run_bytes, bool fixed) {
  STRATA_EXPECTS(data != nullptr && bytes > 0, "register_buffer: empty buffer");
  const RegisteredBuffer buffer{data, bytes, run_bytes, fixed};
  do_register_buffer(buffer);
  std::lock_guard lock(registered_mutex_);
  registered_.push_back(buffer);
}

void IoEngine::unregister_buffer(void* data) {
  do_unregister_buffer(data);
  std::lock_guard lock(registered_mutex_);
  std::erase_if(registered_, [data](const RegisteredBuffer& b) { return b.data == data; });
}

std::vector<IoEngine::RegisteredBuffer> IoEngine::registered_buffers() const {
  std::lock_guard lock(registered_mutex_);
  return registered_;
}

std::future<void> IoEngine::submit(const IoRequest& request) {
  auto [callback, future] = detail::callback_with_future();
  submit(request, std::move(callback));
  return std::move(future);
}

bool fault_injection_available() noexcept {
#ifdef STRATA_NO_FAULT_INJECTION
  return false;
#else
  return true;
#endif
}

std::int64_t IoEngine::inject(IoOp op, std::int64_t result,
                              [[maybe_unused]] std::size_t bytes) noexcept {
#ifdef STRATA_NO_FAULT_INJECTION
  (void)op;
  return result;
#endif
  if (options_.faults.empty()) return result;
  const std::uint64_t n = (op == IoOp::Read ? reads_seen_ : writes_seen_).fetch_add(1) + 1;
  const auto want = op == IoOp::Read ? FaultSpec::Op::Read : FaultSpec::Op::Write;
  for (const FaultSpec& f : options_.faults) {
    if (f.op != want || f.nth != n) continue;
    switch (f.kind) {
      case FaultSpec::Kind::Eio:
        return -EIO;
      case FaultSpec::Kind::Enospc:
        return -ENOSPC;
      case FaultSpec::Kind::Short: {
        // Half, rounded down to pages, so an O_DIRECT remainder stays aligned; an operation of
        // under two pages cannot be shortened that way and completes whole.
        constexpr auto kPage = static_cast<std::int64_t>(kPageBytes);
        return result >= 2 * kPage ? result / 2 / kPage * kPage : result;
      }
    }
  }
  return result;
}

int IoEngine::inject_ring(int result) noexcept {
#ifdef STRATA_NO_FAULT_INJECTION
  return result;
#endif
  if (options_.faults.empty()) return result;
  const std::uint64_t n = ring_waits_seen_.fetch_add(1) + 1;
  for (const FaultSpec& f : options_.faults)
    if (f.op == FaultSpec::Op::Ring && f.nth == n)
      return f.kind == FaultSpec::Kind::Enospc ? -ENOSPC : -EIO;
  return result;
}

void IoEngine::fail(Pending& pending, std::uint64_t offset, std::size_t bytes, int error) {
  if (pending.error) return;
  const char* what = pending.request.op == IoOp::Read
                         ? (error == 0 ? "read (end of file reached)" : "read")
                         : (error == 0 ? "write (no progress)" : "write");
  pending.error = std::make_exception_ptr(
      IoError(Errc::io_error, pending.request.file->path(), offset, bytes, error, what));
}

void IoEngine::finish(std::unique_ptr<Pending> pending) noexcept {
  if (pending->error) {
    failed_.fetch_add(1, std::memory_order_relaxed);
  } else if (pending->request.op == IoOp::Read) {
    bytes_read_.fetch_add(pending->request.bytes, std::memory_order_relaxed);
  } else {
    bytes_written_.fetch_add(pending->request.bytes, std::memory_order_relaxed);
  }
  try {
    pending->done(pending->error);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: io completion callback threw: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "strata: io completion callback threw\n");
  }
}

IoStats IoEngine::stats() const noexcept {
  IoStats s;
  s.requests = requests_.load();
  s.operations = operations_.load();
  s.resubmissions = resubmissions_.load();
  s.failed_requests = failed_.load();
  s.bytes_read = bytes_read_.load();
  s.bytes_written = bytes_written_.load();
  return s;
}

std::unique_ptr<IoEngine> make_io_engine(const IoOptions& options) {
  options.validate();
  if (options.engine == EngineKind::Posix) return detail::make_posix_engine(options);
  if (options.engine == EngineKind::Uring) return detail::make_uring_engine(options);
  try {
    return detail::make_uring_engine(options);
  } catch (const Error& e) {
    if (e.code() != Errc::unsupported) throw;
    static std::once_flag said;
    if (!options.quiet) {
      std::call_once(
          said, [&] { std::fprintf(stderr, "strata: io engine auto -> posix (%s)\n", e.what()); });
    }
    return detail::make_posix_engine(options);
  }
}

}  // namespace strata
