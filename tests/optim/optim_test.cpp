// LR schedules, the clip coefficient, and AdamW over a block with per-tensor weight decay.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "optim/adamw.h"
#include "optim/schedule.h"

namespace dstrain {
namespace {

TEST(LrSchedule, WarmupThenCosineToTheFloor) {
  const LrScheduleConfig config{LrSchedule::Cosine, 1e-3, 1e-4, 10, 110};
  EXPECT_DOUBLE_EQ(learning_rate(config, 0), 1e-4);      // (0+1)/10 of the peak
  EXPECT_DOUBLE_EQ(learning_rate(config, 9), 1e-3);      // the end of the warmup
  EXPECT_DOUBLE_EQ(learning_rate(config, 10), 1e-3);     // cosine starts at the peak
  EXPECT_NEAR(learning_rate(config, 60), 5.5e-4, 1e-15);  // halfway: the mean of peak and floor
  EXPECT_NEAR(learning_rate(config, 110), 1e-4, 1e-15);   // reaches the floor
  for (int64_t s = 10; s < 110; ++s) {
    EXPECT_LE(learning_rate(config, s + 1), learning_rate(config, s)) << s;
  }
}

// DeepSpeed's schedulers step for step: the learning rates of optimizer steps 1, 2, ... as
// deepspeedai/DeepSpeed edaa722's deepspeed/runtime/lr_schedules.py gives them (its classes run
// on the CPU with a stand-in for torch, stepped as its engine steps them: once after each
// applied step, the first step at the constructor's value).
TEST(LrSchedule, DeepSpeedsSchedulersStepForStep) {
  struct Row {
    LrScheduleConfig config;
    std::vector<double> rates;  // steps 1, 2, ...
  };
  const auto schedule = [](LrSchedule kind, double lr, double min_lr, int64_t warmup,
                           int64_t total, WarmupType type, double warmup_min_lr) {
    return LrScheduleConfig{kind, lr, min_lr, warmup, total, type, warmup_min_lr};
  };
  const std::vector<Row> rows = {
      // WarmupLR(warmup_min_lr=0, warmup_max_lr=1, warmup_num_steps=4), log and linear.
      {schedule(LrSchedule::WarmupLr, 1.0, 0.0, 4, 0, WarmupType::Log, 0.0),
       {0.0, 0.0, 0.5, 0.792481250360578, 1.0, 1.0, 1.0}},
      {schedule(LrSchedule::WarmupLr, 1.0, 0.0, 4, 0, WarmupType::Linear, 0.0),
       {0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0}},
      // warmup_num_steps=1 is max(2, 1).
      {schedule(LrSchedule::WarmupLr, 1.0, 0.0, 1, 0, WarmupType::Log, 0.0), {0.0, 0.0, 1.0, 1.0}},
      // WarmupDecayLR(total_num_steps=10, warmup_num_steps=4, linear, min 0, max 1).
      {schedule(LrSchedule::WarmupDecayLr, 1.0, 0.0, 4, 10, WarmupType::Linear, 0.0),
       {0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 5.0 / 6, 4.0 / 6, 3.0 / 6, 2.0 / 6, 1.0 / 6, 0.0, 0.0}},
      // WarmupCosineLR(total_num_steps=10, warmup_num_steps=4, linear, warmup_min_ratio=0.1,
      // cos_min_ratio=0.2) of an optimizer lr of 1.
      {schedule(LrSchedule::WarmupCosineLr, 1.0, 0.2, 4, 10, WarmupType::Linear, 0.1),
       {0.0, 0.1, 0.325, 0.55, 0.775, 0.946410161513775, 0.8, 0.6, 0.4, 0.253589838486225, 0.2,
        0.2, 0.2}},
  };
  for (const Row& row : rows) {
    for (size_t k = 0; k < row.rates.size(); ++k) {
      EXPECT_NEAR(learning_rate(row.config, static_cast<int64_t>(k)), row.rates[k], 1e-12)
          << lr_schedule_name(row.config.kind) << ", step " << k + 1;
    }
  }
  EXPECT_EQ(parse_lr_schedule("warmup-cosine-lr"), LrSchedule::WarmupCosineLr);
  EXPECT_EQ(parse_warmup_type("log"), WarmupType::Log);
  EXPECT_THROW(parse_warmup_type("exp"), UserError);
}

TEST(LrSchedule, ConstantAfterWarmupAndNames) {
  const LrScheduleConfig config{LrSchedule::Constant, 3e-4, 0.0, 4, 100};
  EXPECT_DOUBLE_EQ(learning_rate(config, 1), 1.5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(config, 50), 3e-4);
  const LrScheduleConfig no_warmup{LrSchedule::Constant, 3e-4, 0.0, 0, 100};
  EXPECT_DOUBLE_EQ(learning_rate(no_warmup, 0), 3e-4);
  EXPECT_EQ(parse_lr_schedule("cosine"), LrSchedule::Cosine);
  EXPECT_THROW(parse_lr_schedule("step"), UserError);
}

TEST(Clip, CoefficientAsPyTorchClipGradNorm) {
  EXPECT_FLOAT_EQ(clip_coefficient(0.5, 1.0), 1.0f);      // under the limit: untouched
  EXPECT_FLOAT_EQ(clip_coefficient(4.0, 1.0), float(1.0 / (4.0 + 1e-6)));
  EXPECT_FLOAT_EQ(clip_coefficient(1e9, 0.0), 1.0f);      // 0 disables clipping
}

TEST(AdamW, BlockUpdateDecaysOnlyMatricesAndSkipsPadding) {
  ModelConfig config;
  config.vocab_size = 10;  // padded to 64: rows 10..63 of wte must stay untouched
  config.n_positions = 4;
  config.n_embd = 8;
  config.n_layer = 1;
  config.n_head = 2;
  const ParamLayout layout(config);
  auto backend = make_cpu_backend(1);
  Rng rng(11);
  for (int block = 0; block < layout.num_blocks(); ++block) {
    const int64_t n = layout.block_numel(block);
    std::vector<float> param(n), grad(n), m(n, 0.0f), v(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      param[i] = float(rng.normal());
      grad[i] = float(rng.normal());
    }
    const std::vector<float> before = param;
    const AdamWConfig adam{0.9, 0.95, 1e-8, 0.5, 1.0};
    const float lr = 0.01f;
    adamw_update_range(*backend, layout, 0, FlatRange{block, 0, n},
                       Tensor(param.data(), DType::F32, {n}), Tensor(grad.data(), DType::F32, {n}),
                       Tensor(m.data(), DType::F32, {n}), Tensor(v.data(), DType::F32, {n}),
                       Tensor(), adam, lr, 1, 1.0f, nullptr);
    std::vector<bool> covered(n, false);
    for (int index : layout.block_params(block)) {
      const ParamSpec& spec = layout.params()[index];
      for (int64_t i = spec.offset; i < spec.offset + spec.numel(); ++i) {
        covered[i] = true;
        if (i >= spec.offset + spec.file_numel()) {
          ASSERT_EQ(param[i], before[i]) << spec.name << " padding row changed";
          continue;
        }
        // First Adam step: mhat/sqrt(vhat) = g/|g|, so the update is lr*sign(g) (+ decay).
        const double decay = spec.weight_decay ? 0.5 : 0.0;
        const double expected = before[i] * (1 - lr * decay) -
                                lr * grad[i] / (std::abs(double(grad[i])) + 1e-8);
        ASSERT_NEAR(param[i], expected, 1e-6) << spec.name << "[" << i - spec.offset << "]";
      }
    }
    // Alignment gaps between tensors are not parameters: untouched.
    for (int64_t i = 0; i < n; ++i) {
      if (!covered[i]) {
        ASSERT_EQ(param[i], before[i]);
      }
    }
  }
}

}  // namespace
}  // namespace dstrain
