// The parameter layout: every parameter tensor lives in one flat buffer per block, as the
// model's parts (model/parts.h) declare them. GPT-2's:
//   block 0            embeddings: wte (Vp,C), wpe (maxT,C)
//   block 1 + l        transformer layer l: ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
//                      mlp.c_proj (weights in the Hugging Face Conv1D layout (in, out))
//   block L + 1        final layernorm ln_f
//   block L + 2 + j    the routed experts of the j-th mixture-of-experts layer (its router and
//                      shared expert stay in the layer's block): under expert parallelism a
//                      separate block, sharded and reduced over its own group
// A layer's tensors always come in the order norm, qkv, o, norm, up, down (weights before
// biases). Names are the Hugging Face names (GPT-2's without the "transformer." prefix). A
// block is the unit of sharding (ZeRO-3 gathers one block at a time) and of pipeline cuts.
//
// Tensor parallelism (Megatron-LM's splits): ParamLayout(config, tp) is the layout of one tp
// rank's blocks, holding its slices of the split tensors and the whole replicated ones. Every
// tp rank has the same layout (offsets, shapes); which piece of a split tensor it holds is
// its tp rank, which the slice functions below take. tp = 1 is the whole model.
//   wte               (Vp, C)   dim 0: vocabulary rows [r*Vp/tp, (r+1)*Vp/tp)
//   attn.c_attn.w/b   (C, 3C)   dim 1 (dim 0 of the bias) in 3 groups: [q_r | k_r | v_r], the
//                               columns of heads [r*NH/tp, (r+1)*NH/tp) of q, of k and of v
//   attn.c_proj.w     (C, C)    dim 0: the input rows of this rank's heads
//   mlp.c_fc.w/b      (C, 4C)   dim 1 (dim 0 of the bias)
//   mlp.c_proj.w      (4C, C)   dim 0
//   wpe, layernorms, the two c_proj biases: replicated (the same values on every tp rank)
// Latent attention (DeepSeek-V2/V3) splits its per-head projections by heads (q_proj or
// q_b_proj and kv_b_proj by output rows, o_proj by input columns) and replicates its latent
// path (q_a_proj, kv_a_proj_with_mqa and their norms), whose gradients are per-rank parts.
//
// Expert parallelism (--ep): ParamLayout(config, tp, ep, ep_rank) holds the experts
// [ep_rank * E / ep, (ep_rank + 1) * E / ep) of every MoE layer whole; the other experts' specs
// are there with no rows (shape[0] = 0, numel 0), so that every rank's layout lists the same
// tensors in the same order as the whole model's (index i is the same tensor everywhere) and
// the held experts lie at the same offsets on every ep rank.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/parts.h"

namespace dstrain {

// How a fresh parameter starts (init_model_parameters, model/architecture.h): 0 (biases),
// 1 (norm weights), N(0, init_std), or N(0, init_std / sqrt(2 n_layer)) (a scaled residual
// projection).
enum class ParamInit { Zero, One, Normal, ResidualNormal };

struct ParamSpec {
  std::string name;           // "h.0.attn.c_attn.weight"
  int block = 0;
  int64_t offset = 0;         // elements from the start of the block's flat buffer
  std::vector<int64_t> shape; // this tp rank's slice as stored inside dstrain: wte (Vp/tp, C)
  std::vector<int64_t> full_shape;  // the whole tensor inside dstrain (tp = 1): wte (Vp, C)
  std::vector<int64_t> file_shape;  // the whole tensor in model.safetensors: wte (V, C)
  bool weight_decay = false;  // matrices and embeddings decay; biases and norms do not
  // How the tensor splits over tp ranks. tp_dim -1: replicated (every tp rank holds all of it,
  // the same values). Else dim tp_dim of full_shape is tp_parts equal groups (q, k, v: 3),
  // each cut into tp equal pieces; rank r holds piece r of every group, in group order. The
  // split is described at tp = 1 too (one piece: the whole tensor).
  int tp_dim = -1;
  int tp_parts = 1;
  // A replicated tensor inside the sequence-parallel region (the layernorms): under sequence
  // parallelism each tp rank's gradient covers its own token rows, a part of the gradient that
  // is summed over the tp group.
  bool tp_partial_grad = false;
  // A replicated tensor whose gradient is each tp rank's part under any tensor parallelism
  // (latent attention's latent path: each rank backpropagates its own heads), summed over the
  // tp group the same way.
  bool tp_summed_grad = false;
  // Whether tp rank gradients of this tensor are parts, summed over the tp group.
  bool tp_grad_parts(bool sequence_parallel) const {
    return tp_summed_grad || (sequence_parallel && tp_partial_grad);
  }
  ParamInit init = ParamInit::Normal;

  // A routed expert's tensor (ParamLayout::expert_block): whole on the ep rank that holds it,
  // without rows on the others.
  bool expert = false;

  int64_t numel() const;       // of the slice
  int64_t full_numel() const;  // of the whole tensor
  int64_t file_numel() const;  // of the whole file tensor: the leading elements files hold
  // The leading elements of tp rank `tp_rank`'s slice that files hold: all of it, except wte's
  // padded vocabulary rows (which lie at the end of the last ranks' slices). file_numel() at
  // tp = 1. Use it, not file_numel(), to bound a slice's real rows.
  int64_t slice_file_numel(int tp_rank) const;
};

class ParamLayout {
 public:
  // One tp rank's layout, holding ep rank ep_rank's experts. tp = ep = 1: the whole model.
  // Throws UserError (tp_unsupported_reason, ep_unsupported_reason) when the model does not
  // split so.
  explicit ParamLayout(const ModelConfig& config, int tp = 1, int ep = 1, int ep_rank = 0);

