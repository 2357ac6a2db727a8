// The memory model against what the code allocates, byte for byte, and against the ZeRO
// paper's closed forms.
//
// Exactness: each rank builds what the trainer builds (src/train/rank_trainer.cpp): its
// groups, ShardedModel of its pipeline stage's blocks on a device and a host CPU allocator,
// the ModelStage with the plan's precision, recompute mode and the schedule's slots, and the
// token batches; every category of both allocators must equal the prediction for its stage.
// Covered: one rank, 2-4 ranks x ZeRO 0-3 x offload x fp32/bf16/fp16, and pipelines of 2-4
// stages x dp 1-2 x 1F1B/GPipe (the first stage keeps the most micro-batches in flight, the
// last holds the head and the tied embedding's copy), on the tiny preset and on odd configs
// (vocabulary, widths and sequence lengths that are not multiples of anything), with odd
// micro-batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <sstream>

#include "comm/communicator.h"
#include "kernels/ops.h"
#include "model/gpt2.h"
#include "model/stage.h"
#include "parallel/groups.h"
#include "parallel/memory_model.h"
#include "parallel/pipeline_split.h"
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

// Builds, on every rank of the plan, what the trainer allocates, and checks both allocators
// against the prediction of the rank's stage. Returns the number of ranks checked.
int expect_allocations_match(const ModelConfig& config, const Plan& plan) {
  const MemoryModel model(config);
  std::mutex mutex;
  int checked = 0;
  run_local_ranks(plan.world(), 60.0, [&](Communicator& world) {
    const bool tied = model.layout().tied_embedding();
    const RankGroups groups = make_rank_groups(world, plan, tied);
    const MemoryPrediction predicted = model.predict_stage(plan, groups.stage);
    std::unique_ptr<Backend> backend = make_cpu_backend(1);
    std::unique_ptr<Allocator> device = make_cpu_allocator(world.rank());
    std::unique_ptr<Allocator> host = make_cpu_allocator(world.rank());
    const StageRange range = model.stage_range(plan, groups.stage);
    ShardingConfig sharding{plan.zero,
                            plan.offload,
                            plan.param_dtype,
                            1,
                            pipeline_stage_blocks(model.layout(), range),
                            plan.pp > 1 && range.last && tied,
                            plan.tp,
                            plan.uses_sequence_parallel(),
                            plan.ep,
                            groups.expert_index,
                            plan.offload_params,
                            plan.bf16_optimizer_states};
    ShardedModel state(
        config, sharding,
        StateGroups{groups.data, groups.all, groups.tied, groups.tensor, groups.expert_data},
        *backend, *device, *host);
    const std::unique_ptr<Architecture> arch = make_architecture(
        config,
        TensorParallel{plan.tp, groups.tensor_index, plan.uses_sequence_parallel(), groups.tensor},
        ExpertParallel{plan.ep, groups.expert_index, groups.expert, nullptr, nullptr,
                       plan.moe_capacity_factor},
        fp8_options(plan));
    const int slots = activation_slots(plan.pp_schedule, plan.pp, groups.stage,
                                       static_cast<int>(plan.grad_accum));
    ModelStage stage(*arch, range, *backend, *device, plan.micro_batch, plan.seq_len,
                     plan.param_dtype, true, plan.recompute, slots);
    // As the trainer: a token batch per slot on the first and the last stage (every stage with
    // packed sequences).
    std::vector<Buffer> batches;
    for (int i = 0; stage_reads_tokens(plan, range) && i < slots; ++i) {
      batches.push_back(device->allocate(MemCategory::Data,
                                         token_batch_bytes(plan.micro_batch, plan.seq_len)));
    }
    const MemoryStats d = device->stats(), h = host->stats();
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_GT(predicted.device_total(), 0u);
    for (int c = 0; c < kNumMemCategories; ++c) {
      EXPECT_EQ(predicted.device[static_cast<size_t>(c)], d.current[static_cast<size_t>(c)])
          << "device " << mem_category_name(static_cast<MemCategory>(c)) << ", rank "
          << world.rank() << " (stage " << groups.stage << "), " << describe(plan) << "\n"
          << category_table(predicted.device, d);
      EXPECT_EQ(predicted.host[static_cast<size_t>(c)], h.current[static_cast<size_t>(c)])
          << "host " << mem_category_name(static_cast<MemCategory>(c)) << ", rank "
          << world.rank() << " (stage " << groups.stage << "), " << describe(plan) << "\n"
          << category_table(predicted.host, h);
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
        for (const char* offload : {"none", "optimizer", "params", "all"}) {
          Plan plan = one_rank_plan(2, 9);
          plan.dp = ranks;
          plan.zero = zero;
          set_offload(plan, offload);
          plan.bf16_optimizer_states = plan.offload && dtype != DType::F32;
          plan.param_dtype = dtype;
          plan.recompute = zero == 1 ? Recompute::Full : Recompute::None;
          SCOPED_TRACE(describe(plan));
          EXPECT_EQ(expect_allocations_match(config, plan), ranks);
        }
      }
    }
  }
}

