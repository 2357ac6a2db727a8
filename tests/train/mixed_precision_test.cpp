// fp16 and bf16 training: the gradient scaler's semantics (PyTorch GradScaler's), an overflow
// on one rank skipping the step everywhere, and fp16 training reaching fp32's loss.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "core/rng.h"
#include "optim/grad_scaler.h"
#include "tests/common/temp_dir.h"
#include "tests/train/small_model.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

TEST(GradScaler, PyTorchDefaultsBackoffAndGrowth) {
  GradScaler scaler(true);
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_TRUE(scaler.update(true));  // overflow: skip and halve
  EXPECT_EQ(scaler.scale(), 32768.0);
  for (int i = 0; i < 1999; ++i) ASSERT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 32768.0);  // not yet: 1999 clean steps
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 65536.0);  // the 2000th clean step doubles it
  EXPECT_EQ(scaler.growth_tracker(), 0);
  for (int i = 0; i < 1500; ++i) scaler.update(false);
  EXPECT_TRUE(scaler.update(true));    // an overflow resets the count
  EXPECT_EQ(scaler.growth_tracker(), 0);
  for (int i = 0; i < 1999; ++i) scaler.update(false);
  EXPECT_EQ(scaler.scale(), 32768.0);

  GradScaler restored(true);
  restored.restore(scaler.state());
  EXPECT_EQ(restored.scale(), scaler.scale());
  EXPECT_EQ(restored.growth_tracker(), scaler.growth_tracker());
  EXPECT_THROW(restored.restore(nlohmann::json{{"scale", -1.0}, {"growth_tracker", 0}}), UserError);

  GradScaler disabled(false);  // fp32 / bf16
  EXPECT_EQ(disabled.scale(), 1.0);
  EXPECT_FALSE(disabled.update(true));
}

// DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py, consecutive_hysteresis off),
// written from its update rule: an overflow halves the scale (not below min) only once the
// hysteresis is used up, else spends one; a step is a growth step when the steps since the last
// overflow are a multiple of the window, and it doubles the scale and restores the hysteresis.
struct DeepSpeedScaler {
  double scale;
  int64_t window, delayed_shift, hysteresis;
  double min_scale;
  int64_t iter = 0, last_overflow = -1;
  void update(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || hysteresis == 1) {
        scale = std::max(scale / 2, min_scale);
      } else {
        --hysteresis;
      }
      last_overflow = iter;
    } else if ((iter - last_overflow) % window == 0) {
      hysteresis = delayed_shift;
      scale *= 2;
    }
    ++iter;
  }
};

TEST(GradScaler, DeepSpeedHysteresisFloorAndWindowFollowDeepSpeedsRule) {
  const LossScaling settings{256.0, 7, 3, 16.0};
  GradScaler scaler(true, settings);
  DeepSpeedScaler reference{256.0, 7, 3, 3, 16.0};
  Rng rng(11);
  int overflows = 0, growths = 0, floored = 0;
  for (int step = 0; step < 3000; ++step) {
    // Bursts of overflows and long clean runs, so that every branch is taken.
    const bool overflow = rng.uniform() < (step % 400 < 100 ? 0.45 : 0.04);
    const double before = scaler.scale();
    EXPECT_EQ(scaler.update(overflow), overflow) << "every overflow skips its step";
    reference.update(overflow);
    ASSERT_EQ(scaler.scale(), reference.scale) << "step " << step;
    overflows += overflow;
    growths += scaler.scale() > before;
    floored += overflow && scaler.scale() == 16.0;
  }
  EXPECT_GT(overflows, 100);
  EXPECT_GT(growths, 20);
  EXPECT_GT(floored, 5) << "the floor was reached";
  // The state carries the hysteresis left across a resume.
  GradScaler resumed(true, settings);
  resumed.restore(scaler.state());
  EXPECT_EQ(resumed.state(), scaler.state());
}

class MixedPrecisionTest : public ::testing::Test {
 protected:
  testing::TempDir temp_;
  const fs::path& dir_ = temp_.path();
};

