// The memory model against what the code allocates, byte for byte, and against the ZeRO
// paper's closed forms.
//
// Exactness: each rank builds what the trainer builds (src/train/trainer.cpp, run_rank):
// ShardedModel on a device and a host CPU allocator, Gpt2 with the plan's precision and
// recompute mode, and the token batch; every category of both allocators must equal the
// prediction. Covered: one rank (the plan the trainer has always run), and 2-4 ranks x ZeRO
// 0-3 x offload x fp32/bf16/fp16, on the tiny preset and on odd configs (vocabulary, widths
// and sequence lengths that are not multiples of anything), with odd micro-batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <sstream>

#include "comm/communicator.h"
#include "kernels/ops.h"
#include "model/gpt2.h"
#include "parallel/memory_model.h"
#include "parallel/sharded_model.h"

namespace dstrain {
namespace {

ModelConfig odd_config(int64_t vocab, int64_t positions, int64_t embd, int64_t layers,
                       int64_t heads) {
  ModelConfig c;
  c.name = "odd";
  c.vocab_size = vocab;
  c.n_positions = positions;
  c.n_embd = embd;
  c.n_layer = layers;
  c.n_head = heads;
  return c;
}

Plan one_rank_plan(int64_t B, int64_t T) {
  Plan plan;
  plan.micro_batch = B;
  plan.seq_len = T;
  plan.param_dtype = DType::F32;  // what the trainer runs today
  return plan;
}

std::string category_table(const std::array<uint64_t, kNumMemCategories>& predicted,
                           const MemoryStats& actual) {
  std::ostringstream text;
  for (int c = 0; c < kNumMemCategories; ++c) {
    text << "  " << mem_category_name(static_cast<MemCategory>(c)) << ": predicted "
         << predicted[static_cast<size_t>(c)] << ", allocated " << actual.current[static_cast<size_t>(c)]
         << "\n";
  }
  return text.str();
}

// Builds, on every rank of plan.dp, what the trainer allocates, and checks both allocators
// against the prediction. Returns the number of ranks checked.
int expect_allocations_match(const ModelConfig& config, const Plan& plan) {
  const MemoryPrediction predicted = predict_memory(config, plan);
  EXPECT_GT(predicted.device_total(), 0u);
  std::mutex mutex;
  int checked = 0;
  run_local_ranks(plan.dp, 60.0, [&](Communicator& comm) {
    std::unique_ptr<Backend> backend = make_cpu_backend(1);
    std::unique_ptr<Allocator> device = make_cpu_allocator(comm.rank());
    std::unique_ptr<Allocator> host = make_cpu_allocator(comm.rank());
    ShardedModel state(config, ShardingConfig{plan.zero, plan.offload, plan.param_dtype}, comm,
                       *backend, *device, *host);
    Gpt2 model(config, *backend, *device, plan.micro_batch, plan.seq_len, plan.param_dtype, true,
               plan.recompute);
    // As trainer.cpp: inputs and targets, (B, T) int32 each.
    Buffer batch = device->allocate(MemCategory::Data,
                                    2 * plan.micro_batch * plan.seq_len * sizeof(int32_t));
    const MemoryStats d = device->stats(), h = host->stats();
    std::lock_guard<std::mutex> lock(mutex);
    for (int c = 0; c < kNumMemCategories; ++c) {
      EXPECT_EQ(predicted.device[static_cast<size_t>(c)], d.current[static_cast<size_t>(c)])
          << "device " << mem_category_name(static_cast<MemCategory>(c)) << ", rank "
          << comm.rank() << ", " << describe(plan) << "\n" << category_table(predicted.device, d);
      EXPECT_EQ(predicted.host[static_cast<size_t>(c)], h.current[static_cast<size_t>(c)])
          << "host " << mem_category_name(static_cast<MemCategory>(c)) << ", rank "
          << comm.rank() << ", " << describe(plan) << "\n" << category_table(predicted.host, h);
    }
    EXPECT_EQ(predicted.device_total(), d.current_total);
    EXPECT_EQ(predicted.host_total(), h.current_total);
    ++checked;
  });
  return checked;
}

TEST(MemoryModel, OneRankFp32MatchesAllocatorOnTinyAndOddConfigs) {
  const std::vector<ModelConfig> configs = {
      load_model_config("tiny"),
      odd_config(37, 32, 24, 2, 3),
      odd_config(101, 48, 40, 3, 5),
  };
  for (const ModelConfig& config : configs) {
    for (const auto& [B, T] : {std::pair<int64_t, int64_t>{1, 1}, {2, 16}, {3, 7}, {5, 32}}) {
      SCOPED_TRACE(config.name + " B=" + std::to_string(B) + " T=" + std::to_string(T));
      EXPECT_EQ(expect_allocations_match(config, one_rank_plan(B, T)), 1);
    }
  }
}

TEST(MemoryModel, RecomputeModesMatchAllocator) {
  const ModelConfig config = odd_config(101, 48, 40, 3, 5);
  for (Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(recompute));
    Plan plan = one_rank_plan(3, 17);
    plan.recompute = recompute;
    expect_allocations_match(config, plan);
  }
}

TEST(MemoryModel, ShardedPlansMatchAllocatorEveryRankEveryStage) {
  // 37 * 24 and friends: no block divides evenly by 3 or 4, so shards are padded.
  const ModelConfig config = odd_config(37, 32, 24, 2, 3);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    for (int ranks : {2, 3, 4}) {
      for (int zero = 0; zero <= 3; ++zero) {
        for (bool offload : {false, true}) {
          Plan plan = one_rank_plan(2, 9);
          plan.dp = ranks;
          plan.zero = zero;
          plan.offload = offload;
          plan.param_dtype = dtype;
          plan.recompute = zero == 1 ? Recompute::Full : Recompute::None;
          SCOPED_TRACE(describe(plan));
          EXPECT_EQ(expect_allocations_match(config, plan), ranks);
        }
      }
    }
  }
}

