#include "model.h"

#include <cblas.h>
#include <fcntl.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "example_util.h"
#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/crc32c.h"
#include "strata/io/pages.h"
#include "strata/optim/adam.h"
#include "strata/runtime/compressed_cache.h"
#include "strata/runtime/runtime.h"
#include "strata/runtime/svg_timeline.h"
#include "strata/runtime/telemetry.h"
#include "strata/scheduler/prefetch_pipeline.h"

namespace strata::examples {
namespace {

// Rows of W converted to fp32 at a time: the scratch the device needs beside the layer.
constexpr int kBlockRows = 256;

// `count` elements of `dtype` at `src` as fp32 into dst.
void to_f32(DType dtype, const void* src, std::size_t count, float* dst) {
  if (dtype == DType::F32) {
    std::memcpy(dst, src, count * sizeof(float));
  } else if (dtype == DType::BF16) {
    const auto* s = static_cast<const std::uint16_t*>(src);
    for (std::size_t i = 0; i < count; ++i)
      dst[i] = optim::bf16_to_float(s[i]);
  } else {
    const auto* s = static_cast<const std::uint16_t*>(src);
    for (std::size_t i = 0; i < count; ++i)
      dst[i] = optim::f16_to_float(s[i]);
  }
}

// Scratch for one layer's compute: a block of W's rows and the bias, in fp32.
struct Scratch {
  float* rows = nullptr;  // kBlockRows x max_in
  float* bias = nullptr;  // max_out
};

// y = relu?(x W^T + b) for one layer, W converted kBlockRows rows at a time. The same function
// serves the streamed and the reference runs, so both compute bit for bit the same.
void layer_forward(const LayerSpec& l, const void* w, const void* b, const float* x, float* y,
                   int batch, bool relu, const Scratch& s) {
  const std::size_t in = static_cast<std::size_t>(l.in);
  const DType wt = l.weight->dtype;
  const std::size_t wsize = dtype_bytes(wt);
  for (int r0 = 0; r0 < l.out; r0 += kBlockRows) {
    const int rows = std::min(kBlockRows, l.out - r0);
    const void* src = static_cast<const std::byte*>(w) + static_cast<std::size_t>(r0) * in * wsize;
    const float* block = static_cast<const float*>(src);
    if (wt != DType::F32) {
      to_f32(wt, src, static_cast<std::size_t>(rows) * in, s.rows);
      block = s.rows;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, rows, l.in, 1.0f, x, l.in, block,
                l.in, 0.0f, y + r0, l.out);
  }
  to_f32(l.bias->dtype, b, static_cast<std::size_t>(l.out), s.bias);
  for (int r = 0; r < batch; ++r) {
    float* row = y + static_cast<std::size_t>(r) * l.out;
    for (int j = 0; j < l.out; ++j) {
      const float v = row[j] + s.bias[j];
      row[j] = relu ? (v > 0.0f ? v : 0.0f) : v;
    }
  }
}

std::size_t scratch_floats(const ModelSpec& m) {
  int max_in = 0, max_out = 0;
  for (const LayerSpec& l : m.layers) {
    max_in = std::max(max_in, l.in);
    max_out = std::max(max_out, l.out);
  }
  return static_cast<std::size_t>(kBlockRows) * max_in + max_out;
}

// The scratch's parts in a buffer of scratch_floats(m) floats.
Scratch scratch_at(float* base, const ModelSpec& m) {
  int max_out = 0;
  for (const LayerSpec& l : m.layers)
    max_out = std::max(max_out, l.out);
  return {base, base + (scratch_floats(m) - static_cast<std::size_t>(max_out))};
}

void check_input(const ModelSpec& m, const std::vector<float>& input, int batch) {
  STRATA_EXPECTS(batch >= 1, "--batch: must be at least 1");
  STRATA_EXPECTS(input.size() == static_cast<std::size_t>(batch) * m.input_dim(), "the input has ",
                 input.size(), " values; the model takes batch ", batch, " x ", m.input_dim(),
                 " = ", static_cast<std::size_t>(batch) * m.input_dim());
}

// Note [Measuring compute_s]
// compute_s is the forward pass's compute alone, measured under the conditions of the streamed
// pass it is compared with. Each timed pass k runs three passes, every one from the same state
// (cold and drained: the planner idle, no move in flight, no layer on the device or the host
// tier, the file the only copy):
//   1. compute-only: layer by layer, the layer's own weights are leased on the device (brought in
//      from the file, untimed), flushed from the CPU caches (untimed), and only its compute is
//      timed; compute_s is the sum. The layer's weights are read from memory once, as in the
//      streamed pass, where they were loaded while earlier layers computed: one cache-hot buffer
//      reused for every layer (what this replaced) measured a compute that no real pass can do.
//   2. transfer-only: every layer through the same pipeline, nothing computed (transfer_s).
//   3. the streamed pass (step_s).
// The medians over the passes give compute_s, transfer_s and step_s; the passes go on until each
// has run long enough (Note [Measuring until the figures hold]), and a roofline above
// kMaxRoofline still means one of them was mismeasured: the figures are marked untrusted.
void flush_from_cpu_caches(const void* p, std::size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  const auto* c = static_cast<const char*>(p);
  for (std::size_t i = 0; i < bytes; i += 64)
    _mm_clflush(c + i);
  if (bytes > 0) _mm_clflush(c + bytes - 1);
  _mm_mfence();
#else
  // Other architectures: no flush; the tail of a layer the load just wrote may still be cached,
  // so compute_s may be a little low there.
  (void)p;
  (void)bytes;
#endif
}

}  // namespace

int ModelSpec::max_dim() const {
  int d = 0;
  for (const LayerSpec& l : layers)
    d = std::max({d, l.in, l.out});
  return d;
}

std::uint64_t ModelSpec::largest_layer_bytes(std::size_t* which) const {
  std::uint64_t best = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::uint64_t b = layers[i].weight->bytes() + layers[i].bias->bytes();
    if (b > best) {
      best = b;
      if (which != nullptr) *which = i;
    }
  }
  return best;
}

