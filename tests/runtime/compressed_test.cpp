// Compressed tensors in the residency manager (Note [Compressed copies]): stored as int8/int4 on
// the host and NVMe tiers (their bytes, their moves and their counters), dequantized into the
// device copy on arrival (from the host copy, after NVMe -> host), read-only everywhere, the
// device copy dropped without a write-back, a failed NVMe read surfacing with the tensor intact,
// a mapped file of stored bytes, and the errors for what cannot be compressed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "runtime/runtime_fixture.h"
#include "strata/base/error.h"
#include "strata/base/half.h"
#include "strata/quant/group_quant.h"
#include "strata/runtime/runtime.h"
#include "strata/runtime/telemetry.h"

namespace strata::testing {
namespace {

constexpr std::int64_t kRows = 96, kCols = 200;  // groups of 64, 64, 64 and 8 a row

TensorDesc weight(const std::string& name, Codec codec, DType dtype = DType::F32) {
  TensorDesc d;
  d.name = name;
  d.dtype = dtype;
  d.shape = {kRows, kCols};
  d.kind = TensorKind::Param;
  d.compression = {codec, 64};
  return d;
}

std::vector<float> values(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> v(kRows * kCols);
  for (float& x : v)
    x = normal(rng);
  return v;
}

quant::Scheme scheme_of(Codec codec) {
  return quant::scheme_of({codec, 64});
}

// The bytes a [kRows, kCols] weight's host and NVMe copies hold.
std::uint64_t stored_bytes(Codec codec) {
  return quant::layout(scheme_of(codec), kRows, kCols).bytes;
}

// What the device copy must hold: the stored bytes of `v`, dequantized (strata::quant, whose
// results tests/python/test_quant.py checks against an independent reference).
std::vector<float> expected(const std::vector<float>& v, Codec codec) {
  const quant::Layout l = quant::layout(scheme_of(codec), kRows, kCols);
  std::vector<std::byte> packed(l.bytes);
  quant::quantize(scheme_of(codec), l, DType::F32, v.data(), packed.data(), "w");
  std::vector<float> out(v.size());
  quant::dequantize(scheme_of(codec).bits, l, packed.data(), DType::F32, out.data(), 0, kRows);
  return out;
}

std::vector<float> device_values(Runtime& rt, TensorId t) {
  Lease lease = rt.acquire(t, Tier::Device, Access::Read).get();
  lease.wait();
  EXPECT_EQ(lease.bytes(), sizeof(float) * kRows * kCols);  // the device copy is full width
  const float* p = lease.as<const float>();
  return {p, p + kRows * kCols};
}

class CompressedTest : public ::testing::Test {
 protected:
  std::unique_ptr<Runtime> make(Budgets b = {}) {
    return std::make_unique<Runtime>(small_options(dir_.path(), b));
  }
  TempDir dir_;
};

TEST_F(CompressedTest, AHostTensorIsStoredCompressedAndDequantizedIntoItsDeviceCopy) {
  for (Codec codec : {Codec::Int8, Codec::Int4}) {
    SCOPED_TRACE(to_string(codec));
    auto rt = make();
    const auto v = values(1);
    const TensorId t = rt->create_tensor(weight("w", codec), Tier::Host, v.data());
    const std::uint64_t stored = stored_bytes(codec);
    EXPECT_EQ(rt->tier_stats(Tier::Host).used_bytes, (stored + 4095) / 4096 * 4096);
    EXPECT_EQ(rt->tensor_bytes(t, Tier::Host), stored);
    EXPECT_EQ(rt->tensor_bytes(t, Tier::Nvme), stored);
    EXPECT_EQ(rt->tensor_bytes(t, Tier::Device), sizeof(float) * v.size());
    EXPECT_EQ(rt->tensor_bytes(t), sizeof(float) * v.size());
    const auto got = device_values(*rt, t);
    EXPECT_EQ(got, expected(v, codec));
    // Within half a step of the original: the step of this data is at most 0.5 / 15 (int4).
    for (std::size_t i = 0; i < v.size(); ++i)
      ASSERT_NEAR(got[i], v[i], 0.02) << i;
    rt->synchronize();
    const TierStats d = rt->tier_stats(Tier::Device);
    EXPECT_EQ(d.bytes_in, stored);  // the compressed bytes crossed the link
    EXPECT_EQ(d.bytes_in_compressed, stored);
    EXPECT_EQ(d.dequantizations, 1u);
    EXPECT_EQ(d.bytes_dequantized, sizeof(float) * v.size());
    EXPECT_EQ(rt->transfer_stats().bytes_host_to_device, stored);
    // read() gives the dequantized values too.
    std::vector<float> r(v.size());
    rt->read(t, r.data(), r.size() * sizeof(float));
    EXPECT_EQ(r, got);
  }
}

TEST_F(CompressedTest, FromNvmeItLandsOnTheHostFirstAndTheTraceShowsTheDequantization) {
  auto rt = make();
  const auto v = values(2);
  const TensorId t = rt->create_tensor(weight("w", Codec::Int4), Tier::Nvme, v.data());
  const std::uint64_t stored = stored_bytes(Codec::Int4);
  EXPECT_EQ(device_values(*rt, t), expected(v, Codec::Int4));
  rt->synchronize();
  const TransferStats x = rt->transfer_stats();
  EXPECT_EQ(x.bytes_nvme_to_host, stored);
  EXPECT_EQ(x.bytes_host_to_device, stored);
  EXPECT_EQ(x.bytes_nvme_to_device, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Host).bytes_in_compressed, stored);
  int nvme = 0, dequant = 0;
  for (const TraceEvent& e : rt->telemetry().events()) {
    if (e.tensor != t) continue;
    nvme += e.track == Track::NvmeRead;
    if (e.track == Track::Dequant) {
      ++dequant;
      EXPECT_EQ(e.bytes, stored);
    }
  }
  EXPECT_EQ(nvme, 1);
  EXPECT_EQ(dequant, 1);
  const auto j = nlohmann::json::parse(rt->stats_json());
  EXPECT_EQ(j["tiers"]["Device"]["dequantizations"], 1);
  EXPECT_GT(j["tiers"]["Device"]["dequant_ns"].get<std::uint64_t>(), 0u);
  // Dropped from the device and the host, it comes back the same; the device copy was never
  // written back (it is never the newest alone).
  rt->evict(t, Tier::Device);
  rt->evict(t, Tier::Host);
  EXPECT_EQ(device_values(*rt, t), expected(v, Codec::Int4));
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 0u);
}

