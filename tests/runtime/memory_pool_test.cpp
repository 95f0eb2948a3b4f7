#include "strata/runtime/memory_pool.h"

#include <gtest/gtest.h>

#include <vector>

#include "strata/base/error.h"
#include "strata/base/units.h"

namespace strata {
namespace {

TEST(MemoryPool, HandsOutPointersInsideItsBlock) {
  std::vector<std::byte> block(64 * KiB);
  MemoryPool pool("Host (pinned)", block.data(), block.size(), 256);
  void* a = pool.allocate(1000);
  void* b = pool.allocate(1000);
  EXPECT_TRUE(pool.contains(a));
  EXPECT_TRUE(pool.contains(b));
  EXPECT_EQ(static_cast<std::byte*>(b) - static_cast<std::byte*>(a), 1024);
  pool.deallocate(a);
  pool.deallocate(b);
  EXPECT_EQ(pool.stats().current_bytes, 0u);
}

TEST(MemoryPool, OutOfMemoryNamesTheTier) {
  std::vector<std::byte> block(4 * KiB);
  MemoryPool pool("Host (pinned)", block.data(), block.size(), 256);
  try {
    pool.allocate(8 * KiB);
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), "Host (pinned)");
    EXPECT_EQ(e.requested_bytes(), 8 * KiB);
    EXPECT_EQ(e.free_bytes(), 4 * KiB);
  }
  EXPECT_EQ(pool.try_allocate(8 * KiB), nullptr);
}

TEST(MemoryPool, RejectsForeignPointers) {
  std::vector<std::byte> block(4 * KiB);
  MemoryPool pool("Device", block.data(), block.size(), 256);
  int elsewhere = 0;
  EXPECT_THROW(pool.deallocate(&elsewhere), Error);
  EXPECT_THROW(pool.deallocate(block.data() + 512), Error);  // inside, but never handed out
}

}  // namespace
}  // namespace strata
