// Pipeline parallelism against one rank: a 4-layer model, 20 fp32 steps of 8 micro-batches of
// 2 x 16 tokens, the same global batch for every plan, on CPU ranks.
//
// Tolerances (as the data-parallel equivalence tests): per-step losses within 1e-6 relative,
// final weights within 1e-5 absolute. Not bitwise: the tied wte's two copies (first and last
// stage) each add their micro-batches and are then summed, where one rank adds head and
// embedding micro-batch by micro-batch; and ranks reduce in another order. Bitwise where the
// arithmetic is the same: 1F1B against GPipe (the same additions in the same order, at other
// times), and offload or recompute on or off within a plan.
//
// CI runs a representative subset (PipelineEquivalence.*: every pp x dp, every ZeRO stage,
// offload, the three recompute modes, both schedules, a split of one's own, in 14 plans). The
// full matrix, pp {2, 4} x dp {1, 2} x ZeRO 0-3 x offload x recompute {none, selective, full}
// x {1F1B, GPipe} (192 plans, about 100 s on 2 cores), exists only with DSTRAIN_FULL_MATRIX=1:
//   DSTRAIN_FULL_MATRIX=1 build/tests_train --gtest_filter='*PipelineFullMatrix*'
// (or DSTRAIN_FULL_MATRIX=1 ctest --test-dir build -R PipelineFullMatrix).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "tests/common/temp_dir.h"
#include "tests/train/expect_user_error.h"
#include "tests/train/small_model.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

constexpr int kLayers = 4;

struct Pipeline {
  Pipeline(int pp = 1, int dp = 1, int zero = 0, bool offload = false,
           std::string recompute = "none", std::string schedule = "1f1b",
           std::string precision = "fp32", std::string split = "")
      : pp(pp),
        dp(dp),
        zero(zero),
        offload(offload),
        recompute(std::move(recompute)),
        schedule(std::move(schedule)),
        precision(std::move(precision)),
        split(std::move(split)) {}
  int pp, dp, zero;
  bool offload;
  std::string recompute, schedule, precision;
  std::string split;  // --pp-split, empty: balanced
  bool offload_params = false;

  std::string name() const {
    std::string text = "pp" + std::to_string(pp) + "_dp" + std::to_string(dp) + "_zero" +
                       std::to_string(zero) + (offload ? "_offload" : "") +
                       (offload_params ? "_params" : "") + "_" + recompute + "_" +
                       schedule + "_" + precision;
    if (!split.empty()) text += "_split";
    for (char c : split) text += c == ',' ? '_' : c;
    return text;
  }
};

void PrintTo(const Pipeline& pipeline, std::ostream* out) { *out << pipeline.name(); }

using RunResult = test::LoggedRun;

TrainOptions pipeline_options(const fs::path& dir, const Pipeline& p) {
  TrainOptions options = test::small_run_options(dir, p.name(), p.pp * p.dp);
  options.model = test::write_small_model_config(dir, kLayers);
  options.pp = p.pp;
  options.grad_accum = test::kSmallRunMicroBatches / p.dp;
  options.zero = p.zero;
  options.offload = p.offload;
  options.offload_params = p.offload_params;
  options.recompute = p.recompute;
  options.pp_schedule = p.schedule;
  options.pp_split = p.split;
  options.precision = p.precision;
  options.threads = p.pp * p.dp;
  options.test.verify_tied_embedding = true;  // the two copies of wte stay bitwise equal
  return options;
}

RunResult read_run(const TrainOptions& options) { return test::read_logged_run(options); }

RunResult run(const fs::path& dir, const Pipeline& p) {
  TrainOptions options = pipeline_options(dir, p);
  std::ostringstream out;
  train(options, out);
  RunResult result = read_run(options);
  result.output = out.str();
  return result;
}

