#include "model/llama.h"

#include <cmath>
#include <cstring>
#include <numbers>

#include "core/rng.h"
#include "model/param_provider.h"
#include "model/transformer_parts.h"

namespace dstrain {

namespace {

// A layer's activations, in LayerRun::activations order.
enum LayerActivation : int {
  kNorm1,
  kNorm1Rstd,
  kQkv,
  kAtty,
  kAttLse,
  kResidual2,
  kNorm2,
  kNorm2Rstd,
  kGateUp,
  kSwiglu,
  kNumLayerActivations
};
// The layers' workspace, in LayerRun::workspace order; every entry always declared (with no
// rows where unused) so that the indices stay fixed.
enum LayerWork : int {
  kScratch,
  kDnorm,
  kDqkv,
  kDgateUp,
  kDswiglu,
  kStreamPart,
  kGathered,
  kRopeFreqs
};
// The head's workspace, in HeadRun::workspace order.
enum HeadWork : int {
  kLogits,
  kNormF,
  kNormFRstd,
  kLosses,
  kDnormF,
  kNormFGathered,
  kDnormFPart,
  kCeStats,
  kCeStatsAll
};

// `first` with `rows` rows: the packed tensors that follow it in the block form one matrix
// (q|k|v, gate|up; model/layout.cpp packs them), or one vector for biases.
Tensor packed_rows(Tensor first, int64_t rows) {
  if (first.empty()) return first;
  first.shape[0] = rows;
  return first;
}

Tensor optional(const std::vector<Tensor>& tensors, int index) {
  return index >= 0 ? tensors[static_cast<size_t>(index)] : Tensor();
}

LlamaArchitecture::LayerTensors find_layer_tensors(const ParamLayout& layout) {
  auto index = [&](const std::string& name) -> int {
    const std::string full = "model.layers.0." + name;
    if (!layout.contains(full)) return -1;
    const std::vector<int>& block = layout.block_params(ParamLayout::layer_block(0));
    const int param = &layout.find(full) - layout.params().data();
    for (size_t i = 0; i < block.size(); ++i) {
      if (block[i] == param) return static_cast<int>(i);
    }
    return -1;
  };
  LlamaArchitecture::LayerTensors t;
  t.attn_norm = index("input_layernorm.weight");
  t.q = index("self_attn.q_proj.weight");
  t.q_bias = index("self_attn.q_proj.bias");
  t.o = index("self_attn.o_proj.weight");
  t.o_bias = index("self_attn.o_proj.bias");
  t.mlp_norm = index("post_attention_layernorm.weight");
  t.gate = index("mlp.gate_proj.weight");
  t.gate_bias = index("mlp.gate_proj.bias");
  t.down = index("mlp.down_proj.weight");
  t.down_bias = index("mlp.down_proj.bias");
  return t;
}

}  // namespace

std::vector<double> rope_inverse_frequencies(const ModelConfig& config) {
  const int64_t hd = config.head_dim();
  std::vector<double> inv_freq(static_cast<size_t>(hd / 2));
  for (int64_t i = 0; i < hd / 2; ++i) {
    inv_freq[static_cast<size_t>(i)] =
        1.0 / std::pow(config.rope_theta, static_cast<double>(2 * i) / static_cast<double>(hd));
  }
  const nlohmann::json& scaling = config.rope_scaling;
  if (scaling.is_null()) return inv_freq;
  // Llama 3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
  const double factor = scaling["factor"], low = scaling["low_freq_factor"];
  const double high = scaling["high_freq_factor"];
  const double context = scaling["original_max_position_embeddings"];
  const double low_freq_wavelength = context / low, high_freq_wavelength = context / high;
  for (double& f : inv_freq) {
    const double wavelength = 2 * std::numbers::pi / f;
    if (wavelength > low_freq_wavelength) {
      f /= factor;
    } else if (wavelength >= high_freq_wavelength) {
      const double smooth = (context / wavelength - low) / (high - low);
      f = (1 - smooth) * f / factor + smooth * f;
    }
  }
  return inv_freq;
}

std::vector<float> rope_table(const std::vector<double>& inv_freq, int64_t T) {
  const size_t half = inv_freq.size();
  std::vector<float> table(static_cast<size_t>(T) * half * 2);
  for (int64_t t = 0; t < T; ++t) {
    for (size_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i];
      const size_t at = (static_cast<size_t>(t) * half + i) * 2;
      table[at] = static_cast<float>(std::cos(angle));
      table[at + 1] = static_cast<float>(std::sin(angle));
    }
  }
  return table;
}

