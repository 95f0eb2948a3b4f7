// Many threads acquiring and releasing at once; run under ThreadSanitizer in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>
#include <thread>

#include "runtime/runtime_fixture.h"
#include "strata/base/error.h"
#include "strata/quant/group_quant.h"

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
  std::atomic<int> wrong{0}, oom{0}, rounds_done{0};
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
          rounds_done.fetch_add(1);
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
  // The work was done: eight leases at once (768 KiB at most) fit the 1 MiB device, so a refusal
  // is the odd moment prefetched copies still land; most rounds must complete, each byte checked.
  std::printf("eight threads: %d of %d rounds done, %d out-of-memory refusals\n",
              rounds_done.load(), kThreads * kRounds, oom.load());
  EXPECT_GE(rounds_done.load(), kThreads * kRounds * 3 / 4);
  EXPECT_EQ(rounds_done.load() + oom.load(), kThreads * kRounds);
  for (int i = 0; i < kShared; ++i)
    EXPECT_EQ(contents(rt, shared[i]), shared_data[i]);
  EXPECT_EQ(rt.tier_stats(Tier::Device).leased_bytes, 0u);
}

// Makes a write-back on the thread that marks itself `held` wait inside make_room (as if its
// victim were still landing), with the runtime's lock released, until another thread has made the
// room; every other caller gets least-recently-used.
class HoldWriteBack final : public EvictionPolicy {
 public:
  static thread_local bool held;
  std::atomic<bool> holding{true};
  std::atomic<bool> parked{false};

  std::size_t choose(Tier tier, const std::vector<EvictionCandidate>& candidates) override {
    if (held && holding.load()) {
      parked.store(true);
      parked.notify_all();
      return candidates.size();  // not a candidate: make_room waits for a change
    }
    return lru_.choose(tier, candidates);
  }

 private:
  LruPolicy lru_;
};
thread_local bool HoldWriteBack::held = false;

// A write-back (device -> host) that waits for room on the host while a lease on the host starts
// the same device -> host move must join that move, not start a second one into the host copy:
// the second copy would land in bytes the lease already reads or writes (what ThreadSanitizer
// saw in the ZeRO-Offload example: Adam reading a gradient while the d2h stream rewrote it).
// Note [Compaction without the lock]: while a copy slides down, readers keep asking for it (a
// lease, read()) and for its neighbour; every lease and read sees the tensor's bytes, wherever
// they are at that moment.
TEST(RuntimeConcurrency, CopiesSlidingDownWithoutTheLockKeepTheirBytesForEveryReader) {
  TempDir dir;
  Budgets b;
  b.device = 512 * KiB;
  b.host = 2 * MiB;
  Runtime rt(small_options(dir.path(), b));
  constexpr int kRounds = 30;
  std::atomic<int> wrong{0}, oom{0};
  int big_refused = 0;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<TensorId> t;
    std::vector<std::vector<unsigned char>> data;
    for (int i = 0; i < 4; ++i) {
      data.push_back(pattern(128 * KiB, 100 * round + i));
      t.push_back(rt.create_tensor(desc("t" + std::to_string(i), 128 * KiB), Tier::Host,
                                   data.back().data()));
      rt.acquire(t[i], Tier::Device, Access::Read).get().wait();
    }
    rt.evict(t[0], Tier::Device);
    rt.evict(t[2], Tier::Device);  // 256 KiB free in two holes: placing 256 KiB compacts
    const auto big_data = pattern(256 * KiB, 100 * round + 50);
    const TensorId big = rt.create_tensor(desc("big", 256 * KiB), Tier::Host, big_data.data());
    std::atomic<bool> done{false};
    const auto reader = [&](int i, bool leases) {
      std::vector<unsigned char> out(128 * KiB);
      while (!done.load()) {
        try {
          if (leases) {
            Lease l = rt.acquire(t[i], Tier::Device, Access::Read).get();
            if (leased_bytes(l) != data[i]) wrong.fetch_add(1);
          } else {
            rt.read(t[i], out.data(), out.size());
            if (out != data[i]) wrong.fetch_add(1);
          }
        } catch (const OutOfMemoryError&) {
          oom.fetch_add(1);  // big and both readers' copies may not fit at once
        }
      }
    };
    std::thread r1(reader, 1, true), r3(reader, 3, true), read1(reader, 1, false);
    try {
      Lease l = rt.acquire(big, Tier::Device, Access::Read).get();
      if (leased_bytes(l) != big_data) wrong.fetch_add(1);
    } catch (const OutOfMemoryError&) {
      ++big_refused;  // both neighbours leased at that moment: nothing could slide
    }
    done.store(true);
    r1.join();
    r3.join();
    read1.join();
    for (TensorId id : t)
      rt.destroy_tensor(id);
    rt.destroy_tensor(big);
  }
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(rt.tier_stats(Tier::Device).compactions, 0u);
  EXPECT_LT(big_refused, kRounds);
  std::printf("compactions %llu, big refused %d of %d, reader OOMs %d\n",
              static_cast<unsigned long long>(rt.tier_stats(Tier::Device).compactions), big_refused,
              kRounds, oom.load());
}

