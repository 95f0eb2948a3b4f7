#include "strata/io/swap_space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/io_test_util.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/crc32c.h"

namespace strata::testing {
namespace {

// Flips the `mask` bits of the byte at `offset` of the file `path`, on disk (a corrupt piece).
void flip_bits(const std::string& path, std::uint64_t offset, unsigned char mask) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  unsigned char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  byte ^= mask;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  ::fsync(fd);
  ::close(fd);
}

class SwapSpaceTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  std::unique_ptr<IoEngine> engine(std::vector<FaultSpec> faults = {}) {
    IoOptions o;
    o.engine = GetParam();
    o.block_size = 256 * KiB;
    o.faults = std::move(faults);
    o.quiet = true;
    return make_io_engine(o);
  }
  SwapOptions options(std::vector<std::string> paths, std::uint64_t capacity = 64 * MiB,
                      std::uint64_t stripe = 64 * KiB) {
    SwapOptions o;
    o.paths = std::move(paths);
    o.capacity_bytes = capacity;
    o.stripe_bytes = stripe;
    return o;
  }
  TempDir a_, b_, c_;
};

TEST_P(SwapSpaceTest, RoundTripsManySizesAlignedOrNot) {
  auto io = engine();
  SwapSpace swap(options({a_.path()}), *io);
  for (std::size_t bytes : {std::size_t{1}, std::size_t{100}, std::size_t{4095}, std::size_t{4096},
                            std::size_t{4097}, 1 * MiB - 1, 1 * MiB + 1, 3 * MiB + 123}) {
    for (std::size_t misalign : {std::size_t{0}, std::size_t{1}, std::size_t{333}}) {
      PageBuffer src(bytes + misalign), dst(bytes + misalign);
      fill_pattern(src.data() + misalign, bytes, static_cast<unsigned>(bytes + misalign));
      const ExtentId id = swap.allocate(bytes);
      swap.write(id, 0, src.data() + misalign, bytes).get();
      swap.read(id, 0, dst.data() + misalign, bytes).get();
      ASSERT_EQ(std::memcmp(src.data() + misalign, dst.data() + misalign, bytes), 0)
          << bytes << " bytes, buffer offset " << misalign;
      swap.release(id);
    }
  }
  EXPECT_EQ(swap.stats().current_bytes, 0u);
}

TEST_P(SwapSpaceTest, StripesAnExtentOverThreeDirectories) {
  auto io = engine();
  SwapSpace swap(options({a_.path(), b_.path(), c_.path()}, 6 * MiB, 64 * KiB), *io);
  ASSERT_EQ(swap.swap_files().size(), 3u);
  const std::size_t bytes = 1 * MiB;
  auto data = pattern(bytes, 42);
  const ExtentId id = swap.allocate(bytes);
  swap.write(id, 0, data.data(), bytes).get();
  // 16 stripes of 64 KiB, round robin over the three files.
  const auto pieces = swap.pieces(id);
  ASSERT_EQ(pieces.size(), 16u);
  std::size_t at = 0;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    EXPECT_EQ(pieces[k].path, swap.swap_files()[k % 3]);
    EXPECT_EQ(pieces[k].offset, (k / 3) * 64 * KiB);
    // The bytes really are in that file at that offset.
    std::vector<unsigned char> raw(pieces[k].bytes);
    const int fd = ::open(pieces[k].path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pread(fd, raw.data(), raw.size(), static_cast<off_t>(pieces[k].offset)),
              static_cast<ssize_t>(raw.size()));
    ::close(fd);
    EXPECT_EQ(std::memcmp(raw.data(), data.data() + at, raw.size()), 0) << "piece " << k;
    at += pieces[k].bytes;
  }
  std::vector<unsigned char> back(bytes);
  swap.read(id, 0, back.data(), bytes).get();
  EXPECT_EQ(back, data);
}

TEST_P(SwapSpaceTest, ReadsAndWritesAtOffsetsInsideAnExtent) {
  auto io = engine();
  SwapSpace swap(options({a_.path(), b_.path()}, 8 * MiB, 64 * KiB), *io);
  const std::size_t bytes = 1 * MiB + 5000;
  auto data = pattern(bytes, 8);
  const ExtentId id = swap.allocate(bytes);
  // Written in two chunks, as the residency pipeline does, then read whole and in parts.
  swap.write(id, 0, data.data(), 512 * KiB).get();
  swap.write(id, 512 * KiB, data.data() + 512 * KiB, bytes - 512 * KiB).get();
  std::vector<unsigned char> back(bytes);
  swap.read(id, 0, back.data(), bytes).get();
  EXPECT_EQ(back, data);
  std::vector<unsigned char> part(200 * KiB);
  swap.read(id, 128 * KiB, part.data(), part.size()).get();
  EXPECT_EQ(std::memcmp(part.data(), data.data() + 128 * KiB, part.size()), 0);
  EXPECT_THROW(swap.read(id, 100, part.data(), 10), Error);       // not a page multiple
  EXPECT_THROW(swap.write(id, 4096, data.data(), bytes), Error);  // runs past the end
}

