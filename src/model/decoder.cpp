#include "model/decoder.h"

#include <cmath>

#include "model/decoder_internal.h"
#include "model/moe_aux_loss.h"
#include "model/param_provider.h"
#include "model/transformer_parts.h"

namespace dstrain {

using namespace decoder_internal;

namespace {

// Buffer specs in order, each added with its index.
template <class Spec>
struct IndexedSpecs {
  std::vector<Spec> list;
  int add(Spec spec) {
    list.push_back(std::move(spec));
    return static_cast<int>(list.size()) - 1;
  }
};

// The prefix of an optional buffer (a norm's mean: LayerNorm's only).
Tensor optional_prefix(const std::vector<Tensor>& buffers, int index,
                       std::initializer_list<int64_t> dims) {
  return index >= 0 ? prefix(buffers[static_cast<size_t>(index)], dims) : Tensor();
}

// The position of tensor `name` among its block's tensors, or -1 when the layout has none.
int index_in_block(const ParamLayout& layout, const std::string& name) {
  if (!layout.contains(name)) return -1;
  const ParamSpec& spec = layout.find(name);
  const std::vector<int>& block = layout.block_params(spec.block);
  const int param = static_cast<int>(&spec - layout.params().data());
  for (size_t i = 0; i < block.size(); ++i) {
    if (block[i] == param) return static_cast<int>(i);
  }
  return -1;
}

// Where the tensors of the layers of `kind` (0: those with the parts' MLP, 1: the dense layers
// among MoE layers) are in their blocks, from the first such layer; none when there is none.
Decoder::LayerTensors find_layer_tensors(const ParamLayout& layout, const DecoderParts& parts,
                                         int kind) {
  int64_t layer = 0;
  while (layer < parts.layers && (&parts.layer_mlp(layer) == &parts.mlp ? 0 : 1) != kind) ++layer;
  Decoder::LayerTensors t;
  if (layer == parts.layers) return t;
  const TensorNames& names = parts.names;
  const std::string p = names.layer_prefix + std::to_string(layer) + ".";
  auto index = [&](const std::string& name) { return index_in_block(layout, p + name); };
  t.norm1 = index(names.norm1 + ".weight");
  t.norm1_bias = index(names.norm1 + ".bias");
  if (!names.qkv.empty()) {
    t.qkv = index(names.qkv.front() + ".weight");
    t.qkv_bias = index(names.qkv.front() + ".bias");
  }
  if (parts.attention.latent()) {
    t.q = index(names.q + ".weight");
    t.q_a = index(names.q_a + ".weight");
    t.q_norm = index(names.q_norm + ".weight");
    t.q_b = index(names.q_b + ".weight");
    t.kv_a = index(names.kv_a + ".weight");
    t.kv_norm = index(names.kv_norm + ".weight");
    t.kv_b = index(names.kv_b + ".weight");
  }
  t.o = index(names.o + ".weight");
  t.o_bias = index(names.o + ".bias");
  t.norm2 = index(names.norm2 + ".weight");
  t.norm2_bias = index(names.norm2 + ".bias");
  t.up = index(names.up.front() + ".weight");
  t.up_bias = index(names.up.front() + ".bias");
  t.down = index(names.down + ".weight");
  t.down_bias = index(names.down + ".bias");
  if (parts.layer_mlp(layer).kind == MlpKind::MoE) {
    t.router = index(names.router + ".weight");
    const std::string first = names.experts + std::to_string(layout.first_local_expert()) + ".";
    t.up = index(first + names.expert_up.front() + ".weight");
    t.down = index(first + names.expert_down + ".weight");
    t.shared_up = index(names.shared_expert + names.expert_up.front() + ".weight");
    t.shared_down = index(names.shared_expert + names.expert_down + ".weight");
    t.shared_gate = index(names.shared_gate + ".weight");
    if (!names.router_bias.empty()) t.router_bias = index(names.router_bias);
  }
  return t;
}

// ---- The norm part: LayerNorm or RMSNorm ---------------------------------------------------

// A norm's tensors and statistics: bias and mean empty for RMSNorm.
struct NormArgs {
  Tensor weight, bias;
  Tensor mean, rstd;  // (rows) F32
};

void norm_forward(Backend& backend, const NormPart& norm, Tensor out, Tensor inp, const NormArgs& n,
                  Stream stream) {
  if (norm.kind == NormKind::LayerNorm) {
    backend.layernorm_forward(out, n.mean, n.rstd, inp, n.weight, n.bias, stream);
  } else {
    backend.rmsnorm_forward(out, n.rstd, inp, n.weight, norm.eps, stream);
  }
}

// residual = a + b, then out = the norm of residual (one fused pass where the backend can).
void residual_norm_forward(Backend& backend, const NormPart& norm, Tensor residual, Tensor out,
                           Tensor a, Tensor b, const NormArgs& n, Stream stream) {
  if (norm.kind == NormKind::LayerNorm) {
    backend.residual_layernorm_forward(residual, out, n.mean, n.rstd, a, b, n.weight, n.bias,
                                       stream);
  } else {
    backend.residual_rmsnorm_forward(residual, out, n.rstd, a, b, n.weight, norm.eps, stream);
  }
}

// The gradients of a norm's weight and bias (empty for RMSNorm).
struct NormGrads {
  Tensor weight, bias;
};

// dinp +=, dweight (and dbias) += from dout.
void norm_backward(Backend& backend, const NormPart& norm, Tensor dinp, const NormGrads& grads,
                   Tensor dout, Tensor inp, const NormArgs& n, Stream stream) {
  if (norm.kind == NormKind::LayerNorm) {
    backend.layernorm_backward(dinp, grads.weight, grads.bias, dout, inp, n.weight, n.mean, n.rstd,
                               stream);
  } else {
    backend.rmsnorm_backward(dinp, grads.weight, dout, inp, n.weight, n.rstd, stream);
  }
}

// ---- The MLP part's activation: GELU or SwiGLU ---------------------------------------------

// amax: SwiGLU's only, max |act| on the way (kernels/ops.h swiglu_forward), or empty.
void activation_forward(Backend& backend, const MlpPart& mlp, Tensor act, Tensor up, Tensor amax,
                        Stream stream) {
  DSTRAIN_CHECK(amax.empty() || mlp.kind == MlpKind::SwiGLU) << "only SwiGLU finds an amax";
  if (mlp.kind == MlpKind::Gelu) {
    backend.gelu_forward(act, up, stream);
  } else {
    backend.swiglu_forward(act, up, amax, stream);
  }
}

}  // namespace

// ---- The decoder ---------------------------------------------------------------------------

Decoder::Decoder(const ModelConfig& config, const TensorParallel& tp, const ExpertParallel& ep,
                 Fp8Options fp8)
    : config_(config),
      parts_(decoder_parts(config)),
      tp_(tp),
      ep_(ep),
      fp8_(fp8.enabled),
      fp8_cache_(fp8.enabled && fp8.cache_weights),
      fp8_found_amax_(fp8.enabled && fp8.found_amax),
      layout_(config, tp.size, ep.size, ep.rank),
      tensors_{find_layer_tensors(layout_, parts_, 0), find_layer_tensors(layout_, parts_, 1)},
      // The indices, from specs of any shape that splits over the tp ranks' token rows.
      activations_{layer_activation_specs(0, 1, tp.size, DType::F32, Recompute::None, nullptr),
                   layer_activation_specs(1, 1, tp.size, DType::F32, Recompute::None, nullptr)},
      workspace_(layer_workspace_specs(1, tp.size, DType::F32, true, nullptr)),
      head_buffers_(head_buffer_specs(1, tp.size, DType::F32, true, nullptr)),
      rotary_(parts_.position.kind == PositionKind::Rotary ? rope_inverse_frequencies(config)
                                                           : std::vector<double>(),
              rope_table_magnitude(config)) {
  // (in, out) weights are one tensor per projection: a packed group widens by rows.
  DSTRAIN_CHECK(!parts_.names.in_by_out ||
                (parts_.names.qkv.size() == 1 && parts_.names.up.size() == 1))
      << config.name << ": (in, out) weights split into several tensors";
}

Decoder::Widths Decoder::widths() const {
  const AttentionPart& attn = parts_.attention;
  const int64_t heads = attn.heads / tp_.size, kv_heads = attn.kv_heads / tp_.size;
  const int64_t atty = heads * attn.head_dim;
  return {heads, kv_heads, (heads + 2 * kv_heads) * attn.head_dim,
          attn.latent() ? heads * attn.v_dim : atty, atty};
}

int Decoder::layer_kind(int layer) const { return &parts_.layer_mlp(layer) == &parts_.mlp ? 0 : 1; }

const MlpPart& Decoder::kind_mlp(int kind) const {
  return kind == 0 ? parts_.mlp : parts_.dense_mlp;
}

int64_t Decoder::mlp_width(int kind) const {
  // Experts are whole on every tp rank; a dense MLP is split.
  const MlpPart& mlp = kind_mlp(kind);
  return mlp.kind == MlpKind::MoE ? mlp.width : mlp.width / tp_.size;
}

Tensor Decoder::own_rows(Tensor full) const {
  if (!tp_.enabled() || !tp_.sequence_parallel) return full;
  const int64_t rows = full.size(0) / tp_.size, C = full.size(1);
  return full.slice(tp_.rank * rows * C, {rows, C});
}

int64_t Decoder::vocab_begin() const { return tp_.rank * (config_.padded_vocab() / tp_.size); }

int Decoder::head_block() const {
  return layout_.tied_embedding() ? ParamLayout::embedding_block() : layout_.final_block();
}

// The activations in order: norm1 (out, [mean], rstd), [latent attention's latents, their norms
// and rstds], qkv (q and k rotated), the attention's output and log-sum-exps, [latent attention's
// values], residual2, norm2, the MLP's up projection and activation.
Decoder::LayerActivations Decoder::layer_activation_specs(
    int kind, int64_t B, int64_t T, DType dtype, Recompute recompute,
    std::vector<ActivationSpec>* specs) const {
  const int64_t C = config_.n_embd, N = B * T, R = tp_.stream_rows(N);
  const Widths w = widths();
  const bool full = recompute == Recompute::Full;
  const bool cheap_kept = recompute == Recompute::None;  // the norms' and activation's outputs
  IndexedSpecs<ActivationSpec> list;
  auto add = [&list](ActivationSpec spec) { return list.add(std::move(spec)); };
  LayerActivations a;
  auto add_norm = [&](const std::string& name, int& out, int& mean, int& rstd) {
    out = add({{name, dtype, {R, C}}, cheap_kept});
    if (parts_.norm.keeps_mean()) mean = add({{name + "_mean", DType::F32, {R}}, !full});
    rstd = add({{name + "_rstd", DType::F32, {R}}, !full});
  };
  add_norm("norm1", a.norm1, a.norm1_mean, a.norm1_rstd);
  const AttentionPart& attn = parts_.attention;
  if (attn.latent()) {
    // The latents' norms are recomputed with the block's (selective recompute).
    if (attn.q_rank > 0) {
      a.q_latent = add({{"q_latent", dtype, {N, attn.q_rank}}, !full});
      a.q_normed = add({{"q_latent_norm", dtype, {N, attn.q_rank}}, cheap_kept});
      a.q_rstd = add({{"q_latent_rstd", DType::F32, {N}}, !full});
    }
    a.kv_latent = add({{"kv_latent", dtype, {N, attn.kv_rank}}, !full});
    a.kv_normed = add({{"kv_latent_norm", dtype, {N, attn.kv_rank}}, cheap_kept});
    a.kv_rstd = add({{"kv_latent_rstd", DType::F32, {N}}, !full});
  }
  a.qkv = add({{"qkv", dtype, {B, T, w.qkv}}, !full});
  a.atty = add({{"atty", dtype, {B, T, w.atty}}, !full});
  a.lse = add({{"att_lse", DType::F32, {B, w.heads, T}}, !full});
  if (attn.latent()) a.values = add({{"att_values", dtype, {N, w.attn}}, !full});
  a.residual2 = add({{"residual2", dtype, {R, C}}, !full});
  add_norm("norm2", a.norm2, a.norm2_mean, a.norm2_rstd);
  const MlpPart& mlp = kind_mlp(kind);
  const int64_t rows = mlp_rows(kind, N), width = mlp_width(kind);
  a.up = add({{"mlp_up", dtype, {rows, mlp.up_factor() * width}}, !full});
  a.act = add({{"mlp_act", dtype, {rows, width}}, cheap_kept});
  if (mlp.kind == MlpKind::MoE) a.moe = add_moe_activations(moe_shape_of(N), dtype, !full, add);
  if (fp8_found_amax_) {
    a.fp8_input_amax = add({{"fp8_input_amax", DType::F32, {kFp8Linears}}, true});
  }
  if (specs != nullptr) *specs = std::move(list.list);
  return a;
}

std::vector<ActivationSpec> Decoder::layer_activations(int layer, int64_t B, int64_t T, DType dtype,
                                                       Recompute recompute) const {
  std::vector<ActivationSpec> specs;
  layer_activation_specs(layer_kind(layer), B, T, dtype, recompute, &specs);
  return specs;
}

std::vector<TensorSpec> Decoder::layer_workspace(int64_t B, int64_t T, DType dtype,
                                                 bool with_backward) const {
  std::vector<TensorSpec> specs;
  layer_workspace_specs(B, T, dtype, with_backward, &specs);
  return specs;
}

Decoder::HeadBuffers Decoder::head_buffer_specs(int64_t B, int64_t T, DType dtype,
                                                bool with_backward,
                                                std::vector<TensorSpec>* specs) const {
  const int64_t C = config_.n_embd, N = B * T, R = tp_.stream_rows(N);
  const bool tp = tp_.enabled(), sp = tp && tp_.sequence_parallel;
  IndexedSpecs<TensorSpec> list;
  auto add = [&list](TensorSpec spec) { return list.add(std::move(spec)); };
  HeadBuffers h;
  // The logits' gradient overwrites them (the op allows it): one (B, T, Vp / tp) buffer.
  h.logits = add({"logits", dtype, {B, T, config_.padded_vocab() / tp_.size}});
  h.norm = add({"normf", dtype, {R, C}});
  if (parts_.norm.keeps_mean()) h.norm_mean = add({"normf_mean", DType::F32, {R}});
  h.norm_rstd = add({"normf_rstd", DType::F32, {R}});
  h.losses = add({"losses", DType::F32, {B, T}});
  h.dnorm = add({"dnormf", dtype, {with_backward ? N : 0, C}});  // partial under tp
  h.norm_gathered = add({"normf_gathered", dtype, {sp ? N : 0, C}});
  h.dnorm_part = add({"dnormf_part", dtype, {sp && with_backward ? R : 0, C}});
  // The vocabulary-parallel cross-entropy's row statistics, this rank's and every rank's.
  h.ce_stats = add({"ce_stats", DType::F32, {tp ? N : 0, 3}});
  h.ce_stats_all = add({"ce_stats_all", DType::F32, {tp ? tp_.size : 0, N, 3}});
  if (specs != nullptr) *specs = std::move(list.list);
  return h;
}

std::vector<TensorSpec> Decoder::head_workspace(int64_t B, int64_t T, DType dtype,
                                                bool with_backward) const {
  std::vector<TensorSpec> specs;
  head_buffer_specs(B, T, dtype, with_backward, &specs);
  return specs;
}

Tensor Decoder::sequence_parallel_view(Tensor full, int64_t rows) const {
  return sequence_parallel_rows(tp_, full, rows, config_.n_embd);
}

Tensor Decoder::stream_part(const LayerRun& run) const {
  return sequence_parallel_view(run.workspace[kStreamPart], tp_.stream_rows(run.b * run.t));
}

Tensor Decoder::gathered(const LayerRun& run) const {
  return sequence_parallel_view(run.workspace[kGathered], run.b * run.t);
}

// A projection's weight (or bias) as one matrix of out_width outputs: (out, in) tensors packed
// one after the other (q|k|v, gate|up) are one matrix of their summed rows; an (in, out) tensor
// is one already.
Tensor Decoder::matrix(const std::vector<Tensor>& tensors, int index, int64_t out_width) const {
  Tensor first = optional(tensors, index);
  if (first.empty() || parts_.names.in_by_out) return first;
  first.shape[0] = out_width;
  return first;
}

Tensor Decoder::row_parallel(const LayerRun& run, Fp8Linear which, Tensor inp, Tensor weight,
                             Tensor bias) const {
  Tensor scratch = prefix(run.workspace[kScratch], {run.b * run.t, config_.n_embd});
  return row_parallel_matmul(run.backend, fp8_scratch(run, which), tp_, scratch, stream_part(run),
                             inp, weight, bias, !parts_.names.in_by_out, run.stream);
}

// The (t, d/2, 2) rotary table of the micro-batch's positions (d: the rotary dims of a head),
// in the workspace.
Tensor Decoder::rope_freqs(const LayerRun& run) const {
  const int64_t half = config_.rotary_dim() / 2;
  Tensor freqs = prefix(run.workspace[kRopeFreqs], {run.t, half, 2});
  run.backend.copy_bytes(freqs.data, rotary_.at_least(run.t), static_cast<size_t>(freqs.nbytes()),
                         run.stream);
  return freqs;
}

void Decoder::embed_forward(ParamProvider& params, const EmbedRun& run, int next) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd, N = b * t;
  const int block = ParamLayout::embedding_block();
  Tensor flat = params.acquire_params(block);
  Tensor output = prefix(run.output, {tp_.stream_rows(N), C});
  // Vocabulary-parallel: each rank embeds the tokens of its rows (and adds their positions),
  // zero elsewhere; the sum over the tp ranks is the embedding (the same bits).
  Tensor gathered_rows = sequence_parallel_view(run.workspace.at(kGathered), N);
  Tensor partial = gathered_rows.empty() ? output : gathered_rows;
  Tensor wpe = parts_.position.kind == PositionKind::Learned
                   ? ParamLayout::view(layout_.find(parts_.names.positions), flat)
                   : Tensor();
  run.backend.embedding_forward(partial.reshape({b, t, C}), run.tokens, run.positions,
                                ParamLayout::view(layout_.find(parts_.names.embedding), flat), wpe,
                                vocab_begin(), config_.padded_vocab(), run.stream);
  exit_region_forward(tp_, partial, output, run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_params(block);
}

void Decoder::embed_backward(ParamProvider& params, const EmbedRun& run) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd, N = b * t;
  const int block = ParamLayout::embedding_block();
  Tensor dout =
      exit_region_backward(tp_, prefix(run.residual_grad, {tp_.stream_rows(N), C}),
                           sequence_parallel_view(run.workspace.at(kGathered), N), run.stream);
  Tensor grads = params.acquire_grads(block);
  Tensor dpositions = parts_.position.kind == PositionKind::Learned
                          ? ParamLayout::view(layout_.find(parts_.names.positions), grads)
                          : Tensor();
  run.backend.embedding_backward(ParamLayout::view(layout_.find(parts_.names.embedding), grads),
                                 dpositions, dout.reshape({b, t, C}), run.tokens, run.positions,
                                 vocab_begin(), config_.padded_vocab(), run.stream);
  params.release_grads(block);
}