TEST_F(CompressedTest, DeviceCopiesAreDroppedNotWrittenBackUnderPressure) {
  Budgets b;
  b.device = 100 * KiB;  // one 75 KiB device copy at a time
  auto rt = make(b);
  const auto v1 = values(3), v2 = values(4);
  const TensorId a = rt->create_tensor(weight("a", Codec::Int8), Tier::Nvme, v1.data());
  const TensorId c = rt->create_tensor(weight("c", Codec::Int8), Tier::Nvme, v2.data());
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(device_values(*rt, a), expected(v1, Codec::Int8));
    EXPECT_EQ(device_values(*rt, c), expected(v2, Codec::Int8));
  }
  rt->synchronize();  // a move is counted when it finishes, after its lease could go out
  EXPECT_GE(rt->tier_stats(Tier::Device).evictions, 5u);
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Device).dequantizations, 6u);
}

TEST_F(CompressedTest, RowsSoShortThatTheStoredBytesOutnumberTheFullWidthStillWork) {
  // A [300, 1] bf16 weight (nn.Linear(1, 300)): 8 stored bytes a row (min, step, a code, padding)
  // against 2 at full width. Its device copy must still be dequantized from all of them.
  auto rt = make();
  TensorDesc d;
  d.name = "w1";
  d.dtype = DType::BF16;
  d.shape = {300, 1};
  d.compression = {Codec::Int8, 64};
  std::vector<std::uint16_t> v(300);
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = float_to_bf16(0.01f * static_cast<float>(i));
  const TensorId t = rt->create_tensor(d, Tier::Nvme, v.data());
  Lease lease = rt->acquire(t, Tier::Device, Access::Read).get();
  lease.wait();
  EXPECT_EQ(lease.bytes(), 600u);
  const auto* got = lease.as<const std::uint16_t>();
  // One element a group: m is the largest fp16 <= it, the step covers nothing: within fp16.
  for (std::size_t i = 0; i < v.size(); ++i)
    ASSERT_NEAR(bf16_to_float(got[i]), bf16_to_float(v[i]), 0.004) << i;
  rt->synchronize();  // a move is counted when it finishes, after its lease could go out
  EXPECT_EQ(rt->transfer_stats().bytes_host_to_device, 300u * 8u);
}

