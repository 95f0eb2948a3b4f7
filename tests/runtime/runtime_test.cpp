#include "strata/runtime/runtime.h"
#include "strata/runtime/telemetry.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "runtime/runtime_fixture.h"
#include "strata/base/error.h"

namespace strata::testing {
namespace {

class RuntimeTest : public ::testing::Test {
 protected:
  std::unique_ptr<Runtime> make(Budgets b = {}) {
    return std::make_unique<Runtime>(small_options(dir_.path(), b));
  }
  TempDir dir_;
};

TEST_F(RuntimeTest, MovesATensorFromNvmeToDeviceAndBack) {
  auto rt = make();
  const auto data = pattern(200 * KiB + 123, 1);
  const TensorId t = rt->create_tensor(desc("w", data.size()), Tier::Nvme, data.data());
  EXPECT_TRUE(rt->resident(t, Tier::Nvme));
  EXPECT_FALSE(rt->resident(t, Tier::Device));
  {
    Lease lease = rt->acquire(t, Tier::Device, Access::Read).get();
    EXPECT_EQ(lease.bytes(), data.size());
    EXPECT_EQ(leased_bytes(lease), data);
  }
  EXPECT_TRUE(rt->resident(t, Tier::Device));
  EXPECT_TRUE(rt->resident(t, Tier::Host));  // the host kept a copy on the way: it had room
  EXPECT_EQ(rt->tier_stats(Tier::Device).misses, 1u);
  {
    Lease again = rt->acquire(t, Tier::Device, Access::Read).get();
    EXPECT_EQ(leased_bytes(again), data);
  }
  EXPECT_EQ(rt->tier_stats(Tier::Device).hits, 1u);
  EXPECT_EQ(contents(*rt, t), data);
}

// io_uring pins what is registered as fixed buffers: that must be the pinned slab and nothing
// else (every staging slot and host copy lies in it). The host backend's device arena is
// registered only to size the chunks of reads landing in it, never pinned.
TEST_F(RuntimeTest, OnlyThePinnedSlabIsRegisteredAsFixedBuffers) {
  auto rt = make();
  ASSERT_NE(rt->io(), nullptr);
  const auto data = pattern(300 * KiB, 3);
  const TensorId t = rt->create_tensor(desc("w", data.size()), Tier::Nvme, data.data());
  Lease host = rt->acquire(t, Tier::Host, Access::Read).get();
  Lease device = rt->acquire(t, Tier::Device, Access::Read).get();
  EXPECT_EQ(leased_bytes(host), data);
  EXPECT_EQ(leased_bytes(device), data);

  const auto registered = rt->io()->registered_buffers();
  std::vector<IoEngine::RegisteredBuffer> fixed, sized;
  for (const auto& b : registered)
    (b.fixed ? fixed : sized).push_back(b);
  ASSERT_EQ(fixed.size(), 1u);
  EXPECT_EQ(fixed[0].bytes, rt->options().host_budget_bytes);
  const auto* slab = static_cast<const std::byte*>(fixed[0].data);
  const auto* h = static_cast<const std::byte*>(host.data());
  EXPECT_TRUE(h >= slab && h + host.bytes() <= slab + fixed[0].bytes)
      << "the host copy lies outside the registered slab";
  ASSERT_EQ(sized.size(), 1u);
  EXPECT_EQ(sized[0].data, rt->backend().device_pool().base());
  EXPECT_EQ(sized[0].bytes, rt->backend().info().budget_bytes);
  const auto* d = static_cast<const std::byte*>(device.data());
  const auto* arena = static_cast<const std::byte*>(sized[0].data);
  EXPECT_TRUE(d >= arena && d + device.bytes() <= arena + sized[0].bytes);
  for (const auto& b : registered)
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data) % kPageBytes, 0u) << "O_DIRECT alignment";
}

TEST_F(RuntimeTest, ByteCountsAreNamedAfterThePathTheBytesTook) {
  auto rt = make();
  const std::uint64_t bytes = 200 * KiB;
  const auto data = pattern(bytes, 3);
  // The host has room: the chunks land in a kept host copy, then go up to the device.
  const TensorId a = rt->create_tensor(desc("a", bytes), Tier::Nvme, data.data());
  rt->acquire(a, Tier::Device, Access::Read).get().wait();
  rt->synchronize();  // a move is counted as it completes, just after its bytes can be used
  TransferStats s = rt->transfer_stats();
  EXPECT_EQ(s.bytes_nvme_to_host, bytes);
  EXPECT_EQ(s.bytes_host_to_device, bytes);
  EXPECT_EQ(s.bytes_nvme_to_device, 0u);
  // No room on the host (its copy of `b` leased there fills it): NVMe straight to the device.
  const auto filler = pattern(700 * KiB, 4);
  const TensorId f = rt->create_tensor(desc("filler", filler.size()), Tier::Host, filler.data());
  rt->evict(a, Tier::Host);
  Lease hold = rt->acquire(f, Tier::Host, Access::Read).get();
  const TensorId b = rt->create_tensor(desc("b", bytes), Tier::Nvme, data.data());
  Lease lb = rt->acquire(b, Tier::Device, Access::Read).get();
  lb.wait();
  EXPECT_EQ(leased_bytes(lb), data);
  EXPECT_FALSE(rt->resident(b, Tier::Host));
  rt->synchronize();
  s = rt->transfer_stats();
  EXPECT_EQ(s.bytes_nvme_to_device, bytes);
  EXPECT_EQ(s.bytes_nvme_to_host, bytes);  // unchanged
  EXPECT_EQ(s.bytes_host_to_device, bytes);
  lb.release();
  hold.release();
  // Written on the device and evicted: device to host.
  {
    Lease w = rt->acquire(a, Tier::Device, Access::ReadWrite).get();
    w.wait();
  }
  EXPECT_TRUE(rt->evict(a, Tier::Device));
  EXPECT_EQ(rt->transfer_stats().bytes_device_to_host, bytes);
  const auto j = nlohmann::json::parse(rt->stats_json());
  EXPECT_EQ(j["transfers"]["bytes_nvme_to_device"], bytes);
  EXPECT_EQ(j["transfers"]["bytes_device_to_host"], bytes);
}

// Records what the residency core reports (observer.h), to compare with the statistics.
class Recorder final : public Observer {
 public:
  struct Landing {
    TensorId tensor;
    std::uint64_t bytes;
    Tier from, to;
    bool operator==(const Landing&) const = default;
  };
  void span(Track track, std::uint64_t start_ns, std::uint64_t end_ns, std::uint64_t bytes,
            TensorId) noexcept override {
    std::lock_guard lock(mutex);
    span_bytes[track] += bytes;
    if (end_ns < start_ns) backwards = true;
  }
  void landed(TensorId tensor, std::uint64_t bytes, Tier from, Tier to) noexcept override {
    std::lock_guard lock(mutex);
    landings.push_back({tensor, bytes, from, to});
  }
  void evicted(TensorId tensor, std::uint64_t, Tier tier) noexcept override {
    std::lock_guard lock(mutex);
    evictions.emplace_back(tensor, tier);
  }
  void written_back(TensorId tensor, std::uint64_t, Tier from) noexcept override {
    std::lock_guard lock(mutex);
    write_backs.emplace_back(tensor, from);
  }
  void requested(TensorId, Tier tier, bool hit) noexcept override {
    std::lock_guard lock(mutex);
    requests.emplace_back(tier, hit);
  }
  std::mutex mutex;
  std::map<Track, std::uint64_t> span_bytes;
  bool backwards = false;
  std::vector<Landing> landings;
  std::vector<std::pair<TensorId, Tier>> evictions, write_backs;
  std::vector<std::pair<Tier, bool>> requests;
};

