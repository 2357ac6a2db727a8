// Charts as inline SVG for `dstrain report`: line charts and stacked bar charts, with axes,
// tick labels, a title and a legend, and nothing that needs a script or the network.
//
// Every value maps linearly to a coordinate, and each <svg> states its mapping:
//   data-x-domain="X0 X1" data-x-range="PX0 PX1" data-y-domain="Y0 Y1" data-y-range="PY0 PY1"
// (a value v is drawn at PX0 + (v - X0) / (X1 - X0) * (PX1 - PX0), likewise for y; a bar
// chart has no x mapping), so a reader (the tests) can recover the plotted numbers. A line
// chart draws one <path class="series"> per series, "M x y L x y x y ...", coordinates with
// two decimals; a reference line is one <line class="reference">; a bar chart draws one
// <rect class="bar"> per stacked segment.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

// Points drawn per series at most (decimate_min_max): a 100k-step run stays a few hundred KB.
constexpr size_t kMaxPlottedPoints = 2000;

enum class LineStyle { Solid, Dashed };

struct LineSeries {
  std::string label;         // in the legend
  std::string color;         // a CSS colour: "#1f77b4"
  std::vector<double> x, y;  // the same length; points with a non-finite x or y are left out
  LineStyle style = LineStyle::Solid;
  bool markers = false;  // a dot on each point (sparse series: evaluations)
};

// A horizontal line across the plot at `y` (the entropy floor).
struct ReferenceLine {
  std::string label;
  std::string color;
  double y = 0.0;
};

struct LineChart {
  std::string title, x_label, y_label;
  std::vector<LineSeries> series;
  std::vector<ReferenceLine> reference_lines;
};

// REQUIRES: some series has a finite point (the caller leaves out charts with no data).
std::string render_line_chart(const LineChart& chart);

// One layer of every stacked bar (a memory category, a part of the step time).
struct BarLayer {
  std::string label;
  std::string color;
};

struct Bar {
  std::string label;           // under the bar ("rank 0")
  std::string group;           // consecutive bars of one group share a caption under them
  std::string group_color;     // the caption's underline (the run's colour)
  std::vector<double> values;  // one per layer, bottom first; each >= 0
};

struct StackedBarChart {
  std::string title, y_label;
  std::vector<BarLayer> layers;
  std::vector<Bar> bars;
};

// REQUIRES: at least one bar; every bar has one value per layer.
std::string render_stacked_bar_chart(const StackedBarChart& chart);

// The indices of the points to draw of a series of `count` points: all of them when count <=
// max_points, else the first and last points and, in each of (max_points - 2) / 2 equal runs
// of consecutive points, the smallest and the largest y (in their order), so spikes survive.
// REQUIRES: max_points >= 4.
std::vector<size_t> decimate_min_max(const std::vector<double>& y, size_t max_points);

// `text` with & < > " ' escaped, for XML and HTML text and attribute values.
std::string escape_xml(std::string_view text);

// The tick values of a linear axis covering [lo, hi]: about `target` "nice" steps (1, 2 or 5
// times a power of ten), the first tick <= lo and the last >= hi.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);

// A tick label: "0.25", "3e-05", "12k", "1.5M" (enough digits to tell ticks `step` apart).
std::string format_tick(double value, double step);

}  // namespace dstrain
