// `dstrain report`: logs with random values rendered, and the plotted numbers read back from
// the SVG through each chart's stated axis mapping; overlays, the entropy floor, memory and
// time bars, decimation, bad input; and the binary on a real training run.
#include "cli/report.h"

#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/run_log.h"
#include "cli/svg_plot.h"
#include "core/check.h"
#include "tests/common/run_binary.h"
#include "tests/common/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using dstrain::RunLog;
using json = nlohmann::json;

// ---- reading the page back -------------------------------------------------------------------

// The value of attribute `name` in the tag `tag` ("" when absent).
std::string attr(const std::string& tag, const std::string& name) {
  const std::string key = " " + name + "=\"";
  const size_t at = tag.find(key);
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size();
  return tag.substr(begin, tag.find('"', begin) - begin);
}

// Every start tag `<name ...>` in `text`.
std::vector<std::string> tags(const std::string& text, const std::string& name) {
  std::vector<std::string> found;
  for (size_t at = text.find("<" + name + " "); at != std::string::npos;
       at = text.find("<" + name + " ", at + 1)) {
    found.push_back(text.substr(at, text.find('>', at) - at + 1));
  }
  return found;
}

std::vector<double> numbers(const std::string& text) {
  std::string cleaned = text;
  for (char& c : cleaned) {
    if (c == 'M' || c == 'L' || c == ',') c = ' ';
  }
  std::istringstream in(cleaned);
  std::vector<double> values;
  for (double v; in >> v;) values.push_back(v);
  return values;
}

// A chart's stated linear mapping of one axis: data [d0, d1] onto coordinates [r0, r1].
struct AxisMap {
  double d0 = 0, d1 = 0, r0 = 0, r1 = 0;
  double value(double coordinate) const { return d0 + (coordinate - r0) / (r1 - r0) * (d1 - d0); }
  double coordinate(double value) const { return r0 + (value - d0) / (d1 - d0) * (r1 - r0); }
  // What two decimals of a coordinate can be off by, as a value.
  double tolerance() const { return 0.0051 * std::abs(d1 - d0) / std::abs(r1 - r0) + 1e-12; }
};

AxisMap axis_map(const std::string& svg_tag, const char axis) {
  const std::vector<double> domain =
      numbers(attr(svg_tag, std::string("data-") + axis + "-domain"));
  const std::vector<double> range = numbers(attr(svg_tag, std::string("data-") + axis + "-range"));
  EXPECT_EQ(domain.size(), 2u) << svg_tag;
  EXPECT_EQ(range.size(), 2u) << svg_tag;
  if (domain.size() != 2 || range.size() != 2) return {};
  return {domain[0], domain[1], range[0], range[1]};
}

struct Chart {
  std::string svg;  // <svg ...>...</svg>
  std::string title;
  AxisMap x, y;
};

std::vector<Chart> charts(const std::string& html) {
  std::vector<Chart> found;
  for (size_t at = html.find("<svg "); at != std::string::npos; at = html.find("<svg ", at + 1)) {
    Chart chart;
    chart.svg = html.substr(at, html.find("</svg>", at) + 6 - at);
    const std::string tag = chart.svg.substr(0, chart.svg.find('>') + 1);
    chart.title = attr(tag, "data-title");
    if (!attr(tag, "data-x-domain").empty()) chart.x = axis_map(tag, 'x');
    chart.y = axis_map(tag, 'y');
    found.push_back(chart);
  }
  return found;
}

const Chart* find_chart(const std::vector<Chart>& all, const std::string& title) {
  for (const Chart& chart : all) {
    if (chart.title == title) return &chart;
  }
  return nullptr;
}

struct Point {
  double x, y;
};

// The data points of the series labelled `label` in `chart`, through its mapping.
std::vector<Point> series_points(const Chart& chart, const std::string& label) {
  std::vector<Point> points;
  for (const std::string& path : tags(chart.svg, "path")) {
    if (attr(path, "class") != "series" || attr(path, "data-label") != label) continue;
    const std::vector<double> coordinates = numbers(attr(path, "d"));
    for (size_t i = 0; i + 1 < coordinates.size(); i += 2) {
      points.push_back({chart.x.value(coordinates[i]), chart.y.value(coordinates[i + 1])});
    }
  }
  return points;
}

