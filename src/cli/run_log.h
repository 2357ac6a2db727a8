// A training run's JSONL log (`dstrain --log FILE`) read back, for `dstrain report`.
//
// The records (one JSON object per line): {"type":"config",...} (absent on a resumed run's
// continuation, which appends to the same file), {"type":"data","entropy_floor":F,...},
// {"type":"memory","ranks":R,"peak_bytes":{category: bytes},"per_rank_peak_bytes":[{...}]},
// step records {"step":S,"loss":L,"lr":..,"grad_norm":..,"tokens_per_s":.., and optionally
// "loss_scale","skipped","mfu","time":{"step_s":..,"compute_s":..,...},"pipeline_bubble":[..]},
// eval records {"step":S,"eval_loss":L} and {"type":"summary",...}. Records of another type,
// and fields this reader does not know, are ignored.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dstrain {

struct StepRecord {
  int64_t step = 0;
  // NaN where the record has no finite value (JSON null: an fp16 overflow's inf).
  double loss = 0.0, lr = 0.0, grad_norm = 0.0, tokens_per_s = 0.0;
  std::optional<double> loss_scale;  // fp16 runs
  bool skipped = false;              // fp16: the step was skipped on overflow
  std::optional<double> mfu;         // a fraction of the GPUs' peak (GPU runs)
  // "time": seconds per step (mean over ranks) of the parts that add up to the step, those of
  // compute_s, comm_exposed_s, bubble_s, optimizer_s, other_s the record has, in this order;
  // step_s is the whole step, kept apart. Other keys of "time" are ignored.
  std::vector<std::pair<std::string, double>> time_parts;
  std::optional<double> step_seconds;
};

struct EvalRecord {
  int64_t step = 0;
  double eval_loss = 0.0;
};

// Peak bytes per memory category, per rank.
struct MemoryRecord {
  std::vector<std::string> categories;        // the order of the log
  std::vector<std::vector<double>> per_rank;  // [rank][category]
  // false: the log has only peak_bytes, the largest over `ranks` ranks per category
  // (per_rank then holds that one row).
  bool by_rank = false;
  int64_t ranks = 0;
};

struct RunLog {
  std::string path;
  std::string label;                    // the file's name (report_command makes labels unique)
  nlohmann::ordered_json config;        // the config record; null when the log has none
  std::optional<double> entropy_floor;  // synthetic data
  std::optional<MemoryRecord> memory;   // the last memory record
  std::vector<StepRecord> steps;        // ascending step
  std::vector<EvalRecord> evals;        // ascending step
  nlohmann::ordered_json summary;       // the last summary record; null when none
  std::vector<std::string> warnings;    // sentences for the user (a skipped torn line)
};

// Reads the log at `path`. Throws UserError (one sentence naming the file) when the file
// cannot be read, when a line is not a JSON object or a known record has a field of the wrong
// kind (naming the line number), or when the log has no step record. The last line alone may
// be torn (a run killed while writing it, the file not ending in a newline): it is skipped
// with a warning in `warnings`. A resumed run appends its steps after the last checkpoint's:
// when a step number comes again, the later records replace the earlier ones from that step
// on.
RunLog parse_run_log(const std::string& path);

// The same, from the text of a log; `path` only names it in messages.
RunLog parse_run_log_text(const std::string& text, const std::string& path);

}  // namespace dstrain
