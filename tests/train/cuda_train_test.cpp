// Training on the CUDA backend against the CPU backend: the same 20-step run, the same data,
// the same initial weights. Skips without a GPU (and in a build without the CUDA backend).
//
// Tolerances
// - fp32: per-step loss within 1e-4 relative. The kernels compute in fp32 like the CPU twins
//   but sum in other orders (tiled GEMMs, block reductions), so the runs drift apart by
//   rounding only.
// - fp16: per-step loss within 1e-2 relative. Every stored activation and gradient is
//   rounded to fp16 (2^-11 relative); a different summation order before a rounding can flip
//   it by one unit, and 20 steps of AdamW carry such differences into the weights. Both runs
//   must skip the same steps for overflow (the scaler's decisions depend on magnitudes, far
//   from the rounding level).
// - 2 simulated ranks sharing one GPU with ZeRO-3 (or 2) + offload (the local communicator
//   through host copies): against 1 rank on the GPU, the equivalence test's own tolerances (losses
//   1e-6 relative, weights 1e-5 absolute: only the order of adding micro-batch gradients
//   differs); against the same plan on the CPU backend, 1e-4 relative per-step loss.
// - 2 ranks with a GPU each, joined by NCCL (2 or more GPUs, a build with NCCL; on the emulator
//   its NCCL, with the GPUs ctest gives tests_train): against 1 rank, the same tolerances.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "tests/common/temp_dir.h"
#include "tests/train/hf_fixture.h"
#include "tests/train/small_model.h"
#include "train/devices.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

