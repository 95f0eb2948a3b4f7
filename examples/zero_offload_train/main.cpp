// zero_offload_train: trains an MLP with its fp32 master weights and Adam moments offloaded to
// the host or NVMe (ZeRO-Offload), and compares against the same training kept in memory.
//
//   zero_offload_train                       # 16 x 512, states on NVMe at 4x the host budget
//   zero_offload_train --reference --json    # the same training, everything in plain memory
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "example_util.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "trainer.h"

namespace {

using strata::examples::StepPhases;

double median_of(const std::vector<StepPhases>& steps, double (*part)(const StepPhases&)) {
  std::vector<double> v;
  for (const StepPhases& s : steps)
    v.push_back(part(s));
  return strata::examples::median(std::move(v));
}

// Every part of the step's bound (Note [Step bound]): medians over the training steps, the same
// steps step_s is the median of.
nlohmann::json bound_json(const std::vector<StepPhases>& steps) {
  auto m = [&](double (*part)(const StepPhases&)) { return median_of(steps, part); };
  return {{"bound_s", m([](const StepPhases& s) { return s.bound_s(); })},
          {"forward_part_s", m([](const StepPhases& s) { return s.forward_part_s(); })},
          {"backward_part_s", m([](const StepPhases& s) { return s.backward_part_s(); })},
          {"prep_s", m([](const StepPhases& s) { return s.prep_s; })},
          {"forward_s", m([](const StepPhases& s) { return s.forward_s; })},
          {"loss_s", m([](const StepPhases& s) { return s.loss_s; })},
          {"backward_optimizer_s", m([](const StepPhases& s) { return s.backward_optimizer_s; })},
          {"nvme_busy_forward_s", m([](const StepPhases& s) { return s.nvme.forward_s; })},
          {"nvme_busy_backward_s", m([](const StepPhases& s) { return s.nvme.backward_s; })},
          {"host_to_device_busy_forward_s",
           m([](const StepPhases& s) { return s.host_to_device.forward_s; })},
          {"host_to_device_busy_backward_s",
           m([](const StepPhases& s) { return s.host_to_device.backward_s; })},
          {"device_to_host_busy_forward_s",
           m([](const StepPhases& s) { return s.device_to_host.forward_s; })},
          {"device_to_host_busy_backward_s",
           m([](const StepPhases& s) { return s.device_to_host.backward_s; })},
          {"steps", steps.size()}};
}

// Which reference a run's losses equal bit for bit, and which they only approach (README, ZeRO
// example): a run split into sub-groups sums the input gradient over them, in another order than
// one sgemm over the whole layer.
std::string reference_equal(const strata::examples::TrainConfig& c,
                            const strata::examples::TrainResult& r) {
  std::string same = "zero_offload_train --reference";
  if (r.sub_groups > 1) same += " --sub-group-rows " + std::to_string(r.sub_group_rows);
  return same + " --layers " + std::to_string(c.layers) + " --hidden " + std::to_string(c.hidden) +
         " --batch " + std::to_string(c.batch) + " --steps " + std::to_string(c.steps) +
         " (the same split, in plain memory)";
}

nlohmann::json reference_near(const strata::examples::TrainResult& r) {
  if (r.sub_groups <= 1) return nullptr;  // unsplit: the bitwise reference is the unsplit one
  return "the unsplit run (--reference --sub-group-rows 0): the input gradient summed over " +
         std::to_string(r.sub_groups) +
         " sub-groups rounds differently; losses within 1e-5 relative (tested), about 5e-9 "
         "measured (1.0614401831877023 against 1.0614401885304392 at a 32 MiB host budget)";
}

}  // namespace

