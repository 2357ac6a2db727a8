// The heart of the distributed algorithm: every plan trains to the same numbers as one rank.
// A small model, 20 optimizer steps in fp32, the same global batch (micro-batch x
// accumulation x ranks = 2 x 8 sequences), against {2, 4, 8} ranks x ZeRO {0, 1, 2, 3} x
// offload {off, on} x recompute {none, full}.
//
// Tolerances: per-step losses within 1e-6 relative and final weights within 1e-5 absolute.
// They are not bitwise equal: one rank adds the 8 micro-batch gradients one after another,
// N ranks add their own and then reduce across ranks, a different summation order in fp32.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "tests/train/small_model.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

const fs::path kDir = fs::temp_directory_path() / ("dstrain_equivalence_" + std::to_string(::getpid()));
// Removes the runs' files when the test process ends.
const struct Cleanup {
  ~Cleanup() { fs::remove_all(kDir); }
} cleanup;
constexpr int kSteps = test::kSmallRunSteps;
constexpr int kGlobalMicroBatches = test::kSmallRunMicroBatches;

std::string small_model_config() { return test::write_small_model_config(kDir); }

struct RunResult {
  std::vector<double> losses;
  nlohmann::json memory;  // peak bytes by category, largest over ranks
  nlohmann::json device_memory, host_memory;  // the same of each allocator
  std::map<std::string, std::vector<float>> weights;
};

// precision: "fp32" or not (then the run's name says it, as it says parameter offload).
RunResult run(int ranks, int zero, bool offload, bool recompute, bool offload_params = false,
              const std::string& precision = "fp32") {
  const bool fp32 = precision == "fp32";
  const std::string name = "r" + std::to_string(ranks) + "_z" + std::to_string(zero) +
                           (offload ? "_offload" : "") + (offload_params ? "_params" : "") +
                           (recompute ? "_recompute" : "") + (fp32 ? "" : "_" + precision);
  TrainOptions options = test::small_run_options(kDir, name, ranks);
  options.zero = zero;
  options.offload = offload;
  options.offload_params = offload_params;
  options.precision = precision;
  options.recompute = recompute ? "full" : "none";
  options.threads = ranks;  // one thread per rank
  std::ostringstream out;
  train(options, out);

  RunResult result;
  std::ifstream log(options.log);
  for (std::string line; std::getline(log, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (record.contains("loss")) result.losses.push_back(record["loss"]);
    if (record.value("type", "") == "memory") {
      result.memory = record["peak_bytes"];
      result.device_memory = record["device_peak_bytes"];
      result.host_memory = record["host_peak_bytes"];
    }
  }
  result.weights = test::final_weights(options);
  return result;
}

// 2 ranks at ZeRO `zero`, fp32, no offload or recompute: run once for every test that wants it.
const RunResult& run_once(int ranks, int zero) {
  static std::map<std::pair<int, int>, RunResult> runs;
  auto it = runs.find({ranks, zero});
  if (it == runs.end()) it = runs.emplace(std::make_pair(ranks, zero), run(ranks, zero, false, false)).first;
  return it->second;
}

const RunResult& reference() {
  static const RunResult result = run(1, 0, false, false);
  return result;
}

class Equivalence : public ::testing::TestWithParam<std::tuple<int, int, bool, bool>> {};

TEST_P(Equivalence, SameLossesAndWeightsAsOneRank) {
  const auto [ranks, zero, offload, recompute] = GetParam();
  const RunResult& one = reference();
  const RunResult many = run(ranks, zero, offload, recompute);
  ASSERT_EQ(one.losses.size(), size_t(kSteps));
  ASSERT_EQ(many.losses.size(), size_t(kSteps));
  // The loss moves: the comparison is not between two untrained models.
  EXPECT_LT(one.losses.back(), one.losses.front() - 0.1);
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(many.losses[step], one.losses[step], 1e-6 * one.losses[step]) << "step " << step + 1;
  }
  const double max_error = test::max_weight_difference(one.weights, many.weights);
  EXPECT_LT(max_error, 1e-5);
  std::cout << "  " << ranks << " ranks, ZeRO-" << zero << (offload ? " + offload" : "")
            << (recompute ? " + recompute" : "") << ": max |weight difference| " << max_error << "\n";

  // Memory per rank by category against the ZeRO forms (fp32: 4 bytes of parameters, 4 of
  // gradients, 8 of Adam moments per parameter, divided by N for what is sharded; small
  // relative slack for alignment and shard padding).
  const double P = double(one.memory["parameters"].get<size_t>()) / 4.0;  // elements, one rank
  auto expect_bytes = [&](const char* category, double expected) {
    const double got = double(many.memory[category].get<size_t>());
    EXPECT_NEAR(got, expected, 0.02 * expected + 4.0 * 64 * ranks) << category;
  };
  expect_bytes("parameters", 4 * P / (zero >= 3 ? ranks : 1));
  expect_bytes("gradients", 4 * P / (zero >= 2 ? ranks : 1));
  if (offload) {
    EXPECT_EQ(many.memory["optimizer_state"].get<size_t>(), 0u);
    expect_bytes("optimizer_state_host", 12 * P / (zero >= 1 ? ranks : 1));  // master + m + v
  } else {
    expect_bytes("optimizer_state", 8 * P / (zero >= 1 ? ranks : 1));
    EXPECT_EQ(many.memory["optimizer_state_host"].get<size_t>(), 0u);
  }
  if (zero >= 3) EXPECT_GT(many.memory["gathered_params"].get<size_t>(), 0u);
  else EXPECT_EQ(many.memory["gathered_params"].get<size_t>(), 0u);
}

