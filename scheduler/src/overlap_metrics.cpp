// The roofline and the measuring rule of strata/scheduler/overlap_metrics.h.
#include "strata/scheduler/overlap_metrics.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

namespace strata {

Roofline assess_roofline(double compute_s, double transfer_s, double step_s, double limit) {
  Roofline r;
  r.value = step_s > 0 ? std::max(compute_s, transfer_s) / step_s : 0;
  if (r.value > limit) {
    char msg[512];
    std::snprintf(msg, sizeof msg,
                  "roofline %.3f = max(compute_s %.6f s, transfer_s %.6f s) / step_s %.6f s is "
                  "above %.2f: the step does both, so neither alone can take longer; one of the "
                  "three was mismeasured and the figures cannot be trusted",
                  r.value, compute_s, transfer_s, step_s, limit);
    r.trusted = false;
    r.warning = msg;
  }
  return r;
}

bool MeasureRule::enough(int rounds,
                         std::initializer_list<const std::vector<double>*> series) const {
  if (rounds >= max_rounds) return true;
  if (rounds < min_rounds) return false;
  return std::all_of(series.begin(), series.end(), [&](const std::vector<double>* s) {
    return std::accumulate(s->begin(), s->end(), 0.0) >= min_seconds;
  });
}

}  // namespace strata
