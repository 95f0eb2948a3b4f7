// strata-bench adam: the CPU Adam step against a baseline that moves the same bytes, in the
// same run.
//
// Note [Adam bench baseline]: Adam reads p, m, v and the gradient and writes p, m, v in place
// (and the param copy, a write-only array, when there is one). The baseline is a loop over the
// same buffers with the same access pattern, the same threads and the same oneTBB partitioning
// (a blocked range of kAdamChunkElements, the default partitioner), compiled for the same ISAs,
// with trivial arithmetic: x += g * zero for p, m and v, where `zero` is read from a volatile at
// run time, so the compiler can neither drop the loop nor turn it into memcpy or memset; the
// values stay as they were (x + 0), so Adam's next step sees the same data. Its loop loads all
// four inputs before it stores, as Adam's does (Adam's stores wait for the whole update): with
// p stored before m and v were loaded, the baseline ran slower than Adam itself on one thread
// (adam_vs_baseline 1.19 with f32 gradients, no copy), no upper bound at all. A parallel memcpy
// of the states' size is no such baseline: its destination is written without being read, and
// the write-allocate read the CPU adds for it is traffic memcpy pays and in-place Adam does not.
// Both run once to fault pages in and warm caches, then in interleaved repetitions (the order
// alternating), and the medians are compared. Adam does everything the baseline does and more,
// so a ratio above kMaxRatio is a measurement error and the bench fails.
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/pages.h"
#include "strata/optim/adam.h"
#include "strata/scheduler/overlap_metrics.h"

namespace strata::bench {
namespace {

constexpr double kMaxRatio = 1.05;  // adam_vs_baseline above this is a measurement error
volatile float g_zero = 0.0f;       // read at run time: the baseline's arithmetic is not foldable

struct Args {
  std::size_t params = std::size_t{32} << 20;
  std::string grad = "f32";
  std::string copy = "bf16";
  unsigned threads = 0;
  int iters = 9;  // at least; more until each has run min_seconds
  double min_seconds = tunables::kMinMeasureSeconds;
  double max_ratio = kMaxRatio;
  bool json = false;
};

// The baseline's loop over one chunk (Note [Adam bench baseline]): grads widened from their
// bits (f32 as int32, bf16/f16 as uint16: one conversion, no decoding), the copy the top half
// of p's bits.
template <typename G>
inline void touch(float* __restrict p, float* __restrict m, float* __restrict v,
                  const G* __restrict g, std::uint16_t* __restrict copy, std::size_t n,
                  float zero) {
  for (std::size_t i = 0; i < n; ++i) {
    // Every load before any store, as in Adam, whose stores wait for all four inputs.
    const float d = static_cast<float>(g[i]) * zero;
    const float x = p[i] + d, y = m[i] + d, z = v[i] + d;
    p[i] = x;
    m[i] = y;
    v[i] = z;
    if (copy != nullptr)
      copy[i] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(x) >> 16);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void baseline_chunk(
    float* __restrict p, float* __restrict m, float* __restrict v, const void* __restrict g,
    bool g32, std::uint16_t* __restrict copy, std::size_t n, float zero) {
  if (g32)
    touch(p, m, v, static_cast<const std::int32_t*>(g), copy, n, zero);
  else
    touch(p, m, v, static_cast<const std::uint16_t*>(g), copy, n, zero);
}

void baseline_step(const optim::AdamArgs& a) {
  const bool g32 = a.grad_dtype == DType::F32;
  const std::size_t grad_bytes = g32 ? 4 : 2;
  const float zero = g_zero;
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, a.count, optim::kAdamChunkElements),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      const std::size_t b = r.begin();
                      baseline_chunk(
                          a.params + b, a.exp_avg + b, a.exp_avg_sq + b,
                          static_cast<const std::byte*>(a.grads) + b * grad_bytes, g32,
                          a.param_copy ? static_cast<std::uint16_t*>(a.param_copy) + b : nullptr,
                          r.size(), zero);
                    });
}

