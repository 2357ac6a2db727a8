#include "model/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/rng.h"

namespace dstrain {

std::unique_ptr<Architecture> make_architecture(const ModelConfig& config) {
  return std::make_unique<Gpt2Architecture>(config);
}

namespace {

// A GPT-2 layer's activations, in LayerRun::activations order.
enum LayerActivation : int {
  kLn1, kLn1Mean, kLn1Rstd, kQkv, kAtty, kAttLse, kResidual2, kLn2, kLn2Mean, kLn2Rstd, kFch,
  kFchGelu, kNumLayerActivations
};
// The layers' workspace, in LayerRun::workspace order (the gradients with backward only).
enum LayerWork : int { kScratch, kDbtc, kDqkv, kDfch, kDfchGelu };
// The head's workspace, in HeadRun::workspace order (dlnf with backward only).
enum HeadWork : int { kLogits, kLnf, kLnfMean, kLnfRstd, kLosses, kDlnf };

}  // namespace

Gpt2Architecture::Gpt2Architecture(const ModelConfig& config) : config_(config), layout_(config) {}

std::vector<ActivationSpec> Gpt2Architecture::layer_activations(int64_t B, int64_t T, DType dtype,
                                                                Recompute recompute) const {
  const int64_t C = config_.n_embd, NH = config_.n_head;
  const bool full = recompute == Recompute::Full;
  const bool cheap_kept = recompute == Recompute::None;  // layernorm and GELU outputs
  std::vector<ActivationSpec> specs(kNumLayerActivations);
  specs[kLn1] = {{"ln1", dtype, {B, T, C}}, cheap_kept};
  specs[kLn1Mean] = {{"ln1_mean", DType::F32, {B, T}}, !full};
  specs[kLn1Rstd] = {{"ln1_rstd", DType::F32, {B, T}}, !full};
  specs[kQkv] = {{"qkv", dtype, {B, T, 3 * C}}, !full};
  specs[kAtty] = {{"atty", dtype, {B, T, C}}, !full};
  specs[kAttLse] = {{"att_lse", DType::F32, {B, NH, T}}, !full};
  specs[kResidual2] = {{"residual2", dtype, {B, T, C}}, !full};
  specs[kLn2] = {{"ln2", dtype, {B, T, C}}, cheap_kept};
  specs[kLn2Mean] = {{"ln2_mean", DType::F32, {B, T}}, !full};
  specs[kLn2Rstd] = {{"ln2_rstd", DType::F32, {B, T}}, !full};
  specs[kFch] = {{"fch", dtype, {B, T, 4 * C}}, !full};
  specs[kFchGelu] = {{"fch_gelu", dtype, {B, T, 4 * C}}, cheap_kept};
  return specs;
}

std::vector<TensorSpec> Gpt2Architecture::layer_workspace(int64_t B, int64_t T, DType dtype,
                                                          bool with_backward) const {
  const int64_t C = config_.n_embd;
  std::vector<TensorSpec> specs = {{"scratch", dtype, {B, T, C}}};
  if (with_backward) {
    specs.push_back({"dbtc", dtype, {B, T, C}});
    specs.push_back({"dqkv", dtype, {B, T, 3 * C}});
    specs.push_back({"dfch", dtype, {B, T, 4 * C}});
    specs.push_back({"dfch_gelu", dtype, {B, T, 4 * C}});
  }
  return specs;
}

std::vector<TensorSpec> Gpt2Architecture::head_workspace(int64_t B, int64_t T, DType dtype,
                                                         bool with_backward) const {
  const int64_t C = config_.n_embd;
  // The gradient of the logits overwrites them (the op allows it): one (B, T, Vp) buffer.
  std::vector<TensorSpec> specs = {{"logits", dtype, {B, T, config_.padded_vocab()}},
                                   {"lnf", dtype, {B, T, C}},
                                   {"lnf_mean", DType::F32, {B, T}},
                                   {"lnf_rstd", DType::F32, {B, T}},
                                   {"losses", DType::F32, {B, T}}};
  if (with_backward) specs.push_back({"dlnf", dtype, {B, T, C}});
  return specs;
}

void Gpt2Architecture::embed_forward(ParamProvider& params, const EmbedRun& run, int next) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd;
  const int block = ParamLayout::embedding_block();
  Tensor flat = params.acquire_params(block);
  run.backend.embedding_forward(prefix(run.output, {b, t, C}), run.tokens,
                                ParamLayout::view(layout_.find("wte.weight"), flat),
                                ParamLayout::view(layout_.find("wpe.weight"), flat), run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_params(block);
}

void Gpt2Architecture::embed_backward(ParamProvider& params, const EmbedRun& run) const {
  const int64_t b = run.tokens.size(0), t = run.tokens.size(1), C = config_.n_embd;
  const int block = ParamLayout::embedding_block();
  Tensor grads = params.acquire_grads(block);
  run.backend.embedding_backward(ParamLayout::view(layout_.find("wte.weight"), grads),
                                 ParamLayout::view(layout_.find("wpe.weight"), grads),
                                 prefix(run.residual_grad, {b, t, C}), run.tokens, run.stream);
  params.release_grads(block);
}

void Gpt2Architecture::layer_forward(const LayerRun& run) const {
  const int64_t b = run.b, t = run.t, C = config_.n_embd, N = b * t;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  Backend& backend = run.backend;
  Tensor scratch = prefix(run.workspace[kScratch], {N, C});
  Tensor input = prefix(run.input, {N, C});
  Tensor ln1 = prefix(a[kLn1], {N, C}), qkv = prefix(a[kQkv], {b, t, 3 * C});
  Tensor atty = prefix(a[kAtty], {b, t, C}), residual2 = prefix(a[kResidual2], {N, C});
  Tensor ln2 = prefix(a[kLn2], {N, C}), fch = prefix(a[kFch], {N, 4 * C});
  Tensor fch_gelu = prefix(a[kFchGelu], {N, 4 * C});
  backend.layernorm_forward(ln1, prefix(a[kLn1Mean], {N}), prefix(a[kLn1Rstd], {N}), input,
                            w[kLn1Weight], w[kLn1Bias], run.stream);
  backend.matmul_forward(qkv.reshape({N, 3 * C}), ln1, w[kQkvWeight], w[kQkvBias], false,
                         run.stream);
  backend.attention_forward(atty, prefix(a[kAttLse], {b, config_.n_head, t}), qkv,
                            static_cast<int>(config_.n_head), run.stream);
  backend.matmul_forward(scratch, atty.reshape({N, C}), w[kAttnProjWeight], w[kAttnProjBias],
                         false, run.stream);
  backend.residual_forward(residual2, input, scratch, run.stream);
  backend.layernorm_forward(ln2, prefix(a[kLn2Mean], {N}), prefix(a[kLn2Rstd], {N}), residual2,
                            w[kLn2Weight], w[kLn2Bias], run.stream);
  backend.matmul_gelu_forward(fch_gelu, fch, ln2, w[kFcWeight], w[kFcBias], run.stream);
  backend.matmul_forward(scratch, fch_gelu, w[kFcProjWeight], w[kFcProjBias], false, run.stream);
  backend.residual_forward(prefix(run.output, {N, C}), residual2, scratch, run.stream);
}

void Gpt2Architecture::layer_recompute(const LayerRun& run, Recompute recompute) const {
  const int64_t N = run.b * run.t, C = config_.n_embd;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  if (recompute == Recompute::Full) {
    // Everything but the layer's input was dropped: run the layer again from it. The ops are
    // deterministic, so the recomputed activations are the same bits.
    layer_forward(run);
  } else if (recompute == Recompute::Selective) {
    // The layernorm and GELU outputs were dropped: recompute them from what was kept.
    run.backend.layernorm_forward(prefix(a[kLn1], {N, C}), prefix(a[kLn1Mean], {N}),
                                  prefix(a[kLn1Rstd], {N}), prefix(run.input, {N, C}),
                                  w[kLn1Weight], w[kLn1Bias], run.stream);
    run.backend.layernorm_forward(prefix(a[kLn2], {N, C}), prefix(a[kLn2Mean], {N}),
                                  prefix(a[kLn2Rstd], {N}), prefix(a[kResidual2], {N, C}),
                                  w[kLn2Weight], w[kLn2Bias], run.stream);
    run.backend.gelu_forward(prefix(a[kFchGelu], {N, 4 * C}), prefix(a[kFch], {N, 4 * C}),
                             run.stream);
  }
}

void Gpt2Architecture::layer_backward(const LayerRun& run) const {
  const int64_t b = run.b, t = run.t, C = config_.n_embd, N = b * t;
  const std::vector<Tensor>& a = run.activations;
  const std::vector<Tensor>& w = run.weights;
  const std::vector<Tensor>& g = run.grads;
  Backend& backend = run.backend;
  const Stream stream = run.stream;
  Tensor dresidual = prefix(run.residual_grad, {N, C});
  Tensor dbtc = prefix(run.workspace[kDbtc], {N, C});
  Tensor dqkv = prefix(run.workspace[kDqkv], {N, 3 * C});
  Tensor dfch = prefix(run.workspace[kDfch], {N, 4 * C});
  Tensor dfch_gelu = prefix(run.workspace[kDfchGelu], {N, 4 * C});
  // dresidual holds dL/d(output of the layer).
  backend.matmul_backward(dfch_gelu, g[kFcProjWeight], g[kFcProjBias], dresidual,
                          prefix(a[kFchGelu], {N, 4 * C}), w[kFcProjWeight], false, stream);
  backend.gelu_backward(dfch, dfch_gelu, prefix(a[kFch], {N, 4 * C}), stream);
  backend.matmul_backward(dbtc, g[kFcWeight], g[kFcBias], dfch, prefix(a[kLn2], {N, C}),
                          w[kFcWeight], false, stream);
  backend.layernorm_backward(dresidual, g[kLn2Weight], g[kLn2Bias], dbtc,
                             prefix(a[kResidual2], {N, C}), w[kLn2Weight],
                             prefix(a[kLn2Mean], {N}), prefix(a[kLn2Rstd], {N}), stream);
  // dresidual holds dL/d(residual2).
  backend.matmul_backward(dbtc, g[kAttnProjWeight], g[kAttnProjBias], dresidual,
                          prefix(a[kAtty], {N, C}), w[kAttnProjWeight], false, stream);
  backend.attention_backward(dqkv.reshape({b, t, 3 * C}), dbtc.reshape({b, t, C}),
                             prefix(a[kQkv], {b, t, 3 * C}), prefix(a[kAtty], {b, t, C}),
                             prefix(a[kAttLse], {b, config_.n_head, t}),
                             static_cast<int>(config_.n_head), stream);
  backend.matmul_backward(dbtc, g[kQkvWeight], g[kQkvBias], dqkv, prefix(a[kLn1], {N, C}),
                          w[kQkvWeight], false, stream);
  backend.layernorm_backward(dresidual, g[kLn1Weight], g[kLn1Bias], dbtc,
                             prefix(run.input, {N, C}), w[kLn1Weight], prefix(a[kLn1Mean], {N}),
                             prefix(a[kLn1Rstd], {N}), stream);
  // dresidual holds dL/d(input of the layer).
}

Tensor Gpt2Architecture::head_logits(const std::vector<Tensor>& workspace, int64_t b,
                                     int64_t t) const {
  return prefix(workspace.at(kLogits), {b, t, config_.padded_vocab()});
}

double Gpt2Architecture::head_forward(ParamProvider& params, const HeadRun& run,
                                      bool release_grads, int next) const {
  const int64_t C = config_.n_embd, Vp = config_.padded_vocab(), N = run.b * run.t;
  const std::vector<Tensor>& ws = run.workspace;
  const int final_block = layout_.final_block(), embed_block = ParamLayout::embedding_block();
  {
    const std::vector<Tensor> w = layout_.block_views(final_block, params.acquire_params(final_block));
    run.backend.layernorm_forward(prefix(ws[kLnf], {N, C}), prefix(ws[kLnfMean], {N}),
                                  prefix(ws[kLnfRstd], {N}), prefix(run.input, {N, C}), w[0], w[1],
                                  run.stream);
    params.prefetch_params(embed_block);
    params.release_params(final_block);
  }
  Tensor wte = ParamLayout::view(layout_.find("wte.weight"), params.acquire_params(embed_block));
  Tensor logits = prefix(ws[kLogits], {N, Vp});
  run.backend.matmul_forward(logits, prefix(ws[kLnf], {N, C}), wte, Tensor(), true, run.stream);
  if (run.targets.empty()) {
    params.release_params(embed_block);
    return 0.0;
  }
  DSTRAIN_CHECK(run.targets.ndim == 2 && run.targets.size(0) == run.b && run.targets.size(1) == run.t)
      << run.targets.shape_str();
  Tensor losses = prefix(ws[kLosses], {N});
  run.backend.softmax_cross_entropy(losses, run.dloss != 0.0f ? logits : Tensor(), logits,
                                    run.targets.reshape({N}),
                                    static_cast<int>(config_.vocab_size), run.dloss, run.stream);
  if (run.dloss != 0.0f) {
    head_backward(params, run, wte, release_grads, next);  // releases the embedding block
  } else {
    params.release_params(embed_block);
  }
  std::vector<float> host_losses(static_cast<size_t>(N));
  run.backend.copy_bytes(host_losses.data(), losses.data, N * sizeof(float), run.stream);
  run.backend.synchronize(run.stream);
  double sum = 0.0;
  for (float loss : host_losses) sum += loss;
  return sum / static_cast<double>(N);
}

// The tied LM head and the final layernorm, backward: from the logits' gradient (in place of
// the logits) to dL/d(input) in run.input_grad.
void Gpt2Architecture::head_backward(ParamProvider& params, const HeadRun& run, Tensor wte,
                                     bool release_grads, int next) const {
  const int64_t C = config_.n_embd, Vp = config_.padded_vocab(), N = run.b * run.t;
  const std::vector<Tensor>& ws = run.workspace;
  const int final_block = layout_.final_block(), embed_block = ParamLayout::embedding_block();
  Tensor dlnf = prefix(ws[kDlnf], {N, C});
  {
    Tensor grads = params.acquire_grads(embed_block);
    run.backend.matmul_backward(dlnf, ParamLayout::view(layout_.find("wte.weight"), grads),
                                Tensor(), prefix(ws[kLogits], {N, Vp}), prefix(ws[kLnf], {N, C}),
                                wte, true, run.stream);
    params.prefetch_params(final_block);
    params.release_params(embed_block);
    if (release_grads) params.release_grads(embed_block);
  }
  const std::vector<Tensor> w = layout_.block_views(final_block, params.acquire_params(final_block));
  const std::vector<Tensor> g = layout_.block_views(final_block, params.acquire_grads(final_block));
  Tensor input_grad = prefix(run.input_grad, {N, C});
  run.backend.fill_zero(input_grad, run.stream);
  run.backend.layernorm_backward(input_grad, g[0], g[1], dlnf, prefix(run.input, {N, C}), w[0],
                                 prefix(ws[kLnfMean], {N}), prefix(ws[kLnfRstd], {N}), run.stream);
  if (next >= 0) params.prefetch_params(next);
  params.release_grads(final_block);
  params.release_params(final_block);
}

Gpt2::Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B,
           int64_t T, DType act_dtype, bool with_backward, Recompute recompute)
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