size_t series_count(const Chart& chart) {
  size_t n = 0;
  for (const std::string& path : tags(chart.svg, "path")) n += attr(path, "class") == "series";
  return n;
}

// ---- random logs -----------------------------------------------------------------------------

struct FakeRun {
  int steps = 137;
  int eval_every = 10;
  bool entropy_floor = true;
  bool fp16 = false;
  bool time = false;
  bool per_rank_memory = true;
  int ranks = 2;
  uint32_t seed = 1;
};

// The records of a run with random values (seeded), one JSON object each.
std::vector<json> fake_records(const FakeRun& run) {
  std::mt19937 rng(run.seed);
  auto uniform = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  std::vector<json> records;
  records.push_back(
      {{"type", "config"},
       {"steps", run.steps},
       {"model", {{"model_type", "gpt2"}, {"n_layer", 2}, {"n_embd", 64}, {"vocab_size", 256}}},
       {"plan",
        {{"dp", run.ranks},
         {"tp", 1},
         {"pp", 1},
         {"zero", 1},
         {"precision", run.fp16 ? "fp16" : "fp32"}}}});
  if (run.entropy_floor) {
    records.push_back(
        {{"type", "data"}, {"entropy_floor", uniform(0.5, 1.0)}, {"entropy_previous_only", 1.7}});
  }
  json memory{{"type", "memory"}, {"ranks", run.ranks}};
  json per_rank = json::array();
  for (int r = 0; r < run.ranks; ++r) {
    per_rank.push_back({{"parameters", std::floor(uniform(1e6, 4e6))},
                        {"gradients", std::floor(uniform(1e6, 4e6))},
                        {"activations", std::floor(uniform(2e6, 9e6))},
                        {"comm_buffers", 0}});
  }
  memory["peak_bytes"] = per_rank[0];
  if (run.per_rank_memory) memory["per_rank_peak_bytes"] = per_rank;
  records.push_back(memory);
  for (int s = 1; s <= run.steps; ++s) {
    json step{{"step", s},
              {"loss", uniform(1.0, 6.0)},
              {"lr", uniform(0.0, 3e-3)},
              {"grad_norm", uniform(0.1, 10.0)},
              {"tokens_per_s", uniform(1e3, 9e4)}};
    if (run.fp16) {
      step["loss_scale"] = std::ldexp(1.0, static_cast<int>(uniform(8, 17)));
      step["skipped"] = false;
    }
    if (run.time) {
      step["time"] = {{"step_s", 0.1},
                      {"compute_s", uniform(0.02, 0.05)},
                      {"comm_exposed_s", uniform(0, 0.01)},
                      {"bubble_s", uniform(0, 0.02)},
                      {"optimizer_s", uniform(0, 0.005)},
                      {"other_s", uniform(0, 0.003)},
                      {"comm_total_s", uniform(0.01, 0.02)}};  // overlaps compute: not a part
      step["mfu"] = uniform(0.2, 0.5);
    }
    records.push_back(step);
    if (run.eval_every > 0 && s % run.eval_every == 0)
      records.push_back({{"step", s}, {"eval_loss", uniform(1.0, 6.0)}});
  }
  records.push_back(
      {{"type", "summary"}, {"steps", run.steps}, {"interrupted", false}, {"tokens_per_s", 5e4}});
  return records;
}

std::string to_text(const std::vector<json>& records) {
  std::string text;
  for (const json& record : records) text += record.dump() + "\n";
  return text;
}

// The step records' `key` as (step, value) points.
std::vector<Point> logged(const std::vector<json>& records, const std::string& key,
                          double scale = 1.0) {
  std::vector<Point> points;
  for (const json& record : records) {
    if (record.contains(key) && record.contains("step")) {
      points.push_back({record["step"].get<double>(), scale * record[key].get<double>()});
    }
  }
  return points;
}

