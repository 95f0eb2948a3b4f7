// strata-bench alloc: replays a synthetic, training-like allocation trace on the RangeAllocator
// and on malloc/free (glibc's defaults, and glibc keeping large blocks), and reports throughput
// and fragmentation.
#include <malloc.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "strata/base/error.h"
#include "strata/io/range_allocator.h"
#include "strata/base/units.h"

namespace strata::bench {
namespace {

struct Op {
  std::uint32_t id;
  std::uint32_t bytes;  // 0 = free
};

struct Trace {
  std::vector<Op> ops;
  std::uint32_t ids = 0;
  std::uint64_t peak_live_bytes = 0;
  std::uint64_t min_bytes = ~0ULL, max_bytes = 0;
};

// Note [Training-like trace]: one iteration of a transformer-ish model with per-layer weights
// brought in and dropped (offload), activations kept from forward to backward, short-lived
// temporaries inside each layer, and gradients that live until a few layers later (write-back).
// The token count changes every iteration, so activation and temporary sizes change and blocks
// freed in one iteration do not fit the next exactly — the case that fragments allocators.
class TraceBuilder {
 public:
  TraceBuilder(std::uint64_t seed, std::uint64_t hidden, int layers)
      : rng_(seed), hidden_(hidden), layers_(layers) {}

  Trace build(std::size_t min_ops) {
    while (trace_.ops.size() < min_ops)
      iteration();
    return std::move(trace_);
  }

 private:
  static constexpr std::uint64_t kMax = 256 * MiB;
  static constexpr std::uint64_t kMin = 4 * KiB;

  std::uint32_t alloc(std::uint64_t bytes) {
    bytes = std::clamp(bytes, kMin, kMax);
    const std::uint32_t id = trace_.ids++;
    trace_.ops.push_back({id, static_cast<std::uint32_t>(bytes)});
    live_ += bytes;
    sizes_.resize(trace_.ids);
    sizes_[id] = bytes;
    trace_.peak_live_bytes = std::max(trace_.peak_live_bytes, live_);
    trace_.min_bytes = std::min(trace_.min_bytes, bytes);
    trace_.max_bytes = std::max(trace_.max_bytes, bytes);
    return id;
  }
  void release(std::uint32_t id) {
    trace_.ops.push_back({id, 0});
    live_ -= sizes_[id];
  }
  std::uint64_t jitter(std::uint64_t bytes) {  // +-12.5%, 256-byte granules
    std::uniform_int_distribution<std::uint64_t> d(bytes - bytes / 8, bytes + bytes / 8);
    return d(rng_) / 256 * 256 + 256;
  }
  std::vector<std::uint32_t> layer_weights() {
    const std::uint64_t h2 = hidden_ * hidden_ * 2;  // bf16 [h, h]
    return {alloc(h2),
            alloc(h2),
            alloc(h2),
            alloc(h2),  // q, k, v, o
            alloc(4 * h2),
            alloc(4 * h2),  // mlp up, down
            alloc(hidden_ * 2),
            alloc(hidden_ * 2),  // norms
            alloc(4 * hidden_ * 2),
            alloc(hidden_ * 2)};  // biases
  }

  void iteration() {
    std::uniform_int_distribution<std::uint64_t> tokens_d(512, 8192);
    const std::uint64_t tokens = tokens_d(rng_);
    const std::uint64_t act = tokens * hidden_ * 2;
    std::vector<std::vector<std::uint32_t>> saved(layers_);
    const std::uint32_t embed = alloc(kMax);
    // forward
    for (int l = 0; l < layers_; ++l) {
      auto w = layer_weights();
      saved[l].push_back(alloc(jitter(act)));
      std::vector<std::uint32_t> tmp{alloc(jitter(3 * act)), alloc(jitter(tokens * tokens * 2 / 4)),
                                     alloc(jitter(4 * act))};
      saved[l].push_back(alloc(jitter(act)));
      saved[l].push_back(alloc(jitter(4 * act)));
      for (int s = 0; s < 4; ++s)
        tmp.push_back(alloc(4 * KiB * (s + 1)));
      for (auto id : tmp)
        release(id);
      for (auto id : w)
        release(id);
    }
    // backward, gradients written back two layers later
    std::vector<std::vector<std::uint32_t>> grads;
    for (int l = layers_ - 1; l >= 0; --l) {
      auto w = layer_weights();
      std::vector<std::uint32_t> tmp{alloc(jitter(4 * act)), alloc(jitter(3 * act))};
      std::vector<std::uint32_t> g;
      for (auto id : w)
        g.push_back(alloc(sizes_[id]));
      for (auto id : tmp)
        release(id);
      for (auto it = saved[l].rbegin(); it != saved[l].rend(); ++it)
        release(*it);
      for (auto id : w)
        release(id);
      grads.push_back(std::move(g));
      if (grads.size() > 2) {
        for (auto id : grads.front())
          release(id);
        grads.erase(grads.begin());
      }
    }
    for (auto& g : grads)
      for (auto id : g)
        release(id);
    release(embed);
  }