LlamaArchitecture::LlamaArchitecture(const ModelConfig& config, const TensorParallel& tp)
    : config_(config),
      tp_(tp),
      layout_(config, tp.size),
      tensors_(find_layer_tensors(layout_)),
      inv_freq_(rope_inverse_frequencies(config)) {
  DSTRAIN_CHECK(config.llama_family()) << config.name << " is not a LLaMA-family model";
}

LlamaArchitecture::Widths LlamaArchitecture::widths() const {
  const int64_t hd = config_.head_dim(), heads = config_.n_head / tp_.size;
  const int64_t kv_heads = config_.kv_heads() / tp_.size;
  return {heads, kv_heads, (heads + 2 * kv_heads) * hd, heads * hd, config_.mlp_width() / tp_.size};
}

int64_t LlamaArchitecture::vocab_begin() const {
  return tp_.rank * (config_.padded_vocab() / tp_.size);
}

int LlamaArchitecture::head_block() const {
  return layout_.tied_embedding() ? ParamLayout::embedding_block() : layout_.final_block();
}

std::vector<ActivationSpec> LlamaArchitecture::layer_activations(int64_t B, int64_t T, DType dtype,
                                                                 Recompute recompute) const {
  const int64_t C = config_.n_embd, N = B * T, R = tp_.stream_rows(N);
  const Widths w = widths();
  const bool full = recompute == Recompute::Full;
  const bool cheap_kept = recompute == Recompute::None;  // the norms' and SwiGLU's outputs
  std::vector<ActivationSpec> specs(kNumLayerActivations);
  specs[kNorm1] = {{"norm1", dtype, {R, C}}, cheap_kept};
  specs[kNorm1Rstd] = {{"norm1_rstd", DType::F32, {R}}, !full};
  specs[kQkv] = {{"qkv", dtype, {B, T, w.qkv}}, !full};  // q and k rotated
  specs[kAtty] = {{"atty", dtype, {B, T, w.attn}}, !full};
  specs[kAttLse] = {{"att_lse", DType::F32, {B, w.heads, T}}, !full};
  specs[kResidual2] = {{"residual2", dtype, {R, C}}, !full};
  specs[kNorm2] = {{"norm2", dtype, {R, C}}, cheap_kept};
  specs[kNorm2Rstd] = {{"norm2_rstd", DType::F32, {R}}, !full};
  specs[kGateUp] = {{"gate_up", dtype, {N, 2 * w.mlp}}, !full};
  specs[kSwiglu] = {{"swiglu", dtype, {N, w.mlp}}, cheap_kept};
  return specs;
}

std::vector<TensorSpec> LlamaArchitecture::layer_workspace(int64_t B, int64_t T, DType dtype,
                                                           bool with_backward) const {
  const int64_t C = config_.n_embd, N = B * T, Nb = with_backward ? N : 0;
  const Widths w = widths();
  const bool sp = tp_.enabled() && tp_.sequence_parallel;
  return {{"scratch", dtype, {N, C}},  // a row-parallel layer's (partial) output
          {"dnorm", dtype, {Nb, C}},   // dL/d(a norm's output), partial under tp; also datty
          {"dqkv", dtype, {Nb, w.qkv}},
          {"dgate_up", dtype, {Nb, 2 * w.mlp}},
          {"dswiglu", dtype, {Nb, w.mlp}},
          {"stream_part", dtype, {sp ? tp_.stream_rows(N) : 0, C}},
          {"gathered", dtype, {sp ? N : 0, C}},
          // The rotary (cos, sin) table of positions 0..T-1, copied in before each use.
          {"rope_freqs", DType::F32, {T, config_.head_dim() / 2, 2}}};
}

std::vector<TensorSpec> LlamaArchitecture::head_workspace(int64_t B, int64_t T, DType dtype,
                                                          bool with_backward) const {
  const int64_t C = config_.n_embd, N = B * T, R = tp_.stream_rows(N);
  const bool tp = tp_.enabled(), sp = tp && tp_.sequence_parallel;
  // The logits' gradient overwrites them: one (B, T, Vp / tp) buffer.
  return {{"logits", dtype, {B, T, config_.padded_vocab() / tp_.size}},
          {"normf", dtype, {R, C}},
          {"normf_rstd", DType::F32, {R}},
          {"losses", DType::F32, {B, T}},
          {"dnormf", dtype, {with_backward ? N : 0, C}},  // partial under tp
          {"normf_gathered", dtype, {sp ? N : 0, C}},
          {"dnormf_part", dtype, {sp && with_backward ? R : 0, C}},
          {"ce_stats", DType::F32, {tp ? N : 0, 3}},
          {"ce_stats_all", DType::F32, {tp ? tp_.size : 0, N, 3}}};
}