class PipelineTest : public test::SameAsOneRank<Pipeline, run> {
 protected:
  void expect_matches_one_rank(const Pipeline& p, double loss_tolerance = 1e-6,
                               double weight_tolerance = 1e-5) {
    expect_same_as_one_rank(p, loss_tolerance, weight_tolerance, 0.1);
  }
};

// The CI subset: every pp x dp, every ZeRO stage, offload, every recompute mode, both schedules.
class PipelineEquivalence : public PipelineTest, public ::testing::WithParamInterface<Pipeline> {};

TEST_P(PipelineEquivalence, SameLossesAndWeightsAsOneRank) { expect_matches_one_rank(GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Plans, PipelineEquivalence,
    ::testing::Values(Pipeline{2, 1, 0}, Pipeline{2, 1, 0, false, "full", "gpipe"},
                      Pipeline{4, 1, 0, false, "selective"},
                      Pipeline{4, 1, 0, true, "none", "gpipe"}, Pipeline{2, 2, 0, false, "full"},
                      Pipeline{2, 2, 1, true}, Pipeline{2, 2, 2, false, "selective", "gpipe"},
                      Pipeline{2, 2, 3}, Pipeline{2, 2, 3, true, "full", "gpipe"},
                      Pipeline{4, 2, 1, false, "full"}, Pipeline{4, 2, 2, true},
                      Pipeline{4, 2, 3, false, "selective", "gpipe"},
                      Pipeline{3, 1, 0, false, "none", "1f1b", "fp32", "2,1,1"},
                      Pipeline{2, 1, 3, false, "none", "1f1b", "fp32", "1,3"}),
    [](const ::testing::TestParamInfo<Pipeline>& info) { return info.param.name(); });

// The whole matrix (documented above; not in CI).
using MatrixPoint = std::tuple<int, int, int, bool, std::string, std::string>;
std::vector<MatrixPoint> full_matrix() {
  std::vector<MatrixPoint> points;
  const char* wanted = std::getenv("DSTRAIN_FULL_MATRIX");
  if (wanted == nullptr || std::string(wanted) != "1") return points;
  for (int pp : {2, 4})
    for (int dp : {1, 2})
      for (int zero : {0, 1, 2, 3})
        for (bool offload : {false, true})
          for (const char* recompute : {"none", "selective", "full"})
            for (const char* schedule : {"1f1b", "gpipe"})
              points.emplace_back(pp, dp, zero, offload, recompute, schedule);
  return points;
}
Pipeline pipeline_of(const MatrixPoint& point) {
  const auto& [pp, dp, zero, offload, recompute, schedule] = point;
  return Pipeline{pp, dp, zero, offload, recompute, schedule};
}
std::string matrix_name(const ::testing::TestParamInfo<MatrixPoint>& info) {
  return pipeline_of(info.param).name();
}

class PipelineFullMatrix : public PipelineTest,
                           public ::testing::WithParamInterface<MatrixPoint> {};

TEST_P(PipelineFullMatrix, SameLossesAndWeightsAsOneRank) {
  expect_matches_one_rank(pipeline_of(GetParam()));
}

GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(PipelineFullMatrix);
INSTANTIATE_TEST_SUITE_P(All, PipelineFullMatrix, ::testing::ValuesIn(full_matrix()), matrix_name);

TEST_F(PipelineTest, OneFOneBAndGPipeAreTheSameBitsAndOffloadAndRecomputeChangeNone) {
  for (const Pipeline& base : {Pipeline{2, 1, 0}, Pipeline{2, 2, 3}}) {
    const RunResult plain = run(temp_.path(), base);
    Pipeline gpipe = base, offload = base, recompute = base, params = base;
    gpipe.schedule = "gpipe";
    offload.offload = true;
    recompute.recompute = "full";
    // Parameter offload: the tied embedding's two copies summed through the device.
    params.offload_params = true;
    params.offload = base.zero == 3;
    for (const Pipeline& other : {gpipe, offload, recompute, params}) {
      const RunResult result = run(temp_.path(), other);
      EXPECT_EQ(result.losses, plain.losses) << other.name();
      EXPECT_EQ(result.weights, plain.weights) << other.name();
    }
  }
}

TEST_F(PipelineTest, Fp16AndBf16MatchOneRankWithinTheirRounding) {
  // The same precision on one rank and on a pipeline: every activation and gradient is
  // rounded to 16 bits (fp16 2^-11, bf16 2^-8 relative), and the additions' orders differ
  // (see the top), so a rounding can flip: the losses agree to 1e-3 (fp16) and 1e-2 (bf16)
  // relative, and both runs skip the same fp16 steps.
  for (const std::string precision : {"fp16", "bf16"}) {
    Pipeline one;
    one.precision = precision;
    Pipeline piped{2, 2, 2, false, "none", "1f1b", precision};
    const RunResult a = run(temp_.path(), one), b = run(temp_.path(), piped);
    const double tolerance = precision == "fp16" ? 1e-3 : 1e-2;
    ASSERT_EQ(a.losses.size(), b.losses.size());
    for (size_t i = 0; i < a.losses.size(); ++i) {
      EXPECT_NEAR(b.losses[i], a.losses[i], tolerance * a.losses[i])
          << precision << " step " << i + 1;
      EXPECT_EQ(b.steps[i].value("skipped", false), a.steps[i].value("skipped", false));
    }
  }
}

TEST_F(PipelineTest, AnOverflowOnTheLastStageSkipsTheStepOnEveryStage) {
  // fp16: the inf/NaN flag is agreed by every rank of every stage: a +inf in one gradient of
  // the last stage's rank 3 (pp 2 x dp 2) skips step 3 everywhere, and the scale halves.
  TrainOptions options =
      pipeline_options(temp_.path(), Pipeline{2, 2, 1, false, "none", "1f1b", "fp16"});
  options.steps = 5;
  options.test.inject_inf_step = 3;
  options.test.inject_inf_rank = 3;
  std::ostringstream out;
  train(options, out);
  const RunResult result = read_run(options);
  ASSERT_EQ(result.steps.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(result.steps[static_cast<size_t>(i)].value("skipped", true), i == 2)
        << "step " << i + 1;
  }
  EXPECT_EQ(result.steps[3]["loss_scale"].get<double>() * 2,
            result.steps[2]["loss_scale"].get<double>());
}

TEST_F(PipelineTest, LogRecordsTheExecutedPlanAndTheBubble) {
  const RunResult result = run(temp_.path(), Pipeline{4, 1, 1, false, "none", "gpipe"});
  const nlohmann::json& plan = result.config.at("plan");
  for (const char* key : {"dp", "tp", "pp", "zero", "offload", "recompute", "micro_batch",
                          "grad_accum", "pp_schedule", "pp_split"}) {
    EXPECT_TRUE(plan.contains(key)) << key;
  }
  EXPECT_EQ(plan["pp"], 4);
  EXPECT_EQ(plan["dp"], 1);
  EXPECT_EQ(plan["pp_schedule"], "gpipe");
  EXPECT_EQ(plan["grad_accum"], 8);
  EXPECT_EQ(plan["pp_split"], nlohmann::json::array({1, 1, 1, 1}));
  for (const nlohmann::json& step : result.steps) {
    ASSERT_TRUE(step.contains("pipeline_bubble"));
    ASSERT_EQ(step["pipeline_bubble"].size(), 4u);
    for (double share : step["pipeline_bubble"]) {
      EXPECT_GE(share, 0.0);
      EXPECT_LT(share, 1.0);
    }
  }
}

TEST_F(PipelineTest, ResumesAcrossPipelineDepths) {
  // A checkpoint is plan-independent: the same files whatever wrote them; a pp = 4 run's
  // checkpoint continues on pp = 1, and a one-rank run's on pp = 2 x dp = 2.
  const Pipeline legs[][2] = {{Pipeline{4, 1, 1}, Pipeline{1, 1, 0}},
                              {Pipeline{1, 1, 0}, Pipeline{2, 2, 3, true}},
                              {Pipeline{2, 2, 2}, Pipeline{4, 1, 0, false, "full", "gpipe"}}};
  int index = 0;
  for (const auto& [first, second] : legs) {
    const fs::path dir = temp_.path() / ("resume" + std::to_string(index++));
    TrainOptions straight = pipeline_options(dir / "straight", first);
    straight.steps = 10;
    straight.save_every = 5;
    std::ostringstream out;
    train(straight, out);
    TrainOptions resumed = pipeline_options(dir / "resumed", second);
    resumed.steps = 10;
    resumed.model.clear();
    resumed.resume = straight.out + "/step-000005";
    train(resumed, out);
    const std::vector<double> all = read_run(straight).losses;
    const std::vector<double> tail = read_run(resumed).losses;
    ASSERT_EQ(all.size(), 10u);
    ASSERT_EQ(tail.size(), 5u);
    for (int i = 0; i < 5; ++i) {
      EXPECT_NEAR(tail[i], all[5 + i], 1e-6 * all[5 + i])
          << first.name() << " -> " << second.name() << ", step " << 6 + i;
    }
  }
}

// A stage that fails fails every rank, with a message naming the stage, the rank and the
// micro-batch; none hangs.
TEST_F(PipelineTest, AFailingStageFailsEveryRankNamingStageRankAndMicroBatch) {
  TrainOptions options = pipeline_options(temp_.path(), Pipeline{4, 1, 0});
  options.test.fail_stage = 2;
  options.test.fail_micro_batch = 3;
  options.test.fail_step = 2;
  options.comm_timeout = 30;
  std::ostringstream out;
  try {
    train(options, out);
    FAIL() << "the injected failure did not fail the run";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("pipeline stage 2 (rank 2), forward of micro-batch 3"), std::string::npos)
        << what;
    EXPECT_NE(what.find("injected failure"), std::string::npos) << what;
  }
}

