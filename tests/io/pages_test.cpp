// Page-aligned buffers: alignment for O_DIRECT and huge pages, huge page backing as the policy
// asks, and the fallback to 4 KiB pages with one warning (Note [Huge pages]); memory limits
// (RLIMIT_MEMLOCK, memory cgroups) as warnings and errors naming what was asked and what is
// there, never a crash (Note [Memory limits]).
#include "strata/io/pages.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "io_test_util.h"
#include "strata/io/error.h"
#include "strata/io/file.h"
#include "strata/io/units.h"

namespace strata {
namespace {

using testing::fill_pattern;
using testing::TempDir;

std::string read_text(const char* path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string thp_enabled() {
  return read_text("/sys/kernel/mm/transparent_hugepage/enabled");
}

bool thp_usable() {
  const std::string text = thp_enabled();
  const std::string_view mode = detail::thp_mode(text);
  return mode == "madvise" || mode == "always";
}

std::size_t hugetlb_available_pages() {
  const std::string meminfo = read_text("/proc/meminfo");
  auto value = [&](const std::string& key) -> std::size_t {
    const std::size_t at = meminfo.find(key + ":");
    return at == std::string::npos ? 0 : std::stoull(meminfo.substr(at + key.size() + 1));
  };
  const std::size_t free = value("HugePages_Free"), reserved = value("HugePages_Rsvd");
  return value("Hugepagesize") == 2048 && free > reserved ? free - reserved : 0;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
    ++n;
  return n;
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

// ---- Memory limits ----

TEST(MemoryLimits, ParsesCgroupV2Files) {
  const auto unlimited = detail::parse_cgroup_memory("max\n", "1073741824\n", "");
  EXPECT_EQ(unlimited.limit_bytes, kUnlimitedBytes);
  EXPECT_EQ(unlimited.current_bytes, 1073741824u);
  EXPECT_EQ(unlimited.room_bytes(), kUnlimitedBytes);

  // A real memory.stat's first lines: page cache is on the file LRUs, shmem on the anon ones.
  const char* stat =
      "anon 44040192\nfile 12582912\nkernel 3145728\nshmem 2097152\n"
      "inactive_anon 46137344\nactive_anon 0\ninactive_file 6291456\nactive_file 4194304\n"
      "unevictable 0\n";
  const auto limited = detail::parse_cgroup_memory("67108864\n", "50331648\n", stat);
  EXPECT_EQ(limited.limit_bytes, 64 * MiB);
  EXPECT_EQ(limited.current_bytes, 48 * MiB);
  EXPECT_EQ(limited.reclaimable_bytes, 10 * MiB);  // active_file + inactive_file, not shmem
  EXPECT_EQ(limited.room_bytes(), 64 * MiB - 48 * MiB + 10 * MiB);

  // Over the limit (charged before reclaim caught up): no room, not a wrapped-around size.
  const auto over = detail::parse_cgroup_memory("67108864\n", "75497472\n", "");
  EXPECT_EQ(over.room_bytes(), 0u);
  // Missing files leave the defaults.
  const auto absent = detail::parse_cgroup_memory("", "", "");
  EXPECT_EQ(absent.limit_bytes, kUnlimitedBytes);
  EXPECT_EQ(absent.current_bytes, 0u);
}

TEST(MemoryLimits, ParsesCgroupV1Files) {
  const char* unlimited_stat =
      "cache 4390912\nrss 1724416\nhierarchical_memory_limit 9223372036854771712\n"
      "total_cache 4390912\ntotal_inactive_file 868352\ntotal_active_file 3522560\n";
  const auto unlimited =
      detail::parse_cgroup_v1_memory("9223372036854771712\n", "7458816\n", unlimited_stat);
  EXPECT_EQ(unlimited.limit_bytes, kUnlimitedBytes);
  EXPECT_EQ(unlimited.current_bytes, 7458816u);
  EXPECT_EQ(unlimited.reclaimable_bytes, 868352u + 3522560u);
  EXPECT_EQ(unlimited.room_bytes(), kUnlimitedBytes);

  // This cgroup is unlimited but an ancestor is not: hierarchical_memory_limit says so.
  const auto inherited = detail::parse_cgroup_v1_memory(
      "9223372036854771712\n", "1048576\n",
      "hierarchical_memory_limit 134217728\ntotal_inactive_file 0\ntotal_active_file 0\n");
  EXPECT_EQ(inherited.limit_bytes, 128 * MiB);
  EXPECT_EQ(inherited.room_bytes(), 127 * MiB);
  const auto own =
      detail::parse_cgroup_v1_memory("67108864\n", "0\n", "hierarchical_memory_limit 134217728\n");
  EXPECT_EQ(own.limit_bytes, 64 * MiB);
}

TEST(MemoryLimits, FindsTheMemoryCgroupDirectory) {
  // A hybrid system (memory on v1, v2 mounted at unified), as systemd's hybrid layout.
  const char* hybrid_cgroup = "9:name=systemd:/\n4:memory:/process_api/eab5\n1:cpu:/\n0::/\n";
  const char* hybrid_mounts =
      "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
      "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
      "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
      "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
  const auto hybrid = detail::parse_cgroup_dirs(hybrid_cgroup, hybrid_mounts);
  EXPECT_EQ(hybrid.v1_memory, "/sys/fs/cgroup/memory/process_api/eab5");
  EXPECT_EQ(hybrid.v2, "/sys/fs/cgroup/unified");
  EXPECT_EQ(hybrid.v2_mount, "/sys/fs/cgroup/unified");

  // Unified (v2 only), with an optional field before the "-".
  const auto unified = detail::parse_cgroup_dirs(
      "0::/user.slice/user-1000.slice/session-2.scope\n",
      "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
      "rw,nsdelegate,memory_recursiveprot\n");
  EXPECT_EQ(unified.v2, "/sys/fs/cgroup/user.slice/user-1000.slice/session-2.scope");
  EXPECT_EQ(unified.v1_memory, "");

  // A container without a cgroup namespace: the mount's root is the container's cgroup.
  const auto container = detail::parse_cgroup_dirs(
      "0::/docker/abc123/worker\n",
      "700 690 0:30 /docker/abc123 /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n");
  EXPECT_EQ(container.v2, "/sys/fs/cgroup/worker");

  const auto none = detail::parse_cgroup_dirs("", "22 1 0:21 / /proc rw - proc proc rw\n");
  EXPECT_EQ(none.v2, "");
  EXPECT_EQ(none.v1_memory, "");
}

TEST(MemoryLimits, LockWarningNamesTheAskTheLimitWhatIsLockedAndWhatToSet) {
  MemoryLimits limits;
  limits.memlock_limit_bytes = 64 * KiB;
  limits.locked_bytes = 8 * KiB;
  const std::string warning =
      detail::lock_failure_warning("Host (pinned)", 4 * MiB, 4 * MiB, ENOMEM, limits);
  for (const char* part :
       {"Host (pinned) could not lock 4194304 bytes (4.00 MiB)", "Cannot allocate memory",
        "RLIMIT_MEMLOCK is 65536 bytes (64.00 KiB)", "8192 bytes (8.00 KiB) already locked (VmLck)",
        "stays pageable", "at least 4104 KiB", "ulimit -l unlimited", "LimitMEMLOCK=infinity",
        "--ulimit memlock=-1", "no memory cgroup limit"})
    EXPECT_NE(warning.find(part), std::string::npos) << "no \"" << part << "\" in " << warning;

  // The mapping is whole 2 MiB pages: the warning names both sizes.
  const std::string rounded =
      detail::lock_failure_warning("Host (pinned)", 6 * MiB, 5 * MiB, ENOMEM, limits);
  EXPECT_NE(rounded.find("6291456 bytes (6.00 MiB), the whole pages of a 5242880-byte buffer"),
            std::string::npos)
      << rounded;

  // When the limit is not why (CAP_IPC_LOCK), it says so instead of advising ulimit.
  limits.memlock_exempt = true;
  limits.cgroup.path = "/sys/fs/cgroup/job";
  limits.cgroup.limit_bytes = 64 * MiB;
  limits.cgroup.current_bytes = 60 * MiB;
  const std::string exempt =
      detail::lock_failure_warning("Host (pinned)", 4 * MiB, 4 * MiB, ENOMEM, limits);
  EXPECT_NE(exempt.find("CAP_IPC_LOCK exempts"), std::string::npos) << exempt;
  EXPECT_NE(exempt.find("RLIMIT_MEMLOCK allows it"), std::string::npos) << exempt;
  EXPECT_NE(exempt.find("the memory cgroup /sys/fs/cgroup/job allows 67108864 bytes"),
            std::string::npos)
      << exempt;
  EXPECT_EQ(exempt.find("ulimit -l"), std::string::npos) << exempt;
}

// This process's values, read differently from the library: /proc/self/limits, the CapEff line
// of /proc/self/status and the cgroup files read here.
TEST(MemoryLimits, ReaderAgreesWithTheKernelFiles) {
  const std::string proc_limits = read_text("/proc/self/limits");
  const std::size_t row = proc_limits.find("Max locked memory");
  ASSERT_NE(row, std::string::npos) << proc_limits;
  std::istringstream row_fields(proc_limits.substr(row + std::strlen("Max locked memory")));
  std::string soft;
  row_fields >> soft;

  PageBuffer locked(4 * MiB, /*lock=*/true, "Host (pinned)", HugePages::Off);
  const MemoryLimits limits = read_memory_limits();
  if (soft == "unlimited") {
    EXPECT_EQ(limits.memlock_limit_bytes, kUnlimitedBytes);
  } else {
    EXPECT_EQ(limits.memlock_limit_bytes, std::stoull(soft));
  }
  const std::string status = read_text("/proc/self/status");
  const std::size_t cap = status.find("CapEff:");
  ASSERT_NE(cap, std::string::npos);
  const unsigned long long cap_eff = std::stoull(status.substr(cap + 7), nullptr, 16);
  EXPECT_EQ(limits.memlock_exempt, ((cap_eff >> CAP_IPC_LOCK) & 1) != 0);
  const std::size_t vmlck = status.find("VmLck:");
  ASSERT_NE(vmlck, std::string::npos);
  EXPECT_EQ(limits.locked_bytes, std::stoull(status.substr(vmlck + 6)) * KiB);
  if (locked.locked()) {
    EXPECT_GE(limits.locked_bytes, 4 * MiB);
  }

  // The cgroup: its limit file in the directory named holds the limit reported, and that
  // directory is this process's cgroup or one of its ancestors.
  const CgroupMemory& cgroup = limits.cgroup;
  if (cgroup.path.empty()) {
    EXPECT_EQ(cgroup.limit_bytes, kUnlimitedBytes);
    EXPECT_EQ(cgroup.room_bytes(), kUnlimitedBytes);
    return;
  }
  // this process's cgroup path in the hierarchy that holds the limit, from /proc/self/cgroup
  std::string own;
  const bool v2 = std::ifstream(cgroup.path + "/memory.max").good();
  std::istringstream lines(read_text("/proc/self/cgroup"));
  for (std::string line; std::getline(lines, line);) {
    const std::size_t first = line.find(':'), second = line.find(':', first + 1);
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    if (v2 ? line.rfind("0::", 0) == 0 : controllers.find(",memory,") != std::string::npos)
      own = line.substr(second + 1);
  }
  // The directory below its cgroup mount point is a leading part of that path (or, where the
  // mount's root is a container's cgroup, a part of it), whole components.
  std::string mount;
  std::istringstream mounts(read_text("/proc/mounts"));
  for (std::string line; std::getline(mounts, line);) {
    std::istringstream fields(line);
    std::string source, point, type;
    fields >> source >> point >> type;
    if ((type == "cgroup" || type == "cgroup2") && cgroup.path.rfind(point, 0) == 0 &&
        point.size() > mount.size())
      mount = point;
  }
  ASSERT_FALSE(mount.empty()) << cgroup.path << " is under no cgroup mount";
  const std::string below = cgroup.path.substr(mount.size());
  EXPECT_NE((own + "/").find(below + "/"), std::string::npos)
      << cgroup.path << " is not the cgroup " << own << " or one of its ancestors";
  const std::string limit_text =
      read_text((cgroup.path + (v2 ? "/memory.max" : "/memory.limit_in_bytes")).c_str());
  if (v2) {
    EXPECT_EQ(cgroup.limit_bytes, std::stoull(limit_text));
  } else {
    EXPECT_LE(cgroup.limit_bytes, std::stoull(limit_text));
  }
  EXPECT_GT(cgroup.current_bytes, 0u);
}

// What a forked child reports: its exit status and everything it wrote to stderr.
struct ChildResult {
  int status = 0;
  std::string output;
  [[nodiscard]] std::string describe() const {
    if (WIFSIGNALED(status))
      return "child killed by signal " + std::to_string(WTERMSIG(status)) + "; output:\n" + output;
    return "child exited " + std::to_string(WEXITSTATUS(status)) + "; output:\n" + output;
  }
  [[nodiscard]] bool exited_ok() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// Runs `body` in a forked child with its stderr on a pipe; the child's exit status is body's
// return value (an exception is exit status 99, its what() on stderr).
ChildResult run_in_child(const std::function<int()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[1]);
    int code = 98;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: uncaught exception: %s\n", e.what());
      code = 99;
    }
    std::fflush(stderr);
    ::_exit(code);
  }
  ::close(fds[1]);
  ChildResult result;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    result.output.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  while (::waitpid(pid, &result.status, 0) < 0 && errno == EINTR) {
  }
  return result;
}

// Clears CAP_IPC_LOCK from the calling thread's effective set (which exempts root from
// RLIMIT_MEMLOCK); false if capset refuses.
bool drop_ipc_lock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3]{};
  if (::syscall(SYS_capget, &header, caps) != 0) return false;
  caps[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  return ::syscall(SYS_capset, &header, caps) == 0;
}

TEST(MemoryLimits, LowMemlockLimitLeavesBuffersPageableWithOneWarningNamingIt) {
  const ChildResult child = run_in_child([] {
    if (!drop_ipc_lock()) {
      std::fprintf(stderr, "child: capset: %s\n", std::strerror(errno));
      return 2;
    }
    const rlimit low{64 * KiB, 64 * KiB};
    if (::setrlimit(RLIMIT_MEMLOCK, &low) != 0) {
      std::fprintf(stderr, "child: setrlimit: %s\n", std::strerror(errno));
      return 3;
    }
    detail::reset_memory_limit_warnings();
    PageBuffer out(4 * MiB, /*lock=*/true, "Host (pinned)", HugePages::Off);
    PageBuffer in(4 * MiB, /*lock=*/true, "Host (pinned)", HugePages::Off);
    if (out.locked() || in.locked()) return 4;  // a 4 MiB lock under a 64 KiB limit
    const MemoryLimits limits = read_memory_limits();
    if (limits.memlock_exempt || limits.memlock_limit_bytes != 64 * KiB) return 5;
    fill_pattern(out.data(), out.size(), 11);
    std::memcpy(in.data(), out.data(), out.size());
    const std::vector<unsigned char> expected = testing::pattern(out.size(), 11);
    if (std::memcmp(in.data(), expected.data(), expected.size()) != 0) return 6;
    return 0;
  });
  ASSERT_TRUE(child.exited_ok()) << child.describe();
  const std::string& warnings = child.output;
  EXPECT_EQ(count(warnings, "could not lock"), 1u) << warnings;  // once per process
  for (const char* part :
       {"strata: warning: Host (pinned) could not lock 4194304 bytes (4.00 MiB)",
        "RLIMIT_MEMLOCK is 65536 bytes (64.00 KiB)", "already locked (VmLck)", "stays pageable",
        "ulimit -l", "LimitMEMLOCK=infinity", "--ulimit memlock=-1"})
    EXPECT_NE(warnings.find(part), std::string::npos) << "no \"" << part << "\" in " << warnings;
  EXPECT_EQ(warnings.find("CAP_IPC_LOCK exempts"), std::string::npos) << warnings;
}

// A memory cgroup of `limit_bytes` made for a test under the hierarchy that has the memory
// controller (v2 where its root delegates memory, else v1), removed at scope exit.
class TestCgroup {
 public:
  explicit TestCgroup(std::size_t limit_bytes) {
    if (::geteuid() != 0) {
      why_not_ = "not root: cannot make a memory cgroup";
      return;
    }
    std::string v2_mount, v1_mount;
    std::istringstream mounts(read_text("/proc/mounts"));
    for (std::string line; std::getline(mounts, line);) {
      std::istringstream fields(line);
      std::string source, point, type, options;
      fields >> source >> point >> type >> options;
      if (type == "cgroup2" && v2_mount.empty()) v2_mount = point;
      if (type == "cgroup" && ("," + options + ",").find(",memory,") != std::string::npos)
        v1_mount = point;
    }
    const std::string name = "/strata-test-" + std::to_string(::getpid());
    const bool v2 = !v2_mount.empty() &&
                    read_text((v2_mount + "/cgroup.subtree_control").c_str()).find("memory") !=
                        std::string::npos;
    if (v2) {
      dir_ = v2_mount + name;
      limit_file_ = "/memory.max";
    } else if (!v1_mount.empty()) {
      dir_ = v1_mount + name;
      limit_file_ = "/memory.limit_in_bytes";
    } else {
      why_not_ = "no memory controller: neither cgroup2 with memory in " + v2_mount +
                 "/cgroup.subtree_control nor a cgroup v1 memory mount";
      return;
    }
    if (::mkdir(dir_.c_str(), 0755) != 0) {
      why_not_ = "mkdir " + dir_ + ": " + std::strerror(errno);
      dir_.clear();
      return;
    }
    if (!write(limit_file_, std::to_string(limit_bytes))) {
      why_not_ = "cannot write " + dir_ + limit_file_;
      return;
    }
    ok_ = true;
  }
  ~TestCgroup() {
    if (dir_.empty()) return;
    // The child has exited; its charges may take a moment to be released.
    for (int attempt = 0; attempt < 100 && ::rmdir(dir_.c_str()) != 0 && errno == EBUSY; ++attempt)
      ::usleep(10'000);
  }
  TestCgroup(const TestCgroup&) = delete;
  TestCgroup& operator=(const TestCgroup&) = delete;

  [[nodiscard]] bool ok() const { return ok_; }
  [[nodiscard]] const std::string& why_not() const { return why_not_; }
  [[nodiscard]] const std::string& dir() const { return dir_; }
  /// Moves the calling process into the cgroup.
  [[nodiscard]] bool join() const { return write("/cgroup.procs", std::to_string(::getpid())); }

 private:
  [[nodiscard]] bool write(const std::string& file, const std::string& text) const {
    std::ofstream out(dir_ + file);
    out << text << std::flush;
    return out.good();
  }

  std::string dir_, limit_file_, why_not_;
  bool ok_ = false;
};

TEST(MemoryLimits, PinnedBufferBeyondTheCgroupLimitIsRefusedNamingIt) {
  const TestCgroup cgroup(64 * MiB);
  if (!cgroup.ok()) GTEST_SKIP() << cgroup.why_not();
  const ChildResult child = run_in_child([&] {
    if (!cgroup.join()) return 2;
    const CgroupMemory memory = read_cgroup_memory();
    std::fprintf(stderr, "child: cgroup %s limit %zu current %zu\n", memory.path.c_str(),
                 memory.limit_bytes, memory.current_bytes);
    if (memory.path != cgroup.dir() || memory.limit_bytes != 64 * MiB) return 3;
    {
      // Within the room: allowed, locked and filled without the OOM killer.
      PageBuffer small(16 * MiB, /*lock=*/true, "Host (pinned)");
      fill_pattern(small.data(), small.size(), 5);
    }
    try {
      // Without the check this is OOM-killed as it is locked (the test sees SIGKILL).
      PageBuffer big(256 * MiB, /*lock=*/true, "Host (pinned)");
      return 4;
    } catch (const OutOfMemoryError& e) {
      std::fprintf(stderr, "refused: %s\n", e.what());
      if (e.requested_bytes() != 256 * MiB || e.free_bytes() > 64 * MiB) return 5;
    }
    // A lazily touched reservation of the same size is allowed, with a warning.
    detail::reset_memory_limit_warnings();
    void* arena = map_pages(256 * MiB, "Device", /*reserve_only=*/true);
    static_cast<std::byte*>(arena)[0] = std::byte{1};
    unmap_pages(arena, 256 * MiB);
    return 0;
  });
  ASSERT_TRUE(child.exited_ok()) << child.describe();
  const std::string& out = child.output;
  const std::size_t refused = out.find("refused: ");
  ASSERT_NE(refused, std::string::npos) << out;
  const std::string error = out.substr(refused, out.find('\n', refused) - refused);
  for (const std::string& part :
       {std::string("out of memory on tier Host (pinned): asked for 268435456 bytes"),
        "the memory cgroup " + cgroup.dir() + " allows 67108864 bytes (64.00 MiB)",
        std::string("OOM killer"), std::string("MemoryMax=")})
    EXPECT_NE(error.find(part), std::string::npos) << "no \"" << part << "\" in " << error;
  EXPECT_NE(out.find("strata: warning: Device reserves 268435456 bytes (256.00 MiB) but the "
                     "memory cgroup " +
                     cgroup.dir() + " allows 67108864 bytes"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace strata