TEST_F(RuntimeTest, AnAddedObserverHearsEveryMoveEvictionAndRequestTheStatisticsCount) {
  auto rt = make();
  auto rec = std::make_shared<Recorder>();
  rt->add_observer(rec);
  const std::uint64_t bytes = 200 * KiB;
  const auto data = pattern(bytes, 5);
  const TensorId a = rt->create_tensor(desc("a", bytes), Tier::Nvme, data.data());
  rt->acquire(a, Tier::Device, Access::Read).get().wait();  // a miss: Nvme -> Host -> Device
  {
    Lease w = rt->acquire(a, Tier::Device, Access::ReadWrite).get();  // a hit; makes it dirty
    w.wait();
  }
  EXPECT_TRUE(rt->evict(a, Tier::Device));  // written back to the host, then dropped
  rt->synchronize();
  std::lock_guard lock(rec->mutex);
  const std::vector<Recorder::Landing> landings = {{a, bytes, Tier::Nvme, Tier::Host},
                                                   {a, bytes, Tier::Host, Tier::Device},
                                                   {a, bytes, Tier::Device, Tier::Host}};
  EXPECT_EQ(rec->landings, landings);
  EXPECT_EQ(rec->write_backs, (std::vector<std::pair<TensorId, Tier>>{{a, Tier::Device}}));
  EXPECT_EQ(rec->evictions, (std::vector<std::pair<TensorId, Tier>>{{a, Tier::Device}}));
  EXPECT_EQ(rec->requests,
            (std::vector<std::pair<Tier, bool>>{{Tier::Device, false}, {Tier::Device, true}}));
  // Spans of chunks add up to the tensor, on every link it crossed.
  EXPECT_EQ(rec->span_bytes[Track::NvmeRead], bytes);
  EXPECT_EQ(rec->span_bytes[Track::H2D], bytes);
  EXPECT_EQ(rec->span_bytes[Track::D2H], bytes);
  EXPECT_FALSE(rec->backwards);
  // The statistics are an observer too, and agree.
  const TierStats d = rt->tier_stats(Tier::Device);
  const TierStats h = rt->tier_stats(Tier::Host);
  EXPECT_EQ(d.moves, 1u);
  EXPECT_EQ(h.moves, 2u);
  EXPECT_EQ(d.evictions, 1u);
  EXPECT_EQ(d.write_backs, 1u);
  EXPECT_EQ(d.bytes_out, bytes);
  EXPECT_EQ(d.hits, 1u);
  EXPECT_EQ(d.misses, 1u);
  EXPECT_EQ(h.peak_bytes, bytes);  // whole pages: the host copy is all the host held
  const TransferStats x = rt->transfer_stats();
  EXPECT_EQ(x.bytes_nvme_to_host, bytes);
  EXPECT_EQ(x.bytes_host_to_device, bytes);
  EXPECT_EQ(x.bytes_device_to_host, bytes);
  // The trace heard the same links.
  std::uint64_t traced_h2d = 0;
  for (const TraceEvent& e : rt->telemetry().events())
    if (e.track == Track::H2D) traced_h2d += e.bytes;
  EXPECT_EQ(traced_h2d, bytes);
}

TEST_F(RuntimeTest, AddingTooManyObserversIsRefusedByName) {
  auto rt = make();
  for (int i = 0; i < 6; ++i)
    rt->add_observer(std::make_shared<Recorder>());
  try {
    rt->add_observer(std::make_shared<Recorder>());
    FAIL() << "a seventh observer was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("6 observers are already added"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(rt->add_observer(nullptr), Error);
}

TEST_F(RuntimeTest, ZeroedTensorsOnEveryTier) {
  auto rt = make();
  for (Tier home : {Tier::Device, Tier::Host, Tier::Nvme}) {
    const TensorId t = rt->create_tensor(desc("z", 70000), home);
    EXPECT_EQ(contents(*rt, t), std::vector<unsigned char>(70000, 0)) << to_string(home);
    rt->destroy_tensor(t);
  }
  EXPECT_EQ(rt->tier_stats(Tier::Device).used_bytes, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Host).used_bytes, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Nvme).used_bytes, 0u);
}

TEST_F(RuntimeTest, WriteLeaseMakesTheCopyNewestAndEvictionWritesItBackOnce) {
  auto rt = make();
  const auto v1 = pattern(100 * KiB, 1), v2 = pattern(100 * KiB, 2);
  const TensorId t = rt->create_tensor(desc("state", v1.size()), Tier::Nvme, v1.data());
  {
    Lease lease = rt->acquire(t, Tier::Device, Access::ReadWrite).get();
    lease.wait();
    std::memcpy(lease.data(), v2.data(), v2.size());
  }
  EXPECT_FALSE(rt->resident(t, Tier::Host));  // stale now
  rt->evict(t, Tier::Device);                 // dirty: written back to the host
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 1u);
  EXPECT_TRUE(rt->resident(t, Tier::Host));
  rt->evict(t, Tier::Host);  // dirty on the host now: written to NVMe
  EXPECT_EQ(rt->tier_stats(Tier::Host).write_backs, 1u);
  EXPECT_EQ(contents(*rt, t), v2);
  // Read it up again and drop it: clean, so no second write-back.
  rt->acquire(t, Tier::Device, Access::Read).get();
  rt->evict(t, Tier::Device);
  rt->evict(t, Tier::Host);
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 1u);
  EXPECT_EQ(rt->tier_stats(Tier::Host).write_backs, 1u);
  EXPECT_EQ(contents(*rt, t), v2);
}

TEST_F(RuntimeTest, AWriteLeaseMovesNothingAndItsBytesBecomeTheNewest) {
  auto rt = make();
  const auto v1 = pattern(100 * KiB, 1), v2 = pattern(100 * KiB, 2);
  const TensorId t = rt->create_tensor(desc("grad", v1.size()), Tier::Nvme, v1.data());
  const std::uint64_t read_before = rt->io()->stats().bytes_read;
  {
    Lease lease = rt->acquire(t, Tier::Device, Access::Write).get();
    EXPECT_EQ(lease.event(), nullptr);  // no copy to wait for
    std::memcpy(lease.data(), v2.data(), v2.size());
  }
  EXPECT_EQ(rt->io()->stats().bytes_read, read_before);  // the old bytes were never read
  EXPECT_EQ(rt->tier_stats(Tier::Device).bytes_in, 0u);
  EXPECT_FALSE(rt->resident(t, Tier::Nvme));  // stale now
  EXPECT_TRUE(rt->evict(t, Tier::Device));    // dirty: written back
  EXPECT_EQ(contents(*rt, t), v2);
}

TEST_F(RuntimeTest, DiscardDropsEveryCopyWithoutWritingAndReadsAreRefused) {
  auto rt = make();
  const auto v1 = pattern(100 * KiB, 1), v2 = pattern(100 * KiB, 2);
  const TensorId t = rt->create_tensor(desc("layers.3.grad", v1.size()), Tier::Host, v1.data());
  {
    Lease lease = rt->acquire(t, Tier::Device, Access::ReadWrite).get();
    lease.wait();
    std::memcpy(lease.data(), v2.data(), v2.size());
  }
  const std::uint64_t host_used = rt->tier_stats(Tier::Host).used_bytes;
  rt->discard(t);  // dirty on the device, yet nothing is written back
  EXPECT_TRUE(rt->discarded(t));
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Device).used_bytes, 0u);
  EXPECT_LT(rt->tier_stats(Tier::Host).used_bytes, host_used);
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme})
    EXPECT_FALSE(rt->resident(t, tier));
  rt->prefetch(t, Tier::Device);  // nothing to bring: ignored
  EXPECT_FALSE(rt->resident(t, Tier::Device));
  try {
    (void)rt->acquire(t, Tier::Host, Access::Read);
    FAIL() << "reading a discarded tensor succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.3.grad"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("discarded"), std::string::npos) << e.what();
  }
  std::vector<unsigned char> out(v1.size());
  EXPECT_THROW(rt->read(t, out.data(), out.size()), Error);
  {
    Lease lease = rt->acquire(t, Tier::Device, Access::Write).get();
    std::memcpy(lease.data(), v1.data(), v1.size());
  }
  EXPECT_FALSE(rt->discarded(t));
  EXPECT_EQ(contents(*rt, t), v1);
  rt->discard(t);
  rt->write(t, v2.data(), v2.size());  // write() fills it too
  EXPECT_EQ(contents(*rt, t), v2);
  {
    Lease held = rt->acquire(t, Tier::Host, Access::Read).get();
    EXPECT_THROW(rt->discard(t), Error);  // leased
  }
  // A reader's last lease can discard on its way out; with another reader it only releases.
  Lease a = rt->acquire(t, Tier::Host, Access::Read).get();
  Lease b = rt->acquire(t, Tier::Host, Access::Read).get();
  EXPECT_FALSE(a.discard());
  EXPECT_FALSE(a);
  EXPECT_FALSE(rt->discarded(t));
  EXPECT_TRUE(b.discard());
  EXPECT_TRUE(rt->discarded(t));
  EXPECT_EQ(rt->tier_stats(Tier::Host).leased_bytes, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 0u);
}

