#include "model/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/rng.h"
#include "model/transformer_parts.h"

namespace dstrain {

namespace {

// A GPT-2 layer's activations, in LayerRun::activations order.
enum LayerActivation : int {
  kLn1,
  kLn1Mean,
  kLn1Rstd,
  kQkv,
  kAtty,
  kAttLse,
  kResidual2,
  kLn2,
  kLn2Mean,
  kLn2Rstd,
  kFch,
  kFchGelu,
  kNumLayerActivations
};
// The layers' workspace, in LayerRun::workspace order. Every entry is always declared, with no
// rows where it is not used (the gradients without backward; the sequence-parallel buffers
// unless tp > 1 with sequence parallelism), so the indices stay fixed.
enum LayerWork : int { kScratch, kDbtc, kDqkv, kDfch, kDfchGelu, kStreamPart, kGathered };
// The head's workspace, in HeadRun::workspace order, declared the same way.
enum HeadWork : int {
  kLogits,
  kLnf,
  kLnfMean,
  kLnfRstd,
  kLosses,
  kDlnf,
  kLnfGathered,
  kDlnfPart,
  kCeStats,
  kCeStatsAll
};

}  // namespace

Gpt2Architecture::Gpt2Architecture(const ModelConfig& config, const TensorParallel& tp)
    : config_(config), tp_(tp), layout_(config, tp.size) {}

int64_t Gpt2Architecture::heads() const { return config_.n_head / tp_.size; }

std::vector<ActivationSpec> Gpt2Architecture::layer_activations(int64_t B, int64_t T, DType dtype,
                                                                Recompute recompute) const {
  const int64_t C = config_.n_embd, N = B * T, R = tp_.stream_rows(N);
  const int64_t Cl = C / tp_.size, Fl = 4 * C / tp_.size;  // this rank's attention / MLP width
  const bool full = recompute == Recompute::Full;
  const bool cheap_kept = recompute == Recompute::None;  // layernorm and GELU outputs
  std::vector<ActivationSpec> specs(kNumLayerActivations);
  specs[kLn1] = {{"ln1", dtype, {R, C}}, cheap_kept};
  specs[kLn1Mean] = {{"ln1_mean", DType::F32, {R}}, !full};
  specs[kLn1Rstd] = {{"ln1_rstd", DType::F32, {R}}, !full};
  specs[kQkv] = {{"qkv", dtype, {B, T, 3 * Cl}}, !full};
  specs[kAtty] = {{"atty", dtype, {B, T, Cl}}, !full};
  specs[kAttLse] = {{"att_lse", DType::F32, {B, heads(), T}}, !full};
  specs[kResidual2] = {{"residual2", dtype, {R, C}}, !full};
  specs[kLn2] = {{"ln2", dtype, {R, C}}, cheap_kept};
  specs[kLn2Mean] = {{"ln2_mean", DType::F32, {R}}, !full};
  specs[kLn2Rstd] = {{"ln2_rstd", DType::F32, {R}}, !full};
  specs[kFch] = {{"fch", dtype, {N, Fl}}, !full};
  specs[kFchGelu] = {{"fch_gelu", dtype, {N, Fl}}, cheap_kept};
  return specs;
}

std::vector<TensorSpec> Gpt2Architecture::layer_workspace(int64_t B, int64_t T, DType dtype,
                                                          bool with_backward) const {
  const int64_t C = config_.n_embd, N = B * T, Cl = C / tp_.size, Fl = 4 * C / tp_.size;
  const int64_t Nb = with_backward ? N : 0;
  const bool sp = tp_.enabled() && tp_.sequence_parallel;
  return {{"scratch", dtype, {N, C}},  // a row-parallel layer's (partial) output
          {"dbtc", dtype, {Nb, C}},    // dL/d(a layernorm's output), partial under tp
          {"dqkv", dtype, {Nb, 3 * Cl}},
          {"dfch", dtype, {Nb, Fl}},
          {"dfch_gelu", dtype, {Nb, Fl}},
          // Sequence parallelism: this rank's rows of a reduce-scattered sum, and the gathered
          // rows of a column-parallel layer's input (or of the stream's gradient).
          {"stream_part", dtype, {sp ? tp_.stream_rows(N) : 0, C}},
          {"gathered", dtype, {sp ? N : 0, C}}};
}

std::vector<TensorSpec> Gpt2Architecture::head_workspace(int64_t B, int64_t T, DType dtype,
                                                         bool with_backward) const {
  const int64_t C = config_.n_embd, N = B * T, R = tp_.stream_rows(N);
  const bool tp = tp_.enabled(), sp = tp && tp_.sequence_parallel;
  // The gradient of the logits overwrites them (the op allows it): one (B, T, Vp / tp) buffer.
  return {{"logits", dtype, {B, T, config_.padded_vocab() / tp_.size}},
          {"lnf", dtype, {R, C}},
          {"lnf_mean", DType::F32, {R}},
          {"lnf_rstd", DType::F32, {R}},
          {"losses", DType::F32, {B, T}},
          {"dlnf", dtype, {with_backward ? N : 0, C}},  // partial under tp
          {"lnf_gathered", dtype, {sp ? N : 0, C}},
          {"dlnf_part", dtype, {sp && with_backward ? R : 0, C}},
          // The vocabulary-parallel cross-entropy's row statistics, this rank's and every rank's.
          {"ce_stats", DType::F32, {tp ? N : 0, 3}},
          {"ce_stats_all", DType::F32, {tp ? tp_.size : 0, N, 3}}};
}

int64_t Gpt2Architecture::vocab_begin() const {
  return tp_.rank * (config_.padded_vocab() / tp_.size);
}

void Gpt2Architecture::embed_forward(ParamProvider& params, const EmbedRun& run, int next) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd, N = b * t;
  const int block = ParamLayout::embedding_block();
  Tensor flat = params.acquire_params(block);
  Tensor output = prefix(run.output, {tp_.stream_rows(N), C});
  // Vocabulary-parallel: each rank embeds the tokens of its rows of wte (and adds their
  // positions), zero elsewhere; the sum over the tp ranks is the embedding (the same bits).
  Tensor gathered = sequence_parallel_view(run.workspace.at(kGathered), N);
  Tensor partial = gathered.empty() ? output : gathered;
  run.backend.embedding_forward(partial.reshape({b, t, C}), run.tokens,
                                ParamLayout::view(layout_.find("wte.weight"), flat),
                                ParamLayout::view(layout_.find("wpe.weight"), flat), vocab_begin(),
                                config_.padded_vocab(), run.stream);
  exit_region_forward(tp_, partial, output, run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_params(block);
}

void Gpt2Architecture::embed_backward(ParamProvider& params, const EmbedRun& run) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd, N = b * t;
  const int block = ParamLayout::embedding_block();
  Tensor dout =
      exit_region_backward(tp_, prefix(run.residual_grad, {tp_.stream_rows(N), C}),
                           sequence_parallel_view(run.workspace.at(kGathered), N), run.stream);
  Tensor grads = params.acquire_grads(block);
  run.backend.embedding_backward(ParamLayout::view(layout_.find("wte.weight"), grads),
                                 ParamLayout::view(layout_.find("wpe.weight"), grads),
                                 dout.reshape({b, t, C}), run.tokens, vocab_begin(),
                                 config_.padded_vocab(), run.stream);
  params.release_grads(block);
}