TEST(MemoryModel, PipelinePlansMatchAllocatorEveryRankEveryStage) {
  const ModelConfig config = odd_config(37, 32, 24, 4, 3);
  for (PipelineScheduleKind schedule : {PipelineScheduleKind::OneFOneB, PipelineScheduleKind::GPipe}) {
    for (int pp : {2, 3, 4}) {
      for (int dp : {1, 2}) {
        if (pp * dp > 6) continue;
        Plan plan = one_rank_plan(2, 9);
        plan.pp = pp;
        plan.dp = dp;
        plan.grad_accum = 5;  // more micro-batches than stages: 1F1B's slots differ by stage
        plan.pp_schedule = schedule;
        plan.zero = pp == 2 ? 3 : pp == 3 ? 1 : 2;
        plan.offload = dp == 2;
        plan.offload_params = schedule == PipelineScheduleKind::GPipe && pp != 3;
        plan.param_dtype = pp == 3 ? DType::BF16 : DType::F32;
        plan.recompute = pp == 4 ? Recompute::Selective : Recompute::None;
        SCOPED_TRACE(describe(plan));
        EXPECT_EQ(expect_allocations_match(config, plan), pp * dp);
      }
    }
  }
  // A split of one's own.
  Plan plan = one_rank_plan(3, 7);
  plan.pp = 2;
  plan.grad_accum = 3;
  plan.pp_split = {3, 1};
  EXPECT_EQ(expect_allocations_match(config, plan), 2);
}

// Packed sequences: the middle stages read the token batch too (its positions).
TEST(MemoryModel, PackedSequencesGiveEveryStageTheTokenBatches) {
  const ModelConfig config = odd_config(37, 32, 24, 4, 3);
  Plan plan = one_rank_plan(2, 9);
  plan.pp = 4;
  plan.grad_accum = 5;
  const MemoryModel model(config);
  const uint64_t before = model.predict_stage(plan, 1).device[static_cast<size_t>(MemCategory::Data)];
  plan.packed_sequences = true;
  const uint64_t after = model.predict_stage(plan, 1).device[static_cast<size_t>(MemCategory::Data)];
  EXPECT_EQ(before, 0u);
  EXPECT_EQ(after, token_batch_bytes(2, 9) * static_cast<uint64_t>(activation_slots(
                                                 plan.pp_schedule, plan.pp, 1, 5)));
  EXPECT_EQ(expect_allocations_match(config, plan), 4);
}

TEST(MemoryModel, TensorParallelPlansMatchAllocatorEveryRank) {
  // n_head 4, C 32 (head 8), vocabulary 37 padded to 64: tp 2 and 4 split everything evenly.
  const ModelConfig config = odd_config(37, 32, 32, 3, 4);
  struct Case { int dp, tp, pp, zero; bool offload, sp; Recompute recompute; DType dtype; };
  const Case cases[] = {
      {1, 2, 1, 0, false, true, Recompute::None, DType::F32},
      {1, 2, 1, 0, false, false, Recompute::None, DType::F32},
      {1, 4, 1, 1, false, true, Recompute::Selective, DType::BF16},
      {2, 2, 1, 3, true, true, Recompute::Full, DType::F16},
      {1, 2, 2, 2, false, true, Recompute::None, DType::F32},
      {2, 2, 2, 1, false, false, Recompute::Selective, DType::BF16},
  };
  for (const Case& c : cases) {
    Plan plan = one_rank_plan(2, 6);  // 12 token rows: split by 2 and by 4
    plan.dp = c.dp;
    plan.tp = c.tp;
    plan.pp = c.pp;
    plan.zero = c.zero;
    plan.offload = c.offload;
    plan.sequence_parallel = c.sp;
    plan.recompute = c.recompute;
    plan.param_dtype = c.dtype;
    plan.grad_accum = 3;
    SCOPED_TRACE(describe(plan));
    EXPECT_EQ(expect_allocations_match(config, plan), plan.world());
  }
}

