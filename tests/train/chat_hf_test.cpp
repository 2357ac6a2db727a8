// Chat training against Hugging Face transformers itself (tests/reference/
// make_chat_train_reference.py): the llama_tiny and qwen2_tiny models trained by
// LlamaForCausalLM / Qwen2ForCausalLM on a chat shard with its loss mask (44 conversations, one
// left out, some truncated at T+1, most padded; labels -100 on the prompt and the padding), the
// loss the sum over the step's trained targets / their count, 4 micro-batches of different counts.
//  - Step 1: the loss and every gradient, from the rows dstrain's DataLoader builds.
//  - 10 steps (the data wrapping after 5) on one rank and on dp x tp x pp plans: every loss and
//    pre-clip gradient norm, and the final weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "data/loader.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/stage.h"
#include "tests/common/temp_dir.h"
#include "tests/model/host_params.h"
#include "tests/model/reference_fixture.h"
#include "tests/train/hf_fixture.h"
#include "tests/train/small_model.h"
#include "train/weights_io.h"

namespace dstrain {
namespace {

// The shard (its mask beside it) both models train on, and a model's run in transformers.
const std::string kChatShard = test::fixture_dir("chat_train/train_000000.bin");
std::string reference_of(const std::string& model) { return "chat_train/" + model; }

// The largest |ours - ref| over every element of every gradient of the fixture file `path`.
double max_gradient_difference(const ParamLayout& layout, ParamProvider& params,
                               const std::string& path) {
  const SafetensorsFile grads = SafetensorsFile::open(path);
  double worst = 0.0;
  for (const ParamSpec& spec : layout.params()) {
    const std::vector<float> ref = grads.read_f32(spec.name);
    const float* ours = ParamLayout::view(spec, params.acquire_grads(spec.block)).f32();
    for (size_t i = 0; i < ref.size(); ++i) {
      worst = std::max(worst, std::abs(double(ours[i]) - ref[i]));
    }
  }
  return worst;
}

class ChatAgainstTransformers : public ::testing::TestWithParam<const char*> {};

// Step 1 as the trainer runs it on one rank: the loader's rows of every micro-batch, each
// forward with the loss gradient 1 / (the step's trained targets), the gradients summed.
TEST_P(ChatAgainstTransformers, LossAndGradientsOfTheFirstStep) {
  const std::string model_dir = test::fixture_dir(GetParam());
  const std::string reference = test::fixture_dir(reference_of(GetParam()));
  const nlohmann::json expected = test::fixture_expected(reference_of(GetParam()));
  const ModelConfig config = load_model_config(model_dir);
  const Decoder arch(config);
  const ParamLayout& layout = arch.layout();
  test::HostParams params(layout);
  test::load_fixture_params(layout, model_dir, params);

  const int64_t B = expected["batch"], T = expected["seq_len"], accum = expected["grad_accum"];
  LoaderOptions loader_options;
  loader_options.batch = B;
  loader_options.seq_len = T;
  loader_options.sequences_per_step = B * accum;
  DataLoader loader(TokenDataset::open(kChatShard, config.vocab_size), loader_options);
  ASSERT_EQ(loader.num_sequences(), expected["kept"].get<int64_t>());
  ASSERT_EQ(loader.conversations()->untrained, expected["left_out"].get<int64_t>());
  ASSERT_EQ(loader.conversations()->truncated, expected["truncated"].get<int64_t>());
  const int64_t trained = loader.trained_targets_ahead(B * accum);
  ASSERT_EQ(trained, expected["step_trained_targets"][0].get<int64_t>());

  auto backend = make_cpu_backend(2);
  auto allocator = make_cpu_allocator();
  ModelStage model(arch, whole_model(config), *backend, *allocator, B, T, DType::F32, true,
                   Recompute::None, 1);
  std::vector<int32_t> inputs(B * T), targets(B * T);
  double loss = 0.0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    loader.next_batch(inputs.data(), targets.data());
    // The micro-batches' counts differ (a mean per micro-batch would weigh tokens differently).
    EXPECT_EQ(
        std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != kIgnoreTarget; }),
        expected["micro_batch_trained_targets"][0][micro].get<int64_t>())
        << "micro-batch " << micro;
    Tensor input_tensor(inputs.data(), DType::I32, {B, T});
    Tensor target_tensor(targets.data(), DType::I32, {B, T});
    // forward returns the sum over the micro-batch's targets / (B*T), ignored ones adding 0.
    loss += model.forward(params, 0, B, T, input_tensor, target_tensor,
                          static_cast<float>(1.0 / trained), nullptr) *
            static_cast<double>(B * T) / static_cast<double>(trained);
    model.backward(params, 0, input_tensor, nullptr);
  }
  EXPECT_NEAR(loss, expected["initial_loss"].get<double>(), 2e-6);
  test::expect_gradients_match_fixture(layout, params, reference + "/grads0.safetensors");
  const double worst = max_gradient_difference(layout, params, reference + "/grads0.safetensors");
  EXPECT_LT(worst, 1e-4);  // the bound (the normalized error above is far stricter)
  std::cout << "  " << GetParam() << " step 1: |loss difference| "
            << std::abs(loss - expected["initial_loss"].get<double>())
            << ", max |gradient difference| " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ChatAgainstTransformers,
                         ::testing::Values("llama_tiny", "qwen2_tiny"));

