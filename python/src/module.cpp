// strata._core: the nanobind binding of the C++ core. Thin on purpose: the types, the GIL released
// around every call that may block, C++ errors turned into the Python exceptions of
// strata/_errors.py, and leases exported as DLPack arrays that keep their lease alive (Note
// [Arrays keep their lease]). The Pythonic surface (configs, dtypes, context managers) is
// strata/*.py; nothing here is imported by users directly.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "strata/base/error.h"
#include "strata/base/units.h"
#include "strata/io/crc32c.h"
#include "strata/optim/adam.h"
#include "strata/quant/group_quant.h"
#include "strata/runtime/runtime.h"
#include "strata/runtime/safetensors.h"
#include "strata/runtime/telemetry.h"
#include "strata/scheduler/prefetch_pipeline.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using strata::Access;
using strata::DType;
using strata::Tier;

// Note [Arrays keep their lease]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A lease's bytes may be used only while the lease lives: after it ends the copy may be evicted,
// moved by compaction or rewritten. The Python Lease and every array exported from it share one
// LeaseBox; the C++ lease ends when the last of them is gone. Leaving a `with` block (or
// release()) drops the Python Lease's share only, so an array that outlives the block still
// reads the right bytes, and its tensor is not evicted while it lives.
struct LeaseBox {
  strata::Lease lease;
  DType dtype = DType::U8;
  std::vector<std::int64_t> shape;
  bool device_is_cuda = false;  // the lease is on a CUDA device tier
  int device_ordinal = 0;
  strata::Backend* backend = nullptr;  // the runtime's, which outlives its leases
};

nb::dlpack::dtype dlpack_dtype(DType d) {
  using nb::dlpack::dtype_code;
  const auto make = [](dtype_code code, int bits) {
    return nb::dlpack::dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
  };
  switch (d) {
    case DType::F32:
      return make(dtype_code::Float, 32);
    case DType::F16:
      return make(dtype_code::Float, 16);
    case DType::BF16:
      return make(dtype_code::Bfloat, 16);
    case DType::F64:
      return make(dtype_code::Float, 64);
    case DType::I64:
      return make(dtype_code::Int, 64);
    case DType::I32:
      return make(dtype_code::Int, 32);
    case DType::I16:
      return make(dtype_code::Int, 16);
    case DType::I8:
      return make(dtype_code::Int, 8);
    case DType::U8:
      return make(dtype_code::UInt, 8);
    case DType::Bool:
      return make(dtype_code::Bool, 8);
  }
  return make(dtype_code::UInt, 8);
}

// Note [DLPack and streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A device lease may be handed out while the copy that brings its bytes is still running on a
// strata stream (Lease::event()). DLPack's `stream` says where the consumer will use the array:
// on the CUDA device tier that stream is made to wait for the copy's event (cudaStreamWaitEvent;
// the host does not block), None means the legacy default stream (1), -1 that the consumer
// synchronises itself. Every other export (host tier, host backend) is waited for on the host,
// with the GIL released, before it is handed out.
int dlpack_device_type(const LeaseBox& box) {
  if (!box.device_is_cuda) return nb::device::cpu::value;
  return box.lease.tier() == Tier::Device ? nb::device::cuda::value : nb::device::cuda_host::value;
}

// Makes the bytes ready for `stream` (Note [DLPack and streams]); nullopt: for the host.
void make_ready(const LeaseBox& box, std::optional<std::intptr_t> stream) {
  if (!box.lease) throw strata::Error(strata::Errc::invalid_argument, "the lease has ended");
  if (dlpack_device_type(box) == nb::device::cuda::value && stream) {
    if (*stream == 0)
      throw strata::Error(strata::Errc::invalid_argument,
                          "DLPack stream 0 is ambiguous: pass 1 (legacy default), 2 (per-thread "
                          "default), a stream handle, or -1 (no synchronization)");
    if (*stream != -1 && box.lease.event() != nullptr)
      box.backend->wait_on_foreign_stream(*box.lease.event(), static_cast<std::uintptr_t>(*stream));
    return;
  }
  nb::gil_scoped_release unlocked;
  box.lease.wait();
}

