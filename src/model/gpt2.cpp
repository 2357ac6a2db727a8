#include "model/gpt2.h"

#include <cmath>
#include <cstring>
#include <map>

#include "core/rng.h"

namespace dstrain {

const char* recompute_name(Recompute recompute) {
  switch (recompute) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::None;
  if (name == "selective") return Recompute::Selective;
  if (name == "full") return Recompute::Full;
  DSTRAIN_USER_ERROR() << "unknown --recompute '" << name << "' (expected none, selective or full)";
  return Recompute::None;
}

Gpt2Buffers plan_gpt2_buffers(const ModelConfig& config, int64_t B, int64_t T, DType act_dtype,
                              bool with_backward, Recompute recompute) {
  const int64_t C = config.n_embd, NH = config.n_head, Vp = config.padded_vocab();
  if (!with_backward) recompute = Recompute::None;
  Gpt2Buffers plan;
  plan.recompute = recompute;
  ArenaPlan& a = plan.activations;
  // A layer activation is either kept per layer ("h.3.ln1") or, when backward recomputes it,
  // one buffer all layers share ("recompute.ln1").
  std::map<std::string, int> shared;
  auto layer_entry = [&](int64_t layer, const std::string& name, DType dtype,
                         std::vector<int64_t> shape, bool kept) {
    if (kept) return a.add("h." + std::to_string(layer) + "." + name, dtype, std::move(shape));
    auto it = shared.find(name);
    if (it == shared.end()) it = shared.emplace(name, a.add("recompute." + name, dtype, std::move(shape))).first;
    return it->second;
  };
  const bool full = recompute == Recompute::Full;
  const bool cheap_kept = recompute == Recompute::None;  // layernorm and GELU outputs
  plan.encoded = a.add("encoded", act_dtype, {B, T, C});
  for (int64_t l = 0; l < config.n_layer; ++l) {
    Gpt2LayerIds ids;
    ids.ln1 = layer_entry(l, "ln1", act_dtype, {B, T, C}, cheap_kept);
    ids.ln1_mean = layer_entry(l, "ln1_mean", DType::F32, {B, T}, !full);
    ids.ln1_rstd = layer_entry(l, "ln1_rstd", DType::F32, {B, T}, !full);
    ids.qkv = layer_entry(l, "qkv", act_dtype, {B, T, 3 * C}, !full);
    ids.atty = layer_entry(l, "atty", act_dtype, {B, T, C}, !full);
    ids.att_lse = layer_entry(l, "att_lse", DType::F32, {B, NH, T}, !full);
    ids.residual2 = layer_entry(l, "residual2", act_dtype, {B, T, C}, !full);
    ids.ln2 = layer_entry(l, "ln2", act_dtype, {B, T, C}, cheap_kept);
    ids.ln2_mean = layer_entry(l, "ln2_mean", DType::F32, {B, T}, !full);
    ids.ln2_rstd = layer_entry(l, "ln2_rstd", DType::F32, {B, T}, !full);
    ids.fch = layer_entry(l, "fch", act_dtype, {B, T, 4 * C}, !full);
    ids.fch_gelu = layer_entry(l, "fch_gelu", act_dtype, {B, T, 4 * C}, cheap_kept);
    ids.output = layer_entry(l, "output", act_dtype, {B, T, C}, true);
    plan.layers.push_back(ids);
  }
  plan.lnf = a.add("lnf", act_dtype, {B, T, C});
  plan.lnf_mean = a.add("lnf_mean", DType::F32, {B, T});
  plan.lnf_rstd = a.add("lnf_rstd", DType::F32, {B, T});
  plan.losses = a.add("losses", DType::F32, {B, T});

  ArenaPlan& w = plan.workspace;
  plan.logits = w.add("logits", act_dtype, {B, T, Vp});  // their gradient overwrites them
  plan.scratch = w.add("scratch", act_dtype, {B, T, C});
  if (with_backward) {
    plan.dresidual = w.add("dresidual", act_dtype, {B, T, C});
    plan.dbtc = w.add("dbtc", act_dtype, {B, T, C});
    plan.dqkv = w.add("dqkv", act_dtype, {B, T, 3 * C});
    plan.dfch = w.add("dfch", act_dtype, {B, T, 4 * C});
    plan.dfch_gelu = w.add("dfch_gelu", act_dtype, {B, T, 4 * C});
  }
  return plan;
}

Gpt2::Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B,
           int64_t T, DType act_dtype, bool with_backward, Recompute recompute)
    : config_(config),
      layout_(config),
      backend_(backend),
      B_(B),
      T_(T),
      act_dtype_(act_dtype),
      with_backward_(with_backward),
      plan_(plan_gpt2_buffers(config, B, T, act_dtype, with_backward, recompute)) {
  DSTRAIN_USER_CHECK(T >= 1 && T <= config.n_positions)
      << "sequence length " << T << " is outside 1.." << config.n_positions
      << " (the model's n_positions)";
  DSTRAIN_USER_CHECK(B >= 1) << "batch size must be at least 1";
  activations_ = allocator.allocate(MemCategory::Activations, plan_.activations.bytes());
  workspace_ = allocator.allocate(MemCategory::Workspace, plan_.workspace.bytes());
}

