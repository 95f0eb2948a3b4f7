#include "strata/runtime/backend.h"

#include <cstdio>
#include <mutex>

#include "backends/backends.h"
#include "strata/base/error.h"
#include "strata/base/tunables.h"
#include "strata/runtime/tier.h"

namespace strata {

void Stream::dequantize_async(void* dst, const void* src, std::size_t src_bytes,
                              const DequantJob& job) {
  (void)dst, (void)src, (void)src_bytes, (void)job;
  STRATA_FAIL(Errc::unsupported, "stream ", name(),
              ": this backend cannot dequantize a compressed tensor's device copy");
}

std::string_view to_string(BackendKind kind) noexcept {
  switch (kind) {
    case BackendKind::Auto:
      return "auto";
    case BackendKind::Host:
      return "host";
    case BackendKind::Cuda:
      return "cuda";
  }
  return "?";
}

BackendKind parse_backend_kind(std::string_view text, std::string_view key) {
  if (text == "auto") return BackendKind::Auto;
  if (text == "host") return BackendKind::Host;
  if (text == "cuda") return BackendKind::Cuda;
  STRATA_FAIL(Errc::invalid_argument, key, ": unknown backend \"", text,
              "\" (expected auto, host or cuda)");
}

Backend::~Backend() = default;

void Backend::wait_on_foreign_stream(Event& event, std::uintptr_t /*stream*/) {
  event.synchronize();
}

void Backend::start(void* device_base, std::size_t budget_bytes) {
  device_pool_ = std::make_unique<MemoryPool>(std::string(to_string(Tier::Device)), device_base,
                                              budget_bytes, tunables::kDeviceAlignment);
  h2d_ = create_stream("h2d");
  d2h_ = create_stream("d2h");
  compute_ = create_stream("compute");
}

void Backend::stop() noexcept {
  compute_.reset();
  d2h_.reset();
  h2d_.reset();
}

void* Backend::allocate_device(std::size_t bytes, std::size_t alignment) {
  return device_pool_->allocate(bytes, alignment);
}

void Backend::deallocate_device(void* ptr) {
  device_pool_->deallocate(ptr);
}

bool cuda_backend_compiled() noexcept {
  return detail::cuda_compiled();
}

int cuda_device_count(std::string* why) noexcept {
  return detail::cuda_device_count_impl(why);
}

std::unique_ptr<Backend> make_backend(const BackendOptions& options) {
  STRATA_EXPECTS(options.link_gbps >= 0.0, "link_gbps: must be >= 0, got ", options.link_gbps);
  STRATA_EXPECTS(options.device_ordinal >= 0, "device_ordinal: must be >= 0, got ",
                 options.device_ordinal);
  if (options.kind == BackendKind::Host) return detail::make_host_backend(options);
  if (options.kind == BackendKind::Cuda) return detail::make_cuda_backend(options);

  std::string why;
  const bool use_cuda = detail::cuda_device_count_impl(&why) > options.device_ordinal;
  static std::once_flag said;
  if (!options.quiet) {
    std::call_once(said, [&] {
      if (use_cuda)
        std::fprintf(stderr, "strata: backend auto -> cuda (device %d)\n", options.device_ordinal);
      else
        std::fprintf(stderr, "strata: backend auto -> host (%s)\n",
                     why.empty() ? "no such CUDA device" : why.c_str());
    });
  }
  return use_cuda ? detail::make_cuda_backend(options) : detail::make_host_backend(options);
}

}  // namespace strata