class ChatTrainsLikeTransformers : public ::testing::TestWithParam<test::FixturePlan> {};

// The tolerances of hf_models_test.cpp's TrainsLikeTransformers (one rank and every plan against
// transformers): losses and pre-clip gradient norms within 1e-5 relative, final weights 2e-5.
TEST_P(ChatTrainsLikeTransformers, LossesGradNormsAndFinalWeights) {
  const test::FixturePlan& p = GetParam();
  const std::string reference = reference_of(p.fixture);
  testing::TempDir dir;
  TrainOptions options = test::fixture_run(p, test::fixture_expected(reference), dir.path());
  options.data = kChatShard;  // the mask is found beside it
  options.packing = "off";    // transformers' reference: one conversation per row
  options.val_data = options.data;
  test::expect_trains_like_transformers(options, reference, 1e-5, 2e-5);

  const nlohmann::json expected = test::fixture_expected(reference);
  const test::LoggedRun run = test::read_logged_run(options);
  double worst_loss = 0.0;
  for (size_t i = 0; i < run.losses.size(); ++i) {
    worst_loss =
        std::max(worst_loss, std::abs(run.losses[i] - expected["losses"][i].get<double>()));
  }
  const SafetensorsFile final_weights =
      SafetensorsFile::open(test::fixture_dir(reference) + "/final.safetensors");
  std::map<std::string, std::vector<float>> want;
  for (const std::string& name : final_weights.names()) want[name] = final_weights.read_f32(name);
  std::cout << "  " << p.name() << ": max |loss difference| " << worst_loss
            << ", max |final weight difference| " << test::max_weight_difference(want, run.weights)
            << "\n";
}

INSTANTIATE_TEST_SUITE_P(Plans, ChatTrainsLikeTransformers,
                         ::testing::Values(test::FixturePlan{"llama_tiny"},
                                           test::FixturePlan{"qwen2_tiny"},
                                           // 8 ranks: dp 2 x tp 2 x pp 2 (2 micro-batches each)
                                           test::FixturePlan{"llama_tiny", 2, 2, 2, 1},
                                           test::FixturePlan{"qwen2_tiny", 2, 2, 2, 1},
                                           test::FixturePlan{"llama_tiny", 2, 2, 2, 3},
                                           test::FixturePlan{"qwen2_tiny", 2, 1, 1, 3, true}),
                         [](const ::testing::TestParamInfo<test::FixturePlan>& info) {
                           return info.param.name();
                         });

}  // namespace
}  // namespace dstrain