// The MLP on the (gathered) norm2: the up projection and the activation (mlp_up, mlp_act), then
// the down projection, or the experts. Returns the stream rows of its output.
Tensor Decoder::mlp_forward(const LayerRun& run, Tensor norm2_full) const {
  const int kind = layer_kind(run.layer);
  const MlpPart& part = kind_mlp(kind);
  const int64_t N = run.b * run.t, mlp = mlp_width(kind), up_width = part.up_factor() * mlp;
  const std::vector<Tensor>& w = run.weights;
  const LayerTensors& i = tensors_[kind];
  if (part.kind == MlpKind::MoE) {
    Tensor out = prefix(run.workspace[kScratch], {N, config_.n_embd});
    const MoeActivations moe = moe_activations(run);
    const int64_t dropped =
        moe_mlp_forward(run.backend, parts_.mlp, ep_,
                        routed_moe_weights(run, w, run.expert_weights), moe, moe_workspace(run),
                        norm2_full, out, run.stream);
    if (ep_.aux != nullptr && !run.recomputing) {
      ep_.aux->add_layer(run.backend, moe, run.stream);
    }
    if (ep_.load != nullptr && !run.recomputing && ep_.capacity_factor > 0) {
      ep_.load->add_dropped(run.layer, dropped);
    }
    // Under tp every rank ran the whole experts on all rows: its stream rows are its own, with
    // no reduction.
    return own_rows(out);
  }
  Tensor up = prefix(run.activations[activations_[kind].up], {N, up_width});
  Tensor act = prefix(run.activations[activations_[kind].act], {N, mlp});
  if (part.kind == MlpKind::Gelu && parts_.names.in_by_out && !fp8_) {
    run.backend.matmul_gelu_forward(act, up, norm2_full, w[i.up], optional(w, i.up_bias),
                                    run.stream);
  } else {
    linear_forward(run.backend, fp8_scratch(run, kFp8Up), up, norm2_full, matrix(w, i.up, up_width),
                   matrix(w, i.up_bias, up_width), !parts_.names.in_by_out, run.stream);
    // FP8: SwiGLU finds the down projection's input amax (fp8_scratch: input_amax_found).
    const Fp8Scratch down = fp8_scratch(run, kFp8Down);
    activation_forward(run.backend, part, act, up,
                       down.input_amax_found ? down.input_amax : Tensor(), run.stream);
  }
  return row_parallel(run, kFp8Down, act, w[i.down], optional(w, i.down_bias));
}

