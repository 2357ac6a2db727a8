// The whole model: every gradient tensor against an independent PyTorch implementation
// (tests/reference/gpt2_tiny, made by make_gpt2_reference.py), and against finite
// differences of the model's own loss.
#include "model/gpt2.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <vector>

#include "core/rng.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "tests/model/host_params.h"
#include "tests/model/reference_fixture.h"

namespace dstrain {
namespace {

const std::string kFixture = DSTRAIN_SOURCE_DIR "/tests/reference/gpt2_tiny/";

using test::slurp;

using TestParams = test::HostParams;

using test::read_llmc_u16;

TEST(Gpt2, GradientsMatchPyTorchReference) {
  const ModelConfig config =
      model_config_from_json(slurp(kFixture + "config.json"), "fixture config.json");
  const ParamLayout layout(config);
  TestParams params(layout);
  const SafetensorsFile weights = SafetensorsFile::open(kFixture + "model.safetensors");
  for (const ParamSpec& spec : layout.params()) {
    Tensor view = ParamLayout::view(spec, params.acquire_params(spec.block));
    weights.read_f32(spec.name, view.f32(), spec.file_numel());
  }
  const int64_t B = 4, T = 16, N = B * T;
  const std::vector<int32_t> stream = read_llmc_u16(kFixture + "train.bin");
  std::vector<int32_t> inputs(stream.begin(), stream.begin() + N);
  std::vector<int32_t> targets(stream.begin() + 1, stream.begin() + N + 1);

  auto backend = make_cpu_backend(2);
  auto allocator = make_cpu_allocator();
  Gpt2 model(config, *backend, *allocator, B, T, DType::F32, true);
  Tensor input_tensor(inputs.data(), DType::I32, {B, T});
  Tensor target_tensor(targets.data(), DType::I32, {B, T});
  // Logits first, from a forward without backward (a training forward overwrites the logits
  // with their gradient).
  const double eval_loss = model.forward(params, input_tensor, target_tensor, 0.0f, nullptr);
  std::vector<float> our_logits(model.logits().f32(),
                                model.logits().f32() + model.logits().numel());
  const double loss = model.forward(params, input_tensor, target_tensor, 1.0f / N, nullptr);
  EXPECT_EQ(loss, eval_loss);
  model.backward(params, input_tensor, nullptr);

  const nlohmann::json expected = nlohmann::json::parse(slurp(kFixture + "expected.json"));
  EXPECT_NEAR(loss, expected["initial_loss"].get<double>(), 1e-5);

  // Logits: the first V columns of our padded (N, Vp) logits.
  const SafetensorsFile logits_file = SafetensorsFile::open(kFixture + "logits0.safetensors");
  const std::vector<float> ref_logits = logits_file.read_f32(logits_file.names().front());
  ASSERT_EQ(ref_logits.size(), static_cast<size_t>(N * config.vocab_size));
  const float* logits = our_logits.data();
  double max_logit_error = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t v = 0; v < config.vocab_size; ++v) {
      max_logit_error =
          std::max(max_logit_error, std::abs(double(logits[n * config.padded_vocab() + v]) -
                                             ref_logits[n * config.vocab_size + v]));
    }
  }
  EXPECT_LT(max_logit_error, 1e-5);

  // Every gradient tensor: normalized error mse(ours, ref) / mse(ref, 0) and a max bound.
  test::expect_gradients_match_fixture(layout, params, kFixture + "grads0.safetensors");
  // The padded vocabulary rows of wte never get a gradient.
  const ParamSpec& wte = layout.find("wte.weight");
  const float* wte_grad = ParamLayout::view(wte, params.acquire_grads(0)).f32();
  for (int64_t i = wte.file_numel(); i < wte.numel(); ++i) ASSERT_EQ(wte_grad[i], 0.0f);
}

ModelConfig small_config() {
  ModelConfig config;
  config.name = "gradcheck";
  config.vocab_size = 11;  // odd, padded to 64 inside
  config.n_positions = 8;
  config.n_embd = 12;
  config.n_layer = 2;
  config.n_head = 3;  // head_dim 4
  return config;
}