TEST_F(CompressedTest, ItsDeviceCopyIsNeverASourceForTheHost) {
  // Device copy there, host copy dropped: a host prefetch reads NVMe again (a device copy is
  // full width, never the stored bytes), instead of an internal error.
  auto rt = make();
  const auto v = values(9);
  const TensorId t = rt->create_tensor(weight("w", Codec::Int8), Tier::Nvme, v.data());
  EXPECT_EQ(device_values(*rt, t), expected(v, Codec::Int8));
  rt->evict(t, Tier::Host);
  rt->prefetch(t, Tier::Host);
  rt->synchronize();
  EXPECT_TRUE(rt->resident(t, Tier::Host));
  EXPECT_EQ(rt->transfer_stats().bytes_device_to_host, 0u);
  EXPECT_FALSE(rt->stage(t, Tier::Device));  // already there
}

TEST_F(CompressedTest, AFailedNvmeReadSurfacesAndTheTensorSurvives) {
  Budgets b;
  b.faults = {"read:1:eio"};
  auto rt = make(b);
  const auto v = values(5);
  const TensorId t = rt->create_tensor(weight("w", Codec::Int8), Tier::Nvme, v.data());
  EXPECT_THROW(rt->acquire(t, Tier::Device, Access::Read).get(), IoError);
  EXPECT_FALSE(rt->resident(t, Tier::Device));
  EXPECT_EQ(device_values(*rt, t), expected(v, Codec::Int8));  // the next read succeeds
}

TEST_F(CompressedTest, ADevicePrefetchReturnsBeforeTheNvmeReadAndTheLandingCarriesTheDeviceMove) {
  // Note [A device prefetch does not wait for NVMe]: prefetch() returns with the host loads in
  // flight; each landing carries its device move, with no acquire. The second read fails: its
  // prefetch does not throw (it never waited for the read), the others still arrive, and the
  // acquire of the failed one reads NVMe again.
  Budgets b;
  b.faults = {"read:2:eio"};
  auto rt = make(b);
  std::vector<std::vector<float>> v;
  std::vector<TensorId> ids;
  for (std::uint32_t i = 0; i < 4; ++i) {
    v.push_back(values(20 + i));
    ids.push_back(rt->create_tensor(weight(std::string("w") + std::to_string(i), Codec::Int8),
                                    Tier::Nvme, v.back().data()));
  }
  for (const TensorId t : ids)
    EXPECT_NO_THROW(rt->prefetch(t, Tier::Device));
  rt->synchronize();
  EXPECT_EQ(rt->tier_stats(Tier::Device).dequantizations, 3u);
  EXPECT_EQ(rt->tier_stats(Tier::Device).misses, 0u);  // nobody asked yet
  int on_device = 0;
  for (const TensorId t : ids)
    on_device += rt->resident(t, Tier::Device) ? 1 : 0;
  EXPECT_EQ(on_device, 3);
  for (std::size_t i = 0; i < ids.size(); ++i)
    EXPECT_EQ(device_values(*rt, ids[i]), expected(v[i], Codec::Int8)) << i;
  const TierStats d = rt->tier_stats(Tier::Device);
  EXPECT_EQ(d.hits, 3u);  // the prefetched three
  EXPECT_EQ(d.misses, 1u);
  rt->synchronize();
  EXPECT_EQ(rt->tier_stats(Tier::Device).dequantizations, 4u);
  EXPECT_EQ(rt->transfer_stats().bytes_nvme_to_host, 4 * stored_bytes(Codec::Int8));
}

