#include "strata/io/swap_space.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "callback_future.h"
#include "strata/base/error.h"
#include "strata/base/tunables.h"
#include "strata/base/units.h"
#include "strata/io/crc32c.h"
#include "strata/io/pages.h"

namespace strata {

void SwapOptions::validate() const {
  STRATA_EXPECTS(!paths.empty(), "nvme.paths: no directory given");
  STRATA_EXPECTS(stripe_bytes >= kPageBytes && stripe_bytes % kPageBytes == 0,
                 "nvme.stripe: ", stripe_bytes, " is not a positive multiple of 4 KiB");
  STRATA_EXPECTS(capacity_bytes > 0, "nvme.capacity: must be > 0");
  for (std::size_t i = 0; i < paths.size(); ++i) {
    struct stat st {};
    STRATA_EXPECTS(::stat(paths[i].c_str(), &st) == 0, "nvme.paths[", i, "]: \"", paths[i],
                   "\": ", std::strerror(errno));
    STRATA_EXPECTS(S_ISDIR(st.st_mode), "nvme.paths[", i, "]: \"", paths[i],
                   "\" is not a directory");
  }
}

struct SwapSpace::Extent {
  std::uint64_t bytes = 0;
  std::uint64_t logical = 0;             // swap extents: offset in the striped space
  std::shared_ptr<MappedFile> mapped;    // mapped extents: the file
  std::uint64_t file_offset = 0;         // mapped extents: offset in that file
  std::mutex mutex;                      // guards the checksum state
  std::vector<std::uint64_t> crc_bytes;  // per stripe piece: bytes covered by crc
  std::vector<std::uint32_t> crcs;
  std::vector<bool> torn;  // per stripe piece: its last write failed
};

struct SwapSpace::MappedFile {
  File direct;    // O_DIRECT where possible, for the page-aligned part
  File buffered;  // for the last partial page of the file
  std::uint64_t size = 0;
};

// One read or write of an extent in flight: its pieces, their buffers, and what to do at the end.
struct SwapSpace::Transfer {
  IoOp op = IoOp::Read;
  std::shared_ptr<Extent> extent;
  std::byte* user = nullptr;
  std::size_t bytes = 0;
  PageBuffer staging;
  std::size_t copy_to_user = 0;  // reads: bytes to copy from staging to user + copy_at
  std::size_t copy_at = 0;
  std::size_t copy_from = 0;             // offset in staging
  std::vector<std::uint64_t> crc_bytes;  // reads: the extent's checksum state at the start
  std::vector<std::uint32_t> crcs;
  std::vector<Piece> pieces;            // the stripe pieces of the transfer
  std::vector<std::uint32_t> new_crcs;  // writes: per piece
  struct Op {
    const File* file;
    std::uint64_t offset;
    std::size_t bytes;
    std::byte* buffer;
  };
  std::vector<Op> ops;
  std::atomic<std::size_t> remaining{0};
  std::mutex mutex;
  std::exception_ptr error;
  IoCallback done;
};

namespace {
std::atomic<std::uint64_t> g_swap_sequence{0};
}

SwapSpace::SwapSpace(SwapOptions options, IoEngine& engine)
    : options_(std::move(options)),
      engine_(engine),
      space_(
          "Nvme",
          [&] {
            options_.validate();
            const std::uint64_t stripes =
                (options_.capacity_bytes + options_.stripe_bytes - 1) / options_.stripe_bytes;
            const std::uint64_t per_path =
                (stripes + options_.paths.size() - 1) / options_.paths.size();
            return per_path * options_.paths.size() * options_.stripe_bytes;
          }(),
          kPageBytes) {
  const std::uint64_t per_file = space_.capacity() / options_.paths.size();
  const std::uint64_t seq = g_swap_sequence.fetch_add(1);
  files_.reserve(options_.paths.size());
  try {
    for (std::size_t i = 0; i < options_.paths.size(); ++i) {
      const std::string path =
          detail::concat(options_.paths[i], "/strata-swap-", ::getpid(), "-", seq, "-", i, ".bin");
      files_.emplace_back(path, File::Mode::Create, options_.direct);
      file_paths_.push_back(path);
      files_.back().allocate(per_file);
      engine_.register_file(files_.back());
    }
  } catch (...) {
    for (File& f : files_)
      engine_.unregister_file(f);
    files_.clear();
    for (const std::string& p : file_paths_)
      ::unlink(p.c_str());
    throw;
  }
}

SwapSpace::~SwapSpace() {
  for (File& f : files_) {
    try {
      engine_.unregister_file(f);
    } catch (...) {
    }
    f.close();
  }
  if (!options_.keep_files)
    for (const std::string& p : file_paths_)
      ::unlink(p.c_str());
}

// Note [Small extents]: an extent starts on a stripe boundary so that its stripe unit k is its
// bytes [k * S, (k + 1) * S), one checksum each. One smaller than a stripe unit needs only to
// stay inside one: it is aligned to the smallest power of two (at least a page) that holds it,
// which divides S, so it never crosses a boundary and is one piece, unit 0. Aligned to S, each
// would take a whole stripe of the swap (a 4 KiB norm's state, a KV cache's 256 KiB page: 1 MiB
// at the default stripe), the rest of it unusable by the next stripe-aligned extent.
std::uint64_t SwapSpace::alignment_for(std::uint64_t bytes) const noexcept {
  const std::uint64_t S = options_.stripe_bytes;
  std::uint64_t a = kPageBytes;
  while (a < bytes && a < S)
    a <<= 1;
  return a < S && S % a == 0 ? a : S;
}

ExtentId SwapSpace::allocate(std::uint64_t bytes) {
  STRATA_EXPECTS(bytes > 0, "swap extent of 0 bytes");
  auto e = std::make_shared<Extent>();
  e->bytes = bytes;
  std::lock_guard lock(mutex_);
  e->logical = space_.allocate(bytes, alignment_for(bytes));
  const std::size_t units = (bytes + options_.stripe_bytes - 1) / options_.stripe_bytes;
  e->crc_bytes.assign(units, 0);
  e->crcs.assign(units, 0);
  e->torn.assign(units, false);
  const ExtentId id = next_id_++;
  extents_.emplace(id, std::move(e));
  return id;
}

ExtentId SwapSpace::map_file(const std::string& path, std::uint64_t offset, std::uint64_t bytes) {
  STRATA_EXPECTS(bytes > 0, path, ": mapped extent of 0 bytes");
  std::lock_guard lock(mutex_);
  std::shared_ptr<MappedFile>& m = mapped_[path];
  if (!m) {
    auto fresh = std::make_shared<MappedFile>();
    fresh->direct = File(path, File::Mode::Read, options_.direct);
    fresh->buffered = File(path, File::Mode::Read, false);
    fresh->size = fresh->buffered.size();
    m = std::move(fresh);
  }
  if (offset + bytes > m->size || offset + bytes < offset) {
    STRATA_FAIL(Errc::invalid_argument, path, ": extent of ", bytes, " bytes at offset ", offset,
                " runs past the end of the file (", m->size, " bytes)");
  }
  auto e = std::make_shared<Extent>();
  e->bytes = bytes;
  e->mapped = m;
  e->file_offset = offset;
  const ExtentId id = next_id_++;
  extents_.emplace(id, std::move(e));
  return id;
}

void SwapSpace::release(ExtentId id) {
  std::lock_guard lock(mutex_);
  const auto it = extents_.find(id);
  STRATA_EXPECTS(it != extents_.end(), "release of unknown extent ", id);
  if (!it->second->mapped) space_.deallocate(it->second->logical);
  extents_.erase(it);
}

std::shared_ptr<SwapSpace::Extent> SwapSpace::find(ExtentId id) const {
  std::lock_guard lock(mutex_);
  const auto it = extents_.find(id);
  if (it == extents_.end()) STRATA_FAIL(Errc::not_found, "no extent ", id, " in this swap space");
  return it->second;
}

std::uint64_t SwapSpace::extent_bytes(ExtentId id) const {
  return find(id)->bytes;
}

RangeStats SwapSpace::stats() const {
  std::lock_guard lock(mutex_);
  return space_.stats();
}

// Stripe pieces of [from, from + bytes) of a swap extent: logical offset L lives in stripe
// s = L / S, on path s % P, at file offset (s / P) * S + L % S. Extents start on stripe
// boundaries or lie inside one stripe (Note [Small extents]), so stripe unit k of an extent is
// its bytes [k * S, (k + 1) * S).
std::vector<SwapSpace::Piece> SwapSpace::layout(const Extent& e, std::uint64_t from,
                                                std::uint64_t bytes) const {
  std::vector<Piece> out;
  const std::uint64_t S = options_.stripe_bytes, P = files_.size();
  std::uint64_t at = 0;
  while (at < bytes) {
    const std::uint64_t logical = e.logical + from + at;
    const std::uint64_t stripe = logical / S, within = logical % S;
    const std::uint64_t len = std::min(S - within, bytes - at);
    out.push_back({&files_[stripe % P], (stripe / P) * S + within, len, at, (from + at) / S,
                   (from + at) % S == 0});
    at += len;
  }
  return out;
}

std::vector<ExtentPiece> SwapSpace::pieces(ExtentId id) const {
  const auto e = find(id);
  if (e->mapped) return {{e->mapped->buffered.path(), e->file_offset, e->bytes}};
  std::vector<ExtentPiece> out;
  for (const Piece& p : layout(*e, 0, e->bytes))
    out.push_back({p.file->path(), p.offset, p.bytes});
  return out;
}

std::shared_ptr<SwapSpace::Transfer> SwapSpace::make_transfer(IoOp op, std::shared_ptr<Extent> e,
                                                              void* data, std::size_t bytes,
                                                              IoCallback done) {
  auto t = std::make_shared<Transfer>();
  t->op = op;
  t->extent = std::move(e);
  t->user = static_cast<std::byte*>(data);
  t->bytes = bytes;
  t->done = std::move(done);
  return t;
}

// Note [Staging for unaligned transfers]: O_DIRECT needs page-aligned buffers, offsets and
// lengths. An aligned buffer goes to the engine as it is for its whole pages; the last partial
// page, or all of an unaligned buffer, goes through page-aligned staging (zero-padded on
// writes; copied out on reads). Swap offsets are page multiples, so file offsets always are.
void SwapSpace::add_ops(Transfer& t, const Extent& e, std::uint64_t offset, std::size_t bytes) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(t.user) % kPageBytes == 0;
  const std::size_t direct_bytes = aligned ? bytes / kPageBytes * kPageBytes : 0;
  const std::size_t padded = align_up(bytes, kPageBytes);
  if (padded > direct_bytes) {
    t.staging = take_staging(padded - direct_bytes);
    if (t.op == IoOp::Write) {
      std::memcpy(t.staging.data(), t.user + direct_bytes, bytes - direct_bytes);
      bounced_bytes_.fetch_add(bytes - direct_bytes, std::memory_order_relaxed);
    } else {
      t.copy_from = 0;
      t.copy_at = direct_bytes;
      t.copy_to_user = bytes - direct_bytes;
    }
  }
  for (const Piece& p : layout(e, offset, padded)) {
    std::uint64_t at = p.at, file_offset = p.offset, len = p.bytes;
    if (at < direct_bytes) {  // the part in the user's buffer
      const std::uint64_t head = std::min<std::uint64_t>(len, direct_bytes - at);
      t.ops.push_back({p.file, file_offset, head, t.user + at});
      at += head, file_offset += head, len -= head;
    }
    if (len > 0)
      t.ops.push_back({p.file, file_offset, len, t.staging.data() + (at - direct_bytes)});
  }
}

