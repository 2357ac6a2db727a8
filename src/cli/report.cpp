#include "cli/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

#include "cli/svg_plot.h"
#include "core/allocator.h"
#include "core/check.h"
#include "core/format.h"

namespace dstrain {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Tableau 10: the runs.
const std::vector<std::string> kRunColors = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                             "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
// ColorBrewer Set3: the layers of stacked bars, none a run's colour.
const std::vector<std::string> kLayerColors = {"#8dd3c7", "#fdb462", "#bebada", "#fb8072",
                                               "#80b1d3", "#b3de69", "#fccde5", "#ffffb3",
                                               "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"};
const char* const kFloorColor = "#444444";

std::string number_text(double v, int digits = 4) {
  if (!std::isfinite(v)) return "-";
  char text[48];
  std::snprintf(text, sizeof text, "%.*g", digits, v);
  return text;
}

// "optimizer_state_host" -> "optimizer state host"; "comm_exposed_s" -> "comm exposed".
std::string readable(std::string name, bool strip_seconds) {
  if (strip_seconds && name.ends_with("_s")) name.resize(name.size() - 2);
  std::replace(name.begin(), name.end(), '_', ' ');
  return name;
}

std::string time_part_label(const std::string& part) {
  static const std::map<std::string, std::string> names = {
      {"compute_s", "compute"},
      {"comm_exposed_s", "exposed communication"},
      {"bubble_s", "pipeline bubble"},
      {"optimizer_s", "optimizer"},
      {"other_s", "other"}};
  const auto it = names.find(part);
  return it != names.end() ? it->second : readable(part, true);
}

bool has_finite_point(const LineChart& chart) {
  for (const LineSeries& series : chart.series) {
    for (size_t i = 0; i < series.y.size(); ++i) {
      if (std::isfinite(series.x[i]) && std::isfinite(series.y[i])) return true;
    }
  }
  return false;
}

// A chart of one per-step value, one series per run; NaN from `value`: no point.
LineChart step_chart(const std::vector<RunLog>& runs, const std::string& title,
                     const std::string& y_label,
                     const std::function<double(const StepRecord&)>& value) {
  LineChart chart{title, "step", y_label, {}, {}};
  for (size_t r = 0; r < runs.size(); ++r) {
    LineSeries series{runs[r].label, run_color(r), {}, {}, LineStyle::Solid, false};
    for (const StepRecord& step : runs[r].steps) {
      series.x.push_back(static_cast<double>(step.step));
      series.y.push_back(value(step));
    }
    chart.series.push_back(std::move(series));
  }
  return chart;
}

// Training loss per run (solid), evaluation loss (dashed, dotted), the entropy floor(s).
LineChart loss_chart(const std::vector<RunLog>& runs) {
  LineChart chart{"Loss", "step", "loss (nats/token)", {}, {}};
  std::vector<double> floors;
  for (size_t r = 0; r < runs.size(); ++r) {
    const RunLog& run = runs[r];
    LineSeries train{run.label + " train", run_color(r), {}, {}, LineStyle::Solid, false};
    for (const StepRecord& step : run.steps) {
      train.x.push_back(static_cast<double>(step.step));
      train.y.push_back(step.loss);
    }
    chart.series.push_back(std::move(train));
    if (!run.evals.empty()) {
      LineSeries eval{run.label + " eval", run_color(r),           {}, {},
                      LineStyle::Dashed,   run.evals.size() <= 200};
      for (const EvalRecord& record : run.evals) {
        eval.x.push_back(static_cast<double>(record.step));
        eval.y.push_back(record.eval_loss);
      }
      chart.series.push_back(std::move(eval));
    }
    if (run.entropy_floor) floors.push_back(*run.entropy_floor);
  }
  std::sort(floors.begin(), floors.end());
  floors.erase(std::unique(floors.begin(), floors.end()), floors.end());
  for (double floor : floors) {
    chart.reference_lines.push_back({"entropy floor " + number_text(floor), kFloorColor, floor});
  }
  return chart;
}

// The memory categories in the allocator's order (unknown ones after), leaving out those no
// rank of any run used.
std::vector<std::string> used_memory_categories(const std::vector<RunLog>& runs) {
  std::vector<std::string> order;
  for (int c = 0; c < kNumMemCategories; ++c) {
    order.emplace_back(mem_category_name(static_cast<MemCategory>(c)));
  }
  std::vector<std::string> used;
  auto add_if_used = [&](const std::string& category) {
    if (std::find(used.begin(), used.end(), category) != used.end()) return;
    for (const RunLog& run : runs) {
      if (!run.memory) continue;
      const auto& cats = run.memory->categories;
      const auto it = std::find(cats.begin(), cats.end(), category);
      if (it == cats.end()) continue;
      const auto index = static_cast<size_t>(it - cats.begin());
      for (const auto& row : run.memory->per_rank) {
        if (row[index] > 0) return used.push_back(category);
      }
    }
  };
  for (const std::string& category : order) add_if_used(category);
  for (const RunLog& run : runs) {
    if (!run.memory) continue;
    for (const std::string& category : run.memory->categories) add_if_used(category);
  }
  return used;
}

// Bytes in the unit that suits `largest`: {divisor, name}.
std::pair<double, std::string> byte_unit(double largest) {
  if (largest >= 1024.0 * 1024 * 1024) return {1024.0 * 1024 * 1024, "GiB"};
  if (largest >= 1024.0 * 1024) return {1024.0 * 1024, "MiB"};
  return {1024.0, "KiB"};
}

std::optional<StackedBarChart> memory_chart(const std::vector<RunLog>& runs) {
  const std::vector<std::string> categories = used_memory_categories(runs);
  if (categories.empty()) return std::nullopt;
  StackedBarChart chart{"Peak memory per rank", "", {}, {}};
  for (size_t c = 0; c < categories.size(); ++c) {
    chart.layers.push_back({readable(categories[c], false), kLayerColors[c % kLayerColors.size()]});
  }
  double largest = 0.0;
  for (size_t r = 0; r < runs.size(); ++r) {
    const std::optional<MemoryRecord>& memory = runs[r].memory;
    if (!memory) continue;
    for (size_t rank = 0; rank < memory->per_rank.size(); ++rank) {
      Bar bar{memory->by_rank || memory->ranks <= 1
                  ? "rank " + std::to_string(rank)
                  : "max of " + std::to_string(memory->ranks) + " ranks",
              runs[r].label,
              run_color(r),
              {}};
      double total = 0.0;
      for (const std::string& category : categories) {
        const auto it = std::find(memory->categories.begin(), memory->categories.end(), category);
        const double bytes =
            it == memory->categories.end()
                ? 0.0
                : memory->per_rank[rank][static_cast<size_t>(it - memory->categories.begin())];
        bar.values.push_back(bytes);
        total += bytes;
      }
      largest = std::max(largest, total);
      chart.bars.push_back(std::move(bar));
    }
  }
  const auto [divisor, unit] = byte_unit(largest);
  for (Bar& bar : chart.bars) {
    for (double& v : bar.values) v /= divisor;
  }
  chart.y_label = unit + " (each category's peak)";
  return chart;
}

// Mean seconds per step of each part of the step, per run that logs "time".
std::optional<StackedBarChart> time_chart(const std::vector<RunLog>& runs) {
  std::vector<std::string> parts;
  for (const RunLog& run : runs) {
    for (const StepRecord& step : run.steps) {
      for (const auto& [part, seconds] : step.time_parts) {
        if (std::find(parts.begin(), parts.end(), part) == parts.end()) parts.push_back(part);
      }
    }
  }
  if (parts.empty()) return std::nullopt;
  StackedBarChart chart{"Time per step (mean over the steps)", "", {}, {}};
  for (size_t p = 0; p < parts.size(); ++p) {
    chart.layers.push_back({time_part_label(parts[p]), kLayerColors[p % kLayerColors.size()]});
  }
  double largest = 0.0;
  for (size_t r = 0; r < runs.size(); ++r) {
    std::vector<double> sums(parts.size(), 0.0), counts(parts.size(), 0.0);
    for (const StepRecord& step : runs[r].steps) {
      for (const auto& [part, seconds] : step.time_parts) {
        if (!std::isfinite(seconds)) continue;
        const auto p =
            static_cast<size_t>(std::find(parts.begin(), parts.end(), part) - parts.begin());
        sums[p] += seconds;
        counts[p] += 1.0;
      }
    }
    if (*std::max_element(counts.begin(), counts.end()) == 0.0) continue;
    Bar bar{"", runs[r].label, run_color(r), {}};
    double total = 0.0;
    for (size_t p = 0; p < parts.size(); ++p) {
      bar.values.push_back(counts[p] > 0 ? sums[p] / counts[p] : 0.0);
      total += bar.values.back();
    }
    largest = std::max(largest, total);
    chart.bars.push_back(std::move(bar));
  }
  const bool milliseconds = largest < 1.0;
  for (Bar& bar : chart.bars) {
    double total = 0.0;
    for (double& v : bar.values) total += (v *= milliseconds ? 1000.0 : 1.0);
    bar.label = number_text(total, 3) + (milliseconds ? " ms" : " s");
  }
  chart.y_label = milliseconds ? "ms per step" : "seconds per step";
  return chart;
}

bool any_step(const std::vector<RunLog>& runs, const std::function<bool(const StepRecord&)>& has) {
  for (const RunLog& run : runs) {
    if (std::any_of(run.steps.begin(), run.steps.end(), has)) return true;
  }
  return false;
}

std::vector<std::string> render_charts(const std::vector<RunLog>& runs) {
  std::vector<LineChart> lines;
  lines.push_back(loss_chart(runs));
  lines.push_back(step_chart(runs, "Throughput", "tokens/s",
                             [](const StepRecord& s) { return s.tokens_per_s; }));
  lines.push_back(
      step_chart(runs, "Learning rate", "learning rate", [](const StepRecord& s) { return s.lr; }));
  lines.push_back(step_chart(runs, "Gradient norm", "global gradient norm",
                             [](const StepRecord& s) { return s.grad_norm; }));
  if (any_step(runs, [](const StepRecord& s) { return s.loss_scale.has_value(); })) {
    lines.push_back(step_chart(runs, "Loss scale (fp16)", "loss scale",
                               [](const StepRecord& s) { return s.loss_scale.value_or(kNaN); }));
  }
  if (any_step(runs, [](const StepRecord& s) { return s.mfu.has_value(); })) {
    lines.push_back(step_chart(runs, "Model FLOPs utilization", "% of the GPUs' peak",
                               [](const StepRecord& s) { return 100.0 * s.mfu.value_or(kNaN); }));
  }
  std::vector<std::string> svgs;
  for (const LineChart& chart : lines) {
    if (has_finite_point(chart)) svgs.push_back(render_line_chart(chart));
  }
  if (auto chart = time_chart(runs)) svgs.push_back(render_stacked_bar_chart(*chart));
  if (auto chart = memory_chart(runs)) svgs.push_back(render_stacked_bar_chart(*chart));
  return svgs;
}

// "gpt2, 2 layers x 64, vocabulary 256"
std::string model_text(const nlohmann::ordered_json& config) {
  if (!config.is_object() || !config.contains("model")) return "-";
  const nlohmann::ordered_json& model = config["model"];
  auto field = [&](const char* a, const char* b) -> std::string {
    for (const char* key : {a, b}) {
      if (model.contains(key) && model[key].is_number()) return model[key].dump();
    }
    return "?";
  };
  return model.value("model_type", std::string("model")) + ", " +
         field("n_layer", "num_hidden_layers") + " layers x " + field("n_embd", "hidden_size") +
         ", vocabulary " + field("vocab_size", "vocab_size");
}

// "dp 1 x tp 1 x pp 2, ZeRO 0, fp32"
std::string plan_text(const nlohmann::ordered_json& config) {
  if (!config.is_object() || !config.contains("plan") || !config["plan"].is_object()) return "-";
  const nlohmann::ordered_json& plan = config["plan"];
  auto get = [&](const char* key) { return plan.contains(key) ? plan[key].dump() : "?"; };
  std::string text = "dp " + get("dp") + " x tp " + get("tp") + " x pp " + get("pp") + ", ZeRO " +
                     get("zero") + ", " + plan.value("precision", std::string("?"));
  if (plan.value("offload", false)) text += ", offload";
  if (plan.value("offload_params", false)) text += ", parameter offload";
  const std::string recompute = plan.value("recompute", std::string("none"));
  if (recompute != "none") text += ", recompute " + recompute;
  return text;
}

std::string best_eval_text(const RunLog& run) {
  const EvalRecord* best = nullptr;
  for (const EvalRecord& eval : run.evals) {
    if (std::isfinite(eval.eval_loss) && (!best || eval.eval_loss < best->eval_loss)) best = &eval;
  }
  return best ? number_text(best->eval_loss) + " (step " + std::to_string(best->step) + ")" : "-";
}

std::string status_text(const RunLog& run) {
  if (run.summary.is_null()) return "no summary (stopped or still running)";
  if (run.summary.value("interrupted", false)) return "interrupted";
  const double seconds = run.summary.value("train_seconds", kNaN);
  return "finished" + (std::isfinite(seconds) ? " in " + number_text(seconds, 3) + " s" : "");
}

double mean_tokens_per_s(const RunLog& run) {
  if (run.summary.is_object() && run.summary.contains("tokens_per_s") &&
      run.summary["tokens_per_s"].is_number()) {
    return run.summary["tokens_per_s"].get<double>();
  }
  double sum = 0.0, count = 0.0;
  for (const StepRecord& step : run.steps) {
    if (std::isfinite(step.tokens_per_s)) sum += step.tokens_per_s, count += 1.0;
  }
  return count > 0 ? sum / count : kNaN;
}

void write_run_table(std::ostream& html, const std::vector<RunLog>& runs) {
  html << "<table class=\"runs\">\n<tr><th>run</th><th>model</th><th>plan</th><th>steps</th>"
       << "<th>last loss</th><th>best eval loss</th><th>entropy floor</th><th>tokens/s</th>"
       << "<th>status</th></tr>\n";
  for (size_t r = 0; r < runs.size(); ++r) {
    const RunLog& run = runs[r];
    const double tokens_per_s = mean_tokens_per_s(run);
    html << "<tr><td title=\"" << escape_xml(run.path) << "\"><span class=\"swatch\" style=\""
         << "background:" << run_color(r) << "\"></span>" << escape_xml(run.label) << "</td><td>"
         << escape_xml(model_text(run.config)) << "</td><td>" << escape_xml(plan_text(run.config))
         << "</td><td>" << run.steps.front().step << "-" << run.steps.back().step << "</td><td>"
         << number_text(run.steps.back().loss) << "</td><td>" << best_eval_text(run) << "</td><td>"
         << (run.entropy_floor ? number_text(*run.entropy_floor) : "-") << "</td><td>"
         << (std::isfinite(tokens_per_s) ? format_rate(tokens_per_s) : "-") << "</td><td>"
         << status_text(run) << "</td></tr>\n";
  }
  html << "</table>\n";
}

void write_head(std::ostream& html, const std::string& title) {
  html << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>"
       << escape_xml(title) << "</title>\n<style>\n"
       << "body{font-family:sans-serif;margin:20px;color:#222;background:#f7f7f7}\n"
       << "h1{font-size:20px;margin:0 0 12px}\n"
       << "table.runs{border-collapse:collapse;margin-bottom:14px;font-size:13px;background:#fff}\n"
       << "table.runs td,table.runs th{padding:3px 10px;border-bottom:1px solid "
          "#ddd;text-align:left}\n"
       << ".swatch{display:inline-block;width:16px;height:4px;vertical-align:middle;margin-right:"
          "6px}\n"
       << ".charts{display:flex;flex-wrap:wrap;gap:12px}\n"
       << ".charts svg{border:1px solid #ddd}\n"
       << ".note{color:#666;font-size:12px}\n"
       << "</style>\n</head>\n<body>\n<h1>" << escape_xml(title) << "</h1>\n";
}

void write_notes(std::ostream& html, const std::vector<RunLog>& runs) {
  for (const RunLog& run : runs) {
    for (const std::string& warning : run.warnings) {
      html << "<p class=\"note warning\">" << escape_xml(warning) << "</p>\n";
    }
  }
  html << "<p class=\"note\">Made by <code>dstrain report</code>. Series of more than "
       << kMaxPlottedPoints << " points are drawn decimated: the first and last point, and the "
       << "lowest and highest of each of " << (kMaxPlottedPoints - 2) / 2
       << " equal stretches of steps. Memory bars stack each category's peak, which need not "
       << "coincide in time.</p>\n";
}

}  // namespace