void expect_points(const Chart& chart, const std::string& label,
                   const std::vector<Point>& expected) {
  const std::vector<Point> drawn = series_points(chart, label);
  ASSERT_FALSE(expected.empty()) << "no logged values for " << label;
  ASSERT_EQ(drawn.size(), expected.size()) << chart.title << " / " << label;
  double spread = 0.0;
  for (size_t i = 0; i < drawn.size(); ++i) {
    EXPECT_NEAR(drawn[i].x, expected[i].x, chart.x.tolerance()) << chart.title << " point " << i;
    EXPECT_NEAR(drawn[i].y, expected[i].y, chart.y.tolerance()) << chart.title << " point " << i;
    spread = std::max(spread, std::abs(expected[i].y - expected[0].y));
  }
  EXPECT_GT(spread, 0.0) << "the logged values of " << label << " are all the same";
}

RunLog parse(const std::vector<json>& records, const std::string& name) {
  return dstrain::parse_run_log_text(to_text(records), name);
}

// The UserError message of `parse_run_log_text(text, name)`.
std::string parse_error(const std::string& text, const std::string& name = "run.jsonl") {
  try {
    dstrain::parse_run_log_text(text, name);
  } catch (const dstrain::UserError& error) {
    return error.what();
  }
  ADD_FAILURE() << "no UserError for:\n" << text;
  return "";
}

// ---- the library -----------------------------------------------------------------------------

TEST(Report, LineChartsGiveBackTheLoggedValues) {
  const std::vector<json> records = fake_records(FakeRun{});
  const std::string html = dstrain::render_report({parse(records, "run.jsonl")}, "t");
  const std::vector<Chart> all = charts(html);
  const Chart* loss = find_chart(all, "Loss");
  const Chart* rate = find_chart(all, "Throughput");
  const Chart* lr = find_chart(all, "Learning rate");
  const Chart* norm = find_chart(all, "Gradient norm");
  ASSERT_TRUE(loss && rate && lr && norm) << html.substr(0, 2000);
  expect_points(*loss, "run.jsonl train", logged(records, "loss"));
  expect_points(*loss, "run.jsonl eval", logged(records, "eval_loss"));
  expect_points(*rate, "run.jsonl", logged(records, "tokens_per_s"));
  expect_points(*lr, "run.jsonl", logged(records, "lr"));
  expect_points(*norm, "run.jsonl", logged(records, "grad_norm"));
  EXPECT_EQ(series_count(*loss), 2u);
  EXPECT_EQ(find_chart(all, "Loss scale (fp16)"), nullptr) << "an fp32 run has no loss scale chart";
  EXPECT_EQ(find_chart(all, "Time per step (mean over the steps)"), nullptr);
}

