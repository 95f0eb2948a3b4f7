// RangeAllocator: hands out aligned sub-ranges [offset, offset + bytes) of a fixed range
// [0, capacity). It knows nothing of what the range is: strata uses it for the device
// reservation, for the pinned host slab and for the extents of NVMe swap files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory_resource>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

namespace strata {

/// Plain statistics of one RangeAllocator (bytes unless the name says otherwise).
struct RangeStats {
  std::uint64_t capacity_bytes = 0;       ///< size of the managed range
  std::uint64_t current_bytes = 0;        ///< bytes in live blocks (after rounding)
  std::uint64_t peak_bytes = 0;           ///< high-water mark of current_bytes
  std::uint64_t reserved_bytes = 0;       ///< end of the highest live block: the part of the
                                          ///< range in use, holes included
  std::uint64_t peak_reserved_bytes = 0;  ///< high-water mark of reserved_bytes
  std::uint64_t free_bytes = 0;           ///< capacity_bytes - current_bytes
  std::uint64_t largest_free_bytes = 0;   ///< the largest single free block
  double fragmentation = 0.0;             ///< 1 - largest_free / free (0 when nothing is free)
  std::uint64_t live_blocks = 0;
  std::uint64_t allocations = 0;         ///< successful allocate() calls, ever
  std::uint64_t deallocations = 0;       ///< deallocate() calls, ever
  std::uint64_t failed_allocations = 0;  ///< allocate() calls that found no room
};

/// Best-fit, address-ordered, coalescing allocator of offsets with alignment.
///
/// Contract:
/// - Every block starts at a multiple of its alignment and its size is rounded up to a multiple
///   of `granularity` (a power of two, at least 1), so neighbours never share a granule.
/// - Best fit: the smallest free block that can hold the request; among equals, the lowest
///   address. Freed blocks merge with free neighbours at once, so freeing everything leaves one
///   block of `capacity` bytes.
/// - O(log n) per operation in the number of free blocks; no allocation touches the range.
/// - Not thread-safe: the owner serialises calls (the memory pools in runtime/ hold a mutex).
/// - allocate() throws strata::OutOfMemoryError naming `name`, the bytes asked (after
///   rounding), the free bytes and the largest free block. deallocate() of an offset that is not
///   a live block throws strata::Error(invalid_argument).
class RangeAllocator {
 public:
  /// @param name        what the range is, for errors ("Device", "Host (pinned)", "Nvme swap").
  /// @param capacity    bytes in the range; a multiple of granularity.
  /// @param granularity smallest unit and default alignment (power of two).
  RangeAllocator(std::string name, std::uint64_t capacity, std::uint64_t granularity = 256);
  RangeAllocator(const RangeAllocator&) = delete;
  RangeAllocator& operator=(const RangeAllocator&) = delete;
  ~RangeAllocator();

  /// Reserves `bytes` (> 0) at an offset aligned to max(alignment, granularity).
  std::uint64_t allocate(std::uint64_t bytes, std::uint64_t alignment = 0);
  /// As allocate(), but returns nullopt instead of throwing when there is no room.
  std::optional<std::uint64_t> try_allocate(std::uint64_t bytes, std::uint64_t alignment = 0);
  /// Reserves exactly [offset, offset + bytes) (rounded up to the granularity), which must lie
  /// inside one free block; false when it does not. For compaction, which slides a block down
  /// into the hole before it.
  bool allocate_at(std::uint64_t offset, std::uint64_t bytes);
  /// Returns a block to the free list; it merges with free neighbours.
  void deallocate(std::uint64_t offset);
  /// Size (after rounding) of the live block at `offset`, or 0 if there is none.
  [[nodiscard]] std::uint64_t block_size(std::uint64_t offset) const noexcept;

  [[nodiscard]] RangeStats stats() const noexcept;
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] std::uint64_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::uint64_t granularity() const noexcept { return granularity_; }
  [[nodiscard]] std::uint64_t largest_free() const noexcept;
  /// Free blocks in address order, as (offset, bytes); for tests and for compaction.
  [[nodiscard]] std::map<std::uint64_t, std::uint64_t> free_blocks() const;

 private:
  void insert_free(std::uint64_t offset, std::uint64_t bytes);
  void erase_free(std::map<std::uint64_t, std::uint64_t>::iterator it);
  void add_live(std::uint64_t offset, std::uint64_t size);
  [[nodiscard]] std::uint64_t reserved_end() const noexcept;

  std::string name_;
  std::uint64_t capacity_;
  std::uint64_t granularity_;
  // Note [RangeAllocator node pool]: the three indexes allocate a node per block; an
  // unsynchronised pool resource recycles those nodes, so a steady state allocates nothing
  // from the system and an operation costs a few tree steps.
  std::pmr::unsynchronized_pool_resource pool_;
  std::pmr::map<std::uint64_t, std::uint64_t> free_by_offset_;           // offset -> bytes
  std::pmr::set<std::pair<std::uint64_t, std::uint64_t>> free_by_size_;  // (bytes, offset)
  std::pmr::unordered_map<std::uint64_t, std::uint64_t> live_;           // offset -> bytes
  RangeStats stats_;
};

}  // namespace strata