void run(const Args& args) {
  const std::size_t n = args.params;
  STRATA_EXPECTS(n >= 1024, "--params: at least 1024");
  const DType grad = parse_dtype(args.grad, "--grad");
  const bool copy = args.copy != "none";
  const DType copy_dtype = copy ? parse_dtype(args.copy, "--copy") : DType::BF16;
  const unsigned threads = args.threads != 0 ? args.threads : std::thread::hardware_concurrency();
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);

  const std::size_t grad_bytes = grad == DType::F32 ? 4 : 2;
  PageBuffer p(n * 4), m(n * 4), v(n * 4), g(n * grad_bytes), c(copy ? n * 2 : 4096);
  auto* pf = reinterpret_cast<float*>(p.data());
  tbb::parallel_for(std::size_t{0}, n, std::size_t{1} << 16, [&](std::size_t b) {
    for (std::size_t i = b; i < std::min(n, b + (std::size_t{1} << 16)); ++i) {
      pf[i] = 0.001f * static_cast<float>(i % 1000);
      if (grad == DType::F32)
        reinterpret_cast<float*>(g.data())[i] = 1e-3f;
      else
        reinterpret_cast<std::uint16_t*>(g.data())[i] = grad == DType::BF16 ? 0x3A83 : 0x1419;
    }
  });
  optim::AdamArgs a;
  a.params = pf;
  a.exp_avg = reinterpret_cast<float*>(m.data());
  a.exp_avg_sq = reinterpret_cast<float*>(v.data());
  a.grads = g.data();
  a.grad_dtype = grad;
  a.count = n;
  a.param_copy = copy ? c.data() : nullptr;
  a.copy_dtype = copy_dtype;
  optim::AdamConfig cfg;
  cfg.decoupled_weight_decay = true;
  cfg.weight_decay = 0.01;

  // Every byte either kernel reads or writes in main memory, per element: p, m, v and the
  // gradient read; p, m, v and the copy written. (The f16 paths' block buffers stay in L1.)
  const std::size_t read_per_param = 12 + grad_bytes;
  const std::size_t written_per_param = 12 + (copy ? 2 : 0);
  const double bytes =
      static_cast<double>(n) * static_cast<double>(read_per_param + written_per_param);

  std::uint64_t step = 0;
  auto time_adam = [&] {
    a.step = ++step;
    const auto start = Clock::now();
    optim::adam_step(cfg, a);
    return seconds_since(start);
  };
  auto time_baseline = [&] {
    const auto start = Clock::now();
    baseline_step(a);
    return seconds_since(start);
  };
  time_adam();  // warm-up: faults the pages in (the first touch of each) and warms the caches
  time_baseline();
  std::vector<double> adam_s, baseline_s;
  const MeasureRule rule{.min_rounds = args.iters, .min_seconds = args.min_seconds};
  for (int i = 0; !rule.enough(i, {&adam_s, &baseline_s}); ++i) {
    if (i % 2 == 0) {
      adam_s.push_back(time_adam());
      baseline_s.push_back(time_baseline());
    } else {
      baseline_s.push_back(time_baseline());
      adam_s.push_back(time_adam());
    }
  }
  const double adam_median = median(adam_s), baseline_median = median(baseline_s);
  const double adam_bps = bytes / adam_median, baseline_bps = bytes / baseline_median;
  const double ratio = adam_bps / baseline_bps;
  // Adam moves the baseline's bytes and computes more, so it cannot be faster: a ratio above the
  // limit is a measurement error, reported as such (Note [Measuring until the figures hold]).
  std::string warning;
  if (ratio > args.max_ratio) {
    char why[512];
    std::snprintf(why, sizeof why,
                  "adam: adam_vs_baseline %.3f is above %.2f: adam_bytes_per_s %.4g against "
                  "baseline_bytes_per_s %.4g (median seconds %.6f against %.6f). Adam moves the "
                  "baseline's bytes and computes more, so it cannot be faster: a measurement "
                  "error, not a result",
                  ratio, args.max_ratio, adam_bps, baseline_bps, adam_median, baseline_median);
    warning = why;
  }
  const int iters = static_cast<int>(adam_s.size());
  const nlohmann::json out{
      {"bench", "adam"},
      {"params", n},
      {"grad", args.grad},
      {"copy", args.copy},
      {"threads", threads},
      {"isa", std::string(optim::adam_isa())},
      {"iters", iters},
      {"min_time_s", args.min_seconds},
      {"bytes_read_per_param", read_per_param},
      {"bytes_written_per_param", written_per_param},
      {"seconds", adam_median},
      {"baseline_seconds", baseline_median},
      {"params_per_s", static_cast<double>(n) / adam_median},
      {"adam_bytes_per_s", adam_bps},
      {"baseline_bytes_per_s", baseline_bps},
      {"adam_vs_baseline", ratio},
      {"figures_trusted", warning.empty()},
      {"warning", warning.empty() ? nlohmann::json() : nlohmann::json(warning)}};
  if (args.json) {
    print_json(out);
  } else {
    std::printf(
        "adam (%s, %u threads, grad %s, copy %s): %zu params, median of %d: %.4g s = %.0f "
        "Mparams/s, %.2f GB/s (%zu B read + %zu B written per param)\n"
        "baseline (same bytes, same access pattern): %.4g s = %.2f GB/s; adam_vs_baseline %.3f\n",
        std::string(optim::adam_isa()).c_str(), threads, args.grad.c_str(), args.copy.c_str(), n,
        iters, adam_median, static_cast<double>(n) / adam_median / 1e6, adam_bps / 1e9,
        read_per_param, written_per_param, baseline_median, baseline_bps / 1e9, ratio);
  }
  if (!warning.empty()) std::fprintf(stderr, "strata-bench %s\n", warning.c_str());
}

}  // namespace

void register_adam(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "adam", "CPU Adam step vs a baseline that moves the same bytes the same way");
  auto args = std::make_shared<Args>();
  cmd->add_option("--params", args->params, "parameters (fp32 master weights)");
  cmd->add_option("--grad", args->grad, "gradient dtype: f32 | bf16 | f16");
  cmd->add_option("--copy", args->copy, "updated-param copy: none | bf16 | f16");
  cmd->add_option("--threads", args->threads, "threads (0 = all)");
  cmd->add_option("--iters", args->iters,
                  "timed repetitions of each, interleaved (the medians are reported): at least "
                  "this many, more until each has run for --min-time")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--min-time", args->min_seconds,
                  "seconds each figure's repetitions add up to at least (default 1; 0: exactly "
                  "--iters)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-ratio", args->max_ratio,
                  "an adam_vs_baseline above this is a measurement error: reported untrusted "
                  "(figures_trusted false, a warning) (default 1.05)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->callback([args] { run(*args); });
}

}  // namespace strata::bench