TEST(Gpt2, WholeModelGradientMatchesFiniteDifferences) {
  const ModelConfig config = small_config();
  const ParamLayout layout(config);
  TestParams params(layout);
  std::vector<Tensor> flats;
  for (int block = 0; block < layout.num_blocks(); ++block) {
    flats.push_back(params.acquire_params(block));
  }
  init_model_parameters(layout, config, 7, flats);
  // Larger, non-zero weights everywhere (biases and norms too) so every path matters.
  Rng rng(99);
  for (const ParamSpec& spec : layout.params()) {
    float* data = ParamLayout::view(spec, flats[spec.block]).f32();
    for (int64_t i = 0; i < spec.file_numel(); ++i) data[i] += float(0.2 * rng.normal());
  }
  const int64_t B = 2, T = 5, N = B * T;
  std::vector<int32_t> inputs(N), targets(N);
  for (int64_t i = 0; i < N; ++i) {
    inputs[i] = int32_t(rng.below(config.vocab_size));
    targets[i] = int32_t(rng.below(config.vocab_size));
  }
  Tensor input_tensor(inputs.data(), DType::I32, {B, T});
  Tensor target_tensor(targets.data(), DType::I32, {B, T});
  auto backend = make_cpu_backend(1);
  auto allocator = make_cpu_allocator();
  Gpt2 model(config, *backend, *allocator, B, T, DType::F32, true);
  model.forward(params, input_tensor, target_tensor, 1.0f / N, nullptr);
  model.backward(params, input_tensor, nullptr);

  const double h = 1e-3;
  int checked = 0;
  for (const ParamSpec& spec : layout.params()) {
    float* param = ParamLayout::view(spec, flats[spec.block]).f32();
    const float* grad = ParamLayout::view(spec, params.acquire_grads(spec.block)).f32();
    double grad_norm = 0.0;
    for (int64_t i = 0; i < spec.file_numel(); ++i) grad_norm += double(grad[i]) * grad[i];
    EXPECT_GT(grad_norm, 0.0) << spec.name;
    for (int probe = 0; probe < 4; ++probe) {
      const int64_t i = int64_t(rng.below(spec.file_numel()));
      const float saved = param[i];
      param[i] = float(saved + h);
      const double plus = model.forward(params, input_tensor, target_tensor, 0.0f, nullptr);
      param[i] = float(saved - h);
      const double minus = model.forward(params, input_tensor, target_tensor, 0.0f, nullptr);
      param[i] = saved;
      const double numeric = (plus - minus) / (2 * h);
      EXPECT_NEAR(grad[i], numeric, 5e-4 + 2e-2 * std::abs(numeric))
          << spec.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4 * int(layout.params().size()));
}

// Activation checkpointing changes what is kept, never the result: the gradients with full
// and selective recompute are bitwise those without, and recompute saves memory. 16-bit
// activations too: the MLP's GELU (matmul_gelu_forward) reads the stored, rounded pre-GELU, as
// selective recompute's gelu_forward does.
void check_recompute_is_bitwise(DType act_dtype) {
  SCOPED_TRACE(dtype_name(act_dtype));
  const ModelConfig config = small_config();
  const ParamLayout layout(config);
  const int64_t B = 3, T = 7, N = B * T;
  Rng rng(21);
  std::vector<int32_t> inputs(N), targets(N);
  for (int64_t i = 0; i < N; ++i) {
    inputs[i] = int32_t(rng.below(config.vocab_size));
    targets[i] = int32_t(rng.below(config.vocab_size));
  }
  Tensor input_tensor(inputs.data(), DType::I32, {B, T});
  Tensor target_tensor(targets.data(), DType::I32, {B, T});
  auto backend = make_cpu_backend(2);
  std::vector<std::vector<std::vector<float>>> grads;
  std::vector<double> losses;
  std::vector<size_t> activation_bytes;
  for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    TestParams params(layout);
    std::vector<Tensor> flats;
    for (int block = 0; block < layout.num_blocks(); ++block)
      flats.push_back(params.acquire_params(block));
    init_model_parameters(layout, config, 3, flats);
    auto allocator = make_cpu_allocator();
    Gpt2 model(config, *backend, *allocator, B, T, act_dtype, true, mode);
    activation_bytes.push_back(allocator->stats().current[int(MemCategory::Activations)]);
    // Two micro-batches accumulate, as in training.
    for (int micro = 0; micro < 2; ++micro) {
      losses.push_back(model.forward(params, input_tensor, target_tensor, 1.0f / N, nullptr));
      model.backward(params, input_tensor, nullptr);
    }
    grads.push_back(params.grads);
  }
  for (size_t mode = 1; mode < grads.size(); ++mode) {
    EXPECT_EQ(losses[2 * mode], losses[0]);
    for (size_t block = 0; block < grads[0].size(); ++block) {
      ASSERT_EQ(grads[mode][block], grads[0][block]) << "mode " << mode << " block " << block;
    }
  }
  EXPECT_LT(activation_bytes[1], activation_bytes[0]);  // selective keeps less
  EXPECT_LT(activation_bytes[2], activation_bytes[1]);  // full keeps least
}

