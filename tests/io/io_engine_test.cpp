#include "strata/io/io_engine.h"

#include <gtest/gtest.h>
#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <thread>
#include <vector>

#include "io/io_test_util.h"
#include "strata/base/error.h"
#include "strata/base/units.h"

namespace strata::testing {
namespace {

// Whether the kernel opens an io_uring with `flags`, asked with the raw system call (not through
// the engine's own setup code, which these tests check).
bool kernel_opens_a_ring(unsigned flags) {
  io_uring_params params{};
  params.flags = flags;
  params.sq_thread_idle = 100;
  const long fd = ::syscall(__NR_io_uring_setup, 4, &params);
  if (fd < 0) return false;
  ::close(static_cast<int>(fd));
  return true;
}

struct UringParam {
  static constexpr EngineKind kind = EngineKind::Uring;
};
struct PosixParam {
  static constexpr EngineKind kind = EngineKind::Posix;
};

template <typename Param>
class IoEngineTest : public ::testing::Test {
 protected:
  std::unique_ptr<IoEngine> make(IoOptions options = {}) {
    options.engine = Param::kind;
    options.quiet = true;
    return make_io_engine(options);
  }
  TempDir dir_;
};

class EngineNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return T::kind == EngineKind::Uring ? "uring" : "posix";
  }
};
using Engines = ::testing::Types<UringParam, PosixParam>;
TYPED_TEST_SUITE(IoEngineTest, Engines, EngineNames);

TYPED_TEST(IoEngineTest, RoundTripsManySizesWithODirect) {
  IoOptions options;
  options.block_size = 256 * KiB;
  options.queue_depth = 4;
  auto engine = this->make(options);
  EXPECT_EQ(engine->kind(), TypeParam::kind);
  File file(this->dir_.file("data.bin"), File::Mode::Create, true);
  ASSERT_TRUE(file.direct());
  std::uint64_t offset = 0;
  for (std::size_t bytes : {4 * KiB, 8 * KiB, 68 * KiB, 256 * KiB, 1 * MiB + 4 * KiB, 3 * MiB}) {
    PageBuffer out(bytes), in(bytes);
    fill_pattern(out.data(), bytes, static_cast<unsigned>(bytes));
    engine->run({IoOp::Write, &file, offset, bytes, out.data()});
    engine->run({IoOp::Read, &file, offset, bytes, in.data()});
    ASSERT_EQ(std::memcmp(out.data(), in.data(), bytes), 0) << bytes << " bytes";
    offset += bytes;
  }
  const IoStats s = engine->stats();
  EXPECT_EQ(s.failed_requests, 0u);
  EXPECT_EQ(s.bytes_written, offset);
  EXPECT_EQ(s.bytes_read, offset);
  // 3 MiB in 256 KiB blocks alone is 12 operations each way.
  EXPECT_GE(s.operations, 2 * 12u);
}

TYPED_TEST(IoEngineTest, BufferedFilesTakeAnySizeAndOffset) {
  auto engine = this->make();
  File file(this->dir_.file("buffered.bin"), File::Mode::Create, false);
  EXPECT_FALSE(file.direct());
  std::uint64_t offset = 3;
  for (std::size_t bytes : {1, 17, 4095, 12345, 1000001}) {
    auto out = pattern(bytes, static_cast<unsigned>(bytes));
    std::vector<unsigned char> in(bytes);
    engine->run({IoOp::Write, &file, offset, bytes, out.data()});
    engine->run({IoOp::Read, &file, offset, bytes, in.data()});
    ASSERT_EQ(in, out) << bytes;
    offset += bytes + 1;
  }
}

TYPED_TEST(IoEngineTest, ServesManyConcurrentRequestsFromSeveralThreads) {
  IoOptions options;
  options.block_size = 64 * KiB;
  auto engine = this->make(options);
  File file(this->dir_.file("concurrent.bin"), File::Mode::Create, true);
  constexpr int kThreads = 4, kPerThread = 32;
  constexpr std::size_t kBytes = 128 * KiB;
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      PageBuffer out(kBytes * kPerThread), in(kBytes * kPerThread);
      fill_pattern(out.data(), out.size(), t + 100);
      std::vector<std::future<void>> writes, reads;
      for (int i = 0; i < kPerThread; ++i) {
        const std::uint64_t offset = (static_cast<std::uint64_t>(t) * kPerThread + i) * kBytes;
        writes.push_back(engine->submit({IoOp::Write, &file, offset, kBytes,
                                         out.data() + static_cast<std::size_t>(i) * kBytes}));
      }
      for (auto& w : writes)
        w.get();
      for (int i = 0; i < kPerThread; ++i) {
        const std::uint64_t offset = (static_cast<std::uint64_t>(t) * kPerThread + i) * kBytes;
        reads.push_back(engine->submit(
            {IoOp::Read, &file, offset, kBytes, in.data() + static_cast<std::size_t>(i) * kBytes}));
      }
      for (auto& r : reads)
        r.get();
      if (std::memcmp(out.data(), in.data(), out.size()) != 0) mismatches.fetch_add(1);
    });
  }
  for (auto& th : threads)
    th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(engine->stats().requests, 2u * kThreads * kPerThread);
}

