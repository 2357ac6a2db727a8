// DeepSeek-V3's auxiliary-loss-free balancing (--moe-router-bias-update-rate): the update rule
// on its own, then the DeepSeek-V3 fixture (tests/reference/deepseek_v3_tiny: 16 experts top 4,
// a selection bias per MoE layer) trained with rate 1e-3. After one step every bias moved by
// -rate, 0 or +rate, the most loaded experts down, the least loaded up, while the step itself
// equals the reference (the update comes after it); over 10 steps the moved biases change the
// routing, and every plan (dp 2 ZeRO-3 with ep 2, pp 2, tp 2, dp 2 ZeRO-1 with parameter and
// optimizer offload) moves them the same way: the same loads, the same bits of the biases; and a
// resumed run continues them.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "tests/common/temp_dir.h"
#include "tests/train/hf_fixture.h"
#include "tests/train/small_model.h"
#include "train/expert_load.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr double kRate = 1e-3;
const char* const kFixture = "deepseek_v3_tiny";

TEST(SelectionBias, MovesEachExpertByTheRateTowardTheMeanLoad) {
  std::vector<float> bias = {0.5f, -0.25f, 0.125f, 1.0f, 0.0f};
  update_selection_bias(bias, {3, 7, 5, 5, 0, /*dropped*/ 9}, 0.125);  // mean 4
  EXPECT_EQ(bias, (std::vector<float>{0.625f, -0.375f, 0.0f, 0.875f, 0.125f}));
  std::vector<float> even = {0.5f, 0.5f};
  update_selection_bias(even, {4, 4}, 0.125);
  EXPECT_EQ(even, (std::vector<float>{0.5f, 0.5f})) << "at the mean: unchanged";
}

test::LoggedRun balanced_run(const test::FixturePlan& plan, const std::filesystem::path& dir,
                             int64_t steps) {
  TrainOptions options = test::fixture_run(plan, test::fixture_expected(kFixture), dir);
  options.moe_bias_update_rate = kRate;
  options.steps = steps;
  std::ostringstream out;
  train(options, out);
  return test::read_logged_run(options);
}

std::vector<std::string> bias_names() {
  return {"model.layers.1.mlp.gate.e_score_correction_bias",
          "model.layers.2.mlp.gate.e_score_correction_bias"};
}

TEST(SelectionBias, OneStepMovesTheBiasesByTheLoadAfterTheStep) {
  const testing::TempDir dir;
  const test::LoggedRun run = balanced_run(test::FixturePlan{kFixture}, dir.path(), 1);
  const nlohmann::json expected = test::fixture_expected(kFixture);
  EXPECT_NEAR(run.losses.at(0), expected["losses"][0].get<double>(), 1e-5);
  const SafetensorsFile initial =
      SafetensorsFile::open(test::fixture_dir(kFixture) + "/model.safetensors");
  const nlohmann::json& load = run.steps.at(0)["expert_load"];
  ASSERT_EQ(load.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    const std::string name = bias_names()[l];
    SCOPED_TRACE(name);
    ASSERT_LT(load[l]["min"].get<double>(), load[l]["mean"].get<double>());
    ASSERT_GT(load[l]["max"].get<double>(), load[l]["mean"].get<double>());
    const std::vector<float> before = initial.read_f32(name), after = run.weights.at(name);
    int up = 0, down = 0;
    for (size_t e = 0; e < before.size(); ++e) {
      const bool moved_up = after[e] == before[e] + static_cast<float>(kRate);
      const bool moved_down = after[e] == before[e] - static_cast<float>(kRate);
      EXPECT_TRUE(after[e] == before[e] || moved_up || moved_down)
          << "expert " << e << " moved " << after[e] - before[e];
      up += moved_up;
      down += moved_down;
    }
    // The least loaded experts rose, the most loaded fell.
    EXPECT_GE(up, 1);
    EXPECT_GE(down, 1);
  }
}

