// GPT-2 forward and backward, block by block, written against Backend. No autograd: each
// layer's backward is explicit, like llm.c, and every buffer is planned up front.
//
// Parameters and gradients are not owned here: a ParamProvider hands out each block's full
// flat parameter buffer and the gradient buffer to accumulate into. With replicated weights
// these are the trainer's own buffers; with ZeRO-3 the provider gathers the block first.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/arena.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/layout.h"

namespace dstrain {

class ParamProvider {
 public:
  virtual ~ParamProvider() = default;
  // The block's full flat parameters (ParamLayout::block_numel elements), valid until
  // release_params(block).
  virtual Tensor acquire_params(int block) = 0;
  virtual void release_params(int block) {}
  // A hint: `block` is the next one whose parameters will be acquired. Called once the work of
  // the block in hand is queued, before it is released, so a provider that gathers (ZeRO-3)
  // can fetch the next block while that work runs.
  virtual void prefetch_params(int block) {}
  // The block's full flat gradient buffer; backward adds (+=) into it.
  virtual Tensor acquire_grads(int block) = 0;
  // Backward has finished adding this micro-batch's gradient of the block.
  virtual void release_grads(int block) {}
};

// Activation checkpointing. Full: each layer keeps only its output (the next layer's input)
// and backward recomputes the layer from its input. Selective: the cheap parts (layernorm
// and GELU outputs) are recomputed, the rest kept. Gradients are bitwise the same either way.
enum class Recompute { None, Selective, Full };
const char* recompute_name(Recompute recompute);
Recompute parse_recompute(const std::string& name);  // "none" | "selective" | "full"

// Ids of one layer's activations in Gpt2Buffers::activations (recomputed ones are shared by
// all layers).
struct Gpt2LayerIds {
  int ln1, ln1_mean, ln1_rstd, qkv, atty, att_lse, residual2, ln2, ln2_mean, ln2_rstd, fch,
      fch_gelu, output;
};

// The memory one Gpt2 instance allocates for a micro-batch of (B, T): the single source of
// truth for activation and workspace bytes (the planner calls this too).
struct Gpt2Buffers {
  ArenaPlan activations;  // kept from forward to backward (MemCategory::Activations)
  ArenaPlan workspace;    // logits, activation gradients, scratch (MemCategory::Workspace)
  Recompute recompute = Recompute::None;
  int encoded = -1, lnf = -1, lnf_mean = -1, lnf_rstd = -1, losses = -1;
  std::vector<Gpt2LayerIds> layers;
  int logits = -1, scratch = -1, dresidual = -1, dbtc = -1, dqkv = -1, dfch = -1, dfch_gelu = -1;
};
Gpt2Buffers plan_gpt2_buffers(const ModelConfig& config, int64_t B, int64_t T, DType act_dtype,
                              bool with_backward, Recompute recompute = Recompute::None);

class Gpt2 {
 public:
  // Allocates activations and workspace for micro-batches of at most (B, T).
  // REQUIRES: T <= config.n_positions.
  Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B, int64_t T,
       DType act_dtype, bool with_backward, Recompute recompute = Recompute::None);

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  int64_t max_batch() const { return B_; }
  int64_t max_seq() const { return T_; }

  // tokens (b,T') I32 with b <= B, T' <= T. With targets (b,T'): computes the per-token losses
  // and returns their mean (fp64 sum in order). With dloss != 0 it also computes the gradient
  // of the logits (weight dloss per token) for a backward() that follows. Without targets it
  // computes logits only and returns 0.
  double forward(ParamProvider& params, Tensor tokens, Tensor targets, float dloss, Stream stream);
  // Backpropagates the last forward (which must have had dloss != 0), adding into the
  // gradients of every block.
  void backward(ParamProvider& params, Tensor tokens, Stream stream);

  // (b, T', Vp) logits of the last forward (after a forward with dloss != 0: their gradient).
  Tensor logits() const;
  // (b, T') per-token losses of the last forward (F32).
  Tensor losses() const;

 private:
  Tensor act(int id, std::initializer_list<int64_t> dims) const;
  Tensor work(int id, std::initializer_list<int64_t> dims) const;
  Tensor layer_input(int layer, int64_t b, int64_t t) const;
  // Runs layer `layer` forward from its input into its activations (also in backward, to
  // recompute what was not kept).
  void layer_forward(int layer, const std::vector<Tensor>& w, int64_t b, int64_t t,
                     Stream stream);

  ModelConfig config_;
  ParamLayout layout_;
  Backend& backend_;
  int64_t B_, T_;
  DType act_dtype_;
  bool with_backward_;
  Gpt2Buffers plan_;
  Buffer activations_, workspace_;
  int64_t last_b_ = 0, last_t_ = 0;
  bool have_dlogits_ = false;
};

// GPT-2 initialization, the same for any layout or sharding: each tensor is drawn from its
// own stream (seed, name). Matrices and embeddings N(0, 0.02), residual projections
// (c_proj) N(0, 0.02/sqrt(2L)), biases 0, layernorm weights 1. block_flats: one F32 host
// tensor of block_numel elements per block; padding and gaps are zeroed.
void init_gpt2_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                          const std::vector<Tensor>& block_flats);

}  // namespace dstrain
