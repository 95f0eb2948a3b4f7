#include "strata/io/range_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <vector>

#include "strata/base/error.h"
#include "strata/base/units.h"

namespace strata {
namespace {

TEST(RangeAllocator, FreshRangeIsOneFreeBlock) {
  RangeAllocator r("test", 1 * MiB, 256);
  EXPECT_EQ(r.free_blocks(), (std::map<std::uint64_t, std::uint64_t>{{0, 1 * MiB}}));
  const RangeStats s = r.stats();
  EXPECT_EQ(s.free_bytes, 1 * MiB);
  EXPECT_EQ(s.largest_free_bytes, 1 * MiB);
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.0);
}

TEST(RangeAllocator, RoundsSizesAndKeepsAlignment) {
  RangeAllocator r("test", 1 * MiB, 256);
  const auto a = r.allocate(1);
  EXPECT_EQ(r.block_size(a), 256u);
  const auto b = r.allocate(100, 64 * KiB);
  EXPECT_EQ(b % (64 * KiB), 0u);
  EXPECT_EQ(r.block_size(b), 256u);
  // The gap left in front of the aligned block stays free and usable.
  const auto c = r.allocate(512);
  EXPECT_EQ(c, 256u);
}

TEST(RangeAllocator, BestFitPicksSmallestHoleThenLowestAddress) {
  RangeAllocator r("test", 64 * KiB, 256);
  std::vector<std::uint64_t> at;
  for (std::uint64_t bytes : {4096, 256, 2048, 256, 2048, 256, 1024, 256})
    at.push_back(r.allocate(bytes));
  r.deallocate(at[0]);                 // hole of 4096 at 0
  r.deallocate(at[2]);                 // hole of 2048
  r.deallocate(at[4]);                 // hole of 2048 at a higher address
  r.deallocate(at[6]);                 // hole of 1024
  EXPECT_EQ(r.allocate(1500), at[2]);  // smallest hole that fits, lowest address of the two
  EXPECT_EQ(r.allocate(1500), at[4]);
  EXPECT_EQ(r.allocate(1000), at[6]);
  EXPECT_EQ(r.allocate(3000), at[0]);
}

TEST(RangeAllocator, FreeCoalescesWithBothNeighbours) {
  RangeAllocator r("test", 16 * KiB, 256);
  const auto a = r.allocate(4 * KiB);
  const auto b = r.allocate(4 * KiB);
  const auto c = r.allocate(4 * KiB);
  r.deallocate(a);
  r.deallocate(c);
  EXPECT_EQ(r.free_blocks().size(), 2u);
  r.deallocate(b);
  EXPECT_EQ(r.free_blocks(), (std::map<std::uint64_t, std::uint64_t>{{0, 16 * KiB}}));
}

TEST(RangeAllocator, OutOfMemoryNamesRangeAskedFreeAndLargest) {
  RangeAllocator r("Device", 16 * KiB, 256);
  const auto a = r.allocate(4 * KiB);
  r.allocate(4 * KiB);
  const auto c = r.allocate(4 * KiB);
  r.allocate(4 * KiB);
  r.deallocate(a);
  r.deallocate(c);  // 8 KiB free in two 4 KiB holes
  try {
    r.allocate(6 * KiB);
    FAIL() << "allocated 6 KiB with no 6 KiB hole";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.code(), Errc::out_of_memory);
    EXPECT_EQ(e.tier(), "Device");
    EXPECT_EQ(e.requested_bytes(), 6 * KiB);
    EXPECT_EQ(e.free_bytes(), 8 * KiB);
    EXPECT_EQ(e.largest_free_bytes(), 4 * KiB);
    const std::string what = e.what();
    EXPECT_NE(what.find("Device"), std::string::npos) << what;
    EXPECT_NE(what.find("6144"), std::string::npos) << what;
    EXPECT_NE(what.find("8192"), std::string::npos) << what;
  }
  EXPECT_EQ(r.stats().failed_allocations, 1u);
  EXPECT_DOUBLE_EQ(r.stats().fragmentation, 0.5);
}

TEST(RangeAllocator, RejectsMisuse) {
  RangeAllocator r("test", 16 * KiB, 256);
  EXPECT_THROW(r.allocate(0), Error);
  EXPECT_THROW(r.allocate(256, 3), Error);
  EXPECT_THROW(r.deallocate(512), Error);
  const auto a = r.allocate(256);
  r.deallocate(a);
  EXPECT_THROW(r.deallocate(a), Error);  // double free
  EXPECT_THROW(RangeAllocator("bad", 1000, 256), Error);
  EXPECT_THROW(RangeAllocator("bad", 1024, 100), Error);
}

TEST(RangeAllocator, TracksPeakAndReservedHighWater) {
  RangeAllocator r("test", 64 * KiB, 256);
  const auto a = r.allocate(8 * KiB);
  const auto b = r.allocate(8 * KiB);
  r.deallocate(a);
  RangeStats s = r.stats();
  EXPECT_EQ(s.current_bytes, 8 * KiB);
  EXPECT_EQ(s.peak_bytes, 16 * KiB);
  EXPECT_EQ(s.reserved_bytes, 16 * KiB);  // b still ends at 16 KiB
  r.deallocate(b);
  s = r.stats();
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(s.peak_reserved_bytes, 16 * KiB);
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_EQ(s.deallocations, 2u);
}

