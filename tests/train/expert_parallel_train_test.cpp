// Expert parallelism against one rank: a Qwen2-MoE-shaped model (4 layers, the first dense, 4
// routed experts of width 20, top 2, a shared expert behind its gate) and a Mixtral-shaped one
// (every layer MoE), 20 fp32 steps of 8 micro-batches of 2 x 16 tokens, the same global batch
// for every plan, on CPU ranks. --ep N splits each MoE layer's experts over N of the dp ranks;
// tokens go to their experts and back by all-to-all.
//
// Tolerances: per-step losses within 1e-5 relative, final weights within 1e-5 absolute (fp32).
// Not bitwise: an expert's gradient is summed over its rows on the rank holding it and then over
// the ranks holding the same expert, where one rank sums all rows in one product (as for any dp
// plan). Bitwise: a run and its resumption on the same plan.
//
// CI runs these plans (ep 2 and 4, every ZeRO stage, offload, recompute, pipelines); the other
// combinations are covered by tests/train/hf_models_test.cpp against transformers.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/rng.h"
#include "parallel/cost_model.h"
#include "parallel/pipeline_split.h"
#include "tests/common/temp_dir.h"
#include "tests/train/expect_user_error.h"
#include "tests/train/small_model.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

constexpr int kVocab = 61;

struct EpSplit {
  int dp = 1, ep = 1, pp = 1, zero = 0;
  int tp = 1;  // the attention split, the experts whole on every tp rank
  bool offload = false;
  std::string recompute = "none";
  std::string model = "qwen2_moe";  // or "mixtral", or "qwen2_moe_aux" (the load-balancing loss)
  bool offload_params = false;

  int world() const { return dp * pp * tp; }
  std::string name() const {
    return model + "_dp" + std::to_string(dp) + "_ep" + std::to_string(ep) + "_pp" +
           std::to_string(pp) + "_zero" + std::to_string(zero) + (offload ? "_offload" : "") +
           (offload_params ? "_params" : "") + "_" +
           recompute + (tp > 1 ? "_tp" + std::to_string(tp) : "");
  }
};

void PrintTo(const EpSplit& split, std::ostream* out) { *out << split.name(); }

std::string write_model_config(const fs::path& dir, const std::string& model) {
  fs::create_directories(dir);
  const fs::path path = dir / (model + ".json");
  if (model == "mixtral") {
    std::ofstream(path) << R"({"model_type": "mixtral", "vocab_size": 61, "hidden_size": 24,
        "intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "num_local_experts": 4, "num_experts_per_tok": 2,
        "tie_word_embeddings": false, "sliding_window": null})";
  } else {
    const bool aux = model == "qwen2_moe_aux";
    std::ofstream(path) << R"({"model_type": "qwen2_moe", "vocab_size": 61, "hidden_size": 24,
        "intermediate_size": 36, "moe_intermediate_size": 20,
        "shared_expert_intermediate_size": 28, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": [0],
        "tie_word_embeddings": true, "output_router_logits": )"
                        << (aux ? "true" : "false") << R"(, "router_aux_loss_coef": 0.1})";
  }
  return path.string();
}

// A stream a small model can learn: mostly the next token is 7 * token + 2 (mod 61).
std::string write_tokens(const fs::path& dir) {
  return test::write_learnable_tokens(dir, kVocab, 7, 2, 4321);
}

TrainOptions split_options(const fs::path& dir, const EpSplit& s) {
  TrainOptions options = test::small_run_options(dir, s.name(), s.world());
  options.model = write_model_config(dir, s.model);
  options.data = write_tokens(dir);
  options.ep = s.ep;
  options.pp = s.pp;
  options.tp = s.tp;
  options.grad_accum = test::kSmallRunMicroBatches / s.dp;
  options.zero = s.zero;
  options.offload = s.offload;
  options.offload_params = s.offload_params;
  options.recompute = s.recompute;
  options.threads = s.world();
  options.check_replicas = 5;  // the ranks holding the same experts (and the dp replicas) agree
  return options;
}

test::LoggedRun run(const fs::path& dir, const EpSplit& s) {
  TrainOptions options = split_options(dir, s);
  std::ostringstream out;
  train(options, out);
  return test::read_logged_run(options);
}

// One rank of each model, trained once.
const test::LoggedRun& reference(const std::string& model) {
  static testing::TempDir dir;
  static std::map<std::string, test::LoggedRun> runs;
  auto it = runs.find(model);
  if (it == runs.end()) {
    EpSplit one;
    one.model = model;
    it = runs.emplace(model, run(dir.path(), one)).first;
  }
  return it->second;
}