// A completion callback that submits the next request runs on the engine's own thread: the
// io_uring engine takes such a request without waking itself (Note [Waking the engine]). With
// one request in flight at a time, a request it failed to take would never complete.
TYPED_TEST(IoEngineTest, RequestsSubmittedFromCompletionCallbacksComplete) {
  IoOptions options;
  options.block_size = 64 * KiB;
  options.queue_depth = 1;
  auto engine = this->make(options);
  File file(this->dir_.file("chained.bin"), File::Mode::Create, true);
  constexpr std::size_t kBlocks = 64, kBytes = 64 * KiB;
  PageBuffer out(kBlocks * kBytes), in(kBlocks * kBytes);
  fill_pattern(out.data(), out.size(), 7);
  // Runs op on blocks 0..kBlocks-1, each submitted by the previous one's callback.
  auto chain = [&](IoOp op, std::byte* data) {
    std::promise<void> done;
    std::function<void(std::size_t)> issue = [&](std::size_t block) {
      engine->submit({op, &file, block * kBytes, kBytes, data + block * kBytes},
                     [&, block](std::exception_ptr error) {
                       if (error || block + 1 == kBlocks) {
                         error ? done.set_exception(error) : done.set_value();
                         return;
                       }
                       issue(block + 1);
                     });
    };
    issue(0);
    auto finished = done.get_future();
    ASSERT_EQ(finished.wait_for(std::chrono::seconds(30)), std::future_status::ready)
        << "a request submitted from a completion callback did not complete";
    finished.get();
  };
  chain(IoOp::Write, out.data());
  chain(IoOp::Read, in.data());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  EXPECT_EQ(engine->stats().requests, 2 * kBlocks);
}

TYPED_TEST(IoEngineTest, InjectedEioFailsThatRequestOnlyAndLosesNothing) {
  if (!fault_injection_available()) GTEST_SKIP() << "built without fault injection";
  IoOptions options;
  options.block_size = 64 * KiB;
  options.faults = {parse_fault("read:3:eio")};
  auto engine = this->make(options);
  File file(this->dir_.file("eio.bin"), File::Mode::Create, true);
  constexpr std::size_t kBytes = 64 * KiB;  // one operation per request
  PageBuffer out(4 * kBytes), in(4 * kBytes);
  fill_pattern(out.data(), out.size(), 7);
  engine->run({IoOp::Write, &file, 0, out.size(), out.data()});
  for (int i = 0; i < 4; ++i) {
    const std::uint64_t offset = static_cast<std::uint64_t>(i) * kBytes;
    IoRequest r{IoOp::Read, &file, offset, kBytes, in.data() + offset};
    if (i == 2) {
      try {
        engine->run(r);
        FAIL() << "the third read should fail";
      } catch (const IoError& e) {
        EXPECT_EQ(e.error_number(), EIO);
        EXPECT_EQ(e.path(), file.path());
        EXPECT_EQ(e.offset(), offset);
        EXPECT_EQ(e.bytes(), kBytes);
        EXPECT_NE(std::string(e.what()).find(file.path()), std::string::npos) << e.what();
      }
      engine->run(r);  // the retry succeeds: the data was never lost
    } else {
      engine->run(r);
    }
  }
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  EXPECT_EQ(engine->stats().failed_requests, 1u);
}

