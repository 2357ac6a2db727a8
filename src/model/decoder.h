// The decoder: one Architecture (model/architecture.h) for every model, its blocks assembled
// from the parts the configuration chooses (model/parts.h). A layer is
//
//   norm1 -> qkv projection -> [rotary] -> causal attention -> o projection -> + residual
//            (or multi-head latent attention, model/latent_attention.h, before o)
//   -> norm2 -> up projection -> GELU | SwiGLU -> down projection -> + residual
//            (or the mixture of experts of model/moe_mlp.h, in every layer or in some)
//
// the embedding [+ a learned position table] before the first layer, the final norm and the
// LM head (tied to the embedding or its own matrix) with the cross-entropy after the last. GPT-2
// is the parts LayerNorm, learned positions, GELU, tied; the LLaMA family RMSNorm, rotary,
// SwiGLU, tied or not. No autograd: each layer's backward is explicit, like llm.c, and every
// buffer is planned up front.
//
// Tensor parallelism, Megatron's splits: the attention by heads (the qkv projection
// column-parallel, q and k/v heads split evenly, o row-parallel), the MLP (up column-parallel,
// down row-parallel), the embedding and the head vocabulary-parallel with a vocabulary-parallel
// cross-entropy (no rank holds the whole (N, V) logits); row-parallel biases are added once,
// after the reduction.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "model/architecture.h"
#include "model/config.h"
#include "model/fp8_linear.h"
#include "model/latent_attention.h"
#include "model/layout.h"
#include "model/moe_mlp.h"
#include "model/parts.h"
#include "model/rotary.h"

namespace dstrain {

class Decoder final : public Architecture {
 public:
  // REQUIRES: the model splits over tp.size ranks (UserError otherwise). fp8: the projections
  // of attention and of the dense MLPs in FP8 (model/fp8_linear.h), with their scratch in the
  // layers' workspace, and with fp8.cache_weights their FP8 weights in layer_weight_cache().
  explicit Decoder(const ModelConfig& config, const TensorParallel& tp = {},
                   const ExpertParallel& ep = {}, Fp8Options fp8 = {});

  const ModelConfig& config() const override { return config_; }
  const DecoderParts& parts() const { return parts_; }
  const ParamLayout& layout() const override { return layout_; }
  const TensorParallel& tensor_parallel() const override { return tp_; }
  std::vector<ActivationSpec> layer_activations(int layer, int64_t B, int64_t T, DType dtype,
                                                Recompute recompute) const override;
  std::vector<TensorSpec> layer_workspace(int64_t B, int64_t T, DType dtype,
                                          bool with_backward) const override;
  std::vector<TensorSpec> head_workspace(int64_t B, int64_t T, DType dtype,
                                         bool with_backward) const override;
  // With cached FP8 weights: each FP8 linear's weight (out, in) and (in, out) in E4M3, then
  // their scale_invs (F32, one per Fp8Linear).
  std::vector<TensorSpec> layer_weight_cache(int layer) const override;
  void embed_forward(ParamProvider& params, const EmbedRun& run, int next) const override;
  void embed_backward(ParamProvider& params, const EmbedRun& run) const override;
  void layer_forward(const LayerRun& run) const override;
  void layer_recompute(const LayerRun& run, Recompute recompute) const override;
  void layer_backward(const LayerRun& run) const override;
  double head_forward(ParamProvider& params, const HeadRun& run, bool release_grads,
                      int next) const override;
  int head_first_block() const override { return layout_.final_block(); }
  Tensor head_logits(const std::vector<Tensor>& workspace, int64_t b, int64_t t) const override;

