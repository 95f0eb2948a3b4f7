// The training example end to end on the host backend: offloaded training equals the in-memory
// reference bit for bit, and bad budgets, NVMe directories and disks give clear errors.
#include "trainer.h"

#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "io/io_test_util.h"
#include "strata/io/error.h"
#include "strata/io/io_options.h"

namespace strata::testing {
namespace {

using examples::Offload;
using examples::train;
using examples::TrainConfig;

TrainConfig small(Offload offload) {
  TrainConfig c;
  c.layers = 16;
  c.hidden = 128;
  c.batch = 8;
  c.steps = 4;
  c.offload = offload;
  c.measure = false;
  return c;
}

std::string message_of(const TrainConfig& c) {
  try {
    train(c);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ZeroOffloadTrain, OffloadedLossesEqualTheReferenceBitForBit) {
  TrainConfig ref = small(Offload::None);
  ref.reference = true;
  const auto expected = train(ref).losses;
  ASSERT_EQ(expected.size(), 4u);
  EXPECT_LT(expected.back(), expected.front());  // it learns

  TempDir dir;
  TrainConfig nvme = small(Offload::Nvme);
  nvme.nvme_dir = dir.path();
  nvme.host_budget = 768 * 1024;  // a quarter of the states, room for one layer's optimizer step
  const auto r = train(nvme);
  EXPECT_GE(r.state_bytes, 4 * r.host_budget) << "the states must not fit the host";
  EXPECT_EQ(r.losses, expected);                    // exactly: same kernels, same order
  EXPECT_GE(r.bytes_nvme_read, 3 * r.state_bytes);  // the states streamed every step
  EXPECT_GE(r.bytes_nvme_written, 3 * r.state_bytes);
  EXPECT_LE(r.peak_device_bytes, r.device_budget);

  EXPECT_EQ(train(small(Offload::Host)).losses, expected);
  EXPECT_EQ(train(small(Offload::None)).losses, expected);
}

TEST(ZeroOffloadTrain, AWorkingSetLargerThanTheDeviceBudgetIsRefused) {
  TrainConfig c = small(Offload::Nvme);
  c.device_budget = 64 * 1024;
  const std::string m = message_of(c);
  EXPECT_NE(m.find("device budget 64.00 KiB cannot hold the working set"), std::string::npos) << m;
  EXPECT_NE(m.find("activations"), std::string::npos) << m;
  c = small(Offload::Nvme);
  c.host_budget = 300 * 1024;
  const std::string h = message_of(c);
  EXPECT_NE(h.find("host budget 300.00 KiB cannot hold"), std::string::npos) << h;
}

TEST(ZeroOffloadTrain, AMissingOrReadOnlyNvmeDirectoryIsRefused) {
  TrainConfig c = small(Offload::Nvme);
  c.nvme_dir = "/nonexistent/strata-nvme";
  const std::string m = message_of(c);
  EXPECT_NE(m.find("--nvme-dir /nonexistent/strata-nvme: does not exist"), std::string::npos) << m;

  TempDir dir;
  if (::mount("tmpfs", dir.path().c_str(), "tmpfs", MS_RDONLY, "size=1m") != 0)
    GTEST_SKIP() << "cannot mount a read-only tmpfs (" << std::strerror(errno) << "; not root?)";
  c.nvme_dir = dir.path();
  const std::string r = message_of(c);
  ::umount2(dir.path().c_str(), MNT_DETACH);
  EXPECT_NE(r.find("cannot write there (Read-only file system)"), std::string::npos) << r;
}

TEST(ZeroOffloadTrain, AFullDiskDuringWriteBackIsAClearError) {
  if (!fault_injection_available()) GTEST_SKIP() << "built without STRATA_FAULT_INJECTION";
  TempDir dir;
  TrainConfig c = small(Offload::Nvme);
  c.nvme_dir = dir.path();
  // Creating the 32 NVMe-homed tensors writes 80 blocks of 64 KiB (2 per layer's weights, 3 per
  // layer's moments); the 100th write is a write-back during training.
  c.io_faults = {"write:100:enospc"};
  int steps_begun = 0;
  c.on_step = [&](int) { ++steps_begun; };
  try {
    train(c);
    FAIL() << "the injected ENOSPC did not surface";
  } catch (const IoError& e) {
    EXPECT_GE(steps_begun, 1) << "it failed before training began";
    EXPECT_EQ(e.error_number(), ENOSPC) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir.path()), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata::testing