TYPED_TEST(IoEngineTest, ShortTransfersAreResubmittedForTheRemainder) {
  if (!fault_injection_available()) GTEST_SKIP() << "built without fault injection";
  IoOptions options;
  options.block_size = 1 * MiB;
  options.faults = {parse_fault("write:1:short"), parse_fault("read:1:short"),
                    parse_fault("read:2:short")};
  auto engine = this->make(options);
  File file(this->dir_.file("short.bin"), File::Mode::Create, true);
  PageBuffer out(1 * MiB), in(1 * MiB);
  fill_pattern(out.data(), out.size(), 9);
  engine->run({IoOp::Write, &file, 0, out.size(), out.data()});
  engine->run({IoOp::Read, &file, 0, in.size(), in.data()});
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  EXPECT_EQ(engine->stats().resubmissions, 3u);
  EXPECT_EQ(engine->stats().failed_requests, 0u);
}

TYPED_TEST(IoEngineTest, InjectedEnospcReachesTheWritersFuture) {
  if (!fault_injection_available()) GTEST_SKIP() << "built without fault injection";
  IoOptions options;
  options.faults = {parse_fault("write:2:enospc")};
  auto engine = this->make(options);
  File file(this->dir_.file("enospc.bin"), File::Mode::Create, true);
  PageBuffer buf(64 * KiB);
  engine->run({IoOp::Write, &file, 0, buf.size(), buf.data()});
  auto second = engine->submit({IoOp::Write, &file, buf.size(), buf.size(), buf.data()});
  try {
    second.get();
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_EQ(e.offset(), buf.size());
  }
  engine->run({IoOp::Write, &file, buf.size(), buf.size(), buf.data()});  // serving goes on
}

TYPED_TEST(IoEngineTest, RealEnospcOnAFullFilesystem) {
  SmallTmpfs fs(1 * MiB);
  if (!fs.mounted()) GTEST_SKIP() << fs.why_not() << "; ENOSPC is covered by the injected test";
  auto engine = this->make();
  File file(fs.path() + "/full.bin", File::Mode::Create, true);
  PageBuffer data(2 * MiB);
  try {
    engine->run({IoOp::Write, &file, 0, data.size(), data.data()});
    FAIL() << "wrote 2 MiB into a 1 MiB filesystem";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC) << e.what();
    EXPECT_EQ(e.path(), file.path());
  }
}

TYPED_TEST(IoEngineTest, ReadingPastTheEndOfTheFileIsAnError) {
  auto engine = this->make();
  File file(this->dir_.file("short-file.bin"), File::Mode::Create, true);
  PageBuffer buf(16 * KiB);
  engine->run({IoOp::Write, &file, 0, 8 * KiB, buf.data()});
  EXPECT_THROW(engine->run({IoOp::Read, &file, 0, 16 * KiB, buf.data()}), IoError);
}

TYPED_TEST(IoEngineTest, MisalignedODirectRequestsAreRejectedUpFront) {
  auto engine = this->make();
  File file(this->dir_.file("align.bin"), File::Mode::Create, true);
  PageBuffer buf(16 * KiB);
  EXPECT_THROW(engine->submit({IoOp::Write, &file, 100, 4 * KiB, buf.data()}), Error);
  EXPECT_THROW(engine->submit({IoOp::Write, &file, 0, 100, buf.data()}), Error);
  EXPECT_THROW(engine->submit({IoOp::Write, &file, 0, 4 * KiB, buf.data() + 1}), Error);
  EXPECT_EQ(engine->stats().requests, 0u);
}

