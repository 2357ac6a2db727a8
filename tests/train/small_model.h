// The small model and run of the training tests that compare plans or backends
// (tests/train/equivalence_test.cpp, cuda_train_test.cpp): 2 layers, 24 channels, 3 heads, a
// vocabulary of 37; 20 fp32 steps of 8 micro-batches of 2 x 16 tokens. Small enough for many
// plans in seconds, long enough that the loss falls clearly.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/safetensors.h"
#include "tests/common/temp_dir.h"
#include "train/options.h"
#include "train/weight_files.h"

namespace dstrain::test {

constexpr int kSmallRunSteps = 20;
constexpr int kSmallRunMicroBatches = 8;  // per step, over all ranks

// Writes the model's config.json into `dir` (created if needed); returns its path. Pipeline
// tests use 4 layers (pp up to 4); tensor-parallel runs 4 heads (of 6 channels: tp 2 splits them).
inline std::string write_small_model_config(const std::filesystem::path& dir, int layers = 2,
                                            int heads = 3) {
  const std::filesystem::path sub =
      dir / ("model_" + std::to_string(layers) + (heads == 3 ? "" : "_h" + std::to_string(heads)));
  std::filesystem::create_directories(sub);
  const std::filesystem::path path = sub / "config.json";
  std::ofstream(path) << R"({"model_type": "gpt2", "vocab_size": 37, "n_positions": 32,
                            "n_embd": 24, "n_layer": )"
                      << layers << R"(, "n_head": )" << heads << "}";
  return path.string();
}

// A run long enough to learn the synthetic corpus's structure (the loss falls from ln 16 = 2.77
// to below 2.0): `model` in `precision`, 150 steps of 8 x 32 tokens, one evaluation at the end.
inline TrainOptions learning_run_options(const std::string& model, const std::string& precision) {
  TrainOptions options;
  options.device = "cpu";
  options.model = model;
  options.precision = precision;
  options.batch = 8;
  options.seq_len = 32;
  options.steps = 150;
  options.eval_every = 150;
  options.eval_batches = 8;
  options.sample_tokens = 0;
  options.quiet = true;
  options.threads = 2;
  return options;
}

// The run on `ranks` CPU ranks (the same global batch for every rank count), its log at
// dir/name.jsonl and its final checkpoint under dir/name.
inline TrainOptions small_run_options(const std::filesystem::path& dir, const std::string& name,
                                      int ranks) {
  TrainOptions options;
  options.device = "cpu";  // the CPU backend's simulated ranks, on a machine with a GPU too
  options.model = write_small_model_config(dir);
  options.batch = 2;
  options.seq_len = 16;
  options.gpus = ranks;
  options.grad_accum = kSmallRunMicroBatches / ranks;
  options.steps = kSmallRunSteps;
  options.lr = 3e-3;
  options.warmup = 2;
  options.eval_every = 0;
  options.sample_tokens = 0;
  options.quiet = true;
  options.log = (dir / (name + ".jsonl")).string();
  options.out = (dir / name).string();
  return options;
}

// A token stream a small model can learn, written once to dir/tokens.u16 (raw uint16): mostly
// the next token is (multiplier * token + increment) mod vocab, sometimes one or two more.
inline std::string write_learnable_tokens(const std::filesystem::path& dir, uint32_t vocab,
                                          uint32_t multiplier, uint32_t increment,
                                          uint64_t seed) {
  const std::filesystem::path path = dir / "tokens.u16";
  if (std::filesystem::exists(path)) return path.string();
  Rng rng(seed, 0);
  std::vector<uint16_t> tokens(40000);
  uint32_t token = 7 % vocab;
  for (uint16_t& t : tokens) {
    const double u = rng.uniform();
    token = (multiplier * token + increment + (u < 0.8 ? 0 : u < 0.9 ? 1 : 2)) % vocab;
    t = static_cast<uint16_t>(token);
  }
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()),
             static_cast<std::streamsize>(tokens.size() * sizeof(uint16_t)));
  return path.string();
}