TEST(Report, TickLabelsSitWhereTheirValuesMap) {
  const std::string html = dstrain::render_report({parse(fake_records(FakeRun{}), "a.jsonl")}, "t");
  size_t checked = 0;
  for (const Chart& chart : charts(html)) {
    for (const std::string& kind : {std::string("x-tick"), std::string("y-tick")}) {
      const AxisMap& map = kind == "x-tick" ? chart.x : chart.y;
      if (kind == "x-tick" && map.r0 == map.r1) continue;  // bar charts
      for (size_t at = chart.svg.find("class=\"" + kind + "\""); at != std::string::npos;
           at = chart.svg.find("class=\"" + kind + "\"", at + 1)) {
        const size_t open = chart.svg.rfind('<', at);
        const std::string tag = chart.svg.substr(open, chart.svg.find('>', at) - open + 1);
        const size_t text_begin = chart.svg.find('>', at) + 1;
        std::string label =
            chart.svg.substr(text_begin, chart.svg.find('<', text_begin) - text_begin);
        double scale = 1.0;
        if (label.ends_with("k")) scale = 1e3;
        if (label.ends_with("M")) scale = 1e6;
        if (scale != 1.0) label.pop_back();
        const double value = std::stod(label) * scale;
        const double position =
            std::stod(attr(tag, kind == "x-tick" ? "x" : "y")) - (kind == "y-tick" ? 4.0 : 0.0);
        EXPECT_NEAR(map.coordinate(value), position, 0.011)
            << chart.title << " " << kind << " " << label;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 30u);
}

TEST(Report, TwoLogsOverlayOnePathPerRunInEachChart) {
  FakeRun second;
  second.seed = 2;
  second.steps = 90;
  second.ranks = 4;
  const std::vector<json> a = fake_records(FakeRun{}), b = fake_records(second);
  std::vector<RunLog> runs = {parse(a, "x/a.jsonl"), parse(b, "y/b.jsonl")};
  dstrain::make_labels_unique(runs);
  const std::string html = dstrain::render_report(runs, "compare");
  const std::vector<Chart> all = charts(html);
  const std::vector<std::pair<std::string, std::string>> per_step = {
      {"Throughput", "tokens_per_s"}, {"Learning rate", "lr"}, {"Gradient norm", "grad_norm"}};
  for (const auto& [title, key] : per_step) {
    const Chart* chart = find_chart(all, title);
    ASSERT_NE(chart, nullptr) << title;
    EXPECT_EQ(series_count(*chart), 2u) << title;
    expect_points(*chart, "a.jsonl", logged(a, key));
    expect_points(*chart, "b.jsonl", logged(b, key));
  }
  const Chart* loss = find_chart(all, "Loss");
  ASSERT_NE(loss, nullptr);
  EXPECT_EQ(series_count(*loss), 4u);
  expect_points(*loss, "a.jsonl train", logged(a, "loss"));
  expect_points(*loss, "b.jsonl eval", logged(b, "eval_loss"));
  // One colour per run, the same in every chart and in the run table.
  std::vector<std::string> colors;
  for (const std::string& path : tags(loss->svg, "path")) colors.push_back(attr(path, "stroke"));
  ASSERT_EQ(colors.size(), 4u);
  EXPECT_EQ(colors[0], dstrain::run_color(0));
  EXPECT_EQ(colors[1], dstrain::run_color(0));
  EXPECT_EQ(colors[2], dstrain::run_color(1));
  EXPECT_NE(dstrain::run_color(0), dstrain::run_color(1));
  EXPECT_NE(html.find("background:" + dstrain::run_color(1) + "\"></span>b.jsonl"),
            std::string::npos);
  const Chart* memory = find_chart(all, "Peak memory per rank");
  ASSERT_NE(memory, nullptr);
  EXPECT_NE(memory->svg.find(">rank 3<"), std::string::npos) << "b's four ranks";
  // Two files with one name: their paths tell them apart.
  std::vector<RunLog> same = {parse(a, "x/run.jsonl"), parse(b, "y/run.jsonl")};
  dstrain::make_labels_unique(same);
  EXPECT_EQ(same[0].label, "x/run.jsonl");
  EXPECT_EQ(same[1].label, "y/run.jsonl");
}

TEST(Report, EntropyFloorIsAHorizontalLineAtItsValue) {
  const std::vector<json> records = fake_records(FakeRun{});
  const double floor = records[1]["entropy_floor"].get<double>();
  const std::vector<Chart> all = charts(dstrain::render_report({parse(records, "r.jsonl")}, "t"));
  const Chart* loss = find_chart(all, "Loss");
  ASSERT_NE(loss, nullptr);
  const std::vector<std::string> lines = tags(loss->svg, "line");
  const auto reference = std::find_if(lines.begin(), lines.end(), [](const std::string& tag) {
    return attr(tag, "class") == "reference";
  });
  ASSERT_NE(reference, lines.end());
  EXPECT_NEAR(loss->y.value(std::stod(attr(*reference, "y1"))), floor, loss->y.tolerance());
  EXPECT_EQ(attr(*reference, "y1"), attr(*reference, "y2"));
  EXPECT_NE(attr(*reference, "data-label").find("entropy floor"), std::string::npos);

  FakeRun without;
  without.entropy_floor = false;
  const std::vector<Chart> plain_charts =
      charts(dstrain::render_report({parse(fake_records(without), "r.jsonl")}, "t"));
  const Chart* plain = find_chart(plain_charts, "Loss");
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->svg.find("class=\"reference\""), std::string::npos);
}

// The bars' (layer, value) in the chart's unit, bar by bar.
std::vector<std::vector<std::pair<std::string, double>>> bar_values(const Chart& chart) {
  std::vector<std::vector<std::pair<std::string, double>>> bars;
  for (const std::string& rect : tags(chart.svg, "rect")) {
    if (attr(rect, "class") != "bar") continue;
    const auto bar = static_cast<size_t>(std::stoul(attr(rect, "data-bar")));
    if (bars.size() <= bar) bars.resize(bar + 1);
    const double top = std::stod(attr(rect, "y")), height = std::stod(attr(rect, "height"));
    bars[bar].emplace_back(attr(rect, "data-layer"),
                           chart.y.value(top) - chart.y.value(top + height));
  }
  return bars;
}

TEST(Report, MemoryBarsStackEachRanksCategories) {
  FakeRun run;
  run.ranks = 3;
  const std::vector<json> records = fake_records(run);
  const json& memory = records[2];
  const std::vector<Chart> all = charts(dstrain::render_report({parse(records, "m.jsonl")}, "t"));
  const Chart* chart = find_chart(all, "Peak memory per rank");
  ASSERT_NE(chart, nullptr);
  EXPECT_NE(chart->svg.find("MiB"), std::string::npos);
  const auto bars = bar_values(*chart);
  ASSERT_EQ(bars.size(), 3u);
  for (size_t rank = 0; rank < 3; ++rank) {
    // The allocator's order, bottom first; comm_buffers is zero everywhere and left out.
    ASSERT_EQ(bars[rank].size(), 3u);
    EXPECT_EQ(bars[rank][0].first, "parameters");
    EXPECT_EQ(bars[rank][1].first, "gradients");
    EXPECT_EQ(bars[rank][2].first, "activations");
    for (const auto& [layer, mib] : bars[rank]) {
      const double bytes = memory["per_rank_peak_bytes"][rank][layer].get<double>();
      EXPECT_GT(bytes, 0.0);
      EXPECT_NEAR(mib, bytes / (1024.0 * 1024.0), 2 * chart->y.tolerance())
          << "rank " << rank << " " << layer;
    }
  }
  // Without per_rank_peak_bytes: one bar, the largest over the ranks.
  run.per_rank_memory = false;
  const std::vector<Chart> fallback_charts =
      charts(dstrain::render_report({parse(fake_records(run), "m.jsonl")}, "t"));
  const Chart* fallback = find_chart(fallback_charts, "Peak memory per rank");
  ASSERT_NE(fallback, nullptr);
  EXPECT_EQ(bar_values(*fallback).size(), 1u);
  EXPECT_NE(fallback->svg.find(">max of 3 ranks<"), std::string::npos);
}

TEST(Report, TimeSplitIsTheMeanOfEachPartAndMfuIsPlotted) {
  FakeRun run;
  run.time = true;
  run.fp16 = true;
  const std::vector<json> records = fake_records(run);
  const std::vector<Chart> all = charts(dstrain::render_report({parse(records, "t.jsonl")}, "t"));
  const Chart* chart = find_chart(all, "Time per step (mean over the steps)");
  ASSERT_NE(chart, nullptr);
  const auto bars = bar_values(*chart);
  ASSERT_EQ(bars.size(), 1u);
  const std::vector<std::pair<std::string, std::string>> parts = {
      {"compute", "compute_s"},
      {"exposed communication", "comm_exposed_s"},
      {"pipeline bubble", "bubble_s"},
      {"optimizer", "optimizer_s"},
      {"other", "other_s"}};
  ASSERT_EQ(bars[0].size(), parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    double sum = 0.0, count = 0.0;
    for (const json& record : records) {
      if (record.contains("time")) sum += record["time"][parts[p].second].get<double>(), count += 1;
    }
    EXPECT_EQ(bars[0][p].first, parts[p].first);
    EXPECT_NEAR(bars[0][p].second, 1000.0 * sum / count, 2 * chart->y.tolerance())
        << parts[p].first << " (ms)";
  }
  const Chart* mfu = find_chart(all, "Model FLOPs utilization");
  ASSERT_NE(mfu, nullptr);
  expect_points(*mfu, "t.jsonl", logged(records, "mfu", 100.0));
  const Chart* scale = find_chart(all, "Loss scale (fp16)");
  ASSERT_NE(scale, nullptr);
  expect_points(*scale, "t.jsonl", logged(records, "loss_scale"));
}

TEST(Report, LongRunsAreDecimatedKeepingFirstLastAndExtremes) {
  std::mt19937 rng(7);
  std::vector<double> y(10007);
  for (double& v : y) v = std::uniform_real_distribution<double>(0, 1)(rng);
  y[4321] = 50.0;  // a spike
  y[777] = -50.0;
  const std::vector<size_t> kept = dstrain::decimate_min_max(y, dstrain::kMaxPlottedPoints);
  EXPECT_LE(kept.size(), dstrain::kMaxPlottedPoints);
  EXPECT_GT(kept.size(), dstrain::kMaxPlottedPoints - 10);
  EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
  EXPECT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end()) << "an index twice";
  EXPECT_EQ(kept.front(), 0u);
  EXPECT_EQ(kept.back(), y.size() - 1);
  EXPECT_NE(std::find(kept.begin(), kept.end(), 4321u), kept.end());
  EXPECT_NE(std::find(kept.begin(), kept.end(), 777u), kept.end());

  FakeRun run;
  run.steps = 6000;
  run.eval_every = 0;
  std::vector<json> records = fake_records(run);
  records[1000]["loss"] = 40.0;  // a loss spike at some step
  const std::string html = dstrain::render_report({parse(records, "long.jsonl")}, "t");
  const std::vector<Chart> long_charts = charts(html);
  const Chart* loss = find_chart(long_charts, "Loss");
  ASSERT_NE(loss, nullptr);
  const std::vector<Point> drawn = series_points(*loss, "long.jsonl train");
  EXPECT_LE(drawn.size(), dstrain::kMaxPlottedPoints);
  const double top =
      std::max_element(drawn.begin(), drawn.end(), [](Point a, Point b) { return a.y < b.y; })->y;
  EXPECT_NEAR(top, 40.0, loss->y.tolerance());
  EXPECT_LT(html.size(), 600u * 1024) << "decimated: the page stays small";
}

