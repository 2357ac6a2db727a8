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
//
// Device-agnostic: the buffers of the device allocator are touched only through the backend
// (fill_zero, copy, copy_bytes), those of the host allocator by the CPU, so the same code runs
// on the CPU backend (where both allocators hand out host memory) and on a GPU. Every method
// that hands tensors to or takes them from the caller (set_full_*, get_full_*, master_part,
// moment_part) works with host memory whatever the backend. The transfers wait for the
// backend (the legacy stream, nullptr) before they return.
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
  // The working parameters and gradients (and the activations): F32, or F16/BF16 with an
  // fp32 master copy of the optimizer's range.
  DType param_dtype = DType::F32;
  int host_threads = 1;  // threads of the host optimizer (offload)
};

// Elements of each rank's shard of a block of `block_numel` elements over `world` ranks:
// ceil(block_numel / world), so all shards are the same size (the last one padded).
int64_t shard_numel(int64_t block_numel, int world);

struct StepStats {
  double grad_norm = 0.0;  // global, of the unscaled gradients, before clipping
  float clip = 1.0f;       // the multiplier applied
  bool found_inf = false;  // some rank's gradients held an inf or NaN: nothing was updated
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
  // After the last micro-batch: finishes the gradient reduction, agrees with every rank on
  // whether any gradient is inf/NaN (then nothing is updated: the step is skipped), computes
  // the global norm of the gradients divided by loss_scale, clips, takes the AdamW step
  // (adam_step is 1-based: the count of steps applied) on this rank's part and makes the
  // updated parameters visible where they are needed. Collective.
  StepStats finish_step(const AdamWConfig& adam, double lr, int64_t adam_step, double loss_scale);

  // Testing: makes one gradient element of this rank +inf (as an fp16 overflow would).
  void inject_inf_gradient();

  // This rank's part of block b, [shard_begin, shard_begin + shard_count), of the F32 master
  // weights and of the Adam moments (which = 0: exp_avg, 1: exp_avg_sq): what it writes of a
  // checkpoint. Every rank has one at every stage, so all write in parallel.
  // Host memory: a view of the state when it lives on the host (CPU backend, offload), else a
  // host copy (a staging buffer of the host allocator kept per part and reused), valid until
  // the next call for the same part. Not collective.
  Tensor master_part(int block) const;
  Tensor moment_part(int which, int block) const;

  // Fills the master weights (and the working parameters, rounded to their dtype) from a full
  // F32 copy of every block (e.g. init or a loaded checkpoint); each rank keeps its part.
  void set_full_params(const std::vector<Tensor>& full_blocks);
  // Gathers the full F32 master weights of every block into `full_blocks` (block_numel each).
  // Collective.
  void get_full_params(const std::vector<Tensor>& full_blocks);
  // The same for the Adam moments (which = 0: exp_avg, 1: exp_avg_sq). Collective.
  void set_full_moments(int which, const std::vector<Tensor>& full_blocks);
  void get_full_moments(int which, const std::vector<Tensor>& full_blocks);

 private:
  struct Block {
    int64_t numel = 0;        // block_numel
    int64_t shard = 0;        // shard_numel
    Buffer params;            // param_dtype: full padded (world * shard) unless stage 3: shard
    Buffer grads;             // param_dtype: full padded unless stage >= 2: shard
    Buffer master;            // F32 master of the optimizer range; on the host with offload;
                              // empty when the params are F32 on the device (they are the master)
    Buffer exp_avg, exp_avg_sq;  // F32, the optimizer range; on the host with offload
  };
  Tensor flat(const Buffer& buffer, int64_t numel, DType dtype = DType::F32) const;
  Tensor params_padded(int block) const;  // all of the params buffer (param_dtype)
  Tensor grads_padded(int block) const;   // all of the grads buffer (param_dtype)
  // The working parameters / gradients of the optimizer range (param_dtype).
  Tensor range_params(int block) const;
  Tensor range_grads(int block) const;
  Tensor master(int block) const;         // F32, the optimizer range
  // The optimizer's range of a block: the whole block at stage 0, this rank's shard above.
  FlatRange optimizer_range(int block) const;
  // Memory by where it lives (see the top of the file): zeroes a buffer; copies bytes between
  // any two of device and host memory and returns once the destination holds them.
  void zero_buffer(const Buffer& buffer);
  void copy_and_wait(void* dst, Device dst_device, const void* src, Device src_device,
                     size_t bytes) const;
  // dst (n) param dtype, host or device = host_f32 (n) F32, rounded (RNE) to dst's dtype.
  void store_from_host(Tensor dst, Tensor host_f32);
  // `part` itself when it is host memory, else its copy in part_staging_[slot][block].
  Tensor on_host(Tensor part, int slot, int block) const;
  // full (>= block_numel) F32 host = the optimizer-range tensor `local` (F32, host or device)
  // of every rank, gathered when the optimizer state is sharded. Collective then.
  void gather_to_host(Tensor local, int block, Tensor full) const;

  ModelConfig config_;
  ParamLayout layout_;
  ShardingConfig sharding_;
  Communicator& comm_;
  Backend& backend_;
  int world_, rank_;
  DType dtype_;
  bool shard_optimizer_, shard_grads_, shard_params_;
  std::vector<Block> blocks_;
  // Stage 3: two gathered-block buffers (the current block and the next one).
  Buffer gathered_[2];
  int next_gather_slot_ = 0;
  // Stage >= 2: full-size block gradient buffers that backward accumulates into before the
  // reduce-scatter: one for the embedding block (held across the whole backward: the tied
  // head adds first, the embedding last) and one rotating for the other blocks.
  Buffer block_grads_[2];
  int block_grads_owner_[2] = {-1, -1};
  // The shard a reduce-scatter delivers (stages >= 1).
  Buffer reduced_;
  // Offload: host staging for a range's gradients (down) and updated weights (up).
  Buffer host_grads_, host_params_;
  Allocator& host_;
  // Host copies of the checkpoint parts when the state lives on the device: [0] master,
  // [1] exp_avg, [2] exp_avg_sq, by block; allocated on first use.
  mutable std::vector<Buffer> part_staging_[3];
};

}  // namespace dstrain