TEST(MemoryModel, ActivationTablesAddUpToTheWholeModelsPlan) {
  // The model-level decomposition (one layer's tensors x layers + shared + the rest) must
  // give what plan_gpt2_buffers gives for the whole model, in every recompute mode and dtype.
  for (const char* name : {"gpt2-124m", "13b"}) {
    const ModelConfig config = load_model_config(name);
    for (Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        Plan plan = one_rank_plan(3, 1000);
        plan.recompute = recompute;
        plan.param_dtype = dtype;
        const Gpt2Buffers whole = plan_gpt2_buffers(config, 3, 1000, dtype, true, recompute);
        const ActivationSizes a = activation_sizes(config, plan, 0);
        EXPECT_EQ(a.activations(), whole.activations.bytes()) << name << " " << recompute_name(recompute);
        EXPECT_EQ(a.workspace, whole.workspace.bytes()) << name;
        EXPECT_EQ(a.pipeline_buffers, 0u);
        const Gpt2Buffers plain = plan_gpt2_buffers(config, 3, 1000, dtype, true);
        EXPECT_EQ(a.without_recompute, plain.activations.bytes());
      }
    }
  }
}

TEST(MemoryModel, RecomputeShrinksActivationsInOrder) {
  const ModelConfig config = load_model_config("6b");
  Plan plan = one_rank_plan(4, 1024);
  plan.param_dtype = DType::BF16;
  uint64_t previous = UINT64_MAX, none = 0;
  for (Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    plan.recompute = recompute;
    const MemoryPrediction m = predict_memory(config, plan);
    const uint64_t activations = m.device[static_cast<size_t>(MemCategory::Activations)];
    EXPECT_LT(activations, previous) << recompute_name(recompute);
    EXPECT_EQ(m.activations_without_recompute,
              plan_gpt2_buffers(config, 4, 1024, DType::BF16, true).activations.bytes());
    if (recompute == Recompute::None) none = activations;
    previous = activations;
  }
  // Full keeps one (B, T, C) tensor per layer (bf16) and one layer's worth to recompute into:
  // under a tenth of what no recompute keeps.
  EXPECT_LT(previous * 10, none);
}

