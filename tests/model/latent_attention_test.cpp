// The decoder with multi-head latent attention and DeepSeek's routers (model/latent_attention.h,
// DeepSeek-V2/V3's parts) on the CPU backend: every parameter's gradient against finite
// differences of the loss (V3's selection bias chooses experts only: exactly zero), recompute
// changes no bit, and the config fields of deepseek_v2 / deepseek_v3 parse, write back and
// refuse what dstrain does not do in one sentence; the presets have the published sizes.
// (Against DeepSeek's own computation: tests/train/hf_models_test.cpp's fixtures.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/decoder.h"
#include "tests/common/user_error.h"
#include "tests/model/gradient_checks.h"
#include "tests/model/host_params.h"
#include "tests/model/reference_fixture.h"

namespace dstrain {
namespace {

// A DeepSeek-V3-shaped config (q rank, sigmoid router with groups and a selection bias, yarn),
// or V2-shaped (q_proj, softmax, group-limited greedy, not renormalized and scaled).
ModelConfig small_deepseek(bool v3) {
  const std::string json = std::string(R"({"model_type": ")") +
                           (v3 ? "deepseek_v3" : "deepseek_v2") + R"(", "vocab_size": 37,
    "max_position_embeddings": 32, "hidden_size": 24, "intermediate_size": 20,
    "moe_intermediate_size": 10, "num_hidden_layers": 2, "num_attention_heads": 3,
    "kv_lora_rank": 10, "qk_nope_head_dim": 4, "qk_rope_head_dim": 6, "v_head_dim": 5,
    "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 3, "topk_group": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 100.0, "aux_loss_alpha": 0.0)" +
                           (v3 ? R"(, "q_lora_rank": 7, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.5,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8,
                     "mscale": 1.0, "mscale_all_dim": 0.8}})"
                               : R"(, "q_lora_rank": null, "topk_method": "group_limited_greedy",
    "scoring_func": "softmax", "norm_topk_prob": false, "routed_scaling_factor": 1.5})");
  return model_config_from_json(json, v3 ? "small-v3" : "small-v2");
}

// The routers' rows spread further than the rest: their logits, not the noise, decide.
double spread(const std::string& name) {
  return name.ends_with("gate.weight") ? 1.0 : name.ends_with("correction_bias") ? 0.5 : 0.2;
}

class LatentAttentionModel : public ::testing::TestWithParam<bool> {};

TEST_P(LatentAttentionModel, EveryGradientMatchesFiniteDifferences) {
  const ModelConfig config = small_deepseek(GetParam());
  const Decoder arch(config);
  ASSERT_TRUE(arch.parts().attention.latent());
  const ParamLayout& layout = arch.layout();
  test::HostParams params(layout);
  test::randomize_parameters(layout, config, params, spread);
  test::TokenBatch batch = test::random_tokens(config, 2, 7, 3);
  test::WholeModelRun run(arch, 2, 7, 1);
  run.forward_backward(params, batch, 1.0f / 14);
  const std::vector<double> norms =
      test::expect_gradients_match_finite_differences(run, params, layout, batch);
  int experts_with_gradient = 0, biases = 0;
  for (size_t i = 0; i < norms.size(); ++i) {
    const std::string& name = layout.params()[i].name;
    if (name.ends_with("e_score_correction_bias")) {
      EXPECT_EQ(norms[i], 0.0) << name << " only chooses experts";
      ++biases;
    } else if (name.find(".experts.") != std::string::npos) {
      experts_with_gradient += norms[i] > 0.0;
    } else {
      EXPECT_GT(norms[i], 0.0) << name;
    }
  }
  EXPECT_EQ(biases, GetParam() ? 1 : 0);
  EXPECT_GE(experts_with_gradient, 12) << "of 6 experts x 3 tensors";
}

