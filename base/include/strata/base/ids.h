// The ids every layer passes around: a tensor's (the runtime's table) and an extent's (the
// swap space's). Plain integers; 0 is never a valid id.
#pragma once

#include <cstdint>

namespace strata {

/// Identifies a tensor of a Runtime.
using TensorId = std::uint64_t;
/// Identifies an extent of a SwapSpace.
using ExtentId = std::uint64_t;

}  // namespace strata