TEST(Report, PageIsSelfContainedAndEscapesText) {
  std::vector<RunLog> runs = {parse(fake_records(FakeRun{}), "dir/<b>&\"x\".jsonl")};
  dstrain::make_labels_unique(runs);
  const std::string html = dstrain::render_report(runs, "<script>alert(1)</script> & co");
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_NE(html.find("&lt;script&gt;alert(1)&lt;/script&gt; &amp; co"), std::string::npos);
  EXPECT_NE(html.find("&lt;b&gt;&amp;&quot;x&quot;.jsonl"), std::string::npos);
  EXPECT_EQ(html.find("<b>"), std::string::npos);
  // Nothing loads from anywhere: the only URL is the SVG namespace's name.
  std::string rest = html;
  for (size_t at; (at = rest.find("http://www.w3.org/2000/svg")) != std::string::npos;)
    rest.erase(at, 26);
  EXPECT_EQ(rest.find("http"), std::string::npos);
  EXPECT_EQ(rest.find("src="), std::string::npos);
  EXPECT_EQ(rest.find("href"), std::string::npos);
  EXPECT_EQ(rest.find("@import"), std::string::npos);
}

TEST(Report, BadLinesNameTheFileAndTheLine) {
  const std::string good = to_text(fake_records(FakeRun{}));
  const std::string bad_json = "{\"step\":1,\"loss\":2}\n{\"step\":2,\"loss\"\n" + good;
  std::string message = parse_error(bad_json, "runs/a.jsonl");
  EXPECT_NE(message.find("line 2 of runs/a.jsonl is not a JSON object"), std::string::npos)
      << message;
  message = parse_error(good + "[1, 2]\n" + good);
  EXPECT_NE(message.find("line " + std::to_string(std::count(good.begin(), good.end(), '\n') + 1) +
                         " of run.jsonl"),
            std::string::npos)
      << message;
  message = parse_error("{\"step\":1,\"loss\":\"low\"}\n");
  EXPECT_NE(message.find("line 1 of run.jsonl: \"loss\" is \"low\", not a number"),
            std::string::npos)
      << message;
  message = parse_error("{\"step\":-3,\"loss\":1.5}\n");
  EXPECT_NE(message.find("line 1 of run.jsonl"), std::string::npos) << message;
  message = parse_error("{\"type\":\"config\"}\n{\"type\":\"summary\"}\n");
  EXPECT_NE(message.find("run.jsonl has no step records"), std::string::npos) << message;
  message = parse_error("");
  EXPECT_NE(message.find("no step records"), std::string::npos) << message;
}