TEST(RangeAllocator, AllocateAtCarvesExactlyThatRange) {
  RangeAllocator r("test", 64 * KiB, 256);
  const auto a = r.allocate(4 * KiB);
  const auto b = r.allocate(8 * KiB);
  r.deallocate(a);
  EXPECT_FALSE(r.allocate_at(0, 8 * KiB));  // the hole before b is only 4 KiB
  r.deallocate(b);
  // Compaction's move: b slides down to 0 over its old place.
  EXPECT_TRUE(r.allocate_at(0, 8 * KiB));
  EXPECT_EQ(r.block_size(0), 8 * KiB);
  EXPECT_EQ(r.free_blocks(), (std::map<std::uint64_t, std::uint64_t>{{8 * KiB, 56 * KiB}}));
  EXPECT_TRUE(r.allocate_at(32 * KiB, 1000));
  EXPECT_EQ(r.free_blocks(), (std::map<std::uint64_t, std::uint64_t>{
                                 {8 * KiB, 24 * KiB}, {32 * KiB + 1024, 32 * KiB - 1024}}));
  EXPECT_FALSE(r.allocate_at(4 * KiB, 256));  // inside a live block
}

// Reference model: the live blocks in a map; free gaps derived from it; best fit computed the
// slow, obvious way. The allocator must choose exactly the same offsets.
class ReferenceModel {
 public:
  ReferenceModel(std::uint64_t capacity, std::uint64_t granularity)
      : capacity_(capacity), granularity_(granularity) {}

  std::vector<std::pair<std::uint64_t, std::uint64_t>> gaps() const {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;  // (offset, bytes)
    std::uint64_t cursor = 0;
    for (const auto& [offset, bytes] : live_) {
      if (offset > cursor) out.emplace_back(cursor, offset - cursor);
      cursor = offset + bytes;
    }
    if (cursor < capacity_) out.emplace_back(cursor, capacity_ - cursor);
    return out;
  }
  std::optional<std::uint64_t> best_fit(std::uint64_t bytes, std::uint64_t alignment) const {
    const std::uint64_t size = align_up(bytes, granularity_);
    alignment = std::max(alignment, granularity_);
    auto g = gaps();
    std::sort(g.begin(), g.end(), [](auto x, auto y) {
      return x.second != y.second ? x.second < y.second : x.first < y.first;
    });
    for (const auto& [offset, gap] : g) {
      const std::uint64_t start = align_up(offset, alignment);
      if (gap >= size && start - offset + size <= gap) return start;
    }
    return std::nullopt;
  }
  void add(std::uint64_t offset, std::uint64_t bytes) {
    live_[offset] = align_up(bytes, granularity_);
  }
  void remove(std::uint64_t offset) { live_.erase(offset); }
  std::uint64_t used() const {
    std::uint64_t sum = 0;
    for (const auto& [o, b] : live_)
      sum += b;
    return sum;
  }
  const std::map<std::uint64_t, std::uint64_t>& live() const { return live_; }

 private:
  std::uint64_t capacity_, granularity_;
  std::map<std::uint64_t, std::uint64_t> live_;
};

class RangeAllocatorProperty : public ::testing::TestWithParam<std::uint64_t> {};

TEST_P(RangeAllocatorProperty, RandomSequencesMatchTheReferenceModel) {
  constexpr std::uint64_t kCapacity = 4 * MiB, kGranularity = 256;
  std::mt19937_64 rng(GetParam());
  RangeAllocator r("prop", kCapacity, kGranularity);
  ReferenceModel model(kCapacity, kGranularity);
  std::vector<std::uint64_t> live;
  std::uniform_int_distribution<int> coin(0, 99);
  std::uniform_int_distribution<std::uint64_t> log_size(0, 18);
  const std::uint64_t aligns[] = {0, 256, 512, 4096, 64 * KiB};
  for (int op = 0; op < 4000; ++op) {
    if (live.empty() || coin(rng) < 55) {
      const std::uint64_t bytes = 1 + rng() % (std::uint64_t{1} << log_size(rng));
      const std::uint64_t alignment = aligns[rng() % 5];
      const auto expected = model.best_fit(bytes, alignment);
      if (expected) {
        const std::uint64_t got = r.allocate(bytes, alignment);
        ASSERT_EQ(got, *expected) << "op " << op << " bytes " << bytes << " align " << alignment;
        ASSERT_EQ(got % std::max(alignment, kGranularity), 0u);
        model.add(got, bytes);
        live.push_back(got);
      } else {
        const std::uint64_t free_before = r.stats().free_bytes;
        try {
          r.allocate(bytes, alignment);
          FAIL() << "allocated where the model has no room";
        } catch (const OutOfMemoryError& e) {
          EXPECT_EQ(e.free_bytes(), free_before);
          EXPECT_EQ(e.requested_bytes(), align_up(bytes, kGranularity));
        }
      }
    } else {
      const std::size_t i = rng() % live.size();
      r.deallocate(live[i]);
      model.remove(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
    // Invariants: stats agree with the model; free blocks are exactly the model's gaps, so
    // nothing overlaps and every free neighbour pair has been merged.
    const RangeStats s = r.stats();
    ASSERT_EQ(s.current_bytes, model.used());
    ASSERT_EQ(s.live_blocks, model.live().size());
    const auto gaps = model.gaps();
    const auto blocks = r.free_blocks();
    ASSERT_EQ(blocks.size(), gaps.size());
    std::uint64_t largest = 0;
    for (const auto& [offset, bytes] : gaps) {
      ASSERT_EQ(blocks.at(offset), bytes);
      largest = std::max(largest, bytes);
    }
    ASSERT_EQ(s.largest_free_bytes, largest);
  }
  for (std::uint64_t offset : live)
    r.deallocate(offset);
  EXPECT_EQ(r.free_blocks(), (std::map<std::uint64_t, std::uint64_t>{{0, kCapacity}}));
  EXPECT_EQ(r.stats().current_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, RangeAllocatorProperty, ::testing::Values(1, 2, 3, 17, 99, 2026));

}  // namespace
}  // namespace strata