TEST_P(SwapSpaceTest, AFlippedByteIsDetectedByTheChecksum) {
  auto io = engine();
  SwapSpace swap(options({a_.path()}), *io);
  auto data = pattern(200 * KiB, 5);
  const ExtentId good = swap.allocate(data.size());
  const ExtentId bad = swap.allocate(data.size());
  swap.write(good, 0, data.data(), data.size()).get();
  swap.write(bad, 0, data.data(), data.size()).get();
  const auto pieces = swap.pieces(bad);
  const ExtentPiece& hit = pieces[1];
  ASSERT_NO_FATAL_FAILURE(flip_bits(hit.path, hit.offset + 10, 0x40));
  std::vector<unsigned char> back(data.size());
  try {
    swap.read(bad, 0, back.data(), back.size()).get();
    FAIL() << "a corrupted extent read as good";
  } catch (const IoError& e) {
    EXPECT_EQ(e.code(), Errc::corrupt_data);
    EXPECT_EQ(e.path(), hit.path);
    EXPECT_EQ(e.offset(), hit.offset);
    EXPECT_EQ(e.bytes(), hit.bytes);
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  swap.read(good, 0, back.data(), back.size()).get();  // the neighbour is intact
  EXPECT_EQ(back, data);
}

TEST_P(SwapSpaceTest, SmallExtentsShareStripesAndKeepTheirChecksums) {
  // Note [Small extents]: 64 KiB stripes over two files. Sixteen 4 KiB extents take one
  // stripe, not sixteen; a 20 KiB one takes 32 KiB inside one stripe; a stripe-sized one still
  // starts on a stripe boundary.
  auto io = engine();
  SwapSpace swap(options({a_.path(), b_.path()}, 8 * MiB, 64 * KiB), *io);
  std::vector<ExtentId> small;
  std::vector<std::vector<unsigned char>> data;
  for (unsigned i = 0; i < 16; ++i) {
    data.push_back(pattern(i == 0 ? 100 : 4 * KiB, 70 + i));  // the first not a page
    small.push_back(swap.allocate(data.back().size()));
  }
  EXPECT_EQ(swap.stats().reserved_bytes, 64 * KiB);
  const ExtentId mid = swap.allocate(20 * KiB);
  const ExtentId big = swap.allocate(64 * KiB + 1);
  EXPECT_EQ(swap.alignment_for(20 * KiB), 32 * KiB);
  EXPECT_EQ(swap.alignment_for(64 * KiB + 1), 64 * KiB);
  for (const ExtentId id : {mid, big}) {
    const auto pieces = swap.pieces(id);
    EXPECT_EQ(pieces.front().offset % (64 * KiB), 0u) << "extent " << id;
  }
  ASSERT_EQ(swap.pieces(mid).size(), 1u);  // inside one stripe: one piece
  // A 20 KiB extent after thirteen 4 KiB ones in a fresh stripe: page-aligned it would start at
  // 52 KiB and cross into the next stripe; it starts on a 32 KiB boundary instead.
  std::vector<ExtentId> thirteen;
  for (int i = 0; i < 13; ++i)
    thirteen.push_back(swap.allocate(4 * KiB));
  const ExtentId after = swap.allocate(20 * KiB);
  ASSERT_EQ(swap.pieces(after).size(), 1u);
  EXPECT_EQ(swap.pieces(after)[0].offset % (32 * KiB), 0u);
  for (const ExtentId id : thirteen)
    swap.release(id);
  swap.release(after);
  for (std::size_t i = 0; i < small.size(); ++i) {
    const auto pieces = swap.pieces(small[i]);
    ASSERT_EQ(pieces.size(), 1u);
    EXPECT_EQ(pieces[0].offset / (64 * KiB), (pieces[0].offset + pieces[0].bytes - 1) / (64 * KiB));
    swap.write(small[i], 0, data[i].data(), data[i].size()).get();
  }
  auto mid_data = pattern(20 * KiB, 9);
  swap.write(mid, 0, mid_data.data(), mid_data.size()).get();
  for (std::size_t i = 0; i < small.size(); ++i) {  // neighbours in one stripe stay apart
    std::vector<unsigned char> back(data[i].size());
    swap.read(small[i], 0, back.data(), back.size()).get();
    ASSERT_EQ(back, data[i]) << "extent " << i;
  }
  // A flipped byte in a small extent is caught by its checksum; its stripe neighbour reads.
  const ExtentPiece hit = swap.pieces(small[5])[0];
  ASSERT_NO_FATAL_FAILURE(flip_bits(hit.path, hit.offset + 7, 0x10));
  std::vector<unsigned char> back(4 * KiB);
  try {
    swap.read(small[5], 0, back.data(), back.size()).get();
    FAIL() << "a corrupted small extent read as good";
  } catch (const IoError& e) {
    EXPECT_EQ(e.code(), Errc::corrupt_data);
    EXPECT_EQ(e.offset(), hit.offset);
  }
  swap.read(small[6], 0, back.data(), back.size()).get();
  EXPECT_EQ(back, data[6]);
  for (const ExtentId id : small)
    swap.release(id);
  swap.release(mid);
  swap.release(big);
  EXPECT_EQ(swap.stats().current_bytes, 0u);
}

TEST_P(SwapSpaceTest, AFailedWriteReportsAndMarksTheExtentTorn) {
  if (!fault_injection_available()) GTEST_SKIP() << "built without fault injection";
  auto io = engine({parse_fault("write:9:eio")});  // the first write is 8 stripe pieces
  SwapSpace swap(options({a_.path()}), *io);
  auto v1 = pattern(512 * KiB, 1), v2 = pattern(512 * KiB, 2);
  const ExtentId id = swap.allocate(v1.size());
  swap.write(id, 0, v1.data(), v1.size()).get();
  try {
    swap.write(id, 0, v2.data(), v2.size()).get();
    // Reached only if the fault landed in the first write; it did not.
    FAIL() << "the injected EIO did not surface";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
  }
  std::vector<unsigned char> back(v1.size());
  EXPECT_THROW(swap.read(id, 0, back.data(), back.size()), IoError);  // torn: never half-data
  swap.write(id, 0, v2.data(), v2.size()).get();                      // the caller still had it
  swap.read(id, 0, back.data(), back.size()).get();
  EXPECT_EQ(back, v2);
}

TEST_P(SwapSpaceTest, AFailedStripePieceStaysTornWhateverSucceedsAfterIt) {
  // 8 pieces of 64 KiB. The write of the first half fails on its first piece; the write of the
  // second half succeeds after it. Before, that success cleared the extent's one torn flag and
  // the failed piece was read back as good.
  if (!fault_injection_available()) GTEST_SKIP() << "built without fault injection";
  auto io = engine({parse_fault("write:9:eio")});  // the first write is 8 pieces
  SwapSpace swap(options({a_.path()}), *io);
  auto v1 = pattern(512 * KiB, 1), v2 = pattern(512 * KiB, 2);
  const ExtentId id = swap.allocate(v1.size());
  swap.write(id, 0, v1.data(), v1.size()).get();
  EXPECT_THROW(swap.write(id, 0, v2.data(), 256 * KiB).get(), IoError);
  swap.write(id, 256 * KiB, v2.data() + 256 * KiB, 256 * KiB).get();
  std::vector<unsigned char> back(v1.size());
  try {
    swap.read(id, 0, back.data(), back.size()).get();
    ADD_FAILURE() << "a torn piece was read back as good";
  } catch (const IoError& e) {
    EXPECT_EQ(e.code(), Errc::corrupt_data);
    EXPECT_NE(std::string(e.what()).find("piece 0"), std::string::npos) << e.what();
  }
  std::vector<unsigned char> half(256 * KiB);
  swap.read(id, 256 * KiB, half.data(), half.size()).get();  // the pieces written since: good
  EXPECT_TRUE(std::equal(half.begin(), half.end(), v2.begin() + 256 * KiB));
  swap.write(id, 0, v2.data(), 256 * KiB).get();  // the caller still had it: whole again
  swap.read(id, 0, back.data(), back.size()).get();
  EXPECT_EQ(back, v2);
}

TEST_P(SwapSpaceTest, RunningOutOfSwapNamesTheNvmeTier) {
  auto io = engine();
  SwapSpace swap(options({a_.path()}, 1 * MiB, 64 * KiB), *io);
  const ExtentId id = swap.allocate(768 * KiB);
  try {
    swap.allocate(512 * KiB);
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), "Nvme");
    EXPECT_EQ(e.requested_bytes(), 512 * KiB);
    EXPECT_EQ(e.free_bytes(), 256 * KiB);
  }
  swap.release(id);
  swap.release(swap.allocate(1 * MiB));
}

