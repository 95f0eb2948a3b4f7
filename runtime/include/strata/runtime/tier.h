// The three memory tiers strata moves tensors between.
#pragma once

#include <cstdint>
#include <string_view>

namespace strata {

/// Tiers, fastest first. Values match the C API's strata_tier.
enum class Tier : std::uint8_t {
  Device = 0,  ///< GPU HBM (CUDA backend) or the budgeted host arena (host backend)
  Host = 1,    ///< page-locked host memory
  Nvme = 2,    ///< extents of files on NVMe drives
};

constexpr std::string_view to_string(Tier tier) noexcept {
  switch (tier) {
    case Tier::Device:
      return "Device";
    case Tier::Host:
      return "Host";
    case Tier::Nvme:
      return "Nvme";
  }
  return "?";
}

}  // namespace strata
