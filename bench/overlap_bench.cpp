// strata-bench overlap: a synthetic layered model many times larger than the device budget,
// streamed layer by layer through the prefetch pipeline; reports how much of the copy time the
// prefetch hid (metrics defined in the design: compute_s, transfer_s, step_s, roofline,
// overlap_efficiency), with a light compute (copy) or a GEMM on the layer's bytes, or both.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "gemm_compute.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/pages.h"
#include "strata/runtime/runtime.h"
#include "strata/runtime/svg_timeline.h"
#include "strata/runtime/telemetry.h"
#include "strata/scheduler/overlap_metrics.h"
#include "strata/scheduler/prefetch_pipeline.h"

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
  int passes = 5;  // at least; more until each figure has run min_seconds
  double min_seconds = tunables::kMinMeasureSeconds;
  double compute_ms = -1;  // default: compute_ratio x the measured transfer time of one layer
  double compute_ratio = 1.0;
  std::string compute = "copy";  // copy | gemm | both
  std::size_t gemm_m = 0;        // 0: calibrated to compute_ms
  std::size_t gemm_n = 0;        // 0: from the layer's size (gemm_shape)
  std::size_t gemm_k = 0;
  double max_roofline = kMaxRoofline;
  bool json = false;
  std::string trace;
  std::string svg;
};

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

// Note [Overlap compute modes]: the step's compute runs on the driving thread once the step's
// lease is ready (Lease::wait), where stream_inference runs its layers; on the host backend
// there is no other compute stream to wait on. `copy` reads every byte of the layer (a checksum
// against the expected value) plus calibrated scalar arithmetic: one core, little memory
// traffic beyond the layer. `gemm` is a float32 GEMM through OpenBLAS (its own threads,
// OPENBLAS_NUM_THREADS) whose B matrix is the layer's bytes (gemm_compute.h), m calibrated the
// same way: the cores are busy as with a real model. Stream::launch_host_func could run either
// on the backend's compute stream instead, but the step must still block on it before
// end_step releases the lease: the same order, one more thread hop and wake-up per layer.
enum class ComputeMode { Copy, Gemm };

const char* to_string(ComputeMode m) {
  return m == ComputeMode::Copy ? "copy" : "gemm";
}

std::vector<ComputeMode> parse_compute(const std::string& text) {
  if (text == "copy") return {ComputeMode::Copy};
  if (text == "gemm") return {ComputeMode::Gemm};
  if (text == "both") return {ComputeMode::Copy, ComputeMode::Gemm};
  STRATA_FAIL(Errc::invalid_argument, "--compute: \"", text, "\" is not copy, gemm or both");
}

// `path` with `suffix` before its extension: strata-overlap.svg -> strata-overlap-gemm.svg.
std::string with_suffix(const std::string& path, const std::string& suffix) {
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + suffix + p.extension().string())).string();
}

std::size_t median_index(const std::vector<double>& v) {
  std::vector<std::size_t> order(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    order[i] = i;
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return v[a] < v[b]; });
  return order[order.size() / 2];
}

// One compute mode's figures (Note [Overlap measurement]).
struct ModeResult {
  ComputeMode mode = ComputeMode::Copy;
  double compute_s = 0, transfer_s = 0, step_s = 0;
  bool verified = true;
  std::string warning;  ///< the roofline's, when its figures cannot be trusted
  nlohmann::json figures;
};

