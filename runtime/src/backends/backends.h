// Internal: constructors of the concrete backends and the page helpers they share.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "strata/runtime/backend.h"

namespace strata::detail {

std::unique_ptr<Backend> make_host_backend(const BackendOptions& options);
/// Defined by cuda_backend.cpp, or by cuda_unavailable.cpp in a build without CUDA.
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options);
int cuda_device_count_impl(std::string* why) noexcept;
bool cuda_compiled() noexcept;

/// Anonymous, page-aligned mapping of `bytes` (rounded up to pages). Throws OutOfMemoryError
/// naming `tier` when the kernel refuses. `reserve_only` maps without committing swap
/// (MAP_NORESERVE) for an arena that is touched lazily.
void* map_pages(std::size_t bytes, const char* tier, bool reserve_only);
void unmap_pages(void* data, std::size_t bytes) noexcept;
/// mlock()s the range; on refusal (RLIMIT_MEMLOCK) warns once per process and returns false.
bool lock_pages(void* data, std::size_t bytes) noexcept;
std::size_t physical_memory_bytes() noexcept;

}  // namespace strata::detail