Tensor LlamaArchitecture::sequence_parallel_view(Tensor full, int64_t rows) const {
  return sequence_parallel_rows(tp_, full, rows, config_.n_embd);
}

Tensor LlamaArchitecture::stream_part(const LayerRun& run) const {
  return sequence_parallel_view(run.workspace[kStreamPart], tp_.stream_rows(run.b * run.t));
}

Tensor LlamaArchitecture::gathered(const LayerRun& run) const {
  return sequence_parallel_view(run.workspace[kGathered], run.b * run.t);
}

Tensor LlamaArchitecture::row_parallel(const LayerRun& run, Tensor inp, Tensor weight,
                                       Tensor bias) const {
  Tensor scratch = prefix(run.workspace[kScratch], {run.b * run.t, config_.n_embd});
  return row_parallel_matmul(run.backend, tp_, scratch, stream_part(run), inp, weight, bias, true,
                             run.stream);
}

// The (t, hd/2, 2) rotary table of the micro-batch's positions, in the workspace. The host
// tables are kept (never freed or moved): a stream may copy from them later.
Tensor LlamaArchitecture::rope_freqs(const LayerRun& run) const {
  const int64_t half = config_.head_dim() / 2;
  const float* host = nullptr;
  {
    std::lock_guard<std::mutex> lock(rope_mutex_);
    if (rope_tables_.empty() ||
        static_cast<int64_t>(rope_tables_.back()->size()) < run.t * half * 2) {
      rope_tables_.push_back(
          std::make_unique<const std::vector<float>>(rope_table(inv_freq_, run.t)));
    }
    host = rope_tables_.back()->data();
  }
  Tensor freqs = prefix(run.workspace[kRopeFreqs], {run.t, half, 2});
  run.backend.copy_bytes(freqs.data, host, static_cast<size_t>(freqs.nbytes()), run.stream);
  return freqs;
}

void LlamaArchitecture::embed_forward(ParamProvider& params, const EmbedRun& run, int next) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd, N = b * t;
  const int block = ParamLayout::embedding_block();
  Tensor flat = params.acquire_params(block);
  Tensor output = prefix(run.output, {tp_.stream_rows(N), C});
  // Vocabulary-parallel: each rank embeds the tokens of its rows, zero elsewhere; the sum over
  // the tp ranks is the embedding (the same bits).
  Tensor gathered_rows = sequence_parallel_view(run.workspace.at(kGathered), N);
  Tensor partial = gathered_rows.empty() ? output : gathered_rows;
  run.backend.embedding_forward(partial.reshape({b, t, C}), run.tokens,
                                ParamLayout::view(layout_.find("model.embed_tokens.weight"), flat),
                                Tensor(), vocab_begin(), config_.padded_vocab(), run.stream);
  exit_region_forward(tp_, partial, output, run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_params(block);
}

void LlamaArchitecture::embed_backward(ParamProvider& params, const EmbedRun& run) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd, N = b * t;
  const int block = ParamLayout::embedding_block();
  Tensor dout =
      exit_region_backward(tp_, prefix(run.residual_grad, {tp_.stream_rows(N), C}),
                           sequence_parallel_view(run.workspace.at(kGathered), N), run.stream);
  Tensor grads = params.acquire_grads(block);
  run.backend.embedding_backward(
      ParamLayout::view(layout_.find("model.embed_tokens.weight"), grads), Tensor(),
      dout.reshape({b, t, C}), run.tokens, vocab_begin(), config_.padded_vocab(), run.stream);
  params.release_grads(block);
}

