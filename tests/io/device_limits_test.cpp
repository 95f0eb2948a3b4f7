// Request sizing from the block device's queue limits (Note [Request sizes]): the arithmetic on
// the limits of real devices, sysfs as the kernel lays it out (a disk, a partition), the device
// behind a real file, and the engines cutting requests into chunks the device takes whole.
#include "strata/io/device_limits.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "io/io_test_util.h"
#include "strata/base/units.h"
#include "strata/io/file.h"
#include "strata/io/io_engine.h"
#include "strata/io/pages.h"

namespace strata::testing {
namespace {

DeviceLimits limits(std::size_t max_kb, unsigned segments, std::size_t segment_bytes) {
  DeviceLimits d;
  d.name = "test";
  d.max_request_bytes = max_kb * KiB;
  d.max_segments = segments;
  d.max_segment_bytes = segment_bytes;
  return d;
}

TEST(DeviceLimits, AVirtioDiskTakes512KiBFromSmallPagesAnd4MiBFromHugePages) {
  // virtio: max_sectors_kb 4096, max_segments 254, max_segment_size 4 GiB - 1.
  const DeviceLimits virtio = limits(4096, 254, 4294967295u);
  EXPECT_EQ(virtio.whole_request_bytes(kPageBytes), 512 * KiB);  // 254 x 4 KiB = 1016 KiB
  EXPECT_EQ(virtio.whole_request_bytes(kHugePageBytes), 4 * MiB);
  EXPECT_EQ(virtio.chunk_bytes(1 * MiB, kPageBytes), 512 * KiB);
  EXPECT_EQ(virtio.chunk_bytes(1 * MiB, kHugePageBytes), 1 * MiB);  // block_size is the cap
  EXPECT_EQ(virtio.chunk_bytes(8 * MiB, kHugePageBytes), 4 * MiB);
}

TEST(DeviceLimits, AnNvmeDriveIsBoundByItsTransferSizeAndSegmentSize) {
  // MDTS 128 KiB: every buffer gives 128 KiB chunks.
  const DeviceLimits small = limits(128, 127, 4294967295u);
  EXPECT_EQ(small.whole_request_bytes(kPageBytes), 128 * KiB);
  EXPECT_EQ(small.whole_request_bytes(kHugePageBytes), 128 * KiB);
  // 1280 KiB requests, 127 segments of at most 64 KiB: huge pages give 126 x 64 KiB = 8064 KiB
  // of segments, so the request limit binds; 4 KiB pages give 508 KiB -> 256 KiB.
  const DeviceLimits seg = limits(1280, 127, 64 * KiB);
  EXPECT_EQ(seg.whole_request_bytes(kHugePageBytes), 1 * MiB);
  EXPECT_EQ(seg.whole_request_bytes(kPageBytes), 256 * KiB);
  // Few segments of 64 KiB: one is lost to a chunk starting inside a huge page.
  const DeviceLimits few = limits(4096, 9, 64 * KiB);
  EXPECT_EQ(few.whole_request_bytes(kHugePageBytes), 512 * KiB);  // 8 x 64 KiB
  EXPECT_EQ(few.whole_request_bytes(kPageBytes), 32 * KiB);       // 9 x 4 KiB = 36 KiB
}

TEST(DeviceLimits, AnUnknownDeviceKeepsTheBlockSize) {
  const DeviceLimits unknown;
  EXPECT_FALSE(unknown.known());
  EXPECT_EQ(unknown.whole_request_bytes(kPageBytes), 0u);
  EXPECT_EQ(unknown.chunk_bytes(3 * MiB, kPageBytes), 3 * MiB);
  EXPECT_EQ(unknown.chunk_bytes(3 * MiB, kHugePageBytes), 3 * MiB);
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

TEST(DeviceLimits, ReadsADiskAndAPartitionFromSysfsAsTheKernelLaysThemOut) {
  TempDir dir;
  const std::filesystem::path disk = std::filesystem::path(dir.path()) / "nvme0n1";
  write_file(disk / "queue/max_sectors_kb", "1280\n");
  write_file(disk / "queue/max_segments", "127\n");
  write_file(disk / "queue/max_segment_size", "4294967295\n");
  write_file(disk / "nvme0n1p2/partition", "2\n");
  write_file(disk / "stat", "  100  0  2048  9  40  0  16384  3  0 0 0\n");

  const DeviceLimits whole = read_device_limits(disk);
  EXPECT_EQ(whole.name, "nvme0n1");
  EXPECT_EQ(whole.max_request_bytes, 1280 * KiB);
  EXPECT_EQ(whole.max_segments, 127u);
  EXPECT_EQ(whole.max_segment_bytes, 4294967295u);

  const DeviceLimits part = read_device_limits(disk / "nvme0n1p2");  // no queue/ of its own
  EXPECT_EQ(part.name, "nvme0n1p2");
  EXPECT_EQ(part.max_request_bytes, 1280 * KiB);
  EXPECT_EQ(part.max_segments, 127u);

  const DeviceCounters c = read_device_counters(disk);
  EXPECT_EQ(c.reads, 100u);
  EXPECT_EQ(c.read_bytes, 2048u * 512);
  EXPECT_EQ(c.writes, 40u);
  EXPECT_EQ(c.write_bytes, 16384u * 512);

  EXPECT_FALSE(read_device_limits(disk / "missing").known());
  const DeviceCounters none = read_device_counters(disk / "missing");
  EXPECT_EQ(none.reads + none.read_bytes + none.writes + none.write_bytes, 0u);
}

// The queue limits of the device holding `path`, read here from sysfs with plain streams.
struct RawQueue {
  std::uint64_t max_kb = 0, segments = 0, segment_bytes = 0;
};
RawQueue raw_queue_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  std::filesystem::path dev =
      "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  std::error_code ec;
  dev = std::filesystem::canonical(dev, ec);
  if (ec) return {};
  if (std::filesystem::exists(dev / "partition")) dev = dev.parent_path();
  RawQueue q;
  std::ifstream(dev / "queue/max_sectors_kb") >> q.max_kb;
  std::ifstream(dev / "queue/max_segments") >> q.segments;
  std::ifstream(dev / "queue/max_segment_size") >> q.segment_bytes;
  return q;
}

TEST(DeviceLimits, AFileKnowsTheDeviceBehindIt) {
  TempDir dir;
  File file(dir.file("f.bin"), File::Mode::Create, true);
  const RawQueue raw = raw_queue_of(dir.path());
  if (raw.max_kb == 0) GTEST_SKIP() << dir.path() << " is on no block device (tmpfs/overlay?)";
  EXPECT_TRUE(file.device().known());
  EXPECT_EQ(file.device().max_request_bytes, raw.max_kb * KiB);
  EXPECT_EQ(file.device().max_segments, raw.segments);
  EXPECT_EQ(file.device().max_segment_bytes, raw.segment_bytes);
  EXPECT_EQ(&file.device(), &File(dir.file("f.bin"), File::Mode::Read, true).device())
      << "one cached entry per device";
}

TEST(DeviceLimits, AFileOnTmpfsHasNoDeviceLimits) {
  SmallTmpfs tmpfs(4 * MiB);
  if (!tmpfs.mounted()) GTEST_SKIP() << tmpfs.why_not();
  File file(tmpfs.path() + "/f.bin", File::Mode::Create, false);
  EXPECT_FALSE(file.device().known());
}

// The kernel's own account of the transparent huge pages in the mapping that holds `data`
// (AnonHugePages in /proc/self/smaps), in bytes; read here, not through strata's pages code.
std::size_t smaps_anon_huge_bytes(const void* data) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(data);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      inside = at >= lo && at < hi;
      continue;
    }
    std::size_t kb = 0;
    if (inside && std::sscanf(line.c_str(), "AnonHugePages: %zu kB", &kb) == 1) return kb * 1024;
  }
  return 0;
}

