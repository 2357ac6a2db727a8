#include "cli/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "core/check.h"

namespace dstrain {

namespace {

// Geometry of every chart (SVG user units, which the report shows as CSS pixels).
constexpr double kWidth = 560.0;
constexpr double kPlotLeft = 72.0;
constexpr double kPlotRight = 544.0;
constexpr double kPlotTop = 40.0;
constexpr double kPlotBottom = 250.0;
constexpr double kLegendTop = 304.0;  // the first legend row's baseline
constexpr double kLegendRow = 16.0;
constexpr double kCharWidth = 6.2;  // an 11px sans-serif character, for the legend layout

// v's coordinate: domain [d0, d1] onto range [r0, r1].
struct LinearMap {
  double d0, d1, r0, r1;
  double operator()(double v) const { return r0 + (v - d0) / (d1 - d0) * (r1 - r0); }
};

// "%.2f" without a locale: the coordinates of paths, lines and rects.
std::string coord(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", v);
  return text;
}

// Exact doubles for the data-*-domain attributes.
std::string exact(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

std::string value_text(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.4g", v);
  return text;
}

struct LegendEntry {
  std::string label, color;
  enum class Swatch { Line, DashedLine, DottedLine, Box } swatch = Swatch::Line;
};

double legend_entry_width(const LegendEntry& entry) {
  return 28.0 + kCharWidth * static_cast<double>(entry.label.size()) + 14.0;
}

// Rows the legend takes within the plot's width.
std::vector<std::vector<const LegendEntry*>> legend_rows(const std::vector<LegendEntry>& entries) {
  std::vector<std::vector<const LegendEntry*>> rows(1);
  double x = kPlotLeft;
  for (const LegendEntry& entry : entries) {
    const double width = legend_entry_width(entry);
    if (x + width > kPlotRight && !rows.back().empty()) {
      rows.emplace_back();
      x = kPlotLeft;
    }
    rows.back().push_back(&entry);
    x += width;
  }
  return rows;
}

double chart_height(const std::vector<LegendEntry>& legend) {
  return kLegendTop + kLegendRow * static_cast<double>(legend_rows(legend).size()) - 4.0;
}

void write_legend(std::ostream& svg, const std::vector<LegendEntry>& entries) {
  double y = kLegendTop;
  for (const auto& row : legend_rows(entries)) {
    double x = kPlotLeft;
    for (const LegendEntry* entry : row) {
      const std::string color = escape_xml(entry->color);
      if (entry->swatch == LegendEntry::Swatch::Box) {
        svg << "<rect x=\"" << coord(x + 4) << "\" y=\"" << coord(y - 9) << "\" width=\"14\" "
            << "height=\"10\" fill=\"" << color << "\"/>";
      } else {
        const char* dash =
            entry->swatch == LegendEntry::Swatch::DashedLine   ? " stroke-dasharray=\"6 3\""
            : entry->swatch == LegendEntry::Swatch::DottedLine ? " stroke-dasharray=\"2 3\""
                                                               : "";
        svg << "<line x1=\"" << coord(x) << "\" y1=\"" << coord(y - 4) << "\" x2=\""
            << coord(x + 22) << "\" y2=\"" << coord(y - 4) << "\" stroke=\"" << color
            << "\" stroke-width=\"2\"" << dash << "/>";
      }
      svg << "<text x=\"" << coord(x + 28) << "\" y=\"" << coord(y) << "\">"
          << escape_xml(entry->label) << "</text>";
      x += legend_entry_width(*entry);
    }
    y += kLegendRow;
  }
}

// <svg ...> with its mapping, the title and the plot frame's background.
void open_svg(std::ostream& svg, const std::string& title, double height, const LinearMap* x_map,
              const LinearMap& y_map) {
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"" << kWidth
      << "\" height=\"" << coord(height) << "\" viewBox=\"0 0 " << kWidth << " " << coord(height)
      << "\" font-family=\"sans-serif\" font-size=\"11\" data-title=\"" << escape_xml(title)
      << "\"";
  if (x_map) {
    svg << " data-x-domain=\"" << exact(x_map->d0) << " " << exact(x_map->d1)
        << "\" data-x-range=\"" << exact(x_map->r0) << " " << exact(x_map->r1) << "\"";
  }
  svg << " data-y-domain=\"" << exact(y_map.d0) << " " << exact(y_map.d1) << "\" data-y-range=\""
      << exact(y_map.r0) << " " << exact(y_map.r1) << "\">\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>";
  svg << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\" "
      << "font-weight=\"bold\">" << escape_xml(title) << "</text>\n";
}

// Horizontal grid lines and the y tick labels; the y axis title, rotated.
void write_y_axis(std::ostream& svg, const std::vector<double>& ticks, const LinearMap& y_map,
                  const std::string& label) {
  const double step = ticks.size() > 1 ? ticks[1] - ticks[0] : 1.0;
  for (double tick : ticks) {
    const std::string y = coord(y_map(tick));
    svg << "<line x1=\"" << kPlotLeft << "\" y1=\"" << y << "\" x2=\"" << kPlotRight << "\" y2=\""
        << y << "\" stroke=\"#e4e4e4\"/>";
    svg << "<text class=\"y-tick\" x=\"" << kPlotLeft - 6 << "\" y=\"" << coord(y_map(tick) + 4)
        << "\" text-anchor=\"end\">" << format_tick(tick, step) << "</text>\n";
  }
  const double middle = (kPlotTop + kPlotBottom) / 2;
  svg << "<text x=\"14\" y=\"" << middle << "\" text-anchor=\"middle\" transform=\"rotate(-90 14 "
      << middle << ")\">" << escape_xml(label) << "</text>\n";
}

void write_x_axis(std::ostream& svg, const std::vector<double>& ticks, const LinearMap& x_map,
                  const std::string& label) {
  const double step = ticks.size() > 1 ? ticks[1] - ticks[0] : 1.0;
  for (double tick : ticks) {
    const std::string x = coord(x_map(tick));
    svg << "<line x1=\"" << x << "\" y1=\"" << kPlotTop << "\" x2=\"" << x << "\" y2=\""
        << kPlotBottom << "\" stroke=\"#efefef\"/>";
    svg << "<text class=\"x-tick\" x=\"" << x << "\" y=\"" << kPlotBottom + 16
        << "\" text-anchor=\"middle\">" << format_tick(tick, step) << "</text>\n";
  }
  svg << "<text x=\"" << (kPlotLeft + kPlotRight) / 2 << "\" y=\"" << kPlotBottom + 34
      << "\" text-anchor=\"middle\">" << escape_xml(label) << "</text>\n";
}

void write_frame(std::ostream& svg) {
  svg << "<rect x=\"" << kPlotLeft << "\" y=\"" << kPlotTop << "\" width=\""
      << kPlotRight - kPlotLeft << "\" height=\"" << kPlotBottom - kPlotTop
      << "\" fill=\"none\" stroke=\"#888888\"/>\n";
}

bool finite_point(const LineSeries& series, size_t i) {
  return std::isfinite(series.x[i]) && std::isfinite(series.y[i]);
}

void write_series(std::ostream& svg, const LineSeries& series, const LinearMap& x_map,
                  const LinearMap& y_map) {
  std::vector<double> x, y;
  for (size_t i = 0; i < series.x.size(); ++i) {
    if (!finite_point(series, i)) continue;
    x.push_back(series.x[i]);
    y.push_back(series.y[i]);
  }
  if (x.empty()) return;
  std::string path;
  const std::vector<size_t> kept = decimate_min_max(y, kMaxPlottedPoints);
  for (size_t k = 0; k < kept.size(); ++k) {
    path += (k == 0 ? "M" : k == 1 ? " L" : " ");
    path += coord(x_map(x[kept[k]])) + " " + coord(y_map(y[kept[k]]));
  }
  svg << "<path class=\"series\" data-label=\"" << escape_xml(series.label) << "\" d=\"" << path
      << "\" fill=\"none\" stroke=\"" << escape_xml(series.color)
      << "\" stroke-width=\"2\" stroke-linejoin=\"round\""
      << (series.style == LineStyle::Dashed ? " stroke-dasharray=\"6 3\"" : "") << "/>\n";
  if (!series.markers) return;
  for (size_t i : kept) {
    svg << "<circle cx=\"" << coord(x_map(x[i])) << "\" cy=\"" << coord(y_map(y[i]))
        << "\" r=\"2.5\" fill=\"" << escape_xml(series.color) << "\"/>";
  }
  svg << "\n";
}

// [lo, hi] of the finite values; {+inf, -inf} when there are none.
void extend(double v, double& lo, double& hi) {
  if (!std::isfinite(v)) return;
  lo = std::min(lo, v);
  hi = std::max(hi, v);
}

}  // namespace

std::string escape_xml(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  DSTRAIN_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo <= hi && target > 0)
      << "nice_ticks(" << lo << ", " << hi << ")";
  if (hi - lo <= std::abs(hi) * 1e-12) {  // one value: a window around it
    const double half = lo == 0.0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= half;
    hi += half;
  }
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / magnitude;
  const double step = (norm <= 1.0   ? 1.0
                       : norm <= 2.0 ? 2.0
                       : norm <= 5.0 ? 5.0
                                     : 10.0) *
                      magnitude;
  const double first = std::floor(lo / step + 1e-9) * step;
  const double last = std::ceil(hi / step - 1e-9) * step;
  const auto count = static_cast<int64_t>(std::llround((last - first) / step)) + 1;
  std::vector<double> ticks;
  for (int64_t i = 0; i < count; ++i) {
    const double tick = first + static_cast<double>(i) * step;
    ticks.push_back(std::abs(tick) < step * 1e-9 ? 0.0 : tick);
  }
  if (ticks.size() == 1) ticks.push_back(ticks[0] + step);
  return ticks;
}

std::string format_tick(double value, double step) {
  if (value == 0.0) return "0";
  step = std::abs(step);
  const char* suffix = "";
  double unit = 1.0;
  if (step >= 1e9) {
    unit = 1e9;
    suffix = "G";
  } else if (step >= 1e6) {
    unit = 1e6;
    suffix = "M";
  } else if (step >= 1e3) {
    unit = 1e3;
    suffix = "k";
  }
  value /= unit;
  step /= unit;
  char text[48];
  if (step >= 1e-3) {
    const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
    std::snprintf(text, sizeof text, "%.*f%s", decimals, value, suffix);
  } else {  // tiny steps (learning rates): significant digits, exponent form below 1e-4
    const int digits = static_cast<int>(std::floor(std::log10(std::abs(value)) + 1e-9) -
                                        std::floor(std::log10(step) + 1e-9)) +
                       1;
    std::snprintf(text, sizeof text, "%.*g%s", std::max(1, digits), value, suffix);
  }
  return text;
}

std::vector<size_t> decimate_min_max(const std::vector<double>& y, size_t max_points) {
  DSTRAIN_CHECK(max_points >= 4) << "max_points " << max_points;
  std::vector<size_t> kept;
  if (y.size() <= max_points) {
    for (size_t i = 0; i < y.size(); ++i) kept.push_back(i);
    return kept;
  }
  const size_t buckets = (max_points - 2) / 2;
  const size_t inner = y.size() - 2;  // the first and last points are always kept
  kept.push_back(0);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t begin = 1 + inner * b / buckets, end = 1 + inner * (b + 1) / buckets;
    if (begin == end) continue;
    size_t low = begin, high = begin;
    for (size_t i = begin; i < end; ++i) {
      if (y[i] < y[low]) low = i;
      if (y[i] > y[high]) high = i;
    }
    kept.push_back(std::min(low, high));
    if (low != high) kept.push_back(std::max(low, high));
  }
  kept.push_back(y.size() - 1);
  return kept;
}