// Offload moves the optimizer to the host (a vectorized AdamW there) and recompute drops
// activations: neither may change a bit.
TEST(EquivalenceBitwise, OffloadAndRecomputeChangeNoBit) {
  for (int zero : {0, 3}) {
    const RunResult& plain = run_once(2, zero);
    const RunResult offload = run(2, zero, true, false);
    const RunResult recompute = run(2, zero, false, true);
    EXPECT_EQ(offload.losses, plain.losses) << "ZeRO-" << zero;
    EXPECT_EQ(recompute.losses, plain.losses) << "ZeRO-" << zero;
    EXPECT_EQ(offload.weights, plain.weights) << "ZeRO-" << zero;
    EXPECT_EQ(recompute.weights, plain.weights) << "ZeRO-" << zero;
  }
}

// Parameter offload keeps the working parameters and gradients in host memory and brings each
// block to the "device" when it is needed (on CPU ranks the two memories are one, but the
// buffers, the copies and the order of every operation are the GPU's): it may not change a
// bit, with the optimizer on the device or offloaded too, at every ZeRO stage (the gradients'
// host sums at stages 0-1, the reduced shards at 2-3), with accumulation over micro-batches,
// in fp32 and in bf16 (the 16-bit sums and the master copy), with recompute.
TEST(EquivalenceBitwise, ParameterOffloadChangesNoBit) {
  for (const std::string precision : {"fp32", "bf16"}) {
    for (int zero : {0, 1, 2, 3}) {
      if (precision == "bf16" && (zero == 1 || zero == 2)) continue;
      // (The other tests' fp32 run of this plan, or this one's own.)
      const RunResult plain = precision == "fp32" && (zero == 0 || zero == 3)
                                  ? run_once(2, zero)
                                  : run(2, zero, false, false, false, precision);
      const RunResult params = run(2, zero, false, zero == 3, true, precision);
      const RunResult all = run(2, zero, true, false, true, precision);
      ASSERT_EQ(plain.losses.size(), size_t(kSteps));
      const std::string what = precision + " ZeRO-" + std::to_string(zero);
      EXPECT_EQ(params.losses, plain.losses) << what << ", params offloaded";
      EXPECT_EQ(params.weights, plain.weights) << what << ", params offloaded";
      EXPECT_EQ(all.losses, plain.losses) << what << ", params and optimizer offloaded";
      EXPECT_EQ(all.weights, plain.weights) << what << ", params and optimizer offloaded";
      // Nothing of the model's state stays on the device but the blocks in flight.
      EXPECT_GT(all.device_memory["gathered_params"].get<size_t>(), 0u) << what;
      for (const char* state : {"parameters", "gradients", "master_weights", "optimizer_state"}) {
        EXPECT_EQ(all.device_memory[state].get<size_t>(), 0u) << what << ": " << state;
      }
      EXPECT_EQ(all.host_memory["parameters"], plain.device_memory["parameters"]) << what;
      EXPECT_EQ(all.host_memory["gradients"], plain.device_memory["gradients"]) << what;
    }
  }
}