Tensor Gpt2Architecture::row_parallel_forward(const LayerRun& run, Tensor inp, Tensor weight,
                                              Tensor bias) const {
  Tensor scratch = prefix(run.workspace[kScratch], {run.b * run.t, config_.n_embd});
  return row_parallel_matmul(run.backend, tp_, scratch, stream_part(run), inp, weight, bias, false,
                             run.stream);
}

Tensor Gpt2Architecture::sequence_parallel_view(Tensor full, int64_t rows) const {
  return sequence_parallel_rows(tp_, full, rows, config_.n_embd);
}

Tensor Gpt2Architecture::stream_part(const LayerRun& run) const {
  return sequence_parallel_view(run.workspace[kStreamPart], tp_.stream_rows(run.b * run.t));
}

Tensor Gpt2Architecture::gathered(const LayerRun& run) const {
  return sequence_parallel_view(run.workspace[kGathered], run.b * run.t);
}

void Gpt2Architecture::layer_forward(const LayerRun& run) const {
  const int64_t b = run.b, t = run.t, C = config_.n_embd, N = b * t, R = tp_.stream_rows(N);
  const int64_t Cl = C / tp_.size, Fl = 4 * C / tp_.size;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  Backend& backend = run.backend;
  Tensor input = prefix(run.input, {R, C});
  Tensor ln1 = prefix(a[kLn1], {R, C}), qkv = prefix(a[kQkv], {b, t, 3 * Cl});
  Tensor atty = prefix(a[kAtty], {b, t, Cl}), residual2 = prefix(a[kResidual2], {R, C});
  Tensor ln2 = prefix(a[kLn2], {R, C}), fch = prefix(a[kFch], {N, Fl});
  Tensor fch_gelu = prefix(a[kFchGelu], {N, Fl});
  backend.layernorm_forward(ln1, prefix(a[kLn1Mean], {R}), prefix(a[kLn1Rstd], {R}), input,
                            w[kLn1Weight], w[kLn1Bias], run.stream);
  Tensor ln1_full = enter_region_forward(tp_, ln1, gathered(run), run.stream);
  backend.matmul_forward(qkv.reshape({N, 3 * Cl}), ln1_full, w[kQkvWeight], w[kQkvBias], false,
                         run.stream);
  backend.attention_forward(atty, prefix(a[kAttLse], {b, heads(), t}), qkv,
                            static_cast<int>(heads()), static_cast<int>(heads()), run.stream);
  Tensor attn_out =
      row_parallel_forward(run, atty.reshape({N, Cl}), w[kAttnProjWeight], w[kAttnProjBias]);
  backend.residual_layernorm_forward(residual2, ln2, prefix(a[kLn2Mean], {R}),
                                     prefix(a[kLn2Rstd], {R}), input, attn_out, w[kLn2Weight],
                                     w[kLn2Bias], run.stream);
  Tensor ln2_full = enter_region_forward(tp_, ln2, gathered(run), run.stream);
  backend.matmul_gelu_forward(fch_gelu, fch, ln2_full, w[kFcWeight], w[kFcBias], run.stream);
  Tensor mlp_out = row_parallel_forward(run, fch_gelu, w[kFcProjWeight], w[kFcProjBias]);
  backend.residual_forward(prefix(run.output, {R, C}), residual2, mlp_out, run.stream);
}