std::string render_line_chart(const LineChart& chart) {
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo;
  double y_lo = x_lo, y_hi = -x_lo;
  std::vector<LegendEntry> legend;
  for (const LineSeries& series : chart.series) {
    DSTRAIN_CHECK(series.x.size() == series.y.size()) << series.label;
    for (size_t i = 0; i < series.x.size(); ++i) {
      if (!finite_point(series, i)) continue;
      extend(series.x[i], x_lo, x_hi);
      extend(series.y[i], y_lo, y_hi);
    }
    legend.push_back({series.label, series.color,
                      series.style == LineStyle::Dashed ? LegendEntry::Swatch::DashedLine
                                                        : LegendEntry::Swatch::Line});
  }
  DSTRAIN_CHECK(x_lo <= x_hi) << "chart '" << chart.title << "' has no finite point";
  for (const ReferenceLine& line : chart.reference_lines) {
    extend(line.y, y_lo, y_hi);
    legend.push_back({line.label, line.color, LegendEntry::Swatch::DottedLine});
  }
  const std::vector<double> x_ticks = nice_ticks(x_lo, x_hi, 6);
  const std::vector<double> y_ticks = nice_ticks(y_lo, y_hi, 5);
  const LinearMap x_map{x_ticks.front(), x_ticks.back(), kPlotLeft, kPlotRight};
  const LinearMap y_map{y_ticks.front(), y_ticks.back(), kPlotBottom, kPlotTop};
  std::ostringstream svg;
  open_svg(svg, chart.title, chart_height(legend), &x_map, y_map);
  write_y_axis(svg, y_ticks, y_map, chart.y_label);
  write_x_axis(svg, x_ticks, x_map, chart.x_label);
  write_frame(svg);
  for (const ReferenceLine& line : chart.reference_lines) {
    const std::string y = coord(y_map(line.y));
    svg << "<line class=\"reference\" data-label=\"" << escape_xml(line.label) << "\" x1=\""
        << kPlotLeft << "\" y1=\"" << y << "\" x2=\"" << kPlotRight << "\" y2=\"" << y
        << "\" stroke=\"" << escape_xml(line.color)
        << "\" stroke-width=\"1.5\" stroke-dasharray=\"2 3\"/>\n";
  }
  for (const LineSeries& series : chart.series) write_series(svg, series, x_map, y_map);
  write_legend(svg, legend);
  svg << "</svg>\n";
  return svg.str();
}