EpSplit split(const char* model, int dp, int ep, int pp, int zero, bool offload,
              const char* recompute, int tp = 1) {
  EpSplit s;
  s.tp = tp;
  s.model = model;
  s.dp = dp;
  s.ep = ep;
  s.pp = pp;
  s.zero = zero;
  s.offload = offload;
  s.recompute = recompute;
  return s;
}

class ExpertParallelEquivalence : public ::testing::TestWithParam<EpSplit> {
 protected:
  testing::TempDir temp_;
};

TEST_P(ExpertParallelEquivalence, SameLossesAndWeightsAsOneRank) {
  const EpSplit& s = GetParam();
  test::expect_same_training(reference(s.model), run(temp_.path(), s), s.name(), 1e-5, 1e-5, 0.5);
}

INSTANTIATE_TEST_SUITE_P(Plans, ExpertParallelEquivalence,
                         ::testing::Values(split("qwen2_moe", 2, 2, 1, 0, false, "none"),
                                           split("qwen2_moe", 4, 2, 1, 3, false, "selective"),
                                           split("qwen2_moe", 4, 4, 1, 2, true, "none"),
                                           split("qwen2_moe", 2, 2, 2, 1, false, "full"),
                                           split("mixtral", 4, 4, 1, 3, false, "full"),
                                           split("mixtral", 4, 2, 2, 3, true, "none"),
                                           // Tensor parallelism: the attention split, the
                                           // experts whole on every tp rank.
                                           split("qwen2_moe", 1, 1, 1, 0, false, "none", 2),
                                           split("mixtral", 2, 2, 1, 3, false, "selective", 2),
                                           split("qwen2_moe", 2, 2, 2, 1, false, "full", 2)),
                         [](const ::testing::TestParamInfo<EpSplit>& info) {
                           return info.param.name();
                         });

// Parameter offload brings the experts' blocks (sharded over the ranks holding the same experts)
// up like any other block: the same bits as without it.
TEST(ExpertParallelOffload, ParameterOffloadChangesNoBit) {
  const testing::TempDir dir;
  for (EpSplit base : {split("qwen2_moe_aux", 4, 2, 1, 3, false, "none"),
                       split("mixtral", 2, 2, 2, 1, false, "full")}) {
    const test::LoggedRun plain = run(dir.path(), base);
    EpSplit params = base;
    params.offload_params = true;
    params.offload = base.zero == 3;
    const test::LoggedRun offloaded = run(dir.path(), params);
    EXPECT_EQ(offloaded.losses, plain.losses) << params.name();
    EXPECT_EQ(offloaded.weights, plain.weights) << params.name();
  }
}

TEST(ExpertParallelResume, AnotherExpertParallelDegreeContinuesTheSameRun) {
  // A checkpoint is plan-independent: an ep 2 run's checkpoint continues on ep 2 bit for bit,
  // and on ep 1 and ep 4 within the tolerance of the top.
  testing::TempDir temp;
  const EpSplit ep2 = split("qwen2_moe", 4, 2, 1, 3, false, "none");
  TrainOptions straight = split_options(temp.path() / "straight", ep2);
  straight.steps = 10;
  straight.save_every = 5;
  std::ostringstream out;
  train(straight, out);
  const std::vector<double> all = test::read_logged_run(straight).losses;
  ASSERT_EQ(all.size(), 10u);
  for (const EpSplit& second : {ep2, split("qwen2_moe", 4, 1, 1, 1, false, "none"),
                                split("qwen2_moe", 4, 4, 1, 0, false, "none")}) {
    TrainOptions resumed = split_options(temp.path() / ("resumed_" + second.name()), second);
    resumed.steps = 10;
    resumed.resume = straight.out + "/step-000005";
    resumed.data = straight.data;
    resumed.model = straight.model;
    train(resumed, out);
    const std::vector<double> tail = test::read_logged_run(resumed).losses;
    ASSERT_EQ(tail.size(), 5u);
    for (int i = 0; i < 5; ++i) {
      if (second.ep == 2) {
        EXPECT_EQ(tail[i], all[5 + i]) << "step " << 6 + i;
      } else {
        EXPECT_NEAR(tail[i], all[5 + i], 1e-5 * all[5 + i]) << second.name() << ", step " << 6 + i;
      }
    }
  }
}