TEST_P(LatentAttentionModel, RecomputeGivesBitwiseIdenticalGradients) {
  const Decoder arch(small_deepseek(GetParam()));
  const auto gradients = [&](Recompute r) {
    return test::model_gradients(arch, spread, 2, 7, 6, r);
  };
  const auto none = gradients(Recompute::None);
  EXPECT_EQ(gradients(Recompute::Selective), none);
  EXPECT_EQ(gradients(Recompute::Full), none);
}

INSTANTIATE_TEST_SUITE_P(DeepSeek, LatentAttentionModel, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "V3" : "V2");
                         });

TEST(LatentAttentionConfig, FieldsReadWriteBackAndMakeTheParts) {
  for (const bool v3 : {false, true}) {
    const ModelConfig config = small_deepseek(v3);
    const ModelConfig again = model_config_from_json(config.to_json().dump(), "again");
    for (const ModelConfig* c : {&config, &again}) {
      EXPECT_EQ(c->type, v3 ? ModelType::DeepSeekV3 : ModelType::DeepSeekV2);
      EXPECT_EQ(c->mla.q_lora_rank, v3 ? 7 : 0);
      EXPECT_EQ(c->mla.kv_lora_rank, 10);
      EXPECT_EQ(c->mla.qk_dim(), 10);
      EXPECT_EQ(c->mla.v_dim, 5);
      EXPECT_EQ(c->moe.groups, 3);
      EXPECT_EQ(c->moe.top_groups, 2);
      EXPECT_EQ(c->moe.sigmoid, v3);
      EXPECT_EQ(c->moe.selection_bias, v3);
      EXPECT_DOUBLE_EQ(c->moe.routed_scale, v3 ? 2.5 : 1.5);
      EXPECT_EQ(c->num_parameters(), config.num_parameters());
    }
    const DecoderParts parts = decoder_parts(config);
    EXPECT_EQ(parts.attention.head_dim, 10);
    EXPECT_EQ(parts.attention.out_width(), 15);
    // V2 scales where it does not renormalize; V3 renormalizes and scales.
    EXPECT_FLOAT_EQ(parts.mlp.routed_scale, v3 ? 2.5f : 1.5f);
    EXPECT_EQ(parts.mlp.norm_topk, v3);
    // DeepSeek's softmax scale: mscale(4, 0.8)^2 = (0.08 ln 4 + 1)^2 where yarn sets it.
    const double mscale = 0.1 * 0.8 * std::log(4.0) + 1.0;
    EXPECT_NEAR(parts.attention.q_scale, v3 ? mscale * mscale : 1.0, 1e-6);
  }
}

// DeepSeek's code renormalizes the top-k weights only for k > 1 (and V2 then scales where it does
// not); transformers' Mixtral renormalizes any k.
TEST(LatentAttentionConfig, RenormalizationFollowsEachFamilysCode) {
  const auto top1 = [](const std::string& file, const std::string& extra) {
    std::string json = test::slurp(std::string(DSTRAIN_SOURCE_DIR) + file);
    json = json.substr(0, json.rfind('}')) + R"(, "num_experts_per_tok": 1)" + extra + "}";
    return decoder_parts(model_config_from_json(json, file)).mlp;
  };
  const MlpPart v2 = top1("/tests/reference/deepseek_v2_tiny/config.json",
                          R"(, "norm_topk_prob": true, "topk_method": "greedy")");
  EXPECT_FALSE(v2.norm_topk);
  EXPECT_FLOAT_EQ(v2.routed_scale, 1.5f);
  EXPECT_FALSE(
      top1("/configs/models/deepseek-moe-16b.json", R"(, "norm_topk_prob": true)").norm_topk);
  EXPECT_TRUE(top1("/configs/models/moe-tiny.json", "").norm_topk);
}

// The UserError a config.json gets, or "" when it parses.
std::string config_error(const std::string& json) {
  return testing::user_error_of([&] { model_config_from_json(json, "m"); });
}

