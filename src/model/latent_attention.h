// Multi-head latent attention (DeepSeek-V2/V3; model/parts.h AttentionPart, kind Latent) on one
// rank's heads, from the normed input x (N, C) to the heads' values (N, H dv), the o
// projection's input:
//
//   q      = x W_q^T, or q_b(rmsnorm(x W_qa^T))                  (N, H D), each head [nope | rope]
//   latent = x W_kva[:kr]^T, k_rope = x W_kva[kr:]^T             (N, kr), (N, dr)
//   kv     = rmsnorm(latent) W_kvb^T                             (N, H (dn + dv)), [k nope | v]
//   qkv    = mla_pack(q, kv, k_rope)  (the rope parts rotated, DeepSeek's interleaved pairs;
//            q times the softmax factor; v padded to D)          (b, t, 3 H D)
//   atty   = causal attention of qkv at head dim D               (b, t, H D)
//   values = mla_unpad(atty)                                     (N, H dv)
//
// The latent path (W_qa, W_kva and the two norms) is replicated over the tp ranks, the per-head
// projections (W_q or W_qb, W_kvb) split by heads: a rank's gradients of the replicated tensors
// and of x are its heads' parts, summed over the ranks by the caller. Weights are nn.Linear's
// (out, in).
#pragma once

#include "core/tensor.h"
#include "kernels/ops.h"
#include "model/parts.h"

namespace dstrain {

// The weights (or their gradients) of one layer's latent attention, o aside.
struct LatentWeights {
  Tensor q;                 // (H D, C); empty with a q rank, then:
  Tensor q_a, q_norm, q_b;  // (qr, C), (qr), (H D, qr)
  Tensor kv_a;              // (kr + dr, C): the latent's rows, then the rope key's
  Tensor kv_norm, kv_b;     // (kr), (H (dn + dv), kr)
};

// What forward keeps for backward (N = b t rows). The q path's are empty without a q rank.
struct LatentActivations {
  Tensor q_latent, q_normed, q_rstd;     // (N, qr), (N, qr), (N) F32
  Tensor kv_latent, kv_normed, kv_rstd;  // (N, kr), (N, kr), (N) F32
  Tensor qkv, atty, lse;                 // (b, t, 3 H D), (b, t, H D), (b, H, t) F32
  Tensor values;                         // (N, H dv)
};

// Scratch: forward's (q, kv, k_rope) and backward's (the rest; empty without backward).
struct LatentWorkspace {
  Tensor q, kv, k_rope;           // (N, H D), (N, H (dn + dv)), (N, dr)
  Tensor datty, dqkv;             // (b, t, H D), (b, t, 3 H D)
  Tensor dq_normed, dq_latent;    // (N, qr) each
  Tensor dkv_normed, dkv_latent;  // (N, kr) each
  Tensor dx_part;                 // (N, C): one path's share of dx
};

// The heads of `attn` on a rank holding `heads` of them, as the mla ops take them.
MlaHeads latent_heads(const AttentionPart& attn, int64_t heads);

// Forward into acts (every tensor of it) from x (N, C); freqs (>= t, dr/2, 2) F32; positions
// (b, t) I32 of packed sequences or empty.
void latent_attention_forward(Backend& backend, const AttentionPart& attn, const MlaHeads& heads,
                              const LatentWeights& w, const LatentActivations& acts,
                              const LatentWorkspace& ws, Tensor x, Tensor freqs, Tensor positions,
                              Stream stream);

// The norms of the latent paths again from the kept latents (selective recompute): the same
// bits as forward's.
void latent_attention_recompute(Backend& backend, const AttentionPart& attn, const LatentWeights& w,
                                const LatentActivations& acts, Stream stream);

// Backward from dvalues (N, H dv): every gradient of `grads` accumulated (+=), dx (N, C)
// overwritten with dL/dx (this rank's heads' part under tp).
void latent_attention_backward(Backend& backend, const AttentionPart& attn, const MlaHeads& heads,
                               const LatentWeights& w, const LatentWeights& grads,
                               const LatentActivations& acts, const LatentWorkspace& ws, Tensor x,
                               Tensor dvalues, Tensor dx, Tensor freqs, Tensor positions,
                               Stream stream);

}  // namespace dstrain