// Each step record says, per MoE layer, the fewest and the most token copies an expert got over
// the step (every micro-batch, every rank): k copies of each of the step's tokens in all, the
// dense layer not listed, and the same numbers whatever the plan (at step 1 the weights are the
// same, so is the routing).
TEST(ExpertParallelLog, StepRecordsHoldEachMoeLayersExpertLoad) {
  const test::LoggedRun& one = reference("qwen2_moe");
  testing::TempDir temp;
  const test::LoggedRun many = run(temp.path(), split("qwen2_moe", 4, 2, 1, 3, false, "full"));
  const double copies = 8 * 2 * 16 * 2;  // micro-batches x batch x seq x k
  for (const test::LoggedRun* r : {&one, &many}) {
    ASSERT_EQ(r->steps.size(), size_t(test::kSmallRunSteps));
    for (const nlohmann::json& step : r->steps) {
      const nlohmann::json& load = step.at("expert_load");
      ASSERT_EQ(load.size(), 3u) << step.dump();  // layers 1-3; layer 0 is dense
      for (size_t i = 0; i < load.size(); ++i) {
        EXPECT_EQ(load[i]["layer"].get<int>(), static_cast<int>(i) + 1);
        EXPECT_DOUBLE_EQ(load[i]["mean"].get<double>(), copies / 4);
        EXPECT_LE(load[i]["min"].get<int64_t>(), load[i]["mean"].get<double>());
        EXPECT_GE(load[i]["max"].get<int64_t>(), load[i]["mean"].get<double>());
      }
    }
  }
  EXPECT_EQ(one.steps[0]["expert_load"], many.steps[0]["expert_load"]);
}

// The load-balancing loss sums each micro-batch's routing statistics over the data-parallel
// ranks: dp ranks at micro-batch b train as one rank at micro-batch dp x b (the same sequences
// in each micro-batch of the step), with and without expert parallelism. Over pipeline stages
// the statistics travel with the micro-batch (pp 4: the first stage holds only the dense layer
// 0). Each step record holds the loss (the cross-entropy plus 0.1 x aux) and aux itself.
TEST(ExpertParallelAuxLoss, DataParallelRanksAndStagesTrainAsOneRank) {
  testing::TempDir temp;
  auto aux_run = [&](int dp, int ep, int pp) {
    EpSplit s = split("qwen2_moe_aux", dp, ep, pp, dp > 1 ? 3 : 0, false, "none");
    TrainOptions options = split_options(temp.path() / s.name(), s);
    options.batch = 4 / dp;
    options.grad_accum = 2;
    std::ostringstream out;
    train(options, out);
    return test::read_logged_run(options);
  };
  const test::LoggedRun one = aux_run(1, 1, 1);
  ASSERT_EQ(one.steps.size(), size_t(test::kSmallRunSteps));
  for (const nlohmann::json& step : one.steps) {
    // A balanced router gives aux = k (f_e = k / E, P_e = 1 / E), one sending every token to
    // the same k experts E times as much.
    ASSERT_TRUE(step.contains("aux_loss")) << step.dump();
    EXPECT_GT(step["aux_loss"].get<double>(), 1.5);
    EXPECT_LT(step["aux_loss"].get<double>(), 8.0);
  }
  for (const auto& [dp, ep, pp] : {std::tuple{2, 1, 1}, std::tuple{2, 2, 1}, std::tuple{4, 4, 1},
                                   std::tuple{1, 1, 2}, std::tuple{1, 1, 4},
                                   std::tuple{2, 2, 2}}) {
    SCOPED_TRACE("dp " + std::to_string(dp) + " ep " + std::to_string(ep) + " pp " +
                 std::to_string(pp));
    const test::LoggedRun many = aux_run(dp, ep, pp);
    ASSERT_EQ(many.steps.size(), one.steps.size());
    for (size_t i = 0; i < one.steps.size(); ++i) {
      const double a = one.steps[i]["aux_loss"], b = many.steps[i]["aux_loss"];
      EXPECT_NEAR(b, a, 1e-5 * a) << "dp " << dp << " ep " << ep << " step " << i + 1;
      EXPECT_NEAR(many.losses[i], one.losses[i], 1e-5 * one.losses[i])
          << "dp " << dp << " ep " << ep << " step " << i + 1;
    }
    EXPECT_LT(test::max_weight_difference(one.weights, many.weights), 1e-5)
        << "dp " << dp << " ep " << ep;
  }
}