namespace {

// The labels under the bars, and under each run of bars of one group its caption, underlined
// in the group's colour.
void write_bar_labels(std::ostream& svg, const std::vector<Bar>& bars, double slot) {
  size_t longest = 1;
  for (const Bar& bar : bars) longest = std::max(longest, bar.label.size());
  // Many narrow bars: label every `every`-th, so the labels do not overlap.
  const auto every = static_cast<size_t>(
      std::max(1.0, std::ceil((5.6 * static_cast<double>(longest) + 6.0) / slot)));
  for (size_t i = 0; i < bars.size(); i += every) {
    svg << "<text x=\"" << coord(kPlotLeft + slot * (static_cast<double>(i) + 0.5)) << "\" y=\""
        << kPlotBottom + 14 << "\" text-anchor=\"middle\" font-size=\"10\">"
        << escape_xml(bars[i].label) << "</text>";
  }
  svg << "\n";
  for (size_t begin = 0; begin < bars.size();) {
    size_t end = begin + 1;
    while (end < bars.size() && bars[end].group == bars[begin].group) ++end;
    const double x0 = kPlotLeft + slot * static_cast<double>(begin) + 4;
    const double x1 = kPlotLeft + slot * static_cast<double>(end) - 4;
    svg << "<line x1=\"" << coord(x0) << "\" y1=\"" << kPlotBottom + 20 << "\" x2=\"" << coord(x1)
        << "\" y2=\"" << kPlotBottom + 20 << "\" stroke=\"" << escape_xml(bars[begin].group_color)
        << "\" stroke-width=\"3\"/>";
    svg << "<text x=\"" << coord((x0 + x1) / 2) << "\" y=\"" << kPlotBottom + 34
        << "\" text-anchor=\"middle\">" << escape_xml(bars[begin].group) << "</text>\n";
    begin = end;
  }
}

}  // namespace

