// strata-bench copy: host<->device bandwidth through the backend's copy streams (pinned host
// buffers), against the backend's plain blocking copy (cudaMemcpy on CUDA) of the same size.
#include <algorithm>
#include <cstring>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_common.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/runtime/backend.h"

namespace strata::bench {
namespace {

struct Args {
  std::string bytes = "256MiB";
  int iters = 10;
  std::string backend = "auto";
  double link_gbps = 0.0;
  bool json = false;
};

// Best-of-iters GB/s of `copy` moving `bytes` each time.
template <typename F>
double best_gbps(std::size_t bytes, int iters, F&& copy) {
  double best = 1e30;
  copy();  // warm-up: first-touch and driver setup do not count
  for (int i = 0; i < iters; ++i) {
    const auto start = Clock::now();
    copy();
    best = std::min(best, seconds_since(start));
  }
  return static_cast<double>(bytes) / best / 1e9;
}

void run(const Args& args) {
  const std::size_t bytes = parse_bytes(args.bytes, "--bytes");
  BackendOptions options;
  options.kind = parse_backend_kind(args.backend, "--backend");
  options.link_gbps = args.link_gbps;
  options.device_budget_bytes = align_up(bytes, 4096) + 64 * MiB;
  auto backend = make_backend(options);

  PinnedBuffer src = backend->allocate_pinned(bytes);
  PinnedBuffer dst = backend->allocate_pinned(bytes);
  auto* s = static_cast<unsigned char*>(src.data());
  for (std::size_t i = 0; i < bytes; ++i)
    s[i] = static_cast<unsigned char>(i * 131 + 7);
  std::memset(dst.data(), 0, bytes);
  void* device = backend->allocate_device(bytes);
  auto done = backend->create_event();

  const double h2d = best_gbps(bytes, args.iters, [&] {
    backend->h2d_stream().copy_async(device, src.data(), bytes, CopyKind::HostToDevice);
    backend->h2d_stream().record(*done);
    done->synchronize();
  });
  const double d2h = best_gbps(bytes, args.iters, [&] {
    backend->d2h_stream().copy_async(dst.data(), device, bytes, CopyKind::DeviceToHost);
    backend->d2h_stream().record(*done);
    done->synchronize();
  });
  const bool verified = std::memcmp(src.data(), dst.data(), bytes) == 0;
  const double ref_h2d = best_gbps(
      bytes, args.iters, [&] { backend->copy(device, src.data(), bytes, CopyKind::HostToDevice); });
  const double ref_d2h = best_gbps(
      bytes, args.iters, [&] { backend->copy(dst.data(), device, bytes, CopyKind::DeviceToHost); });
  backend->deallocate_device(device);

  const nlohmann::json out{{"bench", "copy"},
                           {"backend", to_string(backend->kind())},
                           {"device", backend->info().name},
                           {"bytes", bytes},
                           {"pinned_locked", src.locked()},
                           {"h2d_gbps", h2d},
                           {"d2h_gbps", d2h},
                           {"reference_h2d_gbps", ref_h2d},
                           {"reference_d2h_gbps", ref_d2h},
                           {"h2d_vs_reference", h2d / ref_h2d},
                           {"d2h_vs_reference", d2h / ref_d2h},
                           {"verified", verified}};
  if (args.json) {
    print_json(out);
  } else {
    std::printf(
        "copy (%s, %s, %s): h2d %.2f GB/s (plain copy %.2f), d2h %.2f GB/s (plain copy %.2f), "
        "data %s\n",
        std::string(to_string(backend->kind())).c_str(), backend->info().name.c_str(),
        format_bytes(bytes).c_str(), h2d, ref_h2d, d2h, ref_d2h, verified ? "verified" : "WRONG");
  }
  if (!verified) throw Error(Errc::corrupt_data, "copy: device round trip changed the data");
}

}  // namespace

void register_copy(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "copy", "host<->device bandwidth on the copy streams vs a plain blocking copy");
  auto args = std::make_shared<Args>();
  cmd->add_option("--bytes", args->bytes, "bytes per copy (units allowed)");
  cmd->add_option("--iters", args->iters, "timed copies per direction")
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--backend", args->backend, "auto | host | cuda");
  cmd->add_option("--link-gbps", args->link_gbps, "host backend: pace copies to this link")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->callback([args] { run(*args); });
}

}  // namespace strata::bench
