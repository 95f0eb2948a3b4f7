#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

#include "runtime/backend_fixture.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/quant/group_quant.h"

namespace strata::testing {
namespace {

std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> out(bytes);
  for (std::size_t i = 0; i < bytes; ++i)
    out[i] = static_cast<unsigned char>(i * 31 + seed);
  return out;
}

TYPED_TEST_SUITE(BackendTest, BackendParams, BackendParamNames);

TYPED_TEST(BackendTest, AllocatesWithinTheBudgetAndCountsIt) {
  Backend& b = this->backend();
  EXPECT_EQ(b.info().budget_bytes, this->kBudget);
  void* p = b.allocate_device(1000);
  void* q = b.allocate_device(4096, 4096);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(q) % 4096, 0u);
  EXPECT_EQ(b.device_stats().current_bytes, 1024u + 4096u);
  b.deallocate_device(p);
  b.deallocate_device(q);
  EXPECT_EQ(b.device_stats().current_bytes, 0u);
  EXPECT_EQ(b.device_stats().peak_bytes, 1024u + 4096u);
}

TYPED_TEST(BackendTest, OutOfMemoryNamesTheDeviceTierAndTheNumbers) {
  Backend& b = this->backend();
  void* half = b.allocate_device(this->kBudget / 2);
  try {
    b.allocate_device(this->kBudget);
    FAIL() << "allocated beyond the budget";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), "Device");
    EXPECT_EQ(e.requested_bytes(), this->kBudget);
    EXPECT_EQ(e.free_bytes(), this->kBudget / 2);
    EXPECT_EQ(e.largest_free_bytes(), this->kBudget / 2);
  }
  b.deallocate_device(half);
  // Nothing was lost: the whole budget is usable again.
  b.deallocate_device(b.allocate_device(this->kBudget));
}

TYPED_TEST(BackendTest, RejectsPointersItDidNotAllocate) {
  int on_stack = 0;
  EXPECT_THROW(this->backend().deallocate_device(&on_stack), Error);
}

TYPED_TEST(BackendTest, CopiesRoundTripThroughEveryKind) {
  Backend& b = this->backend();
  const std::size_t bytes = 3 * MiB + 123;  // not a multiple of anything
  const auto src = pattern(bytes, 5);
  std::vector<unsigned char> out(bytes, 0);
  void* d1 = b.allocate_device(bytes);
  void* d2 = b.allocate_device(bytes);
  Stream& s = b.h2d_stream();
  s.copy_async(d1, src.data(), bytes, CopyKind::HostToDevice);
  s.copy_async(d2, d1, bytes, CopyKind::DeviceToDevice);
  s.copy_async(out.data(), d2, bytes, CopyKind::DeviceToHost);
  s.synchronize();
  EXPECT_EQ(out, src);
  std::vector<unsigned char> copy2(bytes, 0);
  s.copy_async(copy2.data(), out.data(), bytes, CopyKind::HostToHost);
  s.synchronize();
  EXPECT_EQ(copy2, src);
  b.deallocate_device(d1);
  b.deallocate_device(d2);
}

// Note [Compressed copies]: a stream dequantizes a compressed copy into device memory with the
// CPU kernel's bits (the CUDA kernel too: no FMA, round to nearest even), both widths, three
// output dtypes, rows that do not divide into groups.
TYPED_TEST(BackendTest, DequantizesACompressedCopyAsTheCpuKernelDoes) {
  Backend& b = this->backend();
  const std::uint64_t rows = 37, cols = 333;
  std::vector<float> x(rows * cols);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % 7));
  for (quant::Bits bits : {quant::Bits::Int8, quant::Bits::Int4}) {
    const quant::Scheme scheme{bits, 64};
    const quant::Layout l = quant::layout(scheme, rows, cols);
    std::vector<std::byte> packed(l.bytes);
    quant::quantize(scheme, l, DType::F32, x.data(), packed.data(), "w");
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      const std::size_t out_bytes = rows * cols * dtype_bytes(dtype);
      std::vector<std::byte> want(out_bytes), got(out_bytes);
      quant::dequantize(bits, l, packed.data(), dtype, want.data(), 0, rows, quant::Isa::baseline);
      void* d = b.allocate_device(out_bytes);
      Stream& s = b.h2d_stream();
      s.dequantize_async(d, packed.data(), packed.size(), {bits, l, dtype});
      s.copy_async(got.data(), d, out_bytes, CopyKind::DeviceToHost);
      s.synchronize();
      EXPECT_EQ(got, want) << quant::to_string(bits) << " to " << to_string(dtype);
      b.deallocate_device(d);
    }
  }
}

