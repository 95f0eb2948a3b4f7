// Concurrency: run under ThreadSanitizer in CI (label "concurrency").
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "runtime/backend_fixture.h"
#include "strata/base/units.h"

namespace strata::testing {
namespace {

template <typename Param>
class BackendConcurrency : public BackendTest<Param> {};
TYPED_TEST_SUITE(BackendConcurrency, BackendParams, BackendParamNames);

TYPED_TEST(BackendConcurrency, DevicePoolServesEightThreadsWithoutOverlap) {
  Backend& b = this->backend();
  constexpr int kThreads = 8, kOps = 1500;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<void*, std::size_t>> mine;
      std::vector<unsigned char> expect, got;
      for (int op = 0; op < kOps; ++op) {
        if (mine.empty() || rng() % 2 == 0) {
          const std::size_t bytes = 256 + rng() % (64 * KiB);
          void* p = b.device_pool().try_allocate(bytes);
          if (p == nullptr) continue;  // budget momentarily full: fine
          expect.assign(bytes, static_cast<unsigned char>(t + 1));
          b.copy(p, expect.data(), bytes, CopyKind::HostToDevice);
          mine.emplace_back(p, bytes);
        } else {
          auto [p, bytes] = mine.back();
          mine.pop_back();
          got.assign(bytes, 0);
          b.copy(got.data(), p, bytes, CopyKind::DeviceToHost);
          // Another thread writing into this block would change these bytes.
          for (unsigned char c : got)
            if (c != static_cast<unsigned char>(t + 1)) {
              failures.fetch_add(1);
              break;
            }
          b.deallocate_device(p);
        }
      }
      for (auto [p, bytes] : mine)
        b.deallocate_device(p);
    });
  }
  for (auto& th : threads)
    th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(b.device_stats().current_bytes, 0u);
  EXPECT_EQ(b.device_stats().largest_free_bytes, b.info().budget_bytes);
}

TYPED_TEST(BackendConcurrency, ManyThreadsEnqueueOntoOneStreamInOrderPerThread) {
  Stream& s = this->backend().compute_stream();
  constexpr int kThreads = 8, kPerThread = 500;
  std::vector<std::vector<int>> seen(kThreads);  // written only by the stream's host thread
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i)
        s.launch_host_func([&seen, t, i] { seen[t].push_back(i); });
    });
  }
  for (auto& th : threads)
    th.join();
  s.synchronize();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), static_cast<std::size_t>(kPerThread));
    for (int i = 0; i < kPerThread; ++i)
      ASSERT_EQ(seen[t][i], i);
  }
}

TYPED_TEST(BackendConcurrency, EventChainCarriesDataThroughFourStreams) {
  Backend& b = this->backend();
  constexpr std::size_t kBytes = 256 * KiB;
  constexpr int kStages = 4, kRounds = 50;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<std::unique_ptr<Event>> events;
  std::vector<void*> buffers;
  for (int i = 0; i < kStages; ++i) {
    streams.push_back(b.create_stream("stage" + std::to_string(i)));
    events.push_back(b.create_event());
    buffers.push_back(b.allocate_device(kBytes));
  }
  std::vector<unsigned char> src(kBytes), out(kBytes);
  for (int round = 0; round < kRounds; ++round) {
    for (std::size_t i = 0; i < kBytes; ++i)
      src[i] = static_cast<unsigned char>(i + round);
    streams[0]->copy_async(buffers[0], src.data(), kBytes, CopyKind::HostToDevice);
    streams[0]->record(*events[0]);
    for (int i = 1; i < kStages; ++i) {
      streams[i]->wait(*events[i - 1]);
      streams[i]->copy_async(buffers[i], buffers[i - 1], kBytes, CopyKind::DeviceToDevice);
      streams[i]->record(*events[i]);
    }
    streams[kStages - 1]->copy_async(out.data(), buffers[kStages - 1], kBytes,
                                     CopyKind::DeviceToHost);
    streams[kStages - 1]->synchronize();
    ASSERT_EQ(out, src) << "round " << round;
    // The next round overwrites src and buffer 0: wait until every stage has consumed them.
    for (auto& s : streams)
      s->synchronize();
  }
  for (void* p : buffers)
    b.deallocate_device(p);
}

TEST(HostBackendConcurrency, EventSynchronizeFromManyThreads) {
  BackendOptions options;
  options.kind = BackendKind::Host;
  options.device_budget_bytes = 1 * MiB;
  auto b = make_backend(options);
  auto e = b->create_event();
  std::atomic<int> ran{0};
  b->compute_stream().launch_host_func([&ran] { ran.store(1); });
  b->compute_stream().record(*e);
  std::vector<std::thread> waiters;
  std::atomic<int> saw{0};
  for (int i = 0; i < 8; ++i)
    waiters.emplace_back([&] {
      e->synchronize();
      saw.fetch_add(ran.load());
    });
  for (auto& w : waiters)
    w.join();
  EXPECT_EQ(saw.load(), 8);
}

}  // namespace
}  // namespace strata::testing
