// strata-bench overlap: a synthetic layered model many times larger than the device budget,
// streamed layer by layer through the prefetch pipeline; reports how much of the copy time the
// prefetch hid (metrics defined in the design: compute_s, transfer_s, step_s, roofline,
// overlap_efficiency).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "strata/io/error.h"
#include "strata/io/pages.h"
#include "strata/io/units.h"
#include "strata/runtime/runtime.h"
#include "strata/scheduler/prefetch_pipeline.h"
#include "strata/runtime/svg_timeline.h"

namespace strata::bench {
namespace {

struct Args {
  std::size_t layers = 32;
  std::string layer_bytes = "16MiB";
  std::string home = "nvme";
  std::string nvme_dir;
  std::string device_budget;  // default: model / 8
  std::string host_budget;    // default: model + staging (home host) or 64 MiB + staging (nvme)
  std::string backend = "auto";
  double link_gbps = 0;
  std::string prefetch = "auto";
  int passes = 5;
  double compute_ms = -1;  // default: the measured transfer time of one layer
  bool json = false;
  std::string trace;
  std::string svg;
};

void fill_layer(std::byte* data, std::size_t bytes, std::size_t layer) {
  auto* w = reinterpret_cast<std::uint64_t*>(data);
  std::uint64_t x = 0x9E3779B97F4A7C15ULL * (layer + 1);
  for (std::size_t i = 0; i < bytes / 8; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    w[i] = x;
  }
  for (std::size_t i = bytes / 8 * 8; i < bytes; ++i)
    data[i] = std::byte(layer + i);
}

// Reads every byte: a stale or wrong byte changes the result.
std::uint64_t checksum(const std::byte* data, std::size_t bytes) {
  const auto* w = reinterpret_cast<const std::uint64_t*>(data);
  std::uint64_t a = 0, b = 0;
  const std::size_t words = bytes / 8;
  std::size_t i = 0;
  for (; i + 1 < words; i += 2) {
    a += w[i];
    b = (b ^ w[i + 1]) * 0x100000001B3ULL;
  }
  if (i < words) a += w[i];
  for (std::size_t k = words * 8; k < bytes; ++k)
    a += static_cast<std::uint64_t>(data[k]);
  return a ^ (b << 17 | b >> 47);
}

volatile double g_sink;
void arithmetic(std::uint64_t iterations) {
  double x = 1.0, y = 0.5;
  for (std::uint64_t i = 0; i < iterations; ++i) {
    x = x * 1.0000001 + y;
    y = y * 0.9999999 + 1e-9;
  }
  g_sink = x + y;
}

struct Compute {
  std::uint64_t iterations = 0;
  std::vector<std::byte> scratch;  // device bytes copied back when not host-addressable
};

void run(Args args) {
  if (!args.json && args.trace.empty() && args.svg.empty()) {  // the demo says where they went
    args.trace = "strata-overlap-trace.json";
    args.svg = "strata-overlap.svg";
  }
  const std::size_t layer_bytes = parse_bytes(args.layer_bytes, "--layer-bytes");
  STRATA_EXPECTS(args.layers >= 2, "--layers: need at least 2");
  STRATA_EXPECTS(args.home == "nvme" || args.home == "host", "--home: \"", args.home,
                 "\" is not host or nvme");
  const std::uint64_t model = layer_bytes * args.layers;
  const std::size_t staging_chunk = 4 * MiB, staging_chunks = 8;
  const std::size_t staging = staging_chunk * staging_chunks;

  std::string dir = args.nvme_dir;
  bool own_dir = false;
  if (args.home == "nvme" && dir.empty()) {
    char tmpl[] = "/var/tmp/strata-overlap-XXXXXX";
    STRATA_EXPECTS(::mkdtemp(tmpl) != nullptr, "--nvme-dir: cannot make a temporary directory");
    dir = tmpl;
    own_dir = true;
  }
  RuntimeOptions o;
  o.backend.kind = parse_backend_kind(args.backend, "--backend");
  o.backend.link_gbps = args.link_gbps;
  o.backend.device_budget_bytes = args.device_budget.empty()
                                      ? align_up(model / 8, 4096)
                                      : parse_bytes(args.device_budget, "--device-budget");
  o.host_budget_bytes = !args.host_budget.empty() ? parse_bytes(args.host_budget, "--host-budget")
                        : args.home == "host"
                            ? model + staging + 8 * MiB
                            : staging + 8 * MiB;  // no room to cache layers: all from NVMe
  o.staging_chunk_bytes = staging_chunk;
  o.staging_chunks = staging_chunks;
  o.quiet = args.json;
  if (!dir.empty()) {
    o.nvme.paths = {dir};
    o.nvme.capacity_bytes = model + model / 4 + 64 * MiB;
    o.nvme.stripe_bytes = 1 * MiB;
  }
  const bool progress = !args.json && stderr_is_terminal();
  auto say = [&](const char* fmt, auto... a) {
    if (!args.json) std::fprintf(stderr, fmt, a...);
  };

  Runtime rt(o);
  const bool host_addressable = rt.backend().info().host_addressable;
  say("overlap: %zu layers x %s = %s homed on %s, device budget %s (%.1fx smaller), backend %s\n",
      args.layers, format_bytes(layer_bytes).c_str(), format_bytes(model).c_str(),
      args.home.c_str(), format_bytes(rt.backend().info().budget_bytes).c_str(),
      static_cast<double>(model) / static_cast<double>(rt.backend().info().budget_bytes),
      std::string(to_string(rt.backend().kind())).c_str());

  std::vector<TensorId> layers;
  std::vector<std::uint64_t> expected;
  {
    PageBuffer init(layer_bytes);
    for (std::size_t l = 0; l < args.layers; ++l) {
      fill_layer(init.data(), layer_bytes, l);
      expected.push_back(checksum(init.data(), layer_bytes));
      TensorDesc d;
      d.name = "layers." + std::to_string(l) + ".weight";
      d.bytes = layer_bytes;
      d.kind = TensorKind::Param;
      layers.push_back(
          rt.create_tensor(d, args.home == "nvme" ? Tier::Nvme : Tier::Host, init.data()));
    }
  }
  Schedule order;
  for (std::size_t l = 0; l < args.layers; ++l)
    order.append({"layer" + std::to_string(l), {{layers[l], Use::Read, Tier::Device}}});

  // transfer_s starts cold: nothing of the model on the device (nor on the host when it is
  // homed on NVMe).
  auto cool = [&] {
    rt.synchronize();
    for (TensorId t : layers) {
      rt.evict(t, Tier::Device);
      if (args.home == "nvme") rt.evict(t, Tier::Host);
    }
  };

  bool verified = true;
  Compute compute;
  if (!host_addressable) compute.scratch.resize(layer_bytes);
  auto compute_step = [&](const Lease& lease, std::size_t l) {
    lease.wait();  // the host backend's stream wait: the compute "stream" is this thread
    const std::byte* data = lease.as<const std::byte>();
    if (!host_addressable) {
      rt.backend().compute_stream().copy_async(compute.scratch.data(), lease.data(), layer_bytes,
                                               CopyKind::DeviceToHost);
      rt.backend().compute_stream().synchronize();
      data = compute.scratch.data();
    }
    if (checksum(data, layer_bytes) != expected[l]) verified = false;
    arithmetic(compute.iterations);
  };

  // A pass through the pipeline; returns its wall time.
  auto pass = [&](PrefetchPipeline& pipeline, bool with_compute) {
    pipeline.begin_iteration();
    const auto start = Clock::now();
    for (std::size_t l = 0; l < args.layers; ++l) {
      StepLeases in =
          pipeline.begin_step("layer" + std::to_string(l), {{layers[l], Use::Read, Tier::Device}});
      const std::uint64_t c0 = rt.telemetry().now_ns();
      if (with_compute) {
        compute_step(in[0], l);
      } else {
        in.wait();
      }
      rt.telemetry().record(
          {c0, rt.telemetry().now_ns(), Track::Compute, layer_bytes, layers[l], l});
      pipeline.end_step(std::move(in));
    }
    pipeline.end_iteration();
    return seconds_since(start);
  };

  // transfer_s: the whole model through the pipeline (prefetch on), no compute, from cold.
  double transfer_s = 0;
  std::uint64_t nvme_read_in_transfer = 0;
  {
    PipelineOptions po;
    PrefetchPipeline pipeline(rt, po);
    pipeline.set_schedule(order);
    // The median of three cold passes: the disk is noisy.
    std::vector<std::pair<double, std::uint64_t>> runs;
    for (int i = 0; i < 3; ++i) {
      cool();
      const std::uint64_t read0 = rt.io() ? rt.io()->stats().bytes_read : 0;
      const double seconds = pass(pipeline, false);
      runs.emplace_back(seconds, (rt.io() ? rt.io()->stats().bytes_read : 0) - read0);
    }
    std::sort(runs.begin(), runs.end());
    transfer_s = runs[1].first;
    nvme_read_in_transfer = runs[1].second;
  }
  // Calibrate the arithmetic so a step takes compute_ms with its data resident.
  const double compute_ms =
      args.compute_ms >= 0 ? args.compute_ms : transfer_s * 1e3 / static_cast<double>(args.layers);
  {
    PageBuffer probe(layer_bytes);
    fill_layer(probe.data(), layer_bytes, 0);
    auto t = Clock::now();
    for (int i = 0; i < 3; ++i)
      g_sink = static_cast<double>(checksum(probe.data(), layer_bytes));
    const double checksum_s = seconds_since(t) / 3;
    t = Clock::now();
    arithmetic(20'000'000);
    const double per_iteration = seconds_since(t) / 20e6;
    const double rest = compute_ms / 1e3 - checksum_s;
    compute.iterations = rest > 0 ? static_cast<std::uint64_t>(rest / per_iteration) : 0;
  }
  // compute_s: every step's compute with its layer already resident.
  double compute_s = 0;
  for (std::size_t l = 0; l < args.layers; ++l) {
    Lease lease = rt.acquire(layers[l], Tier::Device, Access::Read).get();
    lease.wait();
    const auto start = Clock::now();
    compute_step(lease, l);
    compute_s += seconds_since(start);
  }

  // The real passes: the first one records the schedule (unless prefetch is none), the rest
  // replay it; step_s is the median of the passes after that warm-up.
  PipelineOptions po;
  std::string prefetch_label = args.prefetch;
  if (args.prefetch == "none") {
    po.prefetch = PrefetchMode::None;
  } else if (args.prefetch == "auto") {
    po.prefetch = PrefetchMode::Auto;
  } else {
    po.prefetch = PrefetchMode::Fixed;
    try {
      po.fixed_lookahead = std::stoul(args.prefetch);
    } catch (...) {
      STRATA_FAIL(Errc::invalid_argument, "--prefetch: \"", args.prefetch,
                  "\" is not none, auto or a number of steps");
    }
  }
  PrefetchPipeline pipeline(rt, po);
  std::vector<double> times;
  const TierStats d0 = rt.tier_stats(Tier::Device);
  const std::uint64_t nvme0 = rt.io() ? rt.io()->stats().bytes_read : 0;
  cool();
  for (int p = 0; p <= args.passes; ++p) {
    // Steady state, as in a training or inference loop: the end of one pass already prefetches
    // the next one's first layers.
    if (p == args.passes) rt.telemetry().clear();  // the trace shows the last pass
    const double s = pass(pipeline, true);
    if (p > 0) times.push_back(s);
    if (progress)
      std::fprintf(stderr, "\r  pass %d/%d: %.3f s%s   ", p, args.passes, s,
                   p == 0 ? " (warm-up, records the schedule)" : "");
  }
  if (progress) std::fprintf(stderr, "\n");
  std::sort(times.begin(), times.end());
  const double step_s = times[times.size() / 2];
  const TierStats d1 = rt.tier_stats(Tier::Device);
  const std::uint64_t passes_run = static_cast<std::uint64_t>(args.passes) + 1;
  const std::uint64_t bytes_h2d = (d1.bytes_in - d0.bytes_in) / passes_run;
  const std::uint64_t bytes_nvme =
      ((rt.io() ? rt.io()->stats().bytes_read : 0) - nvme0) / passes_run;
  const double roofline = std::max(compute_s, transfer_s) / step_s;
  const double overlap = (compute_s + transfer_s - step_s) / std::min(compute_s, transfer_s);
  const PipelineStats ps = pipeline.stats();

  if (!args.trace.empty()) rt.telemetry().write_chrome_trace(args.trace);
  if (!args.svg.empty()) {
    char title[256];
    std::snprintf(title, sizeof title,
                  "strata overlap: %zu x %s from %s, prefetch %s, step %.3f s (compute %.3f, "
                  "transfer %.3f), roofline %.2f",
                  args.layers, format_bytes(layer_bytes).c_str(), args.home.c_str(),
                  prefetch_label.c_str(), step_s, compute_s, transfer_s, roofline);
    write_svg_timeline(args.svg, rt, rt.telemetry(), title);
  }
  const nlohmann::json out{
      {"bench", "overlap"},
      {"backend", std::string(to_string(rt.backend().kind()))},
      {"home", args.home},
      {"prefetch", prefetch_label},
      {"layers", args.layers},
      {"layer_bytes", layer_bytes},
      {"model_bytes", model},
      {"device_budget", rt.backend().info().budget_bytes},
      {"link_gbps", args.link_gbps},
      {"compute_ms", compute_ms},
      {"compute_s", compute_s},
      {"transfer_s", transfer_s},
      {"step_s", step_s},
      {"roofline", roofline},
      {"overlap_efficiency", overlap},
      {"bytes_h2d", bytes_h2d},
      {"bytes_nvme_read", bytes_nvme},
      {"gbps_h2d", static_cast<double>(model) / transfer_s / 1e9},
      {"gbps_nvme_read", static_cast<double>(nvme_read_in_transfer) / transfer_s / 1e9},
      {"peak_device_bytes", d1.peak_bytes},
      {"max_lookahead_steps", ps.max_lookahead_steps},
      {"ready_at_step_begin", ps.inputs ? static_cast<double>(ps.ready_at_begin) / ps.inputs : 0},
      {"verified", verified}};
  if (args.json) {
    print_json(out);
  } else {
    std::printf("\n  %-22s %10s\n", "metric", "value");
    std::printf("  %-22s %10.3f\n  %-22s %10.3f\n  %-22s %10.3f\n", "compute_s", compute_s,
                "transfer_s", transfer_s, "step_s (median)", step_s);
    std::printf("  %-22s %10.3f\n  %-22s %10.3f\n", "roofline", roofline, "overlap_efficiency",
                overlap);
    std::printf("  %-22s %10.2f\n  %-22s %10.2f\n", "gbps_h2d", out["gbps_h2d"].get<double>(),
                "gbps_nvme_read", out["gbps_nvme_read"].get<double>());
    std::printf("  %-22s %10s\n  %-22s %10zu\n  %-22s %10s\n", "peak_device_bytes",
                format_bytes(d1.peak_bytes).c_str(), "max lookahead (steps)",
                ps.max_lookahead_steps, "verified", verified ? "yes" : "NO");
    if (!args.trace.empty()) std::printf("  trace: %s (open in Perfetto)\n", args.trace.c_str());
    if (!args.svg.empty()) std::printf("  timeline: %s\n", args.svg.c_str());
  }
  if (own_dir) std::filesystem::remove_all(dir);
  if (!verified) throw Error(Errc::corrupt_data, "overlap: a layer's checksum did not match");
}

}  // namespace

void register_overlap(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "overlap", "stream a layered model larger than the device through the prefetch pipeline");
  auto args = std::make_shared<Args>();
  cmd->add_option("--layers", args->layers, "number of layers (tensors)");
  cmd->add_option("--layer-bytes", args->layer_bytes, "bytes per layer (units allowed)");
  cmd->add_option("--home", args->home, "where the model lives: host | nvme");
  cmd->add_option("--nvme-dir", args->nvme_dir, "NVMe directory (default: a temporary one)");
  cmd->add_option("--device-budget", args->device_budget, "device budget (default: model / 8)");
  cmd->add_option("--host-budget", args->host_budget, "pinned host budget");
  cmd->add_option("--backend", args->backend, "auto | host | cuda");
  cmd->add_option("--link-gbps", args->link_gbps, "host backend: pace copies to this link")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--prefetch", args->prefetch, "none | auto | K (fixed lookahead)");
  cmd->add_option("--passes", args->passes, "measured passes after the warm-up")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--compute-ms", args->compute_ms,
                  "compute per step with data resident (default: one layer's transfer time)");
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->add_option("--trace", args->trace, "write the last pass as a Chrome trace");
  cmd->add_option("--svg", args->svg, "write the last pass as an SVG timeline");
  cmd->callback([args] { run(*args); });
}

}  // namespace strata::bench