TEST_P(SwapSpaceTest, SwapFilesAreRemovedUnlessKept) {
  auto io = engine();
  std::vector<std::string> files;
  {
    SwapSpace swap(options({a_.path(), b_.path()}, 1 * MiB), *io);
    files = swap.swap_files();
    for (const auto& f : files)
      EXPECT_TRUE(std::filesystem::exists(f));
    EXPECT_EQ(std::filesystem::file_size(files[0]), 512 * KiB);  // preallocated
  }
  for (const auto& f : files)
    EXPECT_FALSE(std::filesystem::exists(f)) << f;
  {
    SwapOptions o = options({a_.path()}, 1 * MiB);
    o.keep_files = true;
    SwapSpace swap(o, *io);
    files = swap.swap_files();
  }
  EXPECT_TRUE(std::filesystem::exists(files[0]));
}

TEST_P(SwapSpaceTest, MappedFileExtentsReadAtAnyOffset) {
  auto io = engine();
  SwapSpace swap(options({a_.path()}, 1 * MiB), *io);
  const std::size_t file_bytes = 3 * 4096 + 1234;
  auto content = pattern(file_bytes, 77);
  const std::string path = b_.file("model.bin");
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(content.data()),
             static_cast<std::streamsize>(file_bytes));
  struct Case {
    std::uint64_t offset, bytes;
  };
  for (Case c : {Case{0, file_bytes}, Case{1, 100}, Case{4095, 2}, Case{4096, 8192},
                 Case{5000, file_bytes - 5000}, Case{12288, 1234}, Case{0, 4096}}) {
    const ExtentId id = swap.map_file(path, c.offset, c.bytes);
    for (std::size_t misalign : {std::size_t{0}, std::size_t{3}}) {
      PageBuffer dst(c.bytes + misalign);
      swap.read(id, 0, dst.data() + misalign, c.bytes).get();
      ASSERT_EQ(std::memcmp(dst.data() + misalign, content.data() + c.offset, c.bytes), 0)
          << "offset " << c.offset << " bytes " << c.bytes << " misalign " << misalign;
    }
    EXPECT_THROW(swap.write(id, 0, content.data(), 1), Error);  // never written
    swap.release(id);
  }
  EXPECT_THROW(swap.map_file(path, 4096, file_bytes), Error);  // past the end
  EXPECT_THROW(swap.map_file(b_.file("missing.bin"), 0, 1), IoError);
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapSpaceTest,
                         ::testing::Values(EngineKind::Uring, EngineKind::Posix),
                         [](const auto& p) { return std::string(to_string(p.param)); });