TYPED_TEST(BackendTest, MemsetSetsDeviceBytes) {
  Backend& b = this->backend();
  const std::size_t bytes = 100000;
  void* d = b.allocate_device(bytes);
  std::vector<unsigned char> out(bytes, 1);
  b.compute_stream().memset_async(d, 0xAB, bytes);
  b.compute_stream().copy_async(out.data(), d, bytes, CopyKind::DeviceToHost);
  b.compute_stream().synchronize();
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](unsigned char c) { return c == 0xAB; }));
  b.deallocate_device(d);
}

TYPED_TEST(BackendTest, PinnedBuffersArePageAlignedAndUsable) {
  Backend& b = this->backend();
  PinnedBuffer buf = b.allocate_pinned(1 * MiB + 1);
  ASSERT_NE(buf.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buf.data()) % 4096, 0u);
  EXPECT_EQ(buf.size(), 1 * MiB + 1);
  std::memset(buf.data(), 0x5A, buf.size());
  void* d = b.allocate_device(buf.size());
  std::vector<unsigned char> out(buf.size());
  b.h2d_stream().copy_async(d, buf.data(), buf.size(), CopyKind::HostToDevice);
  b.h2d_stream().copy_async(out.data(), d, buf.size(), CopyKind::DeviceToHost);
  b.h2d_stream().synchronize();
  EXPECT_EQ(std::count(out.begin(), out.end(), 0x5A), static_cast<long>(buf.size()));
  PinnedBuffer moved = std::move(buf);
  EXPECT_EQ(buf.data(), nullptr);
  EXPECT_NE(moved.data(), nullptr);
  b.deallocate_device(d);
}

TYPED_TEST(BackendTest, StreamRunsWorkInSubmissionOrder) {
  Stream& s = this->backend().compute_stream();
  std::vector<int> order;
  for (int i = 0; i < 100; ++i)
    s.launch_host_func([&order, i] { order.push_back(i); });
  s.synchronize();
  std::vector<int> expected(100);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
}

TYPED_TEST(BackendTest, HostCallbacksRunExactlyOnce) {
  Stream& s = this->backend().compute_stream();
  std::atomic<int> calls{0};
  for (int i = 0; i < 1000; ++i)
    s.launch_host_func([&calls] { calls.fetch_add(1); });
  s.synchronize();
  s.synchronize();
  EXPECT_EQ(calls.load(), 1000);
}

TYPED_TEST(BackendTest, HostCallbackFailureSurfacesOnSynchronize) {
  Stream& s = this->backend().compute_stream();
  bool later_ran = false;
  s.launch_host_func([] { throw std::runtime_error("callback failed on purpose"); });
  s.launch_host_func([&later_ran] { later_ran = true; });
  EXPECT_THROW(s.synchronize(), std::runtime_error);
  EXPECT_TRUE(later_ran);
  EXPECT_NO_THROW(s.synchronize());  // reported once
}

TYPED_TEST(BackendTest, EventWaitOrdersWorkAcrossStreams) {
  Backend& b = this->backend();
  auto first = b.create_stream("first");
  auto second = b.create_stream("second");
  auto gate_passed = b.create_event();
  auto second_done = b.create_event();
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  std::vector<std::string> order;
  std::mutex m;
  first->launch_host_func([opened, &order, &m] {
    opened.wait();
    std::lock_guard lock(m);
    order.push_back("first");
  });
  first->record(*gate_passed);
  second->wait(*gate_passed);
  second->launch_host_func([&order, &m] {
    std::lock_guard lock(m);
    order.push_back("second");
  });
  second->record(*second_done);
  // The second stream must not run past its wait while the first is held at the gate.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (std::chrono::steady_clock::now() < deadline && !second_done->ready())
    std::this_thread::yield();
  EXPECT_FALSE(second_done->ready());
  EXPECT_FALSE(gate_passed->ready());
  gate.set_value();
  second_done->synchronize();
  EXPECT_TRUE(gate_passed->ready());
  EXPECT_EQ(order, (std::vector<std::string>{"first", "second"}));
}