// The array a lease exports: its bytes, dtype and shape, on its tier's device, owning a share of
// the lease (Note [Arrays keep their lease]). Does not wait: make_ready() does.
nb::ndarray<nb::array_api> lease_array(const std::shared_ptr<LeaseBox>& box) {
  if (!box->lease) throw strata::Error(strata::Errc::invalid_argument, "the lease has ended");
  std::vector<std::size_t> shape(box->shape.begin(), box->shape.end());
  if (shape.empty() && box->lease.bytes() != strata::dtype_bytes(box->dtype))
    shape.push_back(box->lease.bytes() / strata::dtype_bytes(box->dtype));
  const int device_type = dlpack_device_type(*box);
  const int device_id = device_type == nb::device::cuda::value ? box->device_ordinal : 0;
  auto* share = new std::shared_ptr<LeaseBox>(box);
  nb::capsule owner(share,
                    [](void* p) noexcept { delete static_cast<std::shared_ptr<LeaseBox>*>(p); });
  return nb::ndarray<nb::array_api>(box->lease.data(), shape.size(), shape.data(), owner,
                                    /*strides=*/nullptr, dlpack_dtype(box->dtype), device_type,
                                    device_id);
}

// Bytes of any C-contiguous array (DLPack or buffer protocol, converted by nanobind).
using AnyArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

std::size_t array_bytes(const AnyArray& a) {
  return a.nbytes();
}

// Note [Errors in Python]: each strata error becomes the matching class of strata._errors, with
// the C++ message; IoError carries errno and path, OutOfMemoryError the numbers.
void translate(const std::exception_ptr& p, void*) {
  nb::module_ errors = nb::module_::import_("strata._errors");
  const auto raise = [&](const char* cls, const std::string& message, nb::dict extra) {
    nb::object type = errors.attr(cls);
    nb::object err = type(message);
    for (auto [k, v] : extra)
      nb::setattr(err, nb::borrow<nb::str>(k).c_str(), nb::borrow(v));
    PyErr_SetObject(type.ptr(), err.ptr());
  };
  try {
    std::rethrow_exception(p);
  } catch (const strata::OutOfMemoryError& e) {
    nb::dict extra;
    extra["tier"] = e.tier();
    extra["requested_bytes"] = e.requested_bytes();
    extra["free_bytes"] = e.free_bytes();
    extra["largest_free_bytes"] = e.largest_free_bytes();
    raise("OutOfMemoryError", e.what(), extra);
  } catch (const strata::IoError& e) {
    nb::dict extra;
    extra["errno"] = e.error_number();
    extra["path"] = e.path();
    extra["offset"] = e.offset();
    raise(e.code() == strata::Errc::corrupt_data ? "CorruptDataError" : "IoError", e.what(), extra);
  } catch (const strata::Error& e) {
    const char* cls = "Error";
    switch (e.code()) {
      case strata::Errc::invalid_argument:
        cls = "InvalidArgumentError";
        break;
      case strata::Errc::out_of_memory:
        cls = "OutOfMemoryError";
        break;
      case strata::Errc::io_error:
        cls = "IoError";
        break;
      case strata::Errc::corrupt_data:
        cls = "CorruptDataError";
        break;
      case strata::Errc::unsupported:
        cls = "UnsupportedError";
        break;
      case strata::Errc::not_found:
        cls = "NotFoundError";
        break;
      case strata::Errc::cuda_error:
      case strata::Errc::internal:
        break;
    }
    raise(cls, e.what(), nb::dict());
  }
}

// A lease handed to Python: a box shared with the arrays exported from it.
struct PyLease {
  std::shared_ptr<LeaseBox> box;
};