TEST(SwapSpace, MissingDirectoryIsAnErrorNamingThePath) {
  IoOptions io;
  io.quiet = true;
  auto engine = make_io_engine(io);
  SwapOptions o;
  o.paths = {"/nonexistent/strata"};
  o.capacity_bytes = 1 * MiB;
  try {
    SwapSpace swap(o, *engine);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nvme.paths[0]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("/nonexistent/strata"), std::string::npos);
  }
}

TEST(SwapSpace, ACapacityLargerThanTheDiskIsEnospcNamingTheFile) {
  SmallTmpfs fs(1 * MiB);
  if (!fs.mounted()) GTEST_SKIP() << fs.why_not();
  IoOptions io;
  io.quiet = true;
  auto engine = make_io_engine(io);
  SwapOptions o;
  o.paths = {fs.path()};
  o.capacity_bytes = 8 * MiB;
  try {
    SwapSpace swap(o, *engine);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC) << e.what();
    EXPECT_NE(e.path().find(fs.path()), std::string::npos);
  }
  EXPECT_TRUE(std::filesystem::is_empty(fs.path()));  // the partial file was removed
}

TEST(Crc32c, MatchesTheStandardCheckValue) {
  const char* check = "123456789";
  EXPECT_EQ(crc32c(check, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(check + 4, 5, crc32c(check, 4)), 0xE3069283u);  // continues
  auto big = pattern(100003, 1);
  EXPECT_EQ(crc32c(big.data(), big.size()),
            crc32c(big.data() + 50000, 50003, crc32c(big.data(), 50000)));
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

}  // namespace
}  // namespace strata::testing