// Multi-head attention: the qkv projection, the rotary, the attention ops; or latent attention.
Tensor Decoder::attention_part_forward(const LayerRun& run, Tensor norm1_full) const {
  const int64_t b = run.b, t = run.t, N = b * t;
  const Widths wd = widths();
  const int kind = layer_kind(run.layer);
  if (parts_.attention.latent()) {
    const LatentActivations acts = latent_activations(run);
    latent_attention_forward(run.backend, parts_.attention,
                             latent_heads(parts_.attention, wd.heads),
                             latent_weights(run.weights, kind), acts, latent_workspace(run),
                             norm1_full, rope_freqs(run), run.positions, run.stream);
    return acts.values;
  }
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const LayerTensors& i = tensors_[kind];
  const LayerActivations& ai = activations_[kind];
  Backend& backend = run.backend;
  Tensor qkv = prefix(a[ai.qkv], {b, t, wd.qkv}), atty = prefix(a[ai.atty], {b, t, wd.atty});
  const int heads = static_cast<int>(wd.heads), kv_heads = static_cast<int>(wd.kv_heads);
  linear_forward(backend, fp8_scratch(run, kFp8Qkv), qkv.reshape({N, wd.qkv}), norm1_full,
                 matrix(w, i.qkv, wd.qkv), matrix(w, i.qkv_bias, wd.qkv), !parts_.names.in_by_out,
                 run.stream);
  if (parts_.position.kind == PositionKind::Rotary) {
    backend.rope_forward(qkv, rope_freqs(run), run.positions, heads, kv_heads, run.stream);
  }
  backend.attention_forward(atty, prefix(a[ai.lse], {b, wd.heads, t}), qkv, run.positions, heads,
                            kv_heads, run.stream);
  return atty.reshape({N, wd.attn});
}