void Gpt2Architecture::layer_recompute(const LayerRun& run, Recompute recompute) const {
  const int64_t N = run.b * run.t, C = config_.n_embd, R = tp_.stream_rows(N);
  const int64_t Fl = 4 * C / tp_.size;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  if (recompute == Recompute::Full) {
    // Everything but the layer's input was dropped: run the layer again from it. The ops and
    // the collectives are deterministic, so the recomputed activations are the same bits.
    layer_forward(run);
  } else if (recompute == Recompute::Selective) {
    // The layernorm and GELU outputs were dropped: recompute them from what was kept.
    run.backend.layernorm_forward(prefix(a[kLn1], {R, C}), prefix(a[kLn1Mean], {R}),
                                  prefix(a[kLn1Rstd], {R}), prefix(run.input, {R, C}),
                                  w[kLn1Weight], w[kLn1Bias], run.stream);
    run.backend.layernorm_forward(prefix(a[kLn2], {R, C}), prefix(a[kLn2Mean], {R}),
                                  prefix(a[kLn2Rstd], {R}), prefix(a[kResidual2], {R, C}),
                                  w[kLn2Weight], w[kLn2Bias], run.stream);
    run.backend.gelu_forward(prefix(a[kFchGelu], {N, Fl}), prefix(a[kFch], {N, Fl}), run.stream);
  }
}