void LlamaArchitecture::layer_forward(const LayerRun& run) const {
  const int64_t b = run.b, t = run.t, C = config_.n_embd, N = b * t, R = tp_.stream_rows(N);
  const Widths wd = widths();
  const float eps = static_cast<float>(config_.norm_eps);
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const LayerTensors& i = tensors_;
  Backend& backend = run.backend;
  Tensor input = prefix(run.input, {R, C}), norm1 = prefix(a[kNorm1], {R, C});
  Tensor qkv = prefix(a[kQkv], {b, t, wd.qkv}), atty = prefix(a[kAtty], {b, t, wd.attn});
  Tensor residual2 = prefix(a[kResidual2], {R, C}), norm2 = prefix(a[kNorm2], {R, C});
  Tensor gate_up = prefix(a[kGateUp], {N, 2 * wd.mlp}), swiglu = prefix(a[kSwiglu], {N, wd.mlp});
  const int heads = static_cast<int>(wd.heads), kv_heads = static_cast<int>(wd.kv_heads);

  backend.rmsnorm_forward(norm1, prefix(a[kNorm1Rstd], {R}), input, w[i.attn_norm], eps,
                          run.stream);
  Tensor norm1_full = enter_region_forward(tp_, norm1, gathered(run), run.stream);
  backend.matmul_forward(qkv.reshape({N, wd.qkv}), norm1_full, packed_rows(w[i.q], wd.qkv),
                         packed_rows(optional(w, i.q_bias), wd.qkv), true, run.stream);
  backend.rope_forward(qkv, rope_freqs(run), heads, kv_heads, run.stream);
  backend.attention_forward(atty, prefix(a[kAttLse], {b, wd.heads, t}), qkv, heads, kv_heads,
                            run.stream);
  Tensor attn_out = row_parallel(run, atty.reshape({N, wd.attn}), w[i.o], optional(w, i.o_bias));
  backend.residual_rmsnorm_forward(residual2, norm2, prefix(a[kNorm2Rstd], {R}), input, attn_out,
                                   w[i.mlp_norm], eps, run.stream);
  Tensor norm2_full = enter_region_forward(tp_, norm2, gathered(run), run.stream);
  backend.matmul_forward(gate_up, norm2_full, packed_rows(w[i.gate], 2 * wd.mlp),
                         packed_rows(optional(w, i.gate_bias), 2 * wd.mlp), true, run.stream);
  backend.swiglu_forward(swiglu, gate_up, run.stream);
  Tensor mlp_out = row_parallel(run, swiglu, w[i.down], optional(w, i.down_bias));
  backend.residual_forward(prefix(run.output, {R, C}), residual2, mlp_out, run.stream);
}

void LlamaArchitecture::layer_recompute(const LayerRun& run, Recompute recompute) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const int64_t mlp = widths().mlp;
  const float eps = static_cast<float>(config_.norm_eps);
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  if (recompute == Recompute::Full) {
    // Only the layer's input was kept: run the layer again (deterministic: the same bits).
    layer_forward(run);
  } else if (recompute == Recompute::Selective) {
    run.backend.rmsnorm_forward(prefix(a[kNorm1], {R, C}), prefix(a[kNorm1Rstd], {R}),
                                prefix(run.input, {R, C}), w[tensors_.attn_norm], eps, run.stream);
    run.backend.rmsnorm_forward(prefix(a[kNorm2], {R, C}), prefix(a[kNorm2Rstd], {R}),
                                prefix(a[kResidual2], {R, C}), w[tensors_.mlp_norm], eps,
                                run.stream);
    run.backend.swiglu_forward(prefix(a[kSwiglu], {N, mlp}), prefix(a[kGateUp], {N, 2 * mlp}),
                               run.stream);
  }
}

// From dL/d(the layer's output) in run.residual_grad to dL/d(residual2) there.
void LlamaArchitecture::mlp_backward(const LayerRun& run, Tensor dout) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const int64_t mlp = widths().mlp;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  const LayerTensors& i = tensors_;
  Backend& backend = run.backend;
  Tensor dswiglu = prefix(run.workspace[kDswiglu], {N, mlp});
  Tensor dgate_up = prefix(run.workspace[kDgateUp], {N, 2 * mlp});
  Tensor dnorm = prefix(run.workspace[kDnorm], {N, C});
  backend.matmul_backward(dswiglu, g[i.down], optional(g, i.down_bias), dout,
                          prefix(a[kSwiglu], {N, mlp}), w[i.down], true, run.stream);
  backend.swiglu_backward(dgate_up, dswiglu, prefix(a[kGateUp], {N, 2 * mlp}), run.stream);
  Tensor norm2_full =
      enter_region_forward(tp_, prefix(a[kNorm2], {R, C}), gathered(run), run.stream);
  backend.matmul_backward(dnorm, packed_rows(g[i.gate], 2 * mlp),
                          packed_rows(optional(g, i.gate_bias), 2 * mlp), dgate_up, norm2_full,
                          packed_rows(w[i.gate], 2 * mlp), true, run.stream);
  Tensor dnorm2 = enter_region_backward(tp_, dnorm, stream_part(run), run.stream);
  backend.rmsnorm_backward(prefix(run.residual_grad, {R, C}), g[i.mlp_norm], dnorm2,
                           prefix(a[kResidual2], {R, C}), w[i.mlp_norm], prefix(a[kNorm2Rstd], {R}),
                           run.stream);
}

