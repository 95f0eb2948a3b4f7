// stream_inference: runs an MLP stored in a safetensors file that does not fit the device,
// streaming its layers from the file with O_DIRECT and prefetching them layer by layer.
//
//   stream_inference --generate model.safetensors --layers 64 --hidden 2048 --dtype bf16
//   stream_inference --model model.safetensors --batch 64 --device-budget 64MiB --json
//   stream_inference --model model.safetensors --batch 64 --reference --output ref.bin
#include <cblas.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "model.h"
#include "strata/base/error.h"
#include "strata/base/units.h"

namespace {

std::vector<float> read_input(const std::string& path, int in_dim, int& batch, bool batch_given) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  STRATA_EXPECTS(f.good(), "--input ", path, ": cannot open it");
  const auto bytes = static_cast<std::uint64_t>(f.tellg());
  const std::uint64_t row = static_cast<std::uint64_t>(in_dim) * sizeof(float);
  STRATA_EXPECTS(bytes > 0 && bytes % row == 0, "--input ", path, ": ", bytes,
                 " bytes is not a whole number of rows of ", in_dim, " little-endian f32 (", row,
                 " bytes each) for the model's input");
  const auto rows = static_cast<int>(bytes / row);
  STRATA_EXPECTS(!batch_given || rows == batch, "--input ", path, " holds ", rows,
                 " rows but --batch says ", batch);
  batch = rows;
  std::vector<float> out(bytes / sizeof(float));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(bytes));
  STRATA_EXPECTS(f.good(), "--input ", path, ": read failed");
  return out;
}

void write_output(const std::string& path, const std::vector<float>& out) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(out.data()),
          static_cast<std::streamsize>(out.size() * sizeof(float)));
  STRATA_EXPECTS(f.good(), "--output ", path, ": write failed");
}

}  // namespace