// bf16 optimizer states (--bf16-optimizer-states, with the optimizer on the host): the moments
// are rounded to bf16 after every step, so the run differs from fp32 moments, but stays close
// and trains; 2 ranks at ZeRO-3 with the parameters offloaded too train as 1 rank; and a
// checkpoint (moments written widened to fp32, exactly) resumes to the same bits.
TEST(EquivalenceBf16States, TrainAsOneRankAndResumeBitwise) {
  auto options_for = [&](const std::string& name, int ranks, int zero) {
    TrainOptions options = test::small_run_options(kDir, name, ranks);
    options.zero = zero;
    options.offload = true;
    options.offload_params = ranks > 1;
    options.bf16_optimizer_states = true;
    options.precision = "bf16";
    options.threads = ranks;
    return options;
  };
  auto train_and_read = [](const TrainOptions& options) {
    std::ostringstream out;
    train(options, out);
    return test::read_logged_run(options);
  };
  const test::LoggedRun one = train_and_read(options_for("bf16_states_r1", 1, 0));
  const test::LoggedRun many = train_and_read(options_for("bf16_states_r2", 2, 3));
  const RunResult fp32_states = run(2, 0, true, false, false, "bf16");
  ASSERT_EQ(one.losses.size(), size_t(kSteps));
  EXPECT_LT(one.losses.back(), one.losses.front() - 0.1);
  for (int step = 0; step < kSteps; ++step) {
    // bf16 runs: the 16-bit sums' rounding flips with the order of the additions (see the top).
    EXPECT_NEAR(many.losses[step], one.losses[step], 1e-2 * one.losses[step]) << step + 1;
    EXPECT_NEAR(one.losses[step], fp32_states.losses[step], 2e-2 * fp32_states.losses[step])
        << step + 1;
  }
  EXPECT_NE(one.losses, fp32_states.losses) << "bf16 moments round: not the fp32 run";
  EXPECT_EQ(one.config["plan"]["bf16_optimizer_states"], true);

  TrainOptions straight = options_for("bf16_states_straight", 2, 3);
  straight.steps = 10;
  straight.save_every = 5;
  const test::LoggedRun all = train_and_read(straight);
  TrainOptions resumed = options_for("bf16_states_resumed", 2, 3);
  resumed.model.clear();
  resumed.resume = straight.out + "/step-000005";
  resumed.steps = 10;
  const test::LoggedRun tail = train_and_read(resumed);
  ASSERT_EQ(tail.losses.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(tail.losses[i], all.losses[5 + i]) << "step " << 6 + i;
}

// A checkpoint is layout-independent: resuming with another number of ranks or ZeRO stage
// (the same micro-batches per step) continues with the same losses.
TEST(EquivalenceResume, AnotherRankCountOrZeroStageContinuesTheSameRun) {
  struct Leg {
    int ranks, zero;
    bool offload;
  };
  const Leg legs[][2] = {{{1, 0, false}, {4, 3, false}},
                         {{4, 2, true}, {2, 1, false}},
                         {{2, 3, false}, {1, 0, true}}};
  int index = 0;
  for (const auto& [first, second] : legs) {
    const std::string base = (kDir / ("resume" + std::to_string(index++))).string();
    auto options_for = [&](const Leg& leg, const std::string& name) {
      TrainOptions options;
      options.device = "cpu";
      options.model = small_model_config();
      options.batch = 2;
      options.seq_len = 16;
      options.gpus = leg.ranks;
      options.grad_accum = kGlobalMicroBatches / leg.ranks;
      options.zero = leg.zero;
      options.offload = leg.offload;
      options.steps = 10;
      options.lr = 3e-3;
      options.warmup = 2;
      options.eval_every = 0;
      options.sample_tokens = 0;
      options.quiet = true;
      options.threads = leg.ranks;
      options.log = base + name + ".jsonl";
      options.out = base + name;
      return options;
    };
    TrainOptions straight = options_for(first, "straight");
    straight.save_every = 5;
    std::ostringstream out;
    train(straight, out);
    TrainOptions resumed = options_for(second, "resumed");
    resumed.model.clear();
    resumed.resume = base + "straight/step-000005";
    train(resumed, out);
    auto losses = [](const std::string& path) {
      std::vector<double> result;
      std::ifstream log(path);
      for (std::string line; std::getline(log, line);) {
        const nlohmann::json record = nlohmann::json::parse(line);
        if (record.contains("loss")) result.push_back(record["loss"]);
      }
      return result;
    };
    const std::vector<double> all = losses(straight.log), tail = losses(resumed.log);
    ASSERT_EQ(all.size(), 10u);
    ASSERT_EQ(tail.size(), 5u);
    for (int i = 0; i < 5; ++i) {
      EXPECT_NEAR(tail[i], all[5 + i], 1e-6 * all[5 + i])
          << first.ranks << " ranks ZeRO-" << first.zero << " -> " << second.ranks
          << " ranks ZeRO-" << second.zero << ", step " << 6 + i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Plans, Equivalence,
    ::testing::Combine(::testing::Values(2, 4, 8), ::testing::Values(0, 1, 2, 3),
                       ::testing::Bool(), ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<int, int, bool, bool>>& info) {
      return "ranks" + std::to_string(std::get<0>(info.param)) + "_zero" +
             std::to_string(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_offload" : "") +
             (std::get<3>(info.param) ? "_recompute" : "");
    });

}  // namespace
}  // namespace dstrain