  int tp() const { return tp_; }
  int ep() const { return ep_; }
  int ep_rank() const { return ep_rank_; }
  // Whether this is the whole model's layout (what files hold).
  bool whole() const { return tp_ == 1 && ep_ == 1; }
  // Whether the LM head is the embedding (GPT-2; tie_word_embeddings) or its own tensor,
  // lm_head.weight in the final block.
  bool tied_embedding() const { return tied_embedding_; }

  int num_blocks() const { return static_cast<int>(block_numel_.size()); }
  int64_t block_numel(int block) const { return block_numel_.at(block); }
  int64_t total_numel() const;  // with alignment gaps and vocabulary padding
  const std::vector<ParamSpec>& params() const { return params_; }
  // Indices into params() of the tensors of one block, in buffer order.
  const std::vector<int>& block_params(int block) const { return block_params_.at(block); }
  // REQUIRES: the name exists (throws otherwise).
  const ParamSpec& find(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }

  static int embedding_block() { return 0; }
  static int layer_block(int layer) { return 1 + layer; }
  int final_block() const { return 1 + layers_; }
  // The block of layer `layer`'s routed experts, -1 for a dense layer.
  int expert_block(int layer) const { return expert_blocks_.at(static_cast<size_t>(layer)); }
  // The layer whose experts block `block` holds, -1 for any other block.
  int expert_layer(int block) const;
  // Rows of the experts of a MoE layer this rank holds: E / ep, from expert ep_rank * E / ep.
  int64_t local_experts() const { return local_experts_; }
  int64_t first_local_expert() const { return ep_rank_ * local_experts_; }
  // Whether `name` is a tensor of the layers a checkpoint holds after the model's and dstrain
  // does not train: DeepSeek-V3's multi-token prediction layers (ModelConfig::mtp_layers),
  // "model.layers.<n_layer + i>.*".
  bool is_skipped_layer_tensor(const std::string& name) const;

  // A view of one parameter inside its block's flat buffer (dtype of the buffer).
  static Tensor view(const ParamSpec& spec, Tensor block_flat);
  // Views of every tensor of block b inside its flat buffer, in buffer order (none for an
  // empty buffer: a block whose gradients are not asked for).
  std::vector<Tensor> block_views(int block, Tensor block_flat) const;

  class Builder;

 private:
  int tp_ = 1, ep_ = 1, ep_rank_ = 0;
  int layers_ = 0;
  int64_t skipped_layers_ = 0;
  std::string layer_prefix_;
  int64_t local_experts_ = 0;
  std::vector<int> expert_blocks_;  // by layer
  bool tied_embedding_ = true;
  std::vector<ParamSpec> params_;
  std::vector<int64_t> block_numel_;
  std::vector<std::vector<int>> block_params_;
  std::unordered_map<std::string, int> index_;
};

// Why `config` cannot be split over `tp` tensor-parallel ranks, as one sentence naming the
// numbers ("tensor parallelism over 3 ranks needs n_head (12) divisible by 3"), or "" when it
// can. Never throws: the planner skips such tp values, the CLI reports them.
std::string tp_unsupported_reason(const ModelConfig& config, int tp);
// The same for expert parallelism over `ep` ranks ("" when it can).
std::string ep_unsupported_reason(const ModelConfig& config, int ep);

// How a tp rank's slice of a split tensor lies in the whole tensor. Seen as (outer, D, inner)
// around the split dim, the slice is outer * tp_parts runs of run_length = (D / (tp_parts *
// tp)) * inner contiguous elements; local run k is run k * tp + tp_rank of the whole tensor
// (the full tensor's runs go rank by rank within each group). Replicated tensors (and every
// tensor at tp = 1) are one run: tp == 1, local index == full index.
struct TpSliceRuns {
  int64_t run_length = 0;
  int64_t tp = 1;
};
TpSliceRuns tp_slice_runs(const ParamSpec& spec);

// Calls fn(local_index, full_index, count) for the contiguous runs covering elements
// [first, last) of tp rank `tp_rank`'s slice (indices in the slice's and in the whole
// tensor's row-major order), in increasing order.
// REQUIRES: 0 <= first <= last <= spec.numel(), 0 <= tp_rank < tp (any rank for a replicated
// tensor).
template <typename Fn>
void for_each_tp_run(const ParamSpec& spec, int tp_rank, int64_t first, int64_t last, Fn&& fn) {
  DSTRAIN_CHECK(0 <= first && first <= last && last <= spec.numel())
      << spec.name << ": [" << first << ", " << last << ") of " << spec.numel();
  const TpSliceRuns runs = tp_slice_runs(spec);
  // Any tp rank holds all of a replicated tensor.
  DSTRAIN_CHECK(0 <= tp_rank && (spec.tp_dim < 0 || tp_rank < runs.tp))
      << spec.name << ": tp rank " << tp_rank << " of " << runs.tp;
  if (runs.tp == 1) {
    if (first < last) fn(first, first, last - first);
    return;
  }
  for (int64_t local = first; local < last;) {
    const int64_t run = local / runs.run_length, within = local - run * runs.run_length;
    const int64_t count = std::min(last - local, runs.run_length - within);
    fn(local, (run * runs.tp + tp_rank) * runs.run_length + within, count);
    local += count;
  }
}

// Copies tp rank `tp_rank`'s slice out of the whole tensor, and back in.
// full: (spec.full_shape), slice: (spec.shape).
void extract_tp_slice(const ParamSpec& spec, int tp_rank, const float* full, float* slice);
void insert_tp_slice(const ParamSpec& spec, int tp_rank, const float* slice, float* full);

}  // namespace dstrain