namespace {

// An environment variable as JSON: its text, or null when unset (the figures say what ran).
nlohmann::json env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? nlohmann::json(v) : nlohmann::json(nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace strata::examples;
  InferenceConfig c;
  std::string generate, dtype = "bf16", input, output, device_budget, host_budget;
  int layers = 32, hidden = 1024;
  bool reference = false, json = false, no_measure = false;
  CLI::App app{"Stream an MLP from a safetensors file larger than the device, layer by layer"};
  app.add_option("--model", c.model, "the model: layers.{i}.weight [out, in], layers.{i}.bias");
  app.add_option("--input", input, "raw little-endian f32 [batch, in] (default: all ones)");
  app.add_option("--batch", c.batch, "rows of the all-ones input")->check(CLI::PositiveNumber);
  app.add_option("--output", output, "write the result as raw little-endian f32 [batch, out]");
  app.add_option("--device-budget", device_budget, "device budget (default: model / 8)");
  app.add_option("--host-budget", host_budget, "pinned host budget (default 64 MiB)");
  app.add_option("--backend", c.backend, "host (cuda: not yet, see README)");
  app.add_option("--prefetch", c.prefetch, "none | auto | K (layers ahead)");
  app.add_option("--passes", c.passes,
                 "timed passes, each from cold: at least this many, more until each figure has "
                 "run for --min-time")
      ->check(CLI::PositiveNumber);
  app.add_option("--min-time", c.min_seconds,
                 "seconds each measured figure's passes add up to at least (default 1; 0: "
                 "exactly --passes)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--reference", reference, "plain reads of every weight into memory, no strata");
  app.add_flag("--json", json, "print one JSON object");
  app.add_flag("--no-measure", no_measure, "skip measuring compute and transfer alone");
  app.add_option("--max-roofline", c.max_roofline,
                 "mark the figures untrusted (a warning, figures_trusted false) when "
                 "max(compute_s, transfer_s) / step_s is above this (default and largest: 1.02)")
      ->check(CLI::Range(0.0, kMaxRoofline));
  app.add_option("--compress", c.compress,
                 "int8 | int4: the weights compressed on the host and NVMe tiers (a cache beside "
                 "the model, built once), dequantized on arrival")
      ->check(CLI::IsMember({"int8", "int4"}));
  app.add_option("--compress-group", c.compress_group, "--compress: elements a group")
      ->check(CLI::PositiveNumber);
  app.add_option("--compress-cache", c.compress_cache,
                 "--compress: the cache's directory (default: the model's)");
  app.add_option("--trace", c.trace, "Chrome trace of the last pass");
  app.add_option("--svg", c.svg, "SVG timeline of the last pass");
  app.add_option("--generate", generate, "write a synthetic model to this file and exit");
  app.add_option("--layers", layers, "--generate: layers")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden, "--generate: width")->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype, "--generate: f32 | f16 | bf16");
  CLI11_PARSE(app, argc, argv);

  try {
    if (!generate.empty()) {
      const std::uint64_t bytes =
          generate_model(generate, layers, hidden, strata::parse_dtype(dtype, "--dtype"));
      if (json)
        std::printf("%s\n",
                    nlohmann::json{{"generated", generate}, {"file_bytes", bytes}}.dump().c_str());
      else
        std::printf("wrote %s: %d layers of %d x %d %s, %s\n", generate.c_str(), layers, hidden,
                    hidden, dtype.c_str(), strata::format_bytes(bytes).c_str());
      return 0;
    }
    STRATA_EXPECTS(!c.model.empty(), "--model FILE is required (or --generate FILE)");
    const auto header = strata::safetensors::read_header(c.model);
    const ModelSpec spec = describe_model(header, c.model);
    const bool batch_given = app.count("--batch") > 0;
    if (!input.empty()) {
      c.input = read_input(input, spec.input_dim(), c.batch, batch_given);
    } else {
      c.input.assign(static_cast<std::size_t>(c.batch) * spec.input_dim(), 1.0f);
    }
    if (reference) {
      const auto out = run_reference(c.model, c.input, c.batch);
      if (!output.empty()) write_output(output, out);
      if (json)
        std::printf("%s\n", nlohmann::json{{"mode", "reference"},
                                           {"layers", spec.layers.size()},
                                           {"model_bytes", spec.model_bytes},
                                           {"batch", c.batch},
                                           {"output_checksum", output_checksum(out)},
                                           {"peak_rss_bytes", peak_rss_bytes()}}
                                .dump()
                                .c_str());
      else
        std::printf("reference: output checksum %s\n", output_checksum(out).c_str());
      return 0;
    }
    if (!device_budget.empty()) c.device_budget = strata::parse_bytes(device_budget);
    if (!host_budget.empty()) c.host_budget = strata::parse_bytes(host_budget);
    c.measure = !no_measure;
    const InferenceResult r = run_streamed(c);
    if (!output.empty()) write_output(output, r.output);
    if (!r.figures_trusted)
      std::fprintf(stderr, "stream_inference: warning: %s\n", r.warning.c_str());
    const double ratio =
        static_cast<double>(r.model.model_bytes) / static_cast<double>(r.device_budget);
    if (json) {
      std::printf("%s\n",
                  nlohmann::json{
                      {"mode", "streamed"},
                      {"layers", r.model.layers.size()},
                      {"model_bytes", r.model.model_bytes},
                      {"device_budget", r.device_budget},
                      {"host_budget", r.host_budget},
                      {"model_over_device", ratio},
                      {"batch", c.batch},
                      {"prefetch", c.prefetch},
                      {"passes", r.passes_run},
                      {"min_time_s", c.min_seconds},
                      {"step_s", r.step_s},
                      {"step_runs_s", r.step_runs_s},
                      {"cpu_steal_s", r.cpu_steal_s},
                      {"host_prefetches", r.host_prefetches},
                      {"arrivals_in_pieces", r.arrivals_in_pieces},
                      {"blas_threads", openblas_get_num_threads()},
                      {"blas_thread_timeout", env_or_null("OPENBLAS_THREAD_TIMEOUT")},
                      {"compute_s", r.compute_s},
                      {"transfer_s", r.transfer_s},
                      {"roofline", r.roofline},
                      {"figures_trusted", r.figures_trusted},
                      {"warning", r.warning.empty() ? nlohmann::json() : nlohmann::json(r.warning)},
                      {"gbps_nvme_read", r.gbps_nvme_read},
                      {"bytes_nvme_read", r.bytes_nvme_read},
                      {"samples_per_s", r.samples_per_s},
                      {"output_checksum", output_checksum(r.output)},
                      {"passes_agree", r.passes_agree},
                      {"peak_device_bytes", r.peak_device_bytes},
                      {"compress", c.compress.empty() ? "none" : c.compress},
                      {"compressed_stored_bytes", r.compressed_stored_bytes},
                      {"compressed_full_bytes", r.compressed_full_bytes},
                      {"cache_rebuilt", r.cache_rebuilt},
                      {"cache_why", r.cache_why},
                      {"dequant_s", static_cast<double>(r.dequant_ns) / 1e9},
                      {"peak_rss_bytes", peak_rss_bytes()}}
                      .dump()
                      .c_str());
      return 0;
    }
    std::printf("%zu layers, %s in %s; device budget %s (model is %.1fx), host budget %s\n",
                r.model.layers.size(), strata::format_bytes(r.model.model_bytes).c_str(),
                c.model.c_str(), strata::format_bytes(r.device_budget).c_str(), ratio,
                strata::format_bytes(r.host_budget).c_str());
    std::printf(
        "forward pass %.4f s (median of %d, each from cold): compute alone %.4f s, "
        "transfer alone %.4f s, roofline %.2f; NVMe %.2f GB/s; %.1f samples/s\n",
        r.step_s, r.passes_run, r.compute_s, r.transfer_s, r.roofline, r.gbps_nvme_read,
        r.samples_per_s);
    std::printf(
        "output checksum %s; peak RSS %s; CPU stolen by the hypervisor in the passes %.3f s\n",
        output_checksum(r.output).c_str(), strata::format_bytes(peak_rss_bytes()).c_str(),
        r.cpu_steal_s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stream_inference: %s\n", e.what());
    return 1;
  }
}