void Decoder::layer_forward(const LayerRun& run) const {
  const int64_t C = config_.n_embd, R = tp_.stream_rows(run.b * run.t);
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const LayerTensors& i = tensors_[layer_kind(run.layer)];
  const LayerActivations& ai = activations_[layer_kind(run.layer)];
  Backend& backend = run.backend;
  Tensor input = prefix(run.input, {R, C}), norm1 = prefix(a[ai.norm1], {R, C});
  Tensor residual2 = prefix(a[ai.residual2], {R, C}), norm2 = prefix(a[ai.norm2], {R, C});

  norm_forward(backend, parts_.norm, norm1, input,
               {w[i.norm1], optional(w, i.norm1_bias), optional_prefix(a, ai.norm1_mean, {R}),
                prefix(a[ai.norm1_rstd], {R})},
               run.stream);
  Tensor values =
      attention_part_forward(run, enter_region_forward(tp_, norm1, gathered(run), run.stream));
  Tensor attn_out = row_parallel(run, kFp8O, values, w[i.o], optional(w, i.o_bias));
  residual_norm_forward(backend, parts_.norm, residual2, norm2, input, attn_out,
                        {w[i.norm2], optional(w, i.norm2_bias),
                         optional_prefix(a, ai.norm2_mean, {R}), prefix(a[ai.norm2_rstd], {R})},
                        run.stream);
  Tensor mlp_out = mlp_forward(run, enter_region_forward(tp_, norm2, gathered(run), run.stream));
  backend.residual_forward(prefix(run.output, {R, C}), residual2, mlp_out, run.stream);
}