TEST(RuntimeConcurrency, AWriteBackJoinsTheMoveAlreadyLandingInItsTarget) {
  TempDir dir;
  Budgets b;
  b.device = 512 * KiB;
  b.host = 1 * MiB;  // 4 x 64 KiB staging: the host tier holds three 256 KiB copies
  Runtime rt(small_options(dir.path(), b));
  constexpr std::size_t kBytes = 256 * KiB;
  for (int i = 0; i < 3; ++i) {  // fill the host tier with clean copies (NVMe holds them too)
    const auto data = pattern(kBytes, 10 + i);
    const TensorId z =
        rt.create_tensor(desc("z" + std::to_string(i), kBytes), Tier::Nvme, data.data());
    rt.prefetch(z, Tier::Host);
  }
  rt.synchronize();
  ASSERT_EQ(rt.tier_stats(Tier::Host).used_bytes, rt.tier_stats(Tier::Host).capacity_bytes);
  const auto before = pattern(kBytes, 1), after = pattern(kBytes, 2);
  const TensorId g = rt.create_tensor(desc("grad", kBytes, TensorKind::Grad), Tier::Device,
                                      before.data());  // its only copy: dirty on the device
  const std::uint64_t host_moves = rt.tier_stats(Tier::Host).moves;
  auto policy = std::make_shared<HoldWriteBack>();
  rt.set_eviction_policy(policy);

  // The write-back thread: evict(g, Device) writes g back to the host, whose make_room waits.
  std::future<bool> evicted = std::async(std::launch::async, [&] {
    HoldWriteBack::held = true;
    return rt.evict(g, Tier::Device);
  });
  policy->parked.wait(false);
  // The d2h stream is held while the lease's move is queued, so that the write-back resumes
  // while that move is still landing (as in the example, where the link was busy).
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  rt.backend().d2h_stream().launch_host_func([gate] { gate.wait(); });
  bool opened = false;
  const auto open_gate = [&] {
    if (!std::exchange(opened, true)) open.set_value();
  };
  try {
    LeaseFuture future = rt.acquire(g, Tier::Host, Access::ReadWrite);  // makes room, moves g
    policy->holding.store(false);
    open_gate();
    Lease lease = future.get();
    EXPECT_EQ(leased_bytes(lease), before);
    std::memcpy(lease.data(), after.data(), kBytes);
  } catch (...) {
    open_gate();
    throw;
  }
  EXPECT_TRUE(evicted.get());  // it was dirty: its bytes went down (with the lease's move)
  rt.synchronize();
  EXPECT_FALSE(rt.resident(g, Tier::Device));
  EXPECT_EQ(contents(rt, g), after);  // a second move would have put `before` back
  // Exactly one move into the host copy: the device's bytes crossed the link once.
  EXPECT_EQ(rt.tier_stats(Tier::Host).moves, host_moves + 1);
  EXPECT_EQ(rt.transfer_stats().bytes_device_to_host, kBytes);
  rt.set_eviction_policy(std::make_shared<LruPolicy>());
}