  std::mt19937_64 rng_;
  std::uint64_t hidden_;
  int layers_;
  Trace trace_;
  std::uint64_t live_ = 0;
  std::vector<std::uint64_t> sizes_;
};

double replay_range(const Trace& trace, RangeAllocator& ranges, std::vector<std::uint64_t>& at) {
  const auto start = Clock::now();
  for (const Op& op : trace.ops) {
    if (op.bytes != 0)
      at[op.id] = ranges.allocate(op.bytes);
    else
      ranges.deallocate(at[op.id]);
  }
  return seconds_since(start);
}

double replay_malloc(const Trace& trace, std::vector<void*>& at) {
  const auto start = Clock::now();
  for (const Op& op : trace.ops) {
    if (op.bytes != 0) {
      at[op.id] = std::malloc(op.bytes);
      if (at[op.id] == nullptr) std::abort();
    } else {
      std::free(at[op.id]);
    }
  }
  return seconds_since(start);
}

// Note [malloc variants]: glibc serves a block above M_MMAP_THRESHOLD (128 KiB at first, raised
// as mmapped blocks are freed, up to 32 MiB) with a fresh mmap and returns it with munmap on free,
// so by default every large block costs two system calls and a page fault; the RangeAllocator
// keeps its range. The "cached" variant makes glibc keep large blocks too: M_MMAP_MAX = 0 (no
// mmap at all: M_MMAP_THRESHOLD alone cannot be raised above 32 MiB, and the trace has blocks of
// up to 256 MiB) and M_TRIM_THRESHOLD = -1 (the top of the heap is never given back), so every
// block comes from the heap and is reused. mallopt is process-global and setting a threshold
// ends glibc's dynamic adjustment for good, so the default variant runs first and completely,
// before any mallopt call. An untimed replay of each variant samples mallinfo2 after every
// allocation; the most mmapped blocks held at once proves which variant used mmap.

// Replays the trace once, untimed, and returns the most of its blocks malloc held in mmapped
// chunks at once (mallinfo2().hblks, less the mmapped blocks live before: the trace itself).
std::size_t peak_mmapped_blocks(const Trace& trace, std::vector<void*>& at) {
  const std::size_t before = ::mallinfo2().hblks;
  std::size_t peak = before;
  for (const Op& op : trace.ops) {
    if (op.bytes != 0) {
      at[op.id] = std::malloc(op.bytes);
      if (at[op.id] == nullptr) std::abort();
      peak = std::max(peak, ::mallinfo2().hblks);
    } else {
      std::free(at[op.id]);
    }
  }
  return peak - before;
}

// Switches glibc to keeping every block on its heap (Note [malloc variants]). False when malloc
// refuses the settings (it is not glibc's: a sanitizer's allocator, for instance).
bool make_malloc_keep_large_blocks() {
  return ::mallopt(M_MMAP_MAX, 0) == 1 && ::mallopt(M_TRIM_THRESHOLD, -1) == 1;
}

}  // namespace

void register_alloc(CLI::App& app) {
  auto* cmd = app.add_subcommand("alloc", "RangeAllocator vs malloc on a training-like trace");
  struct Args {
    std::size_t ops = 200000;
    std::uint64_t hidden = 4096;
    int layers = 32;
    std::uint64_t seed = 42;
    double capacity_factor = 1.25;
    int repeats = 3;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--ops", args->ops, "minimum operations in the trace (>= 100000)")
      ->check(CLI::Range(std::size_t{1000}, std::size_t{100000000}));
  cmd->add_option("--hidden", args->hidden, "model width that sets tensor sizes")
      ->check(CLI::Range(256, 16384));
  cmd->add_option("--layers", args->layers, "layers per iteration")->check(CLI::Range(1, 1024));
  cmd->add_option("--seed", args->seed, "trace seed");
  cmd->add_option("--capacity-factor", args->capacity_factor,
                  "allocator range = factor x the trace's peak live bytes")
      ->check(CLI::Range(1.0, 64.0));
  cmd->add_option("--repeats", args->repeats, "timed replays of each (best is reported)")
      ->check(CLI::Range(1, 100));
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->callback([args] {
    Trace trace = TraceBuilder(args->seed, args->hidden, args->layers).build(args->ops);
    const std::uint64_t capacity =
        align_up(static_cast<std::uint64_t>(static_cast<double>(trace.peak_live_bytes) *
                                            args->capacity_factor),
                 4096);
    std::vector<std::uint64_t> offsets(trace.ids);
    std::vector<void*> pointers(trace.ids);

    // Note [malloc variants]: glibc's defaults first, then glibc keeping its blocks.
    double best_range = 1e30, best_malloc = 1e30, best_cached = 1e30;
    RangeStats last{};
    for (int r = 0; r < args->repeats; ++r) {
      RangeAllocator ranges("bench", capacity, 256);
      best_range = std::min(best_range, replay_range(trace, ranges, offsets));
      last = ranges.stats();
      best_malloc = std::min(best_malloc, replay_malloc(trace, pointers));
    }
    const std::size_t malloc_mmapped = peak_mmapped_blocks(trace, pointers);
    const bool cached = make_malloc_keep_large_blocks();
    std::size_t cached_mmapped = 0, cached_heap_bytes = 0;
    if (cached) {
      for (int r = 0; r < args->repeats; ++r)
        best_cached = std::min(best_cached, replay_malloc(trace, pointers));
      cached_mmapped = peak_mmapped_blocks(trace, pointers);
      cached_heap_bytes = ::mallinfo2().arena;  // never trimmed: the most the heap held
      if (cached_mmapped != 0)
        STRATA_FAIL(Errc::internal, "malloc with M_MMAP_MAX = 0 still held ", cached_mmapped,
                    " mmapped blocks: the cached variant is not what it claims");
    } else {
      std::fprintf(stderr,
                   "strata-bench alloc: mallopt refused M_MMAP_MAX/M_TRIM_THRESHOLD (malloc is "
                   "not glibc's?): no cached-malloc figures\n");
    }

    // An untimed replay to sample fragmentation at the peak of allocated bytes.
    RangeAllocator ranges("bench", capacity, 256);
    double frag_at_peak = 0.0, frag_sum = 0.0;
    std::uint64_t peak = 0, samples = 0;
    for (std::size_t i = 0; i < trace.ops.size(); ++i) {
      const Op& op = trace.ops[i];
      if (op.bytes != 0) {
        offsets[op.id] = ranges.allocate(op.bytes);
        const RangeStats s = ranges.stats();
        if (s.current_bytes > peak) {
          peak = s.current_bytes;
          frag_at_peak = s.fragmentation;
        }
      } else {
        ranges.deallocate(offsets[op.id]);
      }
      if (i % 256 == 0) {
        frag_sum += ranges.stats().fragmentation;
        ++samples;
      }
    }
    const RangeStats s = ranges.stats();
    const double ops = static_cast<double>(trace.ops.size());
    nlohmann::json out{
        {"bench", "alloc"},
        {"ops", trace.ops.size()},
        {"min_bytes", trace.min_bytes},
        {"max_bytes", trace.max_bytes},
        {"capacity_bytes", capacity},
        {"peak_allocated_bytes", s.peak_bytes},
        {"peak_reserved_bytes", s.peak_reserved_bytes},
        {"ops_per_s", ops / best_range},
        {"malloc_ops_per_s", ops / best_malloc},
        {"speedup_vs_malloc", best_malloc / best_range},
        {"malloc_mmapped_blocks_peak", malloc_mmapped},
        {"malloc_cached_ops_per_s", cached ? nlohmann::json(ops / best_cached) : nullptr},
        {"speedup_vs_malloc_cached", cached ? nlohmann::json(best_cached / best_range) : nullptr},
        {"malloc_cached_heap_over_allocated",
         cached ? nlohmann::json(static_cast<double>(cached_heap_bytes) /
                                 static_cast<double>(trace.peak_live_bytes))
                : nullptr},
        {"malloc_cached_mmapped_blocks_peak", cached ? nlohmann::json(cached_mmapped) : nullptr},
        {"peak_reserved_over_allocated",
         static_cast<double>(s.peak_reserved_bytes) / static_cast<double>(s.peak_bytes)},
        {"fragmentation", frag_at_peak},
        {"fragmentation_mean", samples ? frag_sum / static_cast<double>(samples) : 0.0},
        {"failed_allocations", last.failed_allocations}};
    if (args->json) {
      print_json(out);
    } else {
      std::printf(
          "alloc: %zu ops (%s..%s) | RangeAllocator %.2f Mops/s | malloc %.2f Mops/s (%.1fx; "
          "mmap for large blocks, %zu at once) | malloc keeping blocks %.2f Mops/s (%.1fx, heap "
          "%.3f x peak live) | "
          "peak reserved/allocated %.3f | fragmentation at peak %.3f (mean %.3f)\n",
          trace.ops.size(), format_bytes(trace.min_bytes).c_str(),
          format_bytes(trace.max_bytes).c_str(), ops / best_range / 1e6, ops / best_malloc / 1e6,
          best_malloc / best_range, malloc_mmapped, cached ? ops / best_cached / 1e6 : 0.0,
          cached ? best_cached / best_range : 0.0,
          cached
              ? static_cast<double>(cached_heap_bytes) / static_cast<double>(trace.peak_live_bytes)
              : 0.0,
          out["peak_reserved_over_allocated"].get<double>(), frag_at_peak,
          out["fragmentation_mean"].get<double>());
    }
  });
}

}  // namespace strata::bench
