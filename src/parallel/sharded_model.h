// ShardedModel: one rank's share of the model's trainable state, FSDP style. ZeRO stages
// 0-3 are settings of this one mechanism (what is sharded), not four code paths:
//
//   stage  optimizer state (+fp32 master)   gradients              parameters
//   0      full, replicated                 full, all-reduced      full
//   1      this rank's shard                full, reduce-scattered full (all-gathered)
//   2      shard                            shard (per block)      full (all-gathered)
//   3      shard                            shard (per block)      shard (gathered per block)
//
// Each block's flat buffer is cut into `world` equal shards of shard_numel(n, world)
// elements (the last padded with zeros); rank r owns [r*s, (r+1)*s). With offload, the fp32
// master weights and Adam moments of the shard live in host memory and the optimizer step
// runs on the host; gradients go down, updated weights come back.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "model/layout.h"
#include "optim/adamw.h"

namespace dstrain {

struct ShardingConfig {
  int zero = 0;          // ZeRO stage 0..3
  bool offload = false;  // master weights and Adam moments in host memory
};

// Elements of each rank's shard of a block of `block_numel` elements over `world` ranks:
// ceil(block_numel / world), so all shards are the same size (the last one padded).
int64_t shard_numel(int64_t block_numel, int world);

struct StepStats {
  double grad_norm = 0.0;  // global, before clipping
  float clip = 1.0f;       // the multiplier applied
};

class ShardedModel : public ParamProvider {
 public:
  ShardedModel(const ModelConfig& config, const ShardingConfig& sharding, Communicator& comm,
               Backend& backend, Allocator& device, Allocator& host);

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  const ShardingConfig& sharding() const { return sharding_; }
  int num_blocks() const { return layout_.num_blocks(); }
  // This rank's range of block b: [shard_begin, shard_begin + shard_count) of the flat buffer
  // (shard_count may be < shard_numel for the last rank, or 0).
  int64_t shard_begin(int block) const;
  int64_t shard_count(int block) const;

  // ParamProvider (called by Gpt2 forward/backward).
  Tensor acquire_params(int block) override;
  void release_params(int block) override;
  Tensor acquire_grads(int block) override;
  void release_grads(int block) override;

  // Before the first micro-batch of a step: zeroes the gradients.
  void begin_step();
  // After the last micro-batch: finishes the gradient reduction, computes the global norm,
  // clips, takes the AdamW step (step is 1-based) on this rank's part and makes the updated
  // parameters visible where they are needed. Collective.
  StepStats finish_step(const AdamWConfig& adam, double lr, int64_t step);

  // Fills the master weights from a full F32 copy of every block (e.g. init or a loaded
  // checkpoint); each rank keeps its part.
  void set_full_params(const std::vector<Tensor>& full_blocks);
  // Gathers the full F32 parameters of every block into `full_blocks` (block_numel each). Collective.
  void get_full_params(const std::vector<Tensor>& full_blocks);
  // The same for the Adam moments (which = 0: exp_avg, 1: exp_avg_sq). Collective.
  void set_full_moments(int which, const std::vector<Tensor>& full_blocks);
  void get_full_moments(int which, const std::vector<Tensor>& full_blocks);

 private:
  struct Block {
    int64_t numel = 0;        // block_numel
    int64_t shard = 0;        // shard_numel
    Buffer params;            // full padded (world * shard) unless stage 3: shard
    Buffer grads;             // full padded unless stage >= 2: shard
    Buffer master;            // with offload: fp32 master of the shard, on the host
    Buffer exp_avg, exp_avg_sq;  // full (stage 0) or shard; on the host with offload
  };
  Tensor params_full(int block) const;   // REQUIRES: parameters not sharded
  Tensor flat(const Buffer& buffer, int64_t numel) const;
  // The optimizer's range of a block: the whole block at stage 0, this rank's shard above.
  FlatRange optimizer_range(int block) const;
  void reduce_block_grads(int block, Tensor full_grads);

  ModelConfig config_;
  ParamLayout layout_;
  ShardingConfig sharding_;
  Communicator& comm_;
  Backend& backend_;
  int world_, rank_;
  bool shard_optimizer_, shard_grads_, shard_params_;
  std::vector<Block> blocks_;
  // Stage 3: two gathered-block buffers (the current block and the next one).
  Buffer gathered_[2];
  int gathered_block_[2] = {-1, -1};
  int next_gather_slot_ = 0;
  // Stage >= 2: full-size block gradient buffers that backward accumulates into before the
  // reduce-scatter: one for the embedding block (held across the whole backward: the tied
  // head adds first, the embedding last) and one rotating for the other blocks.
  Buffer block_grads_[2];
  int block_grads_owner_[2] = {-1, -1};
  // The shard a reduce-scatter delivers (stages >= 1).
  Buffer reduced_;
  // Offload: host staging for a shard's gradients and updated weights.
  Buffer host_grads_;
};

}  // namespace dstrain
