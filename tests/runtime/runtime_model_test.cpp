// A randomized model test: thousands of random operations over tensors many times larger than
// the device and host budgets, against a reference copy of every tensor's bytes.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "runtime/runtime_fixture.h"
#include "strata/base/error.h"

namespace strata::testing {
namespace {

struct ModelCase {
  const char* name;
  Budgets budgets;
  int ops;
};

class RuntimeModel : public ::testing::TestWithParam<ModelCase> {};

TEST_P(RuntimeModel, EveryTensorAlwaysHoldsItsReferenceBytes) {
  const ModelCase& mc = GetParam();
  TempDir dir;
  Runtime rt(small_options(dir.path(), mc.budgets));
  std::mt19937_64 rng(12345);
  std::map<TensorId, std::vector<unsigned char>> ref;
  std::uint64_t live_bytes = 0, peak_live = 0;
  int io_errors = 0;
  auto pick = [&]() {
    auto it = ref.begin();
    std::advance(it, static_cast<long>(rng() % ref.size()));
    return it;
  };
  const Tier tiers[] = {Tier::Device, Tier::Host, Tier::Nvme};
  for (int op = 0; op < mc.ops; ++op) {
    const int kind = ref.size() < 8 ? 0 : static_cast<int>(rng() % 100);
    try {
      if (kind < 12) {  // create
        const std::size_t bytes = 1 + rng() % (192 * KiB);
        auto data = pattern(bytes, static_cast<unsigned>(op));
        const Tier home = tiers[rng() % 3];
        const bool zeroed = rng() % 4 == 0;
        if (zeroed) std::fill(data.begin(), data.end(), 0);
        const TensorId id = rt.create_tensor(desc("t" + std::to_string(op), bytes), home,
                                             zeroed ? nullptr : data.data());
        ref[id] = std::move(data);
        live_bytes += bytes;
        peak_live = std::max(peak_live, live_bytes);
      } else if (kind < 40) {  // acquire for read
        auto it = pick();
        Lease lease =
            rt.acquire(it->first, rng() % 2 ? Tier::Device : Tier::Host, Access::Read).get();
        ASSERT_EQ(leased_bytes(lease), it->second) << "op " << op;
      } else if (kind < 55) {  // acquire for write
        auto it = pick();
        Lease lease =
            rt.acquire(it->first, rng() % 2 ? Tier::Device : Tier::Host, Access::ReadWrite).get();
        ASSERT_EQ(leased_bytes(lease), it->second) << "op " << op;
        auto fresh = pattern(it->second.size(), static_cast<unsigned>(op + 7777));
        std::memcpy(lease.data(), fresh.data(), fresh.size());
        it->second = std::move(fresh);
      } else if (kind < 63) {  // write
        auto it = pick();
        auto fresh = pattern(it->second.size(), static_cast<unsigned>(op + 9999));
        rt.write(it->first, fresh.data(), fresh.size());
        it->second = std::move(fresh);
      } else if (kind < 75) {  // read
        auto it = pick();
        ASSERT_EQ(contents(rt, it->first), it->second) << "op " << op;
      } else if (kind < 85) {  // prefetch
        rt.prefetch(pick()->first, tiers[rng() % 3]);
      } else if (kind < 95) {  // evict
        try {
          rt.evict(pick()->first, tiers[rng() % 3]);
        } catch (const Error& e) {
          if (e.code() != Errc::invalid_argument) throw;  // only copy, nothing below: refused
        }
      } else {  // destroy
        auto it = pick();
        rt.destroy_tensor(it->first);
        live_bytes -= it->second.size();
        ref.erase(it);
      }
    } catch (const IoError& e) {
      // Only an injected fault may fail an operation (and then the data must not change).
      if (mc.budgets.faults.empty())
        FAIL() << "op " << op << ": I/O error with no fault injected: " << e.what();
      ++io_errors;
    }
  }
  rt.synchronize();
  for (const auto& [id, bytes] : ref)
    ASSERT_EQ(contents(rt, id), bytes) << "tensor " << id;
  EXPECT_GT(peak_live, 4 * mc.budgets.device);
  if (!mc.budgets.faults.empty()) {
    EXPECT_GT(io_errors, 0) << "no injected fault surfaced";
  }
  const TierStats d = rt.tier_stats(Tier::Device);
  EXPECT_GT(d.evictions, 0u);
  EXPECT_LE(d.peak_bytes, d.capacity_bytes);
}

Budgets with(std::size_t device, std::size_t host, std::vector<std::string> faults = {},
             EngineKind engine = EngineKind::Uring) {
  Budgets b;
  b.device = device;
  b.host = host;
  b.faults = std::move(faults);
  b.engine = engine;
  return b;
}

INSTANTIATE_TEST_SUITE_P(
    Budgets, RuntimeModel,
    ::testing::Values(ModelCase{"roomy", with(1 * MiB, 4 * MiB), 3000},
                      ModelCase{"tight", with(512 * KiB, 1 * MiB), 3000},
                      ModelCase{"posix", with(512 * KiB, 1 * MiB, {}, EngineKind::Posix), 1500},
                      ModelCase{"faults",
                                with(512 * KiB, 1 * MiB,
                                     {"read:40:eio", "read:97:short", "write:60:eio",
                                      "write:150:enospc", "read:300:eio", "write:400:eio"}),
                                3000}),
    [](const auto& test) { return std::string(test.param.name); });

}  // namespace
}  // namespace strata::testing
