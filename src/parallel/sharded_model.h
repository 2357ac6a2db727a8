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
// Parameter offload (offload_params): the working parameters and gradients of every block,
// as the stage shards them, live in host memory; the device holds only the blocks in flight.
// A block comes up as stage 3 gathers it (into one of two full-block buffers, the next one's
// copy in flight while the current one computes; at stage 3 this rank's shard comes up and is
// gathered there), and backward adds into a full-block gradient buffer as at stage 2, whose
// sum goes back down once the block's backward is done: at stages 0-1 the block's sum so far
// (brought up again for the next micro-batch; reduced first in the last one), at stages 2-3
// the reduced shard added to the host's sum on the device. Collectives and updates on host
// state (the tied copy's sum, sequence-parallel sums, the gradient check, a device optimizer
// step, the gathers of stages 1-2) bring a block's range to the device, run there and send the
// result back. Every operation on the numbers is the one the run without it does, on the same
// operands: the bits are the same; only where bytes live and when they move changes.
//
// Device-agnostic: the buffers of the device allocator are touched only through the backend
// (fill_zero, copy, copy_bytes), those of the host allocator by the CPU, so the same code runs
// on the CPU backend (where both allocators hand out host memory) and on a GPU. Every method
// that hands tensors to or takes them from the caller (set_full_*, get_full_*, master_part,
// moment_part) works with host memory whatever the backend, and waits for its transfers.
//
// Pipelines. A rank of a pipeline stage holds that stage's blocks only, sharded over the
// stage's data-parallel group; the first and the last stage both hold the embedding block (the
// tied wte of the LM head): finish_step sums the two copies' gradients over the tied group
// before the step, so both take the same step and stay bitwise equal, and the inf/NaN flag
// and the gradient norm (counting the tied copy once) are agreed over every rank of the run.
//
// Tensor parallelism. A tp rank holds its slices of the blocks (ParamLayout(config, tp)), and
// shards them over its data-parallel group like any block. Replicated parameters are the same
// on every tp rank: the gradient norm counts them on tp index 0 only; those whose gradients are
// per-rank parts under sequence parallelism (ParamSpec::tp_partial_grad: the layernorms) or
// under any tp (ParamSpec::tp_summed_grad: latent attention's latent path) are summed over the
// tp group (StateGroups::tensor) before the step.
//
// Streams. The model's ops (Gpt2's, the optimizer's) run on the compute stream the caller
// names; collectives and offload transfers on a communication stream of this object's own,
// ordered against compute with events, so that on a GPU they overlap:
// - stage 3: while block i computes, block i+1 is gathered (prefetch_params) into the other
//   of two gather buffers;
// - stages 2-3: block i's reduce-scatter is issued once block i-1's backward is queued, and
//   runs while it computes (two rotating full-block gradient buffers);
// - offload: block k+1's gradients go down while the host updates block k, and block k's
//   weights go up while the host updates block k+1 (double-buffered pinned staging).
// The arithmetic is the same in every order: results do not depend on the overlap.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/param_provider.h"
#include "optim/adamw.h"
#include "parallel/memory_model.h"  // shard_numel and the sizing functions

