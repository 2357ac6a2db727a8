#include "model/latent_attention.h"

namespace dstrain {

namespace {

// kv_a's rows: the latent's (kr, C) and the rope key's (dr, C).
Tensor latent_rows(const AttentionPart& attn, Tensor kv_a) {
  return kv_a.slice(0, {attn.kv_rank, kv_a.size(1)});
}
Tensor rope_key_rows(const AttentionPart& attn, Tensor kv_a) {
  return kv_a.slice(attn.kv_rank * kv_a.size(1), {attn.rope_dim, kv_a.size(1)});
}

}  // namespace

MlaHeads latent_heads(const AttentionPart& attn, int64_t heads) {
  return MlaHeads{static_cast<int>(heads),
                  static_cast<int>(attn.nope_dim),
                  static_cast<int>(attn.rope_dim),
                  static_cast<int>(attn.v_dim),
                  attn.q_scale,
                  /*interleaved=*/true};
}

void latent_attention_forward(Backend& backend, const AttentionPart& attn, const MlaHeads& heads,
                              const LatentWeights& w, const LatentActivations& acts,
                              const LatentWorkspace& ws, Tensor x, Tensor freqs, Tensor positions,
                              Stream stream) {
  const int64_t b = acts.qkv.size(0), t = acts.qkv.size(1);
  if (attn.q_rank == 0) {
    backend.matmul_forward(ws.q, x, w.q, Tensor(), true, stream);
  } else {
    backend.matmul_forward(acts.q_latent, x, w.q_a, Tensor(), true, stream);
    backend.rmsnorm_forward(acts.q_normed, acts.q_rstd, acts.q_latent, w.q_norm, attn.latent_eps,
                            stream);
    backend.matmul_forward(ws.q, acts.q_normed, w.q_b, Tensor(), true, stream);
  }
  backend.matmul_forward(acts.kv_latent, x, latent_rows(attn, w.kv_a), Tensor(), true, stream);
  backend.matmul_forward(ws.k_rope, x, rope_key_rows(attn, w.kv_a), Tensor(), true, stream);
  backend.rmsnorm_forward(acts.kv_normed, acts.kv_rstd, acts.kv_latent, w.kv_norm, attn.latent_eps,
                          stream);
  backend.matmul_forward(ws.kv, acts.kv_normed, w.kv_b, Tensor(), true, stream);
  const auto rows = [&](Tensor flat) { return flat.reshape({b, t, flat.size(1)}); };
  backend.mla_pack(acts.qkv, rows(ws.q), rows(ws.kv), rows(ws.k_rope), freqs, positions, heads,
                   stream);
  backend.attention_forward(acts.atty, acts.lse, acts.qkv, positions, heads.heads, heads.heads,
                            stream);
  backend.mla_unpad(rows(acts.values), acts.atty, heads, stream);
}

void latent_attention_recompute(Backend& backend, const AttentionPart& attn, const LatentWeights& w,
                                const LatentActivations& acts, Stream stream) {
  if (attn.q_rank > 0) {
    backend.rmsnorm_forward(acts.q_normed, acts.q_rstd, acts.q_latent, w.q_norm, attn.latent_eps,
                            stream);
  }
  backend.rmsnorm_forward(acts.kv_normed, acts.kv_rstd, acts.kv_latent, w.kv_norm, attn.latent_eps,
                          stream);
}

void latent_attention_backward(Backend& backend, const AttentionPart& attn, const MlaHeads& heads,
                               const LatentWeights& w, const LatentWeights& grads,
                               const LatentActivations& acts, const LatentWorkspace& ws, Tensor x,
                               Tensor dvalues, Tensor dx, Tensor freqs, Tensor positions,
                               Stream stream) {
  const int64_t b = acts.qkv.size(0), t = acts.qkv.size(1);
  const auto rows = [&](Tensor flat) { return flat.reshape({b, t, flat.size(1)}); };
  backend.mla_unpad_backward(ws.datty, rows(dvalues), heads, stream);
  backend.attention_backward(ws.dqkv, ws.datty, acts.qkv, acts.atty, acts.lse, positions,
                             heads.heads, heads.heads, stream);
  // The pack's input gradients land in forward's q, kv and k_rope buffers (free in backward).
  backend.mla_pack_backward(rows(ws.q), rows(ws.kv), rows(ws.k_rope), ws.dqkv, freqs, positions,
                            heads, stream);
  // The kv path: kv_b, the latent's norm, then kv_a's two row blocks.
  backend.matmul_backward(ws.dkv_normed, grads.kv_b, Tensor(), ws.kv, acts.kv_normed, w.kv_b, true,
                          stream);
  backend.fill_zero(ws.dkv_latent, stream);
  backend.rmsnorm_backward(ws.dkv_latent, grads.kv_norm, ws.dkv_normed, acts.kv_latent, w.kv_norm,
                           acts.kv_rstd, stream);
  backend.matmul_backward(dx, latent_rows(attn, grads.kv_a), Tensor(), ws.dkv_latent, x,
                          latent_rows(attn, w.kv_a), true, stream);
  backend.matmul_backward(ws.dx_part, rope_key_rows(attn, grads.kv_a), Tensor(), ws.k_rope, x,
                          rope_key_rows(attn, w.kv_a), true, stream);
  backend.accumulate(dx, ws.dx_part, stream);
  // The q path.
  if (attn.q_rank == 0) {
    backend.matmul_backward(ws.dx_part, grads.q, Tensor(), ws.q, x, w.q, true, stream);
  } else {
    backend.matmul_backward(ws.dq_normed, grads.q_b, Tensor(), ws.q, acts.q_normed, w.q_b, true,
                            stream);
    backend.fill_zero(ws.dq_latent, stream);
    backend.rmsnorm_backward(ws.dq_latent, grads.q_norm, ws.dq_normed, acts.q_latent, w.q_norm,
                             acts.q_rstd, stream);
    backend.matmul_backward(ws.dx_part, grads.q_a, Tensor(), ws.dq_latent, x, w.q_a, true, stream);
  }
  backend.accumulate(dx, ws.dx_part, stream);
}

}  // namespace dstrain