// A view of the leading b*t*... elements of a (B,T,...) buffer with the actual micro-batch
// shape: buffers are contiguous, so a smaller (b,t) is a prefix.
static Tensor prefix_view(Tensor full, std::initializer_list<int64_t> dims) {
  return full.slice(0, dims);
}

Tensor Gpt2::act(int id, std::initializer_list<int64_t> dims) const {
  return prefix_view(plan_.activations.view(id, activations_.data(), activations_.device()), dims);
}

Tensor Gpt2::work(int id, std::initializer_list<int64_t> dims) const {
  return prefix_view(plan_.workspace.view(id, workspace_.data(), workspace_.device()), dims);
}

Tensor Gpt2::layer_input(int layer, int64_t b, int64_t t) const {
  const int64_t C = config_.n_embd;
  return layer == 0 ? act(plan_.encoded, {b, t, C}) : act(plan_.layers[layer - 1].output, {b, t, C});
}

Tensor Gpt2::logits() const { return work(plan_.logits, {last_b_, last_t_, config_.padded_vocab()}); }
Tensor Gpt2::losses() const { return act(plan_.losses, {last_b_, last_t_}); }

namespace {
// The 12 parameter (or gradient) tensors of a layer, viewed inside its flat block buffer.
std::vector<Tensor> layer_tensors(const ParamLayout& layout, int block, Tensor flat) {
  std::vector<Tensor> tensors;
  for (int index : layout.block_params(block)) {
    tensors.push_back(ParamLayout::view(layout.params()[index], flat));
  }
  return tensors;
}
}  // namespace

void Gpt2::layer_forward(int layer, const std::vector<Tensor>& w, int64_t b, int64_t t,
                         Stream stream) {
  const int64_t C = config_.n_embd, N = b * t;
  const Gpt2LayerIds& a = plan_.layers[layer];
  Tensor scratch = work(plan_.scratch, {N, C});
  Tensor input = layer_input(layer, b, t).reshape({N, C});
  Tensor ln1 = act(a.ln1, {N, C}), qkv = act(a.qkv, {b, t, 3 * C});
  Tensor atty = act(a.atty, {b, t, C}), residual2 = act(a.residual2, {N, C});
  Tensor ln2 = act(a.ln2, {N, C}), fch = act(a.fch, {N, 4 * C});
  Tensor fch_gelu = act(a.fch_gelu, {N, 4 * C});
  backend_.layernorm_forward(ln1, act(a.ln1_mean, {N}), act(a.ln1_rstd, {N}), input,
                             w[kLn1Weight], w[kLn1Bias], stream);
  backend_.matmul_forward(qkv.reshape({N, 3 * C}), ln1, w[kQkvWeight], w[kQkvBias], false,
                          stream);
  backend_.attention_forward(atty, act(a.att_lse, {b, config_.n_head, t}), qkv,
                             static_cast<int>(config_.n_head), stream);
  backend_.matmul_forward(scratch, atty.reshape({N, C}), w[kAttnProjWeight], w[kAttnProjBias],
                          false, stream);
  backend_.residual_forward(residual2, input, scratch, stream);
  backend_.layernorm_forward(ln2, act(a.ln2_mean, {N}), act(a.ln2_rstd, {N}), residual2,
                             w[kLn2Weight], w[kLn2Bias], stream);
  backend_.matmul_gelu_forward(fch_gelu, fch, ln2, w[kFcWeight], w[kFcBias], stream);
  backend_.matmul_forward(scratch, fch_gelu, w[kFcProjWeight], w[kFcProjBias], false, stream);
  backend_.residual_forward(act(a.output, {N, C}), residual2, scratch, stream);
}

