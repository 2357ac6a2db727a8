// --precision fp8 (model/fp8_linear.h) on CPU ranks: it trains to bf16's loss on both weight
// layouts (LLaMA's (out, in), GPT-2's (in, out) with biases), it is not bf16 (the FP8 GEMMs run),
// every plan trains it as one rank does (recompute, ZeRO-3 and offload to the bit; data,
// tensor and pipeline parallelism within bf16's tolerance, their sums added in another order),
// and a checkpoint resumes it to the bit with --precision fp8 remembered.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "core/check.h"
#include "tests/common/temp_dir.h"
#include "tests/train/small_model.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

// The Fp16AndBf16ReachTheFp32Loss run (tests/train/mixed_precision_test.cpp) of `model`.
TrainSummary train_to_learn(const std::string& model, const std::string& precision) {
  std::ostringstream out;
  return train(test::learning_run_options(model, precision), out);
}

TEST(Fp8Training, LlamaAndGpt2ReachTheBf16Loss) {
  for (const std::string model : {"llama-tiny", "tiny"}) {
    const TrainSummary bf16 = train_to_learn(model, "bf16");
    const TrainSummary fp8 = train_to_learn(model, "fp8");
    const double bf16_loss = bf16.final_eval_loss.value(), fp8_loss = fp8.final_eval_loss.value();
    std::cout << "  " << model << " eval loss after 150 steps: bf16 " << bf16_loss << ", fp8 "
              << fp8_loss << "\n";
    EXPECT_LT(bf16_loss, 2.0) << model;  // it learned the corpus beyond unigram statistics
    EXPECT_NEAR(fp8_loss, bf16_loss, 0.02 * bf16_loss) << model;
    EXPECT_NE(fp8.losses, bf16.losses) << model << ": the FP8 GEMMs round, bf16's do not";
  }
}

// llama-tiny (every projection a multiple of 16) on the small run's batch: 2 x 16 tokens per
// micro-batch, 8 micro-batches a step over the ranks.
TrainOptions fp8_options(const std::filesystem::path& dir, const std::string& name, int ranks) {
  TrainOptions options = test::small_run_options(dir, name, ranks);
  options.model = "llama-tiny";
  options.precision = "fp8";
  options.threads = ranks;
  return options;
}

test::LoggedRun train_logged(const TrainOptions& options) {
  std::ostringstream out;
  train(options, out);
  return test::read_logged_run(options);
}

// Also the cached FP8 weights: ZeRO-0 keeps each layer's from one micro-batch (and step) to
// the next, cast again after every optimizer step (model/fp8_linear.h Fp8Options), parameter
// offload casts them at each use: the same bits, step after step (a stale cache would train
// on old weights), with 4 micro-batches a step.
TEST(Fp8Training, RecomputeAndOffloadChangeNoBit) {
  testing::TempDir dir;
  for (int zero : {0, 3}) {
    TrainOptions plain_options = fp8_options(dir.path(), "plain" + std::to_string(zero), 2);
    plain_options.zero = zero;
    const test::LoggedRun plain = train_logged(plain_options);
    EXPECT_EQ(plain.config["plan"]["precision"], "fp8");
    TrainOptions other = plain_options;
    other.out += "_recompute_offload";
    other.log = other.out + ".jsonl";
    other.recompute = "full";  // the forward again, its casts again: the same bytes
    other.offload = true;
    other.offload_params = true;
    const test::LoggedRun run = train_logged(other);
    EXPECT_EQ(run.losses, plain.losses) << "ZeRO-" << zero;
    EXPECT_EQ(run.weights, plain.weights) << "ZeRO-" << zero;
  }
}

TEST(Fp8Training, DataTensorAndPipelineParallelTrainAsOneRank) {
  testing::TempDir dir;
  const test::LoggedRun one = train_logged(fp8_options(dir.path(), "one", 1));
  TrainOptions dp = fp8_options(dir.path(), "dp2_zero2", 2);
  dp.zero = 2;
  TrainOptions tp = fp8_options(dir.path(), "tp2", 2);
  tp.tp = 2;
  tp.grad_accum = test::kSmallRunMicroBatches;  // one data-parallel rank: the same batch
  TrainOptions pp = fp8_options(dir.path(), "pp2", 2);
  pp.pp = 2;
  pp.grad_accum = test::kSmallRunMicroBatches;
  for (const TrainOptions& options : {dp, tp, pp}) {
    // bf16's tolerance (tests/train/equivalence_test.cpp): the 16-bit sums round in another
    // order; under tp each rank also scales its own slice of a weight (its own amax).
    test::expect_same_training(one, train_logged(options), options.out, 1e-2, 3e-2, 0.1);
  }
}

TEST(Fp8Training, ResumesBitIdenticallyAndRemembersFp8) {
  testing::TempDir dir;
  TrainOptions straight = fp8_options(dir.path(), "straight", 2);
  straight.steps = 10;
  straight.save_every = 5;
  const test::LoggedRun all = train_logged(straight);
  TrainOptions resumed = fp8_options(dir.path(), "resumed", 2);
  resumed.model.clear();
  // Only these flags given, as on a command line: the rest (fp8 among them) from the checkpoint.
  resumed.precision = "fp32";
  resumed.explicit_flags = std::set<std::string>{
      "resume", "steps", "out", "log", "threads", "device", "quiet", "sample", "eval-every"};
  resumed.resume = straight.out + "/step-000005";
  resumed.steps = 10;
  const test::LoggedRun tail = train_logged(resumed);
  std::ifstream state(resumed.out + "/step-000010/trainer.json");
  EXPECT_EQ(nlohmann::json::parse(state)["plan"]["precision"], "fp8");
  ASSERT_EQ(tail.losses.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(tail.losses[i], all.losses[5 + i]) << "step " << 6 + i;
  EXPECT_EQ(tail.weights, all.weights);
}

// A micro-batch whose tokens the FP8 GEMMs cannot take is refused in one sentence, before
// anything runs (else no projection would run in FP8).
TEST(Fp8Training, AMicroBatchOfTokensNotAMultipleOf16IsRefused) {
  testing::TempDir dir;
  TrainOptions options = fp8_options(dir.path(), "odd", 1);
  options.batch = 1;
  options.seq_len = 24;
  std::ostringstream out;
  try {
    train(options, out);
    FAIL() << "trained";
  } catch (const UserError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("make a micro-batch's tokens (--batch 1 x --seq-len "
                        "24) a multiple of 16"),
              std::string::npos)
        << error.what();
  }
  EXPECT_FALSE(std::filesystem::exists(options.out));
}

}  // namespace
}  // namespace dstrain