// A tensor made where it is used (a KV cache's next page): no room and no NVMe write until its
// first (write) lease; its bytes then go down the tiers as any dirty copy's do, and come back.
TEST_F(RuntimeTest, AnUnwrittenTensorTakesNoRoomUntilItsFirstWriteLease) {
  auto rt = make();
  const auto v = pattern(200 * KiB, 7);
  const std::uint64_t nvme_written =
      rt->transfer_stats().bytes_device_to_nvme + rt->transfer_stats().bytes_host_to_nvme;
  const TensorId t = rt->create_unwritten(desc("kv.0.page.3", v.size()), Tier::Nvme);
  EXPECT_TRUE(rt->discarded(t));
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme}) {
    EXPECT_FALSE(rt->resident(t, tier));
    EXPECT_EQ(rt->tier_stats(tier).used_bytes, 0u) << to_string(tier);
  }
  try {
    (void)rt->acquire(t, Tier::Device, Access::ReadWrite);
    FAIL() << "reading an unwritten tensor succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kv.0.page.3"), std::string::npos) << e.what();
  }
  {
    Lease lease = rt->acquire(t, Tier::Device, Access::Write).get();
    std::memcpy(lease.data(), v.data(), v.size());
  }
  EXPECT_FALSE(rt->discarded(t));
  EXPECT_EQ(rt->transfer_stats().bytes_device_to_nvme + rt->transfer_stats().bytes_host_to_nvme,
            nvme_written);  // nothing written yet: the copy is dirty on the device
  EXPECT_TRUE(rt->evict(t, Tier::Device));
  EXPECT_TRUE(rt->evict(t, Tier::Host));
  EXPECT_TRUE(rt->resident(t, Tier::Nvme));
  EXPECT_FALSE(rt->resident(t, Tier::Host));
  EXPECT_EQ(contents(*rt, t), v);
  TensorDesc packed = desc("kv.int8", 1 * KiB);
  packed.dtype = DType::BF16;
  packed.shape = {512};
  packed.compression = {Codec::Int8, 64};
  EXPECT_THROW((void)rt->create_unwritten(packed, Tier::Nvme), Error);  // read-only: no writer
  rt->destroy_tensor(t);
}

TEST_F(RuntimeTest, CleanVictimsAreDroppedNeverWrittenBack) {
  auto rt = make();
  std::vector<TensorId> weights;
  std::vector<std::vector<unsigned char>> data;
  for (int i = 0; i < 12; ++i) {  // 12 x 128 KiB = 3x the device budget
    data.push_back(pattern(128 * KiB, i));
    weights.push_back(rt->create_tensor(desc("w" + std::to_string(i), 128 * KiB), Tier::Nvme,
                                        data.back().data()));
  }
  const std::uint64_t written = rt->io()->stats().bytes_written;
  for (int pass = 0; pass < 2; ++pass)
    for (int i = 0; i < 12; ++i) {
      Lease lease = rt->acquire(weights[i], Tier::Device, Access::Read).get();
      ASSERT_EQ(leased_bytes(lease), data[i]);
    }
  EXPECT_GT(rt->tier_stats(Tier::Device).evictions, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 0u);
  EXPECT_EQ(rt->tier_stats(Tier::Host).write_backs, 0u);
  EXPECT_EQ(rt->io()->stats().bytes_written, written);  // not one byte written back
}

TEST_F(RuntimeTest, EvictsTheLeastRecentlyUsedFirst) {
  auto rt = make();  // the device holds 4 tensors of 128 KiB
  std::vector<TensorId> t;
  for (int i = 0; i < 5; ++i)
    t.push_back(rt->create_tensor(desc("t" + std::to_string(i), 128 * KiB), Tier::Host));
  for (int i : {0, 1, 2, 3, 0})
    rt->acquire(t[i], Tier::Device, Access::Read).get();
  rt->acquire(t[4], Tier::Device, Access::Read).get();  // needs room: t1 is least recent
  EXPECT_FALSE(rt->resident(t[1], Tier::Device));
  for (int i : {0, 2, 3, 4})
    EXPECT_TRUE(rt->resident(t[i], Tier::Device)) << i;
}

TEST_F(RuntimeTest, EvictsTheFarthestNextUseThroughThePolicy) {
  auto rt = make();
  std::vector<TensorId> t;
  for (int i = 0; i < 5; ++i)
    t.push_back(rt->create_tensor(desc("t" + std::to_string(i), 128 * KiB), Tier::Host));
  // Next uses: t2 is needed last of all, so it goes even though t0 is least recent.
  std::map<TensorId, std::uint64_t> next{{t[0], 1}, {t[1], 2}, {t[2], 50}, {t[3], 3}};
  rt->set_eviction_policy(std::make_shared<FarthestNextUsePolicy>(
      [next](TensorId id) { return next.count(id) ? next.at(id) : ~0ULL; }));
  for (int i = 0; i < 4; ++i)
    rt->acquire(t[i], Tier::Device, Access::Read).get();
  rt->acquire(t[4], Tier::Device, Access::Read).get();
  EXPECT_FALSE(rt->resident(t[2], Tier::Device));
  for (int i : {0, 1, 3, 4})
    EXPECT_TRUE(rt->resident(t[i], Tier::Device)) << i;
}

// Note [Duplicates go first]: a host copy of a tensor the device tier holds is not needed while
// that copy stays, so it goes before a host-only copy, even a less recently used one, and
// under either policy.
void duplicates_go_first(Runtime& rt) {
  const std::uint64_t fits = rt.tier_stats(Tier::Host).capacity_bytes / (128 * KiB);
  ASSERT_GE(fits, 3u);
  std::vector<TensorId> only;  // host copies only, least recent first
  std::vector<std::vector<unsigned char>> data;
  for (std::uint64_t i = 0; i + 1 < fits; ++i) {
    data.push_back(pattern(128 * KiB, 40 + static_cast<int>(i)));
    only.push_back(
        rt.create_tensor(desc("h" + std::to_string(i), 128 * KiB), Tier::Nvme, data.back().data()));
    rt.acquire(only.back(), Tier::Host, Access::Read).get();
  }
  const auto dup_data = pattern(128 * KiB, 39);
  const TensorId dup = rt.create_tensor(desc("dup", 128 * KiB), Tier::Nvme, dup_data.data());
  rt.acquire(dup, Tier::Device, Access::Read).get();  // the host keeps a copy on the way
  rt.acquire(dup, Tier::Host, Access::Read).get();    // its host copy is now the most recent
  ASSERT_TRUE(rt.resident(dup, Tier::Host));
  const TensorId next = rt.create_tensor(desc("next", 128 * KiB), Tier::Nvme, dup_data.data());
  rt.acquire(next, Tier::Host, Access::Read).get();  // needs room on the host
  EXPECT_FALSE(rt.resident(dup, Tier::Host));        // the duplicate went,
  EXPECT_TRUE(rt.resident(dup, Tier::Device));
  for (std::size_t i = 0; i < only.size(); ++i)  // not the least recent host-only copy
    EXPECT_TRUE(rt.resident(only[i], Tier::Host)) << i;
  rt.evict(dup, Tier::Device);  // its last copy above NVMe gone: read back from there, whole
  Lease again = rt.acquire(dup, Tier::Device, Access::Read).get();
  EXPECT_EQ(leased_bytes(again), dup_data);
  for (std::size_t i = 0; i < only.size(); ++i)
    EXPECT_EQ(contents(rt, only[i]), data[i]) << i;
}