// From dL/d(residual2) in run.residual_grad to dL/d(the layer's input) there.
void LlamaArchitecture::attention_backward(const LayerRun& run, Tensor dout) const {
  const int64_t b = run.b, t = run.t, N = b * t, C = config_.n_embd, R = tp_.stream_rows(N);
  const Widths wd = widths();
  const int heads = static_cast<int>(wd.heads), kv_heads = static_cast<int>(wd.kv_heads);
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  const LayerTensors& i = tensors_;
  Backend& backend = run.backend;
  Tensor datty = prefix(run.workspace[kDnorm], {N, wd.attn});
  Tensor dqkv = prefix(run.workspace[kDqkv], {b, t, wd.qkv});
  backend.matmul_backward(datty, g[i.o], optional(g, i.o_bias), dout,
                          prefix(a[kAtty], {N, wd.attn}), w[i.o], true, run.stream);
  backend.attention_backward(dqkv, datty.reshape({b, t, wd.attn}), prefix(a[kQkv], {b, t, wd.qkv}),
                             prefix(a[kAtty], {b, t, wd.attn}),
                             prefix(a[kAttLse], {b, wd.heads, t}), heads, kv_heads, run.stream);
  backend.rope_backward(dqkv, rope_freqs(run), heads, kv_heads, run.stream);
  Tensor norm1_full =
      enter_region_forward(tp_, prefix(a[kNorm1], {R, C}), gathered(run), run.stream);
  Tensor dnorm = prefix(run.workspace[kDnorm], {N, C});
  backend.matmul_backward(dnorm, packed_rows(g[i.q], wd.qkv),
                          packed_rows(optional(g, i.q_bias), wd.qkv), dqkv.reshape({N, wd.qkv}),
                          norm1_full, packed_rows(w[i.q], wd.qkv), true, run.stream);
  Tensor dnorm1 = enter_region_backward(tp_, dnorm, stream_part(run), run.stream);
  backend.rmsnorm_backward(prefix(run.residual_grad, {R, C}), g[i.attn_norm], dnorm1,
                           prefix(run.input, {R, C}), w[i.attn_norm], prefix(a[kNorm1Rstd], {R}),
                           run.stream);
}

// Under sequence parallelism the column-parallel layers' gathered inputs are not kept: backward
// gathers them again (as Megatron does).
void LlamaArchitecture::layer_backward(const LayerRun& run) const {
  const int64_t R = tp_.stream_rows(run.b * run.t), C = config_.n_embd;
  Tensor dresidual = prefix(run.residual_grad, {R, C});
  mlp_backward(run, exit_region_backward(tp_, dresidual, gathered(run), run.stream));
  attention_backward(run, exit_region_backward(tp_, dresidual, gathered(run), run.stream));
}

Tensor LlamaArchitecture::head_logits(const std::vector<Tensor>& workspace, int64_t b,
                                      int64_t t) const {
  return prefix(workspace.at(kLogits), {b, t, config_.padded_vocab() / tp_.size});
}