PyLease boxed(strata::Runtime& rt, strata::Lease lease, strata::TensorId id) {
  auto box = std::make_shared<LeaseBox>();
  box->lease = std::move(lease);
  const strata::TensorDesc d = rt.describe(id);
  box->dtype = d.dtype;
  box->shape = d.shape;
  box->device_is_cuda = rt.backend().kind() == strata::BackendKind::Cuda;
  box->device_ordinal = rt.options().backend.device_ordinal;
  box->backend = &rt.backend();
  return PyLease{std::move(box)};
}

// Runtime::acquire's future: result() waits without the GIL.
struct PyLeaseFuture {
  strata::Runtime* rt = nullptr;
  strata::TensorId id = 0;
  strata::LeaseFuture future;
};

// The prefetch pipeline and the step it has open (one at a time, as in C++).
struct PyPipeline {
  strata::Runtime* rt = nullptr;
  std::unique_ptr<strata::PrefetchPipeline> pipeline;
  std::optional<strata::StepLeases> open;
};

strata::PrefetchMode parse_mode(const std::string& mode) {
  if (mode == "auto") return strata::PrefetchMode::Auto;
  if (mode == "none") return strata::PrefetchMode::None;
  if (mode == "fixed") return strata::PrefetchMode::Fixed;
  throw strata::Error(strata::Errc::invalid_argument,
                      "prefetch: \"" + mode + "\" is not one of auto, none, fixed");
}

// "none", "int8" or "int4" and a group size: a descriptor's compression (Note [Compressed copies]).
strata::Compression compression(const std::string& codec, std::uint32_t group) {
  if (codec == "none") return {strata::Codec::None, group};
  return {strata::quant::codec_of(strata::quant::parse_bits(codec, "compress")), group};
}

