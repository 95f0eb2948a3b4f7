// Many threads acquiring and releasing at once; run under ThreadSanitizer in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "runtime/runtime_fixture.h"
#include "strata/io/error.h"

namespace strata::testing {
namespace {

TEST(RuntimeConcurrency, EightThreadsAcquireAndReleaseAtOnce) {
  TempDir dir;
  Budgets b;
  b.device = 1 * MiB;
  b.host = 2 * MiB;
  Runtime rt(small_options(dir.path(), b));
  // Shared read-only weights, and per-thread tensors each thread rewrites.
  constexpr int kThreads = 8, kShared = 12, kRounds = 60;
  std::vector<TensorId> shared;
  std::vector<std::vector<unsigned char>> shared_data;
  for (int i = 0; i < kShared; ++i) {
    shared_data.push_back(pattern(96 * KiB, i));
    shared.push_back(rt.create_tensor(desc("w" + std::to_string(i), 96 * KiB), Tier::Nvme,
                                      shared_data.back().data()));
  }
  std::atomic<int> wrong{0}, oom{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto mine_data = pattern(64 * KiB, 1000 + t);
      const TensorId mine = rt.create_tensor(desc("mine" + std::to_string(t), 64 * KiB), Tier::Host,
                                             mine_data.data());
      std::mt19937 rng(t);
      for (int r = 0; r < kRounds; ++r) {
        try {
          const int i = static_cast<int>(rng() % kShared);
          {
            Lease w =
                rt.acquire(shared[i], rng() % 2 ? Tier::Device : Tier::Host, Access::Read).get();
            if (leased_bytes(w) != shared_data[i]) wrong.fetch_add(1);
          }
          {
            Lease m = rt.acquire(mine, Tier::Device, Access::ReadWrite).get();
            if (leased_bytes(m) != mine_data) wrong.fetch_add(1);
            mine_data = pattern(64 * KiB, 5000 + t * 100 + r);
            std::memcpy(m.data(), mine_data.data(), mine_data.size());
          }
          if (r % 7 == 0) rt.prefetch(shared[(i + 1) % kShared], Tier::Device);
          if (r % 11 == 0) rt.evict(mine, Tier::Device);
        } catch (const OutOfMemoryError&) {
          oom.fetch_add(1);  // 8 threads may momentarily lease more than the device holds
        }
      }
      if (contents(rt, mine) != mine_data) wrong.fetch_add(1);
      rt.destroy_tensor(mine);
    });
  }
  for (auto& th : threads)
    th.join();
  EXPECT_EQ(wrong.load(), 0);
  for (int i = 0; i < kShared; ++i)
    EXPECT_EQ(contents(rt, shared[i]), shared_data[i]);
  EXPECT_EQ(rt.tier_stats(Tier::Device).leased_bytes, 0u);
}

}  // namespace
}  // namespace strata::testing