// ZeRO (Rajbhandari et al. 2020), section 5: per parameter, mixed-precision Adam holds
// 2 (fp16 params) + 2 (fp16 grads) + 12 (fp32 master, momentum, variance) bytes; sharding
// over N data-parallel ranks divides what is sharded: stage 1: 4 + 12/N, stage 2: 2 + 14/N,
// stage 3: 16/N. Per-block shard padding is the only difference here; on 6b it is < 1e-6.
TEST(MemoryModel, ZeroStagesMatchThePapersClosedForms) {
  const ModelConfig config = load_model_config("6b");
  const ParamLayout layout(config);
  const double psi = static_cast<double>(layout.total_numel());
  for (DType dtype : {DType::F16, DType::BF16}) {
    for (int n : {1, 2, 8, 64}) {
      const double closed[4] = {16.0, 4 + 12.0 / n, 2 + 14.0 / n, 16.0 / n};
      for (int zero = 0; zero <= 3; ++zero) {
        Plan plan = one_rank_plan(1, 1024);
        plan.dp = n;
        plan.zero = zero;
        plan.param_dtype = dtype;
        const MemoryPrediction m = predict_memory(config, plan);
        auto bytes = [&](MemCategory c) { return static_cast<double>(m.device[static_cast<size_t>(c)]); };
        const double model_states = bytes(MemCategory::Parameters) + bytes(MemCategory::Gradients) +
                                    bytes(MemCategory::MasterWeights) +
                                    bytes(MemCategory::OptimizerState);
        const double per_parameter = model_states / psi;
        EXPECT_LT(std::abs(per_parameter / closed[zero] - 1), 1e-3)
            << "ZeRO-" << zero << " N=" << n << ": " << per_parameter << " bytes/param, paper "
            << closed[zero];
        // And category by category.
        EXPECT_NEAR(bytes(MemCategory::Parameters) / psi, zero >= 3 ? 2.0 / n : 2.0, 1e-3);
        EXPECT_NEAR(bytes(MemCategory::Gradients) / psi, zero >= 2 ? 2.0 / n : 2.0, 1e-3);
        EXPECT_NEAR(bytes(MemCategory::MasterWeights) / psi, zero >= 1 ? 4.0 / n : 4.0, 1e-3);
        EXPECT_NEAR(bytes(MemCategory::OptimizerState) / psi, zero >= 1 ? 8.0 / n : 8.0, 1e-3);
      }
    }
  }
}

TEST(MemoryModel, OffloadMovesMasterAndMomentsToTheHost) {
  const ModelConfig config = load_model_config("6b");
  const double psi = static_cast<double>(ParamLayout(config).total_numel());
  Plan plan = one_rank_plan(1, 1024);
  plan.dp = 8;
  plan.zero = 2;
  plan.offload = true;
  plan.param_dtype = DType::BF16;
  const MemoryPrediction m = predict_memory(config, plan);
  EXPECT_EQ(m.device[static_cast<size_t>(MemCategory::MasterWeights)], 0u);
  EXPECT_EQ(m.device[static_cast<size_t>(MemCategory::OptimizerState)], 0u);
  // 4 master + 8 Adam over 8 ranks, per rank.
  EXPECT_NEAR(m.host[static_cast<size_t>(MemCategory::OptimizerStateHost)] / psi, 12.0 / 8, 1e-3);
  // Device: 2 bytes params + 2/8 grads (ZeRO-2).
  EXPECT_NEAR((m.device[static_cast<size_t>(MemCategory::Parameters)] +
               m.device[static_cast<size_t>(MemCategory::Gradients)]) / psi,
              2 + 2.0 / 8, 1e-3);
  EXPECT_EQ(MemoryModel(config).host_bytes_all_ranks(plan), 8 * m.host_total());
}

