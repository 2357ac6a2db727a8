// The mixture-of-experts MLP part (model/parts.h, MlpKind::MoE), as the decoder runs it on one
// rank: a router (x @ W_router^T, (N, E) logits), the top-k routing (scores in fp32), the
// tokens' copies in expert order (M = N k rows), each expert's SwiGLU on its rows (two grouped
// matmuls around the activation), and the weighted combine back into token order. Dropless by
// default: every token reaches its k experts; with an expert capacity (ExpertParallel::
// capacity_factor) each expert runs only its first copies. Under expert parallelism the copies
// travel to their experts' ranks and back (model/expert_parallel.h). Qwen2-MoE adds a shared
// SwiGLU expert every token passes through, scaled by sigmoid(x @ w_gate): the routing op with
// one expert, top 1, sigmoid scores gives that scale and its gradient, the combine applies it;
// DeepSeekMoE's shared experts have no gate. Forward and backward written against Backend's MoE
// ops (kernels/ops.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"
#include "model/architecture.h"
#include "model/expert_parallel.h"
#include "model/parts.h"

namespace dstrain {

// The sizes of one micro-batch's MoE MLP: N tokens of C channels, k choices each, M = N k rows
// in expert order, E experts of width I. Under expert parallelism this rank's experts are El =
// E / ep of them and see at most R rows (M without it).
struct MoeShape {
  int64_t N = 0, k = 0, M = 0, E = 0, C = 0, I = 0;
  int64_t Is = 0;  // the shared expert's width (0: none)
  int64_t ep = 1, El = 0, R = 0;
  bool aux = false;  // with the load-balancing loss (its gradient w.r.t. the scores)
};
// capacity_factor > 0: an expert capacity (ExpertParallel::capacity_factor) bounds R too.
MoeShape moe_shape(const MlpPart& mlp, int64_t tokens, int64_t width, int ep = 1,
                   double capacity_factor = 0);
// The part's router, with its selection bias (E) F32 where it has one (else empty).
MoeRouting moe_routing(const MlpPart& mlp, Tensor selection_bias = {});

// The part's weights (or their gradients) in a layer's block: the router (E, C), every expert's
// [gate | up] (E, 2I, C) and down (E, C, I), each one packed tensor (model/layout.cpp).
struct MoeWeights {
  Tensor router, up, down;
  Tensor shared_up, shared_down, shared_gate;  // (2 Is, C), (C, Is), (1, C), or empty
  Tensor router_bias = {};  // (E): the selection bias (MlpPart::selection_bias), or empty
};
// The views of `first` (the first expert's tensor in the block) over every expert's.
Tensor all_experts(Tensor first, int64_t experts);

// What forward keeps for backward (besides the MLP's up and act, (R, 2I) and (R, I), which the
// decoder keeps for every MLP), as prefixes of the micro-batch's sizes.
struct MoeActivations {
  Tensor scores;       // (N, E) F32
  Tensor topk_weight;  // (N, k) F32
  Tensor topk_expert;  // (N, k) I32
  Tensor offsets;      // (E + 1) I32
  Tensor source_rows;  // (M) I32
  Tensor dest_rows;    // (N, k) I32
  Tensor inp;          // (R, C): the tokens' copies in expert order (this rank's experts')
  Tensor up, act;      // (R, 2I), (R, I)
  Tensor out;          // (M, C): each copy's expert output (for the routing weights' gradient)
  // Expert parallelism: the rows this rank's experts got from each peer ((ep, El) I32, peer
  // major), and the offsets of its experts' rows in `inp` ((El + 1) I32). Full size: the
  // rows received are known at run time only.
  Tensor recv_counts, local_offsets;
  // The shared expert: its up (N, 2 Is), act (N, Is) and output (N, C), and its gate's routing
  // (one expert, top 1: scores, weight (N, 1) F32, expert (N, 1) I32, offsets (2), source (N)
  // and dest (N, 1) I32).
  Tensor shared_up, shared_act, shared_out;
  Tensor shared_scores, shared_weight, shared_expert, shared_offsets, shared_source, shared_dest;
};
// Their indices in LayerRun::activations.
struct MoeActivationIndex {
  int scores = -1, topk_weight = -1, topk_expert = -1, offsets = -1, source_rows = -1;
  int dest_rows = -1, inp = -1, out = -1, recv_counts = -1, local_offsets = -1;
  int shared_up = -1, shared_act = -1, shared_out = -1, shared_scores = -1, shared_weight = -1;
  int shared_expert = -1, shared_offsets = -1, shared_source = -1, shared_dest = -1;
};
// Adds the MoE activations (all kept unless recompute is Full) through add(spec) -> index.
template <class Add>
MoeActivationIndex add_moe_activations(const MoeShape& s, DType dtype, bool kept, Add&& add) {
  MoeActivationIndex i;
  i.scores = add(ActivationSpec{{"router_scores", DType::F32, {s.N, s.E}}, kept});
  i.topk_weight = add(ActivationSpec{{"topk_weight", DType::F32, {s.N, s.k}}, kept});
  i.topk_expert = add(ActivationSpec{{"topk_expert", DType::I32, {s.N, s.k}}, kept});
  i.offsets = add(ActivationSpec{{"expert_offsets", DType::I32, {s.E + 1}}, kept});
  i.source_rows = add(ActivationSpec{{"source_rows", DType::I32, {s.M}}, kept});
  i.dest_rows = add(ActivationSpec{{"dest_rows", DType::I32, {s.N, s.k}}, kept});
  i.inp = add(ActivationSpec{{"expert_inp", dtype, {s.R, s.C}}, kept});
  i.out = add(ActivationSpec{{"expert_out", dtype, {s.M, s.C}}, kept});
  if (s.ep > 1) {
    i.recv_counts = add(ActivationSpec{{"expert_recv_counts", DType::I32, {s.ep * s.El}}, kept});
    i.local_offsets = add(ActivationSpec{{"local_expert_offsets", DType::I32, {s.El + 1}}, kept});
  }
  if (s.Is == 0) return i;
  i.shared_up = add(ActivationSpec{{"shared_up", dtype, {s.N, 2 * s.Is}}, kept});
  i.shared_act = add(ActivationSpec{{"shared_act", dtype, {s.N, s.Is}}, kept});
  i.shared_out = add(ActivationSpec{{"shared_out", dtype, {s.N, s.C}}, kept});
  i.shared_scores = add(ActivationSpec{{"shared_scores", DType::F32, {s.N, 1}}, kept});
  i.shared_weight = add(ActivationSpec{{"shared_weight", DType::F32, {s.N, 1}}, kept});
  i.shared_expert = add(ActivationSpec{{"shared_expert", DType::I32, {s.N, 1}}, kept});
  i.shared_offsets = add(ActivationSpec{{"shared_offsets", DType::I32, {2}}, kept});
  i.shared_source = add(ActivationSpec{{"shared_source", DType::I32, {s.N}}, kept});
  i.shared_dest = add(ActivationSpec{{"shared_dest", DType::I32, {s.N, 1}}, kept});
  return i;
}

// The workspace the part needs besides the decoder's (router logits or their gradient, the
// rows' gradients, the routing weights' gradient).
struct MoeWorkspace {
  Tensor logits;        // (N, E): forward the logits, backward their gradient
  Tensor dout_rows;     // (M, C)
  Tensor dinp_rows;     // (M, C)
  Tensor dtopk_weight;  // (N, k) F32
  Tensor dup, dact;     // (R, 2I), (R, I)
  Tensor dx_router;     // (N, C): the router's (and the shared expert's) part of dx
  // The shared expert: its gate's logit (forward) or gradient (backward) (N, 1), its gated
  // output (forward) or that output's gradient (backward) (N, C), dact (N, Is), dup (N, 2 Is),
  // the gate weight's gradient (N, 1) F32.
  Tensor shared_logit, shared_sum, dshared_act, dshared_up, dshared_weight;
  // Expert parallelism: the rows sent (M, C), two (R, C) buffers of the rows received, the
  // permutations between peer-major and expert-major order (R) I32 each, and the counts sent
  // (E) I32.
  Tensor send_rows, exchange[2], to_expert_order, to_peer_order, send_counts;
  // The load-balancing loss's gradient w.r.t. the scores (N, E) F32 (backward), or empty.
  Tensor aux_dscores;
};
// Their indices in LayerRun::workspace (dup and dact are the decoder's).
struct MoeWorkspaceIndex {
  int logits = -1, dout_rows = -1, dinp_rows = -1, dtopk_weight = -1, dx_router = -1;
  int shared_logit = -1, shared_sum = -1, dshared_act = -1, dshared_up = -1;
  int dshared_weight = -1, send_rows = -1, exchange[2] = {-1, -1}, to_expert_order = -1;
  int to_peer_order = -1, send_counts = -1, aux_dscores = -1;
};
// Adds the MoE workspace through add(spec) -> index: every buffer, with no rows where the pass
// has none (the gradients without backward, the shared expert's without one, the exchange's
// without expert parallelism), so the indices do not depend on the shape.
template <class Add>
MoeWorkspaceIndex add_moe_workspace(const MoeShape& s, DType dtype, bool with_backward, Add&& add) {
  const int64_t Mb = with_backward ? s.M : 0, Nb = with_backward ? s.N : 0;
  const int64_t Ns = s.Is > 0 ? s.N : 0, Nsb = s.Is > 0 ? Nb : 0;
  const int64_t Me = s.ep > 1 ? s.M : 0, Re = s.ep > 1 ? s.R : 0;
  MoeWorkspaceIndex i;
  i.logits = add(TensorSpec{"router_logits", dtype, {s.N, s.E}});
  i.dout_rows = add(TensorSpec{"dexpert_out", dtype, {Mb, s.C}});
  i.dinp_rows = add(TensorSpec{"dexpert_inp", dtype, {Mb, s.C}});
  i.dtopk_weight = add(TensorSpec{"dtopk_weight", DType::F32, {Nb, s.k}});
  i.dx_router = add(TensorSpec{"dx_router", dtype, {Nb, s.C}});
  i.shared_logit = add(TensorSpec{"shared_logit", dtype, {Ns, 1}});
  i.shared_sum = add(TensorSpec{"shared_sum", dtype, {Ns, s.C}});
  i.dshared_act = add(TensorSpec{"dshared_act", dtype, {Nsb, s.Is}});
  i.dshared_up = add(TensorSpec{"dshared_up", dtype, {Nsb, 2 * s.Is}});
  i.dshared_weight = add(TensorSpec{"dshared_weight", DType::F32, {Nsb, 1}});
  i.send_rows = add(TensorSpec{"expert_send_rows", dtype, {Me, s.C}});
  i.exchange[0] = add(TensorSpec{"expert_exchange_0", dtype, {Re, s.C}});
  i.exchange[1] = add(TensorSpec{"expert_exchange_1", dtype, {Re, s.C}});
  i.to_expert_order = add(TensorSpec{"to_expert_order", DType::I32, {Re}});
  i.to_peer_order = add(TensorSpec{"to_peer_order", DType::I32, {Re}});
  i.send_counts = add(TensorSpec{"expert_send_counts", DType::I32, {s.ep > 1 ? s.E : 0}});
  i.aux_dscores = add(TensorSpec{"aux_dscores", DType::F32, {s.aux ? Nb : 0, s.E}});
  return i;
}

// An expert capacity (ExpertParallel::capacity_factor > 0): after the dispatch, each expert keeps
// its first `capacity` rows (in token order); the other choices are dropped (dest_rows -1) and
// the kept rows close up (offsets and source_rows rewritten). host_offsets: the dispatch's
// offsets read to the host, replaced by the kept ones. Returns the copies dropped.
int64_t moe_apply_capacity(Backend& backend, const MoeActivations& a, int64_t capacity,
                           std::vector<int32_t>& host_offsets, Stream stream);
// The capacity of a micro-batch's experts: ceil(factor x N k / E).
int64_t moe_capacity(double factor, const MoeShape& s);

// The rows this rank's experts saw in the forward that kept `a` (its tokens' M copies without
// expert parallelism; with it, what the peers sent: read from the kept counts).
int64_t moe_expert_rows(Backend& backend, const MoeShape& s, const MoeActivations& a,
                        Stream stream);

// out (N, C) = sum over each token's k experts of weight * expert(x), x (N, C) the norm's output.
// w.up and w.down hold this rank's experts (E / ep). Returns the token copies an expert capacity
// dropped (0 when dropless).
int64_t moe_mlp_forward(Backend& backend, const MlpPart& mlp, const ExpertParallel& ep,
                     const MoeWeights& w, const MoeActivations& a, const MoeWorkspace& ws, Tensor x,
                     Tensor out, Stream stream);
// dx (N, C) = dL/dx (overwritten) from dout (N, C); the weights' gradients g are added to.
// expert_tokens (optional): the copies each of the E experts ran this micro-batch.
void moe_mlp_backward(Backend& backend, const MlpPart& mlp, const ExpertParallel& ep,
                      const MoeWeights& w, const MoeWeights& g, const MoeActivations& a,
                      const MoeWorkspace& ws, Tensor x, Tensor dout, Tensor dx, Stream stream,
                      std::vector<int64_t>* expert_tokens = nullptr);

}  // namespace dstrain