// Under tp a MoE layer's experts run whole on every tp rank: its MLP has no output reduction and
// no summed input gradient. The collectives each rank logs are what the cost model counts.
TEST(ExpertParallelLog, TensorParallelCollectivesAreWhatTheCostModelCounts) {
  testing::TempDir temp;
  for (const EpSplit& s : {split("qwen2_moe", 1, 1, 1, 0, false, "full", 2),
                           split("qwen2_moe", 2, 2, 2, 1, false, "none", 2)}) {
    SCOPED_TRACE(s.name());
    TrainOptions options = split_options(temp.path() / s.name(), s);
    options.steps = 2;
    std::ostringstream out;
    train(options, out);
    const test::LoggedRun r = test::read_logged_run(options);
    Plan plan;
    plan.tp = s.tp;
    plan.pp = s.pp;
    plan.recompute = s.recompute == "full" ? Recompute::Full : Recompute::None;
    const ModelConfig config = load_model_config(options.model);
    const std::vector<int64_t> cut = r.config["plan"]["pp_split"];
    ASSERT_EQ(r.steps.size(), 2u);
    for (const nlohmann::json& step : r.steps) {
      for (int stage = 0; stage < s.pp; ++stage) {
        const StageRange range = stage_of_split(cut, stage);
        const TensorParallelTraffic traffic =
            tensor_parallel_traffic(plan, range, moe_layers_in(config, range));
        EXPECT_EQ(step["tensor_parallel"]["collectives"][stage].get<double>(),
                  test::kSmallRunMicroBatches / s.dp * traffic.collectives)
            << "stage " << stage;
      }
    }
  }
}

// --moe-expert-capacity-factor: each expert runs at most ceil(f x its even share) of a rank's
// micro-batch copies. The step records count what was dropped; splitting the experts over ranks
// changes no drop (each rank's capacity is over its own copies) and the losses within 1e-5.
TEST(ExpertParallelCapacity, DroppedCopiesAreLoggedAndExpertParallelismDropsTheSame) {
  testing::TempDir temp;
  auto capped = [&](int ep) {
    const EpSplit s = split("mixtral", 2, ep, 1, 1, false, "none");
    TrainOptions options = split_options(temp.path() / s.name(), s);
    options.moe_capacity_factor = 1.0;
    std::ostringstream out;
    train(options, out);
    return test::read_logged_run(options);
  };
  const test::LoggedRun one = capped(1), two = capped(2);
  // A rank's micro-batch: 2 x 16 tokens, 2 copies each over 4 experts: capacity 16 a rank.
  const int64_t capacity_over_ranks = 2 * 16, micro_batches = test::kSmallRunMicroBatches / 2;
  int64_t dropped = 0;
  for (size_t i = 0; i < one.steps.size(); ++i) {
    const nlohmann::json& a = one.steps[i]["expert_load"];
    const nlohmann::json& b = two.steps[i]["expert_load"];
    ASSERT_EQ(a.size(), 2u);
    for (size_t l = 0; l < a.size(); ++l) {
      EXPECT_EQ(a[l]["dropped"], b[l]["dropped"]) << "step " << i + 1;
      EXPECT_LE(a[l]["max"].get<int64_t>(), micro_batches * capacity_over_ranks);
      dropped += a[l]["dropped"].get<int64_t>();
    }
    EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i + 1;
  }
  EXPECT_GT(dropped, 0);
  EXPECT_LT(one.losses.back(), one.losses.front() - 0.5);
}

TEST(ExpertParallelFlags, WhatCannotSplitIsOneSentence) {
  testing::TempDir temp;
  test::expect_user_error(split_options(temp.path(), split("mixtral", 4, 3, 1, 0, false, "none")),
                          "--ep 3: expert parallelism over 3 ranks needs the experts (4) "
                          "divisible by 3");
  test::expect_user_error(split_options(temp.path(), split("mixtral", 2, 4, 1, 0, false, "none")),
                          "--ep 4 splits the experts over data-parallel ranks, but the plan has 2");
  // DeepSeek-V3's balancing needs a router with a selection bias; Mixtral's has none.
  TrainOptions balanced = split_options(temp.path(), split("mixtral", 1, 1, 1, 0, false, "none"));
  balanced.moe_bias_update_rate = 1e-3;
  test::expect_user_error(balanced, "--moe-router-bias-update-rate needs a router with a "
                                    "selection bias");
}

}  // namespace
}  // namespace dstrain
