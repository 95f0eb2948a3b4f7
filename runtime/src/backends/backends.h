// Internal: constructors of the concrete backends.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "strata/io/pages.h"
#include "strata/runtime/backend.h"

namespace strata::detail {

std::unique_ptr<Backend> make_host_backend(const BackendOptions& options);
/// Defined by cuda_backend.cpp, or by cuda_unavailable.cpp in a build without CUDA.
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options);
int cuda_device_count_impl(std::string* why) noexcept;
bool cuda_compiled() noexcept;

}  // namespace strata::detail