TEST(Report, UnfinishedLastLineIsSkippedWithAWarning) {
  const std::string good = to_text(fake_records(FakeRun{}));
  const RunLog log = dstrain::parse_run_log_text(good + "{\"step\":138,\"lo", "c.jsonl");
  EXPECT_EQ(log.steps.size(), 137u);
  ASSERT_EQ(log.warnings.size(), 1u);
  EXPECT_NE(log.warnings[0].find("unfinished last line"), std::string::npos) << log.warnings[0];
  EXPECT_NE(dstrain::render_report({log}, "t").find("unfinished last line"), std::string::npos);
  // The same line with its newline was written whole: an error, not a warning.
  EXPECT_NE(parse_error(good + "{\"step\":138,\"lo\n").find("is not a JSON object"),
            std::string::npos);
}

TEST(Report, ResumedRunReplacesTheStepsItLogsAgain) {
  FakeRun first;
  first.steps = 30;
  const std::vector<json> a = fake_records(first);
  std::vector<json> records(a.begin(), a.end() - 1);  // crashed: no summary
  // Resumed from the checkpoint at step 20: no config, a memory record, steps 21.. again.
  FakeRun resumed;
  resumed.steps = 40;
  resumed.seed = 9;
  const std::vector<json> b = fake_records(resumed);
  for (const json& record : b) {
    const bool step = record.contains("step") && record["step"].get<int>() > 20;
    if (step || record.value("type", "") == "memory" || record.value("type", "") == "summary")
      records.push_back(record);
  }
  const RunLog log = parse(records, "r.jsonl");
  ASSERT_EQ(log.steps.size(), 40u);
  for (size_t i = 0; i < 40; ++i) {
    EXPECT_EQ(log.steps[i].step, static_cast<int64_t>(i + 1));
    const json& source =
        i < 20 ? a[3 + i + i / 10] : b[3 + i + i / 10];  // evals follow every 10th step
    EXPECT_EQ(log.steps[i].loss, source["loss"].get<double>()) << "step " << i + 1;
  }
  ASSERT_EQ(log.evals.size(), 4u);
  EXPECT_EQ(log.evals[2].eval_loss, b[3 + 30 + 2]["eval_loss"].get<double>());
  EXPECT_FALSE(log.config.is_null());
  EXPECT_FALSE(log.summary.is_null());
}