TEST(LatentAttentionConfig, WhatDstrainDoesNotDoIsOneSentence) {
  std::string base = test::slurp(std::string(DSTRAIN_SOURCE_DIR) +
                                 "/tests/reference/deepseek_v3_tiny/config.json");
  base = base.substr(0, base.rfind('}'));
  const auto message = [&](const std::string& extra) { return config_error(base + extra + "}"); };
  EXPECT_EQ(message(""), "");
  for (const auto& [extra, named] : std::vector<std::pair<std::string, std::string>>{
           {R"(, "topk_method": "greedy")", "topk_method"},
           {R"(, "scoring_func": "softmax")", "scoring_func"},
           {R"(, "scoring_func": 1)", "scoring_func"},
           {R"(, "n_group": 3)", "n_group"},
           {R"(, "topk_group": 1, "num_experts_per_tok": 5)", "topk_group"},
           {R"(, "attention_bias": true)", "attention_bias"},
           {R"(, "qk_rope_head_dim": 5)", "qk_rope_head_dim"},
           {R"(, "v_head_dim": 13)", "v_head_dim"},
           {R"(, "kv_lora_rank": 0)", "kv_lora_rank"},
           {R"(, "rope_scaling": {"type": "linear", "factor": 2})", "rope_scaling"},
           {R"(, "rope_scaling": {"type": "yarn"})", "factor"},
           {R"(, "rope_scaling": {"type": "yarn", "factor": 4,
                "original_max_position_embeddings": 8, "beta_slow": 0})",
            "\"beta_slow\" must be a positive"},
           {R"(, "rope_scaling": {"type": "yarn", "factor": 4,
                "original_max_position_embeddings": 8, "mscale": -1})",
            "\"mscale\" must be a non-negative"},
       }) {
    const std::string error = message(extra);
    EXPECT_NE(error.find(named), std::string::npos) << extra << ": " << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
  // V2's routers: greedy (and its misspelling) and group-limited greedy; not V3's.
  std::string v2 = test::slurp(std::string(DSTRAIN_SOURCE_DIR) +
                               "/tests/reference/deepseek_v2_tiny/config.json");
  v2 = v2.substr(0, v2.rfind('}'));
  EXPECT_EQ(config_error(v2 + R"(, "topk_method": "gready"})"), "");
  EXPECT_NE(config_error(v2 + R"(, "topk_method": "noaux_tc"})").find("topk_method"),
            std::string::npos);
  EXPECT_NE(config_error(v2 + R"(, "scoring_func": "sigmoid"})").find("scoring_func"),
            std::string::npos);
}

// DeepSeek-V2-Lite: 15.7B parameters (its model card); DeepSeek-V3: 671B without its 14B of
// multi-token prediction (the hub's 685B total), which dstrain skips.
TEST(LatentAttentionConfig, PresetsHaveThePublishedSizes) {
  const ModelConfig lite = load_model_config("deepseek-v2-lite");
  EXPECT_NEAR(static_cast<double>(lite.num_parameters()), 15.7e9, 0.05e9);
  EXPECT_EQ(lite.mla.q_lora_rank, 0);
  EXPECT_FALSE(lite.moe.moe_layer(0));
  EXPECT_TRUE(lite.moe.moe_layer(1));
  const ModelConfig v3 = load_model_config("deepseek-v3");
  EXPECT_NEAR(static_cast<double>(v3.num_parameters()), 671e9, 1e9);
  EXPECT_EQ(v3.mtp_layers, 1);
  const ParamLayout layout(v3);
  EXPECT_TRUE(layout.is_skipped_layer_tensor("model.layers.61.eh_proj.weight"));
  EXPECT_FALSE(layout.is_skipped_layer_tensor("model.layers.60.mlp.gate.weight"));
  EXPECT_FALSE(layout.is_skipped_layer_tensor("model.layers.62.eh_proj.weight"));
  EXPECT_FALSE(layout.is_skipped_layer_tensor("model.layers.6x.eh_proj.weight"));
  EXPECT_TRUE(load_model_config("moe-mla-tiny").mla.enabled());
}

}  // namespace
}  // namespace dstrain