TEST(SelectionBias, EveryPlanMovesTheBiasesAlike) {
  const testing::TempDir dir;
  const test::LoggedRun one = balanced_run(test::FixturePlan{kFixture}, dir.path(), 10);
  // The moved biases route differently from the fixture's run, which kept them.
  const nlohmann::json expected = test::fixture_expected(kFixture);
  double largest = 0;
  for (size_t i = 1; i < one.losses.size(); ++i) {
    largest = std::max(largest, std::abs(one.losses[i] - expected["losses"][i].get<double>()));
  }
  EXPECT_GT(largest, 1e-5) << "the balancing changed no loss of 10 steps";
  for (const test::FixturePlan& plan :
       {test::FixturePlan{kFixture, 2, 1, 1, 3, false, 2}, test::FixturePlan{kFixture, 1, 1, 2, 0},
        test::FixturePlan{kFixture, 1, 2, 1, 0}, test::FixturePlan{kFixture, 2, 1, 1, 1, true}}) {
    SCOPED_TRACE(plan.name());
    const test::LoggedRun other = balanced_run(plan, dir.path(), 10);
    ASSERT_EQ(other.losses.size(), one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) {
      EXPECT_NEAR(other.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i + 1;
    }
    for (const std::string& name : bias_names()) {
      EXPECT_EQ(other.weights.at(name), one.weights.at(name)) << name;
    }
  }
}

// Under bf16 parameters the routing reads the biases as the fp32 weights hold them, not their
// rounding to bf16: two copies of the fixture whose biases round to the same bf16 values but
// differ by up to 0.8 of a bf16 step (up to 8e-4, against choices 5.5e-5 apart) between experts
// route, and so train, differently.
TEST(SelectionBias, Bf16ParametersRouteByTheFp32Biases) {
  const testing::TempDir dir;
  const SafetensorsFile fixture =
      SafetensorsFile::open(test::fixture_dir(kFixture) + "/model.safetensors");
  // A copy of the fixture with each bias at its bf16 value + sign x 0.4 of its bf16 step, the
  // sign alternating over the experts.
  const auto write_copy = [&](const std::string& name, float sign) {
    const std::filesystem::path copy = dir.path() / name;
    std::filesystem::create_directories(copy);
    std::filesystem::copy_file(test::fixture_dir(kFixture) + "/config.json", copy / "config.json");
    std::map<std::string, std::vector<float>> tensors;
    SafetensorsWriter writer;
    for (const std::string& tensor : fixture.names()) {
      std::vector<float>& values = tensors[tensor] = fixture.read_f32(tensor);
      for (size_t e = 0; tensor.ends_with("e_score_correction_bias") && e < values.size(); ++e) {
        const float rounded = bf16_bits_to_fp32(fp32_to_bf16_bits(values[e]));
        const float step = std::ldexp(1.0f, std::ilogb(rounded) - 7);
        values[e] = rounded + (e % 2 ? sign : -sign) * 0.4f * step;
        EXPECT_EQ(bf16_bits_to_fp32(fp32_to_bf16_bits(values[e])), rounded);
      }
      writer.add(tensor, DType::F32, fixture.info(tensor).shape, values.data());
    }
    writer.write((copy / "model.safetensors").string());
    return copy.string();
  };
  const auto run = [&](const std::string& model) {
    TrainOptions options = test::fixture_run(test::FixturePlan{kFixture},
                                             test::fixture_expected(kFixture), model + "-run");
    options.model = options.init_from = model;
    options.precision = "bf16";
    options.steps = 3;
    std::ostringstream out;
    train(options, out);
    return test::read_logged_run(options).losses;
  };
  EXPECT_NE(run(write_copy("plus", 1.0f)), run(write_copy("minus", -1.0f)))
      << "the routing saw the biases rounded to bf16";
}

// The biases live in the master weights: a resumed run continues them bit for bit.
TEST(SelectionBias, AResumedRunContinuesTheBiases) {
  const testing::TempDir dir;
  const test::LoggedRun whole = balanced_run(test::FixturePlan{kFixture}, dir.path() / "whole", 4);
  TrainOptions options =
      test::fixture_run(test::FixturePlan{kFixture}, test::fixture_expected(kFixture), dir.path());
  options.moe_bias_update_rate = kRate;
  options.steps = 2;
  std::ostringstream out;
  train(options, out);
  options.resume = options.out + "/step-000002";
  options.steps = 4;
  options.log = (dir.path() / "resumed.jsonl").string();
  train(options, out);
  const test::LoggedRun resumed = test::read_logged_run(options);
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[1], whole.losses[3]);
  for (const std::string& name : bias_names()) {
    EXPECT_EQ(resumed.weights.at(name), whole.weights.at(name)) << name;
  }
}

}  // namespace
}  // namespace dstrain