void SwapSpace::write(ExtentId id, std::uint64_t offset, const void* data, std::size_t bytes,
                      IoCallback done) {
  auto e = find(id);
  STRATA_EXPECTS(!e->mapped, "extent ", id, " is a read-only mapping of ",
                 e->mapped ? e->mapped->buffered.path() : "", "; it is never written");
  STRATA_EXPECTS(offset % kPageBytes == 0, "write at offset ", offset, " of extent ", id,
                 ": swap offsets are multiples of 4 KiB");
  STRATA_EXPECTS(offset + bytes <= e->bytes, "write of ", bytes, " bytes at offset ", offset,
                 " into extent ", id, " of ", e->bytes, " bytes");
  STRATA_EXPECTS(bytes == 0 || data != nullptr, "write of ", bytes, " bytes from null");
  auto t =
      make_transfer(IoOp::Write, std::move(e), const_cast<void*>(data), bytes, std::move(done));
  t->pieces = layout(*t->extent, offset, bytes);
  if (options_.checksums)
    for (const Piece& p : t->pieces)
      t->new_crcs.push_back(crc32c(t->user + p.at, p.bytes));
  add_ops(*t, *t->extent, offset, bytes);
  start(std::move(t));
}

void SwapSpace::read(ExtentId id, std::uint64_t offset, void* data, std::size_t bytes,
                     IoCallback done) {
  auto e = find(id);
  STRATA_EXPECTS(offset + bytes <= e->bytes, "read of ", bytes, " bytes at offset ", offset,
                 " from extent ", id, " of ", e->bytes, " bytes");
  STRATA_EXPECTS(bytes == 0 || data != nullptr, "read of ", bytes, " bytes into null");
  auto t = make_transfer(IoOp::Read, e, data, bytes, std::move(done));
  const bool aligned = reinterpret_cast<std::uintptr_t>(data) % kPageBytes == 0;

  if (e->mapped) {
    // Read [A, full_end) with O_DIRECT (A = the page below the offset; full_end never past the
    // file's last whole page), and the rest — at most the file's last partial page — buffered.
    const MappedFile& m = *e->mapped;
    const std::uint64_t off = e->file_offset + offset, end = off + bytes;
    const std::uint64_t A = off / kPageBytes * kPageBytes;
    std::uint64_t full_end =
        m.direct.direct() ? std::min(align_up(end, kPageBytes), m.size / kPageBytes * kPageBytes)
                          : A;
    if (full_end < A) full_end = A;
    if (full_end > A) {
      if (A == off && aligned && full_end <= end) {
        t->ops.push_back({&m.direct, A, full_end - A, t->user});
      } else {
        t->staging = take_staging(full_end - A);
        t->ops.push_back({&m.direct, A, full_end - A, t->staging.data()});
        t->copy_from = off - A;
        t->copy_at = 0;
        t->copy_to_user = std::min(full_end, end) - off;
      }
    }
    const std::uint64_t tail_start = std::max(full_end, off);
    if (end > tail_start)
      t->ops.push_back({&m.buffered, tail_start, end - tail_start, t->user + (tail_start - off)});
    start(std::move(t));
    return;
  }

  STRATA_EXPECTS(offset % kPageBytes == 0, "read at offset ", offset, " of extent ", id,
                 ": swap offsets are multiples of 4 KiB");
  {
    std::lock_guard lock(e->mutex);
    for (const Piece& p : layout(*e, offset, bytes))
      if (e->torn[p.index])
        throw IoError(Errc::corrupt_data, p.file->path(), p.offset, p.bytes, 0,
                      detail::concat("read of torn extent ", id, ": the last write of its stripe ",
                                     "piece ", p.index, " failed, so its bytes are not valid"));
    if (options_.checksums) {
      t->crc_bytes = e->crc_bytes;
      t->crcs = e->crcs;
    }
  }
  if (options_.checksums) t->pieces = layout(*e, offset, bytes);
  add_ops(*t, *e, offset, bytes);
  start(std::move(t));
}