TEST_F(RuntimeTest, AHostCopyTheDeviceAlsoHoldsIsEvictedFirstUnderLru) {
  auto rt = make();
  duplicates_go_first(*rt);
}

TEST_F(RuntimeTest, AHostCopyTheDeviceAlsoHoldsIsEvictedFirstUnderFarthestNextUse) {
  auto rt = make();
  // No next use known for any (a loop's own tensors): Belady falls back to recency, which the
  // duplicate rule overrides.
  rt->set_eviction_policy(std::make_shared<FarthestNextUsePolicy>([](TensorId) { return ~0ULL; }));
  duplicates_go_first(*rt);
}

TEST_F(RuntimeTest, CompactsInsteadOfEvictingWhenFreeBytesSuffice) {
  auto rt = make();  // 512 KiB device
  std::vector<TensorId> t;
  std::vector<std::vector<unsigned char>> data;
  for (int i = 0; i < 4; ++i) {
    data.push_back(pattern(128 * KiB, 10 + i));
    t.push_back(
        rt->create_tensor(desc("t" + std::to_string(i), 128 * KiB), Tier::Host, data[i].data()));
    rt->acquire(t[i], Tier::Device, Access::Read).get();
  }
  rt->evict(t[0], Tier::Device);
  rt->evict(t[2], Tier::Device);  // two holes of 128 KiB: 256 KiB free, none of it in one block
  const std::uint64_t evictions = rt->tier_stats(Tier::Device).evictions;
  const TensorId big = rt->create_tensor(desc("big", 256 * KiB), Tier::Host);
  rt->acquire(big, Tier::Device, Access::Read).get();
  EXPECT_EQ(rt->tier_stats(Tier::Device).evictions, evictions);  // nothing evicted
  EXPECT_GT(rt->tier_stats(Tier::Device).compactions, 0u);
  for (int i : {1, 3}) {
    EXPECT_TRUE(rt->resident(t[i], Tier::Device));
    Lease lease = rt->acquire(t[i], Tier::Device, Access::Read).get();
    EXPECT_EQ(leased_bytes(lease), data[i]) << "moved tensor " << i << " kept its bytes";
  }
}

// Note [Making room]: a dirty device victim needs room on the host, whose own dirty victim
// needs room on NVMe: written back bottom first, nothing lost.
// `n` tensors of 256 KiB whose only copies are on `tier` (dirty there), named prefix + i.
struct OnlyCopies {
  std::vector<TensorId> ids;
  std::vector<std::vector<unsigned char>> data;
  OnlyCopies(Runtime& rt, const std::string& prefix, int n, Tier tier, unsigned seed) {
    for (int i = 0; i < n; ++i) {
      data.push_back(pattern(256 * KiB, seed + i));
      ids.push_back(
          rt.create_tensor(desc(prefix + std::to_string(i), 256 * KiB), tier, data.back().data()));
    }
  }
};

// Fills the device with two dirty copies, then loads a third tensor from NVMe: one device
// victim must be written back.
void load_one_more(Runtime& rt, unsigned seed) {
  const auto x_data = pattern(256 * KiB, seed);
  const TensorId x = rt.create_tensor(desc("x", 256 * KiB), Tier::Nvme, x_data.data());
  Lease l = rt.acquire(x, Tier::Device, Access::Read).get();
  EXPECT_EQ(leased_bytes(l), x_data);
}

TEST_F(RuntimeTest, AWriteBackThatNeedsRoomBelowWritesBackThereFirst) {
  auto rt = make();  // device 512 KiB; host 768 KiB after 4 x 64 KiB of staging
  const OnlyCopies h(*rt, "h", 3, Tier::Host, 20);
  const OnlyCopies d(*rt, "d", 2, Tier::Device, 30);
  const auto& host = h.ids;
  const auto& host_data = h.data;
  const auto& device = d.ids;
  const auto& device_data = d.data;
  load_one_more(*rt, 40);
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 1u);
  EXPECT_EQ(rt->tier_stats(Tier::Host).write_backs, 1u);
  EXPECT_TRUE(rt->resident(device[0], Tier::Host));  // kept on the host
  EXPECT_FALSE(rt->resident(device[0], Tier::Device));
  EXPECT_TRUE(rt->resident(host[0], Tier::Nvme));  // made room for it
  EXPECT_FALSE(rt->resident(host[0], Tier::Host));
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(contents(*rt, host[i]), host_data[i]) << "h" << i;
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(contents(*rt, device[i]), device_data[i]) << "d" << i;
}

// When the host cannot take a device victim (everything there is leased), its write-back goes
// straight to NVMe; the host's copies stay where they are.
TEST_F(RuntimeTest, AWriteBackTheHostCannotTakeGoesStraightToNvme) {
  auto rt = make();
  std::vector<TensorId> host;
  std::vector<Lease> held;
  for (int i = 0; i < 3; ++i) {
    host.push_back(rt->create_tensor(desc("h" + std::to_string(i), 256 * KiB), Tier::Host));
    held.push_back(rt->acquire(host[i], Tier::Host, Access::Read).get());
  }
  const OnlyCopies d(*rt, "d", 2, Tier::Device, 50);
  const auto& device = d.ids;
  const auto& device_data = d.data;
  load_one_more(*rt, 60);
  EXPECT_EQ(rt->tier_stats(Tier::Device).write_backs, 1u);
  EXPECT_EQ(rt->tier_stats(Tier::Host).write_backs, 0u);
  EXPECT_EQ(rt->transfer_stats().bytes_device_to_nvme, 256 * KiB);
  EXPECT_TRUE(rt->resident(device[0], Tier::Nvme));
  EXPECT_FALSE(rt->resident(device[0], Tier::Host));
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(rt->resident(host[i], Tier::Host));
  held.clear();
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(contents(*rt, device[i]), device_data[i]) << "d" << i;
}

