// SwapSpace: the NVMe tier's storage. Extents of preallocated swap files striped over one or more
// directories (one per drive), plus read-only extents of existing files (model weights).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/base/ids.h"
#include "strata/base/tunables.h"
#include "strata/io/file.h"
#include "strata/io/io_engine.h"
#include "strata/io/pages.h"
#include "strata/io/range_allocator.h"

namespace strata {

struct SwapOptions {
  std::vector<std::string> paths;    ///< directories, one per drive (nvme.paths)
  std::uint64_t capacity_bytes = 0;  ///< swap bytes over all paths (nvme.capacity)
  std::uint64_t stripe_bytes = tunables::kStripeBytes;  ///< RAID-0 stripe unit, multiple of 4 KiB
  bool checksums = true;    ///< CRC32C per written piece, verified on read
  bool keep_files = false;  ///< leave the swap files behind on destruction
  bool direct = true;       ///< O_DIRECT where the filesystem allows

  /// Throws strata::Error (invalid_argument) naming the first bad key.
  void validate() const;
};

/// One contiguous piece of an extent inside one file.
struct ExtentPiece {
  std::string path;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

/// Contract:
/// - Swap files are created and preallocated (fallocate) at construction, one per path, and
///   removed at destruction unless keep_files. A missing or read-only directory, or a disk too
///   small for the capacity, is an error naming the path.
/// - allocate() gives an extent of logical space (RangeAllocator, best fit), stripe-aligned; its
///   bytes are striped over the paths in `stripe_bytes` units, so N drives give N drives' rate.
///   One smaller than a stripe unit lies inside one, aligned to the smallest power of two that
///   holds it (Note [Small extents]): small extents share stripes.
///   No room is an OutOfMemoryError for tier "Nvme".
/// - map_file() makes a read-only extent of an existing file at any offset; it is read as its
///   page-aligned superset with O_DIRECT and handed over at the right offset. It is never
///   written.
/// - read()/write() take any buffer and size (up to the extent's bytes); aligned buffers and
///   4 KiB multiples go straight to the engine, the rest through page-aligned staging.
/// - With checksums on, a read of a piece whose CRC32C differs from the one written fails with
///   Errc::corrupt_data naming the file, offset and length; wrong bytes are never handed over as
///   good. A write that fails (EIO, ENOSPC) reports an IoError and marks the stripe pieces it
///   covered torn: later reads of them fail instead of returning half-written data, whatever
///   writes of other pieces succeed after it, until a write of a whole torn piece succeeds.
///   The caller still has its source.
/// - Thread-safe. Callbacks run on an engine thread.
class SwapSpace {
 public:
  SwapSpace(SwapOptions options, IoEngine& engine);
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;
  ~SwapSpace();

  ExtentId allocate(std::uint64_t bytes);
  /// The logical alignment allocate() gives an extent of `bytes` (Note [Small extents]).
  [[nodiscard]] std::uint64_t alignment_for(std::uint64_t bytes) const noexcept;
  /// A read-only extent: `bytes` at `offset` of the file at `path`.
  ExtentId map_file(const std::string& path, std::uint64_t offset, std::uint64_t bytes);
  /// Frees a swap extent's space, or forgets a mapped one. No I/O on it may be pending.
  void release(ExtentId id);

  /// Writes `bytes` at `offset` (a multiple of 4 KiB) of a swap extent.
  void write(ExtentId id, std::uint64_t offset, const void* data, std::size_t bytes,
             IoCallback done);
  /// Reads `bytes` at `offset` of an extent (swap: a multiple of 4 KiB; mapped: any).
  void read(ExtentId id, std::uint64_t offset, void* data, std::size_t bytes, IoCallback done);
  /// The same, completing a future (the arguments in the same order).
  std::future<void> write(ExtentId id, std::uint64_t offset, const void* data, std::size_t bytes);
  std::future<void> read(ExtentId id, std::uint64_t offset, void* data, std::size_t bytes);

  [[nodiscard]] std::uint64_t extent_bytes(ExtentId id) const;
  /// Where an extent's bytes live, in order (for errors, tests and tools).
  [[nodiscard]] std::vector<ExtentPiece> pieces(ExtentId id) const;
  [[nodiscard]] RangeStats stats() const;
  /// Bytes copied through page-aligned staging, ever: what an unaligned buffer or a mapped
  /// tensor that does not start on a page of its file costs (one memcpy on the I/O thread).
  [[nodiscard]] std::uint64_t bounced_bytes() const noexcept {
    return bounced_bytes_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] const std::vector<std::string>& swap_files() const noexcept { return file_paths_; }
  [[nodiscard]] const SwapOptions& options() const noexcept { return options_; }
  [[nodiscard]] IoEngine& engine() noexcept { return engine_; }

 private:
  struct Piece {
    const File* file;
    std::uint64_t offset;  ///< in the file
    std::uint64_t bytes;   ///< of the transfer's bytes in this piece
    std::uint64_t at;      ///< position of the piece in the transfer
    std::uint64_t index;   ///< stripe unit of the extent (checksum slot)
    bool whole_start;      ///< the piece starts at its stripe unit's start
  };
  struct Extent;
  struct MappedFile;
  struct Transfer;

  std::vector<Piece> layout(const Extent& e, std::uint64_t from, std::uint64_t bytes) const;
  void add_ops(struct Transfer& t, const Extent& e, std::uint64_t offset, std::size_t bytes);
  static std::shared_ptr<Transfer> make_transfer(IoOp op, std::shared_ptr<Extent> e, void* data,
                                                 std::size_t bytes, IoCallback done);
  std::shared_ptr<Extent> find(ExtentId id) const;
  void start(std::shared_ptr<Transfer> t);
  /// Page-aligned staging for unaligned transfers, reused: a fresh mapping per transfer would
  /// cost a page fault per page. At most kStagingPoolBytes are kept.
  PageBuffer take_staging(std::size_t bytes);
  void give_staging(PageBuffer buffer);
  static constexpr std::size_t kStagingPoolBytes = tunables::kStagingPoolBytes;
  std::atomic<std::uint64_t> bounced_bytes_{0};

  SwapOptions options_;
  IoEngine& engine_;
  std::vector<File> files_;
  std::vector<std::string> file_paths_;
  mutable std::mutex mutex_;
  RangeAllocator space_;
  ExtentId next_id_ = 1;
  std::unordered_map<ExtentId, std::shared_ptr<Extent>> extents_;
  std::unordered_map<std::string, std::shared_ptr<MappedFile>> mapped_;
  std::mutex staging_mutex_;
  std::vector<PageBuffer> staging_pool_;
  std::size_t staging_pooled_bytes_ = 0;
};

}  // namespace strata
