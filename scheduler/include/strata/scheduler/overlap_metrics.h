// The overlap metrics of the design, defined once for every benchmark and example that reports
// them: roofline = max(compute_s, transfer_s) / step_s, the tolerance above which a roofline is
// a measurement error rather than a result, and how many rounds a measurement takes.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "strata/base/tunables.h"

namespace strata {

/// max(compute_s, transfer_s) / step_s above this is a measurement error (DESIGN, Metrics): all
/// three are measured over the same passes from the same tier state, so neither half alone can
/// take longer than the step that does both, beyond noise.
inline constexpr double kMaxRoofline = 1.02;

/// A roofline and whether it can be believed.
struct Roofline {
  double value = 0;     ///< max(compute_s, transfer_s) / step_s (0 when step_s is 0)
  bool trusted = true;  ///< false: above the limit, a measurement error and no result
  /// Empty when trusted; else names the roofline, the three figures and the limit, for stderr and
  /// the JSON's "warning".
  std::string warning;
};

/// The roofline of three figures, judged against `limit`. Never throws: a figure that cannot be
/// trusted is reported as such (Note [Measuring until the figures hold]), not as a failed run.
Roofline assess_roofline(double compute_s, double transfer_s, double step_s,
                         double limit = kMaxRoofline);

// Note [Measuring until the figures hold]
// A benchmark's rounds each time compute alone, transfer alone and the step, and each figure is
// the median of its runs. A fixed count of rounds is no measurement on a small model: three
// passes of a few milliseconds each are within the timer's and the scheduler's noise, and a
// 4-layer model gave a roofline of 1.03 from medians of three. So a measurement runs at least
// `min_rounds` rounds and goes on until the runs of every figure add up to `min_seconds` of wall
// time (at most `max_rounds`, so that it ends): the same statistic (the median) of each, from
// enough runs that noise of one pass moves it little. When the figures still do not hold (the
// roofline above its limit), the run says so (a warning on stderr, "figures_trusted": false and
// the warning in its JSON) and exits 0: the user's run did its work; only its figure is unfit to
// report.
struct MeasureRule {
  int min_rounds = 3;
  double min_seconds = tunables::kMinMeasureSeconds;
  int max_rounds = tunables::kMaxMeasureRounds;

  /// True when `rounds` rounds are enough: at least min_rounds and every series sums to at least
  /// min_seconds, or max_rounds reached.
  bool enough(int rounds, std::initializer_list<const std::vector<double>*> series) const;
};

}  // namespace strata