// ---- the binary ------------------------------------------------------------------------------

using Result = dstrain::testing::BinaryResult;

Result run_dstrain(const std::string& args, const fs::path& dir) {
  return dstrain::testing::run_binary(DSTRAIN_BINARY, args, dir);
}

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class ReportCli : public ::testing::Test {
 protected:
  dstrain::testing::TempDir temp_;
  const fs::path& dir_ = temp_.path();

  void expect_user_error(const std::string& args, const std::string& fragment) {
    const Result result = run_dstrain(args, dir_);
    EXPECT_EQ(result.exit_code, 2) << args << "\nstderr: " << result.err;
    EXPECT_EQ(result.err.rfind("dstrain: error: ", 0), 0u) << result.err;
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
    EXPECT_NE(result.err.find(fragment), std::string::npos)
        << "expected '" << fragment << "' in " << result.err;
  }
};

TEST_F(ReportCli, TrainThenReport) {
  const Result train = run_dstrain(
      "--device cpu --steps 12 --gpus 2 --pp 2 --eval-every 6 --sample 0 --quiet --log run.jsonl",
      dir_);
  ASSERT_EQ(train.exit_code, 0) << train.err;
  const Result report = run_dstrain("report run.jsonl --out run.html --title 'pp 2'", dir_);
  ASSERT_EQ(report.exit_code, 0) << report.err;
  EXPECT_NE(report.out.find("wrote run.html (1 run"), std::string::npos) << report.out;
  const std::string html = read(dir_ / "run.html");
  EXPECT_NE(html.find("<h1>pp 2</h1>"), std::string::npos);
  const std::vector<Chart> all = charts(html);
  EXPECT_GE(all.size(), 5u);
  const Chart* loss = find_chart(all, "Loss");
  ASSERT_NE(loss, nullptr);
  std::vector<json> records;
  std::ifstream log(dir_ / "run.jsonl");
  for (std::string line; std::getline(log, line);) records.push_back(json::parse(line));
  expect_points(*loss, "run.jsonl train", logged(records, "loss"));
  expect_points(*loss, "run.jsonl eval", logged(records, "eval_loss"));
  EXPECT_NE(loss->svg.find("class=\"reference\""), std::string::npos)
      << "the synthetic corpus's floor";
  ASSERT_NE(find_chart(all, "Peak memory per rank"), nullptr);
  // Two logs overlaid, the default --out beside the first.
  ASSERT_EQ(run_dstrain("--device cpu --steps 8 --gpus 2 --sample 0 --quiet --log dp.jsonl", dir_)
                .exit_code,
            0);
  const Result both = run_dstrain("report run.jsonl dp.jsonl", dir_);
  ASSERT_EQ(both.exit_code, 0) << both.err;
  const std::vector<Chart> overlay_charts = charts(read(dir_ / "run.html"));
  const Chart* overlay = find_chart(overlay_charts, "Throughput");
  ASSERT_NE(overlay, nullptr);
  EXPECT_EQ(series_count(*overlay), 2u);
}

