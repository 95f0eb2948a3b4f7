#include "strata/runtime/memory_pool.h"

#include "strata/base/error.h"
#include "strata/base/units.h"

namespace strata {

MemoryPool::MemoryPool(std::string tier_name, void* base, std::size_t capacity_bytes,
                       std::size_t granularity)
    : base_(static_cast<std::byte*>(base)),
      capacity_(capacity_bytes),
      ranges_(std::move(tier_name), capacity_bytes / granularity * granularity, granularity) {}

void* MemoryPool::allocate(std::size_t bytes, std::size_t alignment) {
  std::lock_guard lock(mutex_);
  return base_ + ranges_.allocate(bytes, alignment);
}

void* MemoryPool::try_allocate(std::size_t bytes, std::size_t alignment) noexcept {
  try {
    std::lock_guard lock(mutex_);
    const auto offset = ranges_.try_allocate(bytes, alignment);
    return offset ? base_ + *offset : nullptr;
  } catch (...) {
    return nullptr;
  }
}

void MemoryPool::deallocate(void* ptr) {
  STRATA_EXPECTS(contains(ptr), ranges_.name(), ": deallocate of pointer ", ptr,
                 " outside the pool [", static_cast<void*>(base_), ", +", capacity_, ")");
  std::lock_guard lock(mutex_);
  ranges_.deallocate(static_cast<std::uint64_t>(static_cast<std::byte*>(ptr) - base_));
}

bool MemoryPool::allocate_at(void* ptr, std::size_t bytes) {
  STRATA_EXPECTS(contains(ptr), ranges_.name(), ": allocate_at outside the pool");
  std::lock_guard lock(mutex_);
  return ranges_.allocate_at(static_cast<std::uint64_t>(static_cast<std::byte*>(ptr) - base_),
                             bytes);
}

std::vector<std::pair<std::byte*, std::size_t>> MemoryPool::free_blocks() const {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<std::byte*, std::size_t>> out;
  for (const auto& [offset, bytes] : ranges_.free_blocks())
    out.emplace_back(base_ + offset, bytes);
  return out;
}

bool MemoryPool::contains(const void* ptr) const noexcept {
  const auto* p = static_cast<const std::byte*>(ptr);
  return p >= base_ && p < base_ + capacity_;
}

PoolStats MemoryPool::stats() const {
  std::lock_guard lock(mutex_);
  return ranges_.stats();
}

}  // namespace strata
