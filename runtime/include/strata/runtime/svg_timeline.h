// Draws a telemetry recording as an SVG timeline: one lane each for compute, host-to-device,
// device-to-host, NVMe read and NVMe write, and each tier's occupancy over time.
#pragma once

#include <string>

#include "strata/runtime/runtime.h"
#include "strata/runtime/telemetry.h"

namespace strata {

/// Writes the SVG to `path`; throws IoError naming the path.
void write_svg_timeline(const std::string& path, const Runtime& runtime, const Telemetry& telemetry,
                        const std::string& title);

}  // namespace strata
