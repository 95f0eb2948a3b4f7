// strata-microbench (Google Benchmark): the residency manager's fixed costs and move rates.
//   BM_AcquireReleaseResident   acquire + release of a tensor already on the device
//   BM_NvmeToDevice/<MiB>       NVMe -> device move of one tensor (staging pipeline)
//   BM_NvmeRead/<MiB>           the io engine alone reading as many bytes into pinned memory
//   BM_AcquireDuringCompaction/<MiB>
//                               a device acquire that compacts (slides three copies, two of
//                               <MiB>), timed; meanwhile another thread acquires and releases a
//                               host tensor: other_max_us is its slowest acquire+release (what
//                               the compaction held it up), other_ops how many it did
// NVMe files go to $STRATA_BENCH_DIR (default /var/tmp).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "strata/base/units.h"
#include "strata/io/file.h"
#include "strata/io/io_engine.h"
#include "strata/io/pages.h"
#include "strata/runtime/runtime.h"

namespace {

using namespace strata;

std::string bench_dir() {
  const char* env = std::getenv("STRATA_BENCH_DIR");
  std::string dir = env != nullptr && *env != '\0' ? env : "/var/tmp";
  dir += "/strata-microbench";
  std::filesystem::create_directories(dir);
  return dir;
}

// Non-zero, non-repeating bytes: zeros can be served by a storage layer without reading.
void fill(PageBuffer& buffer) {
  auto* words = reinterpret_cast<std::uint64_t*>(buffer.data());
  std::uint64_t x = 88172645463325252ULL;
  for (std::size_t i = 0; i < buffer.size() / 8; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    words[i] = x;
  }
}

RuntimeOptions options(std::size_t device, std::size_t host) {
  RuntimeOptions o;
  o.backend.kind = BackendKind::Host;
  o.backend.device_budget_bytes = device;
  o.host_budget_bytes = host;
  o.nvme.paths = {bench_dir()};
  o.nvme.capacity_bytes = 1 * GiB;
  o.nvme.stripe_bytes = 1 * MiB;
  o.staging_chunk_bytes = 4 * MiB;
  o.staging_chunks = 8;
  o.quiet = true;
  return o;
}

void BM_AcquireReleaseResident(benchmark::State& state) {
  Runtime rt(options(64 * MiB, 64 * MiB));
  TensorDesc d;
  d.name = "w";
  d.bytes = 1 * MiB;
  const TensorId t = rt.create_tensor(d, Tier::Device);
  for (auto _ : state) {
    Lease lease = rt.acquire(t, Tier::Device, Access::Read).get();
    benchmark::DoNotOptimize(lease.data());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AcquireReleaseResident);

void BM_NvmeToDevice(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) * MiB;
  Runtime rt(options(bytes + 64 * MiB, 64 * MiB));  // the host tier cannot hold it: staging
  TensorDesc d;
  d.name = "layer";
  d.bytes = bytes;
  PageBuffer init(bytes);
  fill(init);
  const TensorId t = rt.create_tensor(d, Tier::Nvme, init.data());
  for (auto _ : state) {
    Lease lease = rt.acquire(t, Tier::Device, Access::Read).get();
    lease.wait();
    lease.release();
    state.PauseTiming();
    rt.evict(t, Tier::Device);  // clean: dropped
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_NvmeToDevice)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

// The io engine alone reading the same number of bytes from a file in the same directory, with
// the runtime's engine settings: the rate BM_NvmeToDevice is measured against.
void BM_NvmeRead(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) * MiB;
  const RuntimeOptions o = options(64 * MiB, 64 * MiB);
  auto engine = make_io_engine(o.io);
  const std::string path = bench_dir() + "/engine-read.dat";
  PageBuffer buffer(bytes, true);
  fill(buffer);
  engine->register_buffer(buffer.data(), buffer.size());
  {
    File file(path, File::Mode::Create, true);
    engine->run({IoOp::Write, &file, 0, bytes, buffer.data()});
  }
  File file(path, File::Mode::Read, true);
  for (auto _ : state)
    engine->run({IoOp::Read, &file, 0, bytes, buffer.data()});
  engine->unregister_buffer(buffer.data());
  std::filesystem::remove(path);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_NvmeRead)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AcquireDuringCompaction(benchmark::State& state) {
  using Clock = std::chrono::steady_clock;
  const std::size_t n = static_cast<std::size_t>(state.range(0)) * MiB;
  double max_us_sum = 0, ops_sum = 0;
  for (auto _ : state) {
    // Device: [a n][b n][c n][small 1 MiB][free n]; a evicted leaves 2n free in two holes, so
    // placing 2n slides b, c and small down (Note [Compaction without the lock]).
    RuntimeOptions o = options(4 * n + 1 * MiB, 5 * n + 8 * MiB);
    o.nvme.paths.clear();
    o.staging_chunk_bytes = 1 * MiB;
    o.staging_chunks = 2;
    Runtime rt(o);
    const auto make = [&](const char* name, std::size_t bytes, Tier tier) {
      TensorDesc d;
      d.name = name;
      d.bytes = bytes;
      return rt.create_tensor(d, tier);
    };
    const TensorId a = make("a", n, Tier::Host), b = make("b", n, Tier::Host),
                   c = make("c", n, Tier::Host), small = make("small", 1 * MiB, Tier::Host);
    for (TensorId t : {a, b, c, small})
      rt.acquire(t, Tier::Device, Access::Read).get().wait();
    rt.evict(a, Tier::Device);
    const TensorId big = make("big", 2 * n, Tier::Host);
    const TensorId other = make("other", 4 * KiB, Tier::Host);
    std::atomic<bool> done{false};
    double max_us = 0;
    double ops = 0;
    std::thread reader([&] {
      while (!done.load(std::memory_order_acquire)) {
        const auto t0 = Clock::now();
        { Lease l = rt.acquire(other, Tier::Host, Access::Read).get(); }
        max_us =
            std::max(max_us, std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        ops += 1;
      }
    });
    const auto start = Clock::now();
    Lease l = rt.acquire(big, Tier::Device, Access::Read).get();
    l.wait();
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - start).count());
    done.store(true, std::memory_order_release);
    reader.join();
    if (rt.tier_stats(Tier::Device).compactions < 3) state.SkipWithError("no compaction ran");
    max_us_sum += max_us;
    ops_sum += ops;
  }
  state.counters["other_max_us"] = max_us_sum / static_cast<double>(state.iterations());
  state.counters["other_ops"] = ops_sum / static_cast<double>(state.iterations());
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(2 * n + 1 * MiB));
}
BENCHMARK(BM_AcquireDuringCompaction)->Arg(256)->Unit(benchmark::kMillisecond)->UseManualTime();

}  // namespace

BENCHMARK_MAIN();
