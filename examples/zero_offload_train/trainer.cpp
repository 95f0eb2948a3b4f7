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
#include "strata/io/pages.h"
#include "strata/base/units.h"
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

struct Shape {
  int layers, hidden, batch;
  [[nodiscard]] std::size_t params() const {  // one layer: W [H, H] then b [H]
    return static_cast<std::size_t>(hidden) * hidden + hidden;
  }
  [[nodiscard]] std::size_t activation() const { return static_cast<std::size_t>(batch) * hidden; }
};

// ---- the kernels: the same calls, in the same order, for the offloaded and reference runs ----

// out = relu?(in W^T + b); wb holds W [H, H] row-major (out x in) then b [H].
void forward_layer(const Shape& s, const float* wb, const float* in, float* out, bool relu) {
  const int h = s.hidden, b = s.batch;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, h, h, 1.0f, in, h, wb, h, 0.0f, out, h);
  const float* bias = wb + static_cast<std::size_t>(h) * h;
  for (int r = 0; r < b; ++r) {
    float* row = out + static_cast<std::size_t>(r) * h;
    for (int j = 0; j < h; ++j) {
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

// From dz (the gradient at this layer's pre-activation output): grad = [dz^T in | sum_b dz];
// din = (dz W) masked by in > 0 (in is the previous layer's relu output), unless null.
void backward_layer(const Shape& s, const float* wb, const float* in, const float* dz, float* grad,
                    float* din) {
  const int h = s.hidden, b = s.batch;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h, h, b, 1.0f, dz, h, in, h, 0.0f, grad, h);
  float* db = grad + static_cast<std::size_t>(h) * h;
  std::fill(db, db + h, 0.0f);
  for (int r = 0; r < b; ++r)
    for (int j = 0; j < h; ++j)
      db[j] += dz[static_cast<std::size_t>(r) * h + j];
  if (din == nullptr) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, b, h, h, 1.0f, dz, h, wb, h, 0.0f, din, h);
  for (std::size_t k = 0; k < s.activation(); ++k)
    if (!(in[k] > 0.0f)) din[k] = 0.0f;
}