TEST(Gpt2, RecomputeGivesBitwiseIdenticalGradients) {
  for (DType act_dtype : {DType::F32, DType::BF16, DType::F16}) {
    check_recompute_is_bitwise(act_dtype);
  }
}

TEST(ModelConfig, PresetsLoadAndCountParameters) {
  const ModelConfig gpt2 = load_model_config("gpt2-124m");
  EXPECT_EQ(gpt2.n_layer, 12);
  EXPECT_EQ(gpt2.padded_vocab(), 50304);
  // Hugging Face's GPT2LMHeadModel(gpt2) has 124,439,808 parameters (tied head).
  EXPECT_EQ(gpt2.num_parameters(), 124439808);
  const ModelConfig six = load_model_config("6b");
  EXPECT_EQ(six.n_layer, 28);
  EXPECT_EQ(six.n_embd, 4096);
  EXPECT_EQ(six.n_head, 16);
  EXPECT_EQ(six.n_positions, 2048);
  EXPECT_EQ(six.vocab_size, 50257);
  for (const char* name : {"tiny", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "13b"}) {
    EXPECT_NO_THROW(load_model_config(name)) << name;
  }
  // The layout holds every parameter once (plus alignment and vocabulary padding).
  const ParamLayout layout(gpt2);
  int64_t counted = 0;
  for (const ParamSpec& spec : layout.params()) {
    counted += spec.file_numel();
    EXPECT_EQ(spec.offset % 32, 0) << spec.name;
  }
  EXPECT_EQ(counted, gpt2.num_parameters());
  EXPECT_GE(layout.total_numel(), counted);
  EXPECT_EQ(layout.num_blocks(), 14);
}

void expect_config_error(const std::string& json, const std::string& fragment) {
  try {
    model_config_from_json(json, "test.json");
    FAIL() << "no error for " << json;
  } catch (const UserError& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

TEST(ModelConfig, BadConfigsAreClearErrors) {
  const std::string ok = R"("vocab_size": 100, "n_positions": 64, "n_embd": 32, "n_head": 4)";
  expect_config_error("{" + ok + "}", "\"n_layer\"");
  expect_config_error("{" + ok + R"(, "n_layer": 0})", "out of range");
  expect_config_error("{" + ok + R"(, "n_layer": -3})", "out of range");
  expect_config_error("{" + ok + R"(, "n_layer": 2000000})", "out of range");
  expect_config_error("{" + ok + R"(, "n_layer": "two"})", "must be an integer");
  expect_config_error(
      R"({"vocab_size": 100, "n_positions": 64, "n_embd": 30, "n_head": 4, "n_layer": 2})",
      "not divisible");
  expect_config_error("{" + ok + R"(, "n_layer": 2, "model_type": "mistral"})", "model_type");
  expect_config_error("{" + ok + R"(, "n_layer": 2, "layer_norm_epsilon": 1e-6})",
                      "layer_norm_epsilon");
  expect_config_error("{" + ok + R"(, "n_layer": 2, "activation_function": "relu"})", "activation");
  expect_config_error("{not json", "not valid JSON");
  expect_config_error("[1, 2]", "not a JSON object");
  EXPECT_NO_THROW(model_config_from_json("{" + ok + R"(, "n_layer": 2})", "test.json"));
}

TEST(ModelConfig, UnknownPresetNamesThePresets) {
  try {
    load_model_config("gpt5");
    FAIL();
  } catch (const UserError& error) {
    EXPECT_NE(std::string(error.what()).find("gpt2-124m"), std::string::npos) << error.what();
  }
  EXPECT_THROW(load_model_config("/nonexistent/config.json"), UserError);
}

}  // namespace
}  // namespace dstrain
