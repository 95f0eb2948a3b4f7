// Internal: constructors of the concrete I/O engines.
#pragma once

#include <memory>

#include "strata/io/io_engine.h"

namespace strata::detail {

/// @throws strata::Error (unsupported) when the kernel refuses io_uring, with the reason.
std::unique_ptr<IoEngine> make_uring_engine(const IoOptions& options);
std::unique_ptr<IoEngine> make_posix_engine(const IoOptions& options);

}  // namespace strata::detail
