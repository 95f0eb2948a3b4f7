#include "trainer.h"

#include <cblas.h>
#include <tbb/global_control.h>
#include <tbb/task_group.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <utility>

#include <nlohmann/json.hpp>

#include "example_util.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/pages.h"
#include "strata/optim/adam.h"
#include "strata/runtime/runtime.h"
#include "strata/runtime/telemetry.h"
#include "strata/scheduler/prefetch_pipeline.h"

// Note [TBB under ThreadSanitizer]: libtbb is not built with TSan, so TSan cannot see that
// task_group::wait() (or the end of a parallel_for) orders a task's writes before the waiting
// thread's reads, and reports every such hand-over as a race. Under TSan the example keeps TBB
// to one thread (a task runs inside wait(), in the caller): the runtime's own threads (planner,
// write-back, I/O engine, streams), which TSan does see, are still checked.
#if defined(__SANITIZE_THREAD__)
#define STRATA_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STRATA_UNDER_TSAN 1
#endif
#endif

namespace strata::examples {
namespace {

// ---- deterministic data: random streams (example_util.h), the same in every run ----

constexpr std::uint64_t kInitStream = 1 << 20;     // + layer
constexpr std::uint64_t kTeacherStream = 2 << 20;  // + 0, 1
constexpr std::uint64_t kDataStream = 3 << 20;     // + step

// Note [Sub-groups]
// ~~~~~~~~~~~~~~~~~
// A layer's parameters, gradient and Adam moments are held in sub-groups of `rows` output rows
// each (DeepSpeed's sub_group_size, here along W's rows): sub-group k holds rows [r0, r0 + n)
// of W and the same n biases, as its own tensors, so the host tier needs only one sub-group's
// master weights, moments and gradient at a time (and the next one's, prefetched), whatever
// the width: a 32 MiB host budget trains 1,536-wide layers (36 MiB of optimizer state each).
// Forward computes each sub-group's output columns on their own (one sgemm each); backward
// takes each sub-group's weight gradient on its own and sums their input gradients
// (din = sum_k dz[:, rows_k] W_k, an sgemm accumulating into din), so the device needs one
// sub-group's weights and gradient at a time too. With one sub-group (the default whenever a
// layer's step fits) every call is the unsplit one; with several, the summation of din
// differs in order from one sgemm, so the reference run splits the same way and stays equal
// bit for bit. Adam is element by element: its sub-groups are the layer's update exactly.
struct Shape {
  int layers, hidden, batch;
  int rows;                                   // per sub-group
  [[nodiscard]] std::size_t params() const {  // one layer: W [H, H] then b [H]
    return static_cast<std::size_t>(hidden) * hidden + hidden;
  }
  [[nodiscard]] std::size_t activation() const { return static_cast<std::size_t>(batch) * hidden; }
  [[nodiscard]] int groups() const { return (hidden + rows - 1) / rows; }
  [[nodiscard]] int first_row(int k) const { return k * rows; }
  [[nodiscard]] int rows_of(int k) const { return std::min(rows, hidden - k * rows); }
  /// Sub-group k's parameters: W's rows [first_row, + rows_of) then their biases.
  [[nodiscard]] std::size_t group_params(int k) const {
    return static_cast<std::size_t>(rows_of(k)) * (hidden + 1);
  }
};

// Sub-group k of a layer's parameters (W [H, H] then b [H]), and the layer back from them.
std::vector<float> group_of(const Shape& s, const std::vector<float>& layer, int k) {
  const std::size_t h = s.hidden, r0 = s.first_row(k), n = s.rows_of(k);
  std::vector<float> g(n * (h + 1));
  std::copy_n(layer.data() + r0 * h, n * h, g.data());
  std::copy_n(layer.data() + h * h + r0, n, g.data() + n * h);
  return g;
}
void put_group(const Shape& s, const float* group, int k, float* layer) {
  const std::size_t h = s.hidden, r0 = s.first_row(k), n = s.rows_of(k);
  std::copy_n(group, n * h, layer + r0 * h);
  std::copy_n(group + n * h, n, layer + h * h + r0);
}

// ---- the kernels: the same calls, in the same order, for the offloaded and reference runs ----

// Sub-group k's columns of out = relu?(in W^T + b); wb holds its rows of W (row-major, out x in)
// then their biases (Note [Sub-groups]).
void forward_group(const Shape& s, int k, const float* wb, const float* in, float* out, bool relu) {
  const int h = s.hidden, b = s.batch, n = s.rows_of(k), r0 = s.first_row(k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, n, h, 1.0f, in, h, wb, h, 0.0f, out + r0,
              h);
  const float* bias = wb + static_cast<std::size_t>(n) * h;
  for (int r = 0; r < b; ++r) {
    float* row = out + static_cast<std::size_t>(r) * h + r0;
    for (int j = 0; j < n; ++j) {
      const float v = row[j] + bias[j];
      row[j] = relu ? (v > 0.0f ? v : 0.0f) : v;
    }
  }
}

// Mean squared error and its gradient with respect to `out`.
double loss_and_grad(const Shape& s, const float* out, const float* target, float* dout) {
  const std::size_t n = s.activation();
  const float scale = 2.0f / static_cast<float>(n);
  double sum = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const float d = out[k] - target[k];
    sum += static_cast<double>(d) * d;
    dout[k] = scale * d;
  }
  return sum / static_cast<double>(n);
}

// Sub-group k's part of backward, from dz (the gradient at this layer's pre-activation output):
// its grad = [dz_k^T in | sum_b dz_k] (dz_k: its columns of dz); din += dz_k W_k (the first
// sub-group sets it), masked by in > 0 (the previous layer's relu output) after the last; no
// din when null.
void backward_group(const Shape& s, int k, const float* wb, const float* in, const float* dz,
                    float* grad, float* din) {
  const int h = s.hidden, b = s.batch, n = s.rows_of(k), r0 = s.first_row(k);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, h, b, 1.0f, dz + r0, h, in, h, 0.0f, grad,
              h);
  float* db = grad + static_cast<std::size_t>(n) * h;
  std::fill(db, db + n, 0.0f);
  for (int r = 0; r < b; ++r)
    for (int j = 0; j < n; ++j)
      db[j] += dz[static_cast<std::size_t>(r) * h + r0 + j];
  if (din == nullptr) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, b, h, n, 1.0f, dz + r0, h, wb, h,
              k == 0 ? 0.0f : 1.0f, din, h);
  if (k + 1 < s.groups()) return;
  for (std::size_t e = 0; e < s.activation(); ++e)
    if (!(in[e] > 0.0f)) din[e] = 0.0f;
}

