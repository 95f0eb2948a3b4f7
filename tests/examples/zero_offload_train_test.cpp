// The training example end to end on the host backend: offloaded training equals the in-memory
// reference bit for bit and an independent float64 implementation within float32's error, the
// step's bound adds up its own spans, and bad budgets, NVMe directories and disks give clear
// errors.
#include "trainer.h"

#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "io/io_test_util.h"
#include "strata/base/error.h"
#include "strata/io/io_options.h"

namespace strata::testing {
namespace {

using examples::Offload;
using examples::StepPhases;
using examples::StepWindow;
using examples::train;
using examples::TrainConfig;

TrainConfig small(Offload offload) {
  TrainConfig c;
  c.layers = 16;
  c.hidden = 128;
  c.batch = 8;
  c.steps = 4;
  c.offload = offload;
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

// The same training written apart from the trainer: plain float64 loops for the MLP (y =
// relu(x W^T + b) on every layer but the last), the mean squared error and its gradients, and
// Adam as torch.optim.Adam defines it (no weight decay: the example's configuration). Only the
// task (batches and initial weights) comes from the example.
class Float64Training {
 public:
  explicit Float64Training(const TrainConfig& c) : c_(c), h_(c.hidden), n_(c.batch) {
    for (int i = 0; i < c.layers; ++i) {
      const std::vector<float> init = examples::task_initial_params(c, i);
      params_.emplace_back(init.begin(), init.end());
      m_.emplace_back(init.size(), 0.0);
      v_.emplace_back(init.size(), 0.0);
    }
  }

  // One step (t counts from 0); returns the loss before the update.
  double step(int t) {
    const std::size_t hh = static_cast<std::size_t>(h_) * h_,
                      act = static_cast<std::size_t>(n_) * h_;
    std::vector<float> xf(act), tf(act);
    examples::task_batch(c_, t, xf.data(), tf.data());
    // Forward: a[i] is layer i's input, z[i] its output before the relu.
    std::vector<std::vector<double>> a(c_.layers + 1, std::vector<double>(act)), z = a;
    a[0].assign(xf.begin(), xf.end());
    for (int i = 0; i < c_.layers; ++i) {
      const std::vector<double>& p = params_[i];
      for (int r = 0; r < n_; ++r)
        for (int o = 0; o < h_; ++o) {
          double sum = p[hh + o];
          for (int k = 0; k < h_; ++k)
            sum += a[i][at(r, k)] * p[static_cast<std::size_t>(o) * h_ + k];
          z[i][at(r, o)] = sum;
          a[i + 1][at(r, o)] = i + 1 == c_.layers || sum > 0 ? sum : 0.0;
        }
    }
    double loss = 0;
    std::vector<double> delta(act);  // d loss / d z of the layer being differentiated
    for (std::size_t k = 0; k < act; ++k) {
      const double d = a[c_.layers][k] - tf[k];
      loss += d * d;
      delta[k] = 2.0 * d / static_cast<double>(act);
    }
    loss /= static_cast<double>(act);
    // Backward, every gradient from the weights before this step's update.
    std::vector<std::vector<double>> grads(c_.layers, std::vector<double>(hh + h_, 0.0));
    for (int i = c_.layers - 1; i >= 0; --i) {
      std::vector<double>& g = grads[i];
      for (int r = 0; r < n_; ++r)
        for (int o = 0; o < h_; ++o) {
          g[hh + o] += delta[at(r, o)];
          for (int k = 0; k < h_; ++k)
            g[static_cast<std::size_t>(o) * h_ + k] += delta[at(r, o)] * a[i][at(r, k)];
        }
      if (i == 0) break;
      std::vector<double> below(act, 0.0);
      for (int r = 0; r < n_; ++r)
        for (int k = 0; k < h_; ++k) {
          double sum = 0;
          for (int o = 0; o < h_; ++o)
            sum += delta[at(r, o)] * params_[i][static_cast<std::size_t>(o) * h_ + k];
          below[at(r, k)] = z[i - 1][at(r, k)] > 0 ? sum : 0.0;  // through layer i - 1's relu
        }
      delta = std::move(below);
    }
    // Adam (torch.optim.Adam, step t + 1).
    const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, lr = c_.lr;
    const double bc1 = 1 - std::pow(beta1, t + 1), bc2 = 1 - std::pow(beta2, t + 1);
    for (int i = 0; i < c_.layers; ++i)
      for (std::size_t k = 0; k < hh + h_; ++k) {
        const double g = grads[i][k];
        m_[i][k] = beta1 * m_[i][k] + (1 - beta1) * g;
        v_[i][k] = beta2 * v_[i][k] + (1 - beta2) * g * g;
        params_[i][k] -= lr / bc1 * m_[i][k] / (std::sqrt(v_[i][k]) / std::sqrt(bc2) + eps);
      }
    return loss;
  }

  [[nodiscard]] const std::vector<double>& params(int layer) const { return params_[layer]; }
  [[nodiscard]] const std::vector<double>& m(int layer) const { return m_[layer]; }
  [[nodiscard]] const std::vector<double>& v(int layer) const { return v_[layer]; }

 private:
  [[nodiscard]] std::size_t at(int row, int col) const {
    return static_cast<std::size_t>(row) * h_ + col;
  }
  TrainConfig c_;
  int h_, n_;
  std::vector<std::vector<double>> params_, m_, v_;
};

// ||got - want|| / ||scale|| over [begin, end) (2-norms), with got in float32.
double relative_error(const std::vector<float>& got, std::size_t got_offset,
                      const std::vector<double>& want, const std::vector<double>& scale,
                      std::size_t begin, std::size_t end) {
  double err = 0, norm = 0;
  for (std::size_t k = begin; k < end; ++k) {
    const double d = static_cast<double>(got[got_offset + k]) - want[k];
    err += d * d;
    norm += scale[k] * scale[k];
  }
  return std::sqrt(err / norm);
}

// sub_group_rows 0: each layer whole; 20: sub-groups of 20, 20 and 8 of the 48 rows (Note
// [Sub-groups] in trainer.cpp), checked against the same unsplit float64 training.
class ZeroOffloadTrainRows : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(SubGroups, ZeroOffloadTrainRows, ::testing::Values(0, 20));

TEST_P(ZeroOffloadTrainRows, NvmeOffloadedTrainingMatchesAnIndependentFloat64Implementation) {
  TempDir dir;
  TrainConfig c = small(Offload::Nvme);
  c.layers = 4;
  c.hidden = 48;
  c.batch = 16;
  c.steps = 5;
  c.nvme_dir = dir.path();
  c.keep_state = true;
  c.sub_group_rows = GetParam();
  const auto r = train(c);
  EXPECT_EQ(r.sub_groups, GetParam() == 0 ? 1 : 3);
  ASSERT_GT(r.bytes_nvme_read, 0u) << "the states did not stream";
  ASSERT_EQ(r.losses.size(), 5u);
  ASSERT_EQ(r.final_params.size(), 4u);
  ASSERT_EQ(r.final_moments.size(), 4u);

  Float64Training ref(c);
  std::vector<std::vector<double>> initial;
  for (int i = 0; i < c.layers; ++i)
    initial.push_back(ref.params(i));
  // Why these tolerances: float32 rounds at u = 2^-24 = 6e-8; a dot product of length n
  // accumulated in float32 errs by at most n u of its terms' magnitude (typically sqrt(n) u), and
  // a gradient passes through 2L + 1 of them (forward, loss, backward) with n <= max(hidden,
  // batch) = 48: (2 * 4 + 1) * 48 * u = 2.6e-5 of the norm at worst. Adam's step constants are
  // computed in double and rounded to float32 once (Note [Adam step constants]), so they add a
  // few u. The losses and the moments (linear in the gradients: m sums them, v their squares)
  // are held to 1e-4 of their norm per tensor (seen: losses 1e-7, m 4e-7, v below 1e-6). A
  // parameter moves by lr * m / (sqrt(v) + eps), which divides by the gradient's own size, so an
  // element whose gradient is near zero may move differently in float32 by up to lr per step: the
  // parameters are compared to the change they went through, ||p32 - p64|| <= 1e-3 ||p64 - p0||
  // (seen: 4e-6). A wrong gradient (a layer's, its bias's, a relu mask) or a wrong moment (a beta,
  // a bias correction) is off by 1e-3 to 1 in these; Adam hides a gradient scaled as a whole from
  // the parameters (m / sqrt(v) does not change), not from the moments.
  constexpr double kLossTolerance = 1e-4, kMomentTolerance = 1e-4, kParamTolerance = 1e-3;
  for (int t = 0; t < c.steps; ++t) {
    const double want = ref.step(t);
    EXPECT_NEAR(r.losses[t], want, kLossTolerance * want) << "step " << t;
  }
  const std::size_t hh = static_cast<std::size_t>(c.hidden) * c.hidden, all = hh + c.hidden;
  for (int i = 0; i < c.layers; ++i) {
    const std::vector<float>& p = r.final_params[i];
    const std::vector<float>& st = r.final_moments[i];  // [m | v]
    std::vector<double> moved(all);
    for (std::size_t k = 0; k < all; ++k)
      moved[k] = ref.params(i)[k] - initial[i][k];
    // Weights [0, hh) and bias [hh, all) apart: the bias is too small a share to show in one norm.
    for (const auto& [begin, end, what] :
         {std::tuple{std::size_t{0}, hh, "weights"}, std::tuple{hh, all, "bias"}}) {
      const std::string where = "layer " + std::to_string(i) + " " + what;
      EXPECT_LE(relative_error(st, 0, ref.m(i), ref.m(i), begin, end), kMomentTolerance)
          << where << ": Adam's first moment";
      EXPECT_LE(relative_error(st, all, ref.v(i), ref.v(i), begin, end), kMomentTolerance)
          << where << ": Adam's second moment";
      EXPECT_LE(relative_error(p, 0, ref.params(i), moved, begin, end), kParamTolerance)
          << where << ": parameters";
    }
  }
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

  // Every step's phases come from its own spans; the drive's only in the NVMe run.
  ASSERT_EQ(r.steps.size(), 4u);
  EXPECT_GT(r.link_bytes.nvme_read, 0u);
  EXPECT_GT(r.link_bytes.nvme_write, 0u);
  for (const StepPhases& ph : r.steps) {
    EXPECT_GT(ph.nvme.forward_s + ph.nvme.backward_s, 0.0);
    EXPECT_GT(ph.forward_s, 0.0);
    EXPECT_GT(ph.backward_s, 0.0);
    EXPECT_GT(ph.optimizer_s, 0.0);
    EXPECT_GE(ph.backward_optimizer_s, std::max(ph.backward_s, ph.optimizer_s));
  }

  const auto host = train(small(Offload::Host));
  EXPECT_EQ(host.losses, expected);
  EXPECT_EQ(host.link_bytes.nvme_read + host.link_bytes.nvme_write, 0u);
  for (const StepPhases& ph : host.steps)
    EXPECT_EQ(ph.nvme.forward_s + ph.nvme.backward_s, 0.0);
  EXPECT_EQ(train(small(Offload::None)).losses, expected);
}

TraceEvent span(Track track, std::uint64_t start_ns, std::uint64_t end_ns,
                std::uint64_t bytes = 0) {
  return {start_ns, end_ns, track, bytes, 0, 0};
}

TEST(StepBound, ALinkIsBusyWhileAnyOfItsSpansIsOpenInsideTheWindow) {
  const std::vector<TraceEvent> spans = {span(Track::NvmeRead, 10, 30),
                                         span(Track::NvmeRead, 20, 40),    // overlapping: 30 ns
                                         span(Track::NvmeRead, 50, 60),    // 10 ns
                                         span(Track::NvmeRead, 90, 120),   // clipped at 100: 10 ns
                                         span(Track::NvmeRead, 200, 300),  // outside
                                         span(Track::NvmeRead, 70, 70)};   // empty
  EXPECT_DOUBLE_EQ(examples::busy_s(spans, 0, 100), 50e-9);
  EXPECT_DOUBLE_EQ(examples::busy_s(spans, 25, 55), 20e-9);
  EXPECT_DOUBLE_EQ(examples::busy_s({}, 0, 100), 0.0);
}

TEST(StepBound, TheBoundIsEachPartsCriticalPath) {
  const StepWindow w{0, 60, 200};  // forward part [0, 60), backward part [60, 200)
  const std::vector<TraceEvent> events = {
      span(Track::NvmeRead, 0, 50, 1000), span(Track::NvmeWrite, 40, 80, 300),  // drive 0..80
      span(Track::H2D, 100, 190, 7),      span(Track::D2H, 10, 20, 5),
      span(Track::Compute, 0, 200),       span(Track::NvmeRead, 190, 260, 11)};  // ends outside
  StepPhases ph;
  ph.prep_s = 5e-9;
  ph.forward_s = 20e-9;
  ph.loss_s = 1e-9;
  ph.backward_optimizer_s = 70e-9;
  examples::add_link_busy(events, w, ph);
  EXPECT_DOUBLE_EQ(ph.nvme.forward_s, 60e-9);   // reads and writes share the drive
  EXPECT_DOUBLE_EQ(ph.nvme.backward_s, 30e-9);  // 60..80, and 190..260 up to the end
  EXPECT_DOUBLE_EQ(ph.host_to_device.forward_s, 0.0);
  EXPECT_DOUBLE_EQ(ph.host_to_device.backward_s, 90e-9);
  EXPECT_DOUBLE_EQ(ph.device_to_host.forward_s, 10e-9);
  EXPECT_DOUBLE_EQ(ph.forward_part_s(), 60e-9);   // the drive, not the 26 ns of compute
  EXPECT_DOUBLE_EQ(ph.backward_part_s(), 90e-9);  // host to device, not the 70 ns of compute
  EXPECT_DOUBLE_EQ(ph.bound_s(), 150e-9);
  ph.backward_optimizer_s = 120e-9;
  EXPECT_DOUBLE_EQ(ph.bound_s(), 180e-9);

  const auto bytes = examples::link_bytes(events, {w});
  EXPECT_EQ(bytes.nvme_read, 1000u);  // the read ending at 260 belongs to no step
  EXPECT_EQ(bytes.nvme_write, 300u);
  EXPECT_EQ(bytes.host_to_device, 7u);
  EXPECT_EQ(bytes.device_to_host, 5u);
}

TEST(ZeroOffloadTrain, AWorkingSetLargerThanTheDeviceBudgetIsRefused) {
  TrainConfig c = small(Offload::Nvme);
  c.device_budget = 64 * 1024;
  const std::string m = message_of(c);
  EXPECT_NE(m.find("device budget 64.00 KiB cannot hold the working set"), std::string::npos) << m;
  EXPECT_NE(m.find("activations"), std::string::npos) << m;
  // Below the staging slots and one row's optimizer step, no sub-group can help.
  c = small(Offload::Nvme);
  c.host_budget = 200 * 1024;
  const std::string h = message_of(c);
  EXPECT_NE(h.find("host budget 200.00 KiB cannot hold the optimizer's working set: one "
                   "sub-group's (1 of 128 rows) master weights, Adam moments and gradient"),
            std::string::npos)
      << h;
}

TEST(ZeroOffloadTrain, ALayerWhoseStepExceedsTheHostBudgetTrainsInSubGroups) {
  // 300 KiB of host budget: 256 KiB of staging slots leave 44 KiB, where one layer's step needs
  // 272 KiB. The optimizer works in sub-groups of rows that fit twice (Note [Sub-groups]); the
  // losses are the reference's split the same way, bit for bit, and within the rounding of a
  // reordered sum of the unsplit one's.
  TempDir dir;
  TrainConfig c = small(Offload::Nvme);
  c.nvme_dir = dir.path();
  c.host_budget = 300 * 1024;
  const auto r = train(c);
  ASSERT_GT(r.sub_groups, 1);
  EXPECT_EQ(r.sub_groups, (c.hidden + r.sub_group_rows - 1) / r.sub_group_rows);
  EXPECT_LE(r.peak_host_bytes, r.host_budget);
  EXPECT_GE(r.bytes_nvme_read, 3 * r.state_bytes);  // every sub-group's states streamed

  TrainConfig ref = small(Offload::None);
  ref.reference = true;
  ref.sub_group_rows = r.sub_group_rows;
  EXPECT_EQ(r.losses, train(ref).losses);
  ref.sub_group_rows = 0;
  const auto whole = train(ref).losses;
  ASSERT_EQ(whole.size(), r.losses.size());
  for (std::size_t t = 0; t < whole.size(); ++t)
    EXPECT_NEAR(r.losses[t], whole[t], 1e-5 * whole[t]) << "step " << t;
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