#define REQUIRE_CUDA_DEVICE()                                         \
  do {                                                                \
    if (usable_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// Why `gpus` NCCL ranks with a GPU each cannot run here; empty when they can.
std::string missing_nccl_gpus(int gpus) {
  if (usable_cuda_devices() < gpus) {
    return "needs " + std::to_string(gpus) +
           " GPUs (on the emulator: DSTRAIN_CUDA_EMU_DEVICES=" + std::to_string(gpus) +
           " or more, as ctest sets for tests_train)";
  }
  if (!choose_devices("cuda", gpus, gpus).nccl) return "this build has no NCCL";
  return "";
}

#define REQUIRE_NCCL_GPUS(gpus)                                                             \
  do {                                                                                      \
    REQUIRE_CUDA_DEVICE();                                                                  \
    if (const std::string why = missing_nccl_gpus(gpus); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

constexpr int kSteps = test::kSmallRunSteps;

struct Run {
  std::string device = "cpu";
  std::string precision = "fp32";
  int ranks = 1;
  int zero = 0;
  bool offload = false;
  bool gpu_per_rank = false;  // cuda: one GPU per rank (NCCL), else the ranks share one GPU
  int pp = 1;                 // pipeline stages (ranks = pp x tp x data-parallel ranks)
  std::string schedule = "1f1b";
  int tp = 1;  // tensor-parallel ranks
  bool sequence_parallel = true;
  bool four_heads = false;  // the small model with 4 heads of 6 channels (tp 2 and 4 split it)
  // 2 heads of 64 channels: a head dimension the tensor-core attention takes in bf16/fp16
  // (kernels/cuda/cuda_attention_mma.cu); the small model's heads of 8 take the fp32 kernels.
  bool tensor_core_heads = false;
  bool offload_params = false;  // the working parameters and gradients in pinned host memory
  bool bf16_states = false;     // the Adam moments in bf16 (with offload)
};

using RunSpec = Run;  // (inside a TEST, Run names testing::Test::Run)

// The small model with other heads: dir/NAME/config.json with n_embd and n_head as given.
std::string small_model_with_heads(const fs::path& dir, const std::string& name, int n_embd,
                                   int n_head) {
  fs::create_directories(dir / name);
  const fs::path path = dir / name / "config.json";
  std::ofstream(path) << R"({"model_type": "gpt2", "vocab_size": 37, "n_positions": 32, "n_embd": )"
                      << n_embd << R"(, "n_layer": 2, "n_head": )" << n_head << "}";
  return path.string();
}

struct RunResult {
  std::vector<double> losses;
  std::vector<bool> skipped;
  std::map<std::string, std::vector<float>> weights;
  std::string output;  // what train() printed: its plan names the devices and communicator
};

RunResult train_run(const fs::path& dir, const Run& run) {
  const std::string name = run.device + "_" + run.precision + "_r" + std::to_string(run.ranks) +
                           "_z" + std::to_string(run.zero) + (run.offload ? "_offload" : "") +
                           (run.gpu_per_rank ? "_gpus" : "") + "_pp" + std::to_string(run.pp) +
                           run.schedule + "_tp" + std::to_string(run.tp) +
                           (run.sequence_parallel ? "sp" : "") + (run.four_heads ? "_4h" : "") +
                           (run.tensor_core_heads ? "_hd64" : "") +
                           (run.offload_params ? "_params" : "") +
                           (run.bf16_states ? "_bf16states" : "");
  TrainOptions options = test::small_run_options(dir, name, run.ranks);
  if (run.four_heads) options.model = small_model_with_heads(dir, "four_heads", 24, 4);
  if (run.tensor_core_heads) {
    options.model = small_model_with_heads(dir, "heads_of_64", 128, 2);
    // At 3e-3 this wider model's loss spikes at step 6 (2.75 -> 3.3), and a spike multiplies
    // the runs' rounding differences a hundredfold (1e-4 -> 1.5e-2 relative); 1e-3 trains
    // smoothly.
    options.lr = 1e-3;
  }
  options.device = run.device;
  // One GPU (or one per rank), and the flags are the plan (plan_run does not plan with
  // max_gpus).
  options.test.max_gpus = run.device != "cuda" ? 0 : run.gpu_per_rank ? run.ranks : 1;
  options.precision = run.precision;
  options.zero = run.zero;
  options.offload = run.offload;
  options.offload_params = run.offload_params;
  options.bf16_optimizer_states = run.bf16_states;
  options.pp = run.pp;
  options.pp_schedule = run.schedule;
  options.tp = run.tp;
  options.sequence_parallel = run.sequence_parallel;
  options.grad_accum = test::kSmallRunMicroBatches / (run.ranks / (run.pp * run.tp));
  options.test.verify_tied_embedding = run.pp > 1;
  options.threads = 2;
  std::ostringstream out;
  train(options, out);

  RunResult result;
  std::ifstream log(options.log);
  for (std::string line; std::getline(log, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (!record.contains("loss")) continue;
    result.losses.push_back(record["loss"]);
    result.skipped.push_back(record.value("skipped", false));
  }
  result.weights = test::final_weights(options);
  result.output = out.str();
  return result;
}

void expect_losses_near(const RunResult& got, const RunResult& want, double relative,
                        const std::string& what) {
  ASSERT_EQ(got.losses.size(), size_t(kSteps)) << what;
  ASSERT_EQ(want.losses.size(), size_t(kSteps)) << what;
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(got.losses[step], want.losses[step], relative * want.losses[step])
        << what << ", step " << step + 1;
  }
}

double max_weight_difference(const RunResult& a, const RunResult& b) {
  return test::max_weight_difference(b.weights, a.weights);
}

TEST(CudaTraining, Fp32TwentyStepsMatchTheCpuBackend) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  const RunResult cpu = train_run(dir.path(), {"cpu", "fp32"});
  const RunResult cuda = train_run(dir.path(), {"cuda", "fp32"});
  // The loss moves: not a comparison of two untrained models.
  ASSERT_LT(cpu.losses.back(), cpu.losses.front() - 0.1);
  expect_losses_near(cuda, cpu, 1e-4, "fp32 CUDA vs CPU");
  std::cout << "  fp32: max |weight difference| CUDA vs CPU " << max_weight_difference(cuda, cpu)
            << "\n";
}

TEST(CudaTraining, Fp16TwentyStepsMatchTheCpuBackend) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  const RunResult cpu = train_run(dir.path(), {"cpu", "fp16"});
  const RunResult cuda = train_run(dir.path(), {"cuda", "fp16"});
  ASSERT_LT(cpu.losses.back(), cpu.losses.front() - 0.1);
  expect_losses_near(cuda, cpu, 1e-2, "fp16 CUDA vs CPU");
  EXPECT_EQ(cuda.skipped, cpu.skipped) << "the scaler skipped other steps";
}

// bf16 and fp16 on the tensor-core attention (heads of 64: cuda_attention_mma*.cu, forward and
// backward), 20 steps against the CPU backend. The kernel rounds the probabilities P to the
// storage dtype before the P V product (the CPU twin keeps them in fp32) and every kernel sums
// in its own order, so stored values differ by a rounding here and there. Tolerance: per-step
// loss within one unit roundoff of the storage dtype, relative: 2^-9 (bf16) and 2^-11 (fp16).
// Measured on the emulator: at most 1.6e-4 (bf16) and 2.8e-5 (fp16). Both runs skip the same
// fp16 steps.
TEST(CudaTraining, Bf16AndFp16OnTensorCoreAttentionMatchTheCpuBackend) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  for (const auto& [precision, tolerance] :
       {std::pair{"bf16", 0x1p-9}, std::pair{"fp16", 0x1p-11}}) {
    RunSpec run{"cpu", precision};
    run.tensor_core_heads = true;
    const RunResult cpu = train_run(dir.path(), run);
    run.device = "cuda";
    const RunResult cuda = train_run(dir.path(), run);
    ASSERT_LT(cpu.losses.back(), cpu.losses.front() - 0.1) << precision;
    expect_losses_near(cuda, cpu, tolerance, std::string(precision) + " CUDA vs CPU, heads of 64");
    EXPECT_EQ(cuda.skipped, cpu.skipped) << precision << ": the scaler skipped other steps";
    double worst = 0;
    for (int step = 0; step < kSteps; ++step) {
      worst = std::max(worst, std::abs(cuda.losses[step] / cpu.losses[step] - 1));
    }
    std::cout << "  " << precision << ", heads of 64: largest relative loss difference " << worst
              << ", max |weight difference| " << max_weight_difference(cuda, cpu) << "\n";
  }
}

// --precision fp8 (model/fp8_linear.h) on the CUDA backend: the same model (GPT-2's layout:
// (in, out) weights, biases; every projection and the 32 tokens of a micro-batch multiples of
// 16), 20 steps against the CPU backend's fp8. The casts are the same bytes for the same inputs
// (CudaFp8.*), but the inputs differ by the bf16 runs' roundings (above), and a value near an
// FP8 rounding boundary moves by a whole E4M3 step (2^-3 relative): tolerance 2^-7 per step's
// loss, relative (measured on the emulator: 3.4e-3). And the CUDA run is FP8's, not bf16's: it
// is nearer the CPU's fp8 run than the CPU's bf16 run.
TEST(CudaTraining, Fp8TrainsLikeTheCpuBackend) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  RunSpec run{"cpu", "fp8"};
  run.tensor_core_heads = true;
  const RunResult cpu = train_run(dir.path(), run);
  run.precision = "bf16";
  const RunResult cpu_bf16 = train_run(dir.path(), run);
  run.device = "cuda";
  run.precision = "fp8";
  const RunResult cuda = train_run(dir.path(), run);
  ASSERT_LT(cpu.losses.back(), cpu.losses.front() - 0.1);
  expect_losses_near(cuda, cpu, 0x1p-7, "fp8 CUDA vs CPU, heads of 64");
  auto worst = [&](const RunResult& other) {
    double largest = 0;
    for (int step = 0; step < kSteps; ++step) {
      largest = std::max(largest, std::abs(cuda.losses[step] / other.losses[step] - 1));
    }
    return largest;
  };
  EXPECT_LT(worst(cpu), worst(cpu_bf16));
  std::cout << "  fp8: largest relative loss difference CUDA vs CPU " << worst(cpu)
            << " (vs the CPU's bf16 run " << worst(cpu_bf16) << "), max |weight difference| "
            << max_weight_difference(cuda, cpu) << "\n";
}