TEST(DeviceLimits, ContiguousRunIsTwoMiBOnlyWhenEveryByteIsInHugePages) {
  PageBuffer small_pages(4 * MiB, /*lock=*/true, "test", HugePages::Off);
  EXPECT_EQ(contiguous_run_bytes(small_pages.data(), small_pages.size()), 4096u);
  PageBuffer tiny(64 * KiB, /*lock=*/true);
  EXPECT_EQ(contiguous_run_bytes(tiny.data(), tiny.size()), 4096u);
  EXPECT_EQ(contiguous_run_bytes(nullptr, 4 * MiB), 4096u);
  PageBuffer huge(4 * MiB, /*lock=*/true, "test", HugePages::Transparent);
  if (smaps_anon_huge_bytes(huge.data()) >= 4 * MiB) {
    EXPECT_EQ(contiguous_run_bytes(huge.data(), huge.size()), 2097152u);
    EXPECT_EQ(contiguous_run_bytes(huge.data(), 2 * MiB), 2097152u);
    // Less than one huge page is never a 2 MiB run, even inside one.
    EXPECT_EQ(contiguous_run_bytes(huge.data(), 1 * MiB), 4096u);
  } else {
    std::printf(
        "  (the kernel gave the 4 MiB buffer %zu bytes of transparent huge pages: "
        "only the 4 KiB cases hold)\n",
        smaps_anon_huge_bytes(huge.data()));
    EXPECT_EQ(contiguous_run_bytes(huge.data(), huge.size()), 4096u);
  }
}

}  // namespace
}  // namespace strata::testing