ModelSpec describe_model(const safetensors::Header& h, const std::string& path) {
  // The layer count: one past the highest i of any layers.{i}.weight / .bias.
  std::size_t count = 0;
  for (const safetensors::TensorInfo& t : h.tensors) {
    if (t.name.rfind("layers.", 0) != 0) continue;
    const std::string rest = t.name.substr(7);
    const std::size_t dot = rest.find('.');
    if (dot == std::string::npos || dot == 0) continue;
    const std::string index = rest.substr(0, dot), field = rest.substr(dot + 1);
    if (field != "weight" && field != "bias") continue;
    if (!std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    if (index.size() > 6)
      STRATA_FAIL(Errc::invalid_argument, path, ": ", t.name, ": too many layers");
    count = std::max(count, static_cast<std::size_t>(std::stoul(index)) + 1);
  }
  STRATA_EXPECTS(count > 0, path,
                 ": no layers.0.weight: not a streamable MLP (expected layers.{i}.weight [out, in] "
                 "and layers.{i}.bias [out] for i = 0..L-1)");
  ModelSpec m;
  for (std::size_t i = 0; i < count; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerSpec l;
    l.weight = h.find(p + "weight");
    l.bias = h.find(p + "bias");
    STRATA_EXPECTS(l.weight != nullptr, path, ": ", p,
                   "weight is missing (the model has tensors up "
                   "to layers.",
                   count - 1, ")");
    STRATA_EXPECTS(l.bias != nullptr, path, ": ", p, "bias is missing");
    for (const safetensors::TensorInfo* t : {l.weight, l.bias}) {
      STRATA_EXPECTS(t->dtype == DType::F32 || t->dtype == DType::F16 || t->dtype == DType::BF16,
                     path, ": ", t->name, " is ", to_string(t->dtype),
                     ": only F32, F16 and BF16 are supported");
    }
    STRATA_EXPECTS(l.weight->shape.size() == 2 && l.weight->shape[0] > 0 && l.weight->shape[1] > 0,
                   path, ": ", l.weight->name, " must have shape [out, in] with out, in > 0");
    l.out = static_cast<int>(l.weight->shape[0]);
    l.in = static_cast<int>(l.weight->shape[1]);
    STRATA_EXPECTS(l.weight->shape[0] <= (1 << 20) && l.weight->shape[1] <= (1 << 20), path, ": ",
                   l.weight->name, " is wider than 2^20");
    STRATA_EXPECTS(l.bias->shape.size() == 1 && l.bias->shape[0] == l.weight->shape[0], path, ": ",
                   l.bias->name, " must have shape [", l.out, "] to match ", l.weight->name);
    if (!m.layers.empty()) {
      const LayerSpec& prev = m.layers.back();
      STRATA_EXPECTS(l.in == prev.out, path, ": ", l.weight->name, " takes ", l.in,
                     " inputs but layers.", i - 1, " gives ", prev.out, " outputs");
    }
    m.model_bytes += l.weight->bytes() + l.bias->bytes();
    m.layers.push_back(l);
  }
  return m;
}

std::uint64_t generate_model(const std::string& path, int layers, int hidden, DType dtype,
                             std::uint64_t seed) {
  STRATA_EXPECTS(layers >= 1 && hidden >= 1, "--generate: --layers and --hidden must be >= 1");
  STRATA_EXPECTS(dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16,
                 "--dtype: only f32, f16 and bf16");
  std::vector<safetensors::TensorSpec> specs;
  for (int i = 0; i < layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    specs.push_back({p + "weight", dtype, {hidden, hidden}});
    specs.push_back({p + "bias", dtype, {hidden}});
  }
  safetensors::Writer w(path, specs,
                        {{"format", "strata-mlp"},
                         {"generator", "stream_inference --generate"},
                         {"seed", std::to_string(seed)}},
                        kPageBytes);  // the data page-aligned: layers read in place (O_DIRECT)
  const std::size_t esize = dtype_bytes(dtype);
  const std::size_t chunk = std::max<std::size_t>(1, (4 * MiB) / (esize * hidden));  // rows
  std::vector<unsigned char> buf(chunk * hidden * esize);
  const float wbound = std::sqrt(6.0f / static_cast<float>(hidden));
  auto put = [&](std::size_t i, float v) {
    if (dtype == DType::F32) {
      std::memcpy(&buf[i * 4], &v, 4);
    } else {
      const std::uint16_t h =
          dtype == DType::BF16 ? optim::float_to_bf16(v) : optim::float_to_f16(v);
      std::memcpy(&buf[i * 2], &h, 2);
    }
  };
  for (int l = 0; l < layers; ++l) {
    const auto stream = static_cast<std::uint64_t>(l) * 2;
    for (std::size_t r0 = 0; r0 < static_cast<std::size_t>(hidden); r0 += chunk) {
      const std::size_t rows = std::min(chunk, static_cast<std::size_t>(hidden) - r0);
      for (std::size_t k = 0; k < rows * hidden; ++k)
        put(k, wbound * uniform(seed, stream, r0 * hidden + k));
      w.write(buf.data(), rows * hidden * esize);
    }
    for (int k = 0; k < hidden; ++k)
      put(static_cast<std::size_t>(k),
          0.1f * uniform(seed, stream + 1, static_cast<std::size_t>(k)));
    w.write(buf.data(), static_cast<std::size_t>(hidden) * esize);
  }
  w.finish();
  return w.file_bytes();
}

std::vector<float> run_reference(const std::string& model, const std::vector<float>& input,
                                 int batch) {
  const safetensors::Header h = safetensors::read_header(model);
  const ModelSpec m = describe_model(h, model);
  check_input(m, input, batch);
  // Every weight in memory, read with plain reads.
  const int fd = ::open(model.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(Errc::io_error, model, 0, 0, errno, "open");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  auto load = [&](const safetensors::TensorInfo& t) {
    std::vector<std::byte> out(t.bytes());
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t n =
          ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(t.offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        throw IoError(n == 0 ? Errc::corrupt_data : Errc::io_error, model, t.offset + done,
                      out.size() - done, n == 0 ? 0 : errno, "read");
      done += static_cast<std::size_t>(n);
    }
    return out;
  };
  std::vector<std::vector<std::byte>> weights, biases;
  for (const LayerSpec& l : m.layers) {
    weights.push_back(load(*l.weight));
    biases.push_back(load(*l.bias));
  }
  std::vector<float> scratch(scratch_floats(m));
  const Scratch scr = scratch_at(scratch.data(), m);
  const std::size_t width = static_cast<std::size_t>(batch) * m.max_dim();
  std::vector<float> x(width), y(width);
  std::copy(input.begin(), input.end(), x.begin());
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    layer_forward(m.layers[i], weights[i].data(), biases[i].data(), x.data(), y.data(), batch,
                  i + 1 < m.layers.size(), scr);
    std::swap(x, y);
  }
  return {x.begin(), x.begin() + static_cast<std::ptrdiff_t>(batch) * m.output_dim()};
}

InferenceResult run_streamed(const InferenceConfig& c) {
  InferenceResult r;
  const safetensors::Header h = safetensors::read_header(c.model);
  r.model = describe_model(h, c.model);
  const ModelSpec& m = r.model;
  check_input(m, c.input, c.batch);
  STRATA_EXPECTS(c.passes >= 1, "--passes: must be at least 1");

  // Device: two activation buffers and the fp32 scratch beside the layers in flight.
  const std::size_t width = static_cast<std::size_t>(c.batch) * m.max_dim();
  const std::size_t own =
      2 * align_up(width * sizeof(float), 256) + align_up(scratch_floats(m) * sizeof(float), 256);
  std::size_t largest_index = 0;
  const std::uint64_t largest = m.largest_layer_bytes(&largest_index);
  const std::uint64_t layer_need = align_up(m.layers[largest_index].weight->bytes(), 256) +
                                   align_up(m.layers[largest_index].bias->bytes(), 256);
  r.device_budget = c.device_budget != 0
                        ? c.device_budget
                        : std::max<std::size_t>(align_up(m.model_bytes / 8, kPageBytes),
                                                align_up(own + 2 * layer_need, kPageBytes));
  STRATA_EXPECTS(r.device_budget >= own + layer_need, "device budget ",
                 format_bytes(r.device_budget), " is smaller than the largest layer (layers.",
                 largest_index, ": ", format_bytes(largest), ") plus the working buffers (",
                 format_bytes(own), ": activations of batch ", c.batch, " x ", m.max_dim(),
                 " and fp32 scratch) = ", format_bytes(own + layer_need));
  // A host budget too small for this staging area is shrunk to fit by the runtime (Note
  // [Staging fits the budget]); it refuses only one that no staging area fits.
  const std::size_t staging_chunk = 4 * MiB, staging_chunks = 4;
  r.host_budget = c.host_budget != 0 ? c.host_budget : 64 * MiB;

  OwnedDir swap_dir(
      "strata-infer");  // the runtime's own swap files: the model is never copied there
  RuntimeOptions o;
  o.backend.kind = parse_backend_kind(c.backend, "--backend");
  o.backend.device_budget_bytes = r.device_budget;
  o.host_budget_bytes = r.host_budget;
  o.staging_chunk_bytes = staging_chunk;
  o.staging_chunks = staging_chunks;
  o.nvme.paths = {swap_dir.path()};
  o.nvme.capacity_bytes = 64 * MiB;
  o.nvme.stripe_bytes = MiB;
  o.io.block_size = MiB;
  // The model streams through a host tier smaller than it: a host copy kept on the way would be
  // evicted before the next pass and cost a memcpy of every layer on the cores the GEMM uses.
  // Layers staged ahead on the host (the planner's host prefetches) are host copies all the same.
  o.host_copy_on_the_way = false;
  o.quiet = c.quiet;
  Runtime rt(o);
  STRATA_EXPECTS(rt.backend().info().host_addressable, "--backend ", c.backend,
                 ": this example's kernels are OpenBLAS on the host backend; the CUDA backend "
                 "would need cuBLAS kernels, which it does not have yet (use --backend host)");
  auto ids = safetensors::map_file(rt, c.model, h);
  if (!c.compress.empty()) {  // the weights from the compressed cache, biases full width
    std::vector<std::string> names;
    for (const LayerSpec& l : m.layers)
      names.push_back(l.weight->name);
    const quant::Scheme scheme{quant::parse_bits(c.compress, "--compress"), c.compress_group};
    const std::string dir = !c.compress_cache.empty()
                                ? c.compress_cache
                                : std::filesystem::path(c.model).parent_path().string();
    const auto cache = safetensors::open_compressed_cache(
        c.model, h, names, scheme, dir.empty() ? "." : dir, /*verify=*/true,
        [&](std::uint64_t done, std::uint64_t total) {
          if (!c.quiet || done == total)
            std::fprintf(stderr, "\rstream_inference: compressing %s to %s: %3.0f%%%s",
                         c.model.c_str(), c.compress.c_str(),
                         100.0 * static_cast<double>(done) / static_cast<double>(total),
                         done == total ? "\n" : "");
        });
    for (const auto& [name, id] : safetensors::map_compressed(rt, cache)) {
      rt.destroy_tensor(ids.at(name));
      ids[name] = id;
    }
    r.cache_rebuilt = cache.rebuilt;
    r.cache_why = cache.why;
    r.compressed_stored_bytes = cache.stored_bytes;
    r.compressed_full_bytes = cache.full_bytes;
  }
  std::vector<TensorId> w, b;
  for (const LayerSpec& l : m.layers) {
    w.push_back(ids.at(l.weight->name));
    b.push_back(ids.at(l.bias->name));
  }

  // The example's own device memory.
  Backend& be = rt.backend();
  auto* x = static_cast<float*>(be.allocate_device(width * sizeof(float)));
  auto* y = static_cast<float*>(be.allocate_device(width * sizeof(float)));
  auto* scratch = static_cast<float*>(be.allocate_device(scratch_floats(m) * sizeof(float)));
  struct Free {
    Backend& be;
    std::vector<void*> p;
    ~Free() {
      for (void* q : p)
        be.deallocate_device(q);
    }
  } free_on_exit{be, {x, y, scratch}};
  const Scratch s = scratch_at(scratch, m);

  Schedule order;
  for (std::size_t i = 0; i < m.layers.size(); ++i)
    order.append({"layer." + std::to_string(i),
                  {{w[i], Access::Read, Tier::Device}, {b[i], Access::Read, Tier::Device}}});
  PipelineOptions po;
  if (c.prefetch == "none") {
    po.prefetch = PrefetchMode::None;
  } else if (c.prefetch != "auto") {
    po.prefetch = PrefetchMode::Fixed;
    char* end = nullptr;
    const unsigned long k = std::strtoul(c.prefetch.c_str(), &end, 10);
    STRATA_EXPECTS(end != c.prefetch.c_str() && *end == '\0' && k >= 1, "--prefetch: \"",
                   c.prefetch, "\" is not none, auto or a number of layers >= 1");
    po.fixed_lookahead = k;
  }
  po.budget_fraction =
      std::clamp(static_cast<double>(r.device_budget - be.device_stats().current_bytes) /
                     static_cast<double>(r.device_budget),
                 0.01, 1.0);

  // Each pass starts cold and drained (Note [Measuring compute_s]): the planner idle (it does not
  // prefetch the next iteration: across_iterations is off), no move in flight, no layer on the
  // device or the host tier.
  po.across_iterations = false;
  PrefetchPipeline p(rt, po);
  auto cool = [&] {
    p.drain();
    rt.synchronize();
    for (std::size_t i = 0; i < w.size(); ++i)
      for (TensorId t : {w[i], b[i]}) {
        rt.evict(t, Tier::Device);
        rt.evict(t, Tier::Host);
      }
  };
  auto output_of = [&](const float* in) {
    std::vector<float> result(static_cast<std::size_t>(c.batch) * m.output_dim());
    be.copy(result.data(), in, result.size() * sizeof(float), CopyKind::DeviceToHost);
    return result;
  };
  // The streamed pass (compute) or a transfer-only one: its time and output.
  auto pass = [&](bool compute) {
    cool();
    const auto t0 = Clock::now();
    be.copy(x, c.input.data(), c.input.size() * sizeof(float), CopyKind::HostToDevice);
    float* in = x;
    float* out = y;
    p.begin_iteration();
    for (std::size_t i = 0; i < m.layers.size(); ++i) {
      StepLeases leases = p.begin_step(order.steps()[i].name, order.steps()[i].uses);
      leases.wait();
      const std::uint64_t c0 = rt.telemetry().now_ns();
      if (compute) {
        layer_forward(m.layers[i], leases[0].data(), leases[1].data(), in, out, c.batch,
                      i + 1 < m.layers.size(), s);
        std::swap(in, out);
      }
      rt.telemetry().record({c0, rt.telemetry().now_ns(), Track::Compute,
                             leases[0].bytes() + leases[1].bytes(), w[i], i});
      p.end_step(std::move(leases));
    }
    p.end_iteration();
    std::vector<float> result = output_of(in);
    return std::make_pair(seconds_since(t0), std::move(result));
  };
  // The compute-only pass: the sum of the layers' compute times, each layer's own weights
  // resident and out of the CPU caches when its timer starts.
  auto compute_pass = [&] {
    cool();
    be.copy(x, c.input.data(), c.input.size() * sizeof(float), CopyKind::HostToDevice);
    float* in = x;
    float* out = y;
    double seconds = 0;
    for (std::size_t i = 0; i < m.layers.size(); ++i) {
      Lease wl = rt.acquire(w[i], Tier::Device, Access::Read).get();
      Lease bl = rt.acquire(b[i], Tier::Device, Access::Read).get();
      wl.wait();
      bl.wait();
      flush_from_cpu_caches(wl.data(), wl.bytes());
      flush_from_cpu_caches(bl.data(), bl.bytes());
      rt.synchronize();  // nothing in flight while the timer runs
      const auto t0 = Clock::now();
      layer_forward(m.layers[i], wl.data(), bl.data(), in, out, c.batch, i + 1 < m.layers.size(),
                    s);
      seconds += seconds_since(t0);
      std::swap(in, out);
    }
    return std::make_pair(seconds, output_of(in));
  };
  auto agree = [&](std::vector<float> out) {
    if (!r.output.empty() && out != r.output) r.passes_agree = false;
    r.output = std::move(out);
  };

  pass(true);  // warm-up: records the schedule
  // Timed pass k: compute-only, transfer-only, streamed, each from the same state; the
  // transfer-only pass runs just before the streamed one, so both see the disk in the same state
  // (this machine's disk drifts by 20-30% from one second to the next). Passes go on until each
  // figure has run long enough (Note [Measuring until the figures hold]).
  const MeasureRule rule{.min_rounds = c.passes, .min_seconds = c.min_seconds};
  std::vector<double> times, computes, transfers;
  std::uint64_t read_in_passes = 0;
  for (int i = 0;
       !(c.measure ? rule.enough(i, {&times, &computes, &transfers}) : rule.enough(i, {&times}));
       ++i) {
    if (c.measure) {
      auto [seconds, out] = compute_pass();
      computes.push_back(seconds);
      agree(std::move(out));
      transfers.push_back(pass(false).first);
    }
    rt.telemetry().clear();  // the trace shows the last streamed pass
    const std::uint64_t read0 = rt.io()->stats().bytes_read;
    const double steal0 = cpu_steal_seconds();
    p.drain();  // the measuring passes' planning is over before the counts are taken
    const PipelineStats before = p.stats();
    auto [seconds, out] = pass(true);
    r.cpu_steal_s += cpu_steal_seconds() - steal0;
    p.drain();
    r.host_prefetches += p.stats().host_prefetches - before.host_prefetches;
    r.arrivals_in_pieces += p.stats().arrivals_in_pieces - before.arrivals_in_pieces;
    read_in_passes += rt.io()->stats().bytes_read - read0;
    times.push_back(seconds);
    agree(std::move(out));
  }
  r.passes_run = static_cast<int>(times.size());
  r.bytes_nvme_read = read_in_passes;
  double total = 0;
  for (double t : times)
    total += t;
  r.step_s = median(times);
  r.step_runs_s = times;
  r.gbps_nvme_read = total > 0 ? static_cast<double>(r.bytes_nvme_read) / total / 1e9 : 0;
  r.samples_per_s = r.step_s > 0 ? c.batch / r.step_s : 0;
  r.peak_device_bytes = be.device_stats().peak_bytes;
  r.dequant_ns = rt.tier_stats(Tier::Device).dequant_ns;
  if (!c.trace.empty()) rt.telemetry().write_chrome_trace(c.trace);
  if (!c.svg.empty())
    write_svg_timeline(c.svg, rt, rt.telemetry(),
                       "stream_inference: " + std::to_string(m.layers.size()) + " layers, " +
                           format_bytes(m.model_bytes) + ", device budget " +
                           format_bytes(r.device_budget));
  if (c.measure) {
    r.compute_s = median(computes);
    r.transfer_s = median(transfers);
    const strata::Roofline roof =
        assess_roofline(r.compute_s, r.transfer_s, r.step_s, c.max_roofline);
    r.roofline = roof.value;
    r.figures_trusted = roof.trusted;
    r.warning = roof.warning;
  }
  return r;
}

std::string output_checksum(const std::vector<float>& output) {
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08x", crc32c(output.data(), output.size() * sizeof(float)));
  return hex;
}

std::uint64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream in(line.substr(6));
      std::uint64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

}  // namespace strata::examples