void Decoder::layer_recompute(const LayerRun& run, Recompute recompute) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const int kind = layer_kind(run.layer);
  const MlpPart& part = kind_mlp(kind);
  const int64_t mlp = mlp_width(kind);
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const LayerTensors& i = tensors_[kind];
  const LayerActivations& ai = activations_[kind];
  if (recompute == Recompute::Full) {
    // Everything but the layer's input was dropped: run the layer again from it. The ops and
    // the collectives are deterministic, so the recomputed activations are the same bits.
    LayerRun again = run;
    again.recomputing = true;
    layer_forward(again);
  } else if (recompute == Recompute::Selective) {
    // The norms' and the activation's outputs were dropped: recompute them from what was kept.
    norm_forward(run.backend, parts_.norm, prefix(a[ai.norm1], {R, C}), prefix(run.input, {R, C}),
                 {w[i.norm1], optional(w, i.norm1_bias), optional_prefix(a, ai.norm1_mean, {R}),
                  prefix(a[ai.norm1_rstd], {R})},
                 run.stream);
    norm_forward(run.backend, parts_.norm, prefix(a[ai.norm2], {R, C}),
                 prefix(a[ai.residual2], {R, C}),
                 {w[i.norm2], optional(w, i.norm2_bias), optional_prefix(a, ai.norm2_mean, {R}),
                  prefix(a[ai.norm2_rstd], {R})},
                 run.stream);
    if (parts_.attention.latent()) {
      latent_attention_recompute(run.backend, parts_.attention, latent_weights(w, kind),
                                 latent_activations(run), run.stream);
    }
    const int64_t rows =
        part.kind == MlpKind::MoE
            ? moe_expert_rows(run.backend, moe_shape_of(N), moe_activations(run), run.stream)
            : N;
    // (A dense layer's FP8 input amax of the down projection is forward's, of the same values.)
    activation_forward(run.backend, part, prefix(a[ai.act], {rows, mlp}),
                       prefix(a[ai.up], {rows, part.up_factor() * mlp}), Tensor(), run.stream);
  }
}