// Adam on one sub-group: `states` is [m | v], each `count` long.
void adam(const TrainConfig& c, std::size_t count, float* params, float* states, const float* grad,
          std::uint64_t step) {
  optim::AdamConfig config;
  config.lr = c.lr;
  optim::AdamArgs args;
  args.params = params;
  args.exp_avg = states;
  args.exp_avg_sq = states + count;
  args.grads = grad;
  args.grad_dtype = DType::F32;
  args.count = count;
  args.step = step;
  optim::adam_step(config, args);
}

// Targets come from a fixed random teacher with a narrow hidden layer:
// t = relu(x T1^T) T2^T, T1 [K, H], T2 [H, K], x uniform in [-1, 1); targets have variance ~1.
class Data {
 public:
  static constexpr int kTeacherWidth = 32;
  Data(const Shape& s, std::uint64_t seed) : s_(s), seed_(seed) {
    const std::size_t hk = static_cast<std::size_t>(s.hidden) * kTeacherWidth;
    const float a1 = std::sqrt(18.0f / static_cast<float>(s.hidden));
    const float a2 = std::sqrt(3.0f / static_cast<float>(kTeacherWidth));
    t1_.resize(hk);
    t2_.resize(hk);
    for (std::size_t k = 0; k < hk; ++k) {
      t1_[k] = a1 * uniform(seed, kTeacherStream, k);
      t2_[k] = a2 * uniform(seed, kTeacherStream + 1, k);
    }
    hidden_.resize(static_cast<std::size_t>(s.batch) * kTeacherWidth);
  }
  void batch(int step, float* x, float* target) {
    const int h = s_.hidden, b = s_.batch, k = kTeacherWidth;
    for (std::size_t i = 0; i < s_.activation(); ++i)
      x[i] = uniform(seed_, kDataStream + static_cast<std::uint64_t>(step), i);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, k, h, 1.0f, x, h, t1_.data(), h, 0.0f,
                hidden_.data(), k);
    for (float& v : hidden_)
      v = v > 0.0f ? v : 0.0f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, h, k, 1.0f, hidden_.data(), k,
                t2_.data(), k, 0.0f, target, h);
  }

 private:
  Shape s_;
  std::uint64_t seed_;
  std::vector<float> t1_, t2_, hidden_;
};

