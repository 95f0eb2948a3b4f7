// The overlap metrics of the design, defined once for every benchmark and example that reports
// them: roofline = max(compute_s, transfer_s) / step_s, and the tolerance above which a roofline
// is a measurement error rather than a result.
#pragma once

#include "strata/base/error.h"

namespace strata {

/// max(compute_s, transfer_s) / step_s above this is a measurement error (DESIGN, Metrics): all
/// three are measured over the same passes from the same tier state, so neither half alone can
/// take longer than the step that does both, beyond noise.
inline constexpr double kMaxRoofline = 1.02;

/// A roofline above the limit: the figures are refused, not reported.
class RooflineError : public Error {
 public:
  using Error::Error;
};

/// max(compute_s, transfer_s) / step_s (0 when step_s is 0). Throws RooflineError naming
/// compute_s, transfer_s and step_s when it is above `limit`.
double checked_roofline(double compute_s, double transfer_s, double step_s,
                        double limit = kMaxRoofline);

}  // namespace strata