// Under sequence parallelism the column-parallel layers' gathered inputs are not kept: backward
// gathers them again (as Megatron does), into the buffer the stream's gradient was gathered in.
void Gpt2Architecture::layer_backward(const LayerRun& run) const {
  const int64_t b = run.b, t = run.t, C = config_.n_embd, N = b * t, R = tp_.stream_rows(N);
  const int64_t Cl = C / tp_.size, Fl = 4 * C / tp_.size;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  Backend& backend = run.backend;
  const Stream stream = run.stream;
  Tensor dresidual = prefix(run.residual_grad, {R, C});
  Tensor dbtc = prefix(run.workspace[kDbtc], {N, C});
  Tensor dqkv = prefix(run.workspace[kDqkv], {N, 3 * Cl});
  Tensor dfch = prefix(run.workspace[kDfch], {N, Fl});
  Tensor dfch_gelu = prefix(run.workspace[kDfchGelu], {N, Fl});
  // dresidual holds dL/d(output of the layer). The row-parallel biases' gradients come from
  // the whole dout, so they are the same on every tp rank.
  Tensor dout = exit_region_backward(tp_, dresidual, gathered(run), stream);
  backend.matmul_backward(dfch_gelu, g[kFcProjWeight], g[kFcProjBias], dout,
                          prefix(a[kFchGelu], {N, Fl}), w[kFcProjWeight], false, stream);
  // The fc bias's gradient (the column sums of dfch) in the GELU's pass, not in fc's backward.
  backend.gelu_backward_bias(dfch, g[kFcBias], dfch_gelu, prefix(a[kFch], {N, Fl}), stream);
  Tensor ln2_full = enter_region_forward(tp_, prefix(a[kLn2], {R, C}), gathered(run), stream);
  backend.matmul_backward(dbtc, g[kFcWeight], Tensor(), dfch, ln2_full, w[kFcWeight], false,
                          stream);
  Tensor dln2 = enter_region_backward(tp_, dbtc, stream_part(run), stream);
  backend.layernorm_backward(dresidual, g[kLn2Weight], g[kLn2Bias], dln2,
                             prefix(a[kResidual2], {R, C}), w[kLn2Weight], prefix(a[kLn2Mean], {R}),
                             prefix(a[kLn2Rstd], {R}), stream);
  // dresidual holds dL/d(residual2).
  dout = exit_region_backward(tp_, dresidual, gathered(run), stream);
  Tensor datty = prefix(run.workspace[kDbtc], {N, Cl});
  backend.matmul_backward(datty, g[kAttnProjWeight], g[kAttnProjBias], dout,
                          prefix(a[kAtty], {N, Cl}), w[kAttnProjWeight], false, stream);
  backend.attention_backward(dqkv.reshape({b, t, 3 * Cl}), datty.reshape({b, t, Cl}),
                             prefix(a[kQkv], {b, t, 3 * Cl}), prefix(a[kAtty], {b, t, Cl}),
                             prefix(a[kAttLse], {b, heads(), t}), static_cast<int>(heads()),
                             static_cast<int>(heads()), stream);
  Tensor ln1_full = enter_region_forward(tp_, prefix(a[kLn1], {R, C}), gathered(run), stream);
  backend.matmul_backward(dbtc, g[kQkvWeight], g[kQkvBias], dqkv, ln1_full, w[kQkvWeight], false,
                          stream);
  Tensor dln1 = enter_region_backward(tp_, dbtc, stream_part(run), stream);
  backend.layernorm_backward(dresidual, g[kLn1Weight], g[kLn1Bias], dln1, prefix(run.input, {R, C}),
                             w[kLn1Weight], prefix(a[kLn1Mean], {R}), prefix(a[kLn1Rstd], {R}),
                             stream);
  // dresidual holds dL/d(input of the layer).
}

Tensor Gpt2Architecture::head_logits(const std::vector<Tensor>& workspace, int64_t b,
                                     int64_t t) const {
  return prefix(workspace.at(kLogits), {b, t, config_.padded_vocab() / tp_.size});
}

void Gpt2Architecture::cross_entropy(const HeadRun& run, Tensor logits) const {
  const std::vector<Tensor>& ws = run.workspace;
  const int64_t N = run.b * run.t;
  vocab_parallel_cross_entropy(run, tp_, logits, prefix(ws[kLosses], {N}), ws[kCeStats],
                               ws[kCeStatsAll], vocab_begin(), config_.vocab_size);
}

double Gpt2Architecture::head_forward(ParamProvider& params, const HeadRun& run, bool release_grads,
                                      int next) const {
  const int64_t C = config_.n_embd, Vl = config_.padded_vocab() / tp_.size, N = run.b * run.t;
  const int64_t R = tp_.stream_rows(N);
  const std::vector<Tensor>& ws = run.workspace;
  const int final_block = layout_.final_block(), embed_block = ParamLayout::embedding_block();
  {
    const std::vector<Tensor> w =
        layout_.block_views(final_block, params.acquire_params(final_block));
    run.backend.layernorm_forward(prefix(ws[kLnf], {R, C}), prefix(ws[kLnfMean], {R}),
                                  prefix(ws[kLnfRstd], {R}), prefix(run.input, {R, C}), w[0], w[1],
                                  run.stream);
    params.prefetch_params(embed_block);
    params.release_params(final_block);
  }
  Tensor wte = ParamLayout::view(layout_.find("wte.weight"), params.acquire_params(embed_block));
  Tensor logits = prefix(ws[kLogits], {N, Vl});
  Tensor lnf_full = enter_region_forward(tp_, prefix(ws[kLnf], {R, C}),
                                         sequence_parallel_view(ws[kLnfGathered], N), run.stream);
  run.backend.matmul_forward(logits, lnf_full, wte, Tensor(), true, run.stream);
  if (run.targets.empty()) {
    params.release_params(embed_block);
    return 0.0;
  }
  DSTRAIN_CHECK(run.targets.ndim == 2 && run.targets.size(0) == run.b &&
                run.targets.size(1) == run.t)
      << run.targets.shape_str();
  cross_entropy(run, logits);
  if (run.dloss != 0.0f) {
    head_backward(params, run, wte, lnf_full, release_grads, next);  // releases the embedding
  } else {
    params.release_params(embed_block);
  }
  return mean_loss(run, ws[kLosses], N);
}