TYPED_TEST(BackendTest, EventNeverRecordedIsReady) {
  auto e = this->backend().create_event();
  EXPECT_TRUE(e->ready());
  e->synchronize();
  this->backend().d2h_stream().wait(*e);  // waiting on it does not block the stream
  this->backend().d2h_stream().synchronize();
}

TYPED_TEST(BackendTest, HasThreeOwnStreams) {
  Backend& b = this->backend();
  EXPECT_EQ(b.h2d_stream().name(), "h2d");
  EXPECT_EQ(b.d2h_stream().name(), "d2h");
  EXPECT_EQ(b.compute_stream().name(), "compute");
  EXPECT_NE(&b.h2d_stream(), &b.d2h_stream());
}

// Host-only behaviour: pacing and the backend choice.

TEST(HostBackend, PacedCopyTakesAtLeastBytesOverRate) {
  BackendOptions options;
  options.kind = BackendKind::Host;
  options.device_budget_bytes = 16 * MiB;
  options.link_gbps = 1.0;  // 10^9 bytes/s: 8 MiB takes >= 8.39 ms
  auto b = make_backend(options);
  const std::size_t bytes = 8 * MiB;
  std::vector<unsigned char> host(bytes, 1);
  void* d = b->allocate_device(bytes);
  auto start = std::chrono::steady_clock::now();
  b->h2d_stream().copy_async(d, host.data(), bytes, CopyKind::HostToDevice);
  b->h2d_stream().synchronize();
  const double one =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(one, static_cast<double>(bytes) / 1e9);
  // Two streams in the same direction share the link: both copies together take twice as long.
  auto other = b->create_stream("other");
  start = std::chrono::steady_clock::now();
  b->h2d_stream().copy_async(d, host.data(), bytes / 2, CopyKind::HostToDevice);
  other->copy_async(static_cast<char*>(d) + bytes / 2, host.data(), bytes / 2,
                    CopyKind::HostToDevice);
  b->h2d_stream().synchronize();
  other->synchronize();
  const double two =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(two, static_cast<double>(bytes) / 1e9);
  b->deallocate_device(d);
}

TEST(HostBackend, DeviceMemoryIsHostAddressable) {
  BackendOptions options;
  options.kind = BackendKind::Host;
  options.device_budget_bytes = 1 * MiB;
  auto b = make_backend(options);
  EXPECT_TRUE(b->info().host_addressable);
  auto* p = static_cast<unsigned char*>(b->allocate_device(4096));
  p[0] = 1;
  p[4095] = 2;
  EXPECT_EQ(p[0] + p[4095], 3);
  b->deallocate_device(p);
}

TEST(MakeBackend, AutoPicksAUsableBackend) {
  BackendOptions options;
  options.device_budget_bytes = 1 * MiB;
  options.quiet = true;
  auto b = make_backend(options);
  std::string why;
  EXPECT_EQ(b->kind(), cuda_device_count(&why) > 0 ? BackendKind::Cuda : BackendKind::Host);
}

TEST(MakeBackend, CudaWithoutADeviceIsAClearError) {
  std::string why;
  if (cuda_device_count(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  BackendOptions options;
  options.kind = BackendKind::Cuda;
  try {
    make_backend(options);
    FAIL() << "made a CUDA backend without a device";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
}

TEST(MakeBackend, RejectsImpossibleOptionsNamingThem) {
  BackendOptions options;
  options.kind = BackendKind::Host;
  options.link_gbps = -1;
  EXPECT_THROW(make_backend(options), Error);
  options.link_gbps = 0;
  options.device_budget_bytes = 100;
  try {
    make_backend(options);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device_budget"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_backend_kind("gpu"), Error);
  EXPECT_EQ(parse_backend_kind("cuda"), BackendKind::Cuda);
}

}  // namespace
}  // namespace strata::testing
