#include "strata/scheduler/overlap_metrics.h"

#include <algorithm>
#include <cstdio>

namespace strata {

double checked_roofline(double compute_s, double transfer_s, double step_s, double limit) {
  const double roofline = step_s > 0 ? std::max(compute_s, transfer_s) / step_s : 0;
  if (roofline > limit) {
    char msg[512];
    std::snprintf(msg, sizeof msg,
                  "roofline %.3f = max(compute_s %.6f s, transfer_s %.6f s) / step_s %.6f s is "
                  "above %.2f: the step does both, so neither alone can take longer; one of the "
                  "three was mismeasured and the figures are refused",
                  roofline, compute_s, transfer_s, step_s, limit);
    throw RooflineError(Errc::internal, msg);
  }
  return roofline;
}

}  // namespace strata