TEST_F(ReportCli, BadInputIsOneSentenceAndWritesNothing) {
  const std::string good = to_text(fake_records(FakeRun{}));
  std::ofstream(dir_ / "good.jsonl") << good;
  std::ofstream(dir_ / "bad.jsonl")
      << "{\"step\":1,\"loss\":2}\nnot json\n{\"step\":2,\"loss\":1}\n";
  std::ofstream(dir_ / "empty.jsonl") << "{\"type\":\"config\"}\n";
  std::ofstream(dir_ / "old.html") << "old";
  expect_user_error("report bad.jsonl --out old.html", "line 2 of bad.jsonl is not a JSON object");
  expect_user_error("report good.jsonl missing.jsonl --out old.html", "missing.jsonl");
  expect_user_error("report empty.jsonl --out old.html", "empty.jsonl has no step records");
  expect_user_error("report good.jsonl --out no/such/dir/r.html", "no/such/dir/r.html");
  expect_user_error("report good.jsonl --out good.jsonl", "is one of the logs");
  expect_user_error("report --out x.html", "needs a log");
  expect_user_error("report good.jsonl --bogus", "unknown flag --bogus");
  EXPECT_EQ(read(dir_ / "old.html"), "old") << "a failed report leaves the old page";
  EXPECT_EQ(read(dir_ / "good.jsonl"), good);
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  }
  const Result help = run_dstrain("report --help", dir_);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Usage: dstrain report RUN.jsonl"), std::string::npos);
  const Result usage = run_dstrain("--help", dir_);
  EXPECT_NE(usage.out.find("dstrain report RUN.jsonl"), std::string::npos);
}

}  // namespace
