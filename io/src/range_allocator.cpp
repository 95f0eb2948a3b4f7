#include "strata/io/range_allocator.h"

#include <algorithm>
#include <iterator>

#include "strata/base/error.h"
#include "strata/base/units.h"

namespace strata {

RangeAllocator::RangeAllocator(std::string name, std::uint64_t capacity, std::uint64_t granularity)
    : name_(std::move(name)),
      capacity_(capacity),
      granularity_(granularity),
      free_by_offset_(&pool_),
      free_by_size_(&pool_),
      live_(&pool_) {
  STRATA_EXPECTS(is_pow2(granularity_), name_, ": granularity ", granularity_,
                 " is not a power of two");
  STRATA_EXPECTS(capacity_ % granularity_ == 0, name_, ": capacity ", capacity_,
                 " bytes is not a multiple of the granularity ", granularity_);
  stats_.capacity_bytes = capacity_;
  if (capacity_ > 0) insert_free(0, capacity_);
}

RangeAllocator::~RangeAllocator() = default;

void RangeAllocator::insert_free(std::uint64_t offset, std::uint64_t bytes) {
  free_by_offset_.emplace(offset, bytes);
  free_by_size_.emplace(bytes, offset);
}

void RangeAllocator::erase_free(std::map<std::uint64_t, std::uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

void RangeAllocator::add_live(std::uint64_t offset, std::uint64_t size) {
  live_.emplace(offset, size);
  stats_.current_bytes += size;
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.current_bytes);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, offset + size);
  ++stats_.allocations;
}

std::uint64_t RangeAllocator::largest_free() const noexcept {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

std::uint64_t RangeAllocator::reserved_end() const noexcept {
  if (free_by_offset_.empty()) return capacity_;
  const auto& [offset, bytes] = *free_by_offset_.rbegin();
  return offset + bytes == capacity_ ? offset : capacity_;
}

std::optional<std::uint64_t> RangeAllocator::try_allocate(std::uint64_t bytes,
                                                          std::uint64_t alignment) {
  STRATA_EXPECTS(bytes > 0, name_, ": cannot allocate 0 bytes");
  if (alignment == 0) alignment = granularity_;
  STRATA_EXPECTS(is_pow2(alignment), name_, ": alignment ", alignment, " is not a power of two");
  alignment = std::max(alignment, granularity_);
  if (bytes > capacity_) {
    ++stats_.failed_allocations;
    return std::nullopt;
  }
  const std::uint64_t size = align_up(bytes, granularity_);

  // Smallest block that fits; the set orders equal sizes by address. With alignment no larger
  // than the granularity, the first candidate always fits.
  for (auto it = free_by_size_.lower_bound({size, 0}); it != free_by_size_.end(); ++it) {
    const auto [block_bytes, block_offset] = *it;
    const std::uint64_t start = align_up(block_offset, alignment);
    const std::uint64_t head = start - block_offset;
    if (head + size > block_bytes) continue;
    const std::uint64_t tail = block_bytes - head - size;
    free_by_size_.erase(it);
    free_by_offset_.erase(block_offset);
    if (head > 0) insert_free(block_offset, head);
    if (tail > 0) insert_free(start + size, tail);
    add_live(start, size);
    return start;
  }
  ++stats_.failed_allocations;
  return std::nullopt;
}

bool RangeAllocator::allocate_at(std::uint64_t offset, std::uint64_t bytes) {
  STRATA_EXPECTS(bytes > 0, name_, ": cannot allocate 0 bytes");
  STRATA_EXPECTS(offset % granularity_ == 0, name_, ": offset ", offset,
                 " is not a multiple of the granularity ", granularity_);
  const std::uint64_t size = align_up(bytes, granularity_);
  auto it = free_by_offset_.upper_bound(offset);
  if (it == free_by_offset_.begin()) return false;
  --it;
  const auto [block_offset, block_bytes] = *it;
  if (offset + size > block_offset + block_bytes) return false;
  erase_free(it);
  if (offset > block_offset) insert_free(block_offset, offset - block_offset);
  if (block_offset + block_bytes > offset + size)
    insert_free(offset + size, block_offset + block_bytes - offset - size);
  add_live(offset, size);
  return true;
}

std::uint64_t RangeAllocator::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  if (auto offset = try_allocate(bytes, alignment)) return *offset;
  const std::uint64_t free = capacity_ - stats_.current_bytes;
  throw OutOfMemoryError(
      name_, align_up(bytes, granularity_), free, largest_free(),
      detail::concat("capacity ", capacity_, " bytes, ", live_.size(), " live blocks"));
}

void RangeAllocator::deallocate(std::uint64_t offset) {
  const auto live = live_.find(offset);
  STRATA_EXPECTS(live != live_.end(), name_, ": deallocate of offset ", offset,
                 " which is not a live block");
  std::uint64_t start = offset;
  std::uint64_t size = live->second;
  live_.erase(live);
  stats_.current_bytes -= size;
  ++stats_.deallocations;

  // Merge with the free neighbours on both sides.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    erase_free(next);
  }
  insert_free(start, size);
}

std::uint64_t RangeAllocator::block_size(std::uint64_t offset) const noexcept {
  const auto it = live_.find(offset);
  return it == live_.end() ? 0 : it->second;
}

RangeStats RangeAllocator::stats() const noexcept {
  RangeStats s = stats_;
  s.free_bytes = capacity_ - s.current_bytes;
  s.largest_free_bytes = largest_free();
  s.fragmentation = s.free_bytes == 0 ? 0.0
                                      : 1.0 - static_cast<double>(s.largest_free_bytes) /
                                                  static_cast<double>(s.free_bytes);
  s.reserved_bytes = reserved_end();
  s.live_blocks = live_.size();
  return s;
}

std::map<std::uint64_t, std::uint64_t> RangeAllocator::free_blocks() const {
  return {free_by_offset_.begin(), free_by_offset_.end()};
}

}  // namespace strata