  // Where a layer's tensors are in its block (LayerRun::weights), -1 where the parts have none.
  // A packed group (q|k|v, gate|up) by its first tensor.
  struct LayerTensors {
    int norm1 = -1, norm1_bias = -1, qkv = -1, qkv_bias = -1, o = -1, o_bias = -1;
    int norm2 = -1, norm2_bias = -1, up = -1, up_bias = -1, down = -1, down_bias = -1;
    int router = -1;  // MoE: the router; up and down then the first held expert's, in the
                      // experts' block (LayerRun::expert_weights)
    int shared_up = -1, shared_down = -1, shared_gate = -1;  // MoE: the shared expert's
    int router_bias = -1;                                    // MoE: the selection bias
    // Latent attention (qkv then -1): q, or q_a, q_norm, q_b; kv_a, kv_norm, kv_b.
    int q = -1, q_a = -1, q_norm = -1, q_b = -1, kv_a = -1, kv_norm = -1, kv_b = -1;
  };
  // Where a layer's activations are in LayerRun::activations (-1: the parts keep none).
  struct LayerActivations {
    int norm1 = -1, norm1_mean = -1, norm1_rstd = -1, qkv = -1, atty = -1, lse = -1;
    int residual2 = -1, norm2 = -1, norm2_mean = -1, norm2_rstd = -1, up = -1, act = -1;
    MoeActivationIndex moe;  // MoE only
    // Latent attention only (model/latent_attention.h LatentActivations); the q path's with a
    // q rank only.
    int q_latent = -1, q_normed = -1, q_rstd = -1, kv_latent = -1, kv_normed = -1, kv_rstd = -1;
    int values = -1;
    // --precision fp8 only: each FP8 linear's input amax (F32, by Fp8Linear), from its forward
    // to its backward (Fp8Scratch::input_amax).
    int fp8_input_amax = -1;
  };
  // Where the parts' buffers are in LayerRun::workspace, after the decoder's own
  // (decoder_internal.h LayerWork).
  struct LayerWorkspace {
    MoeWorkspaceIndex moe;  // MoE only
    // MoE only: the experts' input gathered again in backward (sequence parallelism), the
    // router's selection bias in F32 (16-bit parameters).
    int moe_gathered = -1, router_bias_f32 = -1;
    // Latent attention only (model/latent_attention.h LatentWorkspace; its dqkv is kDqkv), and
    // the o projection's input gradient.
    int mla_q = -1, mla_kv = -1, mla_k_rope = -1, mla_datty = -1, mla_dq_normed = -1;
    int mla_dq_latent = -1, mla_dkv_normed = -1, mla_dkv_latent = -1, mla_dx_part = -1;
    int mla_dvalues = -1;
    // --precision fp8 only: the FP8 operands of one GEMM and their scale_invs (Fp8Scratch).
    int fp8_bytes = -1, fp8_scales = -1;
  };
  // Where the head's buffers are in HeadRun::workspace.
  struct HeadBuffers {
    int logits = -1, norm = -1, norm_mean = -1, norm_rstd = -1, losses = -1, dnorm = -1;
    int norm_gathered = -1, dnorm_part = -1, ce_stats = -1, ce_stats_all = -1;
  };

