// I/O under concurrency: run under ThreadSanitizer in CI (label "concurrency").
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "io/io_test_util.h"
#include "strata/io/swap_space.h"
#include "strata/base/units.h"

namespace strata::testing {
namespace {

class IoConcurrency : public ::testing::TestWithParam<EngineKind> {};

TEST_P(IoConcurrency, SwapExtentsFromSixThreadsKeepTheirBytes) {
  IoOptions io;
  io.engine = GetParam();
  io.block_size = 64 * KiB;
  io.queue_depth = 8;
  io.quiet = true;
  auto engine = make_io_engine(io);
  TempDir a, b;
  SwapOptions o;
  o.paths = {a.path(), b.path()};
  o.capacity_bytes = 32 * MiB;
  o.stripe_bytes = 64 * KiB;
  SwapSpace swap(o, *engine);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 8; ++round) {
        const std::size_t bytes = 1000 + static_cast<std::size_t>(t * 70001 + round * 13331);
        auto data = pattern(bytes, static_cast<unsigned>(t * 100 + round));
        std::vector<unsigned char> back(bytes);
        const ExtentId id = swap.allocate(bytes);
        swap.write(id, 0, data.data(), bytes).get();
        swap.read(id, 0, back.data(), bytes).get();
        if (back != data) bad.fetch_add(1);
        swap.release(id);
      }
    });
  }
  for (auto& th : threads)
    th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(swap.stats().current_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Engines, IoConcurrency,
                         ::testing::Values(EngineKind::Uring, EngineKind::Posix),
                         [](const auto& p) { return std::string(to_string(p.param)); });

}  // namespace
}  // namespace strata::testing
