// The op set of dstrain: one interface, one method per op. Every backend (kernels/cpu/, and
// kernels/cuda/ later) implements all of it; the CPU backend is the reference twin every
// other backend is tested against.
//
// Conventions
// - Tensors are views (core/tensor.h). Activations and parameters may be stored as F32, F16
//   or BF16; every op computes in fp32 and rounds each stored output to the storage dtype
//   (round-to-nearest-even), exactly where a GPU kernel would store it. Statistics (layernorm
//   mean/rstd, attention log-sum-exp, losses) are always F32. Token ids are I32.
// - Shapes are written beside each argument: B batch, T sequence, C channels, NH heads,
//   V real vocabulary, Vp padded vocabulary (>= V), N = B*T rows, OC output channels.
// - Parameter gradients always ACCUMULATE (+=), so micro-batches add up without a copy.
//   Activation gradients OVERWRITE (=) unless the method says +=.
// - Ops are stateless and take an explicit stream: on the CPU backend `stream` is ignored and
//   every op has finished when it returns; on CUDA it is a cudaStream_t.
// - Deterministic: the same inputs give the same bits, whatever the thread count of the
//   backend (reductions run in a fixed order).
// - Each float tensor's dtype is independent of the others' (e.g. BF16 activations with F32
//   gradients). Tensors may have more than 2 dims: row ops treat the last dim as the row.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace dstrain {

using Stream = void*;  // cudaStream_t on CUDA; nullptr on the CPU backend
using Event = void*;   // cudaEvent_t on CUDA; nullptr on the CPU backend

// A cross-entropy target that the loss does not count (PyTorch's ignore_index): loss 0 and a
// zero gradient row. Any other negative target is an error.
constexpr int32_t kIgnoreTarget = -100;

struct AdamWStep {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: param -= lr * weight_decay * param
  int64_t step = 1;           // 1-based, for bias correction
  float grad_scale = 1.0f;    // gradients are multiplied by this first (unscale * clip)
};

// One buffer of a multi-tensor AdamW (Backend::adamw_multi): adamw's tensors and this
// buffer's weight decay.
struct AdamWTensors {
  Tensor param;       // (n) F32 master weights
  Tensor grad;        // (n) any float dtype
  Tensor m, v;        // (n) F32
  Tensor param_copy;  // (n) any float dtype, or empty
  float weight_decay = 0.0f;
};

// One buffer of a gradient check (Backend::gradient_stats): any float dtype; its sum of
// squares is wanted or not (a tensor-parallel replica's copy is checked for inf/NaN but counted
// on one rank only).
struct GradientTensor {
  Tensor x;
  bool count_squares = true;
};

struct GradientStats {
  bool found_inf = false;       // some element of some tensor is inf or NaN
  std::vector<double> squares;  // per tensor: sum_squares(x) where counted, else 0
};

// Multi-head latent attention (DeepSeek-V2/V3): the head dims of its q, k and v
// (Backend::mla_pack).
struct MlaHeads {
  int heads = 0;     // H (this rank's)
  int nope_dim = 0;  // dn: qk_nope_head_dim
  int rope_dim = 0;  // dr: qk_rope_head_dim, even
  int v_dim = 0;     // dv: v_head_dim, <= dn + dr
  // The q heads times this (the softmax scale beyond D^-1/2 that the attention ops apply:
  // YaRN's mscale^2 for DeepSeek-V3); 1: none.
  float q_scale = 1.0f;
  // The rope parts' rotated pairs are (2i, 2i + 1), as DeepSeek's checkpoints hold them (its
  // apply_rotary_pos_emb moves them into halves before rotating: the same numbers in another
  // order, and q.k the same sum), rather than rope_forward's (i, i + dr/2).
  bool interleaved = false;
  int64_t qk_dim() const { return int64_t{nope_dim} + rope_dim; }  // D
};

