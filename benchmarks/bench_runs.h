// What the benchmarks that time whole training runs share (bench_pipeline,
// bench_tensor_parallel): a scratch directory, a model config written for the run, statistics
// of the logged steps, and table formatting.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_main.h"
#include "core/check.h"
#include "topology/gpu_table.h"
#include "topology/topology.h"
#include "train/options.h"
#include "train/trainer.h"

namespace dstrain::bench {

namespace fs = std::filesystem;

// A scratch directory, removed with its contents at scope exit unless the user named it.
class WorkDir {
 public:
  WorkDir(const std::string& given, const std::string& program) : keep_(!given.empty()) {
    path_ = keep_ ? fs::path(given)
                  : fs::temp_directory_path() /
                        ("dstrain_" + program + "_" + std::to_string(::getpid()));
    if (!keep_) fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~WorkDir() {
    if (keep_) return;
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  WorkDir(const WorkDir&) = delete;
  WorkDir& operator=(const WorkDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  bool keep_;
};

// The shape of the timed runs, flags both benchmarks take; each sets its own defaults.
struct RunShape {
  int64_t layers = 4, n_embd = 256, heads = 8, vocab = 512;
  int64_t batch = 4, seq_len = 64, micro_batches = 4;
  int steps = 8, warmup = 2;
  std::string log_dir;  // empty: a temp directory
  bool help = false;
};

// Consumes `arg` when it is one of RunShape's flags (value() takes its value); false otherwise.
template <class Value>
bool parse_shape_flag(RunShape& s, const std::string& arg, Value&& value) {
  if (arg == "--help" || arg == "-h") {
    s.help = true;
  } else if (arg == "--layers") {
    s.layers = parse_int(arg, value(), 1);
  } else if (arg == "--n-embd") {
    s.n_embd = parse_int(arg, value(), 1);
  } else if (arg == "--heads") {
    s.heads = parse_int(arg, value(), 1);
  } else if (arg == "--vocab") {
    s.vocab = parse_int(arg, value(), 16);  // the synthetic corpus has 16 tokens
  } else if (arg == "--batch") {
    s.batch = parse_int(arg, value(), 1);
  } else if (arg == "--seq-len") {
    s.seq_len = parse_int(arg, value(), 2);
  } else if (arg == "--micro-batches") {
    s.micro_batches = parse_int(arg, value(), 1);
  } else if (arg == "--steps") {
    s.steps = static_cast<int>(parse_int(arg, value(), 1));
  } else if (arg == "--warmup") {
    s.warmup = static_cast<int>(parse_int(arg, value(), 0));
  } else if (arg == "--log-dir") {
    s.log_dir = value();
  } else {
    return false;
  }
  return true;
}

// Parses argv into `options` (a RunShape with more flags): RunShape's flags, then
// more_flag(options, arg, value) for the rest, which returns false for an unknown one. Checks
// the shape unless --help was given.
template <class Options, class MoreFlag>
Options parse_run_flags(int argc, char** argv, const char* usage, Options options,
                        MoreFlag&& more_flag) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      DSTRAIN_USER_CHECK(i + 1 < argc) << arg << " needs a value; " << usage;
      return argv[++i];
    };
    if (parse_shape_flag(options, arg, value)) continue;
    DSTRAIN_USER_CHECK(more_flag(options, arg, value))
        << "unknown argument '" << arg << "'; " << usage;
  }
  if (options.help) return options;
  DSTRAIN_USER_CHECK(options.n_embd % options.heads == 0)
      << "--heads " << options.heads << " must divide --n-embd " << options.n_embd;
  DSTRAIN_USER_CHECK(options.steps > options.warmup)
      << "--steps " << options.steps << " leaves no timed step after --warmup " << options.warmup;
  return options;
}

// The GPUs the cost model's predictions are for: H100 SXMs, every pair joined by 18 NVLinks
// (NVSwitch), so that the link terms are small, like the CPU ranks' shared-memory copies.
constexpr const char* kReferenceGpu = "h100-sxm";
constexpr int kReferenceNvlinks = 18;

// `gpus` reference GPUs; `source` names the benchmark in the topology's text.
inline NodeTopology reference_machine(int gpus, const std::string& source) {
  NodeTopology topology = make_topology(gpus);
  for (Link& link : topology.links) {
    link.kind = LinkKind::NVLink;
    link.nvlinks = kReferenceNvlinks;
  }
  apply_gpu_model(topology, lookup_gpu(kReferenceGpu));
  topology.source = source + "'s reference machine";
  topology.check_invariants();
  return topology;
}

// A GPT-2 config.json in `dir` (n_positions max(128, seq_len)); returns its path.
inline std::string write_gpt2_config(const fs::path& dir, int64_t layers, int64_t n_embd,
                                     int64_t heads, int64_t vocab, int64_t seq_len) {
  const fs::path path = dir / "config.json";
  const nlohmann::json config{{"model_type", "gpt2"},
                              {"vocab_size", vocab},
                              {"n_positions", std::max<int64_t>(128, seq_len)},
                              {"n_embd", n_embd},
                              {"n_layer", layers},
                              {"n_head", heads}};
  std::ofstream file(path);
  file << config.dump(2) << "\n";
  DSTRAIN_USER_CHECK(file.good()) << "cannot write the model config " << path.string();
  return path.string();
}

// The options of a timed run of `ranks` CPU ranks, one thread each (a rank stands for a GPU):
// the shape's model and batch, fp32, no evaluation or sample, quiet, logging to `log` (removed
// first). The caller adds the plan (tp, pp, ...).
inline TrainOptions timed_run_options(const RunShape& shape, const std::string& model, int ranks,
                                      const fs::path& log) {
  TrainOptions t;
  t.device = "cpu";
  t.model = model;
  t.batch = shape.batch;
  t.seq_len = shape.seq_len;
  t.grad_accum = shape.micro_batches;
  t.steps = shape.steps;
  t.precision = "fp32";
  t.gpus = ranks;
  t.threads = ranks;
  t.eval_every = 0;
  t.sample_tokens = 0;
  t.quiet = true;
  t.log = log.string();
  fs::remove(log);
  return t;
}

// What a timed run logged: the step records after the warm-up, each step's seconds (tokens per
// step / tokens_per_s), and the summary record.
struct TimedSteps {
  std::vector<nlohmann::json> records;
  std::vector<double> seconds;
  nlohmann::json summary;
};

// Trains `t` and reads its log.
inline TimedSteps train_timed(const RunShape& shape, const TrainOptions& t) {
  std::ostringstream progress;  // quiet: only the final lines
  train(t, progress);
  const double tokens_per_step =
      static_cast<double>(shape.batch * shape.seq_len * shape.micro_batches);
  TimedSteps steps;
  std::ifstream log(t.log);
  DSTRAIN_CHECK(log.good()) << "the run wrote no log at " << t.log;
  for (std::string line; std::getline(log, line);) {
    nlohmann::json record = nlohmann::json::parse(line);
    if (record.value("type", "") == "summary") steps.summary = record;
    if (!record.contains("tokens_per_s") || !record.contains("step")) continue;
    if (record["step"].get<int64_t>() <= shape.warmup) continue;
    steps.seconds.push_back(tokens_per_step / record["tokens_per_s"].get<double>());
    steps.records.push_back(std::move(record));
  }
  DSTRAIN_CHECK(static_cast<int>(steps.seconds.size()) == shape.steps - shape.warmup)
      << steps.seconds.size() << " timed steps in " << t.log;
  return steps;
}

inline double median(std::vector<double> values) {
  DSTRAIN_CHECK(!values.empty());
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

inline double mean(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v;
  return values.empty() ? 0 : sum / static_cast<double>(values.size());
}

inline std::string fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  return text;
}

inline std::string list_text(const std::vector<double>& values, int decimals) {
  std::string text;
  for (double v : values) text += (text.empty() ? "" : ", ") + fixed(v, decimals);
  return text;
}

// The main of a benchmark of several cases: parse(argc, argv) gives options with a `help`
// flag (then the usage and help text are printed), run(options) the cases' status: 1 when a
// case failed (its row says why), which main returns after the table.
template <class Parse, class Run>
int cases_main(const char* program, int argc, char** argv, const char* usage, const char* help,
               Parse&& parse, Run&& run) {
  int cases_status = 0;
  const int status = benchmark_main(program, [&] {
    const auto options = parse(argc, argv);
    if (options.help) {
      std::printf("%s\n\n%s", usage, help);
      return;
    }
    cases_status = run(options);
  });
  return status != 0 ? status : cases_status;
}

}  // namespace dstrain::bench