PageBuffer SwapSpace::take_staging(std::size_t bytes) {
  {
    std::lock_guard lock(staging_mutex_);
    auto best = staging_pool_.end();
    for (auto it = staging_pool_.begin(); it != staging_pool_.end(); ++it)
      if (it->size() >= bytes && (best == staging_pool_.end() || it->size() < best->size()))
        best = it;
    if (best != staging_pool_.end()) {
      PageBuffer b = std::move(*best);
      staging_pool_.erase(best);
      staging_pooled_bytes_ -= b.size();
      return b;
    }
  }
  // Sizes rounded up to 64 KiB so that buffers fit the next transfers of about the same size.
  return PageBuffer(align_up(bytes, tunables::kStagingRoundBytes), false, "Host (staging)");
}

void SwapSpace::give_staging(PageBuffer buffer) {
  std::lock_guard lock(staging_mutex_);
  if (staging_pooled_bytes_ + buffer.size() > kStagingPoolBytes) return;  // unmapped here
  staging_pooled_bytes_ += buffer.size();
  staging_pool_.push_back(std::move(buffer));
}

void SwapSpace::start(std::shared_ptr<Transfer> t) {
  // Runs when every operation of the transfer has completed.
  auto finish = [this](Transfer& tr) {
    std::exception_ptr error = tr.error;
    Extent& e = *tr.extent;
    if (tr.op == IoOp::Write) {
      std::lock_guard lock(e.mutex);
      for (std::size_t k = 0; k < tr.pieces.size(); ++k) {
        const Piece& p = tr.pieces[k];
        // Torn per stripe piece: a failed piece stays torn whatever succeeds after it elsewhere,
        // until a write of its whole unit succeeds.
        const std::uint64_t unit_bytes = std::min<std::uint64_t>(
            options_.stripe_bytes, e.bytes - p.index * options_.stripe_bytes);
        if (error)
          e.torn[p.index] = true;
        else if (p.whole_start && p.bytes == unit_bytes)
          e.torn[p.index] = false;
        // A piece written from its unit's start is verifiable; anything else is not.
        const bool ok = !error && !tr.new_crcs.empty() && p.whole_start;
        e.crc_bytes[p.index] = ok ? p.bytes : 0;
        e.crcs[p.index] = ok ? tr.new_crcs[k] : 0;
      }
    } else if (!error) {
      if (tr.copy_to_user > 0) {
        std::memcpy(tr.user + tr.copy_at, tr.staging.data() + tr.copy_from, tr.copy_to_user);
        bounced_bytes_.fetch_add(tr.copy_to_user, std::memory_order_relaxed);
      }
      for (const Piece& p : tr.pieces) {
        if (!p.whole_start || tr.crc_bytes[p.index] != p.bytes) continue;  // not written so
        const std::uint32_t got = crc32c(tr.user + p.at, p.bytes);
        if (got != tr.crcs[p.index]) {
          char expected_hex[16], got_hex[16];
          std::snprintf(expected_hex, sizeof expected_hex, "%08x", tr.crcs[p.index]);
          std::snprintf(got_hex, sizeof got_hex, "%08x", got);
          error = std::make_exception_ptr(
              IoError(Errc::corrupt_data, p.file->path(), p.offset, p.bytes, 0,
                      detail::concat("checksum mismatch (CRC32C written ", expected_hex, ", read ",
                                     got_hex, ") in read")));
        }
      }
    }
    if (tr.staging.size() > 0) give_staging(std::move(tr.staging));
    IoCallback done = std::move(tr.done);
    done(error);
  };
  if (t->ops.empty()) {
    finish(*t);
    return;
  }
  t->remaining.store(t->ops.size());
  for (std::size_t i = 0; i < t->ops.size(); ++i) {
    const Transfer::Op& op = t->ops[i];
    IoRequest request{t->op, op.file, op.offset, op.bytes, op.buffer};
    auto on_done = [t, finish](std::exception_ptr error) {
      if (error) {
        std::lock_guard lock(t->mutex);
        if (!t->error) t->error = error;
      }
      if (t->remaining.fetch_sub(1) == 1) finish(*t);
    };
    try {
      engine_.submit(request, on_done);
    } catch (...) {
      // Invalid request: fail this operation and the ones not submitted.
      const std::size_t not_started = t->ops.size() - i;
      {
        std::lock_guard lock(t->mutex);
        if (!t->error) t->error = std::current_exception();
      }
      if (t->remaining.fetch_sub(not_started) == not_started) finish(*t);
      return;
    }
  }
}

std::future<void> SwapSpace::write(ExtentId id, std::uint64_t offset, const void* data,
                                   std::size_t bytes) {
  auto [callback, future] = detail::callback_with_future();
  write(id, offset, data, bytes, std::move(callback));
  return std::move(future);
}

std::future<void> SwapSpace::read(ExtentId id, std::uint64_t offset, void* data,
                                  std::size_t bytes) {
  auto [callback, future] = detail::callback_with_future();
  read(id, offset, data, bytes, std::move(callback));
  return std::move(future);
}

}  // namespace strata
