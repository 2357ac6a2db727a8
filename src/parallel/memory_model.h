// The memory model: the exact bytes one rank allocates under a Plan, by category.
//
// One source of truth. The functions here size every buffer a rank holds; the code that
// allocates calls the same functions, and a test compares the two byte for byte
// (tests/parallel/memory_model_test.cpp runs ShardedModel + ModelStage + the token batch of
// every pipeline stage on the CPU allocators and checks every category against predict()).
//
//   model state per block      block_state_sizes()     (ZeRO stage, offload, precision)
//   per-rank state buffers     rank_state_buffers()    (gathered blocks, reduce buffers)
//   activations, workspace     activation_sizes()      (model/stage.h's plan_stage_buffers
//                                                       for the rank's pipeline stage, its
//                                                       micro-batch slots from the schedule;
//                                                       tensor-parallel splits estimated)
//   token batch                token_batch_bytes()
//
// Per parameter element of a block, for param bytes P (4 fp32, 2 fp16/bf16) and N the
// data-parallel ranks the state is sharded over (ZeRO paper, Rajbhandari et al. 2020, with
// K = 12 for mixed-precision Adam):
//   stage 0   P params + P grads + (4 master if P = 2) + 8 Adam          all replicated
//   stage 1   P params + P grads + (4 master + 8 Adam) / N
//   stage 2   P params + (P grads + 4 master + 8 Adam) / N
//   stage 3   (P params + P grads + 4 master + 8 Adam) / N
//   offload   the master (always, fp32) and the Adam moments live in pinned host memory
//             (OptimizerStateHost) instead; the device keeps the P-byte params and grads.
//   offload of the parameters: the P-byte params and grads (each as its stage shards them)
//             live in pinned host memory (Parameters, Gradients, host) and come to the device
//             block by block.
//   bf16 optimizer states: the two Adam moments take 2 bytes each instead of 4.
// plus, per rank, buffers sized by the largest block (not per parameter): stage 3 gathers
// each block into one of two full-block buffers (current, prefetched); stages 2-3 let
// backward add each block's gradient into a full-block buffer before the reduce-scatter (one
// held for the embedding block, whose tied head adds first and the embedding last; one for
// the block at hand); stages 1-3 receive the reduce-scatter's shard into a buffer; offload
// stages one range's gradients down and updated weights up through two host buffers.
// Parameter offload brings every block to the device as stage 3 gathers it (two full-block
// buffers, the host's params copied in -- at stage 3 this rank's shard, then gathered) and
// lets backward add into the three full-block gradient buffers at every stage (their sums go
// back to the host); at stages 2-3 a shard buffer on the device adds each micro-batch's
// reduced shard to the host's sum; the host staging of optimizer offload is not needed (the
// gradients and the weights are on the host already).
//
// Shards: each block's flat buffer is cut into N equal shards of shard_numel(n, N) =
// ceil(n / N) elements (rank r owns [r*s, (r+1)*s), the last padded); full buffers of a
// group (at every stage, 0 included) are padded to N * s elements so collectives run in place.
//
// Tensor parallelism: a tp rank's blocks are its slices (ParamLayout(config, tp)), its
// activations those of its architecture (model/tensor_parallel.h: with sequence parallelism
// the residual stream's tensors hold 1/tp of the token rows).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/allocator.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/stage.h"
#include "parallel/pipeline_split.h"
#include "parallel/plan.h"