// Adam's arrays: C-contiguous CPU arrays of any dtype, checked here by name.
DType array_dtype(const AnyArray& a, const char* what) {
  const nb::dlpack::dtype d = a.dtype();
  if (d == nb::dtype<float>()) return DType::F32;
  if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && d.bits == 16)
    return DType::BF16;
  if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 16)
    return DType::F16;
  throw strata::Error(strata::Errc::invalid_argument,
                      strata::detail::concat(what, " must be float32, bfloat16 or float16 (code ",
                                             int(d.code), ", ", int(d.bits), " bits)"));
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "strata's C++ core (the binding); use the `strata` package.";
  nb::register_exception_translator(translate);
  m.def(
      "parse_bytes",
      [](const std::string& text, const std::string& what) {
        return strata::parse_bytes(text, what);
      },
      "text"_a, "what"_a = "size",
      "A size in bytes from a number or a string with a unit (\"64KiB\", \"2GiB\"), as the "
      "config reads them; InvalidArgumentError naming `what` otherwise.");

  nb::enum_<Tier>(m, "Tier", "A tier of memory: DEVICE (GPU or its stand-in), HOST (pinned), NVME.")
      .value("DEVICE", Tier::Device)
      .value("HOST", Tier::Host)
      .value("NVME", Tier::Nvme);
  nb::enum_<Access>(m, "Access",
                    "How a lease uses the bytes: READ, WRITE (write-discard: the old bytes are "
                    "not brought), READ_WRITE.")
      .value("READ", Access::Read)
      .value("WRITE", Access::Write)
      .value("READ_WRITE", Access::ReadWrite);

  nb::class_<LeaseBox>(m, "LeaseBox");  // opaque; held through shared_ptr below

  nb::class_<PyLease>(m, "Lease")
      .def_prop_ro("data_ptr",
                   [](const PyLease& l) {
                     if (!l.box)
                       throw strata::Error(strata::Errc::invalid_argument, "the lease has ended");
                     return reinterpret_cast<std::uintptr_t>(l.box->lease.data());
                   })
      .def_prop_ro("nbytes", [](const PyLease& l) { return l.box ? l.box->lease.bytes() : 0; })
      .def_prop_ro("tier", [](const PyLease& l) { return l.box->lease.tier(); })
      .def_prop_ro("access", [](const PyLease& l) { return l.box->lease.access(); })
      .def_prop_ro("active", [](const PyLease& l) { return l.box != nullptr; })
      .def("array",
           [](const PyLease& l) {
             if (!l.box) throw strata::Error(strata::Errc::invalid_argument, "the lease has ended");
             return lease_array(l.box);
           })
      .def(
          "make_ready",
          [](const PyLease& l, std::optional<std::intptr_t> stream) {
            if (!l.box) throw strata::Error(strata::Errc::invalid_argument, "the lease has ended");
            make_ready(*l.box, stream);
          },
          "stream"_a.none())
      .def("dlpack_device",
           [](const PyLease& l) {
             if (!l.box) throw strata::Error(strata::Errc::invalid_argument, "the lease has ended");
             const int type = dlpack_device_type(*l.box);
             return std::pair<int, int>(
                 type, type == nb::device::cuda::value ? l.box->device_ordinal : 0);
           })
      .def("release", [](PyLease& l) { l.box.reset(); });

  nb::class_<PyLeaseFuture>(m, "LeaseFuture")
      .def("done", [](const PyLeaseFuture& f) { return f.future.valid() && f.future.ready(); })
      .def("result", [](PyLeaseFuture& f) {
        if (!f.future.valid())
          throw strata::Error(strata::Errc::invalid_argument, "result(): already taken");
        nb::gil_scoped_release unlocked;
        strata::Lease lease = f.future.get();
        return boxed(*f.rt, std::move(lease), f.id);
      });

  nb::class_<strata::Runtime>(m, "Runtime")
      .def("__init__",
           [](strata::Runtime* self, const std::string& json) {
             auto options = strata::RuntimeOptions::from_json(json);
             nb::gil_scoped_release unlocked;
             new (self) strata::Runtime(std::move(options));
           })
      .def(
          "create_tensor",
          [](strata::Runtime& rt, const std::string& name, std::vector<std::int64_t> shape,
             const std::string& dtype, Tier home, nb::object init, const std::string& compress,
             std::uint32_t group) {
            strata::TensorDesc d;
            d.name = name;
            d.shape = std::move(shape);
            d.dtype = strata::parse_dtype(dtype);
            d.compression = compression(compress, group);
            std::uint64_t n = 1;
            for (std::int64_t s : d.shape) {
              if (s < 0)
                throw strata::Error(strata::Errc::invalid_argument,
                                    "create_tensor \"" + name + "\": negative dimension");
              n *= static_cast<std::uint64_t>(s);
            }
            d.bytes = n * strata::dtype_bytes(d.dtype);
            if (init.is_none()) {
              nb::gil_scoped_release unlocked;
              return rt.create_tensor(d, home);
            }
            const AnyArray a = nb::cast<AnyArray>(init);
            if (array_bytes(a) != d.bytes)
              throw strata::Error(
                  strata::Errc::invalid_argument,
                  strata::detail::concat("create_tensor \"", name, "\": init has ", array_bytes(a),
                                         " bytes, the tensor ", d.bytes));
            const void* src = a.data();
            nb::gil_scoped_release unlocked;
            return rt.create_tensor(d, home, src);
          },
          "name"_a, "shape"_a, "dtype"_a, "home"_a, "init"_a.none(), "compress"_a = "none",
          "group"_a = 64)
      .def(
          "create_unwritten",
          [](strata::Runtime& rt, const std::string& name, std::vector<std::int64_t> shape,
             const std::string& dtype, Tier home) {
            strata::TensorDesc d;
            d.name = name;
            d.shape = std::move(shape);
            d.dtype = strata::parse_dtype(dtype);
            nb::gil_scoped_release unlocked;
            return rt.create_unwritten(d, home);
          },
          "name"_a, "shape"_a, "dtype"_a, "home"_a)
      .def(
          "map_tensor",
          [](strata::Runtime& rt, const std::string& name, std::vector<std::int64_t> shape,
             const std::string& dtype, const std::string& path, std::uint64_t offset,
             const std::string& compress, std::uint32_t group) {
            strata::TensorDesc d;
            d.name = name;
            d.shape = std::move(shape);
            d.dtype = strata::parse_dtype(dtype);
            d.compression = compression(compress, group);
            nb::gil_scoped_release unlocked;
            return rt.map_tensor(d, path, offset);
          },
          "name"_a, "shape"_a, "dtype"_a, "path"_a, "offset"_a, "compress"_a = "none",
          "group"_a = 64)
      .def("describe",
           [](const strata::Runtime& rt, strata::TensorId id) {
             const strata::TensorDesc d = rt.describe(id);
             return nb::make_tuple(d.name, d.shape, std::string(strata::to_string(d.dtype)),
                                   d.bytes);
           })
      .def("acquire",
           [](strata::Runtime& rt, strata::TensorId id, Tier tier, Access access) {
             nb::gil_scoped_release unlocked;
             strata::Lease lease = rt.acquire(id, tier, access).get();
             return boxed(rt, std::move(lease), id);
           })
      .def(
          "acquire_async",
          [](strata::Runtime& rt, strata::TensorId id, Tier tier, Access access) {
            PyLeaseFuture f{&rt, id, {}};
            {
              nb::gil_scoped_release unlocked;
              f.future = rt.acquire(id, tier, access);
            }
            return f;
          },
          nb::keep_alive<0, 1>())
      .def("prefetch",
           [](strata::Runtime& rt, strata::TensorId id, Tier tier) {
             nb::gil_scoped_release unlocked;
             rt.prefetch(id, tier);
           })
      .def("evict",
           [](strata::Runtime& rt, strata::TensorId id, Tier tier) {
             nb::gil_scoped_release unlocked;
             return rt.evict(id, tier);
           })
      .def("resident", &strata::Runtime::resident)
      .def("synchronize",
           [](strata::Runtime& rt) {
             nb::gil_scoped_release unlocked;
             rt.synchronize();
           })
      .def("read_into",
           [](strata::Runtime& rt, strata::TensorId id,
              nb::ndarray<nb::c_contig, nb::device::cpu> out) {
             void* dst = out.data();
             const std::size_t bytes = out.nbytes();
             nb::gil_scoped_release unlocked;
             rt.read(id, dst, bytes);
           })
      .def("write",
           [](strata::Runtime& rt, strata::TensorId id, const AnyArray& src) {
             const void* p = src.data();
             const std::size_t bytes = src.nbytes();
             nb::gil_scoped_release unlocked;
             rt.write(id, p, bytes);
           })
      .def("destroy",
           [](strata::Runtime& rt, strata::TensorId id) {
             nb::gil_scoped_release unlocked;
             rt.destroy_tensor(id);
           })
      .def("tier_bytes",
           [](const strata::Runtime& rt, Tier tier) {
             const strata::TierStats s = rt.tier_stats(tier);
             return std::make_tuple(s.capacity_bytes, s.used_bytes, s.leased_bytes);
           })
      .def("stats_json", &strata::Runtime::stats_json)
      .def("residency_json", &strata::Runtime::residency_json)
      .def("export_trace",
           [](strata::Runtime& rt, const std::string& path) {
             nb::gil_scoped_release unlocked;
             rt.telemetry().write_chrome_trace(path);
           })
      .def("map_safetensors", [](strata::Runtime& rt, const std::string& path) {
        std::vector<std::pair<std::string, strata::TensorId>> out;
        {
          nb::gil_scoped_release unlocked;
          for (const auto& [name, id] :
               strata::safetensors::map_file(rt, path, strata::safetensors::read_header(path)))
            out.emplace_back(name, id);
        }
        nb::list l;
        for (auto& [name, id] : out)
          l.append(nb::make_tuple(name, id));
        return l;
      });

  nb::class_<PyPipeline>(m, "PrefetchPipeline")
      .def(
          "__init__",
          [](PyPipeline* self, strata::Runtime& rt, const std::string& prefetch,
             std::size_t fixed_lookahead, bool write_back, bool across_iterations,
             bool arrival_in_pieces, double budget_fraction, std::uint64_t device_reserve,
             std::uint64_t host_reserve) {
            strata::PipelineOptions o;
            o.prefetch = parse_mode(prefetch);
            o.fixed_lookahead = fixed_lookahead;
            o.write_back = write_back;
            o.across_iterations = across_iterations;
            o.arrival_in_pieces = arrival_in_pieces;
            o.budget_fraction = budget_fraction;
            o.device_reserve_bytes = device_reserve;
            o.host_reserve_bytes = host_reserve;
            new (self) PyPipeline{&rt, std::make_unique<strata::PrefetchPipeline>(rt, o), {}};
          },
          nb::keep_alive<1, 2>(), "runtime"_a, "prefetch"_a = "auto", "fixed_lookahead"_a = 2,
          "write_back"_a = true, "across_iterations"_a = true, "arrival_in_pieces"_a = true,
          "budget_fraction"_a = 1.0, "device_reserve"_a = 0, "host_reserve"_a = 0)
      .def("begin_iteration",
           [](PyPipeline& p) {
             nb::gil_scoped_release unlocked;
             p.pipeline->begin_iteration();
           })
      .def("end_iteration",
           [](PyPipeline& p) {
             nb::gil_scoped_release unlocked;
             p.pipeline->end_iteration();
           })
      .def("begin_step",
           [](PyPipeline& p, const std::string& name,
              const std::vector<std::tuple<strata::TensorId, Tier, Access>>& uses) {
             if (p.open)
               throw strata::Error(strata::Errc::invalid_argument,
                                   "begin_step \"" + name + "\": the previous step has not ended");
             std::vector<strata::TensorUse> u;
             for (const auto& [id, tier, access] : uses)
               u.push_back({id, access, tier});
             std::vector<PyLease> out;
             {
               nb::gil_scoped_release unlocked;
               p.open = p.pipeline->begin_step(name, u);
               for (std::size_t i = 0; i < p.open->size(); ++i)
                 out.push_back(boxed(*p.rt, std::move((*p.open)[i]), u[i].tensor));
             }
             nb::list l;
             for (auto& lease : out)
               l.append(nb::cast(std::move(lease)));
             return l;
           })
      .def("end_step",
           [](PyPipeline& p) {
             if (!p.open) return;
             strata::StepLeases leases = std::move(*p.open);
             p.open.reset();
             nb::gil_scoped_release unlocked;
             p.pipeline->end_step(std::move(leases));
           })
      .def("drain",
           [](PyPipeline& p) {
             nb::gil_scoped_release unlocked;
             p.pipeline->drain();
           })
      .def("stats", [](const PyPipeline& p) {
        const strata::PipelineStats s = p.pipeline->stats();
        nb::dict d;
        // Every field of strata::PipelineStats, by its C++ name.
        d["steps"] = s.steps;
        d["divergences"] = s.divergences;
        d["resyncs"] = s.resyncs;
        d["on_demand"] = s.on_demand;
        d["prefetches"] = s.prefetches;
        d["host_prefetches"] = s.host_prefetches;
        d["arrivals_in_pieces"] = s.arrivals_in_pieces;
        d["ready_at_begin"] = s.ready_at_begin;
        d["inputs"] = s.inputs;
        d["write_backs"] = s.write_backs;
        d["discards"] = s.discards;
        d["deferred"] = s.deferred;
        d["prefetch_failures"] = s.prefetch_failures;
        d["max_window_bytes"] = s.max_window_bytes;
        d["max_host_window_bytes"] = s.max_host_window_bytes;
        d["max_lookahead_steps"] = s.max_lookahead_steps;
        d["max_host_lookahead_steps"] = s.max_host_lookahead_steps;
        d["measured_gbps"] = s.measured_gbps;
        d["compute_s_per_step"] = s.compute_s_per_step;
        d["needed_lookahead_steps"] = s.needed_lookahead_steps;
        return d;
      });

  nb::module_ optim = m.def_submodule("optim", "The CPU Adam of strata::optim.");
  optim.def(
      "adam_step",
      [](AnyArray params, AnyArray grads, AnyArray exp_avg, AnyArray exp_avg_sq, std::uint64_t step,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
         std::optional<AnyArray> param_copy) {
        const std::size_t n = params.size();
        for (auto [a, what] : {std::pair{&grads, "grads"}, std::pair{&exp_avg, "exp_avg"},
                               std::pair{&exp_avg_sq, "exp_avg_sq"}})
          if (a->size() != n)
            throw strata::Error(strata::Errc::invalid_argument,
                                strata::detail::concat("adam_step: ", what, " has ", a->size(),
                                                       " elements, params ", n));
        const DType param_dtype = array_dtype(params, "adam_step: params");
        const DType state_dtype = array_dtype(exp_avg, "adam_step: exp_avg");
        if (array_dtype(exp_avg_sq, "adam_step: exp_avg_sq") != state_dtype)
          throw strata::Error(strata::Errc::invalid_argument,
                              "adam_step: exp_avg and exp_avg_sq must have one dtype");
        const strata::optim::AdamConfig c{lr, beta1, beta2, eps, weight_decay, adamw};
        if (param_dtype != DType::F32) {  // 16-bit params, no master copy
          if (param_copy)
            throw strata::Error(strata::Errc::invalid_argument,
                                "adam_step: param_copy goes with float32 params (the master "
                                "copy); these params are 16-bit and are updated in place");
          strata::optim::Adam16Args args;
          args.params = params.data();
          args.param_dtype = param_dtype;
          args.exp_avg = exp_avg.data();
          args.exp_avg_sq = exp_avg_sq.data();
          args.state_dtype = state_dtype;
          args.grads = grads.data();
          args.grad_dtype = array_dtype(grads, "adam_step: grads");
          args.count = n;
          args.step = step;
          nb::gil_scoped_release unlocked;
          strata::optim::adam_step(c, args);
          return;
        }
        if (state_dtype != DType::F32)
          throw strata::Error(strata::Errc::invalid_argument,
                              "adam_step: float32 params take float32 exp_avg and exp_avg_sq");
        strata::optim::AdamArgs args;
        args.params = static_cast<float*>(params.data());
        args.exp_avg = static_cast<float*>(exp_avg.data());
        args.exp_avg_sq = static_cast<float*>(exp_avg_sq.data());
        args.grads = grads.data();
        args.grad_dtype = array_dtype(grads, "adam_step: grads");
        args.count = n;
        args.step = step;
        if (param_copy) {
          args.copy_dtype = array_dtype(*param_copy, "adam_step: param_copy");
          if (args.copy_dtype == DType::F32 || param_copy->size() != n)
            throw strata::Error(strata::Errc::invalid_argument,
                                "adam_step: param_copy must be bfloat16 or float16, one per param");
          args.param_copy = param_copy->data();
        }
        nb::gil_scoped_release unlocked;
        strata::optim::adam_step(c, args);
      },
      "params"_a, "grads"_a, "exp_avg"_a, "exp_avg_sq"_a, "step"_a, "lr"_a, "beta1"_a, "beta2"_a,
      "eps"_a, "weight_decay"_a, "adamw"_a, "param_copy"_a.none());

  nb::module_ quant = m.def_submodule(
      "quant", "Group-wise int8/int4 quantization of strata::quant (Note [Compressed copies]).");
  quant.def(
      "layout",
      [](std::vector<std::int64_t> shape, const std::string& bits, std::uint32_t group) {
        const auto l = strata::quant::layout({strata::quant::parse_bits(bits, "bits"), group},
                                             std::span<const std::int64_t>(shape));
        nb::dict d;
        d["rows"] = l.rows;
        d["cols"] = l.cols;
        d["groups_per_row"] = l.groups_per_row;
        d["row_code_bytes"] = l.row_code_bytes;
        d["row_stride"] = l.row_stride;
        d["bytes"] = l.bytes;
        return d;
      },
      "shape"_a, "bits"_a, "group"_a);
  quant.def(
      "quantize",
      [](AnyArray src, AnyArray out, const std::string& bits, std::uint32_t group,
         const std::string& name) {
        const strata::quant::Scheme scheme{strata::quant::parse_bits(bits, "bits"), group};
        std::vector<std::int64_t> shape(src.ndim());
        for (std::size_t i = 0; i < src.ndim(); ++i)
          shape[i] = src.shape(i);
        const auto l = strata::quant::layout(scheme, std::span<const std::int64_t>(shape));
        const DType dtype = array_dtype(src, ("quantize: tensor '" + name + "'").c_str());
        if (array_bytes(out) != l.bytes)
          throw strata::Error(strata::Errc::invalid_argument,
                              strata::detail::concat("quantize: out has ", array_bytes(out),
                                                     " bytes, the compressed copy ", l.bytes));
        nb::gil_scoped_release unlocked;
        strata::quant::quantize(scheme, l, dtype, src.data(), out.data(), name);
      },
      "src"_a, "out"_a, "bits"_a, "group"_a, "name"_a);
  quant.def(
      "dequantize",
      [](AnyArray packed, std::vector<std::int64_t> shape, const std::string& bits,
         std::uint32_t group, AnyArray out, const std::string& isa) {
        const strata::quant::Scheme scheme{strata::quant::parse_bits(bits, "bits"), group};
        const auto l = strata::quant::layout(scheme, std::span<const std::int64_t>(shape));
        const DType dtype = array_dtype(out, "dequantize: out");
        if (array_bytes(packed) != l.bytes || out.size() != l.rows * l.cols)
          throw strata::Error(
              strata::Errc::invalid_argument,
              strata::detail::concat("dequantize: ", array_bytes(packed), " bytes into ",
                                     out.size(), " elements; the shape needs ", l.bytes,
                                     " bytes and ", l.rows * l.cols, " elements"));
        strata::quant::Isa v = strata::quant::native_isa();
        if (isa == "avx512f")
          v = strata::quant::Isa::avx512f;
        else if (isa == "avx2")
          v = strata::quant::Isa::avx2;
        else if (isa == "baseline")
          v = strata::quant::Isa::baseline;
        else if (isa != "native")
          throw strata::Error(
              strata::Errc::invalid_argument,
              "dequantize: isa \"" + isa + "\" is not one of native, avx512f, avx2, baseline");
        nb::gil_scoped_release unlocked;
        strata::quant::dequantize(scheme.bits, l, packed.data(), dtype, out.data(), 0, l.rows, v);
      },
      "packed"_a, "shape"_a, "bits"_a, "group"_a, "out"_a, "isa"_a = "native");
  quant.def("supports", [](const std::string& isa) {
    for (auto v :
         {strata::quant::Isa::avx512f, strata::quant::Isa::avx2, strata::quant::Isa::baseline})
      if (strata::quant::to_string(v) == isa) return strata::quant::supports(v);
    return false;
  });
  quant.def(
      "crc32c",
      [](AnyArray data, std::uint32_t crc) {
        const void* p = data.data();
        const std::size_t n = array_bytes(data);
        nb::gil_scoped_release unlocked;
        return strata::crc32c(p, n, crc);
      },
      "data"_a, "crc"_a = 0, "CRC32C of an array's bytes (continuing from `crc`).");
  quant.def("native_isa",
            [] { return std::string(strata::quant::to_string(strata::quant::native_isa())); });
}