TEST(CudaTraining, TwoRanksSharingOneGpuZero3OffloadMatchOneRank) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  const RunResult one = train_run(dir.path(), {"cuda", "fp32", 1, 0, false});
  const RunResult shared = train_run(dir.path(), {"cuda", "fp32", 2, 3, true});
  const RunResult cpu = train_run(dir.path(), {"cpu", "fp32", 2, 3, true});
  ASSERT_LT(one.losses.back(), one.losses.front() - 0.1);
  // The equivalence test's tolerances (tests/train/equivalence_test.cpp), now on the GPU.
  expect_losses_near(shared, one, 1e-6, "2 ranks sharing the GPU vs 1 rank");
  const double error = max_weight_difference(shared, one);
  EXPECT_LT(error, 1e-5);
  expect_losses_near(shared, cpu, 1e-4, "2 ranks on the GPU vs 2 ranks on the CPU backend");
  std::cout << "  2 ranks sharing one GPU, ZeRO-3 + offload: max |weight difference| vs 1 rank "
            << error << "\n";
}

// ZeRO-2 + offload: the lagged per-block reduce-scatter on the communication stream, the
// pipelined offload copies, and a forward that reads the updated full parameters directly
// (ZeRO-3 reads only gathered copies), each ordered with events against the compute stream.
// The emulator runs streams as late as CUDA allows, so a missing wait changes the numbers.
TEST(CudaTraining, Zero2AndOffloadOverlapMatchOneRank) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  const RunResult one = train_run(dir.path(), {"cuda", "fp32", 1, 0, false});
  const RunResult shared = train_run(dir.path(), {"cuda", "fp32", 2, 2, true});
  ASSERT_LT(one.losses.back(), one.losses.front() - 0.1);
  expect_losses_near(shared, one, 1e-6, "2 ranks sharing the GPU (ZeRO-2 + offload) vs 1 rank");
  EXPECT_LT(max_weight_difference(shared, one), 1e-5);
  // One rank with offload: no collective synchronizes the communication stream, only events
  // order the weights going up before the next forward reads them. Offload changes no bit.
  const RunResult offload = train_run(dir.path(), {"cuda", "fp32", 1, 0, true});
  expect_losses_near(offload, one, 0.0, "1 rank with offload vs without");
  EXPECT_EQ(max_weight_difference(offload, one), 0.0);
}