// He (Kaiming) uniform init for the weights, U(-sqrt(6/in), sqrt(6/in)), so that a deep relu
// stack neither vanishes nor explodes; zero biases.
std::vector<float> initial_params(const Shape& s, std::uint64_t seed, int layer) {
  std::vector<float> p(s.params(), 0.0f);
  const float bound = std::sqrt(6.0f / static_cast<float>(s.hidden));
  const std::size_t weights = static_cast<std::size_t>(s.hidden) * s.hidden;
  for (std::size_t k = 0; k < weights; ++k)
    p[k] = bound * uniform(seed, kInitStream + static_cast<std::uint64_t>(layer), k);
  return p;
}

// Times `kernel` as one compute span on `clock`'s telemetry (the trace shows it) and returns
// its seconds. Thread-safe: Adam's spans come from the optimizer's thread.
template <class Kernel>
double compute_span(Telemetry& clock, TensorId tensor, int layer, Kernel&& kernel) {
  const std::uint64_t start = clock.now_ns();
  kernel();
  const std::uint64_t end = clock.now_ns();
  clock.record({start, end, Track::Compute, 0, tensor, static_cast<std::uint64_t>(layer)});
  return static_cast<double>(end - start) * 1e-9;
}

double seconds_between(std::uint64_t start_ns, std::uint64_t end_ns) {
  return static_cast<double>(end_ns - start_ns) * 1e-9;
}

TrainResult train_reference(const TrainConfig& c, const Shape& s) {
  TrainResult r;
  const int groups = s.groups();
  // Per layer and sub-group: parameters, Adam states [m | v], gradient (Note [Sub-groups]).
  std::vector<std::vector<std::vector<float>>> w(s.layers), st(s.layers), g(s.layers);
  for (int i = 0; i < s.layers; ++i) {
    const std::vector<float> init = initial_params(s, c.seed, i);
    for (int k = 0; k < groups; ++k) {
      w[i].push_back(group_of(s, init, k));
      st[i].emplace_back(2 * s.group_params(k), 0.0f);
      g[i].emplace_back(s.group_params(k));
    }
  }
  std::vector<std::vector<float>> act(s.layers, std::vector<float>(s.activation()));
  std::vector<float> out(s.activation()), target(s.activation()), dz(s.activation()),
      din(s.activation());
  Data data(s, c.seed);
  Telemetry clock(static_cast<std::size_t>(c.steps) * (3 * s.layers * groups + 4));
  for (int step = 0; step < c.steps; ++step) {
    StepPhases ph;
    const std::uint64_t t0 = clock.now_ns();
    data.batch(step, act[0].data(), target.data());
    ph.prep_s = seconds_between(t0, clock.now_ns());
    for (int i = 0; i < s.layers; ++i) {
      const bool last = i + 1 == s.layers;
      for (int k = 0; k < groups; ++k) {
        ph.forward_s += compute_span(clock, 0, i, [&] {
          forward_group(s, k, w[i][k].data(), act[i].data(), last ? out.data() : act[i + 1].data(),
                        !last);
        });
      }
    }
    ph.loss_s = compute_span(clock, 0, s.layers, [&] {
      r.losses.push_back(loss_and_grad(s, out.data(), target.data(), dz.data()));
    });
    for (int i = s.layers - 1; i >= 0; --i) {
      for (int k = 0; k < groups; ++k) {
        ph.backward_s += compute_span(clock, 0, i, [&] {
          backward_group(s, k, w[i][k].data(), act[i].data(), dz.data(), g[i][k].data(),
                         i > 0 ? din.data() : nullptr);
        });
      }
      std::swap(dz, din);
      for (int k = 0; k < groups; ++k) {
        ph.optimizer_s += compute_span(clock, 0, i, [&] {
          adam(c, s.group_params(k), w[i][k].data(), st[i][k].data(), g[i][k].data(),
               static_cast<std::uint64_t>(step) + 1);
        });
      }
    }
    ph.backward_optimizer_s = ph.backward_s + ph.optimizer_s;  // one after the other
    ph.step_s = seconds_between(t0, clock.now_ns());
    r.steps.push_back(ph);
  }
  r.peak_host_bytes = (s.layers * 4 * s.params() + (s.layers + 4) * s.activation()) * sizeof(float);
  r.stats_json = "{}";
  r.pipeline_json = "{}";
  if (c.keep_state) {
    for (int i = 0; i < s.layers; ++i) {
      std::vector<float> p(s.params()), m(2 * s.params());
      for (int k = 0; k < groups; ++k) {
        put_group(s, w[i][k].data(), k, p.data());
        put_group(s, st[i][k].data(), k, m.data());
        put_group(s, st[i][k].data() + s.group_params(k), k, m.data() + s.params());
      }
      r.final_params.push_back(std::move(p));
      r.final_moments.push_back(std::move(m));
    }
  }
  return r;
}

