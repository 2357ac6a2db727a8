// The decoder's layer workspace (model/decoder.h) and its views of its parts' buffers: the
// mixture-of-experts MLP's weights, activations and workspace, latent attention's, and the FP8
// linears' scratch.
#include "model/decoder.h"

#include <algorithm>
#include <string>

#include "model/decoder_internal.h"

namespace dstrain {

using namespace decoder_internal;

// The decoder's buffers (decoder_internal.h LayerWork), then the MoE part's and latent
// attention's.
Decoder::LayerWorkspace Decoder::layer_workspace_specs(int64_t B, int64_t T, DType dtype,
                                                       bool with_backward,
                                                       std::vector<TensorSpec>* out) const {
  const int64_t C = config_.n_embd, N = B * T, Nb = with_backward ? N : 0;
  // The MLP's gradients, for the largest of the layers' MLPs (MoE and dense layers share them).
  int64_t mlp_rows = 0, up_width = 0, act_width = 0;
  for (int kind : {0, 1}) {
    if (kind == 1 && !parts_.mixed_layers()) break;
    mlp_rows = std::max(mlp_rows, with_backward ? this->mlp_rows(kind, N) : 0);
    up_width = std::max(up_width, kind_mlp(kind).up_factor() * mlp_width(kind));
    act_width = std::max(act_width, mlp_width(kind));
  }
  const Widths w = widths();
  const bool sp = tp_.enabled() && tp_.sequence_parallel;
  std::vector<TensorSpec> specs = {
      {"scratch", dtype, {N, C}},  // a row-parallel layer's (partial) output
      {"dnorm", dtype, {Nb, C}},   // dL/d(a norm's output), partial under tp; also datty
      {"dqkv", dtype, {Nb, w.qkv}},
      {"dmlp_up", dtype, {mlp_rows, up_width}},
      {"dmlp_act", dtype, {mlp_rows, act_width}},
      // Sequence parallelism: this rank's rows of a reduce-scattered sum, and the gathered rows
      // of a column-parallel layer's input (or of the stream's gradient).
      {"stream_part", dtype, {sp ? tp_.stream_rows(N) : 0, C}},
      {"gathered", dtype, {sp ? N : 0, C}}};
  if (parts_.position.kind == PositionKind::Rotary) {
    // The rotary (cos, sin) table of positions 0..T-1, copied in before each use.
    specs.push_back({"rope_freqs", DType::F32, {T, config_.rotary_dim() / 2, 2}});
  }
  DSTRAIN_CHECK(static_cast<int>(specs.size()) ==
                (parts_.position.kind == PositionKind::Rotary ? kRopeFreqs + 1 : kRopeFreqs));
  LayerWorkspace index;
  auto add = [&specs](TensorSpec spec) {
    specs.push_back(std::move(spec));
    return static_cast<int>(specs.size()) - 1;
  };
  if (parts_.mlp.kind == MlpKind::MoE) {
    index.moe = add_moe_workspace(moe_shape_of(N), dtype, with_backward, add);
    index.moe_gathered = add({"moe_gathered", dtype, {sp && with_backward ? N : 0, C}});
    const bool bias_copy = parts_.mlp.selection_bias && dtype != DType::F32;
    const int64_t bias_rows = bias_copy ? parts_.mlp.experts : 0;
    index.router_bias_f32 = add({"router_bias_f32", DType::F32, {bias_rows}});
  }
  if (parts_.attention.latent()) add_latent_workspace(N, Nb, dtype, index, specs);
  if (fp8_) {
    index.fp8_bytes =
        add({"fp8_operands", DType::F8E4M3, {fp8_scratch_bytes_of(N, with_backward)}});
    index.fp8_scales = add({"fp8_scale_invs", DType::F32, {Fp8Scratch::kFp8Scales}});
  }
  if (out != nullptr) *out = std::move(specs);
  return index;
}

// The largest scratch of the linears that run through linear_forward / linear_backward in any
// layer (fp8_linear_widths).
int64_t Decoder::fp8_scratch_bytes_of(int64_t N, bool with_backward) const {
  int64_t bytes = 0;
  for (int layer = 0; layer < config_.n_layer; ++layer) {
    for (const LinearWidths& l : fp8_linear_widths(layer)) {
      if (l.in != 0) bytes = std::max(bytes, fp8_scratch_bytes(N, l.in, l.out, with_backward));
    }
  }
  return bytes;
}

std::array<Decoder::LinearWidths, Decoder::kFp8Linears> Decoder::fp8_linear_widths(
    int layer) const {
  std::array<LinearWidths, kFp8Linears> linears{};
  if (!fp8_) return linears;
  const Widths w = widths();
  const int64_t C = config_.n_embd;
  if (!parts_.attention.latent()) linears[kFp8Qkv] = {C, w.qkv};
  linears[kFp8O] = {w.attn, C};
  const int kind = layer_kind(layer);
  const MlpPart& part = kind_mlp(kind);
  if (part.kind != MlpKind::MoE) {
    linears[kFp8Up] = {C, part.up_factor() * mlp_width(kind)};
    linears[kFp8Down] = {mlp_width(kind), C};
  }
  for (LinearWidths& l : linears) {  // what matmul_fp8 cannot take runs in the activations' dtype
    if (!fp8_linear_fits(16, l.in, l.out)) l = {};
  }
  return linears;
}

std::vector<TensorSpec> Decoder::layer_weight_cache(int layer) const {
  if (!fp8_cache_) return {};
  static constexpr const char* kNames[kFp8Linears] = {"qkv", "o", "up", "down"};
  const std::string prefix = "h." + std::to_string(layer) + ".fp8_weight.";
  std::vector<TensorSpec> specs;
  const auto linears = fp8_linear_widths(layer);
  for (int l = 0; l < kFp8Linears; ++l) {
    if (linears[l].in == 0) continue;
    specs.push_back({prefix + kNames[l], DType::F8E4M3, {linears[l].out, linears[l].in}});
    specs.push_back({prefix + kNames[l] + "_t", DType::F8E4M3, {linears[l].in, linears[l].out}});
  }
  if (!specs.empty()) specs.push_back({prefix + "scale_invs", DType::F32, {kFp8Linears}});
  return specs;
}

Fp8Scratch Decoder::fp8_scratch(const LayerRun& run, Fp8Linear which) const {
  if (!fp8_) return {};
  Fp8Scratch fp8{run.workspace[static_cast<size_t>(workspace_.fp8_bytes)],
                 run.workspace[static_cast<size_t>(workspace_.fp8_scales)]};
  const int kind = layer_kind(run.layer);
  if (fp8_found_amax_) {
    const int amax = activations_[kind].fp8_input_amax;
    fp8.input_amax = run.activations[static_cast<size_t>(amax)].slice(which, {1});
    // mlp_forward has SwiGLU find the down projection's input amax.
    fp8.input_amax_found = which == kFp8Down && kind_mlp(kind).kind == MlpKind::SwiGLU;
  }
  if (run.weight_cache.empty()) return fp8;  // a run without the stage's cache: cast at each use
  // layer_weight_cache()'s order: (w, wt) of each cached linear, then the scale_invs.
  const auto linears = fp8_linear_widths(run.layer);
  if (linears[which].in == 0) return fp8;
  size_t index = 0;
  for (int l = 0; l < which; ++l) index += linears[l].in != 0 ? 2 : 0;
  DSTRAIN_CHECK(index + 2 < run.weight_cache.size())
      << "layer " << run.layer << "'s FP8 weight cache holds " << run.weight_cache.size()
      << " tensors";
  fp8.w = run.weight_cache[index];
  fp8.wt = run.weight_cache[index + 1];
  fp8.weight_scale_inv = run.weight_cache.back().slice(which, {1});
  fp8.weight_fresh = run.weight_cache_fresh;
  return fp8;
}

// Latent attention's scratch (model/latent_attention.h LatentWorkspace; its dqkv is the layers'
// kDqkv), then the o projection's input gradient.
void Decoder::add_latent_workspace(int64_t N, int64_t Nb, DType dtype, LayerWorkspace& w,
                                   std::vector<TensorSpec>& specs) const {
  const AttentionPart& attn = parts_.attention;
  const Widths widths = this->widths();
  const int64_t q_rank_rows = attn.q_rank > 0 ? Nb : 0;
  auto add = [&specs](TensorSpec spec) {
    specs.push_back(std::move(spec));
    return static_cast<int>(specs.size()) - 1;
  };
  w.mla_q = add({"mla_q", dtype, {N, widths.atty}});
  w.mla_kv = add({"mla_kv", dtype, {N, widths.heads * (attn.nope_dim + attn.v_dim)}});
  w.mla_k_rope = add({"mla_k_rope", dtype, {N, attn.rope_dim}});
  w.mla_datty = add({"mla_datty", dtype, {Nb, widths.atty}});
  w.mla_dq_normed = add({"mla_dq_latent_norm", dtype, {q_rank_rows, attn.q_rank}});
  w.mla_dq_latent = add({"mla_dq_latent", dtype, {q_rank_rows, attn.q_rank}});
  w.mla_dkv_normed = add({"mla_dkv_latent_norm", dtype, {Nb, attn.kv_rank}});
  w.mla_dkv_latent = add({"mla_dkv_latent", dtype, {Nb, attn.kv_rank}});
  w.mla_dx_part = add({"mla_dx_part", dtype, {Nb, config_.n_embd}});
  w.mla_dvalues = add({"mla_dvalues", dtype, {Nb, widths.attn}});
}

LatentWorkspace Decoder::latent_workspace(const LayerRun& run) const {
  const AttentionPart& attn = parts_.attention;
  const Widths w = widths();
  const int64_t b = run.b, t = run.t, N = b * t;
  const std::vector<Tensor>& ws = run.workspace;
  const LayerWorkspace& i = workspace_;
  auto view = [&](int index, std::initializer_list<int64_t> dims) {
    return ws[index].numel() > 0 ? prefix(ws[index], dims) : Tensor();
  };
  LatentWorkspace v;
  v.q = view(i.mla_q, {N, w.atty});
  v.kv = view(i.mla_kv, {N, w.heads * (attn.nope_dim + attn.v_dim)});
  v.k_rope = view(i.mla_k_rope, {N, attn.rope_dim});
  v.datty = view(i.mla_datty, {b, t, w.atty});
  v.dqkv = view(kDqkv, {b, t, w.qkv});
  v.dq_normed = view(i.mla_dq_normed, {N, attn.q_rank});
  v.dq_latent = view(i.mla_dq_latent, {N, attn.q_rank});
  v.dkv_normed = view(i.mla_dkv_normed, {N, attn.kv_rank});
  v.dkv_latent = view(i.mla_dkv_latent, {N, attn.kv_rank});
  v.dx_part = view(i.mla_dx_part, {N, config_.n_embd});
  return v;
}

Tensor Decoder::latent_dvalues(const LayerRun& run) const {
  return prefix(run.workspace[workspace_.mla_dvalues], {run.b * run.t, widths().attn});
}

LatentWeights Decoder::latent_weights(const std::vector<Tensor>& tensors, int kind) const {
  const LayerTensors& t = tensors_[kind];
  return {optional(tensors, t.q),   optional(tensors, t.q_a),  optional(tensors, t.q_norm),
          optional(tensors, t.q_b), optional(tensors, t.kv_a), optional(tensors, t.kv_norm),
          optional(tensors, t.kv_b)};
}

LatentActivations Decoder::latent_activations(const LayerRun& run) const {
  const AttentionPart& attn = parts_.attention;
  const Widths w = widths();
  const int64_t b = run.b, t = run.t, N = b * t;
  const std::vector<Tensor>& a = run.activations;
  const LayerActivations& ai = activations_[layer_kind(run.layer)];
  LatentActivations v;
  if (attn.q_rank > 0) {
    v.q_latent = prefix(a[ai.q_latent], {N, attn.q_rank});
    v.q_normed = prefix(a[ai.q_normed], {N, attn.q_rank});
    v.q_rstd = prefix(a[ai.q_rstd], {N});
  }
  v.kv_latent = prefix(a[ai.kv_latent], {N, attn.kv_rank});
  v.kv_normed = prefix(a[ai.kv_normed], {N, attn.kv_rank});
  v.kv_rstd = prefix(a[ai.kv_rstd], {N});
  v.qkv = prefix(a[ai.qkv], {b, t, w.qkv});
  v.atty = prefix(a[ai.atty], {b, t, w.atty});
  v.lse = prefix(a[ai.lse], {b, w.heads, t});
  v.values = prefix(a[ai.values], {N, w.attn});
  return v;
}

MoeShape Decoder::moe_shape_of(int64_t tokens) const {
  return moe_shape(parts_.mlp, tokens, config_.n_embd, ep_.size, ep_.capacity_factor);
}

int64_t Decoder::mlp_rows(int kind, int64_t tokens) const {
  return kind_mlp(kind).kind == MlpKind::MoE ? moe_shape_of(tokens).R : tokens;
}

MoeWeights Decoder::moe_weights(const std::vector<Tensor>& tensors,
                                const std::vector<Tensor>& experts) const {
  const MlpPart& mlp = parts_.mlp;
  const LayerTensors& t = tensors_[0];  // the MoE layers'
  const int64_t local = layout_.local_experts();
  return {tensors[static_cast<size_t>(t.router)],
          all_experts(matrix(experts, t.up, 2 * mlp.width), local),
          all_experts(experts[static_cast<size_t>(t.down)], local),
          matrix(tensors, t.shared_up, 2 * mlp.shared_width),
          optional(tensors, t.shared_down),
          optional(tensors, t.shared_gate),
          optional(tensors, t.router_bias)};
}

MoeWeights Decoder::routed_moe_weights(const LayerRun& run, const std::vector<Tensor>& tensors,
                                       const std::vector<Tensor>& experts) const {
  MoeWeights w = moe_weights(tensors, experts);
  if (w.router_bias.empty() || w.router_bias.dtype == DType::F32) return w;
  Tensor f32 = run.workspace[static_cast<size_t>(workspace_.router_bias_f32)];
  // The F32 values every rank keeps (ExpertParallel::selection_biases), else the parameters'.
  const std::vector<float>* exact = nullptr;
  if (ep_.selection_biases != nullptr) {
    for (const auto& [layer, bias] : *ep_.selection_biases) {
      if (layer == run.layer) exact = &bias;
    }
  }
  if (exact != nullptr) {
    DSTRAIN_CHECK(static_cast<int64_t>(exact->size()) == f32.numel()) << exact->size();
    run.backend.copy_bytes(f32.data, exact->data(), exact->size() * sizeof(float), run.stream);
  } else {
    run.backend.copy(f32, w.router_bias, run.stream);
  }
  w.router_bias = f32;
  return w;
}

MoeWorkspace Decoder::moe_workspace(const LayerRun& run) const {
  const MoeShape s = moe_shape_of(run.b * run.t);
  const std::vector<Tensor>& ws = run.workspace;
  const MoeWorkspaceIndex& i = workspace_.moe;
  // A buffer the pass has no rows for (the gradients without backward, the shared expert's
  // without one) stays an empty view.
  auto view = [&](int index, std::initializer_list<int64_t> dims) {
    return ws[index].numel() > 0 ? prefix(ws[index], dims) : Tensor();
  };
  MoeWorkspace w;
  w.logits = view(i.logits, {s.N, s.E});
  w.dout_rows = view(i.dout_rows, {s.M, s.C});
  w.dinp_rows = view(i.dinp_rows, {s.M, s.C});
  w.dtopk_weight = view(i.dtopk_weight, {s.N, s.k});
  w.dup = view(kDup, {s.R, 2 * s.I});
  w.dact = view(kDact, {s.R, s.I});
  w.dx_router = view(i.dx_router, {s.N, s.C});
  w.shared_logit = view(i.shared_logit, {s.N, 1});
  w.shared_sum = view(i.shared_sum, {s.N, s.C});
  w.dshared_act = view(i.dshared_act, {s.N, s.Is});
  w.dshared_up = view(i.dshared_up, {s.N, 2 * s.Is});
  w.dshared_weight = view(i.dshared_weight, {s.N, 1});
  w.send_rows = view(i.send_rows, {s.M, s.C});
  w.exchange[0] = view(i.exchange[0], {s.R, s.C});
  w.exchange[1] = view(i.exchange[1], {s.R, s.C});
  w.to_expert_order = view(i.to_expert_order, {s.R});
  w.to_peer_order = view(i.to_peer_order, {s.R});
  w.send_counts = view(i.send_counts, {s.E});
  w.aux_dscores = view(i.aux_dscores, {s.N, s.E});
  return w;
}

MoeActivations Decoder::moe_activations(const LayerRun& run) const {
  const MoeShape s = moe_shape_of(run.b * run.t);
  const std::vector<Tensor>& a = run.activations;
  const MoeActivationIndex& i = activations_[0].moe;
  MoeActivations v;
  v.scores = prefix(a[i.scores], {s.N, s.E});
  v.topk_weight = prefix(a[i.topk_weight], {s.N, s.k});
  v.topk_expert = prefix(a[i.topk_expert], {s.N, s.k});
  v.offsets = prefix(a[i.offsets], {s.E + 1});
  v.source_rows = prefix(a[i.source_rows], {s.M});
  v.dest_rows = prefix(a[i.dest_rows], {s.N, s.k});
  v.inp = prefix(a[i.inp], {s.R, s.C});
  v.up = prefix(a[activations_[0].up], {s.R, 2 * s.I});
  v.act = prefix(a[activations_[0].act], {s.R, s.I});
  v.out = prefix(a[i.out], {s.M, s.C});
  if (s.ep > 1) {
    v.recv_counts = prefix(a[i.recv_counts], {s.ep * s.El});
    v.local_offsets = prefix(a[i.local_offsets], {s.El + 1});
  }
  if (s.Is == 0) return v;
  v.shared_up = prefix(a[i.shared_up], {s.N, 2 * s.Is});
  v.shared_act = prefix(a[i.shared_act], {s.N, s.Is});
  v.shared_out = prefix(a[i.shared_out], {s.N, s.C});
  v.shared_scores = prefix(a[i.shared_scores], {s.N, 1});
  v.shared_weight = prefix(a[i.shared_weight], {s.N, 1});
  v.shared_expert = prefix(a[i.shared_expert], {s.N, 1});
  v.shared_offsets = prefix(a[i.shared_offsets], {2});
  v.shared_source = prefix(a[i.shared_source], {s.N});
  v.shared_dest = prefix(a[i.shared_dest], {s.N, 1});
  return v;
}

}  // namespace dstrain