namespace dstrain {

namespace memory_detail {
struct ActivationTable;  // memory_model.cpp
}

// ---- Sizing functions (what a rank allocates) ------------------------------------------

// One buffer: category, element type and count, and whether it lives in host memory.
struct BufferSize {
  MemCategory category = MemCategory::Workspace;
  DType dtype = DType::F32;
  int64_t numel = 0;  // 0: not allocated
  bool host = false;  // pinned host memory (the host allocator), else the device
  uint64_t bytes() const;
};

struct ShardingSpec {
  int zero = 0;                   // ZeRO stage 0..3
  int world = 1;                  // data-parallel ranks the state is sharded over
  bool offload = false;           // fp32 master + Adam moments on the host
  DType param_dtype = DType::F32; // params and grads; the master and the moments are fp32
  bool offload_params = false;    // the working params and grads on the host too
  DType moment_dtype = DType::F32; // the Adam moments: F32, or BF16 (bf16 optimizer states)
};

// Elements of each rank's shard of a block of `block_numel` elements over `world` ranks:
// ceil(block_numel / world), so all shards are the same size (the last one padded).
int64_t shard_numel(int64_t block_numel, int world);

// One block's model state on one rank.
struct BlockStateSizes {
  int64_t numel = 0;   // the block's elements (ParamLayout(config, tp)::block_numel)
  int64_t shard = 0;   // shard_numel(numel, world)
  int64_t padded = 0;  // shard * world: a full buffer of the sharded group
  int64_t optimizer_numel = 0;  // the range this rank's optimizer updates: padded at stage 0,
                                // else its shard
  BufferSize params;      // Parameters: padded; the shard at stage 3
  BufferSize grads;       // Gradients: padded; the shard at stages 2-3
  BufferSize master;      // fp32 master of the optimizer range: MasterWeights on the device
                          // with mixed precision; OptimizerStateHost with offload; else none
  BufferSize exp_avg, exp_avg_sq;  // Adam moments of the optimizer range (fp32, or bf16 with
                                   // bf16 optimizer states): OptimizerState, or
                                   // OptimizerStateHost with offload
};
// REQUIRES: 0 <= zero <= 3, world >= 1, block_numel >= 0.
BlockStateSizes block_state_sizes(int64_t block_numel, const ShardingSpec& spec);

// The per-rank buffers sized by the largest blocks the rank holds.
struct RankStateBuffers {
  std::array<BufferSize, 2> gathered_params;  // stage 3 or parameter offload: the current and
                                              // the prefetched block, each the largest padded
                                              // block (GatheredParams)
  BufferSize embedding_grads;  // stages 2-3 or parameter offload: the embedding block's padded
                               // gradient, held across backward (CommBuffers); none without
                               // that block
  // stages 2-3 or parameter offload: two of the largest other padded block, one filling while
  // the other's reduction runs (CommBuffers)
  std::array<BufferSize, 2> block_grads;
  BufferSize reduced_shard;  // stages 1-3: the largest shard, a reduce-scatter's output
                             // (CommBuffers)
  BufferSize shard_sum;  // stages 2-3 with parameter offload: the largest shard, where the
                         // host's gradient sum and a micro-batch's reduced shard are added
                         // (CommBuffers)
  // offload: two of the largest optimizer range each, in host memory (double-buffered): the
  // gradients going down and the updated weights going up (CommBuffers, host)
  std::array<BufferSize, 2> host_grad_staging;
  std::array<BufferSize, 2> host_param_staging;
};
// block_numels: the rank's blocks; block_worlds: the ranks each is sharded over (the routed
// experts' blocks over dp / ep; empty: spec.world for all); embedding_position: index into
// block_numels of the embedding block, or -1 when the rank does not hold it.
RankStateBuffers rank_state_buffers(const std::vector<int64_t>& block_numels,
                                    const std::vector<int>& block_worlds, int embedding_position,
                                    const ShardingSpec& spec);

// The token batch a rank reads: inputs, targets and the positions of packed sequences, (B, T)
// int32 each (MemCategory::Data), one per activation slot. Held by the first pipeline stage
// (inputs) and the last (targets), and by every stage with packed sequences (the positions)
// or --batch-tokens (each micro-batch's shape).
uint64_t token_batch_bytes(int64_t micro_batch, int64_t seq_len);
// Whether the ranks of a stage read the token batch (see token_batch_bytes).
bool stage_reads_tokens(const Plan& plan, const StageRange& range);

// Activations and workspace of one rank: plan_stage_buffers of its pipeline stage with the
// plan's recompute mode and slots, exactly what ModelStage allocates. A pipeline
// receives straight into them (the stage input of the micro-batch's slot, the residual
// gradient of the workspace): no buffers of its own.
struct ActivationSizes {
  uint64_t per_micro_batch = 0;   // Activations kept for one micro-batch (a slot)
  int64_t in_flight = 1;          // slots: micro-batches whose activations are alive at once
                                  // (1F1B: min(pp - stage, grad_accum); GPipe: grad_accum)
  uint64_t recompute_buffer = 0;  // Activations: the buffers recomputed tensors share (one
                                  // layer's worth, allocated once)
  uint64_t workspace = 0;         // Workspace (logits, activation gradients, scratch)
  uint64_t without_recompute = 0; // what the activations would be with Recompute::None
  uint64_t activations() const { return per_micro_batch * in_flight + recompute_buffer; }
};
ActivationSizes activation_sizes(const ModelConfig& config, const Plan& plan, int stage);

// ---- Predictions (the sums the planner uses) -------------------------------------------

struct MemoryItem {
  MemCategory category = MemCategory::Workspace;
  bool host = false;
  std::string what;  // "Adam moments (fp32, 1/8 shard)"
  uint64_t bytes = 0;
};

struct MemoryPrediction {
  int stage = 0;  // the pipeline stage of the rank described
  std::array<uint64_t, kNumMemCategories> device{};  // bytes by category on the GPU
  std::array<uint64_t, kNumMemCategories> host{};    // bytes by category in host memory
  std::vector<MemoryItem> items;                     // what makes up the sums
  uint64_t activations_without_recompute = 0;        // device Activations with Recompute::None
  uint64_t device_total() const;
  uint64_t host_total() const;
};

// The memory model of one ModelConfig: keeps the layout and per-shape tables so that a
// planner can ask for thousands of plans.
class MemoryModel {
 public:
  explicit MemoryModel(const ModelConfig& config);
  ~MemoryModel();
  MemoryModel(const MemoryModel&) = delete;
  MemoryModel& operator=(const MemoryModel&) = delete;

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }

  // The rank of pipeline stage `stage` (all its tensor- and data-parallel ranks are alike).
  MemoryPrediction predict_stage(const Plan& plan, int stage) const;
  // The stage whose ranks need the most device memory (ties: the first).
  MemoryPrediction predict(const Plan& plan) const;
  // Host memory of all world() ranks together (they share the machine's RAM).
  uint64_t host_bytes_all_ranks(const Plan& plan) const;
  // On the CPU backend, where a rank's "device" is host memory too: device and host bytes of
  // all world() ranks together.
  uint64_t cpu_bytes_all_ranks(const Plan& plan) const;
  // Elements of the blocks a rank of `stage` holds, tensor-parallel split (one entry per
  // block of pipeline_stage_blocks).
  std::vector<int64_t> stage_block_numels(const Plan& plan, int stage) const;
  // The ranks each of those blocks is sharded over: dp, or dp / ep for the routed experts'.
  std::vector<int> stage_block_worlds(const Plan& plan, int stage) const;
  // The plan's layers per stage: plan.pp_split, or the balanced split (cached).
  std::vector<int64_t> split(const Plan& plan) const;
  // The plan's pipeline stage `stage`.
  StageRange stage_range(const Plan& plan, int stage) const;
  ActivationSizes activation_sizes(const Plan& plan, int stage) const;

 private:
  // One tp rank's architecture under the plan's tp and sequence parallelism (cached).
  const Architecture& architecture(const Plan& plan) const;
  const memory_detail::ActivationTable& activation_table(const Plan& plan,
                                                         const StageRange& range,
                                                         Recompute recompute) const;

  ModelConfig config_;
  ParamLayout layout_;
  // Caches, behind cache_mutex_ (rank threads share a model; an entry, once made, stays where
  // it is): (tp, sequence parallel, ep, capacity, fp8, cached FP8 weights) -> the
  // architecture; (pp, seq_len) -> the balanced split; the stage's shape -> its buffer bytes.
  // Recursive: activation_table asks architecture.
  mutable std::recursive_mutex cache_mutex_;
  mutable std::map<std::tuple<int, bool, int, double, bool, bool>, std::unique_ptr<Architecture>>
      architectures_;
  mutable std::map<std::pair<int, int64_t>, std::vector<int64_t>> splits_;
  // (micro-batch, seq, dtype, tp, sequence parallel, ep, capacity factor, recompute, layers,
  // first stage, last stage, first layer where the layers differ, fp8, cached FP8 weights)
  mutable std::map<std::tuple<int64_t, int64_t, DType, int, bool, int, double, Recompute, int64_t,
                              bool, bool, int64_t, bool, bool>,
                   std::unique_ptr<memory_detail::ActivationTable>>
      activation_tables_;
  bool mixed_layers_ = false;  // some layers' MLPs differ (decoder_parts(config).mixed_layers())
};

// Shortcuts that build a MemoryModel.
MemoryPrediction predict_memory(const ModelConfig& config, const Plan& plan);

}  // namespace dstrain