std::string render_stacked_bar_chart(const StackedBarChart& chart) {
  DSTRAIN_CHECK(!chart.bars.empty()) << "chart '" << chart.title << "' has no bar";
  double top = 0.0;
  for (const Bar& bar : chart.bars) {
    DSTRAIN_CHECK(bar.values.size() == chart.layers.size()) << bar.label;
    double total = 0.0;
    for (double v : bar.values) total += std::isfinite(v) ? std::max(0.0, v) : 0.0;
    top = std::max(top, total);
  }
  std::vector<LegendEntry> legend;
  for (const BarLayer& layer : chart.layers) {
    legend.push_back({layer.label, layer.color, LegendEntry::Swatch::Box});
  }
  const std::vector<double> y_ticks = nice_ticks(0.0, top, 5);
  const LinearMap y_map{y_ticks.front(), y_ticks.back(), kPlotBottom, kPlotTop};
  std::ostringstream svg;
  open_svg(svg, chart.title, chart_height(legend), nullptr, y_map);
  write_y_axis(svg, y_ticks, y_map, chart.y_label);
  const double slot = (kPlotRight - kPlotLeft) / static_cast<double>(chart.bars.size());
  const double width = std::min(48.0, slot * 0.7);
  for (size_t i = 0; i < chart.bars.size(); ++i) {
    const Bar& bar = chart.bars[i];
    const double x = kPlotLeft + slot * (static_cast<double>(i) + 0.5) - width / 2;
    double base = 0.0;
    for (size_t l = 0; l < chart.layers.size(); ++l) {
      const double v = std::isfinite(bar.values[l]) ? std::max(0.0, bar.values[l]) : 0.0;
      if (v == 0.0) continue;
      const double y_top = y_map(base + v), y_bottom = y_map(base);
      svg << "<rect class=\"bar\" data-bar=\"" << i << "\" data-layer=\""
          << escape_xml(chart.layers[l].label) << "\" x=\"" << coord(x) << "\" y=\"" << coord(y_top)
          << "\" width=\"" << coord(width) << "\" height=\"" << coord(y_bottom - y_top)
          << "\" fill=\"" << escape_xml(chart.layers[l].color) << "\"><title>"
          << escape_xml(bar.group + " " + bar.label + ", " + chart.layers[l].label + ": " +
                        value_text(v))
          << "</title></rect>\n";
      base += v;
    }
  }
  write_frame(svg);
  write_bar_labels(svg, chart.bars, slot);
  write_legend(svg, legend);
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace dstrain
