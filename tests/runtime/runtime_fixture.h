// A small runtime on the host backend with an NVMe tier in a temporary directory.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "io/io_test_util.h"
#include "strata/base/units.h"
#include "strata/runtime/runtime.h"

namespace strata::testing {

struct Budgets {
  std::size_t device = 512 * KiB;
  std::size_t host = 1 * MiB;  // of which 4 x 64 KiB staging
  std::uint64_t nvme = 64 * MiB;
  std::vector<std::string> faults;
  EngineKind engine = EngineKind::Uring;
};

inline RuntimeOptions small_options(const std::string& dir, const Budgets& b = {}) {
  RuntimeOptions o;
  o.backend.kind = BackendKind::Host;
  o.backend.device_budget_bytes = b.device;
  o.host_budget_bytes = b.host;
  o.staging_chunk_bytes = 64 * KiB;
  o.staging_chunks = 4;
  o.io.block_size = 64 * KiB;
  o.io.engine = b.engine;
  o.io.quiet = true;
  for (const auto& f : b.faults)
    o.io.faults.push_back(parse_fault(f));
  o.nvme.paths = {dir};
  o.nvme.capacity_bytes = b.nvme;
  o.nvme.stripe_bytes = 64 * KiB;
  o.quiet = true;
  return o;
}

inline TensorDesc desc(const std::string& name, std::uint64_t bytes,
                       TensorKind kind = TensorKind::Param) {
  TensorDesc d;
  d.name = name;
  d.bytes = bytes;
  d.kind = kind;
  return d;
}

/// The tensor's bytes, read back through the runtime.
inline std::vector<unsigned char> contents(Runtime& rt, TensorId t) {
  std::vector<unsigned char> out(rt.describe(t).bytes);
  rt.read(t, out.data(), out.size());
  return out;
}

inline std::vector<unsigned char> leased_bytes(const Lease& lease) {
  lease.wait();
  const auto* p = lease.as<const unsigned char>();
  return {p, p + lease.bytes()};
}

}  // namespace strata::testing