 private:
  struct Widths {
    // This tp rank's: heads, the attention ops' qkv width and the o projection's input width
    // (the heads' values), the attention ops' output width (the same but for latent attention,
    // whose v heads are padded to the qk head dim).
    int64_t heads, kv_heads, qkv, attn, atty;
  };
  Widths widths() const;
  // Layers come in two kinds: 0, with the parts' MLP; 1, the dense layers among MoE layers.
  int layer_kind(int layer) const;
  const MlpPart& kind_mlp(int kind) const;
  int64_t mlp_width(int kind) const;  // this tp rank's hidden width of the kind's MLP
  // This tp rank's stream rows of a (N, C) tensor every rank holds whole: its 1/tp under
  // sequence parallelism, else all of it.
  Tensor own_rows(Tensor full) const;
  LayerActivations layer_activation_specs(int kind, int64_t B, int64_t T, DType dtype,
                                          Recompute recompute,
                                          std::vector<ActivationSpec>* specs) const;
  LayerWorkspace layer_workspace_specs(int64_t B, int64_t T, DType dtype, bool with_backward,
                                       std::vector<TensorSpec>* specs) const;
  // Latent attention's buffers appended to `specs` (N rows; Nb of the gradients), their
  // indices into `w`.
  void add_latent_workspace(int64_t N, int64_t Nb, DType dtype, LayerWorkspace& w,
                            std::vector<TensorSpec>& specs) const;
  HeadBuffers head_buffer_specs(int64_t B, int64_t T, DType dtype, bool with_backward,
                                std::vector<TensorSpec>* specs) const;
  // The FP8 scratch's bytes for the layers' linears over N tokens (0 without fp8).
  int64_t fp8_scratch_bytes_of(int64_t N, bool with_backward) const;
  // The linears of a layer that may run in FP8, and their (in, out) widths on this tp rank in
  // layer `layer`: {0, 0} where it does not (latent attention's qkv, a MoE layer's MLP).
  enum Fp8Linear { kFp8Qkv, kFp8O, kFp8Up, kFp8Down, kFp8Linears };
  struct LinearWidths {
    int64_t in = 0, out = 0;
  };
  std::array<LinearWidths, kFp8Linears> fp8_linear_widths(int layer) const;
  // The scratch (empty without fp8) and, with cached weights, linear `which`'s cached weight.
  Fp8Scratch fp8_scratch(const LayerRun& run, Fp8Linear which) const;
  Tensor rope_freqs(const LayerRun& run) const;
  Tensor matrix(const std::vector<Tensor>& tensors, int index, int64_t out_width) const;
  Tensor row_parallel(const LayerRun& run, Fp8Linear which, Tensor inp, Tensor weight,
                      Tensor bias) const;
  Tensor mlp_forward(const LayerRun& run, Tensor norm2_full) const;
  // The attention part from the (gathered) norm1 to the o projection's input (N, attn).
  Tensor attention_part_forward(const LayerRun& run, Tensor norm1_full) const;
  // Its backward from dL/d(that input) to dL/d(norm1) (N, C) in the kDnorm workspace.
  Tensor attention_part_backward(const LayerRun& run, Tensor dvalues, Tensor norm1_full) const;
  LatentWeights latent_weights(const std::vector<Tensor>& tensors, int kind) const;
  LatentActivations latent_activations(const LayerRun& run) const;
  LatentWorkspace latent_workspace(const LayerRun& run) const;
  Tensor latent_dvalues(const LayerRun& run) const;  // (N, attn): dL/d(the o projection's input)
  // The MoE weights of a layer for the routing ops: the selection bias in F32 (a copy in the
  // workspace where the parameters are 16-bit).
  MoeWeights routed_moe_weights(const LayerRun& run, const std::vector<Tensor>& tensors,
                                const std::vector<Tensor>& experts) const;
  void attention_backward(const LayerRun& run, Tensor dout) const;
  void mlp_backward(const LayerRun& run, Tensor dout) const;
  Tensor dense_mlp_backward(const LayerRun& run, Tensor dout) const;
  Tensor moe_backward(const LayerRun& run, Tensor dout) const;
  MoeShape moe_shape_of(int64_t tokens) const;       // this rank's, for `tokens` tokens
  int64_t mlp_rows(int kind, int64_t tokens) const;  // the rows a kind's MLP activations hold
  MoeWeights moe_weights(const std::vector<Tensor>& tensors,
                         const std::vector<Tensor>& experts) const;
  MoeActivations moe_activations(const LayerRun& run) const;
  MoeWorkspace moe_workspace(const LayerRun& run) const;
  void head_backward(ParamProvider& params, const HeadRun& run, Tensor head, Tensor norm_full,
                     std::vector<Tensor> final_weights, bool release_grads, int next) const;
  Tensor sequence_parallel_view(Tensor full, int64_t rows) const;
  Tensor stream_part(const LayerRun& run) const;  // (stream rows, C) of the workspace
  Tensor gathered(const LayerRun& run) const;     // (N, C) of the workspace
  int64_t vocab_begin() const;                    // this rank's first vocabulary row
  int head_block() const;                         // the block holding the head's matrix

  ModelConfig config_;
  DecoderParts parts_;
  TensorParallel tp_;
  ExpertParallel ep_;
  bool fp8_ = false, fp8_cache_ = false, fp8_found_amax_ = false;
  ParamLayout layout_;
  LayerTensors tensors_[2];          // by layer kind
  LayerActivations activations_[2];  // by layer kind
  LayerWorkspace workspace_;
  HeadBuffers head_buffers_;
  RotaryTables rotary_;
};

}  // namespace dstrain