TEST(MemoryModel, TensorParallelSplitOfBlocks) {
  const ModelConfig config = odd_config(101, 48, 128, 2, 4);
  const ParamLayout layout(config);
  for (int block = 0; block < layout.num_blocks(); ++block) {
    EXPECT_EQ(tp_block_numel(layout, block, 1), layout.block_numel(block)) << block;
  }
  // A layer: the split tensors divide by tp; ln_1, ln_2 (weight, bias) and the two row-split
  // projections' biases (6 tensors of C = 128) stay whole. (C = 128 keeps every split part
  // a multiple of the 32-element alignment: 3C/4 = 96.)
  const int layer = ParamLayout::layer_block(0);
  EXPECT_EQ(2 * tp_block_numel(layout, layer, 2) - layout.block_numel(layer), 6 * 128);
  EXPECT_EQ(4 * tp_block_numel(layout, layer, 4) - layout.block_numel(layer), 3 * 6 * 128);
  // Embeddings and ln_f: whole on every tensor-parallel rank (the tied head is not split).
  EXPECT_EQ(tp_block_numel(layout, 0, 4), layout.block_numel(0));
  EXPECT_EQ(tp_block_numel(layout, layout.final_block(), 4), layout.block_numel(layout.final_block()));
}

TEST(MemoryModel, PipelineStagesCoverEveryLayerOnceAndHoldTheTiedEmbeddingTwice) {
  const ModelConfig config = load_model_config("6b");  // 28 layers
  const ParamLayout layout(config);
  for (int pp : {1, 2, 3, 8, 28}) {
    int64_t next = 0;
    for (int s = 0; s < pp; ++s) {
      const PipelineStage stage = pipeline_stage(config.n_layer, pp, s);
      EXPECT_EQ(stage.first_layer, next);
      const int64_t count = stage.end_layer - stage.first_layer;
      EXPECT_TRUE(count == config.n_layer / pp || count == config.n_layer / pp + 1);
      next = stage.end_layer;
      const std::vector<int> blocks = pipeline_stage_blocks(layout, pp, s);
      const bool has_embedding = std::count(blocks.begin(), blocks.end(), 0) == 1;
      EXPECT_EQ(has_embedding, s == 0 || s == pp - 1) << "pp " << pp << " stage " << s;
      EXPECT_EQ(std::count(blocks.begin(), blocks.end(), layout.final_block()), s == pp - 1);
    }
    EXPECT_EQ(next, config.n_layer);
  }
}

TEST(MemoryModel, OneFOneBKeepsUpToPpMicroBatchesOnTheFirstStage) {
  const ModelConfig config = load_model_config("6b");
  Plan plan = one_rank_plan(1, 1024);
  plan.pp = 4;
  plan.grad_accum = 16;
  plan.param_dtype = DType::BF16;
  EXPECT_EQ(activation_sizes(config, plan, 0).in_flight, 4);
  EXPECT_EQ(activation_sizes(config, plan, 3).in_flight, 1);
  plan.grad_accum = 2;
  EXPECT_EQ(activation_sizes(config, plan, 0).in_flight, 2);
  // Stage 0 and the last stage hold the token batch, the middle ones the receive buffers of
  // an activation and a gradient, (1, 1024, 4096) bf16 each.
  const MemoryModel model(config);
  EXPECT_GT(model.predict_stage(plan, 0).device[static_cast<size_t>(MemCategory::Data)], 0u);
  EXPECT_EQ(model.predict_stage(plan, 1).device[static_cast<size_t>(MemCategory::Data)], 0u);
  EXPECT_EQ(model.predict_stage(plan, 1).device[static_cast<size_t>(MemCategory::CommBuffers)],
            2u * 1024 * 4096 * 2);
}

}  // namespace
}  // namespace dstrain