// Room on the host when every copy there is either leased or dirty, and NVMe, where the dirty
// ones would go, is full: an error naming what was asked and why, not a wait. The wait was for
// this request's own pins (the requester's NVMe copy, the victim being written back), which
// end only when it does. Nothing is lost; with the lease gone, the acquire succeeds.
TEST_F(RuntimeTest, RoomThatOnlyDirtyCopiesCouldMakeWithNvmeFullIsAnErrorNotAWait) {
  Budgets b;
  b.host = 4 * 64 * KiB + 256 * KiB;  // staging, then four 64 KiB copies
  b.nvme = 256 * KiB;                 // four 64 KiB extents
  auto rt = make(b);
  std::vector<TensorId> on_nvme, on_host;
  std::vector<std::vector<unsigned char>> host_data;
  for (int i = 0; i < 4; ++i) {
    const auto d = pattern(64 * KiB, i);
    on_nvme.push_back(
        rt->create_tensor(desc("n" + std::to_string(i), 64 * KiB), Tier::Nvme, d.data()));
  }
  for (int i = 0; i < 3; ++i) {
    host_data.push_back(pattern(64 * KiB, 10 + i));
    on_host.push_back(rt->create_tensor(desc("h" + std::to_string(i), 64 * KiB), Tier::Host,
                                        host_data.back().data()));
  }
  Lease l0 = rt->acquire(on_nvme[0], Tier::Host, Access::Read).get();  // the fourth host copy
  // The bug was a wait forever: bounded here, so that it comes back as a failure, not a hang.
  auto asked = std::async(std::launch::async, [&] {
    try {
      rt->acquire(on_nvme[1], Tier::Host, Access::Read);
    } catch (const OutOfMemoryError&) {
      return std::current_exception();
    }
    return std::exception_ptr{};
  });
  if (asked.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "the acquire still waits after 60 s: room-making waits for itself\n");
    std::abort();  // the waiting thread holds the runtime: no clean way out
  }
  try {
    const std::exception_ptr e = asked.get();
    ASSERT_TRUE(e) << "placed a copy where only dirty copies could make room, and NVMe is full";
    std::rethrow_exception(e);
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), "Host");
    EXPECT_EQ(e.requested_bytes(), 64 * KiB);
    const std::string what = e.what();
    EXPECT_NE(what.find("\"n1\" cannot be placed on Host"), std::string::npos) << what;
    EXPECT_NE(what.find("write-back found no room below"), std::string::npos) << what;
    EXPECT_NE(what.find("Nvme"), std::string::npos) << what;
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(rt->resident(on_host[i], Tier::Host)) << i;
    EXPECT_EQ(contents(*rt, on_host[i]), host_data[i]) << i;
  }
  l0.release();
  Lease l1 = rt->acquire(on_nvme[1], Tier::Host, Access::Read).get();  // n0's clean copy goes
  EXPECT_EQ(leased_bytes(l1), pattern(64 * KiB, 1));
}

TEST_F(RuntimeTest, AWorkingSetThatCannotFitNamesTheLeasedTensors) {
  auto rt = make();
  const TensorId a = rt->create_tensor(desc("layer.a", 256 * KiB), Tier::Host);
  const TensorId b = rt->create_tensor(desc("layer.b", 256 * KiB), Tier::Host);
  const TensorId c = rt->create_tensor(desc("layer.c", 128 * KiB), Tier::Host);
  Lease la = rt->acquire(a, Tier::Device, Access::Read).get();
  Lease lb = rt->acquire(b, Tier::Device, Access::Read).get();
  try {
    rt->acquire(c, Tier::Device, Access::Read);
    FAIL() << "placed a tensor while everything was leased";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), "Device");
    EXPECT_EQ(e.requested_bytes(), 128 * KiB);
    const std::string what = e.what();
    EXPECT_NE(what.find("layer.a"), std::string::npos) << what;
    EXPECT_NE(what.find("layer.b"), std::string::npos) << what;
    EXPECT_NE(what.find("262144"), std::string::npos) << what;
  }
  la.release();
  rt->acquire(c, Tier::Device, Access::Read).get();  // now it fits: nothing was lost
  const TensorId huge = rt->create_tensor(desc("huge", 1 * MiB), Tier::Nvme);
  EXPECT_THROW(rt->acquire(huge, Tier::Device, Access::Read), OutOfMemoryError);
}

TEST_F(RuntimeTest, AFailedWriteBackLeavesTheTensorDirtyAndLosesNothing) {
  Budgets b;
  b.faults = {"write:3:eio"};  // creation writes 2 ops (2 x 64 KiB); the write-back fails
  auto rt = make(b);
  const auto v1 = pattern(128 * KiB, 1), v2 = pattern(128 * KiB, 2);
  const TensorId t = rt->create_tensor(desc("adam.m", v1.size()), Tier::Nvme, v1.data());
  {
    Lease lease = rt->acquire(t, Tier::Host, Access::Write).get();
    std::memcpy(lease.data(), v2.data(), v2.size());
  }
  try {
    rt->evict(t, Tier::Host);
    FAIL() << "the injected EIO did not surface";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
  }
  EXPECT_TRUE(rt->resident(t, Tier::Host));  // still there, still the newest
  EXPECT_EQ(contents(*rt, t), v2);
  rt->evict(t, Tier::Host);  // the retry succeeds
  EXPECT_EQ(contents(*rt, t), v2);
}

TEST_F(RuntimeTest, AFailedLoadSurfacesOnTheFutureAndTheTensorSurvives) {
  // For a read lease and a read-write one: a lease whose load failed wrote nothing, so its end
  // must not make the absent copy the tensor's only current one (for a read-write lease it
  // did: every later acquire waited for it forever, found by strata.torch.optim's retry of a
  // failed step).
  for (const Access access : {Access::Read, Access::ReadWrite}) {
    SCOPED_TRACE(access == Access::Read ? "read" : "read-write");
    Budgets b;
    b.faults = {"read:1:eio"};
    auto rt = make(b);
    const auto data = pattern(64 * KiB, 3);
    const TensorId t = rt->create_tensor(desc("w", data.size()), Tier::Nvme, data.data());
    LeaseFuture f = rt->acquire(t, Tier::Host, access);
    EXPECT_THROW(f.get(), IoError);
    EXPECT_FALSE(rt->resident(t, Tier::Host));
    Lease lease = rt->acquire(t, Tier::Host, access).get();
    EXPECT_EQ(leased_bytes(lease), data);
  }
}

// Which lanes moved `t`: NVMe reads, host-to-device copies.
std::pair<int, int> lanes_of(Runtime& rt, TensorId t) {
  rt.synchronize();  // a lease may go out before the last copy's span is recorded
  int nvme = 0, h2d = 0;
  for (const TraceEvent& e : rt.telemetry().events()) {
    if (e.tensor != t) continue;
    nvme += e.track == Track::NvmeRead;
    h2d += e.track == Track::H2D;
  }
  return {nvme, h2d};
}

TEST_F(RuntimeTest, NvmeToDeviceGoesThroughStagingWhenTheHostIsFull) {
  Budgets b;
  b.device = 2 * MiB;
  auto o = small_options(dir_.path(), b);  // host tier: 1 MiB - 256 KiB staging = 768 KiB
  o.backend.link_gbps = 100;               // a modelled link: always the staged pipeline
  auto rt = std::make_unique<Runtime>(o);
  const auto data = pattern(1 * MiB + 4096 * 3 + 7, 4);
  const TensorId t = rt->create_tensor(desc("big", data.size()), Tier::Nvme, data.data());
  Lease lease = rt->acquire(t, Tier::Device, Access::Read).get();
  EXPECT_EQ(leased_bytes(lease), data);
  EXPECT_FALSE(rt->resident(t, Tier::Host));  // it never fit there
  const auto [nvme, h2d] = lanes_of(*rt, t);
  EXPECT_EQ(nvme, 17);  // 16 chunks of 64 KiB, then the last partial one
  EXPECT_EQ(h2d, 17);
  // Written on the device and evicted: back to NVMe through staging.
  auto v2 = pattern(data.size(), 5);
  lease.release();
  rt->write(t, v2.data(), v2.size());
  rt->evict(t, Tier::Device);
  EXPECT_EQ(contents(*rt, t), v2);
}

TEST_F(RuntimeTest, AnUnpacedHostDeviceReadsNvmeDirectlyWhenTheHostIsFull) {
  Budgets b;
  b.device = 2 * MiB;
  auto rt = make(b);  // host backend, no link model: device memory is host memory
  const auto data = pattern(1 * MiB + 4096 * 3 + 7, 4);
  const TensorId t = rt->create_tensor(desc("big", data.size()), Tier::Nvme, data.data());
  Lease lease = rt->acquire(t, Tier::Device, Access::Read).get();
  EXPECT_EQ(lease.event(), nullptr);  // the bytes are there: nothing left on a stream
  EXPECT_EQ(leased_bytes(lease), data);
  EXPECT_FALSE(rt->resident(t, Tier::Host));
  const auto [nvme, h2d] = lanes_of(*rt, t);
  EXPECT_EQ(nvme, 17);  // 17 chunks read into the device copy
  EXPECT_EQ(h2d, 0);    // and no second copy
  // A tensor that fits the host still keeps a host copy on the way (staged).
  const auto small = pattern(100 * KiB, 5);
  const TensorId s = rt->create_tensor(desc("small", small.size()), Tier::Nvme, small.data());
  EXPECT_EQ(leased_bytes(rt->acquire(s, Tier::Device, Access::Read).get()), small);
  EXPECT_TRUE(rt->resident(s, Tier::Host));
}