TEST_F(CompressedTest, ADevicePrefetchMakesRoomAndAnAcquireJoinsTheMoveBehindTheRead) {
  // Note [A device prefetch does not wait for NVMe]: the device holds one 75 KiB copy. A
  // prefetch of c evicts a's (the default LRU policy, on the prefetching thread) and begins c's
  // device move behind its NVMe read; the acquire right after joins that move (a hit), and NVMe
  // is read once.
  Budgets b;
  b.device = 100 * KiB;
  auto rt = make(b);
  const auto va = values(30), vc = values(31);
  const TensorId a = rt->create_tensor(weight("a", Codec::Int8), Tier::Nvme, va.data());
  const TensorId c = rt->create_tensor(weight("c", Codec::Int4), Tier::Nvme, vc.data());
  EXPECT_EQ(device_values(*rt, a), expected(va, Codec::Int8));
  rt->prefetch(c, Tier::Device);
  EXPECT_FALSE(rt->resident(a, Tier::Device));
  EXPECT_TRUE(rt->resident(c, Tier::Device));  // on its way
  EXPECT_EQ(device_values(*rt, c), expected(vc, Codec::Int4));
  rt->synchronize();
  const TierStats d = rt->tier_stats(Tier::Device);
  EXPECT_EQ(d.hits, 1u);
  EXPECT_EQ(d.misses, 1u);  // a's
  EXPECT_EQ(d.dequantizations, 2u);
  EXPECT_EQ(rt->transfer_stats().bytes_nvme_to_host,
            stored_bytes(Codec::Int8) + stored_bytes(Codec::Int4));
}

TEST_F(CompressedTest, AReplacingPrefetchNeedsFreeRoomAndChangesNothingWithout) {
  // Note [Compressed copies]: a compressed tensor does not arrive in pieces. With a's copy
  // leased and 53 KiB free, c's 75 KiB replacing prefetch says no and leaves a alone; once a's
  // lease ends and its copy goes, it lands whole (one dequantization).
  Budgets b;
  b.device = 128 * KiB;
  auto rt = make(b);
  const auto va = values(40), vc = values(41);
  const TensorId a = rt->create_tensor(weight("a", Codec::Int8), Tier::Nvme, va.data());
  const TensorId c = rt->create_tensor(weight("c", Codec::Int4), Tier::Nvme, vc.data());
  rt->prefetch(c, Tier::Host);  // its stored bytes on the host
  rt->synchronize();
  Lease la = rt->acquire(a, Tier::Device, Access::Read).get();
  la.wait();
  EXPECT_FALSE(rt->prefetch_replacing(c, {a}));
  EXPECT_FALSE(rt->resident(c, Tier::Device));
  EXPECT_TRUE(rt->resident(a, Tier::Device));
  const float* pa = la.as<const float>();
  EXPECT_TRUE(std::equal(pa, pa + va.size(), expected(va, Codec::Int8).begin()));
  la.release();
  rt->evict(a, Tier::Device);
  ASSERT_TRUE(rt->prefetch_replacing(c, {a}));
  EXPECT_EQ(device_values(*rt, c), expected(vc, Codec::Int4));
  rt->synchronize();
  int spans = 0;
  for (const TraceEvent& e : rt->telemetry().events())
    if (e.tensor == c && e.track == Track::Dequant) ++spans;
  EXPECT_EQ(spans, 1);
  const TierStats d = rt->tier_stats(Tier::Device);
  EXPECT_EQ(d.dequantizations, 2u);
  EXPECT_EQ(d.bytes_dequantized, 2 * sizeof(float) * vc.size());
  EXPECT_EQ(rt->transfer_stats().bytes_host_to_device,
            stored_bytes(Codec::Int8) + stored_bytes(Codec::Int4));
}