// Parameter offload on the GPU: every block comes up from pinned host memory on the
// communication stream and its gradients go down, ordered with events against the compute
// stream (the emulator runs streams as late as CUDA allows: a missing wait changes the
// numbers). The same bits as without it, with the optimizer on the device and on the host.
TEST(CudaTraining, ParameterOffloadChangesNoBit) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  for (const std::string precision : {"fp32", "bf16"}) {
    const RunSpec plain{"cuda", precision, 1, 0, false};
    RunSpec params = plain, all = plain;
    params.offload_params = all.offload_params = true;
    all.offload = true;
    const RunResult want = train_run(dir.path(), plain);
    ASSERT_LT(want.losses.back(), want.losses.front() - 0.1);
    for (const RunSpec& run : {params, all}) {
      const RunResult got = train_run(dir.path(), run);
      EXPECT_EQ(got.losses, want.losses) << precision << (run.offload ? " all" : " params");
      EXPECT_EQ(max_weight_difference(got, want), 0.0) << precision;
    }
  }
  // bf16 Adam moments on the host: the parameters' offload changes no bit of them either.
  RunSpec optimizer{"cuda", "bf16", 1, 0, true};
  optimizer.bf16_states = true;
  RunSpec everything = optimizer;
  everything.offload_params = true;
  const RunResult want = train_run(dir.path(), optimizer);
  const RunResult got = train_run(dir.path(), everything);
  EXPECT_EQ(got.losses, want.losses) << "bf16 moments";
  EXPECT_EQ(max_weight_difference(got, want), 0.0) << "bf16 moments";
}

// The same through NCCL with a GPU per rank: at ZeRO-1 each block's sum is reduced on its way
// down in the last micro-batch, at ZeRO-3 each rank's shard comes up and is gathered.
TEST(CudaTraining, ParameterOffloadWithAGpuPerRankThroughNcclChangesNoBit) {
  REQUIRE_NCCL_GPUS(2);
  const testing::TempDir dir;
  for (const int zero : {1, 3}) {
    const RunSpec plain{"cuda", "bf16", 2, zero, false, true};
    RunSpec params = plain;
    params.offload_params = true;
    params.offload = zero == 3;
    const RunResult want = train_run(dir.path(), plain);
    const RunResult got = train_run(dir.path(), params);
    EXPECT_NE(got.output.find("NCCL"), std::string::npos) << got.output;
    EXPECT_EQ(got.losses, want.losses) << "ZeRO-" << zero;
    EXPECT_EQ(max_weight_difference(got, want), 0.0) << "ZeRO-" << zero;
  }
}

TEST(CudaTraining, TwoRanksWithAGpuEachThroughNcclZero3MatchOneRank) {
  REQUIRE_NCCL_GPUS(2);
  const testing::TempDir dir;
  const RunResult one = train_run(dir.path(), {"cuda", "fp32", 1, 0, false});
  ASSERT_LT(one.losses.back(), one.losses.front() - 0.1);
  for (const bool offload : {false, true}) {
    const std::string what =
        std::string("2 ranks on 2 GPUs through NCCL, ZeRO-3") + (offload ? " + offload" : "");
    const RunResult nccl = train_run(dir.path(), {"cuda", "fp32", 2, 3, offload, true});
    EXPECT_NE(nccl.output.find("on CUDA on 2 GPUs, NCCL"), std::string::npos) << nccl.output;
    expect_losses_near(nccl, one, 1e-6, what + " vs 1 rank");
    const double error = max_weight_difference(nccl, one);
    EXPECT_LT(error, 1e-5) << what;
    std::cout << "  " << what << ": max |weight difference| vs 1 rank " << error << "\n";
  }
}