// A plan's shape for expect_cases_match.
struct PlanCase {
  int dp, tp, pp, zero;
  bool offload;
  Recompute recompute;
  DType dtype;
  int ep = 1;
  double capacity = 0;  // an expert capacity factor (it bounds the experts' buffers)
  bool offload_params = false;
};

// Every case of every config (micro-batch 2 x 3 accumulation, seq 6): predicted = allocated on
// every rank.
void expect_cases_match(const std::vector<ModelConfig>& configs, const std::vector<PlanCase>& cases) {
  for (const ModelConfig& config : configs) {
    for (const PlanCase& c : cases) {
      Plan plan = one_rank_plan(2, 6);
      plan.dp = c.dp;
      plan.tp = c.tp;
      plan.ep = c.ep;
      plan.moe_capacity_factor = c.capacity;
      plan.pp = c.pp;
      plan.zero = c.zero;
      plan.offload = c.offload;
      plan.offload_params = c.offload_params;
      plan.recompute = c.recompute;
      plan.param_dtype = c.dtype;
      plan.grad_accum = 3;
      SCOPED_TRACE(config.name + ", " + describe(plan));
      EXPECT_EQ(expect_allocations_match(config, plan), plan.world());
    }
  }
}

// The LLaMA family: Llama with grouped-query attention and an untied head (its own block on
// the last stage, no tied copy of the embedding there), Qwen2 with q/k/v biases and a tied
// head; one rank, ZeRO, pipelines and tensor parallelism.
// A small Llama (grouped-query attention, an untied head) and a Qwen2 like it (q/k/v biases, a
// tied head), named "llama-<suffix>" and "qwen2-<suffix>", MLP width `intermediate`.
std::pair<ModelConfig, ModelConfig> small_llama_family(const std::string& suffix,
                                                       int64_t intermediate) {
  ModelConfig llama = odd_config(37, 32, 32, 4, 4);
  llama.name = "llama-" + suffix;
  llama.type = ModelType::Llama;
  llama.n_kv_head = 2;
  llama.intermediate_size = intermediate;
  llama.tie_word_embeddings = false;
  llama.qkv_bias = llama.o_bias = llama.mlp_bias = false;
  ModelConfig qwen2 = llama;
  qwen2.name = "qwen2-" + suffix;
  qwen2.type = ModelType::Qwen2;
  qwen2.tie_word_embeddings = true;
  qwen2.qkv_bias = true;
  return {llama, qwen2};
}

TEST(MemoryModel, LlamaFamilyPlansMatchAllocatorEveryRank) {
  const auto [llama, qwen2] = small_llama_family("odd", 44);
  expect_cases_match({llama, qwen2}, {
                                         {1, 1, 1, 0, false, Recompute::None, DType::F32},
                                         {1, 1, 1, 0, false, Recompute::Selective, DType::BF16},
                                         {2, 1, 1, 3, true, Recompute::Full, DType::F32},
                                         {1, 1, 2, 1, false, Recompute::None, DType::F32},
                                         {2, 2, 1, 2, false, Recompute::None, DType::BF16},
                                         {1, 2, 2, 0, false, Recompute::Selective, DType::F32},
                                     });
}