const std::string& run_color(size_t index) { return kRunColors[index % kRunColors.size()]; }

void make_labels_unique(std::vector<RunLog>& runs) {
  std::map<std::string, int> uses;
  for (const RunLog& run : runs) ++uses[run.label];
  for (RunLog& run : runs) {
    if (uses[run.label] > 1) run.label = run.path;
  }
  std::map<std::string, int> seen;
  for (RunLog& run : runs) {
    const int n = ++seen[run.label];
    if (n > 1) run.label += " (" + std::to_string(n) + ")";
  }
}

std::string default_report_title(const std::vector<RunLog>& runs) {
  std::string names;
  for (const RunLog& run : runs) names += (names.empty() ? "" : ", ") + run.label;
  return (runs.size() == 1 ? "dstrain run " : "dstrain runs ") + names;
}

std::string render_report(const std::vector<RunLog>& runs, const std::string& title) {
  DSTRAIN_CHECK(!runs.empty()) << "render_report without a run";
  for (const RunLog& run : runs) DSTRAIN_CHECK(!run.steps.empty()) << run.path << " has no step";
  std::ostringstream html;
  write_head(html, title);
  write_run_table(html, runs);
  html << "<div class=\"charts\">\n";
  for (const std::string& svg : render_charts(runs)) html << svg;
  html << "</div>\n";
  write_notes(html, runs);
  html << "</body>\n</html>\n";
  return html.str();
}

}  // namespace dstrain
