// zero_offload_train: trains an MLP with its fp32 master weights and Adam moments offloaded to
// the host or NVMe (ZeRO-Offload), and compares against the same training kept in memory.
//
//   zero_offload_train                       # 16 x 512, states on NVMe at 4x the host budget
//   zero_offload_train --reference --json    # the same training, everything in plain memory
#include <cstdio>
#include <exception>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "strata/io/error.h"
#include "strata/io/units.h"
#include "trainer.h"

int main(int argc, char** argv) {
  using strata::examples::TrainConfig;
  TrainConfig c;
  std::string offload = "nvme", device_budget, host_budget;
  bool json = false, no_measure = false;
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
  app.add_option("--nvme-dir", c.nvme_dir, "NVMe directory (default: a temporary one)");
  app.add_option("--backend", c.backend, "host (cuda: not yet, see README)");
  app.add_flag("--reference", c.reference, "train with everything in plain memory, no offload");
  app.add_flag("--json", json, "print one JSON object");
  app.add_flag("--no-measure", no_measure, "skip timing forward/backward/optimizer/transfer alone");
  CLI11_PARSE(app, argc, argv);

  try {
    c.offload = strata::examples::parse_offload(offload);
    if (!device_budget.empty()) c.device_budget = strata::parse_bytes(device_budget);
    if (!host_budget.empty()) c.host_budget = strata::parse_bytes(host_budget);
    c.measure = !no_measure;
    const auto r = strata::examples::train(c);
    const double bound = r.forward_s + std::max({r.backward_s, r.optimizer_s, r.state_transfer_s});
    if (json) {
      nlohmann::json out{{"mode", c.reference ? "reference" : offload},
                         {"layers", c.layers},
                         {"hidden", c.hidden},
                         {"batch", c.batch},
                         {"steps", c.steps},
                         {"params", r.params},
                         {"state_bytes", r.state_bytes},
                         {"device_budget", r.device_budget},
                         {"host_budget", r.host_budget},
                         {"losses", r.losses},
                         {"final_loss", r.losses.back()},
                         {"step_s", r.step_s},
                         {"forward_s", r.forward_s},
                         {"backward_s", r.backward_s},
                         {"optimizer_s", r.optimizer_s},
                         {"state_transfer_s", r.state_transfer_s},
                         {"step_vs_bound", bound > 0 ? r.step_s / bound : 0.0},
                         {"bytes_nvme_read", r.bytes_nvme_read},
                         {"bytes_nvme_written", r.bytes_nvme_written},
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
    std::printf(
        "step %.4f s (median); alone: forward %.4f, backward %.4f, optimizer %.4f, "
        "state transfer %.4f s; step / (forward + max(rest)) = %.2f\n",
        r.step_s, r.forward_s, r.backward_s, r.optimizer_s, r.state_transfer_s,
        bound > 0 ? r.step_s / bound : 0.0);
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