TEST_F(RuntimeTest, WithoutAHostCopyOnTheWayAnUnpacedHostDeviceReadsNvmeDirectly) {
  RuntimeOptions o = small_options(dir_.path());
  o.host_copy_on_the_way = false;
  auto rt = std::make_unique<Runtime>(o);
  const auto small = pattern(100 * KiB + 5, 8);  // fits the host tier, which stays empty
  const TensorId s = rt->create_tensor(desc("small", small.size()), Tier::Nvme, small.data());
  {
    Lease lease = rt->acquire(s, Tier::Device, Access::Read).get();
    EXPECT_EQ(lease.event(), nullptr);
    EXPECT_EQ(leased_bytes(lease), small);
  }
  EXPECT_FALSE(rt->resident(s, Tier::Host));
  const auto [nvme, h2d] = lanes_of(*rt, s);
  EXPECT_EQ(nvme, 2);  // two 64 KiB chunks read into the device copy
  EXPECT_EQ(h2d, 0);   // and nothing copied
  EXPECT_EQ(rt->transfer_stats().bytes_nvme_to_device, small.size());
  EXPECT_EQ(rt->transfer_stats().bytes_nvme_to_host, 0u);
  // A paced link stages all the same, and still keeps no host copy.
  o.backend.link_gbps = 100;
  rt = std::make_unique<Runtime>(o);
  const TensorId p = rt->create_tensor(desc("paced", small.size()), Tier::Nvme, small.data());
  EXPECT_EQ(leased_bytes(rt->acquire(p, Tier::Device, Access::Read).get()), small);
  EXPECT_FALSE(rt->resident(p, Tier::Host));
  EXPECT_EQ(lanes_of(*rt, p).second, 2);  // two chunks copied up from staging slots
  EXPECT_EQ(RuntimeOptions::from_json(R"({"host_copy_on_the_way": false})").host_copy_on_the_way,
            false);
  EXPECT_THROW(RuntimeOptions::from_json(R"({"host_copy_on_the_way": "no"})"), Error);
}

// Note [Reads in the order asked]: moves that land in a copy send all their chunks at once, so
// the engine reads the first tensor asked for before the next one, however many chunks it has.
TEST_F(RuntimeTest, ATensorAskedForFirstIsReadFirst) {
  for (const bool host_copy : {true, false}) {
    RuntimeOptions o = small_options(dir_.path());
    o.backend.device_budget_bytes = 1 * MiB;
    o.host_budget_bytes = 2 * MiB;
    o.host_copy_on_the_way = host_copy;  // landing in the host copy, or in the device copy
    auto rt = std::make_unique<Runtime>(o);
    const auto a = pattern(6 * 64 * KiB, 1), b = pattern(6 * 64 * KiB, 2);  // 6 chunks each
    const TensorId ta = rt->create_tensor(desc("a", a.size()), Tier::Nvme, a.data());
    const TensorId tb = rt->create_tensor(desc("b", b.size()), Tier::Nvme, b.data());
    rt->prefetch(ta, Tier::Device);
    rt->prefetch(tb, Tier::Device);
    EXPECT_EQ(leased_bytes(rt->acquire(tb, Tier::Device, Access::Read).get()), b);
    EXPECT_EQ(leased_bytes(rt->acquire(ta, Tier::Device, Access::Read).get()), a);
    rt->synchronize();
    std::uint64_t last_a = 0, first_b = ~std::uint64_t{0};
    int reads_a = 0, reads_b = 0;
    for (const TraceEvent& e : rt->telemetry().events()) {
      if (e.track != Track::NvmeRead) continue;  // start_ns: when the chunk was sent
      if (e.tensor == ta) last_a = std::max(last_a, e.start_ns), ++reads_a;
      if (e.tensor == tb) first_b = std::min(first_b, e.start_ns), ++reads_b;
    }
    EXPECT_EQ(reads_a, 6);
    EXPECT_EQ(reads_b, 6);
    EXPECT_LE(last_a, first_b) << "host copy on the way: " << host_copy;
    EXPECT_EQ(rt->resident(ta, Tier::Host), host_copy);
  }
}

// Note [Arrival in pieces]: the device holds A (leased) and 384 KiB free; B (640 KiB) claims
// A's room: the 6 chunks that fit the free part are sent at once, the other 4 once A's lease ends.
TEST_F(RuntimeTest, ANextTensorArrivesInPiecesAsTheCurrentOneLeaves) {
  for (const bool from_host : {false, true}) {
    RuntimeOptions o = small_options(dir_.path());
    o.backend.device_budget_bytes = 1 * MiB;
    o.host_budget_bytes = 2 * MiB;
    o.host_copy_on_the_way = false;
    auto rt = std::make_unique<Runtime>(o);
    const auto a = pattern(640 * KiB, 1), b = pattern(640 * KiB, 2);
    const TensorId ta = rt->create_tensor(desc("a", a.size()), Tier::Nvme, a.data());
    const TensorId tb = rt->create_tensor(desc("b", b.size()), Tier::Nvme, b.data());
    if (from_host) rt->acquire(tb, Tier::Host, Access::Read).get().release();
    Lease la = rt->acquire(ta, Tier::Device, Access::Read).get();
    EXPECT_THROW(rt->prefetch(tb, Tier::Device), OutOfMemoryError);  // no room the usual way
    ASSERT_TRUE(rt->prefetch_replacing(tb, {ta}));
    EXPECT_TRUE(rt->resident(tb, Tier::Device));  // on its way
    EXPECT_TRUE(rt->resident(ta, Tier::Device));
    EXPECT_EQ(leased_bytes(la), a);  // A untouched while its lease lasts
    const std::uint64_t released = rt->telemetry().now_ns();
    la.release();
    EXPECT_EQ(leased_bytes(rt->acquire(tb, Tier::Device, Access::Read).get()), b);
    EXPECT_FALSE(rt->resident(ta, Tier::Device));  // dropped for B, not kept
    rt->synchronize();
    int before = 0, after = 0;
    const Track lane = from_host ? Track::H2D : Track::NvmeRead;
    for (const TraceEvent& e : rt->telemetry().events())
      if (e.tensor == tb && e.track == lane) ++(e.start_ns < released ? before : after);
    if (from_host) {
      EXPECT_EQ(before + after, 10);  // a copy span starts when the stream gets to it
    } else {
      EXPECT_EQ(before, 6);  // a read's span starts when it is sent
      EXPECT_EQ(after, 4);
    }
    EXPECT_EQ(rt->transfer_stats().bytes_host_to_device, from_host ? b.size() : 0u);
    EXPECT_EQ(rt->transfer_stats().bytes_nvme_to_device, a.size() + (from_host ? 0 : b.size()));
    EXPECT_EQ(rt->tier_stats(Tier::Device).evictions, 1u);
    EXPECT_EQ(contents(*rt, ta), a);  // still on NVMe
  }
}

