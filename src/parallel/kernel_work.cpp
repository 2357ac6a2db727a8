#include "parallel/kernel_work.h"

#include <algorithm>
#include <cmath>

#include "model/parts.h"

namespace dstrain {

namespace {

// ---- The attention kernels' tiles: the granularity g of the causal skipping ----------------

// Tensor-core forward (cuda_attention_mma.cu) and dQ pass (cuda_attention_mma_backward.cu): a
// warp owns 16 query rows and issues its mma pairs over 16 keys, up to the key of its last row.
constexpr double kMmaWarpRows = 16;
// Tensor-core dK/dV pass: a warp owns 16 keys and streams whole query tiles (DkdvTiling::
// kQueries: 64 rows at head dim 64, 16 at 128 and up) from the tile holding its first key. At
// head dims 192 and 256 two warps share 16 keys, each owning half of dK and dV's columns but
// computing S^T and dP^T in full: those two products run twice.
double mma_dkdv_query_tile(int64_t hd) { return hd == 64 ? 64 : 16; }
double mma_dkdv_score_copies(int64_t hd) { return hd >= 192 ? 2 : 1; }
// CUDA-core kernels (cuda_attention.cuh, kStreamRows): one lane per key or query of a streamed
// 32-row tile, lanes past the diagonal idle.
constexpr double kCudaCoreTileRows = 32;

// Query-key pairs per token of one query head: T (T + g) / 2 pairs over T tokens.
double causal_keys_per_query(double T, double granularity) { return (T + granularity) / 2; }

// ---- Elements a memory-bound kernel reads + writes per element of its row --------------------

// layernorm/rmsnorm forward (cuda_layernorm.cu, cuda_rmsnorm.cu): the row held in registers,
// read once and written once (the fp32 mean/rstd per row are left out here and below).
constexpr double kNormForward = 2;
// Their backward: dinp += ...: dout, inp and dinp read, dinp written; then the deterministic
// column sums for dweight (and dbias) read dout and inp again.
constexpr double kNormBackward = 6;
constexpr double kResidual = 3;  // residual_forward (cuda_elementwise.cu): a, b read, out written
// residual_layernorm_forward / residual_rmsnorm_forward, a block's second norm with the residual
// add before it in one pass: a, b read, the residual and the norm written. The kernels fuse where
// the row fits the registers (cuda_rows.cuh, kMaxRegisterC: C % 8 == 0, C <= 8192); else they
// run the two ops.
constexpr double kFusedResidualNorm = 4;
constexpr int64_t kMaxFusedNormC = 8192;
// add_bias after a row-parallel reduction (tp > 1; at tp 1 cuBLASLt's BIAS epilogue adds it).
constexpr double kBiasAdd = 2;
constexpr double kBiasGrad = 1;      // dbias: cuda_layernorm.cu's column sums read dout once
constexpr double kGeluForward = 2;   // pre-GELU read, GELU written (matmul_gelu_forward's 2nd pass)
// dout, pre-GELU read, dinp written; GPT-2's fc bias gradient summed from dinp in the same pass
// (cuda_gelu_bias.cu, where the rows are in packs of 8), not read again.
constexpr double kGeluBackward = 3;
// SwiGLU (cuda_swiglu.cu), per element of its output (N, I): gate and up read, out written;
// backward: dout, gate and up read, dgate and dup written.
constexpr double kSwigluForward = 3;
constexpr double kSwigluBackward = 5;
constexpr double kRope = 2;  // cuda_rope.cu, in place on the q and k heads: read, written
// The attention backward's delta = rowsum(dO * O): the dQ kernel reads O for it (dO is in its
// tile already) and writes one fp32 per row and head.
constexpr double kAttentionDelta = 1;
// cuda_cross_entropy.cu, per logit: read for the row's max and sum, read again and the gradient
// written (the vocabulary-parallel stats and from_stats kernels: the same two passes).
constexpr double kCrossEntropy = 3;
constexpr double kFill = 1;  // fill_zero of the head's input gradient before its norm backward
// cuda_moe.cu, per channel of a token with k choices: forward the gather (k copies read and
// written) and the combine (k rows read, one written); backward the combine's backward (dout
// and the k expert rows read, k rows written), the gather's backward (k read, one written) and
// the router's gradient added (read, written). The routing's (N, E) passes are left out.
double moe_forward(double k) { return 2 * k + k + 1; }
double moe_backward(double k) { return (1 + 2 * k) + (k + 1) + 2; }
// cuda_embedding.cu, per channel: wte (and GPT-2's wpe) rows read, the sum written; backward reads
// dout for dwte and writes the token's dwte row (at most once per token), and a learned position
// table reads dout again for dwpe.
double embedding_traffic(const DecoderParts& parts) {
  return parts.position.kind == PositionKind::Learned ? 3 : 2;
}

// Widths per token on one tp rank.
struct Widths {
  double C = 0;     // the residual stream
  double rows = 0;  // the norm and residual rows: C, or C / tp under sequence parallelism
  double q = 0, kv = 0, mlp = 0;  // this rank's query heads, key/value heads, MLP width
};

Widths widths(const DecoderParts& parts, int tp, bool sequence_parallel) {
  Widths w;
  const double hd = static_cast<double>(parts.attention.head_dim);
  w.C = static_cast<double>(parts.width);
  w.rows = w.C / (sequence_parallel ? tp : 1);
  w.q = static_cast<double>(parts.attention.heads) * hd / tp;
  w.kv = static_cast<double>(parts.attention.kv_heads) * hd / tp;
  w.mlp = static_cast<double>(parts.mlp.width) / tp;
  return w;
}

// The two norms and two residual adds of a block, per element of a row.
double norms_and_residuals(const DecoderParts& parts) {
  const bool fused = parts.width % 8 == 0 && parts.width <= kMaxFusedNormC;
  return kNormForward + kResidual + (fused ? kFusedResidualNorm : kNormForward + kResidual);
}

// The MLP's activation, on each of a token's rows (top_k under MoE), of this rank's width.
double activation_forward(const MlpPart& mlp, int tp) {
  return (mlp.kind == MlpKind::Gelu ? kGeluForward : kSwigluForward) *
         (static_cast<double>(mlp.width) / tp) * static_cast<double>(mlp.rows_per_token());
}

double activation_backward(const MlpPart& mlp, int tp) {
  return (mlp.kind == MlpKind::Gelu ? kGeluBackward : kSwigluBackward) *
         (static_cast<double>(mlp.width) / tp) * static_cast<double>(mlp.rows_per_token());
}

// A layer's MLP traffic per token beyond the norms: forward, backward, selective recompute.
struct MlpTraffic {
  double forward = 0, backward = 0, selective = 0;
};
MlpTraffic mlp_traffic(const MlpPart& mlp, int tp, double C) {
  MlpTraffic t{activation_forward(mlp, tp), activation_backward(mlp, tp),
               activation_forward(mlp, tp)};
  if (mlp.kind == MlpKind::MoE) {
    const auto k = static_cast<double>(mlp.top_k);
    t.forward += moe_forward(k) * C;
    t.backward += moe_backward(k) * C;
  }
  return t;
}

// The mean over the layers (dense layers among MoE layers differ).
MlpTraffic mean_mlp_traffic(const DecoderParts& parts, int tp) {
  if (!parts.mixed_layers()) return mlp_traffic(parts.mlp, tp, static_cast<double>(parts.width));
  MlpTraffic mean;
  const double layers = static_cast<double>(std::max<int64_t>(parts.layers, 1));
  for (int64_t layer = 0; layer < parts.layers; ++layer) {
    const MlpTraffic t = mlp_traffic(parts.layer_mlp(layer), tp, static_cast<double>(parts.width));
    mean.forward += t.forward / layers;
    mean.backward += t.backward / layers;
    mean.selective += t.selective / layers;
  }
  return mean;
}

// Latent attention's memory-bound kernels per token (model/latent_attention.h): the two latent
// norms; mla_pack (q, kv and the rope key read, the attention's qkv written) and mla_unpad (the
// values read and written). Backward: the norms' backward after a fill of their input
// gradients, the pack's (dqkv read; dq, dkv and the rope key's written), the unpad's (the values
// read, the padded heads written), dx's two accumulates. Selective recompute: the norms.
struct LatentTraffic {
  double forward = 0, backward = 0, selective = 0;
};
LatentTraffic latent_traffic(const AttentionPart& a, int tp, double C) {
  if (!a.latent()) return {};
  const double heads = static_cast<double>(a.heads) / tp;
  const double q = heads * static_cast<double>(a.head_dim);
  const double kv = heads * static_cast<double>(a.nope_dim + a.v_dim);
  const double values = heads * static_cast<double>(a.v_dim);
  const double rope = static_cast<double>(a.rope_dim);
  const double latents = static_cast<double>(a.q_rank + a.kv_rank);
  LatentTraffic t;
  t.forward = kNormForward * latents + (q + kv + rope + 3 * q) + 2 * values;
  t.backward = (kFill + kNormBackward) * latents + (3 * q + q + kv + rope) + (values + q) +
               2 * kResidual * C;
  t.selective = kNormForward * latents;
  return t;
}

// dbias of every bias the block has: row-parallel ones (o, the MLP's down) from the whole dout.
double bias_gradients(const DecoderParts& parts, const Widths& w) {
  double elements = 0;
  if (parts.attention.qkv_bias) elements += w.q + 2 * w.kv;
  if (parts.attention.o_bias) elements += w.C;
  if (parts.mlp.bias) {
    // GELU's up bias is summed in the activation's backward pass where the rows are in packs
    // of 8 (cuda_gelu_bias.cu).
    const bool gelu = parts.mlp.kind == MlpKind::Gelu;
    const bool in_gelu_pass = gelu && std::fmod(w.mlp, 8.0) == 0.0;
    elements += (in_gelu_pass ? 0.0 : static_cast<double>(parts.mlp.up_factor()) * w.mlp) + w.C;
  }
  return kBiasGrad * elements;
}

}  // namespace

AttentionKernels attention_kernels(const ModelConfig& config, DType storage) {
  const int64_t hd = config.attention_head_dim();
  const bool tensor_dtype = storage == DType::BF16 || storage == DType::F16;
  const bool tensor_dim = hd == 64 || hd == 128 || hd == 192 || hd == 256;
  return tensor_dtype && tensor_dim ? AttentionKernels::TensorCore : AttentionKernels::CudaCore;
}

AttentionWork attention_work(const ModelConfig& config, int64_t seq_len, DType storage) {
  const double T = static_cast<double>(seq_len);
  const int64_t hd = config.attention_head_dim();
  const double per_product = 2 * static_cast<double>(hd) * static_cast<double>(config.n_head);
  AttentionWork work;
  if (attention_kernels(config, storage) == AttentionKernels::TensorCore) {
    const double rows = causal_keys_per_query(T, kMmaWarpRows);
    const double dkdv = causal_keys_per_query(T, mma_dkdv_query_tile(hd));
    work.forward = 2 * per_product * rows;
    work.backward = (2 * mma_dkdv_score_copies(hd) + 2) * per_product * dkdv  // S, dP; dV, dK
                    + 3 * per_product * rows;                                 // S, dP, dQ
  } else {
    const double keys = causal_keys_per_query(T, kCudaCoreTileRows);
    work.forward = 2 * per_product * keys;
    work.backward = (4 + 3) * per_product * keys;
  }
  return work;
}

MemoryTraffic memory_traffic(const ModelConfig& config, int tp, bool sequence_parallel) {
  const DecoderParts parts = decoder_parts(config);
  const Widths w = widths(parts, tp, sequence_parallel);
  // Latent attention rotates inside its pack (in latent_traffic).
  const bool rotary = parts.position.kind == PositionKind::Rotary && !parts.attention.latent();
  const double rope = rotary ? kRope * (w.q + w.kv) : 0;
  const LatentTraffic latent = latent_traffic(parts.attention, tp, w.C);
  const double row_parallel_biases = (parts.attention.o_bias ? 1 : 0) + (parts.mlp.bias ? 1 : 0);
  const MlpTraffic mlp = mean_mlp_traffic(parts, tp);
  MemoryTraffic t;
  // Two norms and two residual adds per block, the MLP's activation (and experts), the rope.
  t.layer_forward = norms_and_residuals(parts) * w.rows + mlp.forward + rope + latent.forward +
                    (tp > 1 ? kBiasAdd * row_parallel_biases * w.rows : 0);
  t.layer_backward = 2 * kNormBackward * w.rows + kAttentionDelta * w.q + rope + mlp.backward +
                     latent.backward + bias_gradients(parts, w);
  t.layer_selective = 2 * kNormForward * w.rows + mlp.selective + latent.selective;
  t.embed_forward = t.embed_backward = embedding_traffic(parts) * w.C;
  const double vocab = static_cast<double>(config.padded_vocab()) / tp;
  t.head_forward = kNormForward * w.rows + kCrossEntropy * vocab;
  t.head_backward = (kNormBackward + kFill) * w.rows;
  return t;
}

Fp8CastBytes fp8_cast_bytes(const ModelConfig& config, int tp_size, DType storage, double tokens,
                            bool cached_weights) {
  const DecoderParts parts = decoder_parts(config);
  const double read_once = static_cast<double>(dtype_size(storage)), read_twice = 2 * read_once;
  const double per = read_twice + 1.0, both_layouts = read_twice + 2.0;
  const double amax_known = read_once + 1.0;  // the input again, with forward's amax
  const double C = static_cast<double>(parts.width), tp = static_cast<double>(tp_size);
  Fp8CastBytes b;
  // input_found / dout_found: the op that wrote the input / dout found its amax (SwiGLU's).
  auto linear = [&](double in, double out, double share, bool input_found = false,
                    bool dout_found = false) {
    const double weight = cached_weights ? 0.0 : in * out;
    const double dout = dout_found ? both_layouts - read_once : both_layouts;
    b.forward += share * ((input_found ? amax_known : per) * tokens * in + per * weight);
    b.backward += share * (dout * tokens * out + amax_known * tokens * in + per * weight);
    if (cached_weights) b.weights_per_step += share * both_layouts * in * out;
  };
  const AttentionPart& a = parts.attention;
  if (!a.latent()) {  // latent attention's own projections stay in bf16
    const double q = static_cast<double>(a.q_width()), kv = static_cast<double>(a.kv_width());
    linear(C, (q + 2 * kv) / tp, 1.0);
  }
  linear(static_cast<double>(a.out_width()) / tp, C, 1.0);  // o: every attention's
  const double layers = static_cast<double>(std::max<int64_t>(parts.layers, 1));
  for (int64_t layer = 0; layer < parts.layers; ++layer) {
    const MlpPart& mlp = parts.layer_mlp(layer);
    if (mlp.kind == MlpKind::MoE) continue;
    const double I = static_cast<double>(mlp.width) / tp;
    const bool swiglu = mlp.kind == MlpKind::SwiGLU;
    linear(C, static_cast<double>(mlp.up_factor()) * I, 1.0 / layers, false, swiglu);
    linear(I, C, 1.0 / layers, swiglu, false);
  }
  return b;
}

}  // namespace dstrain