// Every tensor of the run's final checkpoint, as fp32.
inline std::map<std::string, std::vector<float>> final_weights(const TrainOptions& options) {
  char step[16];
  std::snprintf(step, sizeof step, "%06lld", static_cast<long long>(options.steps));
  // model.safetensors, or its shards.
  const WeightFiles files = WeightFiles::open(options.out + "/step-" + step);
  std::map<std::string, std::vector<float>> weights;
  for (const std::string& tensor : files.names()) {
    weights[tensor] = files.file_of(tensor).read_f32(tensor);
  }
  return weights;
}

// The largest |a - b| over every element of every tensor (tensors of `a` looked up in `b`).
inline double max_weight_difference(const std::map<std::string, std::vector<float>>& a,
                                    const std::map<std::string, std::vector<float>>& b) {
  double worst = 0.0;
  for (const auto& [name, expected] : a) {
    const std::vector<float>& got = b.at(name);
    if (got.size() != expected.size()) return INFINITY;
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, std::abs(double(got[i]) - expected[i]));
    }
  }
  return worst;
}

// What a run left: its log's step records and config record, and its final weights.
struct LoggedRun {
  std::vector<double> losses;
  std::vector<nlohmann::json> steps;
  nlohmann::json config;  // the log's config record
  std::map<std::string, std::vector<float>> weights;
  std::string output;  // what train() printed, where the caller kept it
};

inline LoggedRun read_logged_run(const TrainOptions& options) {
  LoggedRun result;
  std::ifstream log(options.log);
  for (std::string line; std::getline(log, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (record.contains("loss")) {
      result.losses.push_back(record["loss"]);
      result.steps.push_back(record);
    }
    if (record.value("type", "") == "config") result.config = record;
  }
  result.weights = final_weights(options);
  return result;
}

// `many` trained to `one`'s numbers: every step's loss within loss_tolerance (relative) and
// every final weight within weight_tolerance (absolute); `one`'s loss fell by at least
// `min_fall`, so the comparison means something. Prints the largest weight difference.
inline void expect_same_training(const LoggedRun& one, const LoggedRun& many,
                                 const std::string& name, double loss_tolerance,
                                 double weight_tolerance, double min_fall) {
  ASSERT_EQ(one.losses.size(), size_t(kSmallRunSteps));
  ASSERT_EQ(many.losses.size(), size_t(kSmallRunSteps));
  EXPECT_LT(one.losses.back(), one.losses.front() - min_fall);
  for (int step = 0; step < kSmallRunSteps; ++step) {
    EXPECT_NEAR(many.losses[step], one.losses[step], loss_tolerance * one.losses[step])
        << "step " << step + 1;
  }
  const double error = max_weight_difference(one.weights, many.weights);
  EXPECT_LT(error, weight_tolerance);
  std::cout << "  " << name << ": max |weight difference| " << error << "\n";
}

// A fixture comparing plans (a Spec with name(); Spec{} is one rank) with one rank: Train trains
// a plan in a directory and reads its log. The one-rank run is trained once per test binary.
template <class Spec, LoggedRun (*Train)(const std::filesystem::path&, const Spec&)>
class SameAsOneRank : public ::testing::Test {
 protected:
  static const LoggedRun& reference() {
    static testing::TempDir dir;
    static const LoggedRun result = Train(dir.path(), Spec{});
    return result;
  }
  void expect_same_as_one_rank(const Spec& spec, double loss_tolerance, double weight_tolerance,
                               double min_fall) {
    SCOPED_TRACE(spec.name());
    expect_same_training(reference(), Train(temp_.path(), spec), spec.name(), loss_tolerance,
                         weight_tolerance, min_fall);
  }
  testing::TempDir temp_;
};

}  // namespace dstrain::test
