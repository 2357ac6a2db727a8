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
#include <string>
#include <vector>

#include "benchmarks/bench_main.h"
#include "core/check.h"

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