double Gpt2::forward(ParamProvider& params, Tensor tokens, Tensor targets, float dloss,
                     Stream stream) {
  DSTRAIN_CHECK(tokens.ndim == 2 && tokens.dtype == DType::I32) << tokens.shape_str();
  const int64_t b = tokens.size(0), t = tokens.size(1);
  DSTRAIN_CHECK(b <= B_ && t <= T_) << "micro-batch (" << b << ", " << t << ") exceeds ("
                                    << B_ << ", " << T_ << ")";
  DSTRAIN_CHECK(dloss == 0.0f || (with_backward_ && !targets.empty()));
  const int64_t C = config_.n_embd, Vp = config_.padded_vocab(), N = b * t;
  last_b_ = b;
  last_t_ = t;
  const int embed_block = ParamLayout::embedding_block();

  {
    Tensor flat = params.acquire_params(embed_block);
    Tensor wte = ParamLayout::view(layout_.find("wte.weight"), flat);
    Tensor wpe = ParamLayout::view(layout_.find("wpe.weight"), flat);
    backend_.embedding_forward(act(plan_.encoded, {b, t, C}), tokens, wte, wpe, stream);
    params.prefetch_params(config_.n_layer > 0 ? ParamLayout::layer_block(0)
                                               : layout_.final_block());
    params.release_params(embed_block);
  }

  const int final_block = layout_.final_block();
  for (int l = 0; l < config_.n_layer; ++l) {
    const int block = ParamLayout::layer_block(l);
    layer_forward(l, layer_tensors(layout_, block, params.acquire_params(block)), b, t, stream);
    params.prefetch_params(l + 1 < config_.n_layer ? ParamLayout::layer_block(l + 1) : final_block);
    params.release_params(block);
  }

  {
    const std::vector<Tensor> w = layer_tensors(layout_, final_block,
                                                params.acquire_params(final_block));
    backend_.layernorm_forward(act(plan_.lnf, {N, C}), act(plan_.lnf_mean, {N}), act(plan_.lnf_rstd, {N}),
                               layer_input(static_cast<int>(config_.n_layer), b, t).reshape({N, C}),
                               w[0], w[1], stream);
    params.prefetch_params(embed_block);
    params.release_params(final_block);
  }
  {
    Tensor flat = params.acquire_params(embed_block);
    Tensor wte = ParamLayout::view(layout_.find("wte.weight"), flat);
    backend_.matmul_forward(work(plan_.logits, {N, Vp}), act(plan_.lnf, {N, C}), wte, Tensor(), true,
                            stream);
    params.release_params(embed_block);
  }
  have_dlogits_ = false;
  if (targets.empty()) return 0.0;
  DSTRAIN_CHECK(targets.ndim == 2 && targets.size(0) == b && targets.size(1) == t)
      << targets.shape_str();
  // The gradient of the logits overwrites them (the op allows it): one (N, Vp) buffer.
  Tensor dlogits = dloss != 0.0f ? work(plan_.logits, {N, Vp}) : Tensor();
  backend_.softmax_cross_entropy(act(plan_.losses, {N}), dlogits, work(plan_.logits, {N, Vp}),
                                 targets.reshape({N}), static_cast<int>(config_.vocab_size),
                                 dloss, stream);
  have_dlogits_ = dloss != 0.0f;
  std::vector<float> host_losses(static_cast<size_t>(N));
  backend_.copy_bytes(host_losses.data(), act(plan_.losses, {N}).data, N * sizeof(float), stream);
  backend_.synchronize(stream);
  double sum = 0.0;
  for (float loss : host_losses) sum += loss;
  return sum / static_cast<double>(N);
}

