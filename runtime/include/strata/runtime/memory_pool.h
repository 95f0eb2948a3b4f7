// MemoryPool: a thread-safe RangeAllocator over one contiguous block of memory (the device
// reservation or the pinned host slab), handing out pointers instead of offsets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "strata/io/range_allocator.h"

namespace strata {

/// Pool statistics: the range allocator's, under the pool's name.
using PoolStats = RangeStats;

/// Sub-allocates [base, base + capacity) with a RangeAllocator.
///
/// Thread-safe (one mutex; an allocation is a few tree steps). The pool never dereferences
/// `base`: it may be device memory. Pointers are aligned to max(alignment, granularity) relative
/// to `base`, which must itself be aligned to the largest alignment asked for (the backends give
/// page-aligned bases). allocate() throws OutOfMemoryError naming the tier; deallocate() of a
/// pointer the pool did not hand out throws strata::Error(invalid_argument).
class MemoryPool {
 public:
  MemoryPool(std::string tier_name, void* base, std::size_t capacity_bytes,
             std::size_t granularity = 256);
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment = 0);
  void* try_allocate(std::size_t bytes, std::size_t alignment = 0) noexcept;
  void deallocate(void* ptr);
  /// Reserves exactly [ptr, ptr + bytes) if it lies in one free block (compaction).
  bool allocate_at(void* ptr, std::size_t bytes);
  /// Free blocks in address order as (pointer, bytes).
  [[nodiscard]] std::vector<std::pair<std::byte*, std::size_t>> free_blocks() const;
  [[nodiscard]] bool contains(const void* ptr) const noexcept;
  [[nodiscard]] PoolStats stats() const;
  [[nodiscard]] void* base() const noexcept { return base_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

 private:
  std::byte* base_;
  std::size_t capacity_;
  mutable std::mutex mutex_;
  RangeAllocator ranges_;
};

}  // namespace strata