// The dense MLP's backward from dout (the whole rows under sequence parallelism) to dL/d(norm2)
// (partial under tp), returned.
Tensor Decoder::dense_mlp_backward(const LayerRun& run, Tensor dout) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const int kind = layer_kind(run.layer);
  const MlpPart& part = kind_mlp(kind);
  const int64_t mlp = mlp_width(kind), up_width = part.up_factor() * mlp;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  const LayerTensors& i = tensors_[kind];
  const LayerActivations& ai = activations_[kind];
  const bool out_by_in = !parts_.names.in_by_out;
  Backend& backend = run.backend;
  Tensor dact = prefix(run.workspace[kDact], {N, mlp});
  Tensor dup = prefix(run.workspace[kDup], {N, up_width});
  Tensor dnorm = prefix(run.workspace[kDnorm], {N, C});
  Tensor up = prefix(a[ai.up], {N, up_width});
  linear_backward(backend, fp8_scratch(run, kFp8Down), dact, g[i.down], optional(g, i.down_bias),
                  dout, prefix(a[ai.act], {N, mlp}), w[i.down], out_by_in, run.stream);
  Tensor up_bias_grad = matrix(g, i.up_bias, up_width);
  Fp8Scratch up_fp8 = fp8_scratch(run, kFp8Up);
  if (part.kind == MlpKind::SwiGLU && up_fp8.enabled() && fp8_found_amax_) {
    up_fp8.dout_amax = up_fp8.dout_amax_slot();
  }
  if (part.kind == MlpKind::Gelu) {
    // The up bias's gradient (the column sums of dup) in the GELU's pass, not in up's backward.
    backend.gelu_backward_bias(dup, up_bias_grad, dact, up, run.stream);
    up_bias_grad = Tensor();
  } else {  // FP8: dup's amax found on the way, for up's cast of it
    backend.swiglu_backward(dup, dact, up, up_fp8.dout_amax, run.stream);
  }
  Tensor norm2_full =
      enter_region_forward(tp_, prefix(a[ai.norm2], {R, C}), gathered(run), run.stream);
  linear_backward(backend, up_fp8, dnorm, matrix(g, i.up, up_width), up_bias_grad, dup, norm2_full,
                  matrix(w, i.up, up_width), out_by_in, run.stream);
  return dnorm;
}

// The experts' backward from dout (the whole rows): dL/d(norm2) of all rows, the same on every
// tp rank. Their input is norm2 gathered again under sequence parallelism (into a buffer of
// its own: dout holds the usual one until the shared expert's backward).
Tensor Decoder::moe_backward(const LayerRun& run, Tensor dout) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const std::vector<Tensor>& a = run.activations;
  const LayerActivations& ai = activations_[0];
  Tensor dnorm = prefix(run.workspace[kDnorm], {N, C});
  const MoeActivations moe = moe_activations(run);
  const MoeWorkspace ws = moe_workspace(run);
  Tensor x = enter_region_forward(
      tp_, prefix(a[ai.norm2], {R, C}),
      sequence_parallel_view(run.workspace[workspace_.moe_gathered], N),
      run.stream);
  if (ep_.aux != nullptr) {
    ep_.aux->layer_gradient(run.backend, moe, run.t, ws.aux_dscores, run.stream);
  }
  std::vector<int64_t> tokens;
  moe_mlp_backward(run.backend, parts_.mlp, ep_,
                   routed_moe_weights(run, run.weights, run.expert_weights),
                   moe_weights(run.grads, run.expert_grads), moe, ws, x, dout, dnorm, run.stream,
                   ep_.load != nullptr ? &tokens : nullptr);
  if (ep_.load != nullptr) ep_.load->add(run.layer, tokens);
  return dnorm;
}

// From dL/d(the layer's output) (dout: the whole rows under sequence parallelism) to
// dL/d(residual2) in run.residual_grad.
void Decoder::mlp_backward(const LayerRun& run, Tensor dout) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  const LayerTensors& i = tensors_[layer_kind(run.layer)];
  const LayerActivations& ai = activations_[layer_kind(run.layer)];
  // The experts' dnorm is whole on every tp rank already (they ran on all rows); a split MLP's
  // is this rank's part, summed over the ranks.
  const bool moe = kind_mlp(layer_kind(run.layer)).kind == MlpKind::MoE;
  Tensor dnorm2 =
      moe ? own_rows(moe_backward(run, dout))
          : enter_region_backward(tp_, dense_mlp_backward(run, dout), stream_part(run), run.stream);
  norm_backward(run.backend, parts_.norm, prefix(run.residual_grad, {R, C}),
                {g[i.norm2], optional(g, i.norm2_bias)}, dnorm2, prefix(a[ai.residual2], {R, C}),
                {w[i.norm2], optional(w, i.norm2_bias), optional_prefix(a, ai.norm2_mean, {R}),
                 prefix(a[ai.norm2_rstd], {R})},
                run.stream);
}