// How a mixture-of-experts router turns a token's logits over E experts into the weights of
// its top k experts (Backend::moe_route).
enum class RouterScore { Softmax, Sigmoid };
// DeepSeek's group-limited routing: a group's rank is its best expert's selection score
// (DeepSeek-V2's group_limited_greedy) or the sum of its two best (DeepSeek-V3's noaux_tc).
enum class GroupScore { Max, TopTwoSum };
struct MoeRouting {
  int experts = 0;  // E
  int top_k = 0;    // k, 1 <= k <= E
  RouterScore score = RouterScore::Softmax;
  bool norm_topk = false;  // the k weights divided by their sum
  float scale = 1.0f;      // then multiplied by this (routed_scaling_factor)
  // The experts in `groups` equal groups (n_group); a token chooses among the experts of its
  // `top_groups` best groups (topk_group) only. groups 1: every expert.
  int groups = 1, top_groups = 1;
  GroupScore group_score = GroupScore::Max;
  // (E) F32 on the op's device, or empty: added to the scores for the selection only (DeepSeek-V3's
  // e_score_correction_bias); the weights are the scores themselves.
  Tensor selection_bias = {};
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // "cpu (2 threads, OpenBLAS)"
  virtual void synchronize(Stream stream) = 0;

  // ---- streams and events ----
  // Work on two streams is unordered unless an event orders it. The defaults are those of a
  // backend whose ops finish before they return (the CPU backend): no streams, no events, and
  // nothing to order. CUDA: a non-blocking cudaStream_t (no implicit ordering with the legacy
  // stream, nullptr) and a cudaEvent_t without timing.
  virtual Stream create_stream() { return nullptr; }
  virtual void destroy_stream(Stream stream) {}
  virtual Event create_event() { return nullptr; }
  virtual void destroy_event(Event event) {}
  // The event captures the work queued on `stream` so far (replacing what it captured before).
  virtual void record_event(Event event, Stream stream) {}
  // Work queued on `stream` from now on runs after what the event captured (nothing when it was
  // never recorded).
  virtual void wait_event(Stream stream, Event event) {}
  // The host waits for what the event captured.
  virtual void synchronize_event(Event event) {}
  // An event that records when the work before it finished (CUDA: with timing), for traces.
  virtual Event create_timing_event() { return nullptr; }
  // Seconds from `start` to `end`, two timing events whose captured work has finished.
  virtual double elapsed_seconds(Event start, Event end) { return 0.0; }

  // ---- memory ----
  // t = 0
  virtual void fill_zero(Tensor t, Stream stream) = 0;
  // dst = src, converting dtype (F32/F16/BF16 both ways, RNE). REQUIRES: same numel.
  virtual void copy(Tensor dst, Tensor src, Stream stream) = 0;
  // Copy between this device's memory and host memory (either side may be host).
  virtual void copy_bytes(void* dst, const void* src, size_t bytes, Stream stream) = 0;

  // ---- positions (packed sequences) ----
  // The embedding, rotary and attention ops take `positions` (B,T) I32: each token's place in
  // its sequence, where several sequences are packed into one row (Hugging Face's position_ids
  // packing). A sequence starts where the position is 0 and counts up by 1 from there:
  // REQUIRES positions[b,0] == 0 and positions[b,t] is 0 or positions[b,t-1] + 1. Token t of a
  // row belongs to the sequence that starts at t - positions[b,t]. Empty: one sequence per row,
  // positions[b,t] = t. The overloads without it are that case.