namespace dstrain {

struct ShardingConfig {
  int zero = 0;          // ZeRO stage 0..3
  bool offload = false;  // master weights and Adam moments in host memory
  // The working parameters and gradients (and the activations): F32, or F16/BF16 with an
  // fp32 master copy of the optimizer's range.
  DType param_dtype = DType::F32;
  int host_threads = 1;  // threads of the host optimizer (offload)
  // A pipeline stage's blocks (parallel/pipeline_split.h, pipeline_stage_blocks); empty: all.
  std::vector<int> blocks;
  // The embedding block held here is the last stage's copy of the tied embedding/head
  // (pp > 1): its gradient is summed with the first stage's copy (StateGroups::tied) before
  // the step, so both stay bitwise equal, and the gradient norm counts it once (there).
  bool tied_copy = false;
  // Tensor parallelism: this rank holds its slices of every block (StateGroups::tensor).
  int tp = 1;
  bool sequence_parallel = false;
  // Expert parallelism: this rank holds ep rank ep_rank's experts of every MoE layer
  // (ParamLayout(config, tp, ep, ep_rank)), their blocks sharded and reduced over
  // StateGroups::expert_data.
  int ep = 1, ep_rank = 0;
  // The working parameters and gradients in host memory, brought to the device block by block
  // (see the top of the file).
  bool offload_params = false;
  // The Adam moments in bf16 (with offload: the host's AdamW keeps them so).
  bool bf16_optimizer_states = false;
};

// The communicators of a rank's model state.
struct StateGroups {
  Communicator* data = nullptr;  // the data-parallel group: sharding and gradient reduction
  // Every rank of the run (all pipeline stages): the inf/NaN flag and the gradient norm are
  // agreed over it. nullptr: `data`.
  Communicator* all = nullptr;
  // pp > 1, the first and the last stage: the two ranks of this data-parallel index that hold
  // the tied embedding (group rank 0 the first stage's). nullptr elsewhere.
  Communicator* tied = nullptr;
  // tp > 1: the tp ranks of this stage and data-parallel index (parallel/groups.h).
  Communicator* tensor = nullptr;
  // ep > 1: the data-parallel ranks that hold the same experts (parallel/groups.h): the
  // experts' blocks are sharded and reduced over it. nullptr: `data`.
  Communicator* expert_data = nullptr;
};

struct StepStats {
  double grad_norm = 0.0;  // global, of the unscaled gradients, before clipping
  float clip = 1.0f;       // the multiplier applied
  bool found_inf = false;  // some rank's gradients held an inf or NaN: nothing was updated
};

class ShardedModel : public ParamProvider {
 public:
  // The stream of this object's transfers (nullptr on the CPU backend), for traces.
  Stream comm_stream() const { return comm_stream_.get(); }
  // compute: the stream the caller runs the model on (nullptr: the backend's default).
  // REQUIRES: groups.data; groups.tied exactly when the blocks hold the embedding on a stage
  // that is first or last of pp > 1 stages.
  ShardedModel(const ModelConfig& config, const ShardingConfig& sharding, const StateGroups& groups,
               Backend& backend, Allocator& device, Allocator& host, Stream compute = nullptr);
  // Every block, sharded over `comm` (one pipeline stage).
  ShardedModel(const ModelConfig& config, const ShardingConfig& sharding, Communicator& comm,
               Backend& backend, Allocator& device, Allocator& host, Stream compute = nullptr)
      : ShardedModel(config, sharding, StateGroups{&comm, nullptr, nullptr, nullptr, nullptr},
                     backend, device, host, compute) {}

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  const ShardingConfig& sharding() const { return sharding_; }
  int num_blocks() const { return layout_.num_blocks(); }
  // Whether this rank holds block b (a pipeline stage holds some).
  bool holds(int block) const { return blocks_[static_cast<size_t>(block)].held; }
  // The blocks whose state this rank writes to a checkpoint: those it holds but the tied copy.
  bool writes(int block) const { return holds(block) && !is_tied_copy(block); }
  // This rank's range of block b: [shard_begin, shard_begin + shard_count) of the flat buffer
  // (shard_count may be < shard_numel for the last rank, or 0).
  int64_t shard_begin(int block) const;
  int64_t shard_count(int block) const;

  // ParamProvider (called by Gpt2 forward/backward).
  Tensor acquire_params(int block) override;
  void prefetch_params(int block) override;
  void release_params(int block) override;
  Tensor acquire_grads(int block) override;
  void release_grads(int block) override;
  // Counts params_changed(): every write of the working parameters.
  std::optional<uint64_t> params_version() const override { return params_version_; }

  // Before the first micro-batch of a step: zeroes the gradients.
  void begin_step();
  // Before the work of the step's last micro-batch that adds gradients begins, once every
  // earlier micro-batch has added all of its own (optional; the pipeline runner finds the
  // place: last_micro_batch_position): stages 0 and 1 then reduce each block's gradients as
  // it is released, a block at a time as at stages 2-3, instead of all at once in finish_step
  // -- on a GPU the reduction overlaps the backward. The same collectives on the same data:
  // the results are the same bits.
  void last_micro_batch();
  // After the last micro-batch: finishes the gradient reduction, agrees with every rank on
  // whether any gradient is inf/NaN (then nothing is updated: the step is skipped), computes
  // the global norm of the gradients divided by loss_scale, clips, takes the AdamW step
  // (adam_step is 1-based: the count of steps applied) on this rank's part and makes the
  // updated parameters visible where they are needed. Collective.
  StepStats finish_step(const AdamWConfig& adam, double lr, int64_t adam_step, double loss_scale);

