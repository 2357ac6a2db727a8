// The parts a model is made of (model/parts.h): what each model_type's config chooses, and the
// layout the parts declare (names, shapes, tp splits, initialization) in the order the decoder
// reads them.
#include "model/parts.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/config.h"
#include "model/layout.h"

namespace dstrain {
namespace {

TEST(Parts, Gpt2IsLayerNormLearnedPositionsGeluAndATiedHead) {
  const ModelConfig config = load_model_config("gpt2-124m");
  const DecoderParts parts = decoder_parts(config);
  EXPECT_EQ(parts.norm.kind, NormKind::LayerNorm);
  EXPECT_TRUE(parts.norm.has_bias());
  EXPECT_EQ(parts.position.kind, PositionKind::Learned);
  EXPECT_EQ(parts.position.table_rows, 1024);
  EXPECT_EQ(parts.mlp.kind, MlpKind::Gelu);
  EXPECT_EQ(parts.mlp.width, 4 * 768);
  EXPECT_EQ(parts.mlp.up_factor(), 1);
  EXPECT_TRUE(parts.head.tied);
  EXPECT_TRUE(parts.names.in_by_out);
  EXPECT_TRUE(parts.scaled_residual_init);
  EXPECT_EQ(parts.attention.heads, 12);
  EXPECT_EQ(parts.attention.kv_heads, 12);
  EXPECT_EQ(parts.attention.qkv_width(), 3 * 768);
}

TEST(Parts, LlamaFamilyIsRmsNormRotarySwigluAndTheConfigsHead) {
  const ModelConfig qwen = load_model_config("qwen2.5-0.5b");
  const DecoderParts parts = decoder_parts(qwen);
  EXPECT_EQ(parts.norm.kind, NormKind::RMSNorm);
  EXPECT_FALSE(parts.norm.has_bias());
  EXPECT_EQ(parts.norm.eps, static_cast<float>(qwen.norm_eps));
  EXPECT_EQ(parts.position.kind, PositionKind::Rotary);
  EXPECT_EQ(parts.mlp.kind, MlpKind::SwiGLU);
  EXPECT_EQ(parts.mlp.up_factor(), 2);
  EXPECT_TRUE(parts.attention.qkv_bias);
  EXPECT_FALSE(parts.attention.o_bias);
  EXPECT_EQ(parts.attention.qkv_width(), (14 + 2 * 2) * 64);
  EXPECT_TRUE(parts.head.tied);
  EXPECT_FALSE(parts.names.in_by_out);
  EXPECT_FALSE(parts.scaled_residual_init);
  EXPECT_FALSE(decoder_parts(load_model_config("deepseek-7b")).head.tied);
}

// A layer's tensors come norm, qkv, o, norm, up, down (weights before biases), whatever the
// family, with the initialization each part asks for.
TEST(Parts, ALayersTensorsComeInThePartsOrderWithTheirInitialization) {
  struct Expected {
    std::string name;
    ParamInit init;
  };
  const std::vector<Expected> gpt2 = {{"h.0.ln_1.weight", ParamInit::One},
                                      {"h.0.ln_1.bias", ParamInit::Zero},
                                      {"h.0.attn.c_attn.weight", ParamInit::Normal},
                                      {"h.0.attn.c_attn.bias", ParamInit::Zero},
                                      {"h.0.attn.c_proj.weight", ParamInit::ResidualNormal},
                                      {"h.0.attn.c_proj.bias", ParamInit::Zero},
                                      {"h.0.ln_2.weight", ParamInit::One},
                                      {"h.0.ln_2.bias", ParamInit::Zero},
                                      {"h.0.mlp.c_fc.weight", ParamInit::Normal},
                                      {"h.0.mlp.c_fc.bias", ParamInit::Zero},
                                      {"h.0.mlp.c_proj.weight", ParamInit::ResidualNormal},
                                      {"h.0.mlp.c_proj.bias", ParamInit::Zero}};
  const std::vector<Expected> deepseek = {
      {"model.layers.0.input_layernorm.weight", ParamInit::One},
      {"model.layers.0.self_attn.q_proj.weight", ParamInit::Normal},
      {"model.layers.0.self_attn.k_proj.weight", ParamInit::Normal},
      {"model.layers.0.self_attn.v_proj.weight", ParamInit::Normal},
      {"model.layers.0.self_attn.o_proj.weight", ParamInit::Normal},
      {"model.layers.0.post_attention_layernorm.weight", ParamInit::One},
      {"model.layers.0.mlp.gate_proj.weight", ParamInit::Normal},
      {"model.layers.0.mlp.up_proj.weight", ParamInit::Normal},
      {"model.layers.0.mlp.down_proj.weight", ParamInit::Normal}};
  for (const auto& [model, expected] :
       {std::pair{"gpt2-124m", gpt2}, std::pair{"deepseek-7b", deepseek}}) {
    const ParamLayout layout(load_model_config(model));
    const std::vector<int>& block = layout.block_params(ParamLayout::layer_block(0));
    ASSERT_EQ(block.size(), expected.size()) << model;
    for (size_t i = 0; i < block.size(); ++i) {
      const ParamSpec& spec = layout.params()[static_cast<size_t>(block[i])];
      EXPECT_EQ(spec.name, expected[i].name) << model;
      EXPECT_EQ(spec.init, expected[i].init) << spec.name;
    }
  }
}

// Grouped-query attention's k/v heads must split over tp as its query heads do; GPT-2's kv
// heads are its heads, so its message names n_head first.
TEST(Parts, TensorParallelismNeedsTheKeyValueHeadsToSplit) {
  ModelConfig config = load_model_config("llama-tiny");
  config.n_head = 8;
  config.n_kv_head = 2;
  config.n_embd = 64;
  config.intermediate_size = 128;
  EXPECT_EQ(tp_unsupported_reason(config, 4),
            "tensor parallelism over 4 ranks needs num_key_value_heads (2) divisible by 4");
  EXPECT_EQ(tp_unsupported_reason(config, 2), "");
}

}  // namespace
}  // namespace dstrain