// Pipelines on the CUDA backend: the stages' activations and gradients go through the
// pipeline group's exchanges (grouped ncclSend/ncclRecv on the emulator's NCCL, one GPU per
// rank; or the local communicator through host copies when the ranks share a GPU), on a
// communication stream ordered with events. The equivalence test's tolerances.
TEST(CudaTraining, PipelineStagesWithAGpuEachThroughNcclMatchOneRank) {
  REQUIRE_NCCL_GPUS(4);
  const testing::TempDir dir;
  const RunResult one = train_run(dir.path(), {"cuda", "fp32", 1, 0, false});
  ASSERT_LT(one.losses.back(), one.losses.front() - 0.1);
  for (const RunSpec& run : {RunSpec{"cuda", "fp32", 2, 0, false, true, 2},
                             RunSpec{"cuda", "fp32", 4, 3, false, true, 2, "gpipe"}}) {
    const std::string what = "pp 2 x dp " + std::to_string(run.ranks / 2) + ", ZeRO-" +
                             std::to_string(run.zero) + ", " + run.schedule + ", NCCL";
    const RunResult piped = train_run(dir.path(), run);
    EXPECT_NE(piped.output.find("NCCL"), std::string::npos) << piped.output;
    expect_losses_near(piped, one, 1e-6, what + " vs 1 rank");
    const double error = max_weight_difference(piped, one);
    EXPECT_LT(error, 1e-5) << what;
    std::cout << "  " << what << ": max |weight difference| vs 1 rank " << error << "\n";
  }
}

TEST(CudaTraining, PipelineStagesSharingOneGpuMatchOneRank) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  const RunResult one = train_run(dir.path(), {"cuda", "fp32", 1, 0, false});
  const RunResult piped = train_run(dir.path(), {"cuda", "fp32", 4, 2, true, false, 2});
  expect_losses_near(piped, one, 1e-6, "pp 2 x dp 2 sharing the GPU (ZeRO-2 + offload)");
  EXPECT_LT(max_weight_difference(piped, one), 1e-5);
}

// Tensor parallelism on the CUDA backend: the layers' collectives (all-gather, reduce-scatter,
// all-reduce) on the tp group's NCCL communicator, one GPU per rank, on the compute stream; the
// vocabulary-parallel cross-entropy's statistics gathered the same way. The tolerances of
// tests/train/tensor_parallel_test.cpp.
TEST(CudaTraining, TensorParallelRanksWithAGpuEachThroughNcclMatchOneRank) {
  REQUIRE_NCCL_GPUS(4);
  const testing::TempDir dir;
  RunSpec reference{"cuda", "fp32", 1, 0, false};
  reference.four_heads = true;
  const RunResult one = train_run(dir.path(), reference);
  ASSERT_LT(one.losses.back(), one.losses.front() - 0.1);
  RunSpec tp2{"cuda", "fp32", 2, 0, false, true};
  tp2.tp = 2;
  tp2.four_heads = true;
  RunSpec tp2_pp2{"cuda", "fp32", 4, 1, false, true, 2};
  tp2_pp2.tp = 2;
  tp2_pp2.sequence_parallel = false;
  tp2_pp2.four_heads = true;
  for (const RunSpec& run : {tp2, tp2_pp2}) {
    const std::string what = "tp 2 x pp " + std::to_string(run.pp) + ", ZeRO-" +
                             std::to_string(run.zero) +
                             (run.sequence_parallel ? ", sequence parallel" : "") + ", NCCL";
    const RunResult split = train_run(dir.path(), run);
    EXPECT_NE(split.output.find("NCCL"), std::string::npos) << split.output;
    expect_losses_near(split, one, 1e-5, what + " vs 1 rank");
    const double error = max_weight_difference(split, one);
    EXPECT_LT(error, 1e-5) << what;
    std::cout << "  " << what << ": max |weight difference| vs 1 rank " << error << "\n";
  }
}

