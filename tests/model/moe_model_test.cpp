// The decoder with a mixture-of-experts MLP (model/moe_mlp.h; Mixtral's names and routing) on
// the CPU backend: every parameter's gradient against finite differences of the loss (the
// routing is piecewise constant: the probes are small enough to keep every token's choice),
// recompute changes no bit, an expert that receives no token gets no gradient, and the config
// fields of Mixtral and Qwen2-MoE parse with the parameter counts of the real models.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/stage.h"
#include "tests/model/gradient_checks.h"
#include "tests/common/user_error.h"
#include "tests/model/host_params.h"
#include "tests/model/reference_fixture.h"

namespace dstrain {
namespace {

ModelConfig small_mixtral(int64_t experts, int64_t top_k) {
  ModelConfig c;
  c.name = "mixtral_small";
  c.type = ModelType::Mixtral;
  c.vocab_size = 37;
  c.n_positions = 16;
  c.n_embd = 24;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.intermediate_size = 20;
  c.norm_eps = 1e-5;
  c.rope_theta = 100.0;
  c.tie_word_embeddings = false;
  c.qkv_bias = c.o_bias = c.mlp_bias = false;
  c.moe = {experts, top_k, true, 20, 0};
  return c;
}

// The router's rows spread further than the rest: its logits, not the noise, decide the choices.
double spread(const std::string& name) { return name.ends_with("gate.weight") ? 1.0 : 0.2; }

void randomize(const ParamLayout& layout, const ModelConfig& config, test::HostParams& params) {
  test::randomize_parameters(layout, config, params, spread);
}

TEST(MoeModel, EveryGradientMatchesFiniteDifferences) {
  const ModelConfig config = small_mixtral(4, 2);
  const Decoder arch(config);
  const ParamLayout& layout = arch.layout();
  test::HostParams params(layout);
  randomize(layout, config, params);
  test::TokenBatch batch = test::random_tokens(config, 2, 5, 3);
  test::WholeModelRun run(arch, 2, 5, 1);
  run.forward_backward(params, batch, 1.0f / 10);

  const std::vector<double> norms =
      test::expect_gradients_match_finite_differences(run, params, layout, batch);
  int experts_with_gradient = 0;
  for (size_t i = 0; i < norms.size(); ++i) {
    const std::string& name = layout.params()[i].name;
    if (name.find(".experts.") != std::string::npos) {
      experts_with_gradient += norms[i] > 0.0;
    } else {
      EXPECT_GT(norms[i], 0.0) << name;
    }
  }
  // 2 layers x 4 experts x 3 tensors: most experts are chosen by some token.
  EXPECT_GE(experts_with_gradient, 18);
}

// A router of zeros scores every expert alike: ties go to the lower index, so every token
// picks experts 0 and 1, and experts 2 and 3 receive no token. Their tensors get exactly zero
// gradient; the chosen experts' and the router's do not.
TEST(MoeModel, ExpertsWithoutTokensGetNoGradient) {
  const ModelConfig config = small_mixtral(4, 2);
  const Decoder arch(config);
  const ParamLayout& layout = arch.layout();
  test::HostParams params(layout);
  randomize(layout, config, params);
  for (int layer = 0; layer < 2; ++layer) {
    const ParamSpec& router =
        layout.find("model.layers." + std::to_string(layer) + ".block_sparse_moe.gate.weight");
    float* w = ParamLayout::view(router, params.acquire_params(router.block)).f32();
    std::fill(w, w + router.numel(), 0.0f);
  }
  test::TokenBatch batch = test::random_tokens(config, 2, 5, 4);
  test::WholeModelRun run(arch, 2, 5, 2);
  run.forward_backward(params, batch, 0.1f);
  for (const ParamSpec& spec : layout.params()) {
    const bool idle = spec.name.find(".experts.2.") != std::string::npos ||
                      spec.name.find(".experts.3.") != std::string::npos;
    const float* grad = ParamLayout::view(spec, params.acquire_grads(spec.block)).f32();
    double norm = 0.0;
    for (int64_t i = 0; i < spec.file_numel(); ++i) norm += double(grad[i]) * grad[i];
    if (idle) {
      EXPECT_EQ(norm, 0.0) << spec.name;
    } else {
      EXPECT_GT(norm, 0.0) << spec.name;
    }
  }
}

TEST(MoeModel, RecomputeGivesBitwiseIdenticalGradients) {
  const Decoder arch(small_mixtral(5, 3));
  const auto gradients = [&](Recompute r) {
    return test::model_gradients(arch, spread, 2, 5, 6, r);
  };
  const auto none = gradients(Recompute::None);
  EXPECT_EQ(gradients(Recompute::Selective), none);
  EXPECT_EQ(gradients(Recompute::Full), none);
}

// Published parameter counts: Mixtral 8x7B 46.7B; its config read back the same.
TEST(MoeConfig, MixtralFieldsReadAndWriteBack) {
  const std::string mixtral = R"({"model_type": "mixtral", "vocab_size": 32000,
    "max_position_embeddings": 32768, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false,
    "router_aux_loss_coef": 0.02, "output_router_logits": false})";
  const ModelConfig config = model_config_from_json(mixtral, "mixtral");
  EXPECT_EQ(config.type, ModelType::Mixtral);
  EXPECT_EQ(config.moe.experts, 8);
  EXPECT_EQ(config.moe.top_k, 2);
  EXPECT_TRUE(config.moe.norm_topk);
  EXPECT_EQ(config.moe.expert_width, 14336);
  EXPECT_EQ(config.num_parameters(), 46702792704);
  const ModelConfig again = model_config_from_json(config.to_json().dump(), "again");
  EXPECT_EQ(again.to_json(), config.to_json());
  EXPECT_EQ(config.to_json()["router_aux_loss_coef"], 0.02);  // passes through
}