void adam(const Shape& s, const TrainConfig& c, float* params, float* states, const float* grad,
          std::uint64_t step) {
  optim::AdamConfig config;
  config.lr = c.lr;
  optim::AdamArgs args;
  args.params = params;
  args.exp_avg = states;
  args.exp_avg_sq = states + s.params();
  args.grads = grad;
  args.grad_dtype = DType::F32;
  args.count = s.params();
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
  const std::size_t p = s.params();
  std::vector<std::vector<float>> w, st, g(s.layers, std::vector<float>(p));
  for (int i = 0; i < s.layers; ++i) {
    w.push_back(initial_params(s, c.seed, i));
    st.emplace_back(2 * p, 0.0f);
  }
  std::vector<std::vector<float>> act(s.layers, std::vector<float>(s.activation()));
  std::vector<float> out(s.activation()), target(s.activation()), dz(s.activation()),
      din(s.activation());
  Data data(s, c.seed);
  Telemetry clock(static_cast<std::size_t>(c.steps) * (3 * s.layers + 4));
  for (int step = 0; step < c.steps; ++step) {
    StepPhases ph;
    const std::uint64_t t0 = clock.now_ns();
    data.batch(step, act[0].data(), target.data());
    ph.prep_s = seconds_between(t0, clock.now_ns());
    for (int i = 0; i < s.layers; ++i) {
      const bool last = i + 1 == s.layers;
      ph.forward_s += compute_span(clock, 0, i, [&] {
        forward_layer(s, w[i].data(), act[i].data(), last ? out.data() : act[i + 1].data(), !last);
      });
    }
    ph.loss_s = compute_span(clock, 0, s.layers, [&] {
      r.losses.push_back(loss_and_grad(s, out.data(), target.data(), dz.data()));
    });
    for (int i = s.layers - 1; i >= 0; --i) {
      ph.backward_s += compute_span(clock, 0, i, [&] {
        backward_layer(s, w[i].data(), act[i].data(), dz.data(), g[i].data(),
                       i > 0 ? din.data() : nullptr);
      });
      std::swap(dz, din);
      ph.optimizer_s += compute_span(clock, 0, i, [&] {
        adam(s, c, w[i].data(), st[i].data(), g[i].data(), static_cast<std::uint64_t>(step) + 1);
      });
    }
    ph.backward_optimizer_s = ph.backward_s + ph.optimizer_s;  // one after the other
    ph.step_s = seconds_between(t0, clock.now_ns());
    r.steps.push_back(ph);
  }
  r.peak_host_bytes = (s.layers * 4 * p + (s.layers + 4) * s.activation()) * sizeof(float);
  r.stats_json = "{}";
  r.pipeline_json = "{}";
  if (c.keep_state) {
    r.final_params = std::move(w);
    r.final_moments = std::move(st);
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

Budgets resolve_budgets(const TrainConfig& c, const Shape& s) {
  const std::size_t p4 = s.params() * sizeof(float);
  const std::size_t layers = static_cast<std::size_t>(s.layers);
  const std::size_t act = (layers + 4) * align_up(s.activation() * sizeof(float), 256);
  // Four staging slots for NVMe -> device: half a layer each, between 64 and 512 KiB.
  const std::size_t staging = 4 * std::clamp(align_up(p4 / 2, 64 * KiB), 64 * KiB, 512 * KiB);
  Budgets b{c.device_budget, c.host_budget, staging};
  // Device: the activations and one backward step (a layer's weights and its gradient), or
  // everything when nothing is offloaded.
  const std::size_t device_need =
      act + (c.offload == Offload::None ? layers * 4 * p4 : 2 * align_up(p4, 256));
  if (b.device == 0)
    b.device = c.offload == Offload::None ? device_need + 16 * MiB
                                          : act + (layers / 2 + 2) * align_up(p4, 256);
  STRATA_EXPECTS(b.device >= device_need, "device budget ", format_bytes(b.device),
                 " cannot hold the working set: activations ", format_bytes(act), " (", s.layers,
                 " layers + 4 buffers of ", s.batch, " x ", s.hidden, " fp32) + ",
                 c.offload == Offload::None ? "every layer's weights, gradient and Adam states "
                                            : "one layer's weights and gradient ",
                 format_bytes(device_need - act), " = ", format_bytes(device_need),
                 "; raise --device-budget or lower --batch / --hidden");
  if (c.offload == Offload::None) {
    b.host = b.host == 0 ? staging + 4 * MiB : b.host;
    return b;
  }
  // Host: one optimizer step (a layer's master weights, both moments and its gradient); for
  // host offload, every layer's.
  const std::size_t layer_host = 4 * align_up(p4, kPageBytes);
  const std::size_t host_need = staging + (c.offload == Offload::Host ? layers : 1) * layer_host;
  if (b.host == 0) {
    b.host = c.offload == Offload::Host
                 ? host_need + 4 * MiB
                 : std::max(layers * 3 * p4 / 4 / kPageBytes * kPageBytes, host_need + layer_host);
  }
  STRATA_EXPECTS(b.host >= host_need, "host budget ", format_bytes(b.host),
                 " cannot hold the optimizer's working set: ",
                 c.offload == Offload::Host ? "every layer's" : "one layer's",
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
  const std::size_t p = s.params(), p4 = p * sizeof(float);

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
  const std::size_t chunks_per_layer = p4 / (budgets.staging / 4) + 1;
  o.trace_events = std::max<std::size_t>(
      o.trace_events, 2 * static_cast<std::size_t>(c.steps) *
                          (static_cast<std::size_t>(s.layers) * (18 * chunks_per_layer + 3) + 8));
  if (c.offload == Offload::Nvme) {
    o.nvme.paths = {dir};
    o.nvme.capacity_bytes =
        align_up(static_cast<std::uint64_t>(s.layers) * 4 * p4 * 5 / 4 + 64 * MiB, MiB);
    o.io.block_size = budgets.staging / 4;
    for (const std::string& f : c.io_faults)
      o.io.faults.push_back(parse_fault(f));
  }
  Runtime rt(o);
  STRATA_EXPECTS(rt.backend().info().host_addressable, "--backend ", c.backend,
                 ": this example's kernels are OpenBLAS on the host backend; the CUDA backend "
                 "would need cuBLAS kernels, which it does not have yet (use --backend host)");

  // The model: per layer its parameters (master fp32; the device copy is the working weights),
  // its Adam moments [m | v], and its gradient.
  const Tier home = c.offload == Offload::None   ? Tier::Device
                    : c.offload == Offload::Host ? Tier::Host
                                                 : Tier::Nvme;
  const Tier opt = c.offload == Offload::None ? Tier::Device : Tier::Host;
  std::vector<TensorId> w, st, g;
  for (int i = 0; i < s.layers; ++i) {
    const std::string prefix = "layers." + std::to_string(i) + ".";
    const std::vector<float> init = initial_params(s, c.seed, i);
    TensorDesc d{
        prefix + "params", p4, DType::F32, {static_cast<std::int64_t>(p)}, TensorKind::Param};
    w.push_back(rt.create_tensor(d, home, init.data()));
    d = {prefix + "adam",
         2 * p4,
         DType::F32,
         {2, static_cast<std::int64_t>(p)},
         TensorKind::OptimizerState};
    st.push_back(rt.create_tensor(d, home));
    d = {prefix + "grad", p4, DType::F32, {static_cast<std::int64_t>(p)}, TensorKind::Grad};
    g.push_back(rt.create_tensor(d, c.offload == Offload::None ? Tier::Device : Tier::Host));
    rt.discard(g.back());  // not computed yet: no bytes anywhere until backward writes them
  }
  DeviceBuffers buf(rt.backend(), s);
  std::vector<float> x(s.activation()), target(s.activation());
  Data data(s, c.seed);
  std::vector<std::string> fwd, bwd;
  for (int i = 0; i < s.layers; ++i) {
    fwd.push_back("forward." + std::to_string(i));
    bwd.push_back("backward." + std::to_string(i));
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
        StepLeases in = pipe.begin_step(fwd[i], {{w[i], Access::Read, Tier::Device}});
        in.wait();
        const bool last = i + 1 == s.layers;
        ph.forward_s += compute_span(clock, w[i], i, [&] {
          forward_layer(s, in[0].as<float>(), buf.act(i), last ? buf.out() : buf.act(i + 1), !last);
        });
        pipe.end_step(std::move(in));
      }
      ph.loss_s = compute_span(clock, 0, s.layers, [&] {
        r.losses.push_back(loss_and_grad(s, buf.out(), buf.target(), buf.dz()));
      });
      window.backward_ns = clock.now_ns();
      // Backward of layer i overlaps Adam of layer i + 1, whose gradient went down to the host
      // as soon as its backward ended and whose states the planner has been reading meanwhile.
      float* dz = buf.dz();
      float* din = buf.din();
      for (int i = s.layers - 1; i >= -1; --i) {
        std::vector<TensorUse> uses;
        if (i >= 0)
          uses = {{w[i], Access::Read, Tier::Device}, {g[i], Access::Write, Tier::Device}};
        const int u = i + 1;  // the layer Adam updates in this step
        if (u < s.layers) {
          uses.push_back({w[u], Access::ReadWrite, opt});
          uses.push_back({st[u], Access::ReadWrite, opt});
          uses.push_back({g[u], Access::Read, opt});
        }
        StepLeases in = pipe.begin_step(i >= 0 ? bwd[i] : "adam.0", std::move(uses));
        in.wait();
        double adam_s = 0, backward_s = 0;
        if (u < s.layers) {
          optimizer.run([&, u] {
            adam_s = compute_span(clock, st[u], u, [&] {
              adam(s, c, in.of(w[u]).as<float>(), in.of(st[u]).as<float>(), in.of(g[u]).as<float>(),
                   adam_step);
            });
          });
        }
        if (i >= 0) {
          backward_s = compute_span(clock, w[i], i, [&] {
            backward_layer(s, in[0].as<float>(), buf.act(i), dz, in[1].as<float>(),
                           i > 0 ? din : nullptr);
          });
          std::swap(dz, din);
        }
        optimizer.wait();  // adam_s is written before wait() returns
        ph.backward_s += backward_s;
        ph.optimizer_s += adam_s;
        ph.backward_optimizer_s += std::max(backward_s, adam_s);  // side by side
        pipe.end_step(std::move(in));
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
  r.peak_host_bytes = rt.tier_stats(Tier::Host).peak_bytes + budgets.staging;
  if (c.keep_state) {
    for (int i = 0; i < s.layers; ++i) {
      r.final_params.emplace_back(p);
      rt.read(w[i], r.final_params.back().data(), p4);
      r.final_moments.emplace_back(2 * p);
      rt.read(st[i], r.final_moments.back().data(), 2 * p4);
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
  const Shape s{c.layers, c.hidden, c.batch};
#ifdef STRATA_UNDER_TSAN
  tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
#endif
  TrainResult r = c.reference ? train_reference(c, s) : train_offloaded(c, s);
  std::vector<double> times;
  for (const StepPhases& ph : r.steps)
    times.push_back(ph.step_s);
  r.step_s = median(times);
  r.params = static_cast<std::uint64_t>(s.layers) * s.params();
  r.state_bytes = r.params * 3 * sizeof(float);
  return r;
}

void task_batch(const TrainConfig& c, int step, float* x, float* target) {
  Data(Shape{c.layers, c.hidden, c.batch}, c.seed).batch(step, x, target);
}

std::vector<float> task_initial_params(const TrainConfig& c, int layer) {
  return initial_params(Shape{c.layers, c.hidden, c.batch}, c.seed, layer);
}

}  // namespace strata::examples