TEST_F(PipelineTest, AHangingStageTimesOutEveryRankNamingWhatItIsDoing) {
  TrainOptions options = pipeline_options(temp_.path(), Pipeline{2, 1, 0});
  options.test.fail_stage = 1;
  options.test.fail_micro_batch = 2;
  options.test.fail_hang = true;  // sleeps 3 x the timeout, then goes on into an aborted world
  options.comm_timeout = 2;
  std::ostringstream out;
  try {
    train(options, out);
    FAIL() << "the hang did not fail the run";
  } catch (const Error& error) {
    const std::string what = error.what();
    std::cout << what << "\n";
    // The waiting stage reports the timeout, and what the hung rank was doing.
    EXPECT_NE(what.find("pipeline stage 1"), std::string::npos) << what;
    EXPECT_NE(what.find("micro-batch 2"), std::string::npos) << what;
  }
}

TEST_F(PipelineTest, BadPipelineFlagsAreOneSentence) {
  TrainOptions options = pipeline_options(temp_.path(), Pipeline{2, 1, 0});
  options.steps = 1;
  TrainOptions split = options;
  split.pp_split = "3,2";
  test::expect_user_error(split, "adding up to the model's 4 layers");
  split.pp_split = "2,x";
  test::expect_user_error(split, "--pp-split");
  TrainOptions deep = options;
  deep.pp = 5;
  deep.gpus = 5;
  test::expect_user_error(deep, "more pipeline stages than the model's 4 layers");
  TrainOptions uneven = options;
  uneven.gpus = 3;
  test::expect_user_error(uneven, "cannot be cut into 2 pipeline stages");
  TrainOptions schedule = options;
  schedule.pp_schedule = "zigzag";
  test::expect_user_error(schedule, "--pp-schedule");
}

}  // namespace
}  // namespace dstrain