TEST_F(CompressedTest, AMappedFileOfStoredBytesIsDequantizedOnTheDevice) {
  const auto v = values(6);
  const quant::Layout l = quant::layout(scheme_of(Codec::Int8), kRows, kCols);
  std::vector<std::byte> packed(l.bytes);
  quant::quantize(scheme_of(Codec::Int8), l, DType::F32, v.data(), packed.data(), "w");
  const std::string path = dir_.path() + "/cache.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f.write("header!", 7);  // an offset that is not page-aligned
    f.write(reinterpret_cast<const char*>(packed.data()), static_cast<std::streamsize>(l.bytes));
  }
  auto rt = make();
  const TensorId t = rt->map_tensor(weight("w", Codec::Int8), path, 7);
  EXPECT_EQ(device_values(*rt, t), expected(v, Codec::Int8));
}

TEST_F(CompressedTest, ACompressedTensorIsReadOnlyAndLeasedOnTheDeviceOnly) {
  auto rt = make();
  const auto v = values(7);
  const TensorId t = rt->create_tensor(weight("blk.0.w", Codec::Int8), Tier::Host, v.data());
  const auto refuses = [&](auto&& call, const std::string& what) {
    try {
      call();
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument) << what;
      EXPECT_NE(std::string(e.what()).find("\"blk.0.w\": it is stored compressed (int8, groups of "
                                           "64) and read-only"),
                std::string::npos)
          << e.what();
    }
  };
  refuses([&] { (void)rt->acquire(t, Tier::Host, Access::Read); }, "host lease");
  refuses([&] { (void)rt->acquire(t, Tier::Device, Access::ReadWrite); }, "write lease");
  refuses([&] { rt->write(t, v.data(), v.size() * sizeof(float)); }, "write");
  EXPECT_THROW(rt->discard(t), Error);
  {
    Lease lease = rt->acquire(t, Tier::Device, Access::Read).get();
    EXPECT_FALSE(lease.discard());  // only released
  }
  EXPECT_EQ(device_values(*rt, t), expected(v, Codec::Int8));  // nothing was lost
}

TEST_F(CompressedTest, WhatCannotBeCompressedIsRefusedNamingIt) {
  auto rt = make();
  TensorDesc ids = weight("ids", Codec::Int8, DType::I32);
  try {
    rt->create_tensor(ids, Tier::Host);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor \"ids\": i32 cannot be compressed (int8)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(rt->create_tensor(weight("w", Codec::Int8), Tier::Device), Error);
  TensorDesc no_shape = weight("w", Codec::Int8);
  no_shape.shape.clear();
  no_shape.bytes = 4 * kRows * kCols;
  EXPECT_THROW(rt->create_tensor(no_shape, Tier::Host), Error);
  TensorDesc odd = weight("w", Codec::Int4);
  odd.compression.group = 63;
  EXPECT_THROW(rt->create_tensor(odd, Tier::Host), Error);
  auto v = values(8);
  v[5 * kCols + 70] = NAN;  // row 5, group 1
  try {
    rt->create_tensor(weight("nan.w", Codec::Int8), Tier::Host, v.data());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'nan.w': element 70 of row 5 is nan"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(rt->tensors().size(), 0u);  // nothing half-made is left
}

}  // namespace
}  // namespace strata::testing