  // ---- embedding ----
  // out (B,T,C) = wte[tokens[b,t]] + wpe[positions[b,t]]
  // tokens (B,T) I32 with 0 <= id < vocab_rows (else UserError); wpe (maxT,C), maxT >= T, or
  // empty: no position table (LLaMA), out = wte[tokens[b,t]] (and no dwpe in backward).
  // Vocabulary-parallel: wte (Vs,C) holds rows [vocab_begin, vocab_begin + Vs) of the whole
  // (vocab_rows, C) table; positions whose token lies outside them get a zero row (no wpe
  // either), so the sum over the slices is the whole embedding, bitwise. The whole table:
  // vocab_begin 0, vocab_rows Vs. REQUIRES: vocab_begin + Vs <= vocab_rows.
  virtual void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte,
                                 Tensor wpe, int64_t vocab_begin, int64_t vocab_rows,
                                 Stream stream) = 0;
  void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe, int64_t vocab_begin,
                         int64_t vocab_rows, Stream stream) {
    embedding_forward(out, tokens, Tensor(), wte, wpe, vocab_begin, vocab_rows, stream);
  }
  // dwte (Vs,C) += scatter of dout rows by token (only tokens inside the slice);
  // dwpe (maxT,C) += scatter of dout rows by position (every token: positions[b,t], or t).
  // dout (B,T,C). Deterministic: rows that share a token (or a position) add up in (b,t) order.
  virtual void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                                  Tensor positions, int64_t vocab_begin, int64_t vocab_rows,
                                  Stream stream) = 0;
  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                          int64_t vocab_begin, int64_t vocab_rows, Stream stream) {
    embedding_backward(dwte, dwpe, dout, tokens, Tensor(), vocab_begin, vocab_rows, stream);
  }

  // ---- layernorm (eps 1e-5, biased variance) ----
  // out (N,C), mean (N) F32, rstd (N) F32, inp (N,C), weight (C), bias (C)
  virtual void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                                 Tensor weight, Tensor bias, Stream stream) = 0;
  // dinp (N,C) +=, dweight (C) +=, dbias (C) +=; dout (N,C); inp, weight, mean, rstd as saved
  virtual void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                  Tensor inp, Tensor weight, Tensor mean, Tensor rstd,
                                  Stream stream) = 0;

  // ---- the residual add fused into the norm after it (a pre-norm block's second norm) ----
  // residual (N,C) = a + b as residual_forward, then the norm of residual AS STORED into out
  // (and its statistics): bitwise what residual_forward and then layernorm_forward /
  // rmsnorm_forward give on the same backend, so selective recompute (the norm again from the
  // kept residual) sees the same bits. The reference is the two ops (below); a GPU backend
  // reads a and b once and writes residual and out in one pass.
  virtual void residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean, Tensor rstd,
                                          Tensor a, Tensor b, Tensor weight, Tensor bias,
                                          Stream stream) {
    residual_forward(residual, a, b, stream);
    layernorm_forward(out, mean, rstd, residual, weight, bias, stream);
  }
  virtual void residual_rmsnorm_forward(Tensor residual, Tensor out, Tensor rstd, Tensor a,
                                        Tensor b, Tensor weight, float eps, Stream stream) {
    residual_forward(residual, a, b, stream);
    rmsnorm_forward(out, rstd, residual, weight, eps, stream);
  }

  // ---- RMSNorm (Llama, Qwen2) ----
  // out (N,C) = inp * rstd * weight, rstd (N) F32 = 1 / sqrt(mean over C of inp^2 + eps);
  // inp (N,C), weight (C). Compute in fp32 (Hugging Face's LlamaRMSNorm: the normalized value is
  // rounded to the storage dtype before the multiply by weight; do the same so bf16/fp16 match it).
  virtual void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps,
                               Stream stream) = 0;
  // dinp (N,C) +=, dweight (C) +=; dout (N,C); inp, weight, rstd as saved by forward.
  virtual void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                Tensor weight, Tensor rstd, Stream stream) = 0;

  // ---- SwiGLU (Llama's MLP: down(silu(gate(x)) * up(x))) ----
  // inp (N, 2I): each row is [gate (I) | up (I)] (one GEMM against the stacked [gate_proj; up_proj]
  // weight); out (N, I) = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
  // amax: empty, or (1) F32 that receives max |out| as stored (fp8_amax's of out, found on the
  // way: an FP8 cast of out then reads it once; --precision fp8).
  virtual void swiglu_forward(Tensor out, Tensor inp, Tensor amax, Stream stream) = 0;
  // dinp (N, 2I) = [dgate | dup] (overwritten, not accumulated); dout (N, I); inp as in forward;
  // amax as forward's, of dinp.
  virtual void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp, Tensor amax,
                               Stream stream) = 0;

  // ---- matmul with bias ----
  // out (N,OC) = inp (N,C) @ W + bias (OC; may be empty).
  // weight_out_by_in == false: W is weight (C,OC), the Hugging Face Conv1D layout.
  // weight_out_by_in == true:  W is weight^T with weight (OC,C), e.g. the tied LM head wte.
  virtual void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                              bool weight_out_by_in, Stream stream) = 0;
  // dinp (N,C) = dout @ W^T (skipped when dinp is empty); dweight (same shape as weight) +=
  // inp^T @ dout (or its transpose); dbias (OC) += column sums of dout (skipped when empty).
  virtual void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                               Tensor inp, Tensor weight, bool weight_out_by_in,
                               Stream stream) = 0;
  // dbias (OC) += column sums of dout (N,OC): matmul_backward's dbias alone, the same bits (a
  // linear whose GEMMs run elsewhere: the FP8 ones, model/fp8_linear.h).
  virtual void bias_backward(Tensor dbias, Tensor dout, Stream stream) = 0;
  // The MLP up-projection: pre_gelu (N,OC) = inp (N,C) @ weight (C,OC) + bias (OC; may be
  // empty), rounded to pre_gelu's dtype; out (N,OC) = gelu (tanh approximation, below) of
  // pre_gelu AS STORED, rounded to out's dtype. Bitwise what matmul_forward(pre_gelu, inp,
  // weight, bias, false) then gelu_forward(out, pre_gelu) give on the same backend, whatever
  // the dtypes: backward (gelu_backward) and selective recompute (gelu_forward from the kept
  // pre_gelu) see exactly these bits. That is why cuBLASLt's GELU_AUX_BIAS epilogue, whose
  // GELU reads the fp32 sum before pre_gelu is rounded and uses its own tanh, is not used;
  // a backend may fuse the bias and the loads/stores, not change the numbers.
  // REQUIRES: out and pre_gelu do not overlap each other or the inputs.
  virtual void matmul_gelu_forward(Tensor out, Tensor pre_gelu, Tensor inp, Tensor weight,
                                   Tensor bias, Stream stream) = 0;

  // ---- causal self-attention, multi-head or grouped-query ----
  // NH query heads share KV key/value heads: query head h uses kv head h / (NH/KV), so
  // consecutive query heads share one (Hugging Face's repeat_kv). KV == NH is multi-head
  // attention (GPT-2). REQUIRES: NH % KV == 0; hd = qkv's row width / (NH + 2 KV).
  // qkv (B,T,(NH+2KV)*hd): per position [q (NH heads) | k (KV heads) | v (KV heads)]; q head h
  // at columns h*hd, k head j at NH*hd + j*hd, v head j at (NH+KV)*hd + j*hd.
  // out (B,T,NH*hd) = softmax(q k^T / sqrt(hd), causal) v per query head; lse (B,NH,T) F32 = the
  // log-sum-exp of each scaled score row (all backward needs besides qkv and out: no T x T).
  // With positions, query t sees the keys of its own sequence up to itself only: keys
  // [t - positions[b,t], t].
  virtual void attention_forward(Tensor out, Tensor lse, Tensor qkv, Tensor positions,
                                 int n_head, int n_kv_head, Stream stream) = 0;
  void attention_forward(Tensor out, Tensor lse, Tensor qkv, int n_head, int n_kv_head,
                         Stream stream) {
    attention_forward(out, lse, qkv, Tensor(), n_head, n_kv_head, stream);
  }
  // dqkv (B,T,(NH+2KV)*hd) = gradient w.r.t. qkv; dout (B,T,NH*hd); qkv, out, lse as saved by
  // forward (with the same positions). dk and dv of a kv head sum over its query heads in a
  // fixed order (ascending head, then ascending query row, one fp32 accumulator): the same bits
  // on every run.
  virtual void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                                  Tensor positions, int n_head, int n_kv_head,
                                  Stream stream) = 0;
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                          int n_head, int n_kv_head, Stream stream) {
    attention_backward(dqkv, dout, qkv, out, lse, Tensor(), n_head, n_kv_head, stream);
  }

  // ---- rotary position embedding (rotate-half, as Hugging Face's Llama) ----
  // qkv (B,T,(NH+2KV)*hd), laid out as for attention, in place on its NH q heads and KV k heads
  // (v untouched); freqs (maxT,hd/2,2) F32 with maxT >= T: (cos, sin) of position p's angle for
  // frequency i (p = positions[b,t], or t) (the model computes it on the host once, kernels/rope_table.h, with whatever
  // rope_theta / scaling the config has). For each head and i < hd/2: x1 = x[i],
  // x2 = x[i + hd/2]; x[i] = x1*cos - x2*sin, x[i + hd/2] = x2*cos + x1*sin; computed in fp32
  // (no FMA), rounded to storage once. REQUIRES: hd even.
  virtual void rope_forward(Tensor qkv, Tensor freqs, Tensor positions, int n_head,
                            int n_kv_head, Stream stream) = 0;
  void rope_forward(Tensor qkv, Tensor freqs, int n_head, int n_kv_head, Stream stream) {
    rope_forward(qkv, freqs, Tensor(), n_head, n_kv_head, stream);
  }
  // The backward, in place on dqkv (same layout): the transposed rotation (sin negated) of dq
  // and dk; dv untouched.
  virtual void rope_backward(Tensor dqkv, Tensor freqs, Tensor positions, int n_head,
                             int n_kv_head, Stream stream) = 0;
  void rope_backward(Tensor dqkv, Tensor freqs, int n_head, int n_kv_head, Stream stream) {
    rope_backward(dqkv, freqs, Tensor(), n_head, n_kv_head, stream);
  }

  // ---- multi-head latent attention: its heads in the attention ops' layout ----
  // q (B,T,H*D): each head [nope | rope] (D = dn + dr); kv (B,T,H*(dn+dv)): each head
  // [k nope | v]; k_rope (B,T,dr): the one rotary key of every head. qkv (B,T,3*H*D) is the
  // attention ops' input with H q heads, H kv heads and head dim D: the q heads with their rope
  // part rotated, times heads.q_scale (in fp32 after the rotation), the k heads [k nope | the
  // rotated k_rope], the v heads [v | 0] (zero-padded to D, so that the attention's output heads
  // are [their v part | 0]). The rotation is rope_forward's on the dr rope dims (pairs
  // (i, i + dr/2), or (2i, 2i + 1) with heads.interleaved; freqs (maxT,dr/2,2) F32, positions
  // as there). One dtype for the four tensors; every element rounded once (the copies exact
  // where q_scale is 1).
  virtual void mla_pack(Tensor qkv, Tensor q, Tensor kv, Tensor k_rope, Tensor freqs,
                        Tensor positions, const MlaHeads& heads, Stream stream) = 0;
  // The backward from dqkv (same layout), overwriting dq, dkv and dk_rope: the q heads times
  // q_scale (before their rope parts are rotated back), the rope parts rotated back
  // (rope_backward's transposed rotation); dk_rope = the k heads' rope parts summed
  // over the heads in head order in fp32, then rotated back, rounded once; the v padding unread.
  virtual void mla_pack_backward(Tensor dq, Tensor dkv, Tensor dk_rope, Tensor dqkv, Tensor freqs,
                                 Tensor positions, const MlaHeads& heads, Stream stream) = 0;
  // out (B,T,H*dv) = the first dv of each head of atty (B,T,H*D) (the attention's output of
  // mla_pack's qkv); the backward: datty = each head of dout padded with zeros to D.
  virtual void mla_unpad(Tensor out, Tensor atty, const MlaHeads& heads, Stream stream) = 0;
  virtual void mla_unpad_backward(Tensor datty, Tensor dout, const MlaHeads& heads,
                                  Stream stream) = 0;

  // ---- GELU, tanh approximation ----
  // out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); any shape
  virtual void gelu_forward(Tensor out, Tensor inp, Stream stream) = 0;
  // dinp = gelu'(inp) * dout
  virtual void gelu_backward(Tensor dinp, Tensor dout, Tensor inp, Stream stream) = 0;
  // The MLP's GELU backward with its up-projection's bias gradient: dinp (N,OC) as
  // gelu_backward, then dbias (OC; skipped when empty) += column sums of dinp AS STORED. Bitwise
  // what gelu_backward then matmul_backward's dbias over dinp give on the same backend: a
  // backend may fuse the sums into the GELU pass (dinp not read back), not change the numbers.
  virtual void gelu_backward_bias(Tensor dinp, Tensor dbias, Tensor dout, Tensor inp,
                                  Stream stream) = 0;

  // ---- residual ----
  // out = a + b (same shape)
  virtual void residual_forward(Tensor out, Tensor a, Tensor b, Stream stream) = 0;
  // dst += src (same shape): the backward of a residual branch joining the stream
  virtual void accumulate(Tensor dst, Tensor src, Stream stream) = 0;
  // x (N,OC) += bias (OC) on every row: the bias of a row-parallel layer, added once after the
  // sum over the tensor-parallel ranks.
  virtual void add_bias(Tensor x, Tensor bias, Stream stream) = 0;

  // ---- fused softmax + cross-entropy ----
  // logits (N,Vp); targets (N) I32 in [0,V), or kIgnoreTarget: a row the loss does not count
  // (a prompt or padding token of chat data), whose loss is 0 and whose dlogits row is 0.
  // Columns >= V do not exist (masked out).
  // losses (N) F32 = -log softmax(logits[n, :V])[targets[n]].
  // If dlogits (N,Vp) is not empty: dlogits = (softmax - onehot(target)) * dloss for
  // columns < V, 0 for columns >= V (dloss: the weight of each row's loss, e.g. 1/(N*accum)).
  // dlogits may be logits itself (same dtype): the gradient then overwrites the logits.
  virtual void softmax_cross_entropy(Tensor losses, Tensor dlogits, Tensor logits,
                                     Tensor targets, int vocab, float dloss, Stream stream) = 0;

  // ---- vocabulary-parallel softmax + cross-entropy ----
  // The same loss as softmax_cross_entropy with the vocabulary split over P ranks: logits
  // (N,Vs) are columns [vocab_begin, vocab_begin + Vs) of the whole (N, P*Vs) logits; real
  // columns are those < vocab (global index). No rank holds the whole logits.
  // 1. stats (N,3) F32 per row over this slice's real columns: (max, sum of exp(x - max),
  //    the target's logit, or 0 when the target is not in the slice or is kIgnoreTarget). A
  //    slice without real columns gives (-inf, 0, 0).
  virtual void cross_entropy_stats(Tensor stats, Tensor logits, Tensor targets,
                                   int64_t vocab_begin, int vocab, Stream stream) = 0;
  // 2. From every slice's stats (P,N,3) F32 (slice p: columns [p*Vs, (p+1)*Vs)): M = max_p
  //    max_p, S = sum over p in order of sum_p * exp(max_p - M), target logit from the slice
  //    holding the target; losses (N) F32 = log S - (target logit - M). If dlogits (N,Vs) is
  //    not empty: dlogits = (exp(x - M) / S - onehot(target)) * dloss on real columns, 0 on
  //    the others. dlogits may be logits itself (same dtype). A kIgnoreTarget row: loss 0 and
  //    a zero dlogits row.
  virtual void cross_entropy_from_stats(Tensor losses, Tensor dlogits, Tensor logits,
                                        Tensor stats, Tensor targets, int64_t vocab_begin,
                                        int vocab, float dloss, Stream stream) = 0;

  // ---- mixture of experts: routing, dispatch into expert order, grouped GEMM, combine ----
  // E experts, k choices per token, N tokens, M rows in expert order (N * k when none is
  // dropped). The tensors of one token's choices are (N, k); a choice (n, j) is row
  // dest_rows[n, j] of the expert-ordered buffer, or -1: dropped (no row, no contribution).
  //
  // scores (N,E) F32 = softmax (or sigmoid) of logits (N,E) in fp32. The selection scores are
  // the scores + routing.selection_bias (if any); with groups, the top_groups groups of the
  // highest group scores (ties to the lower group) are the token's, the others' experts out of
  // its choice (DeepSeek fills their scores with 0, which picks the same experts while the
  // chosen groups' selection scores are positive). topk_expert (N,k) I32: the experts of the k
  // highest selection scores, highest first, ties to the lower index. topk_weight (N,k) F32:
  // their scores, divided by their sum (in j order) where routing.norm_topk, times
  // routing.scale. The selection is a constant: the backward is the same with groups and bias.
  virtual void moe_route(Tensor topk_weight, Tensor topk_expert, Tensor scores, Tensor logits,
                         const MoeRouting& routing, Stream stream) = 0;
  // dlogits (N,E) = the gradient w.r.t. logits (overwritten) from dtopk_weight (N,k) F32 and, if
  // not empty, dscores (N,E) F32 (a loss on the scores themselves: the load-balancing loss).
  // The selection is a constant; scores and topk_expert as forward saved them.
  virtual void moe_route_backward(Tensor dlogits, Tensor dtopk_weight, Tensor dscores,
                                  Tensor scores, Tensor topk_expert, const MoeRouting& routing,
                                  Stream stream) = 0;
  // The expert order of the choices topk_expert (N,k) I32 (each in [0, E)): a stable counting
  // sort. expert_offsets (E+1) I32: expert e's rows are [offsets[e], offsets[e+1]), offsets[0]
  // = 0, offsets[E] = N*k; within an expert, rows in ascending (n, j). source_rows (N*k) I32:
  // the token each row copies. dest_rows (N,k) I32: the row of choice (n, j).
  virtual void moe_dispatch(Tensor expert_offsets, Tensor source_rows, Tensor dest_rows,
                            Tensor topk_expert, int experts, Stream stream) = 0;
  // out (M,C) row r = inp (N,C) row source_rows[r] (M) I32, converting dtype.
  virtual void moe_gather(Tensor out, Tensor inp, Tensor source_rows, Stream stream) = 0;
  // out (N,C) row n = the sum over j in order of weight[n, j] * inp[dest_rows[n, j]] in fp32,
  // rounded once; weight (N,k) F32, or empty: 1 (then this is moe_gather's backward). A token
  // whose choices are all dropped gets 0. inp (M,C), dest_rows (N,k) I32.
  virtual void moe_combine(Tensor out, Tensor inp, Tensor dest_rows, Tensor weight,
                           Stream stream) = 0;
  // The combine's backward: dinp (M,C) row dest_rows[n, j] = weight[n, j] * dout[n] (weight
  // empty: dout[n]); every row of dinp is some choice's (overwritten). dweight (N,k) F32 (skipped
  // when empty) = dot(dout[n], inp[dest_rows[n, j]]) in fp32, 0 for a dropped choice.
  virtual void moe_combine_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                    Tensor dest_rows, Tensor weight, Stream stream) = 0;
  // The experts' linear layers over their rows: out (M,OC) rows [offsets[e], offsets[e+1]) =
  // inp (M,C) rows @ weight[e]^T, weight (E,OC,C) (each expert's nn.Linear (out, in) matrix),
  // expert_offsets (E+1) I32 on this backend's device, nondecreasing from 0 to at most M; rows
  // past offsets[E] are left as they are. Bitwise what matmul_forward (weight_out_by_in, no
  // bias) gives on each expert's rows.
  virtual void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight,
                                      Tensor expert_offsets, Stream stream) = 0;
  // dinp (M,C) rows of expert e = dout rows @ weight[e] (skipped when dinp is empty; rows past
  // offsets[E] left as they are); dweight (E,OC,C) += dout rows^T @ inp rows (an expert without
  // rows: unchanged). Bitwise matmul_backward's on each expert's rows.
  virtual void grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                       Tensor weight, Tensor expert_offsets, Stream stream) = 0;

  // ---- FP8 GEMMs (--precision fp8; core/fp8.h, kernels/fp8_checks.h) ----
  // Current per-tensor scaling: s = fp8_scale_for_amax(max |inp|, the format), a power of
  // two; each copy = fp8(inp * s) with satfinite, rounded to nearest even (the product is
  // exact); scale_inv (1) F32 = 1 / s, the factor that turns a copy back into inp's range. A NaN
  // in inp makes amax NaN: s = 1. inp (R, C) F32/F16/BF16; out (R, C) and out_t (C, R), the
  // K-contiguous copy an FP8 GEMM needs of an operand stored K-major: either may be empty, not
  // both; F8E4M3 or F8E5M2, the same when both. Both from one amax and one pass over inp.
  // amax: empty (found here, a pass over inp), or (1) F32 holding max |inp| already (fp8_amax's,
  // kept from an earlier cast of the same values): then inp is read once.
  virtual void fp8_quantize(Tensor out, Tensor out_t, Tensor scale_inv, Tensor inp, Tensor amax,
                            Stream stream) = 0;
  // amax (1) F32 = max |inp| (NaN when inp holds a NaN), the amax fp8_quantize would find.
  virtual void fp8_amax(Tensor amax, Tensor inp, Stream stream) = 0;
  // out (M, N) = (a (M, K) @ b (N, K)^T) * a_scale_inv * b_scale_inv + bias (N; may be empty),
  // or out += that (no bias) when `accumulate`: a and b F8 (not both F8E5M2), each row
  // K-contiguous (the "TN" form of cuBLASLt's FP8 GEMMs), their scale_inv (1) F32 as
  // fp8_quantize wrote them. Every product is exact in fp32; they are summed in fp32, scaled,
  // the bias (and out) added, and rounded once to out's dtype (F32/F16/BF16).
  // REQUIRES: K and N multiples of 16 (the FP8 tensor cores' alignment).
  virtual void matmul_fp8(Tensor out, Tensor a, Tensor a_scale_inv, Tensor b,
                          Tensor b_scale_inv, Tensor bias, bool accumulate, Stream stream) = 0;

  // ---- optimizer ----
  // AdamW over a flat buffer. param (n) F32 master weights; grad (n) any float dtype;
  // m, v (n) F32. g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  // param -= lr * (mhat / (sqrt(vhat) + eps) + weight_decay * param).
  // If param_copy (n) is not empty it receives the updated param rounded to its dtype.
  virtual void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
                     const AdamWStep& step, Stream stream) = 0;
  // Sum of squares of x (any float dtype), accumulated in fp64 in a fixed order.
  // Waits for the stream (the result is returned to the host).
  virtual double sum_squares(Tensor x, Stream stream) = 0;
  // x *= s
  virtual void scale(Tensor x, float s, Stream stream) = 0;
  // True when x holds any inf or NaN. Waits for the stream.
  virtual bool has_inf_or_nan(Tensor x, Stream stream) = 0;

  // ---- multi-tensor: every buffer of a step in one launch ----
  // The reference semantics are the loops below (the CPU backend's); a GPU backend runs all
  // buffers in one launch, with one host synchronization for gradient_stats.
  // AdamW on every buffer with `step` and the buffer's own weight_decay (step.weight_decay is
  // not used): bitwise what adamw gives buffer by buffer. REQUIRES: the buffers do not overlap.
  virtual void adamw_multi(std::span<const AdamWTensors> buffers, const AdamWStep& step,
                           Stream stream) {
    AdamWStep piece_step = step;
    for (const AdamWTensors& b : buffers) {
      piece_step.weight_decay = b.weight_decay;
      adamw(b.param, b.grad, b.m, b.v, b.param_copy, piece_step, stream);
    }
  }
  // Whether any buffer holds inf or NaN, and each counted buffer's sum of squares, bitwise
  // what sum_squares gives for it (so a caller adding them up in its own order gets the bits
  // it got before). Waits for the stream (once).
  virtual GradientStats gradient_stats(std::span<const GradientTensor> buffers, Stream stream) {
    GradientStats stats;
    stats.squares.assign(buffers.size(), 0.0);
    for (size_t i = 0; i < buffers.size(); ++i) {
      stats.found_inf = stats.found_inf || has_inf_or_nan(buffers[i].x, stream);
      if (buffers[i].count_squares) stats.squares[i] = sum_squares(buffers[i].x, stream);
    }
    return stats;
  }
};

// A stream or event of a backend, destroyed with this object (the backend must outlive it).
template <void* (Backend::*Create)(), void (Backend::*Destroy)(void*)>
class BackendHandle {
 public:
  BackendHandle() = default;
  explicit BackendHandle(Backend& backend) : backend_(&backend), handle_((backend.*Create)()) {}
  BackendHandle(BackendHandle&& other) noexcept { *this = std::move(other); }
  BackendHandle& operator=(BackendHandle&& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(handle_, other.handle_);
    return *this;
  }
  ~BackendHandle() {
    if (backend_) (backend_->*Destroy)(handle_);
  }
  void* get() const { return handle_; }

 private:
  Backend* backend_ = nullptr;
  void* handle_ = nullptr;
};
using OwnedStream = BackendHandle<&Backend::create_stream, &Backend::destroy_stream>;
using OwnedEvent = BackendHandle<&Backend::create_event, &Backend::destroy_event>;

// The CPU backend: fp32 compute, OpenBLAS GEMM, OpenMP threads (num_threads <= 0: all cores).
std::unique_ptr<Backend> make_cpu_backend(int num_threads = 0);

}  // namespace dstrain
