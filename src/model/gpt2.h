// GPT-2: pre-LN blocks, tanh GELU, learned positions, the LM head tied to wte. No autograd:
// each layer's backward is explicit, like llm.c, and every buffer is planned up front.
//
// Gpt2Architecture is GPT-2 as an Architecture (model/architecture.h), run by ModelStage
// (model/stage.h) on any range of layers. Gpt2 is the whole model as one stage with one
// micro-batch slot: what sampling, the benchmarks and the model tests use.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/allocator.h"
#include "kernels/ops.h"
#include "model/architecture.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/param_provider.h"
#include "model/stage.h"

namespace dstrain {

// Under tensor parallelism (model/tensor_parallel.h), Megatron's splits: the attention heads
// (the fused [q|k|v] projection column-parallel by head, the output projection row-parallel),
// the MLP (up-projection column-parallel, down-projection row-parallel), the tied embedding
// and head vocabulary-parallel with a vocabulary-parallel cross-entropy (no rank holds the
// whole (N, V) logits); the row-parallel biases are added once, after the reduction.
class Gpt2Architecture final : public Architecture {
 public:
  // REQUIRES: the model splits over tp.size ranks (UserError otherwise).
  explicit Gpt2Architecture(const ModelConfig& config, const TensorParallel& tp = {});

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  const TensorParallel& tensor_parallel() const override { return tp_; }
  std::vector<ActivationSpec> layer_activations(int64_t B, int64_t T, DType dtype,
                                                Recompute recompute) const override;
  std::vector<TensorSpec> layer_workspace(int64_t B, int64_t T, DType dtype,
                                          bool with_backward) const override;
  std::vector<TensorSpec> head_workspace(int64_t B, int64_t T, DType dtype,
                                         bool with_backward) const override;
  void embed_forward(ParamProvider& params, const EmbedRun& run, int next) const override;
  void embed_backward(ParamProvider& params, const EmbedRun& run) const override;
  void layer_forward(const LayerRun& run) const override;
  void layer_recompute(const LayerRun& run, Recompute recompute) const override;
  void layer_backward(const LayerRun& run) const override;
  double head_forward(ParamProvider& params, const HeadRun& run, bool release_grads,
                      int next) const override;
  int head_first_block() const override { return layout_.final_block(); }
  Tensor head_logits(const std::vector<Tensor>& workspace, int64_t b, int64_t t) const override;

 private:
  void head_backward(ParamProvider& params, const HeadRun& run, Tensor wte, Tensor lnf_full,
                     bool release_grads, int next) const;
  void cross_entropy(const HeadRun& run, Tensor logits) const;
  Tensor row_parallel_forward(const LayerRun& run, Tensor inp, Tensor weight, Tensor bias) const;
  Tensor sequence_parallel_view(Tensor full, int64_t rows) const;
  Tensor stream_part(const LayerRun& run) const;  // (stream rows, C) of the workspace
  Tensor gathered(const LayerRun& run) const;     // (N, C) of the workspace
  int64_t heads() const;                          // this rank's attention heads
  int64_t vocab_begin() const;                    // this rank's first vocabulary row

  ModelConfig config_;
  TensorParallel tp_;
  ParamLayout layout_;
};

// The whole model: one stage of every layer, one micro-batch slot.
class Gpt2 {
 public:
  // Allocates activations and workspace for micro-batches of at most (B, T).
  // REQUIRES: T <= config.n_positions.
  Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B, int64_t T,
       DType act_dtype, bool with_backward, Recompute recompute = Recompute::None);

  const ModelConfig& config() const { return arch_.config(); }
  const ParamLayout& layout() const { return arch_.layout(); }
  int64_t max_batch() const { return stage_.max_batch(); }
  int64_t max_seq() const { return stage_.max_seq(); }

  // tokens (b,T') I32 with b <= B, T' <= T. With targets (b,T'): computes the per-token losses
  // and returns their mean (fp64 sum in order). With dloss != 0 it also computes the gradient
  // of the logits (weight dloss per token) and backpropagates it through the head for a
  // backward() that follows. Without targets it computes logits only and returns 0.
  double forward(ParamProvider& params, Tensor tokens, Tensor targets, float dloss, Stream stream);
  // Backpropagates the last forward (which must have had dloss != 0), adding into the
  // gradients of every block.
  void backward(ParamProvider& params, Tensor tokens, Stream stream);

  // (b, T', Vp) logits of the last forward (after a forward with dloss != 0: their gradient).
  Tensor logits() const { return stage_.logits(); }

 private:
  Gpt2Architecture arch_;
  ModelStage stage_;
};

// GPT-2 initialization, the same for any layout or sharding: each tensor is drawn from its
// own stream (seed, name). Matrices and embeddings N(0, 0.02), residual projections
// (c_proj) N(0, 0.02/sqrt(2L)), biases 0, layernorm weights 1. block_flats: one F32 host
// tensor of block_numel elements per block; padding and gaps are zeroed.
void init_gpt2_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                          const std::vector<Tensor>& block_flats);

}  // namespace dstrain