int main(int argc, char** argv) {
  using strata::examples::TrainConfig;
  TrainConfig c;
  std::string offload = "nvme", device_budget, host_budget;
  bool json = false;
  CLI::App app{"ZeRO-Offload training of an MLP on strata (teacher-network regression)"};
  app.add_option("--layers", c.layers, "layers")->check(CLI::PositiveNumber);
  app.add_option("--hidden", c.hidden, "width of every layer")->check(CLI::PositiveNumber);
  app.add_option("--batch", c.batch, "samples per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", c.steps, "training steps")->check(CLI::PositiveNumber);
  app.add_option("--lr", c.lr, "Adam learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", c.seed, "seed of the data, the teacher and the initial weights");
  app.add_option("--offload", offload, "where master weights and Adam states live")
      ->check(CLI::IsMember({"none", "host", "nvme"}));
  app.add_option("--device-budget", device_budget, "device tier budget (default: see README)");
  app.add_option("--host-budget", host_budget,
                 "pinned host budget (default for nvme: a quarter of the states)");
  app.add_option("--sub-group-rows", c.sub_group_rows,
                 "rows of each layer per optimizer sub-group (0: automatic, see README)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--nvme-dir", c.nvme_dir, "NVMe directory (default: a temporary one)");
  app.add_option("--backend", c.backend, "host (cuda: not yet, see README)");
  app.add_flag("--reference", c.reference, "train with everything in plain memory, no offload");
  app.add_flag("--json", json, "print one JSON object");
  CLI11_PARSE(app, argc, argv);

  try {
    c.offload = strata::examples::parse_offload(offload);
    if (!device_budget.empty()) c.device_budget = strata::parse_bytes(device_budget);
    if (!host_budget.empty()) c.host_budget = strata::parse_bytes(host_budget);
    const auto r = strata::examples::train(c);
    // Note [Step bound]: every step is at least its own bound; a step faster than it is a
    // measurement error, not a figure. The step lowest against its bound is checked: when it
    // passes, so does the median (each step_s >= ratio * bound_s, so the medians too).
    const nlohmann::json bound = bound_json(r.steps);
    const double bound_s = bound["bound_s"].get<double>();
    const double step_vs_bound = bound_s > 0 ? r.step_s / bound_s : 0.0;
    std::size_t worst = 0;
    for (std::size_t k = 1; k < r.steps.size(); ++k)
      if (r.steps[k].step_s / r.steps[k].bound_s() <
          r.steps[worst].step_s / r.steps[worst].bound_s())
        worst = k;
    const StepPhases& w = r.steps[worst];
    const double worst_ratio = w.step_s / w.bound_s();
    // Below it, the figures are a measurement error: said on stderr and in the JSON, and the run
    // (whose losses are right) still exits 0 (Note [Measuring until the figures hold]).
    const bool trusted = worst_ratio >= 1 / 1.02;
    if (!trusted) {
      std::fprintf(stderr,
                   "zero_offload_train: warning: measurement error, the timings cannot be trusted: "
                   "step %zu took %.6f s, below its own "
                   "lower bound %.6f s (step / bound = %.3f < 1/1.02; forward part %.6f s = "
                   "max(prep %.6f + forward %.6f + loss %.6f, nvme %.6f, host_to_device %.6f, "
                   "device_to_host %.6f); backward part %.6f s = max(backward beside optimizer "
                   "%.6f, nvme %.6f, host_to_device %.6f, device_to_host %.6f)); median step %.6f "
                   "s, median bound %.6f s\n",
                   worst, w.step_s, w.bound_s(), worst_ratio, w.forward_part_s(), w.prep_s,
                   w.forward_s, w.loss_s, w.nvme.forward_s, w.host_to_device.forward_s,
                   w.device_to_host.forward_s, w.backward_part_s(), w.backward_optimizer_s,
                   w.nvme.backward_s, w.host_to_device.backward_s, w.device_to_host.backward_s,
                   r.step_s, bound_s);
    }
    if (json) {
      nlohmann::json out{
          {"mode", c.reference ? "reference" : offload},
          {"layers", c.layers},
          {"hidden", c.hidden},
          {"batch", c.batch},
          {"steps", c.steps},
          {"params", r.params},
          {"state_bytes", r.state_bytes},
          {"device_budget", r.device_budget},
          {"host_budget", r.host_budget},
          {"sub_group_rows", r.sub_group_rows},
          {"sub_groups", r.sub_groups},
          {"equals_bitwise", reference_equal(c, r)},
          {"approaches", reference_near(r)},
          {"losses", r.losses},
          {"final_loss", r.losses.back()},
          {"step_s", r.step_s},
          {"forward_s", bound["forward_s"]},
          {"backward_s", median_of(r.steps, [](const StepPhases& s) { return s.backward_s; })},
          {"optimizer_s", median_of(r.steps, [](const StepPhases& s) { return s.optimizer_s; })},
          {"bound", bound},
          {"step_vs_bound", step_vs_bound},
          {"step_vs_bound_min", worst_ratio},
          {"figures_trusted", trusted},
          {"bytes_nvme_read", r.bytes_nvme_read},
          {"bytes_nvme_written", r.bytes_nvme_written},
          {"bytes_by_link",
           {{"nvme_read", r.link_bytes.nvme_read},
            {"nvme_write", r.link_bytes.nvme_write},
            {"host_to_device", r.link_bytes.host_to_device},
            {"device_to_host", r.link_bytes.device_to_host}}},
          {"peak_device_bytes", r.peak_device_bytes},
          {"peak_host_bytes", r.peak_host_bytes},
          {"pipeline", nlohmann::json::parse(r.pipeline_json)},
          {"runtime", nlohmann::json::parse(r.stats_json)}};
      std::printf("%s\n", out.dump().c_str());
      return 0;
    }
    std::printf("%s: %d layers x %d, batch %d, %s params, states %s",
                c.reference ? "reference" : offload.c_str(), c.layers, c.hidden, c.batch,
                std::to_string(r.params).c_str(), strata::format_bytes(r.state_bytes).c_str());
    if (!c.reference)
      std::printf(", device budget %s, host budget %s",
                  strata::format_bytes(r.device_budget).c_str(),
                  strata::format_bytes(r.host_budget).c_str());
    std::printf("\n");
    for (std::size_t i = 0; i < r.losses.size(); ++i)
      std::printf("step %3zu  loss %.6f\n", i, r.losses[i]);
    const auto part = [&](const char* key) { return bound[key].get<double>(); };
    std::printf(
        "step %.4f s (median), bound %.4f s, step / bound = %.2f; forward part %.4f s (compute "
        "%.4f, nvme %.4f, host to device %.4f, device to host %.4f), backward part %.4f s "
        "(backward beside optimizer %.4f, nvme %.4f, host to device %.4f, device to host %.4f)\n",
        r.step_s, bound_s, step_vs_bound, part("forward_part_s"),
        part("prep_s") + part("forward_s") + part("loss_s"), part("nvme_busy_forward_s"),
        part("host_to_device_busy_forward_s"), part("device_to_host_busy_forward_s"),
        part("backward_part_s"), part("backward_optimizer_s"), part("nvme_busy_backward_s"),
        part("host_to_device_busy_backward_s"), part("device_to_host_busy_backward_s"));
    std::printf("NVMe read %s, written %s; peak device %s, peak host %s\n",
                strata::format_bytes(r.bytes_nvme_read).c_str(),
                strata::format_bytes(r.bytes_nvme_written).c_str(),
                strata::format_bytes(r.peak_device_bytes).c_str(),
                strata::format_bytes(r.peak_host_bytes).c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_offload_train: %s\n", e.what());
    return 1;
  }
}
