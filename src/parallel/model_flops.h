// Floating-point work of a model per token (PaLM's model-FLOPs convention, Chowdhery et
// al. 2022, appendix B: 2 FLOPs per multiply-add, attention counted without the causal
// halving). Used by the cost model and by the pipeline split's balance. What the attention
// kernels execute instead (the causal halving, the recomputed products): kernel_work.h.
#pragma once

#include <algorithm>
#include <cstdint>

#include "model/config.h"
#include "model/parts.h"

namespace dstrain {

struct ModelFlops {
  // One layer's GEMMs: 2 C (q + 2 kv) for the qkv projection, 2 C q for the output projection,
  // the MLP's matrices (GPT-2: 2 x 2 C I; SwiGLU: 3 x 2 C I; MoE: k x 3 x 2 C I + the router's
  // 2 C E: the active experts only). GPT-2 (q = kv = C, I = 4 C): 24 C^2.
  double layer_gemm_forward = 0;
  double attention_forward = 0;  // 4 T q: the attention scores and their product with v
  double layer_forward = 0;      // the two above: GPT-2 24 C^2 + 4 T C
  double head_forward = 0;       // the LM head: 2 C Vp
  // The part of layer_gemm_forward --precision fp8 runs on FP8 tensor cores (model/fp8_linear.h):
  // multi-head attention's qkv and o projections, latent attention's o projection (not its
  // latent path), the dense MLPs' matrices (not the experts'), the mean over the layers.
  double layer_fp8_gemm_forward = 0;
};

// One layer's MLP GEMMs per token: the up projection's matrices (GELU: 1; SwiGLU: gate and up)
// and the down projection, for each of a token's top_k experts under MoE, plus the router's
// (C, E) and a shared expert's.
inline double mlp_gemm_forward(const MlpPart& mlp, double C) {
  const double I = static_cast<double>(mlp.width);
  const double matrices = static_cast<double>(mlp.up_factor() + 1) *
                          static_cast<double>(mlp.rows_per_token());
  double flops = matrices * 2 * C * I;
  if (mlp.kind == MlpKind::MoE) {
    flops += 2 * C * static_cast<double>(mlp.experts) +
             3 * 2 * C * static_cast<double>(mlp.shared_width) + (mlp.shared_width > 0 ? 2 * C : 0);
  }
  return flops;
}

// One layer's attention GEMMs per token: the qkv and o projections (2 C (q + 2 kv) + 2 C q), or
// latent attention's q (or q_a and q_b), kv_a, kv_b and o.
inline double attention_gemm_forward(const AttentionPart& a, double C) {
  const double q = static_cast<double>(a.q_width()), kv = static_cast<double>(a.kv_width());
  if (!a.latent()) return 2 * C * (q + 2 * kv) + 2 * C * q;
  const double q_rank = static_cast<double>(a.q_rank), kv_rank = static_cast<double>(a.kv_rank);
  const double q_path = a.q_rank > 0 ? 2 * C * q_rank + 2 * q_rank * q : 2 * C * q;
  return q_path + 2 * C * (kv_rank + static_cast<double>(a.rope_dim)) +
         2 * kv_rank * static_cast<double>(a.kv_latent_width()) +
         2 * static_cast<double>(a.out_width()) * C;
}

// The part of attention_gemm_forward every tp rank runs whole, on all of the micro-batch's rows:
// latent attention's replicated latent path (q_a, kv_a); 0 for multi-head attention.
inline double attention_replicated_gemm_forward(const AttentionPart& a, double C) {
  if (!a.latent()) return 0;
  return 2 * C * static_cast<double>(a.q_rank + a.kv_rank + a.rope_dim);
}

// The attention's scores and their product with v per token (4 T q; latent attention's v heads
// are narrower: 2 T (q + the values)).
inline double attention_forward_flops(const AttentionPart& a, double T) {
  const double q = static_cast<double>(a.q_width());
  return a.latent() ? 2 * T * (q + static_cast<double>(a.out_width())) : 4 * T * q;
}

inline ModelFlops model_flops(const ModelConfig& config, int64_t seq_len) {
  const DecoderParts parts = decoder_parts(config);
  const double C = static_cast<double>(parts.width), T = static_cast<double>(seq_len);
  // The mean over the layers where they differ (dense layers among MoE layers).
  double mlp = mlp_gemm_forward(parts.mlp, C);
  if (parts.mixed_layers()) {
    mlp = 0;
    for (int64_t layer = 0; layer < parts.layers; ++layer) {
      mlp += mlp_gemm_forward(parts.layer_mlp(layer), C);
    }
    mlp /= static_cast<double>(parts.layers);
  }
  double dense_mlp = 0;  // the mean over the layers of the dense MLPs' GEMMs
  for (int64_t layer = 0; layer < parts.layers; ++layer) {
    const MlpPart& part = parts.layer_mlp(layer);
    if (part.kind != MlpKind::MoE) dense_mlp += mlp_gemm_forward(part, C);
  }
  dense_mlp /= static_cast<double>(std::max<int64_t>(parts.layers, 1));
  ModelFlops f;
  f.layer_gemm_forward = attention_gemm_forward(parts.attention, C) + mlp;
  const double o_projection = 2 * static_cast<double>(parts.attention.out_width()) * C;
  f.layer_fp8_gemm_forward =
      (parts.attention.latent() ? o_projection : attention_gemm_forward(parts.attention, C)) +
      dense_mlp;
  f.attention_forward = attention_forward_flops(parts.attention, T);
  f.layer_forward = f.layer_gemm_forward + f.attention_forward;
  f.head_forward = 2 * C * static_cast<double>(config.padded_vocab());
  return f;
}

// Layer `layer`'s forward FLOPs per token: its own MLP's (a dense layer among MoE layers differs
// from the mean model_flops gives).
inline double layer_forward_flops(const ModelConfig& config, int64_t seq_len, int64_t layer) {
  const DecoderParts parts = decoder_parts(config);
  const double C = static_cast<double>(parts.width), T = static_cast<double>(seq_len);
  return attention_gemm_forward(parts.attention, C) + mlp_gemm_forward(parts.layer_mlp(layer), C) +
         attention_forward_flops(parts.attention, T);
}

// Model FLOPs of training on one token (forward and backward, the backward twice the forward;
// recomputation not counted, as MFU's definition wants): 3 (n_layer layer_forward + head).
inline double training_flops_per_token(const ModelConfig& config, int64_t seq_len) {
  const ModelFlops f = model_flops(config, seq_len);
  return 3.0 * (static_cast<double>(config.n_layer) * f.layer_forward + f.head_forward);
}

}  // namespace dstrain
