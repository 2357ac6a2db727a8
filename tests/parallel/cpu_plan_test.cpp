// Plans for CPU ranks: what a run holds in host memory, the plan that fits a budget (the global
// batch kept), and the sentence when a plan does not fit.
#include "parallel/cpu_plan.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "core/check.h"
#include "model/config.h"

namespace dstrain {
namespace {

Plan four_ranks(const ModelConfig& config) {
  Plan plan;
  plan.dp = 4;
  plan.micro_batch = 4;
  plan.grad_accum = 2;
  plan.seq_len = std::min<int64_t>(128, config.n_positions);
  return plan;
}

TEST(CpuPlan, RunBytesAreTheRanksThePrestartCopiesAndTheSample) {
  const ModelConfig config = load_model_config("gpt2-124m");
  const MemoryModel model(config);
  const Plan plan = four_ranks(config);
  const CpuRunBytes bytes = cpu_run_bytes(model, plan, true);
  EXPECT_EQ(bytes.ranks, model.cpu_bytes_all_ranks(plan));
  const uint64_t weights = static_cast<uint64_t>(model.layout().total_numel()) * 4;
  EXPECT_EQ(bytes.starting, 3 * weights);
  // Rank 0's whole copy, gathered in place, and one block at a time on the 3 others.
  int64_t largest = 0;
  for (int block = 0; block < model.layout().num_blocks(); ++block) {
    largest = std::max(largest, model.layout().block_numel(block));
  }
  EXPECT_EQ(bytes.sample, weights + 3 * static_cast<uint64_t>(largest) * 4);
  EXPECT_EQ(cpu_run_bytes(model, plan, false).sample, 0u);
  EXPECT_EQ(bytes.allowance, kCpuBaseAllowance + 4 * kCpuRankAllowance);
  EXPECT_EQ(bytes.total(), bytes.ranks + bytes.starting + bytes.sample + bytes.allowance);
  // Sharding the state over the ranks holds less in all.
  Plan sharded = plan;
  sharded.zero = 3;
  EXPECT_LT(cpu_run_bytes(model, sharded, false).total(), bytes.total() - bytes.sample);
}

TEST(CpuPlan, ThePlanThatFitsKeepsTheGlobalBatch) {
  const ModelConfig config = load_model_config("gpt2-124m");
  const MemoryModel model(config);
  const Plan plan = four_ranks(config);
  const uint64_t needed = cpu_run_bytes(model, plan, false).total();
  // Everything fits: the plan itself.
  const std::optional<Plan> same = cpu_plan_that_fits(model, plan, false, needed);
  ASSERT_TRUE(same.has_value());
  EXPECT_EQ(to_json(*same), to_json(plan));
  // Less: something else, within the budget, with the same sequences per step.
  const uint64_t budget = needed * 3 / 4;
  const std::optional<Plan> fits = cpu_plan_that_fits(model, plan, false, budget);
  ASSERT_TRUE(fits.has_value());
  EXPECT_LE(cpu_run_bytes(model, *fits, false).total(), budget);
  EXPECT_EQ(fits->dp * fits->micro_batch * fits->grad_accum, 4 * 4 * 2);
  EXPECT_FALSE(plan_flag_changes(plan, *fits).empty());
  // Not even one rank's starting copies fit.
  EXPECT_FALSE(cpu_plan_that_fits(model, plan, false, 1 << 20).has_value());
  try {
    check_cpu_memory(model, plan, false, HostMemoryBudget{budget, "a test's budget"});
    ADD_FAILURE() << "a plan above the budget passed";
  } catch (const UserError& error) {
    const std::string text = error.what();
    EXPECT_NE(text.find("this run needs "), std::string::npos) << text;
    EXPECT_NE(text.find("(a test's budget)"), std::string::npos) << text;
    EXPECT_NE(text.find(plan_flag_changes(plan, *fits) + " would need"), std::string::npos) << text;
  }
  EXPECT_NO_THROW(check_cpu_memory(model, plan, false, HostMemoryBudget{needed, "enough"}));
}

TEST(CpuPlan, TheCpuPlannerPicksTheLeastRecomputeThatFits) {
  const ModelConfig config = load_model_config("gpt2-124m");
  const MemoryModel model(config);
  Plan shape = four_ranks(config);
  const CpuPlanResult roomy = plan_cpu_ranks(model, shape, 32, false, uint64_t{1} << 50);
  ASSERT_TRUE(roomy.best.has_value());
  EXPECT_EQ(roomy.best->plan.recompute, Recompute::None);
  EXPECT_EQ(roomy.best->plan.micro_batch, 8);  // the whole share of a rank at once
  EXPECT_EQ(roomy.best->plan.zero, 0);
  EXPECT_EQ(roomy.options.size(), 12u);  // 4 ZeRO stages x 3 recompute modes
  // A budget the unsharded state misses: ZeRO or recompute or a smaller micro-batch.
  const uint64_t tight = cpu_run_bytes(model, roomy.best->plan, false).total() * 3 / 4;
  const CpuPlanResult tighter = plan_cpu_ranks(model, shape, 32, false, tight);
  ASSERT_TRUE(tighter.best.has_value());
  EXPECT_LE(tighter.best->bytes.total(), tight);
  EXPECT_EQ(tighter.best->plan.dp * tighter.best->plan.micro_batch * tighter.best->plan.grad_accum, 32);
  EXPECT_FALSE(plan_cpu_ranks(model, shape, 32, false, 1 << 20).best.has_value());
}

}  // namespace
}  // namespace dstrain
