// Hugging Face transformers' own LLaMA-family models (tests/reference/make_llama_reference.py:
// Llama with grouped-query attention and an untied head, F32 in 3 shards with an index; Qwen2
// with q/k/v biases and a tied head, BF16; Mixtral, 4 experts, top 2, F32 in shards; Qwen2-MoE
// with its shared expert) and PyTorch references written from DeepSeek's modeling code
// (DeepSeekMoE; DeepSeek-V2 and V3 with multi-head latent attention and their routers:
// make_deepseek_reference.py, make_deepseek_v2_reference.py), loaded from their model
// directories: the first
// micro-batch's loss and every gradient, and 10 training steps (losses, gradient norms, final
// weights) against transformers trained on the same data with the same AdamW.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/moe_aux_loss.h"
#include "model/stage.h"
#include "tests/common/temp_dir.h"
#include "tests/model/host_params.h"
#include "tests/model/reference_fixture.h"
#include "tests/train/hf_fixture.h"
#include "tests/train/small_model.h"
#include "train/trainer.h"
#include "train/weights_io.h"

namespace dstrain {
namespace {

// Hugging Face transformers' own models (tests/reference/make_llama_reference.py): the loss and
// every gradient of micro-batch 0, from the weights dstrain loads out of the model directory
// (Llama: F32 in 3 shards with an index; Qwen2: BF16, tied head).
class LlamaAgainstTransformers : public ::testing::TestWithParam<const char*> {};

TEST_P(LlamaAgainstTransformers, LossAndGradientsOfTheFirstMicroBatch) {
  const std::string dir = std::string(DSTRAIN_SOURCE_DIR "/tests/reference/") + GetParam() + "/";
  const ModelConfig config = load_model_config(dir);
  // The load-balancing loss where the config asks (its gradient's weight: the loss's, 1).
  const std::unique_ptr<MoeAuxLoss> aux = make_aux_loss(config, nullptr);
  if (aux) aux->begin_step(1.0, 1, 1);
  const Decoder arch(config, {}, ExpertParallel{1, 0, nullptr, nullptr, aux.get()});
  const ParamLayout& layout = arch.layout();
  test::HostParams params(layout);
  test::load_fixture_params(layout, dir, params);
  const int64_t B = 4, T = 16, N = B * T;
  const std::vector<int32_t> stream = test::read_llmc_u16(dir + "train.bin");
  std::vector<int32_t> inputs(stream.begin(), stream.begin() + N);
  std::vector<int32_t> targets(stream.begin() + 1, stream.begin() + N + 1);
  auto backend = make_cpu_backend(2);
  auto allocator = make_cpu_allocator();
  ModelStage model(arch, whole_model(config), *backend, *allocator, B, T, DType::F32, true,
                   Recompute::None, 1);
  Tensor input_tensor(inputs.data(), DType::I32, {B, T});
  Tensor target_tensor(targets.data(), DType::I32, {B, T});
  double loss = model.forward(params, 0, B, T, input_tensor, target_tensor, 1.0f / N, nullptr);
  model.backward(params, 0, input_tensor, nullptr);
  if (aux && aux->in_reported_loss()) loss += aux->coef() * aux->take_step_sum();
  const nlohmann::json expected = nlohmann::json::parse(test::slurp(dir + "expected.json"));
  EXPECT_NEAR(loss, expected["initial_loss"].get<double>(), 2e-6);

  // Every gradient: normalized error mse(ours, ref) / mse(ref, 0) and a max bound.
  const auto buffers = expected.value("buffers", std::vector<std::string>());
  test::expect_gradients_match_fixture(layout, params, dir + "grads0.safetensors",
                                       {buffers.begin(), buffers.end()});
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaAgainstTransformers,
                         ::testing::Values("llama_tiny", "qwen2_tiny", "mixtral_tiny",
                                           "qwen2_moe_tiny", "mixtral_aux_tiny",
                                           "qwen2_moe_aux_tiny", "deepseek_moe_tiny",
                                           "deepseek_moe_aux_tiny", "deepseek_v2_tiny",
                                           "deepseek_v3_tiny"));

class TrainsLikeTransformers : public ::testing::TestWithParam<test::FixturePlan> {};

// transformers' losses and pre-clip gradient norms within 1e-5 (relative; the bound is
// 1e-4), the final weights within 2e-5 (Adam divides by sqrt(v): an fp32 rounding difference
// where a gradient is tiny moves an update by up to ~lr * 1e-3).
TEST_P(TrainsLikeTransformers, LossesGradNormsAndFinalWeights) {
  const test::FixturePlan& p = GetParam();
  testing::TempDir dir;
  const TrainOptions options = test::fixture_run(p, test::fixture_expected(p.fixture), dir.path());
  test::expect_trains_like_transformers(options, p.fixture, 1e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Plans, TrainsLikeTransformers,
                         ::testing::Values(test::FixturePlan{"llama_tiny"},
                                           test::FixturePlan{"qwen2_tiny"},
                                           test::FixturePlan{"llama_tiny", 2, 1, 1, 3, true},
                                           test::FixturePlan{"qwen2_tiny", 2, 1, 1, 3, true},
                                           test::FixturePlan{"llama_tiny", 1, 1, 2, 1},
                                           test::FixturePlan{"qwen2_tiny", 1, 1, 2, 0},
                                           test::FixturePlan{"llama_tiny", 1, 2, 1, 0},
                                           test::FixturePlan{"qwen2_tiny", 1, 2, 2, 1},
                                           // Mixtral: experts replicated (no --ep yet)
                                           test::FixturePlan{"mixtral_tiny"},
                                           test::FixturePlan{"mixtral_tiny", 2, 1, 1, 3, true},
                                           test::FixturePlan{"mixtral_tiny", 1, 1, 2, 1},
                                           test::FixturePlan{"qwen2_moe_tiny"},
                                           test::FixturePlan{"qwen2_moe_tiny", 2, 1, 2, 2},
                                           // Expert parallelism: the experts split over ep of
                                           // the dp ranks, tokens exchanged by all-to-all.
                                           test::FixturePlan{"mixtral_tiny", 2, 1, 1, 3, false, 2},
                                           test::FixturePlan{"mixtral_tiny", 4, 1, 1, 3, false, 4},
                                           test::FixturePlan{"mixtral_tiny", 2, 1, 2, 3, false, 2},
                                           test::FixturePlan{"qwen2_moe_tiny", 2, 1, 1, 3, false, 2},
                                           test::FixturePlan{"qwen2_moe_tiny", 4, 1, 1, 3, false, 4},
                                           test::FixturePlan{"qwen2_moe_tiny", 4, 1, 2, 1, true, 2},
                                           // The load-balancing loss (one data-parallel rank:
                                           // over several its statistics are summed across
                                           // them, which transformers' loop does not do).
                                           test::FixturePlan{"mixtral_aux_tiny"},
                                           test::FixturePlan{"qwen2_moe_aux_tiny"},
                                           test::FixturePlan{"qwen2_moe_aux_tiny", 1, 1, 1, 3, true},
                                           // Over pipeline stages: the statistics travel with
                                           // each micro-batch.
                                           test::FixturePlan{"mixtral_aux_tiny", 1, 1, 2, 0},
                                           test::FixturePlan{"qwen2_moe_aux_tiny", 1, 1, 2, 1},
                                           // DeepSeekMoE against a PyTorch reference written
                                           // from DeepSeek's modeling code (its auxiliary loss
                                           // per micro-batch: the dp ranks split the batch).
                                           test::FixturePlan{"deepseek_moe_tiny"},
                                           test::FixturePlan{"deepseek_moe_aux_tiny"},
                                           test::FixturePlan{"deepseek_moe_aux_tiny", 2, 1, 1, 3,
                                                             false, 2, true},
                                           test::FixturePlan{"deepseek_moe_aux_tiny", 4, 1, 1, 1,
                                                             true, 4, true},
                                           test::FixturePlan{"deepseek_moe_aux_tiny", 2, 1, 3, 2,
                                                             false, 2, true},
                                           // DeepSeek-V2 and V3 (multi-head latent
                                           // attention, their routers) against PyTorch
                                           // references written from DeepSeek's code; V3's
                                           // selection bias unchanged by training.
                                           test::FixturePlan{"deepseek_v2_tiny"},
                                           test::FixturePlan{"deepseek_v3_tiny"},
                                           test::FixturePlan{"deepseek_v2_tiny", 2, 1, 1, 3,
                                                             false, 2},
                                           test::FixturePlan{"deepseek_v3_tiny", 2, 1, 1, 3,
                                                             false, 2},
                                           test::FixturePlan{"deepseek_v3_tiny", 1, 1, 2, 1},
                                           test::FixturePlan{"deepseek_v2_tiny", 2, 1, 2, 1,
                                                             true, 2},
                                           // Latent attention's heads split over tp ranks,
                                           // its latent path replicated.
                                           test::FixturePlan{"deepseek_v2_tiny", 1, 2, 1, 0},
                                           test::FixturePlan{"deepseek_v3_tiny", 2, 2, 2, 3,
                                                             false, 2},
                                           // Tensor parallelism with experts whole per rank.
                                           test::FixturePlan{"mixtral_tiny", 1, 2, 1, 0},
                                           test::FixturePlan{"qwen2_moe_aux_tiny", 1, 2, 1, 1},
                                           test::FixturePlan{"deepseek_moe_aux_tiny", 2, 2, 1, 3,
                                                             false, 2, true}),
                         [](const ::testing::TestParamInfo<test::FixturePlan>& info) {
                           return info.param.name();
                         });

// A checkpoint above --save-shard-size is a sharded Hugging Face directory: shards named as
// transformers names them, an index mapping every tensor, the same weights as one file, and a
// resume from it continues the run.
TEST(HfCheckpoints, ShardedCheckpointsHoldTheSameWeightsAndResume) {
  const nlohmann::json expected = test::fixture_expected("llama_tiny");
  testing::TempDir dir;
  std::filesystem::create_directories(dir.path() / "one");
  TrainOptions one_file =
      test::fixture_run(test::FixturePlan{"llama_tiny"}, expected, dir.path() / "one");
  one_file.steps = 2;
  one_file.save_shard_size = "0";
  TrainOptions sharded = one_file;
  sharded.save_shard_size = "30K";
  sharded.out = (dir.path() / "sharded").string();
  sharded.log = (dir.path() / "sharded.jsonl").string();
  std::ostringstream out;
  train(one_file, out);
  train(sharded, out);
  const std::filesystem::path step = std::filesystem::path(sharded.out) / "step-000002";
  ASSERT_TRUE(std::filesystem::exists(step / "model-00001-of-00004.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(step / "model.safetensors"));
  const nlohmann::json index =
      nlohmann::json::parse(test::slurp((step / "model.safetensors.index.json").string()));
  const SafetensorsFile whole =
      SafetensorsFile::open(one_file.out + "/step-000002/model.safetensors");
  ASSERT_EQ(index["weight_map"].size(), whole.names().size());
  uint64_t total = 0;
  for (const std::string& name : whole.names()) {
    const SafetensorsFile shard =
        SafetensorsFile::open(step / index["weight_map"][name].get<std::string>());
    EXPECT_EQ(shard.read_f32(name), whole.read_f32(name)) << name;
    total += whole.info(name).nbytes;
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);

  // The first run's options again with --resume, --init-from included: the checkpoint wins.
  TrainOptions resumed = sharded;
  resumed.resume = step.string();
  resumed.steps = 3;
  resumed.log = (dir.path() / "resumed.jsonl").string();
  std::ostringstream resumed_out;
  train(resumed, resumed_out);
  EXPECT_NE(resumed_out.str().find("--init-from " + sharded.init_from + " is ignored"),
            std::string::npos) << resumed_out.str();
  EXPECT_EQ(test::read_logged_run(resumed).losses.size(), 1u);
}

}  // namespace
}  // namespace dstrain