// The attention part's backward from dvalues (dL/d(the o projection's input), (N, attn)) to
// dL/d(norm1) (N, C) in the kDnorm workspace (this rank's heads' part under tp), returned.
Tensor Decoder::attention_part_backward(const LayerRun& run, Tensor dvalues,
                                        Tensor norm1_full) const {
  const int64_t b = run.b, t = run.t, N = b * t, C = config_.n_embd;
  const Widths wd = widths();
  const int kind = layer_kind(run.layer);
  Tensor dnorm = prefix(run.workspace[kDnorm], {N, C});
  if (parts_.attention.latent()) {
    latent_attention_backward(run.backend, parts_.attention,
                              latent_heads(parts_.attention, wd.heads),
                              latent_weights(run.weights, kind), latent_weights(run.grads, kind),
                              latent_activations(run), latent_workspace(run), norm1_full, dvalues,
                              dnorm, rope_freqs(run), run.positions, run.stream);
    return dnorm;
  }
  const int heads = static_cast<int>(wd.heads), kv_heads = static_cast<int>(wd.kv_heads);
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  const LayerTensors& i = tensors_[kind];
  const LayerActivations& ai = activations_[kind];
  Backend& backend = run.backend;
  Tensor dqkv = prefix(run.workspace[kDqkv], {b, t, wd.qkv});
  backend.attention_backward(dqkv, dvalues.reshape({b, t, wd.attn}),
                             prefix(a[ai.qkv], {b, t, wd.qkv}), prefix(a[ai.atty], {b, t, wd.attn}),
                             prefix(a[ai.lse], {b, wd.heads, t}), run.positions, heads, kv_heads,
                             run.stream);
  if (parts_.position.kind == PositionKind::Rotary) {
    backend.rope_backward(dqkv, rope_freqs(run), run.positions, heads, kv_heads, run.stream);
  }
  // dvalues (in kDnorm) is read: dnorm may overwrite it.
  linear_backward(backend, fp8_scratch(run, kFp8Qkv), dnorm, matrix(g, i.qkv, wd.qkv),
                  matrix(g, i.qkv_bias, wd.qkv), dqkv.reshape({N, wd.qkv}), norm1_full,
                  matrix(w, i.qkv, wd.qkv), !parts_.names.in_by_out, run.stream);
  return dnorm;
}

// From dL/d(residual2) (dout: the whole rows under sequence parallelism) to dL/d(the layer's
// input) in run.residual_grad.
void Decoder::attention_backward(const LayerRun& run, Tensor dout) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const Widths wd = widths();
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  const LayerTensors& i = tensors_[layer_kind(run.layer)];
  const LayerActivations& ai = activations_[layer_kind(run.layer)];
  // The o projection's input: the attention's output, or latent attention's values.
  const bool latent = parts_.attention.latent();
  Tensor values = prefix(a[latent ? ai.values : ai.atty], {N, wd.attn});
  Tensor dvalues = latent ? latent_dvalues(run) : prefix(run.workspace[kDnorm], {N, wd.attn});
  linear_backward(run.backend, fp8_scratch(run, kFp8O), dvalues, g[i.o], optional(g, i.o_bias),
                  dout, values, w[i.o], !parts_.names.in_by_out, run.stream);
  Tensor norm1_full =
      enter_region_forward(tp_, prefix(a[ai.norm1], {R, C}), gathered(run), run.stream);
  Tensor dnorm1 = enter_region_backward(tp_, attention_part_backward(run, dvalues, norm1_full),
                                        stream_part(run), run.stream);
  norm_backward(run.backend, parts_.norm, prefix(run.residual_grad, {R, C}),
                {g[i.norm1], optional(g, i.norm1_bias)}, dnorm1, prefix(run.input, {R, C}),
                {w[i.norm1], optional(w, i.norm1_bias), optional_prefix(a, ai.norm1_mean, {R}),
                 prefix(a[ai.norm1_rstd], {R})},
                run.stream);
}

// Under sequence parallelism the column-parallel layers' gathered inputs are not kept: backward
// gathers them again (as Megatron does), into the buffer the stream's gradient was gathered in.
void Decoder::layer_backward(const LayerRun& run) const {
  const int64_t R = tp_.stream_rows(run.b * run.t), C = config_.n_embd;
  Tensor dresidual = prefix(run.residual_grad, {R, C});
  mlp_backward(run, exit_region_backward(tp_, dresidual, gathered(run), run.stream));
  attention_backward(run, exit_region_backward(tp_, dresidual, gathered(run), run.stream));
}

Tensor Decoder::head_logits(const std::vector<Tensor>& workspace, int64_t b, int64_t t) const {
  return prefix(workspace.at(head_buffers_.logits), {b, t, config_.padded_vocab() / tp_.size});
}