// Note [Request sizes]: a request is cut where the device would otherwise split it, and the
// registered buffers say how contiguous their memory is. The expected chunks come from the
// queue limits read here (dev) with the rule written out again, not from DeviceLimits.
TYPED_TEST(IoEngineTest, ChunksAreSizedSoTheDeviceTakesEachWhole) {
  IoOptions options;
  options.block_size = 8 * MiB;
  auto engine = this->make(options);
  File file(this->dir_.file("chunks.bin"), File::Mode::Create, true);
  const DeviceLimits& dev = file.device();
  if (!dev.known()) GTEST_SKIP() << this->dir_.path() << " is on no block device (tmpfs/overlay?)";
  const std::size_t request = 8 * MiB;
  auto whole = [&](std::size_t run, unsigned lost) {
    std::size_t segment = run;
    if (dev.max_segment_bytes != 0 && dev.max_segment_bytes < segment)
      segment = dev.max_segment_bytes;
    std::size_t bytes =
        std::min<std::size_t>(dev.max_request_bytes, (dev.max_segments - lost) * segment);
    std::size_t pow2 = kPageBytes;
    while (pow2 * 2 <= bytes)
      pow2 *= 2;
    return std::min(pow2, request);
  };

  // 4 KiB pages, not registered: one segment a page.
  PageBuffer small_pages(request, /*lock=*/true, "test", HugePages::Off);
  fill_pattern(small_pages.data(), request, 21);
  engine->run({IoOp::Write, &file, 0, request, small_pages.data()});
  const std::size_t small_chunk = whole(kPageBytes, 0);
  EXPECT_LE(small_chunk, dev.max_segments * kPageBytes);
  EXPECT_EQ(engine->stats().operations, request / small_chunk);

  // Registered as 2 MiB runs: one segment a huge page, one more for a chunk starting inside one.
  PageBuffer huge(request, /*lock=*/true, "test", HugePages::Transparent);
  engine->register_buffer(huge.data(), huge.size(), kHugePageBytes);
  ASSERT_EQ(engine->registered_buffers().size(), 1u);
  EXPECT_EQ(engine->registered_buffers()[0].run_bytes, kHugePageBytes);
  const std::uint64_t before = engine->stats().operations;
  engine->run({IoOp::Read, &file, 0, request, huge.data()});
  const std::size_t huge_chunk = whole(kHugePageBytes, 1);
  EXPECT_LE(huge_chunk, dev.max_request_bytes);
  EXPECT_EQ(engine->stats().operations - before, request / huge_chunk);
  EXPECT_EQ(std::memcmp(huge.data(), small_pages.data(), request), 0);
  engine->unregister_buffer(huge.data());
  EXPECT_TRUE(engine->registered_buffers().empty());
}

// A buffer registered only to size its chunks (a lazily touched arena) gets no fixed buffers,
// and its data still arrives.
TYPED_TEST(IoEngineTest, ABufferRegisteredWithoutFixedOpsStillCarriesData) {
  auto engine = this->make();
  File file(this->dir_.file("nofixed.bin"), File::Mode::Create, true);
  PageBuffer a(2 * MiB), b(2 * MiB);
  fill_pattern(a.data(), a.size(), 5);
  engine->register_buffer(b.data(), b.size(), kHugePageBytes, /*fixed=*/false);
  engine->run({IoOp::Write, &file, 0, a.size(), a.data()});
  engine->run({IoOp::Read, &file, 0, b.size(), b.data()});
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0);
  ASSERT_EQ(engine->registered_buffers().size(), 1u);
  EXPECT_FALSE(engine->registered_buffers()[0].fixed);
  engine->unregister_buffer(b.data());
}

TYPED_TEST(IoEngineTest, RegisteredBuffersAndFilesCarryData) {
  IoOptions options;
  options.block_size = 128 * KiB;
  auto engine = this->make(options);
  File file(this->dir_.file("fixed.bin"), File::Mode::Create, true);
  PageBuffer slab(2 * MiB, /*lock=*/true);
  engine->register_buffer(slab.data(), slab.size());
  engine->register_file(file);
  fill_pattern(slab.data(), 1 * MiB, 11);
  engine->run({IoOp::Write, &file, 0, 1 * MiB, slab.data()});
  engine->run({IoOp::Read, &file, 0, 1 * MiB, slab.data() + 1 * MiB});
  EXPECT_EQ(std::memcmp(slab.data(), slab.data() + 1 * MiB, 1 * MiB), 0);
  engine->unregister_file(file);
  engine->unregister_buffer(slab.data());
  engine->run({IoOp::Read, &file, 0, 1 * MiB, slab.data() + 1 * MiB});  // plain ops again
  EXPECT_EQ(std::memcmp(slab.data(), slab.data() + 1 * MiB, 1 * MiB), 0);
  if (TypeParam::kind == EngineKind::Uring) {
    EXPECT_NE(engine->describe().find("fixed buffers on"), std::string::npos) << engine->describe();
  }
}

TEST(IoEngine, AFilesystemWithoutODirectFallsBackToBufferedIo) {
  // tmpfs takes O_DIRECT since Linux 6.6; ramfs still refuses it.
  SmallTmpfs ramfs(0);
  if (!ramfs.mounted()) GTEST_SKIP() << ramfs.why_not();
  File file(ramfs.path() + "/x.bin", File::Mode::Create, true);
  EXPECT_FALSE(file.direct());
  IoOptions options;
  options.quiet = true;
  auto engine = make_io_engine(options);
  auto out = pattern(10000, 1);
  std::vector<unsigned char> in(10000);
  engine->run({IoOp::Write, &file, 1, out.size(), out.data()});
  engine->run({IoOp::Read, &file, 1, in.size(), in.data()});
  EXPECT_EQ(in, out);
}

