// The plan a run executes: the planner's for a described machine, pipeline included, as one
// Plan object (train/plan_run.h); the flags' own when there is no machine.
#include <gtest/gtest.h>

#include <numeric>
#include <sstream>

#include "core/check.h"
#include "model/config.h"
#include "train/plan_run.h"

namespace dstrain {
namespace {

const std::string kFixtures = std::string(DSTRAIN_SOURCE_DIR) + "/tests/topology/fixtures/";

TrainOptions rtx4090_box(const std::string& model) {
  TrainOptions options;
  options.explicit_flags.emplace();  // a user who gave only these flags
  options.model = model;
  options.nvidia_smi_file = kFixtures + "rtx4090-8gpu-pcie.txt";
  options.gpu_model = "rtx4090";
  options.host_memory = "256G";
  options.device = "cpu";
  for (const char* flag : {"model", "from-nvidia-smi", "gpu", "host-memory", "device"}) {
    options.explicit_flags->insert(flag);
  }
  return options;
}

TEST(PlanRun, The6bOnEightRtx4090sRunsThePlannersPipelineAsChosen) {
  TrainOptions options = rtx4090_box("6b");
  const ModelConfig config = load_model_config("6b");
  std::ostringstream out;
  const Plan plan = plan_run(options, config, out);
  EXPECT_GT(plan.pp, 1) << out.str();
  EXPECT_EQ(plan.world(), 8);
  EXPECT_EQ(out.str().find("cannot run yet"), std::string::npos) << out.str();
  ASSERT_EQ(static_cast<int>(plan.pp_split.size()), plan.pp);
  EXPECT_EQ(std::accumulate(plan.pp_split.begin(), plan.pp_split.end(), int64_t{0}), config.n_layer);
  // The options remember the plan (what a checkpoint stores and a resume takes back), and the
  // flags' plan made from them is the same plan.
  EXPECT_EQ(options.pp, plan.pp);
  EXPECT_EQ(options.gpus, 8);
  const Plan again = plan_from_options(options, config);
  EXPECT_EQ(to_json(again), to_json(plan));
}

TEST(PlanRun, ASplitOfOnesOwnIsWhatRuns) {
  TrainOptions options = rtx4090_box("6b");
  options.pp = 4;
  options.pp_split = "8,7,7,6";
  options.pp_schedule = "gpipe";  // every micro-batch in flight: a small global batch
  options.global_batch_tokens = 32 * 1024;
  for (const char* flag : {"pp", "pp-split", "pp-schedule", "global-batch-tokens"}) {
    options.explicit_flags->insert(flag);
  }
  std::ostringstream out;
  const Plan plan = plan_run(options, load_model_config("6b"), out);
  EXPECT_EQ(plan.pp, 4);
  EXPECT_EQ(plan.pp_split, (std::vector<int64_t>{8, 7, 7, 6}));
  EXPECT_EQ(plan.pp_schedule, PipelineScheduleKind::GPipe);
}

TEST(PlanRun, TensorParallelismIsRefusedWithASentence) {
  TrainOptions options = rtx4090_box("6b");
  options.tp = 2;
  options.explicit_flags->insert("tp");
  std::ostringstream out;
  EXPECT_THROW(plan_run(options, load_model_config("6b"), out), UserError);
}

TEST(PlanRun, WithoutAMachineTheFlagsAreThePlan) {
  TrainOptions options;
  options.device = "cpu";
  options.gpus = 6;
  options.pp = 3;
  options.zero = 2;
  options.grad_accum = 5;
  const ModelConfig config = load_model_config("tiny");  // 2 layers: pp 3 is too deep
  std::ostringstream out;
  EXPECT_THROW(plan_run(options, config, out), UserError);
  options.pp = 2;
  const Plan plan = plan_run(options, config, out);
  EXPECT_EQ(plan.dp, 3);
  EXPECT_EQ(plan.pp, 2);
  EXPECT_EQ(plan.zero, 2);
  EXPECT_EQ(plan.grad_accum, 5);
  EXPECT_EQ(plan.pp_split, (std::vector<int64_t>{1, 1}));
}

}  // namespace
}  // namespace dstrain