double Decoder::head_forward(ParamProvider& params, const HeadRun& run, bool release_grads,
                             int next) const {
  const int64_t C = config_.n_embd, Vl = config_.padded_vocab() / tp_.size, N = run.b * run.t;
  const int64_t R = tp_.stream_rows(N);
  const std::vector<Tensor>& ws = run.workspace;
  const HeadBuffers& h = head_buffers_;
  const int final_block = layout_.final_block(), head = head_block();
  const std::vector<Tensor> w =
      layout_.block_views(final_block, params.acquire_params(final_block));
  norm_forward(run.backend, parts_.norm, prefix(ws[h.norm], {R, C}), prefix(run.input, {R, C}),
               {w[0], parts_.norm.has_bias() ? w[1] : Tensor(),
                optional_prefix(ws, h.norm_mean, {R}), prefix(ws[h.norm_rstd], {R})},
               run.stream);
  Tensor head_weight;
  if (layout_.tied_embedding()) {
    params.prefetch_params(head);
    params.release_params(final_block);
    head_weight =
        ParamLayout::view(layout_.find(parts_.names.embedding), params.acquire_params(head));
  } else {
    head_weight = w[static_cast<size_t>(index_in_block(layout_, parts_.names.head))];
  }
  Tensor logits = prefix(ws[h.logits], {N, Vl});
  Tensor norm_full = enter_region_forward(
      tp_, prefix(ws[h.norm], {R, C}), sequence_parallel_view(ws[h.norm_gathered], N), run.stream);
  run.backend.matmul_forward(logits, norm_full, head_weight, Tensor(), true, run.stream);
  if (!run.targets.empty()) {
    DSTRAIN_CHECK(run.targets.ndim == 2 && run.targets.size(0) == run.b &&
                  run.targets.size(1) == run.t)
        << run.targets.shape_str();
    vocab_parallel_cross_entropy(run, tp_, logits, prefix(ws[h.losses], {N}), ws[h.ce_stats],
                                 ws[h.ce_stats_all], vocab_begin(), config_.vocab_size);
  }
  if (run.targets.empty() || run.dloss == 0.0f) {
    params.release_params(head);
    return run.targets.empty() ? 0.0 : mean_loss(run, ws[h.losses], N);
  }
  // Untied: the final block's parameters are still in hand.
  head_backward(params, run, head_weight, norm_full,
                layout_.tied_embedding() ? std::vector<Tensor>() : w, release_grads, next);
  return mean_loss(run, ws[h.losses], N);
}

// The head and the final norm, backward: from the logits' gradient (in place of the logits)
// to dL/d(input) in run.input_grad. norm_full: the head's (gathered) input.
void Decoder::head_backward(ParamProvider& params, const HeadRun& run, Tensor head,
                            Tensor norm_full, std::vector<Tensor> final_weights, bool release_grads,
                            int next) const {
  const int64_t C = config_.n_embd, Vl = config_.padded_vocab() / tp_.size, N = run.b * run.t;
  const int64_t R = tp_.stream_rows(N);
  const std::vector<Tensor>& ws = run.workspace;
  const HeadBuffers& h = head_buffers_;
  const int final_block = layout_.final_block();
  const bool tied = layout_.tied_embedding();
  Tensor dnorm = prefix(ws[h.dnorm], {N, C});
  Tensor logits_grad = prefix(ws[h.logits], {N, Vl});
  if (tied) {
    const int embed = ParamLayout::embedding_block();
    Tensor grads = params.acquire_grads(embed);
    run.backend.matmul_backward(dnorm,
                                ParamLayout::view(layout_.find(parts_.names.embedding), grads),
                                Tensor(), logits_grad, norm_full, head, true, run.stream);
    params.prefetch_params(final_block);
    params.release_params(embed);
    if (release_grads) params.release_grads(embed);
  }
  const std::vector<Tensor> w =
      tied ? layout_.block_views(final_block, params.acquire_params(final_block))
           : std::move(final_weights);
  const std::vector<Tensor> g = layout_.block_views(final_block, params.acquire_grads(final_block));
  if (!tied) {
    const auto head_index = static_cast<size_t>(index_in_block(layout_, parts_.names.head));
    run.backend.matmul_backward(dnorm, g[head_index], Tensor(), logits_grad, norm_full, head, true,
                                run.stream);
  }
  dnorm =
      enter_region_backward(tp_, dnorm, sequence_parallel_view(ws[h.dnorm_part], R), run.stream);
  Tensor input_grad = prefix(run.input_grad, {R, C});
  run.backend.fill_zero(input_grad, run.stream);
  const bool bias = parts_.norm.has_bias();
  norm_backward(run.backend, parts_.norm, input_grad, {g[0], bias ? g[1] : Tensor()}, dnorm,
                prefix(run.input, {R, C}),
                {w[0], bias ? w[1] : Tensor(), optional_prefix(ws, h.norm_mean, {R}),
                 prefix(ws[h.norm_rstd], {R})},
                run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_grads(final_block);
  params.release_params(final_block);
}

// ---- The factory (model/architecture.h) ---------------------------------------------------------

std::unique_ptr<Architecture> make_architecture(const ModelConfig& config, const TensorParallel& tp,
                                                const ExpertParallel& ep, Fp8Options fp8) {
  return std::make_unique<Decoder>(config, tp, ep, fp8);
}

}  // namespace dstrain
