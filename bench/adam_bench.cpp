// strata-bench adam: the CPU Adam step against memcpy of the same bytes, in the same run.
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "strata/io/error.h"
#include "strata/io/pages.h"
#include "strata/io/units.h"
#include "strata/optim/adam.h"

namespace strata::bench {
namespace {

struct Args {
  std::size_t params = std::size_t{32} << 20;
  std::string grad = "f32";
  std::string copy = "bf16";
  unsigned threads = 0;
  int iters = 5;
  bool json = false;
};

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
  cfg.weight_decay = 0.01f;

  double best = 1e30;
  for (int i = 0; i <= args.iters; ++i) {
    a.step = static_cast<std::uint64_t>(i + 1);
    const auto start = Clock::now();
    optim::adam_step(cfg, a);
    if (i > 0) best = std::min(best, seconds_since(start));  // the first pass faults pages in
  }
  // memcpy of the states' size (p, m, v), with the same threads.
  const std::size_t state_bytes = 3 * n * 4;
  PageBuffer src(state_bytes), dst(state_bytes);
  std::memset(src.data(), 1, state_bytes);
  std::memset(dst.data(), 0, state_bytes);
  double best_copy = 1e30;
  for (int i = 0; i <= args.iters; ++i) {
    const auto start = Clock::now();
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, state_bytes, std::size_t{1} << 20),
                      [&](const tbb::blocked_range<std::size_t>& r) {
                        std::memcpy(dst.data() + r.begin(), src.data() + r.begin(), r.size());
                      });
    if (i > 0) best_copy = std::min(best_copy, seconds_since(start));
  }
  const double moved = static_cast<double>(n) * (12 + grad_bytes + 12 + (copy ? 2 : 0));
  const double gbps = moved / best / 1e9;
  const double memcpy_gbps = 2.0 * static_cast<double>(state_bytes) / best_copy / 1e9;
  const nlohmann::json out{{"bench", "adam"},
                           {"params", n},
                           {"grad", args.grad},
                           {"copy", args.copy},
                           {"threads", threads},
                           {"isa", std::string(optim::adam_isa())},
                           {"seconds", best},
                           {"params_per_s", static_cast<double>(n) / best},
                           {"gbps", gbps},
                           {"memcpy_gbps", memcpy_gbps},
                           {"fraction_of_memcpy", gbps / memcpy_gbps}};
  if (args.json) {
    print_json(out);
  } else {
    std::printf(
        "adam (%s, %u threads): %zu params in %.3f s = %.0f Mparams/s, %.2f GB/s "
        "(memcpy %.2f GB/s, %.2f of it)\n",
        std::string(optim::adam_isa()).c_str(), threads, n, best,
        static_cast<double>(n) / best / 1e6, gbps, memcpy_gbps, gbps / memcpy_gbps);
  }
}

}  // namespace

void register_adam(CLI::App& app) {
  auto* cmd = app.add_subcommand("adam", "CPU Adam step vs memcpy of the same bytes");
  auto args = std::make_shared<Args>();
  cmd->add_option("--params", args->params, "parameters (fp32 master weights)");
  cmd->add_option("--grad", args->grad, "gradient dtype: f32 | bf16 | f16");
  cmd->add_option("--copy", args->copy, "updated-param copy: none | bf16 | f16");
  cmd->add_option("--threads", args->threads, "threads (0 = all)");
  cmd->add_option("--iters", args->iters, "timed steps (best is reported)")
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->callback([args] { run(*args); });
}

}  // namespace strata::bench