  // Block b's working parameters as the model computes with them (param_dtype bytes; gathered
  // under ZeRO-3, then collective over the data group), copied to the host.
  std::vector<unsigned char> working_params_bytes(int block);
  // Testing: flips the lowest bit of element `element` of block b's working parameters where
  // this rank stores it (under ZeRO-3 only the rank whose shard holds it); false elsewhere.
  bool flip_param_bit(int block, int64_t element);

  // Testing: makes one gradient element of this rank +inf (as an fp16 overflow would), in
  // its first held layer block, once this step's gradients are reduced (in finish_step).
  void inject_inf_gradient();

  // This rank's part of block b, [shard_begin, shard_begin + shard_count), of the F32 master
  // weights and of the Adam moments (which = 0: exp_avg, 1: exp_avg_sq; F32, or BF16 with bf16
  // optimizer states, which a checkpoint writes widened): what it writes of a checkpoint. Every rank has one at every stage, so all write in parallel.
  // Host memory: a view of the state when it lives on the host (CPU backend, offload), else a
  // host copy (a staging buffer of the host allocator kept per part and reused), valid until
  // the next call for the same part. Not collective.
  Tensor master_part(int block) const;
  Tensor moment_part(int which, int block) const;

  // Fills the master weights (and the working parameters, rounded to their dtype) from a full
  // F32 copy of every block (e.g. init or a loaded checkpoint); each rank keeps its part.
  void set_full_params(const std::vector<Tensor>& full_blocks);
  // Sets one tensor's values (F32, spec.numel() of them, host memory) where this rank stores them:
  // its master weights' part and its working parameters' (rounded to their dtype). Every rank of
  // the block's group gives the same values (DeepSeek-V3's selection bias, updated outside the
  // optimizer: train/expert_load.h). Not collective. REQUIRES: holds(spec.block).
  void set_param_values(const ParamSpec& spec, const std::vector<float>& values);
  // Gathers the full F32 master weights of held block `block` into `full` (block_numel
  // elements). Collective over the data-parallel group: its ranks call it for the same block.
  void get_full_param_block(int block, const Tensor& full);
  // The same for the Adam moments (which = 0: exp_avg, 1: exp_avg_sq). Collective.
  void set_full_moments(int which, const std::vector<Tensor>& full_blocks);
  void get_full_moments(int which, const std::vector<Tensor>& full_blocks);