// Device memory of the example's own (activations, batch, target, two gradient buffers), from
// the device budget, beside the runtime's copies.
class DeviceBuffers {
 public:
  DeviceBuffers(Backend& backend, const Shape& s) : backend_(backend) {
    for (int i = 0; i < s.layers + 4; ++i)
      ptrs_.push_back(static_cast<float*>(backend.allocate_device(s.activation() * sizeof(float))));
  }
  ~DeviceBuffers() {
    for (float* p : ptrs_)
      backend_.deallocate_device(p);
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  float* act(int i) { return ptrs_[i]; }  // act(0) is the input batch
  float* out() { return ptrs_[ptrs_.size() - 4]; }
  float* target() { return ptrs_[ptrs_.size() - 3]; }
  float* dz() { return ptrs_[ptrs_.size() - 2]; }
  float* din() { return ptrs_[ptrs_.size() - 1]; }

 private:
  Backend& backend_;
  std::vector<float*> ptrs_;
};

void check_nvme_dir(const std::string& dir) {
  std::error_code ec;
  const auto status = std::filesystem::status(dir, ec);
  STRATA_EXPECTS(std::filesystem::exists(status), "--nvme-dir ", dir, ": does not exist");
  STRATA_EXPECTS(std::filesystem::is_directory(status), "--nvme-dir ", dir, ": is not a directory");
  STRATA_EXPECTS(::access(dir.c_str(), W_OK | X_OK) == 0, "--nvme-dir ", dir,
                 ": cannot write there (", std::strerror(errno), ")");
}

struct Budgets {
  std::size_t device, host, staging;
};

// Four staging slots for NVMe -> device: half a sub-group each, between 64 and 512 KiB.
std::size_t staging_for(std::size_t group_p4) {
  return 4 * std::clamp(align_up(group_p4 / 2, 64 * KiB), 64 * KiB, 512 * KiB);
}
// The host tier's share of one sub-group's optimizer step: master weights, both moments and the
// gradient.
std::size_t group_host(std::size_t group_p4) {
  return 4 * align_up(group_p4, kPageBytes);
}

// Rows per sub-group (Note [Sub-groups]): as asked; else the whole layer when one layer's
// optimizer step fits the host budget (or none was given); else the most rows whose step fits
// twice (one updating, the next prefetched), at least one.
int resolve_rows(const TrainConfig& c) {
  if (c.sub_group_rows > 0) return std::min(c.sub_group_rows, c.hidden);
  if (c.offload != Offload::Nvme || c.host_budget == 0) return c.hidden;
  auto fits = [&](int rows, std::size_t n) {
    const std::size_t p4 = static_cast<std::size_t>(rows) * (c.hidden + 1) * sizeof(float);
    return staging_for(p4) + n * group_host(p4) <= c.host_budget;
  };
  if (fits(c.hidden, 1)) return c.hidden;
  int lo = 1, hi = c.hidden;  // the most rows with fits(rows, 2), or 1
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (fits(mid, 2))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

Budgets resolve_budgets(const TrainConfig& c, const Shape& s) {
  const std::size_t p4 = s.params() * sizeof(float);
  const std::size_t gp4 = s.group_params(0) * sizeof(float);  // the largest sub-group
  const std::size_t layers = static_cast<std::size_t>(s.layers);
  const std::size_t groups = layers * static_cast<std::size_t>(s.groups());
  const std::size_t act = (layers + 4) * align_up(s.activation() * sizeof(float), 256);
  const std::size_t staging = staging_for(gp4);
  Budgets b{c.device_budget, c.host_budget, staging};
  const std::string one =
      s.groups() == 1 ? std::string("one layer's")
                      : detail::concat("one sub-group's (", s.rows, " of ", s.hidden, " rows)");
  // Device: the activations and one backward step (a sub-group's weights and its gradient), or
  // everything when nothing is offloaded.
  const std::size_t device_need =
      act + (c.offload == Offload::None ? layers * 4 * p4 : 2 * align_up(gp4, 256));
  if (b.device == 0)
    b.device = c.offload == Offload::None ? device_need + 16 * MiB
                                          : act + (groups / 2 + 2) * align_up(gp4, 256);
  STRATA_EXPECTS(b.device >= device_need, "device budget ", format_bytes(b.device),
                 " cannot hold the working set: activations ", format_bytes(act), " (", s.layers,
                 " layers + 4 buffers of ", s.batch, " x ", s.hidden, " fp32) + ",
                 c.offload == Offload::None ? "every layer's weights, gradient and Adam states "
                                            : one + " weights and gradient ",
                 format_bytes(device_need - act), " = ", format_bytes(device_need),
                 "; raise --device-budget or lower --batch / --hidden");
  if (c.offload == Offload::None) {
    b.host = b.host == 0 ? staging + 4 * MiB : b.host;
    return b;
  }
  // Host: one sub-group's optimizer step; for host offload, every one's.
  const std::size_t step_host = group_host(gp4);
  const std::size_t host_need = staging + (c.offload == Offload::Host ? groups : 1) * step_host;
  if (b.host == 0) {
    b.host = c.offload == Offload::Host
                 ? host_need + 4 * MiB
                 : std::max(layers * 3 * p4 / 4 / kPageBytes * kPageBytes, host_need + step_host);
  }
  STRATA_EXPECTS(b.host >= host_need, "host budget ", format_bytes(b.host),
                 " cannot hold the optimizer's working set: ",
                 c.offload == Offload::Host ? std::string("every layer's") : one,
                 " master weights, Adam moments and gradient ", format_bytes(host_need - staging),
                 " + staging ", format_bytes(staging), " = ", format_bytes(host_need),
                 "; raise --host-budget");
  return b;
}

TrainResult train_offloaded(const TrainConfig& c, const Shape& s) {
  TrainResult r;
  const Budgets budgets = resolve_budgets(c, s);
  r.device_budget = budgets.device;
  r.host_budget = budgets.host;
  const std::size_t p4 = s.params() * sizeof(float);
  const int groups = s.groups();

  std::unique_ptr<OwnedDir> owned;
  std::string dir = c.nvme_dir;
  if (c.offload == Offload::Nvme) {
    if (dir.empty()) {
      owned = std::make_unique<OwnedDir>("strata-train");
      dir = owned->path();
    }
    check_nvme_dir(dir);
  }
  RuntimeOptions o;
  o.backend.kind = parse_backend_kind(c.backend, "--backend");
  o.backend.device_budget_bytes = budgets.device;
  o.host_budget_bytes = budgets.host;
  o.staging_chunk_bytes = budgets.staging / 4;
  o.staging_chunks = 4;
  o.quiet = c.quiet;
  // Every span of the training must stay in the ring (the bound is derived from them): per layer
  // and step at most ~9 layer-sized moves of chunks with two spans each, and three kernels;
  // twice that for room.
  const std::size_t chunks_per_layer = p4 / (budgets.staging / 4) + groups;
  o.trace_events = std::max<std::size_t>(
      o.trace_events,
      2 * static_cast<std::size_t>(c.steps) *
          (static_cast<std::size_t>(s.layers) * (18 * chunks_per_layer + 3 * groups) + 8));
  if (c.offload == Offload::Nvme) {
    o.nvme.paths = {dir};
    // Stripes of one I/O block, and room for each tensor's extent rounded up to them: an
    // extent of a stripe or more starts on one, a smaller one shares one (Note [Small
    // extents]), so that bounds what the extents take.
    o.io.block_size = budgets.staging / 4;
    o.nvme.stripe_bytes = o.io.block_size;
    std::uint64_t extents = 0;
    for (int k = 0; k < groups; ++k) {
      const std::uint64_t n4 = s.group_params(k) * sizeof(float);
      extents += align_up(n4, o.nvme.stripe_bytes) + align_up(2 * n4, o.nvme.stripe_bytes);
    }
    o.nvme.capacity_bytes =
        align_up(static_cast<std::uint64_t>(s.layers) * extents * 5 / 4 + 64 * MiB, MiB);
    for (const std::string& f : c.io_faults)
      o.io.faults.push_back(parse_fault(f));
  }
  Runtime rt(o);
  STRATA_EXPECTS(rt.backend().info().host_addressable, "--backend ", c.backend,
                 ": this example's kernels are OpenBLAS on the host backend; the CUDA backend "
                 "would need cuBLAS kernels, which it does not have yet (use --backend host)");

  // The model: per layer and sub-group (Note [Sub-groups]) its parameters (master fp32; the
  // device copy is the working weights), its Adam moments [m | v], and its gradient.
  const Tier home = c.offload == Offload::None   ? Tier::Device
                    : c.offload == Offload::Host ? Tier::Host
                                                 : Tier::Nvme;
  const Tier opt = c.offload == Offload::None ? Tier::Device : Tier::Host;
  std::vector<std::vector<TensorId>> w(s.layers), st(s.layers), g(s.layers);
  for (int i = 0; i < s.layers; ++i) {
    const std::vector<float> init = initial_params(s, c.seed, i);
    for (int k = 0; k < groups; ++k) {
      const std::string prefix = "layers." + std::to_string(i) + "." +
                                 (groups == 1 ? "" : "group" + std::to_string(k) + ".");
      const std::size_t n = s.group_params(k), n4 = n * sizeof(float);
      const std::vector<float> part = group_of(s, init, k);
      TensorDesc d{
          prefix + "params", n4, DType::F32, {static_cast<std::int64_t>(n)}, TensorKind::Param};
      w[i].push_back(rt.create_tensor(d, home, part.data()));
      d = {prefix + "adam",
           2 * n4,
           DType::F32,
           {2, static_cast<std::int64_t>(n)},
           TensorKind::OptimizerState};
      st[i].push_back(rt.create_tensor(d, home));
      d = {prefix + "grad", n4, DType::F32, {static_cast<std::int64_t>(n)}, TensorKind::Grad};
      g[i].push_back(rt.create_tensor(d, c.offload == Offload::None ? Tier::Device : Tier::Host));
      rt.discard(g[i].back());  // not computed yet: no bytes anywhere until backward writes them
    }
  }
  DeviceBuffers buf(rt.backend(), s);
  std::vector<float> x(s.activation()), target(s.activation());
  Data data(s, c.seed);
  // Step names per layer and sub-group (the pipeline records and replays them).
  std::vector<std::vector<std::string>> fwd(s.layers), bwd(s.layers + 1);
  for (int i = 0; i <= s.layers; ++i) {
    for (int k = 0; k < groups; ++k) {
      const std::string group = groups == 1 ? "" : "." + std::to_string(k);
      if (i < s.layers) {
        fwd[i].push_back("forward." + std::to_string(i) + group);
        bwd[i + 1].push_back("backward." + std::to_string(i) + group);
      } else {
        bwd[0].push_back("adam.0" + group);
      }
    }
  }

  PipelineOptions po;
  po.discard_dead = true;                      // a gradient is dead once Adam has read it
  po.write_back = c.offload != Offload::None;  // none: everything stays on the device
  const double room = static_cast<double>(budgets.device) -
                      static_cast<double>(rt.backend().device_stats().current_bytes);
  po.budget_fraction = std::clamp(room / static_cast<double>(budgets.device), 0.01, 1.0);
  Telemetry& clock = rt.telemetry();
  const IoStats io_before = rt.io() != nullptr ? rt.io()->stats() : IoStats{};
  std::vector<StepWindow> windows;
  {
    PrefetchPipeline pipe(rt, po);
    tbb::task_group optimizer;
    for (int step = 0; step < c.steps; ++step) {
      if (c.on_step) c.on_step(step);
      StepPhases ph;
      StepWindow window;
      window.start_ns = clock.now_ns();
      const std::uint64_t adam_step = static_cast<std::uint64_t>(step) + 1;
      data.batch(step, x.data(), target.data());
      rt.backend().copy(buf.act(0), x.data(), x.size() * sizeof(float), CopyKind::HostToDevice);
      rt.backend().copy(buf.target(), target.data(), target.size() * sizeof(float),
                        CopyKind::HostToDevice);
      ph.prep_s = seconds_between(window.start_ns, clock.now_ns());
      pipe.begin_iteration();
      for (int i = 0; i < s.layers; ++i) {
        const bool last = i + 1 == s.layers;
        for (int k = 0; k < groups; ++k) {
          StepLeases in = pipe.begin_step(fwd[i][k], {{w[i][k], Access::Read, Tier::Device}});
          in.wait();
          ph.forward_s += compute_span(clock, w[i][k], i, [&] {
            forward_group(s, k, in[0].as<float>(), buf.act(i), last ? buf.out() : buf.act(i + 1),
                          !last);
          });
          pipe.end_step(std::move(in));
        }
      }
      ph.loss_s = compute_span(clock, 0, s.layers, [&] {
        r.losses.push_back(loss_and_grad(s, buf.out(), buf.target(), buf.dz()));
      });
      window.backward_ns = clock.now_ns();
      // Backward of layer i overlaps Adam of layer i + 1, sub-group by sub-group: each step
      // pairs sub-group k of layer i's backward with sub-group k of layer i + 1's Adam, whose
      // gradient went down to the host as soon as its backward ended and whose states the
      // planner has been reading meanwhile.
      float* dz = buf.dz();
      float* din = buf.din();
      for (int i = s.layers - 1; i >= -1; --i) {
        const int u = i + 1;  // the layer Adam updates in these steps
        for (int k = 0; k < groups; ++k) {
          std::vector<TensorUse> uses;
          if (i >= 0)
            uses = {{w[i][k], Access::Read, Tier::Device}, {g[i][k], Access::Write, Tier::Device}};
          if (u < s.layers) {
            uses.push_back({w[u][k], Access::ReadWrite, opt});
            uses.push_back({st[u][k], Access::ReadWrite, opt});
            uses.push_back({g[u][k], Access::Read, opt});
          }
          StepLeases in = pipe.begin_step(bwd[u][k], std::move(uses));
          in.wait();
          double adam_s = 0, backward_s = 0;
          if (u < s.layers) {
            optimizer.run([&, u, k] {
              adam_s = compute_span(clock, st[u][k], u, [&] {
                adam(c, s.group_params(k), in.of(w[u][k]).as<float>(), in.of(st[u][k]).as<float>(),
                     in.of(g[u][k]).as<float>(), adam_step);
              });
            });
          }
          if (i >= 0) {
            backward_s = compute_span(clock, w[i][k], i, [&] {
              backward_group(s, k, in[0].as<float>(), buf.act(i), dz, in[1].as<float>(),
                             i > 0 ? din : nullptr);
            });
          }
          optimizer.wait();  // adam_s is written before wait() returns
          ph.backward_s += backward_s;
          ph.optimizer_s += adam_s;
          ph.backward_optimizer_s += std::max(backward_s, adam_s);  // side by side
          pipe.end_step(std::move(in));
        }
        if (i >= 0) std::swap(dz, din);
      }
      pipe.end_iteration();  // rethrows a failed write-back: the states stay where they were
      window.end_ns = clock.now_ns();
      ph.step_s = seconds_between(window.start_ns, window.end_ns);
      r.steps.push_back(ph);
      windows.push_back(window);
    }
    r.pipeline_json = nlohmann::json{{"steps", pipe.stats().steps},
                                     {"prefetches", pipe.stats().prefetches},
                                     {"deferred", pipe.stats().deferred},
                                     {"write_backs", pipe.stats().write_backs},
                                     {"discards", pipe.stats().discards},
                                     {"ready_at_begin", pipe.stats().ready_at_begin},
                                     {"inputs", pipe.stats().inputs},
                                     {"max_window_bytes", pipe.stats().max_window_bytes},
                                     {"max_host_window_bytes", pipe.stats().max_host_window_bytes}}
                          .dump();
  }
  rt.synchronize();  // a span is recorded as its move ends
  STRATA_EXPECTS(clock.dropped() == 0, "the telemetry ring (", o.trace_events, " events) dropped ",
                 clock.dropped(), " spans: the steps' link busy times would be incomplete");
  const std::vector<TraceEvent> events = clock.events();
  for (std::size_t k = 0; k < windows.size(); ++k)
    add_link_busy(events, windows[k], r.steps[k]);
  r.link_bytes = link_bytes(events, windows);
  if (const IoEngine* io = rt.io()) {
    r.bytes_nvme_read = io->stats().bytes_read - io_before.bytes_read;
    r.bytes_nvme_written = io->stats().bytes_written - io_before.bytes_written;
  }
  r.peak_device_bytes = rt.backend().device_stats().peak_bytes;
  // The host slab is the host budget: the tier's part and the staging slots (which the runtime
  // shrinks when a small budget cannot hold the ones asked for).
  const TierStats host_tier = rt.tier_stats(Tier::Host);
  r.peak_host_bytes = host_tier.peak_bytes + (budgets.host - host_tier.capacity_bytes);
  if (c.keep_state) {  // the layers put back together from their sub-groups
    for (int i = 0; i < s.layers; ++i) {
      std::vector<float> params(s.params()), moments(2 * s.params());
      for (int k = 0; k < groups; ++k) {
        const std::size_t n = s.group_params(k);
        std::vector<float> part(2 * n);
        rt.read(w[i][k], part.data(), n * sizeof(float));
        put_group(s, part.data(), k, params.data());
        rt.read(st[i][k], part.data(), 2 * n * sizeof(float));
        put_group(s, part.data(), k, moments.data());
        put_group(s, part.data() + n, k, moments.data() + s.params());
      }
      r.final_params.push_back(std::move(params));
      r.final_moments.push_back(std::move(moments));
    }
  }
  r.stats_json = rt.stats_json();
  return r;
}

}  // namespace

Offload parse_offload(const std::string& text) {
  if (text == "none") return Offload::None;
  if (text == "host") return Offload::Host;
  if (text == "nvme") return Offload::Nvme;
  STRATA_FAIL(Errc::invalid_argument, "--offload: \"", text, "\" is not none, host or nvme");
}

TrainResult train(const TrainConfig& c) {
  STRATA_EXPECTS(c.layers >= 1 && c.hidden >= 1 && c.batch >= 1 && c.steps >= 1,
                 "--layers, --hidden, --batch and --steps must be at least 1");
  STRATA_EXPECTS(c.lr > 0 && std::isfinite(c.lr), "--lr: must be a positive number");
  STRATA_EXPECTS(c.sub_group_rows >= 0, "--sub-group-rows: must be 0 (automatic) or more");
  const Shape s{c.layers, c.hidden, c.batch, resolve_rows(c)};
#ifdef STRATA_UNDER_TSAN
  tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
#endif
  TrainResult r = c.reference ? train_reference(c, s) : train_offloaded(c, s);
  std::vector<double> times;
  for (const StepPhases& ph : r.steps)
    times.push_back(ph.step_s);
  r.step_s = median(times);
  r.params = static_cast<std::uint64_t>(s.layers) * s.params();
  r.sub_group_rows = s.rows;
  r.sub_groups = s.groups();
  r.state_bytes = r.params * 3 * sizeof(float);
  return r;
}

void task_batch(const TrainConfig& c, int step, float* x, float* target) {
  Data(Shape{c.layers, c.hidden, c.batch, c.hidden}, c.seed).batch(step, x, target);
}

std::vector<float> task_initial_params(const TrainConfig& c, int layer) {
  return initial_params(Shape{c.layers, c.hidden, c.batch, c.hidden}, c.seed, layer);
}

}  // namespace strata::examples
