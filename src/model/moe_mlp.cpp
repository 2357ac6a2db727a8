#include "model/moe_mlp.h"

#include "core/check.h"

namespace dstrain {

MoeShape moe_shape(const MlpPart& mlp, int64_t tokens, int64_t width) {
  return {tokens, mlp.top_k, tokens * mlp.top_k, mlp.experts, width, mlp.width, mlp.shared_width};
}

namespace {

// The shared expert's gate as a router: one expert, top 1, a sigmoid score, not renormalized.
constexpr MoeRouting kSharedGate{1, 1, RouterScore::Sigmoid, false, 1.0f};

// out += sigmoid(x @ w_gate) * down(silu(gate(x)) * up(x)).
void shared_expert_forward(Backend& backend, const MoeWeights& w, const MoeActivations& a,
                           const MoeWorkspace& ws, Tensor x, Tensor out, Stream stream) {
  backend.matmul_forward(a.shared_up, x, w.shared_up, Tensor(), true, stream);
  backend.swiglu_forward(a.shared_act, a.shared_up, stream);
  backend.matmul_forward(a.shared_out, a.shared_act, w.shared_down, Tensor(), true, stream);
  backend.matmul_forward(ws.shared_logit, x, w.shared_gate, Tensor(), true, stream);
  backend.moe_route(a.shared_weight, a.shared_expert, a.shared_scores, ws.shared_logit, kSharedGate,
                    stream);
  // One expert: the dispatch is the identity, and the combine scales each row by its weight.
  backend.moe_dispatch(a.shared_offsets, a.shared_source, a.shared_dest, a.shared_expert, 1,
                       stream);
  backend.moe_combine(ws.shared_sum, a.shared_out, a.shared_dest, a.shared_weight, stream);
  backend.accumulate(out, ws.shared_sum, stream);
}

// dx += the shared expert's and its gate's parts of dL/dx.
void shared_expert_backward(Backend& backend, const MoeWeights& w, const MoeWeights& g,
                            const MoeActivations& a, const MoeWorkspace& ws, Tensor x, Tensor dout,
                            Tensor dx, Stream stream) {
  backend.moe_combine_backward(ws.shared_sum, ws.dshared_weight, dout, a.shared_out, a.shared_dest,
                               a.shared_weight, stream);
  backend.matmul_backward(ws.dshared_act, g.shared_down, Tensor(), ws.shared_sum, a.shared_act,
                          w.shared_down, true, stream);
  backend.swiglu_backward(ws.dshared_up, ws.dshared_act, a.shared_up, stream);
  backend.matmul_backward(ws.dx_router, g.shared_up, Tensor(), ws.dshared_up, x, w.shared_up, true,
                          stream);
  backend.accumulate(dx, ws.dx_router, stream);
  backend.moe_route_backward(ws.shared_logit, ws.dshared_weight, Tensor(), a.shared_scores,
                             a.shared_expert, kSharedGate, stream);
  backend.matmul_backward(ws.dx_router, g.shared_gate, Tensor(), ws.shared_logit, x, w.shared_gate,
                          true, stream);
  backend.accumulate(dx, ws.dx_router, stream);
}

}  // namespace

MoeRouting moe_routing(const MlpPart& mlp) {
  return {static_cast<int>(mlp.experts), static_cast<int>(mlp.top_k), RouterScore::Softmax,
          mlp.norm_topk, 1.0f};
}

Tensor all_experts(Tensor first, int64_t experts) {
  DSTRAIN_CHECK(first.ndim == 2) << first.shape_str();
  first.ndim = 3;
  first.shape[2] = first.shape[1];
  first.shape[1] = first.shape[0];
  first.shape[0] = experts;
  return first;
}

std::vector<TensorSpec> moe_workspace_specs(const MoeShape& s, DType dtype, bool with_backward) {
  const int64_t Mb = with_backward ? s.M : 0, Nb = with_backward ? s.N : 0;
  const int64_t Ns = s.Is > 0 ? s.N : 0, Nsb = s.Is > 0 ? Nb : 0;
  return {{"router_logits", dtype, {s.N, s.E}},   {"dexpert_out", dtype, {Mb, s.C}},
          {"dexpert_inp", dtype, {Mb, s.C}},      {"dtopk_weight", DType::F32, {Nb, s.k}},
          {"dx_router", dtype, {Nb, s.C}},        {"shared_logit", dtype, {Ns, 1}},
          {"shared_sum", dtype, {Ns, s.C}},       {"dshared_act", dtype, {Nsb, s.Is}},
          {"dshared_up", dtype, {Nsb, 2 * s.Is}}, {"dshared_weight", DType::F32, {Nsb, 1}}};
}

void moe_mlp_forward(Backend& backend, const MlpPart& mlp, const MoeWeights& w,
                     const MoeActivations& a, const MoeWorkspace& ws, Tensor x, Tensor out,
                     Stream stream) {
  const Tensor logits = ws.logits;
  backend.matmul_forward(logits, x, w.router, Tensor(), true, stream);
  backend.moe_route(a.topk_weight, a.topk_expert, a.scores, logits, moe_routing(mlp), stream);
  backend.moe_dispatch(a.offsets, a.source_rows, a.dest_rows, a.topk_expert,
                       static_cast<int>(mlp.experts), stream);
  backend.moe_gather(a.inp, x, a.source_rows, stream);
  backend.grouped_matmul_forward(a.up, a.inp, w.up, a.offsets, stream);
  backend.swiglu_forward(a.act, a.up, stream);
  backend.grouped_matmul_forward(a.out, a.act, w.down, a.offsets, stream);
  backend.moe_combine(out, a.out, a.dest_rows, a.topk_weight, stream);
  if (mlp.shared_width > 0) shared_expert_forward(backend, w, a, ws, x, out, stream);
}

void moe_mlp_backward(Backend& backend, const MlpPart& mlp, const MoeWeights& w,
                      const MoeWeights& g, const MoeActivations& a, const MoeWorkspace& ws,
                      Tensor x, Tensor dout, Tensor dx, Stream stream) {
  backend.moe_combine_backward(ws.dout_rows, ws.dtopk_weight, dout, a.out, a.dest_rows,
                               a.topk_weight, stream);
  backend.grouped_matmul_backward(ws.dact, g.down, ws.dout_rows, a.act, w.down, a.offsets, stream);
  backend.swiglu_backward(ws.dup, ws.dact, a.up, stream);
  backend.grouped_matmul_backward(ws.dinp_rows, g.up, ws.dup, a.inp, w.up, a.offsets, stream);
  // The copies' gradients summed back into token order, then the router's path added.
  backend.moe_combine(dx, ws.dinp_rows, a.dest_rows, Tensor(), stream);
  backend.moe_route_backward(ws.logits, ws.dtopk_weight, Tensor(), a.scores, a.topk_expert,
                             moe_routing(mlp), stream);
  backend.matmul_backward(ws.dx_router, g.router, Tensor(), ws.logits, x, w.router, true, stream);
  backend.accumulate(dx, ws.dx_router, stream);
  if (mlp.shared_width > 0) shared_expert_backward(backend, w, g, a, ws, x, dout, dx, stream);
}

}  // namespace dstrain