// --precision fp8: the layers' workspace holds the FP8 operands of the largest GEMM and their
// scales (model/fp8_linear.h), on every plan; a micro-batch of 2 x 8 tokens (a multiple of 16),
// the MLP's width a multiple of 16 (Llama) or not (Qwen2: its projections stay bf16, the
// attention's take the scratch).
TEST(MemoryModel, Fp8PlansMatchAllocatorEveryRank) {
  const ModelConfig llama = small_llama_family("fp8", 48).first;
  const ModelConfig qwen2 = small_llama_family("fp8", 44).second;
  for (const ModelConfig& config : {llama, qwen2}) {
    for (const auto& [dp, tp, pp, zero, recompute] :
         {std::tuple{1, 1, 1, 0, Recompute::None}, std::tuple{2, 1, 1, 3, Recompute::Full},
          std::tuple{1, 2, 1, 1, Recompute::Selective}, std::tuple{1, 1, 2, 2, Recompute::None}}) {
      Plan plan = one_rank_plan(2, 8);
      plan.dp = dp;
      plan.tp = tp;
      plan.pp = pp;
      plan.zero = zero;
      plan.recompute = recompute;
      plan.grad_accum = 2;
      plan.param_dtype = DType::BF16;
      plan.fp8 = true;
      SCOPED_TRACE(config.name + ", " + describe(plan));
      EXPECT_EQ(expect_allocations_match(config, plan), plan.world());
      Plan bf16 = plan;
      bf16.fp8 = false;
      const MemoryModel model(config);
      const auto workspace = static_cast<size_t>(MemCategory::Workspace);
      EXPECT_GT(model.predict_stage(plan, 0).device[workspace],
                model.predict_stage(bf16, 0).device[workspace]);
    }
  }
}

// Mixture of experts: Qwen2-MoE with a dense first layer and a shared expert (the layers'
// activations and the MoE workspace differ by layer), and Mixtral; the expert-ordered buffers
// hold every token's k copies (dropless: the worst case is the only case). One rank, ZeRO-3 with
// offload, a pipeline that puts the dense layer and the MoE layer on different stages.
TEST(MemoryModel, MixtureOfExpertsPlansMatchAllocatorEveryRank) {
  ModelConfig qwen = odd_config(37, 32, 32, 4, 4);
  qwen.name = "qwen2-moe-odd";
  qwen.type = ModelType::Qwen2Moe;
  qwen.n_layer = 2;
  qwen.n_kv_head = 2;
  qwen.intermediate_size = 44;
  qwen.tie_word_embeddings = true;
  qwen.qkv_bias = true;
  qwen.o_bias = qwen.mlp_bias = false;
  qwen.moe = {5, 2, false, 20, 28, 1, {0}};
  ModelConfig mixtral = qwen;
  mixtral.name = "mixtral-odd";
  mixtral.type = ModelType::Mixtral;
  mixtral.tie_word_embeddings = false;
  mixtral.qkv_bias = false;
  mixtral.moe = {4, 2, true, 20, 0, 1, {}};
  expect_cases_match({qwen, mixtral}, {
                                          {1, 1, 1, 0, false, Recompute::None, DType::F32},
                                          {1, 1, 1, 0, false, Recompute::Selective, DType::BF16},
                                          {2, 1, 1, 3, true, Recompute::Full, DType::F32},
                                          {1, 1, 2, 1, false, Recompute::None, DType::BF16},
                                      });
  // Expert parallelism: each rank holds E / ep experts, their blocks sharded over dp / ep
  // ranks, and buffers for the worst case of rows its experts may receive.
  qwen.moe.experts = 4;
  expect_cases_match({qwen, mixtral}, {
                                          {2, 1, 1, 0, false, Recompute::None, DType::F32, 2},
                                          {4, 1, 1, 3, false, Recompute::Selective, DType::BF16, 2},
                                          {4, 1, 1, 2, true, Recompute::Full, DType::F32, 4},
                                          {2, 1, 2, 1, false, Recompute::None, DType::BF16, 2},
                                          // tp: the attention split, the experts whole
                                          {1, 2, 1, 0, false, Recompute::Selective, DType::F32},
                                          {2, 2, 1, 3, false, Recompute::Full, DType::BF16, 2},
                                          // an expert capacity bounds the buffers
                                          {4, 1, 1, 3, false, Recompute::None, DType::F32, 4, 1.25},
                                          {1, 1, 1, 0, false, Recompute::Selective, DType::F32, 1,
                                           0.5},
                                          // parameter offload: the experts' blocks come up too
                                          {2, 1, 1, 3, true, Recompute::None, DType::BF16, 2, 0,
                                           true},
                                          {2, 1, 2, 1, false, Recompute::Full, DType::F32, 2, 0,
                                           true},
                                          {2, 2, 1, 0, false, Recompute::None, DType::BF16, 1, 0,
                                           true},
                                      });
}

