#include "model/moe_mlp.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/trace.h"

namespace dstrain {

MoeShape moe_shape(const MlpPart& mlp, int64_t tokens, int64_t width, int ep,
                   double capacity_factor) {
  MoeShape s{tokens, mlp.top_k, tokens * mlp.top_k, mlp.experts,
             width,  mlp.width, mlp.shared_width};
  s.ep = ep;
  s.El = mlp.experts / ep;
  // The worst case a rank's experts may receive: every token of every peer sends it a copy for
  // each of its choices among this rank's El experts.
  s.R = ep == 1 ? s.M : ep * tokens * std::min(s.k, s.El);
  // With a capacity, each of the ep senders gives each of this rank's El experts at most its
  // capacity.
  if (capacity_factor > 0) s.R = std::min(s.R, ep * s.El * moe_capacity(capacity_factor, s));
  s.aux = mlp.aux_loss;
  return s;
}

namespace {

// The shared expert's gate as a router: one expert, top 1, a sigmoid score, not renormalized.
constexpr MoeRouting kSharedGate{1, 1, RouterScore::Sigmoid, false, 1.0f};

// out += sigmoid(x @ w_gate) * down(silu(gate(x)) * up(x)); without a gate (DeepSeekMoE's
// shared experts) out += down(silu(gate(x)) * up(x)).
void shared_expert_forward(Backend& backend, const MoeWeights& w, const MoeActivations& a,
                           const MoeWorkspace& ws, Tensor x, Tensor out, Stream stream) {
  backend.matmul_forward(a.shared_up, x, w.shared_up, Tensor(), true, stream);
  backend.swiglu_forward(a.shared_act, a.shared_up, Tensor(), stream);
  backend.matmul_forward(a.shared_out, a.shared_act, w.shared_down, Tensor(), true, stream);
  if (w.shared_gate.empty()) {
    backend.accumulate(out, a.shared_out, stream);
    return;
  }
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
  const bool gated = !w.shared_gate.empty();
  // dL/d(the expert's output): through the gate's scale, or dout itself.
  if (gated) {
    backend.moe_combine_backward(ws.shared_sum, ws.dshared_weight, dout, a.shared_out,
                                 a.shared_dest, a.shared_weight, stream);
  }
  backend.matmul_backward(ws.dshared_act, g.shared_down, Tensor(), gated ? ws.shared_sum : dout,
                          a.shared_act, w.shared_down, true, stream);
  backend.swiglu_backward(ws.dshared_up, ws.dshared_act, a.shared_up, Tensor(), stream);
  backend.matmul_backward(ws.dx_router, g.shared_up, Tensor(), ws.dshared_up, x, w.shared_up, true,
                          stream);
  backend.accumulate(dx, ws.dx_router, stream);
  if (!gated) return;
  backend.moe_route_backward(ws.shared_logit, ws.dshared_weight, Tensor(), a.shared_scores,
                             a.shared_expert, kSharedGate, stream);
  backend.matmul_backward(ws.dx_router, g.shared_gate, Tensor(), ws.shared_logit, x, w.shared_gate,
                          true, stream);
  backend.accumulate(dx, ws.dx_router, stream);
}

}  // namespace

MoeRouting moe_routing(const MlpPart& mlp, Tensor selection_bias) {
  return {static_cast<int>(mlp.experts),
          static_cast<int>(mlp.top_k),
          mlp.sigmoid ? RouterScore::Sigmoid : RouterScore::Softmax,
          mlp.norm_topk,
          mlp.routed_scale,
          static_cast<int>(mlp.groups),
          static_cast<int>(mlp.top_groups),
          mlp.group_top_two ? GroupScore::TopTwoSum : GroupScore::Max,
          selection_bias};
}

Tensor all_experts(Tensor first, int64_t experts) {
  DSTRAIN_CHECK(first.ndim == 2) << first.shape_str();
  first.ndim = 3;
  first.shape[2] = first.shape[1];
  first.shape[1] = first.shape[0];
  first.shape[0] = experts;
  return first;
}

namespace {

// ---- Expert parallelism -------------------------------------------------------------------
//
// The rows this rank sends are its tokens' copies in expert order (moe_dispatch over all E
// experts): peer p's experts are [p El, (p + 1) El), so its rows are one contiguous run. The
// rows received come peer by peer, each peer's in its experts' order; the grouped matmul wants
// them expert by expert, so they are permuted (moe_gather) into expert order, peer by peer within
// each expert -- the order one rank holding every token would have -- and back.

std::vector<int32_t> read_i32(Backend& backend, Tensor t, Stream stream) {
  std::vector<int32_t> host(static_cast<size_t>(t.numel()));
  if (!host.empty()) {
    backend.copy_bytes(host.data(), t.data, t.nbytes(), stream);
    backend.synchronize(stream);
  }
  return host;
}

void write_i32(Backend& backend, Tensor t, const std::vector<int32_t>& host, Stream stream) {
  DSTRAIN_CHECK(static_cast<int64_t>(host.size()) <= t.numel()) << t.shape_str();
  if (host.empty()) return;
  backend.copy_bytes(t.data, host.data(), host.size() * sizeof(int32_t), stream);
  backend.synchronize(stream);  // the host vector dies on return
}

// One micro-batch's exchange, as the host sees it.
struct Exchange {
  std::vector<int64_t> send_rows, recv_rows;  // per peer
  int64_t received = 0;                       // rows this rank's experts get
  std::vector<int32_t> to_expert_order;       // expert-order row i is peer-order row [i]
  std::vector<int32_t> to_peer_order;         // the inverse
  std::vector<int32_t> local_offsets;         // (El + 1) in expert order
};

// offsets: the dispatch's (E + 1); recv_counts: (ep, El) rows from each peer per local expert.
Exchange plan_exchange(const std::vector<int32_t>& offsets, const std::vector<int32_t>& recv_counts,
                       int64_t ep, int64_t El) {
  Exchange x;
  for (int64_t p = 0; p < ep; ++p) {
    x.send_rows.push_back(offsets[static_cast<size_t>((p + 1) * El)] -
                          offsets[static_cast<size_t>(p * El)]);
    int64_t rows = 0;
    for (int64_t e = 0; e < El; ++e) rows += recv_counts[static_cast<size_t>(p * El + e)];
    x.recv_rows.push_back(rows);
    x.received += rows;
  }
  // Where each (peer, expert) run starts in peer order.
  std::vector<int64_t> start(static_cast<size_t>(ep * El));
  for (int64_t i = 0, at = 0; i < ep * El; ++i) {
    start[static_cast<size_t>(i)] = at;
    at += recv_counts[static_cast<size_t>(i)];
  }
  x.local_offsets.push_back(0);
  x.to_peer_order.assign(static_cast<size_t>(x.received), 0);
  for (int64_t e = 0; e < El; ++e) {
    for (int64_t p = 0; p < ep; ++p) {
      const int64_t run = p * El + e;
      for (int32_t r = 0; r < recv_counts[static_cast<size_t>(run)]; ++r) {
        const int64_t peer_row = start[static_cast<size_t>(run)] + r;
        x.to_peer_order[static_cast<size_t>(peer_row)] =
            static_cast<int32_t>(x.to_expert_order.size());
        x.to_expert_order.push_back(static_cast<int32_t>(peer_row));
      }
    }
    x.local_offsets.push_back(static_cast<int32_t>(x.to_expert_order.size()));
  }
  return x;
}

std::vector<int64_t> elements(const std::vector<int64_t>& rows, int64_t C) {
  std::vector<int64_t> n;
  for (int64_t r : rows) n.push_back(r * C);
  return n;
}

// The first `rows` rows of a full-size buffer.
Tensor rows_of(Tensor full, int64_t rows) {
  return full.ndim == 2 ? prefix(full, {rows, full.size(1)}) : prefix(full, {rows});
}

// Uploads the exchange's permutations.
void upload_orders(Backend& backend, const Exchange& x, const MoeWorkspace& ws, Stream stream) {
  write_i32(backend, ws.to_expert_order, x.to_expert_order, stream);
  write_i32(backend, ws.to_peer_order, x.to_peer_order, stream);
}

// rows (M, C), in expert order over all experts -> each peer's (peer order, into `peer_rows`)
// -> expert order into `expert_rows` (R', C). Returns R'.
void send_to_experts(Backend& backend, const ExpertParallel& ep, const Exchange& x, Tensor rows,
                     const MoeWorkspace& ws, Tensor expert_rows, Stream stream) {
  const int64_t C = rows.size(1);
  Tensor peer_rows = rows_of(ws.exchange[0], x.received);
  ep.comm->all_to_all(peer_rows, elements(x.recv_rows, C), rows, elements(x.send_rows, C), stream);
  backend.moe_gather(expert_rows, peer_rows, rows_of(ws.to_expert_order, x.received), stream);
}

// The inverse: expert_rows (R', C) in expert order -> peer order -> back to the rows' owners,
// into `rows` (M, C) in expert order over all experts.
void return_from_experts(Backend& backend, const ExpertParallel& ep, const Exchange& x,
                         Tensor expert_rows, const MoeWorkspace& ws, Tensor rows, Stream stream) {
  const int64_t C = rows.size(1);
  Tensor peer_rows = rows_of(ws.exchange[1], x.received);
  backend.moe_gather(peer_rows, expert_rows, rows_of(ws.to_peer_order, x.received), stream);
  ep.comm->all_to_all(rows, elements(x.send_rows, C), peer_rows, elements(x.recv_rows, C), stream);
}

}  // namespace

namespace {

// The experts' SwiGLU on their rows in expert order: inp (R', C) -> out (R', C).
void experts_forward(Backend& backend, const MoeWeights& w, Tensor inp, Tensor up, Tensor act,
                     Tensor out, Tensor offsets, Stream stream) {
  backend.grouped_matmul_forward(up, inp, w.up, offsets, stream);
  backend.swiglu_forward(act, up, Tensor(), stream);
  backend.grouped_matmul_forward(out, act, w.down, offsets, stream);
}

// Their backward: dout (R', C) -> dinp (R', C), the weights' gradients added to g.
void experts_backward(Backend& backend, const MoeWeights& w, const MoeWeights& g, Tensor inp,
                      Tensor up, Tensor act, Tensor dout, Tensor dup, Tensor dact, Tensor dinp,
                      Tensor offsets, Stream stream) {
  backend.grouped_matmul_backward(dact, g.down, dout, act, w.down, offsets, stream);
  backend.swiglu_backward(dup, dact, up, Tensor(), stream);
  backend.grouped_matmul_backward(dinp, g.up, dup, inp, w.up, offsets, stream);
}

// Expert parallelism: the rows (M, C) of this rank's tokens -> their experts' outputs in
// a.out (M, C). The counts go first (each peer learns what it receives per expert), then the
// rows; the outputs come back the same way.
// offsets: the dispatch's (E + 1), on the host.
void exchanged_experts_forward(Backend& backend, const ExpertParallel& ep, const MoeShape& s,
                               const MoeWeights& w, const MoeActivations& a, const MoeWorkspace& ws,
                               const std::vector<int32_t>& offsets, Stream stream) {
  std::vector<int32_t> counts(static_cast<size_t>(s.E));
  for (int64_t e = 0; e < s.E; ++e) counts[e] = offsets[e + 1] - offsets[e];
  write_i32(backend, ws.send_counts, counts, stream);
  const std::vector<int64_t> per_peer(static_cast<size_t>(s.ep), s.El);
  ep.comm->all_to_all(a.recv_counts, per_peer, ws.send_counts, per_peer, stream);
  const Exchange x = plan_exchange(offsets, read_i32(backend, a.recv_counts, stream), s.ep, s.El);
  DSTRAIN_CHECK(x.received <= s.R) << x.received << " rows for " << s.R;
  write_i32(backend, a.local_offsets, x.local_offsets, stream);
  upload_orders(backend, x, ws, stream);
  const int64_t R = x.received;
  Tensor inp = rows_of(a.inp, R), expert_out = rows_of(ws.exchange[0], R);
  send_to_experts(backend, ep, x, ws.send_rows, ws, inp, stream);
  experts_forward(backend, w, inp, rows_of(a.up, R), rows_of(a.act, R), expert_out, a.local_offsets,
                  stream);
  return_from_experts(backend, ep, x, expert_out, ws, a.out, stream);
}

// Its backward: ws.dout_rows (M, C) -> ws.dinp_rows (M, C); the exchange from the dispatch's
// offsets (host) and the counts forward kept.
void exchanged_experts_backward(Backend& backend, const ExpertParallel& ep, const MoeShape& s,
                                const MoeWeights& w, const MoeWeights& g, const MoeActivations& a,
                                const MoeWorkspace& ws, const std::vector<int32_t>& offsets,
                                Stream stream) {
  const Exchange x = plan_exchange(offsets, read_i32(backend, a.recv_counts, stream), s.ep, s.El);
  upload_orders(backend, x, ws, stream);
  const int64_t R = x.received;
  // ws.exchange[0] is the peer-order staging of send_to_experts, [1] of return_from_experts.
  Tensor dout = rows_of(ws.exchange[1], R), dinp = rows_of(ws.exchange[0], R);
  send_to_experts(backend, ep, x, ws.dout_rows, ws, dout, stream);
  experts_backward(backend, w, g, rows_of(a.inp, R), rows_of(a.up, R), rows_of(a.act, R), dout,
                   rows_of(ws.dup, R), rows_of(ws.dact, R), dinp, a.local_offsets, stream);
  return_from_experts(backend, ep, x, dinp, ws, ws.dinp_rows, stream);
}

}  // namespace

int64_t moe_capacity(double factor, const MoeShape& s) {
  return static_cast<int64_t>(
      std::ceil(factor * static_cast<double>(s.M) / static_cast<double>(s.E)));
}

int64_t moe_apply_capacity(Backend& backend, const MoeActivations& a, int64_t capacity,
                           std::vector<int32_t>& host_offsets, Stream stream) {
  const std::vector<int32_t> offsets = host_offsets;
  const std::vector<int32_t> source = read_i32(backend, a.source_rows, stream);
  std::vector<int32_t> dest = read_i32(backend, a.dest_rows, stream);
  const size_t E = offsets.size() - 1;
  // Each row's expert, and its place among the kept rows (-1: dropped).
  std::vector<int32_t> kept_offsets(E + 1, 0), new_row(source.size(), -1), new_source;
  for (size_t e = 0; e < E; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    const int64_t keep = std::min(rows, capacity);
    for (int64_t r = 0; r < keep; ++r) {
      new_row[static_cast<size_t>(offsets[e] + r)] = static_cast<int32_t>(new_source.size());
      new_source.push_back(source[static_cast<size_t>(offsets[e] + r)]);
    }
    kept_offsets[e + 1] = static_cast<int32_t>(new_source.size());
  }
  for (int32_t& d : dest) d = d < 0 ? -1 : new_row[static_cast<size_t>(d)];
  write_i32(backend, a.offsets, kept_offsets, stream);
  write_i32(backend, a.source_rows, new_source, stream);
  write_i32(backend, a.dest_rows, dest, stream);
  host_offsets = kept_offsets;
  return static_cast<int64_t>(source.size() - new_source.size());
}

int64_t moe_expert_rows(Backend& backend, const MoeShape& s, const MoeActivations& a,
                        Stream stream) {
  if (s.ep == 1) return read_i32(backend, a.offsets, stream).back();  // M, or what a capacity kept
  int64_t rows = 0;
  for (int32_t count : read_i32(backend, a.recv_counts, stream)) rows += count;
  return rows;
}

int64_t moe_mlp_forward(Backend& backend, const MlpPart& mlp, const ExpertParallel& ep,
                        const MoeWeights& w, const MoeActivations& a, const MoeWorkspace& ws,
                        Tensor x, Tensor out, Stream stream) {
  const MoeShape s = moe_shape(mlp, x.size(0), x.size(1), ep.size, ep.capacity_factor);
  const Tensor logits = ws.logits;
  backend.matmul_forward(logits, x, w.router, Tensor(), true, stream);
  backend.moe_route(a.topk_weight, a.topk_expert, a.scores, logits,
                    moe_routing(mlp, w.router_bias), stream);
  backend.moe_dispatch(a.offsets, a.source_rows, a.dest_rows, a.topk_expert,
                       static_cast<int>(mlp.experts), stream);
  // The dispatch's offsets on the host, read once, where a capacity or the exchange needs them.
  std::vector<int32_t> offsets;
  if (ep.capacity_factor > 0 || ep.enabled()) offsets = read_i32(backend, a.offsets, stream);
  const int64_t dropped =
      ep.capacity_factor > 0
          ? moe_apply_capacity(backend, a, moe_capacity(ep.capacity_factor, s), offsets, stream)
          : 0;
  const int64_t rows = s.M - dropped;  // the copies the experts run, in expert order
  if (ep.enabled()) {
    backend.moe_gather(rows_of(ws.send_rows, rows), x, rows_of(a.source_rows, rows), stream);
    exchanged_experts_forward(backend, ep, s, w, a, ws, offsets, stream);
  } else {
    backend.moe_gather(rows_of(a.inp, rows), x, rows_of(a.source_rows, rows), stream);
    experts_forward(backend, w, rows_of(a.inp, rows), rows_of(a.up, rows), rows_of(a.act, rows),
                    rows_of(a.out, rows), a.offsets, stream);
  }
  backend.moe_combine(out, rows_of(a.out, rows), a.dest_rows, a.topk_weight, stream);
  if (mlp.shared_width > 0) shared_expert_forward(backend, w, a, ws, x, out, stream);
  return dropped;
}

void moe_mlp_backward(Backend& backend, const MlpPart& mlp, const ExpertParallel& ep,
                      const MoeWeights& w, const MoeWeights& g, const MoeActivations& a,
                      const MoeWorkspace& ws, Tensor x, Tensor dout, Tensor dx, Stream stream,
                      std::vector<int64_t>* expert_tokens) {
  const MoeShape s = moe_shape(mlp, x.size(0), x.size(1), ep.size, ep.capacity_factor);
  // The dispatch's offsets on the host, read once, where a capacity, the exchange or the
  // caller needs them.
  std::vector<int32_t> offsets;
  if (ep.capacity_factor > 0 || ep.enabled() || expert_tokens != nullptr) {
    offsets = read_i32(backend, a.offsets, stream);
  }
  if (expert_tokens != nullptr) {
    expert_tokens->clear();
    for (size_t e = 0; e + 1 < offsets.size(); ++e) {
      expert_tokens->push_back(offsets[e + 1] - offsets[e]);
    }
  }
  // The copies the experts ran: all M, or what a capacity kept (the dispatch offsets' end).
  const int64_t rows = ep.capacity_factor > 0 ? offsets.back() : s.M;
  backend.moe_combine_backward(rows_of(ws.dout_rows, rows), ws.dtopk_weight, dout,
                               rows_of(a.out, rows), a.dest_rows, a.topk_weight, stream);
  if (ep.enabled()) {
    exchanged_experts_backward(backend, ep, s, w, g, a, ws, offsets, stream);
  } else {
    experts_backward(backend, w, g, rows_of(a.inp, rows), rows_of(a.up, rows), rows_of(a.act, rows),
                     rows_of(ws.dout_rows, rows), rows_of(ws.dup, rows), rows_of(ws.dact, rows),
                     rows_of(ws.dinp_rows, rows), a.offsets, stream);
  }
  // The copies' gradients summed back into token order, then the router's path added.
  backend.moe_combine(dx, rows_of(ws.dinp_rows, rows), a.dest_rows, Tensor(), stream);
  backend.moe_route_backward(ws.logits, ws.dtopk_weight, ws.aux_dscores, a.scores, a.topk_expert,
                             moe_routing(mlp, w.router_bias), stream);
  backend.matmul_backward(ws.dx_router, g.router, Tensor(), ws.logits, x, w.router, true, stream);
  backend.accumulate(dx, ws.dx_router, stream);
  if (mlp.shared_width > 0) shared_expert_backward(backend, w, g, a, ws, x, dout, dx, stream);
}

}  // namespace dstrain