// Qwen1.5-MoE-A2.7B: 60 experts of 1408, top 4, not renormalized, a shared expert of 5632 behind
// its gate; 14.3B parameters as published.
TEST(MoeConfig, QwenMoePresetHasTheRealModelsParameterCount) {
  const ModelConfig config = load_model_config("qwen1.5-moe-a2.7b");
  EXPECT_EQ(config.type, ModelType::Qwen2Moe);
  EXPECT_EQ(config.moe.experts, 60);
  EXPECT_EQ(config.moe.top_k, 4);
  EXPECT_FALSE(config.moe.norm_topk);
  EXPECT_EQ(config.moe.expert_width, 1408);
  EXPECT_EQ(config.moe.shared_width, 5632);
  EXPECT_TRUE(config.qkv_bias);
  EXPECT_EQ(config.num_parameters(), 14315784192);
  const ModelConfig again = model_config_from_json(config.to_json().dump(), "again");
  EXPECT_EQ(again.to_json(), config.to_json());
  EXPECT_EQ(load_model_config("mixtral-8x7b").num_parameters(), 46702792704);
}

// Qwen2-MoE's dense layers, as transformers places them: not in mlp_only_layers, and every
// decoder_sparse_step-th layer ((layer + 1) % step == 0); the layout gives each its MLP.
TEST(MoeConfig, DenseLayersAmongMoeLayersFollowTransformersRule) {
  const std::string base = R"({"model_type": "qwen2_moe", "vocab_size": 97,
    "max_position_embeddings": 32, "hidden_size": 32, "intermediate_size": 56,
    "num_hidden_layers": 6, "num_attention_heads": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40, )";
  const ModelConfig config =
      model_config_from_json(base + R"("decoder_sparse_step": 2, "mlp_only_layers": [3]})", "m");
  std::vector<bool> moe;
  for (int64_t layer = 0; layer < 6; ++layer) moe.push_back(config.moe.moe_layer(layer));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true}));
  const ParamLayout layout(config);
  EXPECT_TRUE(layout.contains("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_FALSE(layout.contains("model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(layout.contains("model.layers.1.mlp.experts.3.down_proj.weight"));
  EXPECT_TRUE(layout.contains("model.layers.3.mlp.up_proj.weight"));
  const ModelConfig again = model_config_from_json(config.to_json().dump(), "again");
  EXPECT_EQ(again.to_json(), config.to_json());
  EXPECT_EQ(again.num_parameters(), config.num_parameters());
}

// DeepSeekMoE 16B (deepseek-ai/deepseek-moe-16b-base's config.json): 64 routed experts of 1408,
// top 6, two shared experts (one SwiGLU of 2 x 1408, no gate), the first layer dense (10944);
// 16.4B parameters as published, counted here from the shapes.
TEST(MoeConfig, DeepSeekMoePresetFieldsLayersAndParameterCount) {
  const ModelConfig config = load_model_config("deepseek-moe-16b");
  EXPECT_EQ(config.type, ModelType::DeepSeekMoe);
  EXPECT_EQ(config.moe.experts, 64);
  EXPECT_EQ(config.moe.top_k, 6);
  EXPECT_EQ(config.moe.expert_width, 1408);
  EXPECT_EQ(config.moe.shared_width, 2 * 1408);
  EXPECT_FALSE(config.moe.shared_gate);
  EXPECT_FALSE(config.moe.norm_topk);
  EXPECT_DOUBLE_EQ(config.moe.aux_alpha, 0.001);
  EXPECT_TRUE(config.moe.seq_aux);
  EXPECT_FALSE(config.moe.moe_layer(0));
  for (int64_t l = 1; l < 28; ++l) EXPECT_TRUE(config.moe.moe_layer(l)) << l;
  const int64_t V = 102400, C = 2048, L = 28, dense = 10944, E = 64, I = 1408;
  const int64_t layer_common = 4 * C * C + 2 * C;  // attention and the two norms
  const int64_t moe = E * 3 * C * I + 3 * C * 2 * I + E * C;
  EXPECT_EQ(config.num_parameters(), 2 * V * C + C + L * layer_common + 3 * C * dense + 27 * moe);
  EXPECT_NEAR(static_cast<double>(config.num_parameters()) / 1e9, 16.4, 0.05);
  const ModelConfig again = model_config_from_json(config.to_json().dump(), "again");
  EXPECT_EQ(again.to_json(), config.to_json());
  EXPECT_EQ(again.moe.first_dense, 1);
  EXPECT_EQ(config.to_json()["n_shared_experts"], 2);
  // Its weight names: DeepSeek's mlp.gate, mlp.experts.N.*, mlp.shared_experts.*.
  const ParamLayout layout(config);
  EXPECT_TRUE(layout.contains("model.layers.1.mlp.gate.weight"));
  EXPECT_TRUE(layout.contains("model.layers.1.mlp.experts.63.down_proj.weight"));
  EXPECT_TRUE(layout.contains("model.layers.1.mlp.shared_experts.up_proj.weight"));
  EXPECT_TRUE(layout.contains("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_FALSE(layout.contains("model.layers.0.mlp.gate.weight"));
}

// The UserError a config.json gets, or "" when it parses.
std::string config_error(const std::string& json) {
  return testing::user_error_of([&] { model_config_from_json(json, "m"); });
}

TEST(MoeConfig, DeepSeekRoutersDstrainDoesNotRunAreOneSentence) {
  std::string base =
      test::slurp(std::string(DSTRAIN_SOURCE_DIR) + "/configs/models/deepseek-moe-16b.json");
  base = base.substr(0, base.rfind('}'));
  auto message = [&](const std::string& extra) { return config_error(base + extra + "}"); };
  EXPECT_EQ(message(""), "");
  EXPECT_NE(message(R"(, "topk_method": "group_limited_greedy")").find("topk_method"),
            std::string::npos);
  EXPECT_NE(message(R"(, "pretraining_tp": 2)").find("pretraining_tp"), std::string::npos);
  EXPECT_EQ(model_config_from_json(base + R"(, "aux_loss_alpha": 0})", "m").moe.aux_alpha, 0.0);
}

TEST(MoeConfig, WhatDstrainDoesNotDoYetIsOneSentence) {
  const std::string base = R"({"model_type": "mixtral", "vocab_size": 97,
    "max_position_embeddings": 32, "hidden_size": 32, "intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 4,
    "num_experts_per_tok": 2)";
  auto message = [&](const std::string& extra) { return config_error(base + extra + "}"); };
  EXPECT_EQ(message(""), "");
  // The load-balancing loss is read (transformers' default coefficient 0.001), not refused.
  EXPECT_EQ(message(R"(, "output_router_logits": true)"), "");
  EXPECT_EQ(
      model_config_from_json(base + R"(, "output_router_logits": true})", "m").moe.aux_loss_coef,
      0.001);
  EXPECT_EQ(
      model_config_from_json(base + R"(, "router_aux_loss_coef": 0.02})", "m").moe.aux_loss_coef,
      0.0);
  EXPECT_NE(message(R"(, "sliding_window": 4096)").find("sliding-window"), std::string::npos);
  EXPECT_NE(message(R"(, "router_jitter_noise": 0.1)").find("jitter"), std::string::npos);
  EXPECT_NE(message(R"(, "num_experts_per_tok": 5)").find("num_experts_per_tok"),
            std::string::npos);
  // Under tp the experts stay whole (their width need not divide); a dense layer's MLP splits.
  EXPECT_EQ(tp_unsupported_reason(model_config_from_json(base + "}", "m"), 2), "");
  const std::string qwen = R"({"model_type": "qwen2_moe", "vocab_size": 97,
    "max_position_embeddings": 32, "hidden_size": 32, "intermediate_size": 45,
    "moe_intermediate_size": 15, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0]})";
  EXPECT_EQ(tp_unsupported_reason(model_config_from_json(qwen, "q"), 2),
            "tensor parallelism over 2 ranks needs the MLP width intermediate_size (45) divisible "
            "by 2");
}

}  // namespace
}  // namespace dstrain
