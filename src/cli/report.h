// `dstrain report`: one self-contained HTML page (inline SVG and CSS, no script, nothing from
// the network) plotting one or more training logs, each run in its own colour.
//
// The charts, each left out when no run has its data: loss (training solid, evaluation dashed
// with dots, the synthetic corpus's entropy floor as a dotted line), tokens per second,
// learning rate, gradient norm, loss scale (fp16), MFU (GPU runs), the mean step time split
// into its parts (stacked bars, one per run) and the peak memory per category per rank
// (stacked bars). The values map linearly to coordinates (svg_plot.h says how to read them
// back); series longer than kMaxPlottedPoints are decimated keeping each stretch's min and max.
#pragma once

#include <string>
#include <vector>

#include "cli/run_log.h"

namespace dstrain {

// The colour of the i-th run (Tableau 10, repeating after ten runs). The bar layers (memory
// categories, parts of the step time) take colours from another palette, none of these.
const std::string& run_color(size_t index);

// Gives runs whose file names are the same their paths as labels, and numbers exact repeats
// ("r.jsonl (2)"), so each legend entry names one run.
void make_labels_unique(std::vector<RunLog>& runs);

// The whole HTML page. REQUIRES: at least one run, each with a step record (parse_run_log
// guarantees it).
std::string render_report(const std::vector<RunLog>& runs, const std::string& title);

// The title when the user gives none: "dstrain run r.jsonl", "dstrain runs a.jsonl, b.jsonl".
std::string default_report_title(const std::vector<RunLog>& runs);

}  // namespace dstrain
