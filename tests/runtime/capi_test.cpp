#include "strata/strata.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/io_test_util.h"

namespace strata::testing {
namespace {

std::string config(const std::string& dir) {
  return R"({"backend": "host", "device_budget": "1MiB", "host_budget": "2MiB",
             "staging_chunk": "64KiB", "io": {"block": "64KiB"},
             "nvme": {"paths": [")" +
         dir + R"("], "capacity": "16MiB", "stripe": "64KiB"}, "quiet": true})";
}

TEST(CApi, MovesTensorsAndReportsErrorsWithMessages) {
  TempDir dir;
  strata_runtime* rt = nullptr;
  ASSERT_EQ(strata_runtime_create(config(dir.path()).c_str(), &rt), STRATA_OK)
      << strata_last_error();
  auto data = pattern(300000, 3);
  strata_tensor t = 0;
  ASSERT_EQ(strata_tensor_create(rt, "w", data.size(), STRATA_TIER_NVME, data.data(), &t),
            STRATA_OK);
  void* p = nullptr;
  ASSERT_EQ(strata_acquire(rt, t, STRATA_TIER_DEVICE, STRATA_ACCESS_READ, &p), STRATA_OK);
  EXPECT_EQ(std::memcmp(p, data.data(), data.size()), 0);
  void* q = nullptr;  // leases nest
  ASSERT_EQ(strata_acquire(rt, t, STRATA_TIER_DEVICE, STRATA_ACCESS_READ, &q), STRATA_OK);
  EXPECT_EQ(p, q);
  // strata_lease_read: the lease's bytes into host memory (how C checks a CUDA device lease).
  std::vector<unsigned char> seen(data.size());
  ASSERT_EQ(strata_lease_read(rt, t, STRATA_TIER_DEVICE, seen.data(), seen.size()), STRATA_OK);
  EXPECT_EQ(std::memcmp(seen.data(), data.data(), data.size()), 0);
  EXPECT_EQ(strata_lease_read(rt, t, STRATA_TIER_DEVICE, seen.data(), seen.size() + 1),
            STRATA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(strata_last_error()).find("bytes asked of a lease of"), std::string::npos);
  EXPECT_EQ(strata_lease_read(rt, t, STRATA_TIER_HOST, seen.data(), 1),
            STRATA_ERROR_INVALID_ARGUMENT);  // no lease there
  EXPECT_NE(std::string(strata_last_error()).find("holds no lease on tier"), std::string::npos);
  EXPECT_EQ(strata_release(rt, t, STRATA_TIER_DEVICE), STRATA_OK);
  EXPECT_EQ(strata_evict(rt, t, STRATA_TIER_DEVICE), STRATA_ERROR_INVALID_ARGUMENT);  // leased
  EXPECT_NE(std::string(strata_last_error()).find("leased"), std::string::npos);
  EXPECT_EQ(strata_release(rt, t, STRATA_TIER_DEVICE), STRATA_OK);
  EXPECT_EQ(strata_release(rt, t, STRATA_TIER_DEVICE), STRATA_ERROR_INVALID_ARGUMENT);
  EXPECT_STRNE(strata_last_error(), "");

  auto v2 = pattern(data.size(), 4);
  ASSERT_EQ(strata_tensor_write(rt, t, v2.data(), v2.size()), STRATA_OK);
  std::vector<unsigned char> back(v2.size());
  ASSERT_EQ(strata_tensor_read(rt, t, back.data(), back.size()), STRATA_OK);
  EXPECT_EQ(back, v2);
  EXPECT_EQ(strata_prefetch(rt, t, STRATA_TIER_HOST), STRATA_OK);

  strata_tensor big = 0;
  ASSERT_EQ(strata_tensor_create(rt, "big", 4 << 20, STRATA_TIER_NVME, nullptr, &big), STRATA_OK);
  EXPECT_EQ(strata_acquire(rt, big, STRATA_TIER_DEVICE, STRATA_ACCESS_READ, &p),
            STRATA_ERROR_OUT_OF_MEMORY);
  EXPECT_NE(std::string(strata_last_error()).find("Device"), std::string::npos);
  EXPECT_EQ(strata_tensor_destroy(rt, 12345), STRATA_ERROR_NOT_FOUND);

  std::uint64_t needed = 0;
  EXPECT_EQ(strata_stats_json(rt, nullptr, 0, &needed), STRATA_ERROR_INVALID_ARGUMENT);
  ASSERT_GT(needed, 10u);
  std::string stats(needed, '\0');
  ASSERT_EQ(strata_stats_json(rt, stats.data(), needed, &needed), STRATA_OK);
  EXPECT_NE(stats.find("\"tiers\""), std::string::npos);
  EXPECT_EQ(strata_trace_export(rt, dir.file("trace.json").c_str()), STRATA_OK);
  EXPECT_EQ(strata_trace_export(rt, "/nonexistent/trace.json"), STRATA_ERROR_IO);
  EXPECT_EQ(strata_tensor_destroy(rt, t), STRATA_OK);
  strata_runtime_destroy(rt);
}

TEST(CApi, BadConfigurationNamesTheKey) {
  strata_runtime* rt = reinterpret_cast<strata_runtime*>(0x1);
  EXPECT_EQ(strata_runtime_create(R"({"host_budgte": 1})", &rt), STRATA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(rt, nullptr);
  EXPECT_NE(std::string(strata_last_error()).find("host_budgte"), std::string::npos);
  EXPECT_EQ(strata_runtime_create("{}", nullptr), STRATA_ERROR_INVALID_ARGUMENT);
  strata_runtime_destroy(nullptr);  // harmless
}

}  // namespace
}  // namespace strata::testing