 private:
  struct Block {
    bool held = false;        // a pipeline stage's block (else nothing is allocated)
    // The group the block is sharded and reduced over (the data-parallel group, or for
    // routed experts the expert-data group), its size and this rank's index in it.
    Communicator* comm = nullptr;
    int world = 1, rank = 0;
    int64_t numel = 0;        // block_numel
    int64_t shard = 0;        // shard_numel
    Buffer params;            // param_dtype: full padded (world * shard) unless stage 3: shard
    Buffer grads;             // param_dtype: full padded unless stage >= 2: shard
    Buffer master;            // F32 master of the optimizer range; on the host with offload;
                              // empty when the params are F32 on the device (they are the master)
    Buffer exp_avg, exp_avg_sq;  // F32, the optimizer range; on the host with offload
  };
  Tensor flat(const Buffer& buffer, int64_t numel, DType dtype = DType::F32) const;
  bool is_tied_copy(int block) const {
    return sharding_.tied_copy && block == ParamLayout::embedding_block();
  }
  // The held blocks, in order.
  const std::vector<int>& held() const { return held_; }
  // finish_step's parts.
  void finish_reduction();
  void write_injected_inf();
  bool inject_inf_ = false;
  void sum_tied_gradients();
  void sum_tp_partial_gradients();
  StepStats agree_on_gradients(const AdamWConfig& adam, double loss_scale);
  // Appends the reduced gradients `grads` of `part` to a gradient check: all of them checked
  // for inf/NaN, counted in the norm where this rank counts them.
  void append_gradient_check(const FlatRange& part, Tensor grads,
                             std::vector<GradientTensor>& buffers) const;
  // Calls fn(offset, count, spec) for each parameter of `range`'s block inside it, offset
  // relative to range.begin.
  template <typename Fn>
  void for_each_param_in(const FlatRange& range, Fn fn) const;
  Tensor params_padded(int block) const;  // all of the params buffer (param_dtype)
  Tensor grads_padded(int block) const;   // all of the grads buffer (param_dtype)
  // The working parameters / gradients of the optimizer range (param_dtype).
  Tensor range_params(int block) const;
  Tensor range_grads(int block) const;
  Tensor master(int block) const;         // F32, the optimizer range
  Tensor moment(int which, int block) const;  // the optimizer range, moment_dtype_
  // The optimizer's range of a block: the whole block at stage 0, this rank's shard above.
  FlatRange optimizer_range(int block) const;
  int tp_rank() const { return tensor_ != nullptr ? tensor_->rank() : 0; }
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
  Communicator& comm_;    // the data-parallel group
  Communicator& expert_data_;  // the ranks holding the same experts (== comm_ at ep = 1)
  Communicator& all_;     // every rank: agreement on inf/NaN and the norm
  Communicator* tied_;    // the tied embedding's two holders, or nullptr
  Communicator* tensor_;  // the tp group, or nullptr
  std::vector<int> held_;
  Backend& backend_;
  int world_, rank_;
  DType dtype_;
  bool shard_optimizer_, shard_grads_, shard_params_;
  bool offload_params_;
  DType moment_dtype_;  // F32, or BF16 with bf16 optimizer states
  // The working parameters come through the gathered-block buffers (stage 3 or parameter
  // offload); the gradients through the full-block gradient buffers (stages 2-3 or parameter
  // offload).
  bool gathers_params_, slot_grads_;
  // Some parameter's gradient is a sum of tp-rank parts (sum_tp_partial_gradients).
  bool tp_grad_parts_;
  // Parameter offload: which held blocks have no gradient yet this step (their host sum is
  // stale, read as zeros); stages 2-3, the device buffer where a shard is summed.
  std::vector<bool> grads_fresh_;
  Buffer shard_sum_;
  std::vector<Block> blocks_;
  // Stage 3: a buffer for a gathered block. `block` is the block it holds (-1: none, or
  // stale); `gathered` is recorded on the communication stream after its gather, `released` on
  // the compute stream when the block is released (the next gather into it waits for it).
  struct GatherSlot {
    Buffer buffer;
    int block = -1;
    bool in_use = false;
    OwnedEvent gathered, released;
  };
  // Stages >= 2: a full-size block gradient buffer that backward accumulates into before the
  // reduce-scatter. `filled` is recorded on compute when the block's backward is queued,
  // `reduced` on the communication stream once its reduce-scatter has read it.
  struct GradSlot {
    Buffer buffer;
    int owner = -1;     // the block accumulating into it
    bool pending = false;  // released, its reduce-scatter not issued yet
    bool reduce = false;   // parameter offload at stages 0-1: reduced before it goes down
    OwnedEvent filled, reduced;
  };
  // Stage 3: gathers `block` into slot s on the communication stream.
  void gather_into(int slot, int block);
  // Stages >= 2: the slot a block's gradients go into (0: the embedding block, held across the
  // whole backward -- the tied head adds first, the embedding last; 1 and 2 rotate for the
  // others, one being filled while the other's reduce-scatter runs).
  GradSlot& grad_slot_of(int block);
  // Issues the reduce-scatter of every released gradient slot.
  void flush_reductions();
  // After the working parameters were written: later gathers read them, and gathered copies
  // are stale.
  void params_changed();
  uint64_t params_version_ = 0;
  // finish_step's AdamW with offload: on the host, the transfers pipelined.
  void offload_step(const AdamWConfig& adam, double lr, int64_t adam_step, float grad_scale);
  // finish_step's AdamW on the device (every block's range in one update).
  void device_step(const AdamWConfig& adam, double lr, int64_t adam_step, float grad_scale);
  // Stages 1-2: every rank's updated range of the full parameters, gathered.
  void gather_updated_params();