void run(Args args) {
  const std::vector<ComputeMode> modes = parse_compute(args.compute);
  if (!args.json && args.trace.empty() && args.svg.empty()) {  // the demo says where they went
    args.trace = "strata-overlap-trace.json";
    args.svg = "strata-overlap.svg";
  }
  const std::size_t layer_bytes = parse_bytes(args.layer_bytes, "--layer-bytes");
  STRATA_EXPECTS(args.layers >= 2, "--layers: need at least 2");
  STRATA_EXPECTS(args.home == "nvme" || args.home == "host", "--home: \"", args.home,
                 "\" is not host or nvme");
  GemmShape gemm_base;
  if (modes.back() == ComputeMode::Gemm)  // checked before anything is built
    gemm_base = gemm_shape(layer_bytes, args.gemm_m, args.gemm_n, args.gemm_k);
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
    order.append({"layer" + std::to_string(l), {{layers[l], Access::Read, Tier::Device}}});

  // Note [Overlap measurement]: transfer_s, compute_s and step_s come from the same rounds, and
  // every streamed pass starts in the same tier state: cold (nothing of the model on the device,
  // nor on the host when it is homed on NVMe) and drained (no move in flight, no prefetch of a
  // next pass: the pipelines run with across_iterations off). A round is a transfer pass
  // (prefetch auto, no compute), a compute pass (each layer's compute timed with its layer
  // already on the device) and a step pass (prefetch as asked, with compute); each figure is the
  // median over the rounds. A roofline above 1.02 then means the figures were not measured as
  // they claim, and the bench refuses it. With --compute both, each mode has rounds of its own.
  auto cool = [&] {
    rt.synchronize();
    for (TensorId t : layers) {
      rt.evict(t, Tier::Device);
      if (args.home == "nvme") rt.evict(t, Tier::Host);
    }
  };

  // The layer's bytes where the host can read them (copied back when not host-addressable).
  std::vector<std::byte> scratch;
  if (!host_addressable) scratch.resize(layer_bytes);
  auto host_bytes = [&](const Lease& lease) {
    lease.wait();  // the host backend's stream wait: the compute "stream" is this thread
    if (host_addressable) return lease.as<const std::byte>();
    rt.backend().compute_stream().copy_async(scratch.data(), lease.data(), layer_bytes,
                                             CopyKind::DeviceToHost);
    rt.backend().compute_stream().synchronize();
    return static_cast<const std::byte*>(scratch.data());
  };
  // The step's compute for the mode being measured; sets `verified` false on a wrong result.
  std::function<void(const Lease&, std::size_t)> compute_step;

  PipelineOptions step_options;
  std::string prefetch_label = args.prefetch;
  if (args.prefetch == "none") {
    step_options.prefetch = PrefetchMode::None;
  } else if (args.prefetch == "auto") {
    step_options.prefetch = PrefetchMode::Auto;
  } else {
    step_options.prefetch = PrefetchMode::Fixed;
    try {
      step_options.fixed_lookahead = std::stoul(args.prefetch);
    } catch (...) {
      STRATA_FAIL(Errc::invalid_argument, "--prefetch: \"", args.prefetch,
                  "\" is not none, auto or a number of steps");
    }
  }
  step_options.across_iterations = false;
  PipelineOptions transfer_options;
  transfer_options.across_iterations = false;

  struct PassResult {
    double seconds = 0;
    std::uint64_t nvme_read = 0;
    TransferStats moved;
    PipelineStats pipeline;
  };
  // One streamed pass from cold, through a pipeline of its own; ends drained.
  auto pass = [&](const PipelineOptions& po, bool with_compute) {
    cool();
    PrefetchPipeline pipeline(rt, po);
    pipeline.set_schedule(order);
    const std::uint64_t read0 = rt.io() ? rt.io()->stats().bytes_read : 0;
    const TransferStats m0 = rt.transfer_stats();
    const auto start = Clock::now();
    pipeline.begin_iteration();
    for (std::size_t l = 0; l < args.layers; ++l) {
      StepLeases in = pipeline.begin_step("layer" + std::to_string(l),
                                          {{layers[l], Access::Read, Tier::Device}});
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
    PassResult r;
    r.seconds = seconds_since(start);
    pipeline.drain();
    rt.synchronize();
    r.nvme_read = (rt.io() ? rt.io()->stats().bytes_read : 0) - read0;
    const TransferStats m1 = rt.transfer_stats();
    r.moved.bytes_nvme_to_device = m1.bytes_nvme_to_device - m0.bytes_nvme_to_device;
    r.moved.bytes_nvme_to_host = m1.bytes_nvme_to_host - m0.bytes_nvme_to_host;
    r.moved.bytes_host_to_device = m1.bytes_host_to_device - m0.bytes_host_to_device;
    r.pipeline = pipeline.stats();
    return r;
  };
  // compute_s: every step's compute with its layer already on the device (brought in first,
  // not timed).
  auto compute_pass = [&] {
    double seconds = 0;
    for (std::size_t l = 0; l < args.layers; ++l) {
      Lease lease = rt.acquire(layers[l], Tier::Device, Access::Read).get();
      lease.wait();
      const auto start = Clock::now();
      compute_step(lease, l);
      seconds += seconds_since(start);
    }
    return seconds;
  };

  // Each mode's compute takes compute_ms per step with its data resident: by default one
  // layer's transfer time (the faster of two cold transfer passes, not counted: the first pays
  // first touches) times --compute-ratio.
  const double calibration_s =
      std::min(pass(transfer_options, false).seconds, pass(transfer_options, false).seconds);
  const double compute_ms = args.compute_ms >= 0 ? args.compute_ms
                                                 : args.compute_ratio * calibration_s * 1e3 /
                                                       static_cast<double>(args.layers);
  // Calibration data: three layers (48 MiB by default), more than a last-level cache, so that a
  // GEMM's B comes from memory as a streamed layer's does; the checksum reads the first.
  std::vector<PageBuffer> probes;
  std::vector<const std::byte*> probe_bytes;
  for (std::size_t l = 0; l < std::min<std::size_t>(3, args.layers); ++l) {
    probes.emplace_back(layer_bytes);
    fill_layer(probes.back().data(), layer_bytes, l);
    probe_bytes.push_back(probes.back().data());
  }
  const std::byte* probe = probe_bytes[0];

  std::vector<ModeResult> results;
  for (const ComputeMode mode : modes) {
    ModeResult res;
    res.mode = mode;
    bool& verified = res.verified;
    nlohmann::json gemm_figures;
    std::unique_ptr<GemmCompute> gemm;
    if (mode == ComputeMode::Copy) {
      auto t = Clock::now();
      for (int i = 0; i < 3; ++i)
        g_sink = static_cast<double>(checksum(probe, layer_bytes));
      const double checksum_s = seconds_since(t) / 3;
      t = Clock::now();
      arithmetic(20'000'000);
      const double per_iteration = seconds_since(t) / 20e6;
      const double rest = compute_ms / 1e3 - checksum_s;
      const std::uint64_t iterations =
          rest > 0 ? static_cast<std::uint64_t>(rest / per_iteration) : 0;
      compute_step = [&, iterations](const Lease& lease, std::size_t l) {
        if (checksum(host_bytes(lease), layer_bytes) != expected[l]) verified = false;
        arithmetic(iterations);
      };
    } else {
      GemmShape shape = gemm_base;
      if (shape.m == 0) shape.m = calibrate_gemm_m(shape, probe_bytes, compute_ms / 1e3);
      gemm = std::make_unique<GemmCompute>(shape, args.layers);
      compute_step = [&](const Lease& lease, std::size_t l) {
        if (!gemm->run(l, host_bytes(lease))) verified = false;
      };
    }

    std::vector<double> transfers, computes, steps;
    std::vector<PassResult> step_results, transfer_results;
    const MeasureRule rule{.min_rounds = args.passes, .min_seconds = args.min_seconds};
    for (int round = 0; !rule.enough(round, {&transfers, &computes, &steps}); ++round) {
      transfer_results.push_back(pass(transfer_options, false));
      transfers.push_back(transfer_results.back().seconds);
      computes.push_back(compute_pass());
      rt.telemetry().clear();  // the trace shows the last step pass
      step_results.push_back(pass(step_options, true));
      steps.push_back(step_results.back().seconds);
      if (progress)
        std::fprintf(
            stderr,
            "\r  %s round %d (at least %d): transfer %.3f s, compute %.3f s, step %.3f s   ",
            to_string(mode), round + 1, args.passes, transfers.back(), computes.back(),
            steps.back());
    }
    if (progress) std::fprintf(stderr, "\n");
    const std::size_t ti = median_index(transfers), si = median_index(steps);
    res.transfer_s = transfers[ti];
    res.compute_s = computes[median_index(computes)];
    res.step_s = steps[si];
    const PassResult& sr = step_results[si];
    const PassResult& tr = transfer_results[ti];
    const Roofline roof =
        assess_roofline(res.compute_s, res.transfer_s, res.step_s, args.max_roofline);
    const double roofline = roof.value;
    res.warning = roof.warning;
    const double overlap =
        (res.compute_s + res.transfer_s - res.step_s) / std::min(res.compute_s, res.transfer_s);
    const PipelineStats& ps = sr.pipeline;

    // The first mode's trace and timeline keep their names; a second mode's get "-gemm".
    const std::string suffix = mode == modes.front() ? "" : std::string("-") + to_string(mode);
    if (!args.trace.empty()) rt.telemetry().write_chrome_trace(with_suffix(args.trace, suffix));
    if (!args.svg.empty()) {
      char title[256];
      std::snprintf(title, sizeof title,
                    "strata overlap (%s): %zu x %s from %s, prefetch %s, step %.3f s (compute "
                    "%.3f, transfer %.3f), roofline %.2f",
                    to_string(mode), args.layers, format_bytes(layer_bytes).c_str(),
                    args.home.c_str(), prefetch_label.c_str(), res.step_s, res.compute_s,
                    res.transfer_s, roofline);
      write_svg_timeline(with_suffix(args.svg, suffix), rt, rt.telemetry(), title);
    }
    res.figures = {
        {"compute_ms", compute_ms},
        {"compute_s", res.compute_s},
        {"transfer_s", res.transfer_s},
        {"step_s", res.step_s},
        {"roofline", roofline},
        {"figures_trusted", roof.trusted},
        {"warning", roof.trusted ? nlohmann::json() : nlohmann::json(roof.warning)},
        {"passes", static_cast<int>(steps.size())},
        {"overlap_efficiency", overlap},
        {"transfer_s_passes", transfers},
        {"compute_s_passes", computes},
        {"step_s_passes", steps},
        {"bytes_nvme_read", sr.nvme_read},
        {"bytes_nvme_to_device", sr.moved.bytes_nvme_to_device},
        {"bytes_nvme_to_host", sr.moved.bytes_nvme_to_host},
        {"bytes_host_to_device", sr.moved.bytes_host_to_device},
        {"gbps_to_device", static_cast<double>(model) / res.transfer_s / 1e9},
        {"gbps_nvme_read", static_cast<double>(tr.nvme_read) / res.transfer_s / 1e9},
        {"max_lookahead_steps", ps.max_lookahead_steps},
        {"ready_at_step_begin", ps.inputs ? static_cast<double>(ps.ready_at_begin) / ps.inputs : 0},
        {"verified", verified}};
    if (gemm) {
      const GemmShape& s = gemm->shape();
      res.figures["gemm_m"] = s.m;
      res.figures["gemm_n"] = s.n;
      res.figures["gemm_k"] = s.k;
      res.figures["gemm_flops_per_layer"] = s.flops();
      res.figures["gemm_gflops"] =
          s.flops() * static_cast<double>(args.layers) / res.compute_s / 1e9;
      res.figures["gemm_checked_outputs"] = gemm->checked_outputs();
      res.figures["blas_threads"] = blas_threads();
      const char* timeout = std::getenv("OPENBLAS_THREAD_TIMEOUT");
      res.figures["blas_thread_timeout"] =
          timeout != nullptr ? nlohmann::json(timeout) : nlohmann::json(nullptr);
    }
    compute_step = nullptr;  // it refers to this iteration's locals
    results.push_back(std::move(res));
  }

  const TierStats d1 = rt.tier_stats(Tier::Device);
  nlohmann::json out = results.front().figures;
  const nlohmann::json common{{"bench", "overlap"},
                              {"backend", std::string(to_string(rt.backend().kind()))},
                              {"home", args.home},
                              {"prefetch", prefetch_label},
                              {"compute", args.compute},
                              {"layers", args.layers},
                              {"layer_bytes", layer_bytes},
                              {"model_bytes", model},
                              {"device_budget", rt.backend().info().budget_bytes},
                              {"link_gbps", args.link_gbps},
                              {"tier_state", "cold"},
                              {"min_passes", args.passes},
                              {"min_time_s", args.min_seconds},
                              {"peak_device_bytes", d1.peak_bytes}};
  out.update(common);
  for (std::size_t i = 1; i < results.size(); ++i)
    out[to_string(results[i].mode)] = results[i].figures;
  if (args.json) {
    print_json(out);
  } else {
    std::printf("\n  %-22s", "metric");
    for (const ModeResult& r : results)
      std::printf(" %10s", to_string(r.mode));
    std::printf("\n");
    for (const char* key : {"compute_s", "transfer_s", "step_s", "roofline", "overlap_efficiency",
                            "gbps_to_device", "gbps_nvme_read"}) {
      std::printf("  %-22s", key);
      for (const ModeResult& r : results)
        std::printf(" %10.3f", r.figures[key].get<double>());
      std::printf("\n");
    }
    std::printf("  %-22s", "max lookahead (steps)");
    for (const ModeResult& r : results)
      std::printf(" %10zu", r.figures["max_lookahead_steps"].get<std::size_t>());
    std::printf("\n  %-22s", "verified");
    for (const ModeResult& r : results)
      std::printf(" %10s", r.verified ? "yes" : "NO");
    std::printf("\n  %-22s %10s\n", "peak_device_bytes", format_bytes(d1.peak_bytes).c_str());
    for (const ModeResult& r : results) {
      if (r.mode != ComputeMode::Gemm) continue;
      const nlohmann::json& f = r.figures;
      std::printf(
          "  gemm: %zu x %zu x %zu per layer (B = the layer's bytes), %.1f GFLOP/s, "
          "%d BLAS threads\n",
          f["gemm_m"].get<std::size_t>(), f["gemm_n"].get<std::size_t>(),
          f["gemm_k"].get<std::size_t>(), f["gemm_gflops"].get<double>(),
          f["blas_threads"].get<int>());
    }
    for (const ModeResult& r : results) {
      const std::string suffix = &r == &results.front() ? "" : std::string("-") + to_string(r.mode);
      if (!args.trace.empty())
        std::printf("  trace (%s): %s (open in Perfetto)\n", to_string(r.mode),
                    with_suffix(args.trace, suffix).c_str());
      if (!args.svg.empty())
        std::printf("  timeline (%s): %s\n", to_string(r.mode),
                    with_suffix(args.svg, suffix).c_str());
    }
  }
  if (own_dir) std::filesystem::remove_all(dir);
  for (const ModeResult& r : results) {
    if (!r.verified)
      throw Error(Errc::corrupt_data,
                  std::string("overlap (") + to_string(r.mode) + "): a layer's " +
                      (r.mode == ComputeMode::Copy ? "checksum" : "GEMM output") +
                      " did not match");
  }
  for (const ModeResult& r : results) {
    if (!r.warning.empty())
      std::fprintf(stderr, "strata-bench overlap (%s): warning: %s\n", to_string(r.mode),
                   r.warning.c_str());
  }
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
  cmd->add_option("--passes", args->passes,
                  "measured rounds (each: a transfer, a compute and a step pass, all from cold): "
                  "at least this many, more until each figure has run for --min-time")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--min-time", args->min_seconds,
                  "seconds each figure's rounds add up to at least (default 1; 0: exactly "
                  "--passes)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--compute-ms", args->compute_ms,
                  "compute per step with data resident (default: --compute-ratio x one layer's "
                  "transfer time)");
  cmd->add_option("--compute-ratio", args->compute_ratio,
                  "compute per step as a multiple of one layer's measured transfer time")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--compute", args->compute,
                  "the step's compute: copy (checksum + scalar arithmetic) | gemm (OpenBLAS "
                  "sgemm, B = the layer's bytes) | both (copy rounds, then gemm rounds)");
  cmd->add_option("--gemm-m", args->gemm_m,
                  "gemm: rows of the activation (default: calibrated to the compute time)");
  cmd->add_option("--gemm-n", args->gemm_n,
                  "gemm: columns of the layer's weight matrix (default: layer floats / k)");
  cmd->add_option("--gemm-k", args->gemm_k,
                  "gemm: rows of the layer's weight matrix (default: the power of two nearest "
                  "below sqrt(layer floats))");
  cmd->add_option("--max-roofline", args->max_roofline,
                  "a roofline above this is a measurement error: the figures are marked "
                  "untrusted (figures_trusted false, a warning) (default 1.02)");
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->add_option("--trace", args->trace, "write the last pass as a Chrome trace");
  cmd->add_option("--svg", args->svg, "write the last pass as an SVG timeline");
  cmd->callback([args] { run(*args); });
}

}  // namespace strata::bench