TEST_F(RuntimeTest, AnArrivalInPiecesThatFailsGivesItsClaimsBackAndLosesNothing) {
  RuntimeOptions o = small_options(dir_.path());
  o.backend.device_budget_bytes = 1 * MiB;
  o.host_copy_on_the_way = false;
  o.io.faults = {parse_fault("read:12:eio")};  // A's load is reads 1-10; B's 2nd chunk fails
  auto rt = std::make_unique<Runtime>(o);
  const auto a = pattern(640 * KiB, 5), b = pattern(640 * KiB, 6);
  const TensorId ta = rt->create_tensor(desc("a", a.size()), Tier::Nvme, a.data());
  const TensorId tb = rt->create_tensor(desc("b", b.size()), Tier::Nvme, b.data());
  Lease la = rt->acquire(ta, Tier::Device, Access::Read).get();
  ASSERT_TRUE(rt->prefetch_replacing(tb, {ta}));
  rt->synchronize();  // the failed move ends without waiting for A's room
  EXPECT_FALSE(rt->resident(tb, Tier::Device));
  la.release();
  EXPECT_TRUE(rt->resident(ta, Tier::Device));  // the claim lapsed: A is kept
  EXPECT_EQ(rt->tier_stats(Tier::Device).leased_bytes, 0u);
  EXPECT_EQ(leased_bytes(rt->acquire(tb, Tier::Device, Access::Read).get()), b);
  EXPECT_EQ(contents(*rt, ta), a);
}

TEST_F(RuntimeTest, OnlyCleanCopiesNotLeasedForWritingAreReplaced) {
  RuntimeOptions o = small_options(dir_.path());
  o.backend.device_budget_bytes = 1 * MiB;
  o.host_copy_on_the_way = false;
  auto rt = std::make_unique<Runtime>(o);
  const auto a = pattern(640 * KiB, 3), b = pattern(640 * KiB, 4);
  const TensorId ta = rt->create_tensor(desc("a", a.size()), Tier::Nvme, a.data());
  const TensorId tb = rt->create_tensor(desc("b", b.size()), Tier::Nvme, b.data());
  {
    Lease w = rt->acquire(ta, Tier::Device, Access::ReadWrite).get();
    EXPECT_FALSE(rt->prefetch_replacing(tb, {ta}));  // leased for writing
  }
  {
    Lease r = rt->acquire(ta, Tier::Device, Access::Read).get();
    EXPECT_FALSE(rt->prefetch_replacing(tb, {ta}));  // dirty: its only copy
    EXPECT_FALSE(rt->prefetch_replacing(tb, {}));    // nothing replaceable
    EXPECT_FALSE(rt->resident(tb, Tier::Device));
    EXPECT_EQ(leased_bytes(r), a);
  }
  EXPECT_TRUE(rt->resident(ta, Tier::Device));
  // Unleased, clean, replaceable: dropped at once, and the move is an ordinary one.
  rt->evict(ta, Tier::Device);  // written back: clean below
  rt->acquire(ta, Tier::Device, Access::Read).get().release();
  rt->synchronize();  // its copy up from the host has landed: a copy still landing is not taken
  EXPECT_TRUE(rt->prefetch_replacing(tb, {ta}));
  EXPECT_EQ(leased_bytes(rt->acquire(tb, Tier::Device, Access::Read).get()), b);
  EXPECT_FALSE(rt->resident(ta, Tier::Device));
}

TEST_F(RuntimeTest, AHostBudgetSmallerThanTheStagingAreaShrinksItAndStreamsExactly) {
  // Note [Staging fits the budget]: the default staging area (4 x 4 MiB) and a 1 MiB I/O block
  // in a 3 MiB host budget. Before, the runtime refused it.
  RuntimeOptions o = small_options(dir_.path());
  o.host_budget_bytes = 3 * MiB;
  o.staging_chunk_bytes = 4 * MiB;
  o.staging_chunks = 4;
  o.io.block_size = 1 * MiB;
  o.nvme.stripe_bytes = 1 * MiB;
  o.backend.device_budget_bytes = 16 * MiB;
  auto rt = std::make_unique<Runtime>(o);
  const RuntimeOptions& used = rt->options();
  EXPECT_EQ(used.staging_chunks, 4u);
  EXPECT_EQ(used.io.block_size, 512 * KiB);        // at most a quarter of the budget
  EXPECT_EQ(used.staging_chunk_bytes, 256 * KiB);  // 4 x 256 KiB <= (3 MiB - 512 KiB) / 2
  const auto a = pattern(6 * MiB + 123, 21);       // larger than the whole host budget
  const TensorId t = rt->create_tensor(desc("big", a.size()), Tier::Nvme, a.data());
  EXPECT_EQ(leased_bytes(rt->acquire(t, Tier::Device, Access::Read).get()), a);
  EXPECT_EQ(rt->transfer_stats().bytes_nvme_to_device, a.size());  // through the staging slots
  // A budget of 1 MiB + 64 KiB, refused before: smaller blocks, and still every byte right.
  o.host_budget_bytes = 1 * MiB + 64 * KiB;
  rt = std::make_unique<Runtime>(o);
  EXPECT_EQ(rt->options().io.block_size, 256 * KiB);
  const TensorId u = rt->create_tensor(desc("big", a.size()), Tier::Nvme, a.data());
  EXPECT_EQ(leased_bytes(rt->acquire(u, Tier::Device, Access::Read).get()), a);
  rt.reset();
  // Only a budget that cannot hold two 64 KiB slots and a 64 KiB block is refused, saying so.
  o.host_budget_bytes = 160 * KiB;
  try {
    Runtime refused(o);
    ADD_FAILURE() << "a host budget below the smallest staging area was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("smallest staging area (2 x 64.00 KiB) plus the "
                                         "smallest I/O block (64.00 KiB)"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(RuntimeTest, AWriteLeaseDroppedUnclaimedEndsAsAnUnusedLease) {
  // A LeaseFuture for writing that is never claimed ends its lease without writing: the version
  // stays (the copy below is still current) and the copy is no longer leased for writing, so an
  // arrival in pieces may replace it. Before, it stayed "leased for writing" forever.
  RuntimeOptions o = small_options(dir_.path());
  o.backend.device_budget_bytes = 1 * MiB;
  o.host_copy_on_the_way = false;
  auto rt = std::make_unique<Runtime>(o);
  const auto a = pattern(640 * KiB, 8), b = pattern(640 * KiB, 9);
  const TensorId ta = rt->create_tensor(desc("a", a.size()), Tier::Nvme, a.data());
  const TensorId tb = rt->create_tensor(desc("b", b.size()), Tier::Nvme, b.data());
  rt->acquire(ta, Tier::Device, Access::Read).get().release();
  rt->synchronize();
  { LeaseFuture unclaimed = rt->acquire(ta, Tier::Device, Access::ReadWrite); }
  LeaseFuture moved = rt->acquire(ta, Tier::Device, Access::ReadWrite);
  moved = LeaseFuture{};  // move-assigning over an unclaimed future ends it the same way
  EXPECT_TRUE(rt->resident(ta, Tier::Nvme));  // not written: the NVMe copy is still current
  EXPECT_TRUE(rt->prefetch_replacing(tb, {ta}));
  EXPECT_EQ(leased_bytes(rt->acquire(tb, Tier::Device, Access::Read).get()), b);
  EXPECT_FALSE(rt->resident(ta, Tier::Device));
  EXPECT_EQ(contents(*rt, ta), a);
}

TEST_F(RuntimeTest, MappedTensorsAreNeverWritten) {
  auto rt = make();
  const auto data = pattern(3 * 4096 + 100, 6);
  const std::string path = dir_.file("model.bin");
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(data.data()), data.size());
  const TensorId t = rt->map_tensor(desc("w", data.size() - 33), path, 33);
  EXPECT_THROW(rt->discard(t), Error);  // a mapping of a model: never discarded
  Lease lease = rt->acquire(t, Tier::Device, Access::Read).get();
  EXPECT_EQ(leased_bytes(lease), std::vector<unsigned char>(data.begin() + 33, data.end()));
  lease.release();
  auto changed = pattern(data.size() - 33, 7);
  rt->write(t, changed.data(), changed.size());
  rt->evict(t, Tier::Device);
  rt->evict(t, Tier::Host);  // written to a swap extent, not to the model file
  EXPECT_EQ(contents(*rt, t), changed);
  std::vector<unsigned char> file(data.size());
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(file.data()), file.size());
  EXPECT_EQ(file, data);
}

