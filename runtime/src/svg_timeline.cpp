#include "strata/runtime/svg_timeline.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "strata/base/error.h"
#include "strata/base/units.h"

namespace strata {

void write_svg_timeline(const std::string& path, const Runtime& runtime, const Telemetry& telemetry,
                        const std::string& title) {
  const auto events = telemetry.events();
  const auto occupancy = telemetry.occupancy_samples();
  std::uint64_t t0 = ~0ULL, t1 = 0;
  for (const auto& e : events) {
    t0 = std::min(t0, e.start_ns);
    t1 = std::max(t1, e.end_ns);
  }
  if (events.empty()) t0 = 0, t1 = 1;
  const double width = 1200, left = 130, lane_h = 26, top = 50;
  // The dequantize lane (Note [Compressed copies]) only when a compressed copy was made.
  const bool dequant = std::any_of(events.begin(), events.end(),
                                   [](const TraceEvent& e) { return e.track == Track::Dequant; });
  const Track lanes[] = {Track::Compute,  Track::H2D,       Track::D2H,
                         Track::NvmeRead, Track::NvmeWrite, Track::Dequant};
  const char* colors[] = {"#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"};
  const int n_lanes = dequant ? 6 : 5;
  const double plot_top = top + n_lanes * lane_h + 40, plot_h = 160;
  const double height = plot_top + plot_h + 60;
  const double span = static_cast<double>(std::max<std::uint64_t>(t1 - t0, 1));
  auto x = [&](std::uint64_t t) {
    return left + (width - left - 20) * static_cast<double>(t - std::min(t, t0)) / span;
  };

  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='" << height
      << "' font-family='sans-serif' font-size='12'>\n"
      << "<rect width='100%' height='100%' fill='white'/>\n"
      << "<text x='10' y='22' font-size='15' font-weight='bold'>" << title << "</text>\n";
  for (int i = 0; i < n_lanes; ++i) {
    const double y = top + i * lane_h;
    svg << "<text x='10' y='" << y + 17 << "'>" << to_string(lanes[i]) << "</text>\n"
        << "<rect x='" << left << "' y='" << y + 2 << "' width='" << width - left - 20
        << "' height='" << lane_h - 4 << "' fill='#f4f4f4'/>\n";
  }
  for (const auto& e : events) {
    int lane = -1;
    for (int i = 0; i < n_lanes; ++i)
      if (lanes[i] == e.track) lane = i;
    if (lane < 0) continue;
    const double x0 = x(e.start_ns), x1 = std::max(x(e.end_ns), x0 + 0.5);
    svg << "<rect x='" << x0 << "' y='" << top + lane * lane_h + 3 << "' width='" << x1 - x0
        << "' height='" << lane_h - 6 << "' fill='" << colors[lane] << "' fill-opacity='"
        << (e.track == Track::NvmeRead || e.track == Track::NvmeWrite ? 0.35 : 0.85) << "'/>\n";
  }
  // Time axis.
  const double axis_y = top + n_lanes * lane_h + 14;
  for (int i = 0; i <= 10; ++i) {
    const double xi = left + (width - left - 20) * i / 10.0;
    char label[32];
    std::snprintf(label, sizeof label, "%.0f ms", span / 1e6 * i / 10.0);
    svg << "<line x1='" << xi << "' y1='" << axis_y - 8 << "' x2='" << xi << "' y2='" << axis_y
        << "' stroke='#999'/><text x='" << xi - 15 << "' y='" << axis_y + 12 << "' fill='#555'>"
        << label << "</text>\n";
  }
  // Occupancy plot, each tier as a fraction of its capacity.
  svg << "<text x='10' y='" << plot_top + 12 << "'>occupancy</text>\n"
      << "<rect x='" << left << "' y='" << plot_top << "' width='" << width - left - 20
      << "' height='" << plot_h << "' fill='none' stroke='#ccc'/>\n";
  const char* tier_colors[] = {"#4c72b0", "#dd8452", "#55a868"};
  int legend = 0;
  for (Tier tier : {Tier::Device, Tier::Host, Tier::Nvme}) {
    const double capacity = static_cast<double>(runtime.tier_stats(tier).capacity_bytes);
    if (capacity <= 0) continue;
    std::ostringstream points;
    double last_y = plot_top + plot_h;
    for (const auto& s : occupancy) {
      if (s.tier != tier || s.time_ns < t0 || s.time_ns > t1) continue;
      const double y = plot_top + plot_h * (1.0 - static_cast<double>(s.used_bytes) / capacity);
      points << x(s.time_ns) << "," << last_y << " " << x(s.time_ns) << "," << y << " ";
      last_y = y;
    }
    points << x(t1) << "," << last_y;
    const int c = static_cast<int>(tier);
    svg << "<polyline fill='none' stroke='" << tier_colors[c] << "' stroke-width='1.5' points='"
        << points.str() << "'/>\n"
        << "<text x='" << left + 10 + legend * 260 << "' y='" << plot_top + plot_h + 20
        << "' fill='" << tier_colors[c] << "'>" << to_string(tier) << " (capacity "
        << format_bytes(static_cast<std::uint64_t>(capacity)) << ")</text>\n";
    ++legend;
  }
  svg << "</svg>\n";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const std::string text = svg.str();
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  if (!out) throw IoError(Errc::io_error, path, 0, text.size(), errno, "write of the SVG");
}

}  // namespace strata