void Gpt2::backward(ParamProvider& params, Tensor tokens, Stream stream) {
  DSTRAIN_CHECK(have_dlogits_) << "backward() needs a forward() with targets and dloss != 0";
  const int64_t b = last_b_, t = last_t_;
  DSTRAIN_CHECK(tokens.size(0) == b && tokens.size(1) == t);
  const int64_t C = config_.n_embd, Vp = config_.padded_vocab(), N = b * t;
  const int embed_block = ParamLayout::embedding_block();
  const int final_block = layout_.final_block();
  Tensor dresidual = work(plan_.dresidual, {N, C});
  Tensor dbtc = work(plan_.dbtc, {N, C});

  // LM head (tied to wte) and the final layernorm.
  {
    Tensor flat = params.acquire_params(embed_block);
    Tensor grads = params.acquire_grads(embed_block);
    const ParamSpec& wte_spec = layout_.find("wte.weight");
    backend_.matmul_backward(dbtc, ParamLayout::view(wte_spec, grads), Tensor(),
                             work(plan_.logits, {N, Vp}), act(plan_.lnf, {N, C}),
                             ParamLayout::view(wte_spec, flat), true, stream);
    params.prefetch_params(final_block);
    params.release_params(embed_block);
  }
  {
    const std::vector<Tensor> w = layer_tensors(layout_, final_block,
                                                params.acquire_params(final_block));
    const std::vector<Tensor> g = layer_tensors(layout_, final_block,
                                                params.acquire_grads(final_block));
    backend_.fill_zero(dresidual, stream);
    backend_.layernorm_backward(
        dresidual, g[0], g[1], dbtc,
        layer_input(static_cast<int>(config_.n_layer), b, t).reshape({N, C}), w[0],
        act(plan_.lnf_mean, {N}), act(plan_.lnf_rstd, {N}), stream);
    if (config_.n_layer > 0)
      params.prefetch_params(ParamLayout::layer_block(static_cast<int>(config_.n_layer) - 1));
    params.release_grads(final_block);
    params.release_params(final_block);
  }

  Tensor dqkv = work(plan_.dqkv, {N, 3 * C});
  Tensor dfch = work(plan_.dfch, {N, 4 * C}), dfch_gelu = work(plan_.dfch_gelu, {N, 4 * C});
  for (int l = static_cast<int>(config_.n_layer) - 1; l >= 0; --l) {
    const int block = ParamLayout::layer_block(l);
    const std::vector<Tensor> w = layer_tensors(layout_, block, params.acquire_params(block));
    const std::vector<Tensor> g = layer_tensors(layout_, block, params.acquire_grads(block));
    const Gpt2LayerIds& a = plan_.layers[l];
    Tensor input = layer_input(l, b, t).reshape({N, C});
    if (plan_.recompute == Recompute::Full) {
      // Everything but the layer's output was dropped: run the layer again from its input.
      // The ops are deterministic, so the recomputed activations are the same bits.
      layer_forward(l, w, b, t, stream);
    } else if (plan_.recompute == Recompute::Selective) {
      // The layernorm and GELU outputs were dropped: recompute them from what was kept.
      backend_.layernorm_forward(act(a.ln1, {N, C}), act(a.ln1_mean, {N}), act(a.ln1_rstd, {N}),
                                 input, w[kLn1Weight], w[kLn1Bias], stream);
      backend_.layernorm_forward(act(a.ln2, {N, C}), act(a.ln2_mean, {N}), act(a.ln2_rstd, {N}),
                                 act(a.residual2, {N, C}), w[kLn2Weight], w[kLn2Bias], stream);
      backend_.gelu_forward(act(a.fch_gelu, {N, 4 * C}), act(a.fch, {N, 4 * C}), stream);
    }
    // dresidual holds dL/d(output of layer l).
    backend_.matmul_backward(dfch_gelu, g[kFcProjWeight], g[kFcProjBias], dresidual,
                             act(a.fch_gelu, {N, 4 * C}), w[kFcProjWeight], false, stream);
    backend_.gelu_backward(dfch, dfch_gelu, act(a.fch, {N, 4 * C}), stream);
    backend_.matmul_backward(dbtc, g[kFcWeight], g[kFcBias], dfch, act(a.ln2, {N, C}),
                             w[kFcWeight], false, stream);
    backend_.layernorm_backward(dresidual, g[kLn2Weight], g[kLn2Bias], dbtc,
                                act(a.residual2, {N, C}), w[kLn2Weight], act(a.ln2_mean, {N}),
                                act(a.ln2_rstd, {N}), stream);
    // dresidual holds dL/d(residual2).
    backend_.matmul_backward(dbtc, g[kAttnProjWeight], g[kAttnProjBias], dresidual,
                             act(a.atty, {N, C}), w[kAttnProjWeight], false, stream);
    backend_.attention_backward(dqkv.reshape({b, t, 3 * C}), dbtc.reshape({b, t, C}),
                                act(a.qkv, {b, t, 3 * C}), act(a.atty, {b, t, C}),
                                act(a.att_lse, {b, config_.n_head, t}),
                                static_cast<int>(config_.n_head), stream);
    backend_.matmul_backward(dbtc, g[kQkvWeight], g[kQkvBias], dqkv, act(a.ln1, {N, C}),
                             w[kQkvWeight], false, stream);
    backend_.layernorm_backward(dresidual, g[kLn1Weight], g[kLn1Bias], dbtc, input,
                                w[kLn1Weight], act(a.ln1_mean, {N}), act(a.ln1_rstd, {N}),
                                stream);
    // dresidual holds dL/d(input of layer l).
    if (l > 0) params.prefetch_params(ParamLayout::layer_block(l - 1));
    params.release_grads(block);
    params.release_params(block);
  }

  {
    Tensor grads = params.acquire_grads(embed_block);
    backend_.embedding_backward(ParamLayout::view(layout_.find("wte.weight"), grads),
                                ParamLayout::view(layout_.find("wpe.weight"), grads),
                                dresidual.reshape({b, t, C}), tokens, stream);
    params.release_grads(embed_block);
  }
  have_dlogits_ = false;
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