TEST(IoEngine, OpeningAMissingFileNamesIt) {
  try {
    File f("/nonexistent-dir/file.bin", File::Mode::Read, true);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/file.bin"), std::string::npos);
  }
}

TEST(IoOptions, RejectBadValuesNamingTheKey) {
  IoOptions o;
  o.block_size = 1000;
  EXPECT_THROW(o.validate(), Error);
  o = {};
  o.queue_depth = 0;
  try {
    o.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("io.queue_depth"), std::string::npos);
  }
  EXPECT_THROW(parse_fault("read:0:eio"), Error);
  EXPECT_THROW(parse_fault("seek:1:eio"), Error);
  EXPECT_THROW(parse_engine_kind("aio"), Error);
  const FaultSpec f = parse_fault("write:12:short");
  EXPECT_EQ(f.op, FaultSpec::Op::Write);
  EXPECT_EQ(f.nth, 12u);
  EXPECT_EQ(f.kind, FaultSpec::Kind::Short);
}

TEST(UringEngine, AnUnexpectedRingErrorStopsTheEngineAndEveryRequestFailsWithItsErrno) {
  // Note [A broken ring]: before, the engine looped on the error, printing it on every turn,
  // and the requests never completed.
  if (!fault_injection_available()) GTEST_SKIP() << "built without fault injection";
  TempDir dir;
  IoOptions options;
  options.engine = EngineKind::Uring;
  options.quiet = true;
  options.faults = {parse_fault("ring:2:eio")};  // the wait for the first request's completion
  std::unique_ptr<IoEngine> engine;
  try {
    engine = make_io_engine(options);
  } catch (const Error& e) {
    GTEST_SKIP() << "no io_uring here: " << e.what();
  }
  File file(dir.file("ring.bin"), File::Mode::Create, true);
  PageBuffer out(64 * KiB), in(64 * KiB);
  fill_pattern(out.data(), out.size(), 3);
  engine->run({IoOp::Write, &file, 0, out.size(), out.data()});  // in the kernel: completes
  for (int i = 0; i < 2; ++i) {  // queued when it stopped, or submitted after: both fail
    try {
      engine->run({IoOp::Read, &file, 0, in.size(), in.data()});
      ADD_FAILURE() << "a read on a stopped engine succeeded";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), EIO) << e.what();
      EXPECT_EQ(e.path(), file.path());
      EXPECT_NE(std::string(e.what()).find("io_uring_submit_and_wait"), std::string::npos)
          << e.what();
    }
  }
  try {
    engine->register_buffer(in.data(), in.size());
    ADD_FAILURE() << "a stopped engine registered a buffer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stopped"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_fault("ring:1:short"), Error);
  EXPECT_EQ(parse_fault("ring:3:enospc").op, FaultSpec::Op::Ring);
}

TEST(IoEngine, AutoPicksUringWhereTheKernelHasIt) {
  IoOptions options;
  options.quiet = true;
  auto engine = make_io_engine(options);
  if (kernel_opens_a_ring(0)) {
    EXPECT_EQ(engine->kind(), EngineKind::Uring) << engine->describe();
  } else {
    std::printf("  (this kernel opens no io_uring: auto must pick posix)\n");
    EXPECT_EQ(engine->kind(), EngineKind::Posix) << engine->describe();
  }
  EXPECT_FALSE(engine->describe().empty());
}

}  // namespace
}  // namespace strata::testing

namespace strata::testing {
namespace {

TEST(UringEngine, RunsWithAKernelSubmissionThread) {
  IoOptions options;
  options.engine = EngineKind::Uring;
  options.sqpoll = true;
  options.quiet = true;
  auto engine = make_io_engine(options);
  TempDir dir;
  File file(dir.file("sqpoll.bin"), File::Mode::Create, true);
  PageBuffer out(2 * MiB), in(2 * MiB);
  fill_pattern(out.data(), out.size(), 4);
  engine->run({IoOp::Write, &file, 0, out.size(), out.data()});
  engine->run({IoOp::Read, &file, 0, in.size(), in.data()});
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  // Where the kernel refuses SQPOLL the flag is dropped, not fatal; describe() says which.
  const bool granted = kernel_opens_a_ring(IORING_SETUP_SQPOLL);
  if (!granted) std::printf("  (this kernel refuses SQPOLL: the engine must run without it)\n");
  EXPECT_EQ(engine->describe().find("(sqpoll,") != std::string::npos, granted)
      << engine->describe();
}

}  // namespace
}  // namespace strata::testing