// The LLaMA family on the CUDA backend: transformers' Llama (grouped-query attention, untied
// head), Qwen2 (q/k/v biases, tied head), Mixtral (4 experts, top 2) and Qwen2-MoE fixtures, and
// the DeepSeek references (DeepSeekMoE; V2 and V3: multi-head latent attention, their routers)
// trained on one GPU, and tp 2 with a GPU per rank through NCCL, against what the reference did:
// the CUDA tolerance of the fp32 runs above (1e-4 relative per step), the final weights within
// 1e-4.
TEST(CudaTraining, LlamaFamilyTrainsLikeTransformers) {
  REQUIRE_CUDA_DEVICE();
  for (const char* fixture :
       {"llama_tiny", "qwen2_tiny", "mixtral_tiny", "qwen2_moe_tiny", "qwen2_moe_aux_tiny",
        "deepseek_moe_aux_tiny", "deepseek_v2_tiny", "deepseek_v3_tiny"}) {
    SCOPED_TRACE(fixture);
    const testing::TempDir dir;
    TrainOptions options =
        test::fixture_run(test::FixturePlan{fixture}, test::fixture_expected(fixture), dir.path());
    options.device = "cuda";
    options.test.max_gpus = 1;
    test::expect_trains_like_transformers(options, fixture, 1e-4, 1e-4);
  }
}

TEST(CudaTraining, LlamaTensorParallelWithAGpuPerRankTrainsLikeTransformers) {
  REQUIRE_NCCL_GPUS(2);
  const testing::TempDir dir;
  TrainOptions options = test::fixture_run(test::FixturePlan{"llama_tiny", 1, 2, 1, 0},
                                           test::fixture_expected("llama_tiny"), dir.path());
  options.device = "cuda";
  options.test.max_gpus = 2;
  test::expect_trains_like_transformers(options, "llama_tiny", 1e-4, 1e-4);
}

// Expert parallelism with a GPU per rank: each rank's experts on its own device, the tokens'
// all-to-alls through NCCL (grouped sends and receives), the experts' state sharded over the
// ranks holding the same experts.
TEST(CudaTraining, ExpertParallelWithAGpuPerRankTrainsLikeTransformers) {
  REQUIRE_NCCL_GPUS(2);
  for (const auto& [fixture, zero] : {std::pair{"mixtral_tiny", 3}, std::pair{"qwen2_moe_tiny", 1}}) {
    SCOPED_TRACE(fixture);
    const testing::TempDir dir;
    TrainOptions options = test::fixture_run(test::FixturePlan{fixture, 2, 1, 1, zero, false, 2},
                                             test::fixture_expected(fixture), dir.path());
    options.device = "cuda";
    options.test.max_gpus = 2;
    test::expect_trains_like_transformers(options, fixture, 1e-4, 1e-4);
  }
}

// An expert capacity on the GPU: the dispatch rewritten on the host from device memory, the
// experts' GEMMs over the kept rows only. The same drops and losses as the CPU backend.
TEST(CudaTraining, AnExpertCapacityDropsTheSameAsTheCpuBackend) {
  REQUIRE_CUDA_DEVICE();
  const testing::TempDir dir;
  std::vector<test::LoggedRun> runs;
  for (const char* device : {"cpu", "cuda"}) {
    TrainOptions options = test::fixture_run(test::FixturePlan{"mixtral_tiny"},
                                             test::fixture_expected("mixtral_tiny"),
                                             dir.path() / device);
    options.device = device;
    options.test.max_gpus = std::string(device) == "cuda" ? 1 : 0;
    options.moe_capacity_factor = 0.75;
    std::ostringstream out;
    train(options, out);
    runs.push_back(test::read_logged_run(options));
  }
  ASSERT_EQ(runs[0].steps.size(), runs[1].steps.size());
  int64_t dropped = 0;
  for (size_t i = 0; i < runs[0].steps.size(); ++i) {
    EXPECT_EQ(runs[1].steps[i]["expert_load"], runs[0].steps[i]["expert_load"]) << "step " << i + 1;
    EXPECT_NEAR(runs[1].losses[i], runs[0].losses[i], 1e-4 * runs[0].losses[i]) << "step " << i + 1;
    for (const nlohmann::json& layer : runs[0].steps[i]["expert_load"]) {
      dropped += layer["dropped"].get<int64_t>();
    }
  }
  EXPECT_GT(dropped, 0);
}

}  // namespace
}  // namespace dstrain