// The tied LM head and the final layernorm, backward: from the logits' gradient (in place of
// the logits) to dL/d(input) in run.input_grad. lnf_full: the head's (gathered) input.
void Gpt2Architecture::head_backward(ParamProvider& params, const HeadRun& run, Tensor wte,
                                     Tensor lnf_full, bool release_grads, int next) const {
  const int64_t C = config_.n_embd, Vl = config_.padded_vocab() / tp_.size, N = run.b * run.t;
  const int64_t R = tp_.stream_rows(N);
  const std::vector<Tensor>& ws = run.workspace;
  const int final_block = layout_.final_block(), embed_block = ParamLayout::embedding_block();
  Tensor dlnf = prefix(ws[kDlnf], {N, C});
  {
    Tensor grads = params.acquire_grads(embed_block);
    run.backend.matmul_backward(dlnf, ParamLayout::view(layout_.find("wte.weight"), grads),
                                Tensor(), prefix(ws[kLogits], {N, Vl}), lnf_full, wte, true,
                                run.stream);
    params.prefetch_params(final_block);
    params.release_params(embed_block);
    if (release_grads) params.release_grads(embed_block);
  }
  dlnf = enter_region_backward(tp_, dlnf, sequence_parallel_view(ws[kDlnfPart], R), run.stream);
  const std::vector<Tensor> w =
      layout_.block_views(final_block, params.acquire_params(final_block));
  const std::vector<Tensor> g = layout_.block_views(final_block, params.acquire_grads(final_block));
  Tensor input_grad = prefix(run.input_grad, {R, C});
  run.backend.fill_zero(input_grad, run.stream);
  run.backend.layernorm_backward(input_grad, g[0], g[1], dlnf, prefix(run.input, {R, C}), w[0],
                                 prefix(ws[kLnfMean], {R}), prefix(ws[kLnfRstd], {R}), run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_grads(final_block);
  params.release_params(final_block);
}

Gpt2::Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B, int64_t T,
           DType act_dtype, bool with_backward, Recompute recompute)
    : arch_(config),
      stage_(arch_, whole_model(config), backend, allocator, B, T, act_dtype, with_backward,
             recompute, 1) {}

double Gpt2::forward(ParamProvider& params, Tensor tokens, Tensor targets, float dloss,
                     Stream stream) {
  DSTRAIN_CHECK(tokens.ndim == 2 && tokens.dtype == DType::I32) << tokens.shape_str();
  return stage_.forward(params, 0, tokens.size(0), tokens.size(1), tokens, targets, dloss, stream);
}

void Gpt2::backward(ParamProvider& params, Tensor tokens, Stream stream) {
  stage_.backward(params, 0, tokens, stream);
}

void init_gpt2_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                          const std::vector<Tensor>& block_flats) {
  DSTRAIN_CHECK(static_cast<int>(block_flats.size()) == layout.num_blocks());
  for (int block = 0; block < layout.num_blocks(); ++block) {
    DSTRAIN_CHECK(block_flats[block].numel() == layout.block_numel(block));
    std::memset(block_flats[block].f32(), 0, block_flats[block].nbytes());
  }
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer));
  for (const ParamSpec& spec : layout.params()) {
    float* data = ParamLayout::view(spec, block_flats[spec.block]).f32();
    const int64_t n = spec.file_numel();  // padded vocabulary rows stay zero
    const std::string& name = spec.name;
    if (name.ends_with(".bias")) continue;
    if (name.find("ln_") != std::string::npos) {
      for (int64_t i = 0; i < n; ++i) data[i] = 1.0f;
      continue;
    }
    const double stddev = name.ends_with("c_proj.weight") ? residual_std : 0.02;
    Rng rng(seed, hash_name(name));
    for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(rng.normal() * stddev);
  }
}

}  // namespace dstrain