  // ---- Parameter offload (sharded_offload.cpp) ----
  // A copy between host and device memory on the communication stream, traced as `name` (of
  // `block`, -1: none) with its bytes.
  void traced_copy(const char* name, int block, void* dst, const void* src, size_t bytes) const;
  // Block `block`'s working parameters (host) into gathered buffer `slot` on the communication
  // stream: the padded block, or at stage 3 this rank's shard, then gathered.
  void bring_params(int block, Tensor slot);
  // A released gradient buffer's sum to the host (on the communication stream): reduced first
  // at stages 2-3 (into the host's shard sum) and at stages 0-1 when `reduce`.
  void send_gradients_down(int block, const Buffer& buffer, bool reduce);
  // Stages 0-1: block's host gradient sum up, reduced, and down again (finish_reduction, for
  // the blocks last_micro_batch() did not have reduced in backward).
  void reduce_offloaded(int block);
  // `host` (host memory, at most a full block) copied into a device buffer, fn(device copy)
  // queued on the communication stream, and the result copied back. Waits for it.
  void on_device_and_back(Tensor host, const std::function<void(Tensor)>& fn);
  // AdamW on the device with the working parameters and gradients on the host: block by block,
  // each range brought up, updated and sent back.
  void offloaded_params_device_step(const AdamWConfig& adam, double lr, int64_t adam_step,
                                    float grad_scale);
  // AdamW on the host with everything on the host: no transfers.
  void offloaded_params_host_step(const AdamWConfig& adam, double lr, int64_t adam_step,
                                  float grad_scale);
  // Stages 1-2: the gather of the updated full parameters, through the device.
  void gather_updated_params_offloaded();
  // A device buffer of at least `bytes` that is free outside backward (a full-block gradient
  // buffer).
  const Buffer& device_staging(size_t bytes) const;
  // The gradient check of one block's buffers, brought to the device first.
  GradientStats offloaded_gradient_stats(const std::vector<GradientTensor>& buffers);
  // The compute stream waits for everything queued on the communication stream so far.
  void compute_waits_for_comm();
  // The communication stream waits for everything queued on the compute stream so far.
  void comm_waits_for_compute();

  Stream compute_;
  OwnedStream comm_stream_;
  OwnedEvent compute_mark_, comm_mark_;  // for the two waits above
  // Recorded on compute after the working parameters were last written (the optimizer step,
  // set_full_params): a gather reads them after it.
  OwnedEvent params_written_;
  GatherSlot gather_slots_[2];
  GradSlot grad_slots_[3];
  // Stages 0-1 after last_micro_batch(): blocks whose backward is queued and whose reduction
  // is not issued yet (at most two: see release_grads), with the event recorded after each
  // backward; and which blocks are reduced already this step.
  bool reduce_in_backward_ = false;
  std::vector<int> replicated_pending_;
  OwnedEvent replicated_filled_[2];
  int next_replicated_event_ = 0;
  std::vector<int> replicated_event_of_;
  std::vector<bool> reduced_in_backward_;
  // Stages 0-1: the reduction of one block's full gradients (all-reduce, or reduce-scatter
  // into this rank's slice), on the communication stream.
  void reduce_replicated(int block);
  // The same on `full`, the block's gradients wherever they are (on the device).
  void reduce_full(int block, Tensor full);
  // The shard a reduce-scatter delivers (stages >= 1).
  Buffer reduced_;
  // Offload: host staging for a range's gradients (down) and updated weights (up), two of
  // each; `down` / `up` are recorded on the communication stream after each copy.
  Buffer host_grads_[2], host_params_[2];
  OwnedEvent down_[2], up_[2];
  Allocator& host_;
  // Host copies of the checkpoint parts when the state lives on the device: [0] master,
  // [1] exp_avg, [2] exp_avg_sq, by block; allocated on first use.
  mutable std::vector<Buffer> part_staging_[3];
};

}  // namespace dstrain