TEST_F(RuntimeTest, StatsAndTraceExport) {
  auto rt = make();
  const TensorId t = rt->create_tensor(desc("w", 128 * KiB), Tier::Nvme);
  rt->acquire(t, Tier::Device, Access::Read).get();
  rt->synchronize();
  const auto stats = nlohmann::json::parse(rt->stats_json());
  EXPECT_EQ(stats["backend"], "host");
  EXPECT_EQ(stats["tiers"]["Device"]["misses"], 1);
  EXPECT_EQ(stats["tiers"]["Device"]["bytes_in"], 128 * KiB);
  // The pinned slab and how much of it the kernel backs with huge pages (Note [Huge pages]).
  EXPECT_EQ(stats["pinned_bytes"].get<std::uint64_t>(), rt->options().host_budget_bytes);
  EXPECT_LE(stats["pinned_huge_page_bytes"].get<std::uint64_t>(),
            stats["pinned_bytes"].get<std::uint64_t>());
  EXPECT_GE(stats["io"]["bytes_read"].get<std::uint64_t>(), 128 * KiB);
  // The trace file, read back: Chrome/Perfetto trace JSON holding the events this run made.
  const std::string path = dir_.file("trace.json");
  rt->telemetry().write_chrome_trace(path);
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const auto trace = nlohmann::json::parse(in);
  ASSERT_TRUE(trace.contains("traceEvents") && trace["traceEvents"].is_array());
  std::uint64_t h2d_bytes = 0, nvme_bytes = 0;
  std::map<std::uint64_t, std::pair<double, double>> io_spans;  // id -> begin, end
  double device_peak = 0;
  std::set<std::string> tracks;
  for (const auto& e : trace["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("name")) << e.dump();
    const std::string ph = e["ph"];
    if (ph == "M") {
      if (e["name"] == "thread_name") tracks.insert(e["args"]["name"].get<std::string>());
      continue;
    }
    ASSERT_TRUE(e.contains("ts") && e["ts"].is_number()) << e.dump();
    if (ph == "X") {
      ASSERT_GE(e["dur"].get<double>(), 0.0) << e.dump();
      if (e["tid"] == static_cast<int>(Track::H2D)) {
        EXPECT_EQ(e["args"]["tensor"], t) << e.dump();
        h2d_bytes += e["args"]["bytes"].get<std::uint64_t>();
      }
    } else if (ph == "b" || ph == "e") {
      ASSERT_EQ(e["tid"], static_cast<int>(Track::NvmeRead)) << "only reads ran: " << e.dump();
      auto& span = io_spans[e["id"].get<std::uint64_t>()];
      (ph == "b" ? span.first : span.second) = e["ts"].get<double>();
      if (ph == "b") nvme_bytes += e["args"]["bytes"].get<std::uint64_t>();
    } else if (ph == "C") {
      if (e["name"] == "Device bytes")
        device_peak = std::max(device_peak, e["args"]["used"].get<double>());
    } else {
      ADD_FAILURE() << "an event of an unknown phase: " << e.dump();
    }
  }
  EXPECT_EQ(h2d_bytes, 128 * KiB);   // one copy up, of the whole tensor
  EXPECT_EQ(nvme_bytes, 128 * KiB);  // read once from its NVMe home
  ASSERT_FALSE(io_spans.empty());
  for (const auto& [id, span] : io_spans)
    EXPECT_LE(span.first, span.second) << "NVMe read " << id << " ends before it begins";
  EXPECT_EQ(device_peak, static_cast<double>(128 * KiB));
  EXPECT_TRUE(tracks.contains("host-to-device") && tracks.contains("nvme read"));
  EXPECT_THROW(rt->telemetry().write_chrome_trace("/nonexistent/trace.json"), IoError);
}

TEST(RuntimeConfig, ParsesTheDocumentedKeys) {
  TempDir dir;
  // Every value differs from its default, so a key that is read into the wrong field, or not
  // read at all, shows.
  const auto o = RuntimeOptions::from_json(R"({"backend": "host", "device_budget": "64MiB",
      "host_budget": "256MiB", "link_gbps": 25,
      "nvme": {"paths": [")" + dir.path() + R"(", ")" +
                                           dir.path() + R"("], "capacity": "1GiB",
               "stripe": "512KiB", "keep_files": true},
      "io": {"engine": "posix", "block": "2MiB", "queue_depth": 8, "threads": 3,
             "direct": false, "sqpoll": true, "faults": ["read:3:eio", "write:10:enospc"]},
      "checksums": false, "eviction": "farthest_next_use", "trace_events": 1024})");
  EXPECT_EQ(o.backend.kind, BackendKind::Host);
  EXPECT_EQ(o.backend.device_budget_bytes, 64 * MiB);
  EXPECT_EQ(o.host_budget_bytes, 256 * MiB);
  EXPECT_EQ(o.backend.link_gbps, 25.0);
  EXPECT_EQ(o.nvme.paths, (std::vector<std::string>{dir.path(), dir.path()}));
  EXPECT_EQ(o.nvme.capacity_bytes, 1 * GiB);
  EXPECT_EQ(o.nvme.stripe_bytes, 512 * KiB);
  EXPECT_TRUE(o.nvme.keep_files);
  EXPECT_EQ(o.io.engine, EngineKind::Posix);
  EXPECT_EQ(o.io.block_size, 2 * MiB);
  EXPECT_EQ(o.io.queue_depth, 8u);
  EXPECT_EQ(o.io.threads, 3u);
  EXPECT_FALSE(o.io.direct);
  EXPECT_TRUE(o.io.sqpoll);
  ASSERT_EQ(o.io.faults.size(), 2u);
  EXPECT_EQ(o.io.faults[0].op, FaultSpec::Op::Read);
  EXPECT_EQ(o.io.faults[0].nth, 3u);
  EXPECT_EQ(o.io.faults[0].kind, FaultSpec::Kind::Eio);
  EXPECT_EQ(o.io.faults[1].op, FaultSpec::Op::Write);
  EXPECT_EQ(o.io.faults[1].nth, 10u);
  EXPECT_EQ(o.io.faults[1].kind, FaultSpec::Kind::Enospc);
  EXPECT_FALSE(o.checksums);
  EXPECT_FALSE(o.nvme.checksums);
  EXPECT_EQ(o.eviction, EvictionKind::FarthestNextUse);
  EXPECT_EQ(o.trace_events, 1024u);
}

TEST(RuntimeConfig, RejectsBadDocumentsNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"device_budgte": "1GiB"})", "device_budgte"},
      {R"({"device_budget": -5})", "device_budget"},
      {R"({"device_budget": "lots"})", "device_budget"},
      {R"({"host_budget": "64KiB"})", "host_budget"},
      {R"({"nvme": {"paths": ["/nonexistent/x"], "capacity": "1GiB"}})", "nvme.paths[0]"},
      {R"({"nvme": {"paths": ["/tmp"]}})", "nvme.capacity"},
      {R"({"nvme": {"pathz": ["/tmp"]}})", "nvme.pathz"},
      {R"({"io": {"queue_depth": 0}})", "io.queue_depth"},
      {R"({"io": {"block": "1000"}})", "io.block"},
      {R"({"io": {"block_size": "1MiB"}})", "io.block_size: renamed io.block"},
      {R"({"nvme": {"stripe_bytes": "1MiB"}})", "nvme.stripe_bytes: renamed nvme.stripe"},
      {R"({"eviction": "random"})", "eviction"},
      {R"({"backend": "gpu"})", "backend"},
      {R"({"link_gbps": -1})", "link_gbps"},
      {R"([1, 2])", "configuration"},
      {R"({"backend": )", "JSON"},
  };
  for (const auto& [doc, key] : cases) {
    try {
      RuntimeOptions::from_json(doc);
      ADD_FAILURE() << "accepted " << doc;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << doc << " -> " << e.what();
    }
  }
}

}  // namespace
}  // namespace strata::testing
