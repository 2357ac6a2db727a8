// ModelStage: a model cut into pipeline stages, chained by hand (each stage's output copied
// into the next one's input, each input gradient into the previous one's output gradient),
// computes what the whole model computes. In the whole model's order of work (micro-batch by
// micro-batch) the losses and every gradient are the same bits; in GPipe's order (all forwards,
// then all backwards, micro-batches in their own slots) the losses are the same bits and the
// gradients agree to rounding (the tied wte adds the head's and the embedding's parts in
// another order). And the stage allocates what plan_stage_buffers plans, slot by slot.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "model/gpt2.h"
#include "tests/model/host_params.h"
#include "model/stage.h"

namespace dstrain {
namespace {

ModelConfig four_layers() {
  ModelConfig c;
  c.name = "stage-test";
  c.vocab_size = 53;
  c.n_positions = 16;
  c.n_embd = 24;
  c.n_layer = 4;
  c.n_head = 3;
  return c;
}

using HostParams = test::HostParams;

struct Batch {
  std::vector<int32_t> inputs, targets;
  Tensor input_tensor(int64_t B, int64_t T) { return Tensor(inputs.data(), DType::I32, {B, T}); }
  Tensor target_tensor(int64_t B, int64_t T) { return Tensor(targets.data(), DType::I32, {B, T}); }
};

std::vector<Batch> random_batches(const ModelConfig& config, int count, int64_t N) {
  Rng rng(77);
  std::vector<Batch> batches(static_cast<size_t>(count));
  for (Batch& b : batches) {
    for (int64_t i = 0; i < N; ++i) {
      b.inputs.push_back(int32_t(rng.below(config.vocab_size)));
      b.targets.push_back(int32_t(rng.below(config.vocab_size)));
    }
  }
  return batches;
}

HostParams initialized(const ModelConfig& config) {
  const ParamLayout layout(config);
  HostParams params(layout);
  std::vector<Tensor> flats;
  for (int block = 0; block < layout.num_blocks(); ++block) flats.push_back(params.acquire_params(block));
  init_model_parameters(layout, config, 5, flats);
  return params;
}

StageRange range_of(const std::vector<int64_t>& split, size_t stage) {
  StageRange r;
  for (size_t s = 0; s < stage; ++s) r.first_layer += split[s];
  r.end_layer = r.first_layer + split[stage];
  r.first = stage == 0;
  r.last = stage + 1 == split.size();
  return r;
}

struct StagedRun {
  std::vector<double> losses;
  HostParams params;
};

// Runs `batches` through stages of `split`, in micro-batch order (gpipe false: F then B of
// each micro-batch) or GPipe's (every forward, then every backward).
StagedRun run_staged(const ModelConfig& config, const std::vector<int64_t>& split,
                     std::vector<Batch>& batches, bool gpipe, Recompute recompute,
                     Fp8Options fp8 = {}) {
  const int64_t B = 2, T = 8, C = config.n_embd;
  const float dloss = 1.0f / static_cast<float>(B * T * batches.size());
  auto backend = make_cpu_backend(1);
  auto allocator = make_cpu_allocator();
  Decoder arch(config, {}, {}, fp8);
  const int slots = gpipe ? static_cast<int>(batches.size()) : 1;
  std::vector<std::unique_ptr<ModelStage>> stages;
  for (size_t s = 0; s < split.size(); ++s) {
    stages.push_back(std::make_unique<ModelStage>(arch, range_of(split, s), *backend, *allocator,
                                                  B, T, DType::F32, true, recompute, slots));
  }
  StagedRun run{{}, initialized(config)};
  auto forward = [&](int m) {
    const int slot = gpipe ? m : 0;
    Batch& batch = batches[static_cast<size_t>(m)];
    for (size_t s = 0; s < stages.size(); ++s) {
      ModelStage& stage = *stages[s];
      if (s > 0) backend->copy(stage.input(slot, B, T), stages[s - 1]->output(B, T), nullptr);
      const double loss = stage.forward(run.params, slot, B, T,
                                        s == 0 ? batch.input_tensor(B, T) : Tensor(),
                                        stage.range().last ? batch.target_tensor(B, T) : Tensor(),
                                        stage.range().last ? dloss : 0.0f, nullptr);
      if (stage.range().last) run.losses.push_back(loss);
    }
  };
  auto backward = [&](int m) {
    const int slot = gpipe ? m : 0;
    for (size_t s = stages.size(); s-- > 0;) {
      ModelStage& stage = *stages[s];
      if (s + 1 < stages.size()) {
        backend->copy(stage.output_grad(B, T), stages[s + 1]->input_grad(B, T), nullptr);
      }
      stage.backward(run.params, slot,
                     s == 0 ? batches[static_cast<size_t>(m)].input_tensor(B, T) : Tensor(), nullptr);
    }
  };
  const int count = static_cast<int>(batches.size());
  if (gpipe) {
    for (int m = 0; m < count; ++m) forward(m);
    for (int m = 0; m < count; ++m) backward(m);
  } else {
    for (int m = 0; m < count; ++m) {
      forward(m);
      backward(m);
    }
  }
  (void)C;
  return run;
}

StagedRun run_whole(const ModelConfig& config, std::vector<Batch>& batches, Recompute recompute) {
  const int64_t B = 2, T = 8;
  const float dloss = 1.0f / static_cast<float>(B * T * batches.size());
  auto backend = make_cpu_backend(1);
  auto allocator = make_cpu_allocator();
  Gpt2 model(config, *backend, *allocator, B, T, DType::F32, true, recompute);
  StagedRun run{{}, initialized(config)};
  for (Batch& batch : batches) {
    run.losses.push_back(model.forward(run.params, batch.input_tensor(B, T),
                                       batch.target_tensor(B, T), dloss, nullptr));
    model.backward(run.params, batch.input_tensor(B, T), nullptr);
  }
  return run;
}

TEST(ModelStage, StagesChainedInMicroBatchOrderAreTheWholeModelBitForBit) {
  const ModelConfig config = four_layers();
  std::vector<Batch> batches = random_batches(config, 3, 16);
  for (Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    const StagedRun whole = run_whole(config, batches, recompute);
    double norm = 0;
    for (const std::vector<float>& g : whole.params.grads)
      for (float x : g) norm += double(x) * x;
    ASSERT_GT(norm, 0.0);  // the comparison is not between zeros
    for (const std::vector<int64_t>& split :
         std::vector<std::vector<int64_t>>{{4}, {1, 3}, {2, 2}, {1, 2, 1}, {1, 1, 1, 1}}) {
      SCOPED_TRACE(std::string(recompute_name(recompute)) + " split of " +
                   std::to_string(split.size()));
      const StagedRun staged = run_staged(config, split, batches, false, recompute);
      EXPECT_EQ(staged.losses, whole.losses);
      for (size_t block = 0; block < whole.params.grads.size(); ++block) {
        ASSERT_EQ(staged.params.grads[block], whole.params.grads[block]) << "block " << block;
      }
    }
  }
}

TEST(ModelStage, GPipeOrderWithSlotsMatchesTheWholeModel) {
  const ModelConfig config = four_layers();
  std::vector<Batch> batches = random_batches(config, 3, 16);
  const StagedRun whole = run_whole(config, batches, Recompute::None);
  const StagedRun staged = run_staged(config, {1, 2, 1}, batches, true, Recompute::Full);
  EXPECT_EQ(staged.losses, whole.losses);  // forwards do not depend on the order
  for (size_t block = 0; block < whole.params.grads.size(); ++block) {
    const std::vector<float>& want = whole.params.grads[block];
    const std::vector<float>& got = staged.params.grads[block];
    double max_ref = 0, max_error = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_ref = std::max(max_ref, std::abs(double(want[i])));
      max_error = std::max(max_error, std::abs(double(got[i]) - want[i]));
    }
    EXPECT_LE(max_error, 1e-6 * max_ref) << "block " << block;
    // Layer blocks add their micro-batches in the same order: the same bits.
    if (block != 0) {
      EXPECT_EQ(got, want) << "block " << block;
    }
  }
}

TEST(ModelStage, AllocatesWhatPlanStageBuffersPlansPerSlot) {
  const ModelConfig config = four_layers();
  Decoder arch(config);
  auto backend = make_cpu_backend(1);
  for (int slots : {1, 3}) {
    for (const StageRange& range : {StageRange{0, 2, true, false}, StageRange{2, 3, false, false},
                                    StageRange{3, 4, false, true}, StageRange{0, 4, true, true}}) {
      auto allocator = make_cpu_allocator();
      ModelStage stage(arch, range, *backend, *allocator, 3, 7, DType::BF16, true,
                       Recompute::Selective, slots);
      const StageBuffers plan = plan_stage_buffers(arch, range, 3, 7, DType::BF16, true,
                                                   Recompute::Selective, slots);
      const MemoryStats stats = allocator->stats();
      EXPECT_EQ(stats.current[int(MemCategory::Activations)], plan.activation_bytes());
      EXPECT_EQ(stats.current[int(MemCategory::Workspace)], plan.workspace.bytes());
      EXPECT_EQ(plan.activation_bytes(), slots * plan.slot.bytes() + plan.recomputed.bytes());
      // Only the last stage has the head's buffers (the logits).
      EXPECT_EQ(plan.head_workspace.empty(), !range.last);
    }
  }
}

// --precision fp8's amaxes found before the casts (SwiGLU's, and each linear input's kept from
// forward to backward, per micro-batch slot) are the ones each cast would find itself: llama-tiny
// (SwiGLU; every projection a multiple of 16, 16 tokens a micro-batch) in two stages, GPipe's
// order with 3 slots, every recompute, gives the same losses and gradients to the bit either
// way. The FP8 GEMMs ran: bf16's losses differ.
TEST(ModelStage, Fp8FoundAmaxesAreTheOnesTheCastsWouldFind) {
  const ModelConfig config = load_model_config("llama-tiny");
  std::vector<Batch> batches = random_batches(config, 3, 2 * 8);
  for (Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    const StagedRun found = run_staged(config, {1, 1}, batches, true, recompute, {true, false});
    const StagedRun own =
        run_staged(config, {1, 1}, batches, true, recompute, {true, false, false});
    EXPECT_EQ(found.losses, own.losses) << recompute_name(recompute);
    EXPECT_EQ(found.params.grads, own.params.grads) << recompute_name(recompute);
    EXPECT_NE(found.losses, run_staged(config, {1, 1}, batches, true, recompute).losses);
  }
}

}  // namespace
}  // namespace dstrain
