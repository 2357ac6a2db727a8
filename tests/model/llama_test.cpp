// The decoder built from parts (model/decoder.h, model/parts.h) with the LLaMA family's parts, on
// the CPU backend: every parameter's gradient against finite differences of the loss, for Llama
// (grouped-query attention, untied and tied head, with and without Llama's optional biases) and
// Qwen2 (q/k/v biases); recompute changes no bit; the configs of the presets parse with the real
// models' parameter counts, and bad configs are one sentence.
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
#include "tests/model/host_params.h"

namespace dstrain {
namespace {

struct Variant {
  const char* name;
  ModelType type;
  bool tied, attention_bias, mlp_bias;
};

ModelConfig small_llama(const Variant& v) {
  ModelConfig c;
  c.name = v.name;
  c.type = v.type;
  c.vocab_size = 37;  // odd, padded to 64 inside
  c.n_positions = 16;
  c.n_embd = 24;
  c.n_layer = 2;
  c.n_head = 4;  // head_dim 6
  c.n_kv_head = 2;
  c.intermediate_size = 40;
  c.norm_eps = 1e-5;
  c.rope_theta = 100.0;  // fast-turning rotations: positions matter within 5 tokens
  c.tie_word_embeddings = v.tied;
  const bool qwen2 = v.type == ModelType::Qwen2;
  c.qkv_bias = qwen2 || v.attention_bias;
  c.o_bias = !qwen2 && v.attention_bias;
  c.mlp_bias = !qwen2 && v.mlp_bias;
  return c;
}

class LlamaGradients : public ::testing::TestWithParam<Variant> {};

TEST_P(LlamaGradients, WholeModelGradientMatchesFiniteDifferences) {
  const ModelConfig config = small_llama(GetParam());
  const Decoder arch(config);
  const ParamLayout& layout = arch.layout();
  EXPECT_EQ(layout.tied_embedding(), config.tie_word_embeddings);
  test::HostParams params(layout);
  test::randomize_parameters(layout, config, params);
  const int64_t B = 2, T = 5, N = B * T;
  test::TokenBatch batch = test::random_tokens(config, B, T, 3);
  test::WholeModelRun run(arch, B, T, 1);
  run.forward_backward(params, batch, 1.0f / N);

  const std::vector<double> norms =
      test::expect_gradients_match_finite_differences(run, params, layout, batch);
  for (size_t i = 0; i < norms.size(); ++i) EXPECT_GT(norms[i], 0.0) << layout.params()[i].name;
  // The padded vocabulary rows never get a gradient.
  const ParamSpec& embed = layout.find("model.embed_tokens.weight");
  const float* embed_grad = ParamLayout::view(embed, params.acquire_grads(0)).f32();
  for (int64_t i = embed.file_numel(); i < embed.numel(); ++i) ASSERT_EQ(embed_grad[i], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(
    Variants, LlamaGradients,
    ::testing::Values(Variant{"llama_untied", ModelType::Llama, false, false, false},
                      Variant{"llama_tied_all_biases", ModelType::Llama, true, true, true},
                      Variant{"qwen2_tied", ModelType::Qwen2, true, false, false}),
    [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });

// Gradients after a forward + backward of `recompute`.
std::vector<std::vector<float>> gradients(const ModelConfig& config, Recompute recompute) {
  const Decoder arch(config);
  test::HostParams params(arch.layout());
  test::randomize_parameters(arch.layout(), config, params);
  const int64_t B = 2, T = 7;
  test::TokenBatch batch = test::random_tokens(config, B, T, 4);
  test::WholeModelRun run(arch, B, T, 2, recompute);
  run.forward_backward(params, batch, 1.0f / (B * T));
  return params.grads;
}

TEST(Llama, RecomputeGivesBitwiseIdenticalGradients) {
  const ModelConfig config = small_llama({"qwen2", ModelType::Qwen2, false, false, false});
  const auto none = gradients(config, Recompute::None);
  EXPECT_EQ(gradients(config, Recompute::Selective), none);
  EXPECT_EQ(gradients(config, Recompute::Full), none);
}

// Published parameter counts of the real models.
TEST(LlamaConfig, PresetsHaveTheRealModelsParameterCounts) {
  const ModelConfig llama = load_model_config("llama3.2-1b");
  EXPECT_EQ(llama.type, ModelType::Llama);
  EXPECT_EQ(llama.kv_heads(), 8);
  EXPECT_TRUE(llama.tie_word_embeddings);
  EXPECT_EQ(llama.num_parameters(), 1235814400);
  const ModelConfig qwen = load_model_config("qwen2.5-0.5b");
  EXPECT_EQ(qwen.type, ModelType::Qwen2);
  EXPECT_TRUE(qwen.qkv_bias && !qwen.o_bias && !qwen.mlp_bias);
  EXPECT_EQ(qwen.num_parameters(), 494032768);
  const ModelConfig deepseek = load_model_config("deepseek-7b");
  EXPECT_EQ(deepseek.n_layer, 30);
  EXPECT_FALSE(deepseek.tie_word_embeddings);
  EXPECT_EQ(deepseek.num_parameters(), 6910365696);
  const ModelConfig qwen7b = load_model_config("qwen2.5-7b");  // Qwen2.5-7B's 7.62B
  EXPECT_FALSE(qwen7b.tie_word_embeddings);
  EXPECT_EQ(qwen7b.kv_heads(), 4);
  EXPECT_EQ(qwen7b.num_parameters(), 7615616512);
  const ModelConfig qwen32b = load_model_config("qwen2.5-32b");  // Qwen2.5-32B-Instruct's
  EXPECT_EQ(qwen32b.kv_heads(), 8);
  EXPECT_EQ(qwen32b.num_parameters(), 32763876352);
  const ModelConfig tiny = load_model_config("llama-tiny");
  EXPECT_EQ(ParamLayout(tiny).total_numel() >= tiny.num_parameters(), true);
}

TEST(LlamaConfig, TheWrittenConfigReadsBackTheSame) {
  for (const char* name :
       {"llama3.2-1b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b", "deepseek-7b", "llama-tiny"}) {
    const ModelConfig config = load_model_config(name);
    const ModelConfig again = model_config_from_json(config.to_json().dump(), "again");
    EXPECT_EQ(again.to_json(), config.to_json()) << name;
    EXPECT_EQ(again.num_parameters(), config.num_parameters()) << name;
  }
  // Fields dstrain does not use pass through to the checkpoint's config.json.
  EXPECT_EQ(load_model_config("llama3.2-1b").to_json()["bos_token_id"], 128000);
}

TEST(LlamaConfig, Llama3RopeScalingStretchesOnlyTheLongWavelengths) {
  ModelConfig config = load_model_config("llama3.2-1b");
  const std::vector<double> scaled = rope_inverse_frequencies(config);
  config.rope_scaling = nullptr;
  const std::vector<double> plain = rope_inverse_frequencies(config);
  ASSERT_EQ(scaled.size(), 32u);
  EXPECT_EQ(scaled.front(), plain.front());                // wavelength 2 pi: kept
  EXPECT_NEAR(scaled.back(), plain.back() / 32.0, 1e-18);  // the longest: divided by 32
  for (size_t i = 0; i < scaled.size(); ++i) {
    EXPECT_LE(scaled[i], plain[i]);
    EXPECT_GE(scaled[i], plain[i] / 32.0 * (1 - 1e-12));
  }
}

void expect_config_error(const std::string& json, const std::string& fragment) {
  try {
    model_config_from_json(json, "bad.json");
    FAIL() << "no error for " << json;
  } catch (const UserError& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

TEST(LlamaConfig, BadConfigsAreOneSentence) {
  const std::string base =
      R"("vocab_size": 100, "max_position_embeddings": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4)";
  expect_config_error(R"({"model_type": "llama", )" + base + R"(, "num_key_value_heads": 3})",
                      "not a multiple of num_key_value_heads 3");
  expect_config_error(R"({"model_type": "llama", )" + base + R"(, "hidden_act": "gelu"})",
                      "hidden_act");
  expect_config_error(R"({"model_type": "llama", )" + base +
                          R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4}})",
                      "\"yarn\" is not supported");
  expect_config_error(R"({"model_type": "qwen2", )" + base + R"(, "use_sliding_window": true})",
                      "sliding-window");
  expect_config_error(R"({"model_type": "mistral", )" + base + "}", "model_type");
  expect_config_error(R"({"model_type": "llama", "vocab_size": 100})", "max_position_embeddings");
}

}  // namespace
}  // namespace dstrain
