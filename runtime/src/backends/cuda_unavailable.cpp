// Stand-in for the CUDA backend in a build without the CUDA toolkit.
#include "backends.h"
#include "strata/base/error.h"

namespace strata::detail {

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions&) {
  STRATA_FAIL(Errc::unsupported,
              "backend cuda: this strata was built without CUDA (-DSTRATA_CUDA=OFF or no "
              "toolkit found at configure time)");
}

int cuda_device_count_impl(std::string* why) noexcept {
  if (why != nullptr) *why = "built without CUDA";
  return 0;
}

bool cuda_compiled() noexcept {
  return false;
}

}  // namespace strata::detail
