// Page-aligned buffers: alignment for O_DIRECT and huge pages, huge page backing as the policy
// asks, and the fallback to 4 KiB pages with one warning (Note [Huge pages]). The limits they
// are checked against are tested in memory_limits_test.cpp.
#include "strata/io/pages.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "io_test_util.h"
#include "strata/base/error.h"
#include "strata/io/file.h"
#include "strata/base/units.h"

namespace strata {
namespace {

using testing::count;
using testing::fill_pattern;
using testing::read_file;
using testing::TempDir;

std::string thp_enabled() {
  return read_file("/sys/kernel/mm/transparent_hugepage/enabled");
}

bool thp_usable() {
  const std::string text = thp_enabled();
  const std::string_view mode = detail::thp_mode(text);
  return mode == "madvise" || mode == "always";
}

std::size_t hugetlb_available_pages() {
  const std::string meminfo = read_file("/proc/meminfo");
  auto value = [&](const std::string& key) -> std::size_t {
    const std::size_t at = meminfo.find(key + ":");
    return at == std::string::npos ? 0 : std::stoull(meminfo.substr(at + key.size() + 1));
  };
  const std::size_t free = value("HugePages_Free"), reserved = value("HugePages_Rsvd");
  return value("Hugepagesize") == 2048 && free > reserved ? free - reserved : 0;
}

// Writes a pattern from `out` to a file with O_DIRECT (buffered where the filesystem refuses it)
// and reads it back into `in`: the bytes must survive whichever pages back the buffers.
void expect_round_trip(const PageBuffer& out, const PageBuffer& in, unsigned seed) {
  ASSERT_EQ(out.size(), in.size());
  TempDir dir;
  File file(dir.file("pages.bin"), File::Mode::Create, /*direct=*/true);
  fill_pattern(out.data(), out.size(), seed);
  ASSERT_EQ(::pwrite(file.fd(), out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
  std::memset(in.data(), 0, in.size());
  ASSERT_EQ(::pread(file.fd(), in.data(), in.size(), 0), static_cast<ssize_t>(in.size()));
  EXPECT_EQ(std::memcmp(out.data(), in.data(), in.size()), 0);
}

static_assert(mapped_bytes(1) == kPageBytes);
static_assert(mapped_bytes(kHugePageBytes - 1) == kHugePageBytes);
static_assert(mapped_bytes(kHugePageBytes + 1) == 2 * kHugePageBytes);
static_assert(mapped_bytes(3 * kHugePageBytes) == 3 * kHugePageBytes);

TEST(Pages, EveryBufferIsPageAlignedAndLargeOnesAre2MiBAligned) {
  ::testing::internal::CaptureStderr();  // a hugetlb fallback warns; not what this test is about
  for (const HugePages huge : {HugePages::Transparent, HugePages::Hugetlb, HugePages::Off}) {
    for (const std::size_t bytes :
         {std::size_t{1}, 4 * KiB, 100'000 * std::size_t{1}, 2 * MiB - 4 * KiB, 2 * MiB,
          2 * MiB + 1, 5 * MiB + 12345, 16 * MiB}) {
      for (const bool reserve_only : {false, true}) {
        auto* data = static_cast<std::byte*>(map_pages(bytes, "Host", reserve_only, huge));
        const auto address = reinterpret_cast<std::uintptr_t>(data);
        EXPECT_EQ(address % kPageBytes, 0u) << bytes << " bytes, " << to_string(huge);
        if (bytes >= kHugePageBytes) {
          EXPECT_EQ(address % kHugePageBytes, 0u) << bytes << " bytes, " << to_string(huge);
        }
        EXPECT_EQ(data[bytes / 2], std::byte{0});  // zeroed
        data[0] = std::byte{1};                    // the whole mapping is there and writable
        data[bytes - 1] = std::byte{2};
        data[mapped_bytes(bytes) - 1] = std::byte{3};
        unmap_pages(data, bytes);
      }
    }
  }
  ::testing::internal::GetCapturedStderr();
}

TEST(Pages, TouchedTransparentBufferIsBackedByHugePages) {
  if (!thp_usable()) {
    GTEST_SKIP() << "transparent huge pages are not madvise or always here: " << thp_enabled();
  }
  PageBuffer buffer(16 * MiB, /*lock=*/false, "Host", HugePages::Transparent);
  EXPECT_EQ(buffer.huge_pages(), HugePages::Transparent);
  fill_pattern(buffer.data(), buffer.size(), 3);
  const std::size_t huge = huge_page_bytes(buffer.data(), buffer.size());
  EXPECT_GT(huge, 0u) << "no huge page behind a touched, MADV_HUGEPAGE'd 16 MiB buffer";
  EXPECT_LE(huge, buffer.size());
  EXPECT_EQ(huge % kHugePageBytes, 0u);
}

TEST(Pages, ALazilyTouchedArenaTakesTransparentHugePagesWhereTouched) {
  if (!thp_usable()) {
    GTEST_SKIP() << "transparent huge pages are not madvise or always here: " << thp_enabled();
  }
  // The host backend's device arena: reserved, touched only where tensors land (direct NVMe
  // reads included), so it must not need every page at once.
  const std::size_t bytes = 64 * MiB;
  HugePages used = HugePages::Off;
  auto* arena = static_cast<std::byte*>(
      map_pages(bytes, "Device", /*reserve_only=*/true, HugePages::Transparent, &used));
  EXPECT_EQ(used, HugePages::Transparent);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(arena) % kHugePageBytes, 0u);
  EXPECT_EQ(huge_page_bytes(arena, bytes), 0u);  // nothing touched yet
  fill_pattern(arena + 8 * MiB, 4 * MiB, 7);     // two 2 MiB pages' worth
  const std::size_t huge = huge_page_bytes(arena, bytes);
  EXPECT_GT(huge, 0u);
  EXPECT_LE(huge, 4 * MiB);  // only where touched
  void* off = map_pages(bytes, "Device", /*reserve_only=*/true, HugePages::Off, &used);
  EXPECT_EQ(used, HugePages::Off);
  fill_pattern(static_cast<std::byte*>(off), 4 * MiB, 7);
  EXPECT_EQ(huge_page_bytes(off, bytes), 0u);
  unmap_pages(off, bytes);
  unmap_pages(arena, bytes);
}

TEST(Pages, OffGivesFourKiBPagesWithoutWarningAndKeepsBytes) {
  detail::reset_huge_page_warning();
  ::testing::internal::CaptureStderr();
  PageBuffer out(16 * MiB, /*lock=*/false, "Host", HugePages::Off);
  PageBuffer in(16 * MiB, /*lock=*/false, "Host", HugePages::Off);
  expect_round_trip(out, in, 5);
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.huge_pages(), HugePages::Off);
  EXPECT_EQ(huge_page_bytes(out.data(), out.size()), 0u);  // even under THP "always"
  EXPECT_EQ(huge_page_bytes(in.data(), in.size()), 0u);
  EXPECT_EQ(warnings, "");
}

TEST(Pages, HugetlbWithoutReservedPagesFallsBackWithOneWarningNamingHugePagesFree) {
  if (hugetlb_available_pages() >= 8) GTEST_SKIP() << "hugetlb pages are reserved here";
  detail::reset_huge_page_warning();
  ::testing::internal::CaptureStderr();
  PageBuffer out(4 * MiB, /*lock=*/true, "Host (pinned)", HugePages::Hugetlb);
  PageBuffer in(4 * MiB, /*lock=*/false, "Host (pinned)", HugePages::Hugetlb);
  expect_round_trip(out, in, 7);
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  // One warning for the two buffers (an mlock refusal may add its own).
  EXPECT_EQ(count(warnings, "asked for"), 1u) << warnings;
  EXPECT_NE(warnings.find("asked for hugetlb pages"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("HugePages_Free"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("vm.nr_hugepages"), std::string::npos) << warnings;
  // What was asked (the whole 4 MiB) and what is there.
  EXPECT_NE(warnings.find("hugetlb pages for 4.00 MiB but HugePages_Free has"), std::string::npos)
      << warnings;
  if (hugetlb_available_pages() == 0) {
    EXPECT_NE(warnings.find("HugePages_Free has 0 B available"), std::string::npos) << warnings;
  }
  const HugePages expected = thp_usable() ? HugePages::Transparent : HugePages::Off;
  EXPECT_EQ(out.huge_pages(), expected);
  EXPECT_EQ(in.huge_pages(), expected);
  if (expected == HugePages::Off) {
    EXPECT_EQ(huge_page_bytes(in.data(), in.size()), 0u);
  }
}

TEST(Pages, HugetlbWithReservedPagesIsBackedByThem) {
  if (hugetlb_available_pages() < 4) {
    GTEST_SKIP() << "fewer than 4 free 2 MiB hugetlb pages (sysctl vm.nr_hugepages)";
  }
  PageBuffer buffer(4 * MiB, /*lock=*/false, "Host", HugePages::Hugetlb);
  ASSERT_EQ(buffer.huge_pages(), HugePages::Hugetlb);
  fill_pattern(buffer.data(), buffer.size(), 9);
  EXPECT_EQ(huge_page_bytes(buffer.data(), buffer.size()), 4 * MiB);
}

TEST(Pages, SmallBuffersAreLeftToTheKernel) {
  detail::reset_huge_page_warning();
  ::testing::internal::CaptureStderr();
  PageBuffer small(kHugePageBytes - kPageBytes, false, "Host", HugePages::Hugetlb);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(small.huge_pages(), HugePages::Off);
}

TEST(Pages, HugePageBytesOfUnmappedOrEmptyRangeIsZero) {
  auto* data = static_cast<std::byte*>(map_pages(4 * MiB, "Host"));
  unmap_pages(data, 4 * MiB);
  EXPECT_EQ(huge_page_bytes(data, 4 * MiB), 0u);
  PageBuffer buffer(4 * MiB);
  fill_pattern(buffer.data(), buffer.size(), 1);
  EXPECT_EQ(huge_page_bytes(buffer.data(), 0), 0u);
}

TEST(HugePagePlan, TransparentFallsBackWithAWarningNamingTheThpMode) {
  const auto usable = detail::plan_huge_pages(HugePages::Transparent, 16 * MiB,
                                              "always [madvise] never\n", 0, "Host");
  EXPECT_EQ(usable.use, HugePages::Transparent);
  EXPECT_EQ(usable.warning, "");
  EXPECT_EQ(
      detail::plan_huge_pages(HugePages::Transparent, 16 * MiB, "[always] madvise never", 0, "Host")
          .use,
      HugePages::Transparent);

  const auto never = detail::plan_huge_pages(HugePages::Transparent, 16 * MiB,
                                             "always madvise [never]\n", 0, "Host (pinned)");
  EXPECT_EQ(never.use, HugePages::Off);
  EXPECT_NE(never.warning.find("Host (pinned) asked for transparent huge pages"), std::string::npos)
      << never.warning;
  EXPECT_NE(never.warning.find("THP is \"never\""), std::string::npos) << never.warning;
  EXPECT_NE(never.warning.find("4 KiB pages"), std::string::npos) << never.warning;

  const auto absent = detail::plan_huge_pages(HugePages::Transparent, 16 * MiB, "", 0, "Host");
  EXPECT_EQ(absent.use, HugePages::Off);
  EXPECT_NE(absent.warning.find("THP is unavailable"), std::string::npos) << absent.warning;
}

TEST(HugePagePlan, HugetlbNeedsFreePagesForTheWholeMapping) {
  const auto enough =
      detail::plan_huge_pages(HugePages::Hugetlb, 5 * MiB, "always [madvise] never", 6 * MiB, "H");
  EXPECT_EQ(enough.use, HugePages::Hugetlb);
  EXPECT_EQ(enough.warning, "");

  // 5 MiB occupies three 2 MiB pages.
  const auto short_thp =
      detail::plan_huge_pages(HugePages::Hugetlb, 5 * MiB, "always [madvise] never", 4 * MiB, "H");
  EXPECT_EQ(short_thp.use, HugePages::Transparent);
  EXPECT_NE(short_thp.warning.find("HugePages_Free"), std::string::npos) << short_thp.warning;
  EXPECT_NE(short_thp.warning.find("using transparent huge pages"), std::string::npos)
      << short_thp.warning;

  const auto neither =
      detail::plan_huge_pages(HugePages::Hugetlb, 5 * MiB, "always madvise [never]", 0, "H");
  EXPECT_EQ(neither.use, HugePages::Off);
  EXPECT_NE(neither.warning.find("HugePages_Free"), std::string::npos) << neither.warning;
  EXPECT_NE(neither.warning.find("THP is \"never\""), std::string::npos) << neither.warning;
  EXPECT_NE(neither.warning.find("4 KiB pages"), std::string::npos) << neither.warning;
}

TEST(HugePagePlan, OffAndSmallRequestsNeverWarn) {
  for (const HugePages huge : {HugePages::Transparent, HugePages::Hugetlb, HugePages::Off}) {
    const auto small = detail::plan_huge_pages(huge, kHugePageBytes - 1, "", 0, "H");
    EXPECT_EQ(small.use, HugePages::Off);
    EXPECT_EQ(small.warning, "");
  }
  const auto off = detail::plan_huge_pages(HugePages::Off, 16 * MiB, "[always]", 16 * MiB, "H");
  EXPECT_EQ(off.use, HugePages::Off);
  EXPECT_EQ(off.warning, "");
}

TEST(HugePagePlan, ParsesPolicyNames) {
  for (const HugePages huge : {HugePages::Transparent, HugePages::Hugetlb, HugePages::Off})
    EXPECT_EQ(parse_huge_pages(to_string(huge)), huge);
  EXPECT_THROW(parse_huge_pages("yes"), Error);
  EXPECT_EQ(detail::thp_mode("always [madvise] never\n"), "madvise");
  EXPECT_EQ(detail::thp_mode(""), "");
}

}  // namespace
}  // namespace strata