std::vector<nlohmann::json> step_records(const std::string& path) {
  std::vector<nlohmann::json> steps;
  std::ifstream log(path);
  for (std::string line; std::getline(log, line);) {
    nlohmann::json record = nlohmann::json::parse(line);
    if (record.contains("loss") && record.contains("step")) steps.push_back(record);
  }
  return steps;
}

std::string slurp(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

TEST_F(MixedPrecisionTest, OverflowOnOneRankSkipsTheStepEverywhere) {
  // ZeRO 0 and 3, and ZeRO-3 with everything offloaded (the gradients checked on the host's
  // copy, brought to the device block by block).
  for (const auto& [zero, offloaded] :
       {std::pair{0, false}, std::pair{3, false}, std::pair{3, true}}) {
    TrainOptions options;
    options.offload = options.offload_params = offloaded;
    options.device = "cpu";
    options.model = "tiny";
    options.precision = "fp16";
    options.gpus = 4;
    options.zero = zero;
    options.batch = 2;
    options.seq_len = 16;
    options.steps = 6;
    options.eval_every = 0;
    options.sample_tokens = 0;
    options.quiet = true;
    options.threads = 4;
    options.test.inject_inf_step = 4;  // rank 2 overflows at step 4
    options.test.inject_inf_rank = 2;
    const std::string name = std::to_string(zero) + (offloaded ? "_offloaded" : "");
    options.out = (dir_ / ("run" + name)).string();
    options.save_every = 1;
    options.log = (dir_ / ("log" + name + ".jsonl")).string();
    std::ostringstream out;
    const TrainSummary summary = train(options, out);
    EXPECT_EQ(summary.skipped_steps, 1);

    const auto steps = step_records(options.log);
    ASSERT_EQ(steps.size(), 6u);
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(steps[i]["skipped"].get<bool>(), i == 3) << "step " << i + 1;
      EXPECT_EQ(steps[i]["loss_scale"].get<double>(), i <= 3 ? 65536.0 : 32768.0) << i + 1;
      EXPECT_TRUE(std::isfinite(steps[i]["loss"].get<double>()));
    }
    // The skipped step changed no weight and no optimizer state; the next ones did.
    const fs::path run(options.out);
    EXPECT_EQ(slurp(run / "step-000003/model.safetensors"),
              slurp(run / "step-000004/model.safetensors"));
    EXPECT_EQ(slurp(run / "step-000003/optimizer.safetensors"),
              slurp(run / "step-000004/optimizer.safetensors"));
    EXPECT_NE(slurp(run / "step-000004/model.safetensors"),
              slurp(run / "step-000005/model.safetensors"));
    // The scaler's state is in the checkpoint.
    const nlohmann::json trainer = nlohmann::json::parse(slurp(run / "step-000006/trainer.json"));
    EXPECT_EQ(trainer["scaler"]["scale"].get<double>(), 32768.0);
    EXPECT_EQ(trainer["adam_step"].get<int64_t>(), 5);
  }
}

TEST_F(MixedPrecisionTest, Fp16AndBf16ReachTheFp32Loss) {
  // Long enough that the model learns the corpus's structure: the loss falls from ln 16 = 2.77
  // to below 2.0 in this many steps.
  auto run = [&](const std::string& precision) {
    std::ostringstream out;
    return train(test::learning_run_options("tiny", precision), out).final_eval_loss.value();
  };
  const double fp32 = run("fp32");
  const double fp16 = run("fp16");
  const double bf16 = run("bf16");
  std::cout << "  eval loss after 150 steps: fp32 " << fp32 << ", fp16 " << fp16 << ", bf16 "
            << bf16 << "\n";
  EXPECT_LT(fp32, 2.0);  // it learned something beyond unigram statistics
  EXPECT_NEAR(fp16, fp32, 0.02 * fp32);
  EXPECT_NEAR(bf16, fp32, 0.05 * fp32);
}

}  // namespace
}  // namespace dstrain