double LlamaArchitecture::head_forward(ParamProvider& params, const HeadRun& run,
                                       bool release_grads, int next) const {
  const int64_t C = config_.n_embd, Vl = config_.padded_vocab() / tp_.size, N = run.b * run.t;
  const int64_t R = tp_.stream_rows(N);
  const std::vector<Tensor>& ws = run.workspace;
  const int final_block = layout_.final_block(), head = head_block();
  const std::vector<Tensor> w =
      layout_.block_views(final_block, params.acquire_params(final_block));
  run.backend.rmsnorm_forward(prefix(ws[kNormF], {R, C}), prefix(ws[kNormFRstd], {R}),
                              prefix(run.input, {R, C}), w[0], static_cast<float>(config_.norm_eps),
                              run.stream);
  Tensor head_weight;
  if (layout_.tied_embedding()) {
    params.prefetch_params(head);
    params.release_params(final_block);
    head_weight =
        ParamLayout::view(layout_.find("model.embed_tokens.weight"), params.acquire_params(head));
  } else {
    head_weight = w[1];  // lm_head.weight, in the final block
  }
  Tensor logits = prefix(ws[kLogits], {N, Vl});
  Tensor norm_full = enter_region_forward(
      tp_, prefix(ws[kNormF], {R, C}), sequence_parallel_view(ws[kNormFGathered], N), run.stream);
  run.backend.matmul_forward(logits, norm_full, head_weight, Tensor(), true, run.stream);
  if (!run.targets.empty()) {
    DSTRAIN_CHECK(run.targets.ndim == 2 && run.targets.size(0) == run.b &&
                  run.targets.size(1) == run.t)
        << run.targets.shape_str();
    vocab_parallel_cross_entropy(run, tp_, logits, prefix(ws[kLosses], {N}), ws[kCeStats],
                                 ws[kCeStatsAll], vocab_begin(), config_.vocab_size);
  }
  if (run.targets.empty() || run.dloss == 0.0f) {
    params.release_params(head);
    return run.targets.empty() ? 0.0 : mean_loss(run, ws[kLosses], N);
  }
  // Untied: the final block's parameters are still in hand.
  head_backward(params, run, head_weight, norm_full,
                layout_.tied_embedding() ? std::vector<Tensor>() : w, release_grads, next);
  return mean_loss(run, ws[kLosses], N);
}

// The head and the final norm, backward: from the logits' gradient (in place of the logits)
// to dL/d(input) in run.input_grad. norm_full: the head's (gathered) input.
void LlamaArchitecture::head_backward(ParamProvider& params, const HeadRun& run, Tensor head,
                                      Tensor norm_full, std::vector<Tensor> final_weights,
                                      bool release_grads, int next) const {
  const int64_t C = config_.n_embd, Vl = config_.padded_vocab() / tp_.size, N = run.b * run.t;
  const int64_t R = tp_.stream_rows(N);
  const std::vector<Tensor>& ws = run.workspace;
  const int final_block = layout_.final_block();
  const bool tied = layout_.tied_embedding();
  Tensor dnorm = prefix(ws[kDnormF], {N, C});
  Tensor logits_grad = prefix(ws[kLogits], {N, Vl});
  if (tied) {
    const int embed = ParamLayout::embedding_block();
    Tensor grads = params.acquire_grads(embed);
    run.backend.matmul_backward(dnorm,
                                ParamLayout::view(layout_.find("model.embed_tokens.weight"), grads),
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
    run.backend.matmul_backward(dnorm, g[1], Tensor(), logits_grad, norm_full, head, true,
                                run.stream);
  }
  dnorm = enter_region_backward(tp_, dnorm, sequence_parallel_view(ws[kDnormFPart], R), run.stream);
  Tensor input_grad = prefix(run.input_grad, {R, C});
  run.backend.fill_zero(input_grad, run.stream);
  run.backend.rmsnorm_backward(input_grad, g[0], dnorm, prefix(run.input, {R, C}), w[0],
                               prefix(ws[kNormFRstd], {R}), run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_grads(final_block);
  params.release_params(final_block);
}

void init_llama_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                           const std::vector<Tensor>& block_flats) {
  (void)config;
  DSTRAIN_CHECK(static_cast<int>(block_flats.size()) == layout.num_blocks());
  for (int block = 0; block < layout.num_blocks(); ++block) {
    DSTRAIN_CHECK(block_flats[block].numel() == layout.block_numel(block));
    std::memset(block_flats[block].f32(), 0, block_flats[block].nbytes());
  }
  for (const ParamSpec& spec : layout.params()) {
    float* data = ParamLayout::view(spec, block_flats[spec.block]).f32();
    const int64_t n = spec.file_numel();  // padded vocabulary rows stay zero
    if (spec.name.ends_with(".bias")) continue;
    if (spec.name.ends_with("norm.weight")) {
      std::fill(data, data + n, 1.0f);
      continue;
    }
    Rng rng(seed, hash_name(spec.name));
    for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(rng.normal() * 0.02);
  }
}

}  // namespace dstrain