// Multi-head latent attention (DeepSeek-V2: q_proj; V3: the q latent, a selection bias in F32
// beside 16-bit parameters): its latents, values and scratch on one rank, over experts, stages,
// ZeRO-3 with offload and every recompute mode.
TEST(MemoryModel, LatentAttentionPlansMatchAllocatorEveryRank) {
  std::vector<ModelConfig> configs;
  for (const char* dir : {"deepseek_v2_tiny", "deepseek_v3_tiny"}) {
    configs.push_back(
        load_model_config(std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/" + dir));
  }
  expect_cases_match(configs, {
                                  {1, 1, 1, 0, false, Recompute::None, DType::F32},
                                  {1, 1, 1, 0, false, Recompute::Selective, DType::BF16},
                                  {2, 1, 1, 3, true, Recompute::Full, DType::F32, 2},
                                  {2, 1, 2, 1, false, Recompute::None, DType::BF16, 2},
                                  {2, 1, 1, 3, true, Recompute::Selective, DType::BF16, 2, 0,
                                   true},
                                  // tp: the heads split, the latent path replicated
                                  {1, 2, 1, 0, false, Recompute::Selective, DType::F32},
                                  {2, 2, 2, 3, false, Recompute::Full, DType::BF16, 2},
                              });
}

// With an expert capacity the experts' buffers hold what the capacity lets through instead of
// the dropless worst case: less memory at ep > 1.
TEST(MemoryModel, AnExpertCapacityBoundsTheExpertsBuffers) {
  const ModelConfig config = load_model_config("moe-tiny");
  Plan plan = one_rank_plan(8, 64);
  plan.dp = plan.ep = 4;
  const uint64_t dropless = predict_memory(config, plan).device_total();
  plan.moe_capacity_factor = 1.0;
  const uint64_t capped = predict_memory(config, plan).device_total();
  EXPECT_LT(capped, dropless);
  plan.moe_capacity_factor = 100.0;  // a capacity above the worst case: the worst case
  EXPECT_EQ(predict_memory(config, plan).device_total(), dropless);
}

TEST(MemoryModel, SequenceParallelismDividesTheStreamsActivations) {
  // Without sequence parallelism the residual stream's activations are whole on every tp
  // rank; with it, 1/tp of their token rows: per layer ln_1, residual2 and ln_2 (B*T, C) and
  // the four layernorm statistics (B*T) f32; the stage's input, the 11 layer outputs kept
  // between its 12 layers and the head's gradient (B*T, C).
  const ModelConfig config = load_model_config("gpt2-124m");
  Plan plan = one_rank_plan(4, 1024);
  plan.param_dtype = DType::BF16;
  plan.tp = 4;
  plan.sequence_parallel = false;
  const uint64_t whole = activation_sizes(config, plan, 0).per_micro_batch;
  plan.sequence_parallel = true;
  const uint64_t split = activation_sizes(config, plan, 0).per_micro_batch;
  const uint64_t N = 4 * 1024, C = 768, row_tensor = N * C * 2, stats = N * 4;
  const uint64_t stream_bytes = 12 * (3 * row_tensor + 4 * stats) + (1 + 11 + 1) * row_tensor;
  EXPECT_EQ(whole - split, stream_bytes - stream_bytes / 4)      << whole << " " << split;
}

TEST(MemoryModel, ActivationsAreTheStagesOwnPlan) {
  // One stage with every layer: exactly plan_stage_buffers of the whole model, in every
  // recompute mode and dtype (the memory model asks the model, and caches by stage shape).
  for (const char* name : {"gpt2-124m", "13b"}) {
    const ModelConfig config = load_model_config(name);
    Decoder arch(config);
    for (Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        Plan plan = one_rank_plan(3, 1000);
        plan.recompute = recompute;
        plan.param_dtype = dtype;
        const StageBuffers whole =
            plan_stage_buffers(arch, whole_model(config), 3, 1000, dtype, true, recompute, 1);
        const ActivationSizes a = activation_sizes(config, plan, 0);
        EXPECT_EQ(a.activations(), whole.activation_bytes()) << name << " " << recompute_name(recompute);
        EXPECT_EQ(a.workspace, whole.workspace.bytes()) << name;
        const StageBuffers plain =
            plan_stage_buffers(arch, whole_model(config), 3, 1000, dtype, true, Recompute::None, 1);
        EXPECT_EQ(a.without_recompute, plain.slot.bytes());
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
    Decoder arch(config);
    EXPECT_EQ(m.activations_without_recompute,
              plan_stage_buffers(arch, whole_model(config), 4, 1024, DType::BF16, true,
                                 Recompute::None, 1).slot.bytes());
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

// Parameter offload with the optimizer's (DeepSpeed's ZeRO-Infinity with offload_param and
// offload_optimizer on the CPU): the device keeps no model state, only the blocks in flight --
// two gathered blocks and three full-block gradient buffers (the embedding's and two others),
// sized by the largest blocks, plus the shard buffers of the reduction.
TEST(MemoryModel, ParameterOffloadLeavesTheBlocksInFlightOnTheDevice) {
  const ModelConfig config = load_model_config("qwen2.5-7b");
  const MemoryModel model(config);
  const double psi = static_cast<double>(ParamLayout(config).total_numel());
  Plan plan = one_rank_plan(1, 1024);
  plan.dp = 4;
  plan.zero = 3;
  plan.param_dtype = DType::BF16;
  set_offload(plan, "all");
  const MemoryPrediction m = predict_memory(config, plan);
  for (MemCategory c : {MemCategory::Parameters, MemCategory::Gradients, MemCategory::MasterWeights,
                        MemCategory::OptimizerState}) {
    EXPECT_EQ(m.device[static_cast<size_t>(c)], 0u) << mem_category_name(c);
  }
  // Host, per rank: 2 bytes of params + 2 of grads + 4 master + 8 Adam, over 4 ranks.
  EXPECT_NEAR((m.host[static_cast<size_t>(MemCategory::Parameters)] +
               m.host[static_cast<size_t>(MemCategory::Gradients)] +
               m.host[static_cast<size_t>(MemCategory::OptimizerStateHost)]) / psi,
              16.0 / 4, 1e-3);
  // Device: 2 gathered blocks of the largest block (the untied head or the embedding: vocab x
  // hidden, padded to 4 shards), the embedding's gradient buffer, two of the largest other
  // block, and two shards of the largest block (the reduce-scatter's and the sum's).
  const std::vector<int64_t> numels = model.stage_block_numels(plan, 0);
  const int64_t largest = *std::max_element(numels.begin(), numels.end());
  const int64_t embedding = numels[static_cast<size_t>(ParamLayout::embedding_block())];
  int64_t other = 0;
  for (size_t b = 0; b < numels.size(); ++b) {
    if (static_cast<int>(b) != ParamLayout::embedding_block()) other = std::max(other, numels[b]);
  }
  auto padded = [](int64_t n) { return shard_numel(n, 4) * 4; };
  EXPECT_EQ(m.device[static_cast<size_t>(MemCategory::GatheredParams)], 2 * 2 * padded(largest));
  EXPECT_EQ(m.device[static_cast<size_t>(MemCategory::CommBuffers)],
            2 * (padded(embedding) + 2 * padded(other) + 2 * shard_numel(largest, 4)));
  // bf16 optimizer states: 2 + 2 + 4 + 4 (the moments 2 each) bytes per parameter.
  Plan bf16_states = plan;
  bf16_states.bf16_optimizer_states = true;
  const MemoryPrediction b = predict_memory(config, bf16_states);
  EXPECT_NEAR(b.host[static_cast<size_t>(MemCategory::OptimizerStateHost)] / psi, 8.0 / 4, 1e-3);
  EXPECT_EQ(b.device_total(), m.device_total());
  // Without offload the same plan keeps a quarter of 16 bytes per parameter on the device.
  Plan resident = plan;
  set_offload(resident, "none");
  EXPECT_GT(predict_memory(config, resident).device_total(),
            m.device_total() + static_cast<uint64_t>(3.9 * psi));
}

TEST(MemoryModel, TensorParallelSplitOfBlocks) {
  const ModelConfig config = odd_config(101, 48, 128, 2, 4);
  const ParamLayout layout(config);
  // A layer: the split tensors divide by tp; ln_1, ln_2 (weight, bias) and the two row-split
  // projections' biases (6 tensors of C = 128) stay whole. (C = 128 keeps every split part
  // a multiple of the 32-element alignment: 3C/4 = 96.)
  const int layer = ParamLayout::layer_block(0);
  EXPECT_EQ(2 * ParamLayout(config, 2).block_numel(layer) - layout.block_numel(layer), 6 * 128);
  EXPECT_EQ(4 * ParamLayout(config, 4).block_numel(layer) - layout.block_numel(layer), 3 * 6 * 128);
  // The embedding block: wte split by vocabulary rows (101 padded to 128: 32 rows of 128 on
  // each of 4 ranks), wpe (48 x 128) whole. ln_f whole.
  EXPECT_EQ(ParamLayout(config, 4).block_numel(0), 32 * 128 + 48 * 128);
  EXPECT_EQ(ParamLayout(config, 4).block_numel(layout.final_block()),
            layout.block_numel(layout.final_block()));
}

TEST(MemoryModel, PipelineStagesCoverEveryLayerOnceAndHoldTheTiedEmbeddingTwice) {
  const ModelConfig config = load_model_config("6b");  // 28 layers
  const ParamLayout layout(config);
  for (int pp : {1, 2, 3, 8, 28}) {
    Plan plan = one_rank_plan(1, 1024);
    plan.pp = pp;
    int64_t next = 0;
    for (int s = 0; s < pp; ++s) {
      const StageRange stage = pipeline_stage(config, plan, s);
      EXPECT_EQ(stage.first_layer, next);
      EXPECT_GE(stage.layers(), 1);
      next = stage.end_layer;
      const std::vector<int> blocks = pipeline_stage_blocks(layout, stage);
      const bool has_embedding = std::count(blocks.begin(), blocks.end(), 0) == 1;
      EXPECT_EQ(has_embedding, s == 0 || s == pp - 1) << "pp " << pp << " stage " << s;
      EXPECT_EQ(std::count(blocks.begin(), blocks.end(), layout.final_block()), s == pp - 1);
    }
    EXPECT_EQ(next, config.n_layer);
  }
}

TEST(MemoryModel, OneFOneBKeepsUpToPpMicroBatchesOnTheFirstStageGPipeAll) {
  const ModelConfig config = load_model_config("6b");
  Plan plan = one_rank_plan(1, 1024);
  plan.pp = 4;
  plan.grad_accum = 16;
  plan.param_dtype = DType::BF16;
  EXPECT_EQ(activation_sizes(config, plan, 0).in_flight, 4);
  EXPECT_EQ(activation_sizes(config, plan, 3).in_flight, 1);
  plan.grad_accum = 2;
  EXPECT_EQ(activation_sizes(config, plan, 0).in_flight, 2);
  plan.pp_schedule = PipelineScheduleKind::GPipe;
  plan.grad_accum = 16;
  EXPECT_EQ(activation_sizes(config, plan, 3).in_flight, 16);
  plan.pp_schedule = PipelineScheduleKind::OneFOneB;
  // Stage 0 and the last stage hold token batches (one per slot); a pipeline receives straight
  // into the slots and the residual gradient: no buffers of its own.
  const MemoryModel model(config);
  const uint64_t batch = token_batch_bytes(1, 1024);
  EXPECT_EQ(model.predict_stage(plan, 0).device[static_cast<size_t>(MemCategory::Data)], 4 * batch);
  EXPECT_EQ(model.predict_stage(plan, 1).device[static_cast<size_t>(MemCategory::Data)], 0u);
  EXPECT_EQ(model.predict_stage(plan, 3).device[static_cast<size_t>(MemCategory::Data)], batch);
  EXPECT_EQ(model.predict_stage(plan, 1).device[static_cast<size_t>(MemCategory::CommBuffers)], 0u);
}

}  // namespace
}  // namespace dstrain