// Note [A device prefetch does not wait for NVMe]: six threads prefetch compressed tensors to
// the device (device moves begun behind their NVMe reads) and acquire them, while others evict
// their host copies; every lease holds the dequantized stored bytes.
TEST(RuntimeConcurrency, CompressedTensorsPrefetchedAndAcquiredFromSixThreads) {
  TempDir dir;
  Budgets b;
  b.device = 400 * KiB;  // five 75 KiB device copies
  b.host = 4 * 64 * KiB + 160 * KiB;
  Runtime rt(small_options(dir.path(), b));
  constexpr std::int64_t rows = 96, cols = 200;
  constexpr int kThreads = 6, kTensors = 10, kRounds = 40;
  std::vector<TensorId> ids;
  std::vector<std::vector<float>> want;
  for (int i = 0; i < kTensors; ++i) {
    const quant::Scheme scheme{i % 2 ? quant::Bits::Int4 : quant::Bits::Int8, 64};
    std::vector<float> v(rows * cols);
    std::mt19937 rng(i);
    std::normal_distribution<float> normal(0.0f, 0.05f);
    for (float& x : v)
      x = normal(rng);
    TensorDesc d;
    d.name = "w" + std::to_string(i);
    d.dtype = DType::F32;
    d.shape = {rows, cols};
    d.compression = {quant::codec_of(scheme.bits), scheme.group};
    ids.push_back(rt.create_tensor(d, Tier::Nvme, v.data()));
    const quant::Layout l = quant::layout(scheme, rows, cols);
    std::vector<std::byte> packed(l.bytes);
    quant::quantize(scheme, l, DType::F32, v.data(), packed.data(), d.name);
    want.emplace_back(v.size());
    quant::dequantize(scheme.bits, l, packed.data(), DType::F32, want.back().data(), 0, rows);
  }
  std::atomic<int> wrong{0}, oom{0}, acquired{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int r = 0; r < kRounds; ++r) {
        const int i = static_cast<int>(rng() % kTensors);
        try {
          rt.prefetch(ids[(i + 1) % kTensors], Tier::Device);
          Lease w = rt.acquire(ids[i], Tier::Device, Access::Read).get();
          w.wait();
          const float* p = w.as<const float>();
          if (!std::equal(want[i].begin(), want[i].end(), p)) wrong.fetch_add(1);
          acquired.fetch_add(1);
        } catch (const OutOfMemoryError&) {
          oom.fetch_add(1);  // six leases and the prefetches may want more than the device holds
        }
        if (r % 5 == t % 5) rt.evict(ids[(i + 3) % kTensors], Tier::Host);
      }
    });
  }
  for (auto& th : threads)
    th.join();
  rt.synchronize();
  EXPECT_EQ(wrong.load(), 0);
  // Every copy that arrived on the device was dequantized once, whole (all ten are compressed),
  // and the device (five copies of ten) made many arrivals.
  const TierStats device = rt.tier_stats(Tier::Device);
  const std::uint64_t full_bytes = rows * cols * sizeof(float);
  std::printf(
      "compressed, six threads: %d of %d acquires, %d out-of-memory refusals, %llu "
      "arrivals\n",
      acquired.load(), kThreads * kRounds, oom.load(),
      static_cast<unsigned long long>(device.moves));
  EXPECT_EQ(device.dequantizations, device.moves);
  EXPECT_EQ(device.bytes_dequantized, device.moves * full_bytes);
  EXPECT_GE(device.moves, static_cast<std::uint64_t>(kTensors));
  EXPECT_GE(acquired.load(), kThreads * kRounds / 2);
  EXPECT_EQ(device.leased_bytes, 0u);
}

}  // namespace
}  // namespace strata::testing
