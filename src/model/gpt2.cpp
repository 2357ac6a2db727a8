#include "model/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/rng.h"

namespace dstrain {

Gpt2Buffers plan_gpt2_buffers(const ModelConfig& config, int64_t B, int64_t T, DType act_dtype,
                              bool with_backward) {
  const int64_t C = config.n_embd, NH = config.n_head, Vp = config.padded_vocab();
  Gpt2Buffers plan;
  ArenaPlan& a = plan.activations;
  a.add("encoded", act_dtype, {B, T, C});
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    a.add(p + "ln1", act_dtype, {B, T, C});
    a.add(p + "ln1_mean", DType::F32, {B, T});
    a.add(p + "ln1_rstd", DType::F32, {B, T});
    a.add(p + "qkv", act_dtype, {B, T, 3 * C});
    a.add(p + "atty", act_dtype, {B, T, C});
    a.add(p + "att_lse", DType::F32, {B, NH, T});
    a.add(p + "residual2", act_dtype, {B, T, C});
    a.add(p + "ln2", act_dtype, {B, T, C});
    a.add(p + "ln2_mean", DType::F32, {B, T});
    a.add(p + "ln2_rstd", DType::F32, {B, T});
    a.add(p + "fch", act_dtype, {B, T, 4 * C});
    a.add(p + "fch_gelu", act_dtype, {B, T, 4 * C});
    a.add(p + "output", act_dtype, {B, T, C});
  }
  a.add("lnf", act_dtype, {B, T, C});
  a.add("lnf_mean", DType::F32, {B, T});
  a.add("lnf_rstd", DType::F32, {B, T});
  a.add("losses", DType::F32, {B, T});

  ArenaPlan& w = plan.workspace;
  w.add("logits", act_dtype, {B, T, Vp});
  w.add("scratch", act_dtype, {B, T, C});
  if (with_backward) {
    w.add("dlogits", act_dtype, {B, T, Vp});
    w.add("dresidual", act_dtype, {B, T, C});
    w.add("dbtc", act_dtype, {B, T, C});
    w.add("dqkv", act_dtype, {B, T, 3 * C});
    w.add("dfch", act_dtype, {B, T, 4 * C});
    w.add("dfch_gelu", act_dtype, {B, T, 4 * C});
  }
  return plan;
}

Gpt2::Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B,
           int64_t T, DType act_dtype, bool with_backward)
    : config_(config),
      layout_(config),
      backend_(backend),
      B_(B),
      T_(T),
      act_dtype_(act_dtype),
      with_backward_(with_backward),
      plan_(plan_gpt2_buffers(config, B, T, act_dtype, with_backward)) {
  DSTRAIN_USER_CHECK(T >= 1 && T <= config.n_positions)
      << "sequence length " << T << " is outside 1.." << config.n_positions
      << " (the model's n_positions)";
  DSTRAIN_USER_CHECK(B >= 1) << "batch size must be at least 1";
  activations_ = allocator.allocate(MemCategory::Activations, plan_.activations.bytes());
  workspace_ = allocator.allocate(MemCategory::Workspace, plan_.workspace.bytes());
  // Ids follow the order of plan_gpt2_buffers.
  int id = 0;
  encoded_ = id++;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    LayerActs acts;
    acts.ln1 = id++;
    acts.ln1_mean = id++;
    acts.ln1_rstd = id++;
    acts.qkv = id++;
    acts.atty = id++;
    acts.att_lse = id++;
    acts.residual2 = id++;
    acts.ln2 = id++;
    acts.ln2_mean = id++;
    acts.ln2_rstd = id++;
    acts.fch = id++;
    acts.fch_gelu = id++;
    acts.output = id++;
    layer_acts_.push_back(acts);
  }
  lnf_ = id++;
  lnf_mean_ = id++;
  lnf_rstd_ = id++;
  losses_ = id++;
  DSTRAIN_CHECK(id == plan_.activations.size());
  int wid = 0;
  logits_ = wid++;
  scratch_ = wid++;
  if (with_backward) {
    dlogits_ = wid++;
    dresidual_ = wid++;
    dbtc_ = wid++;
    dqkv_ = wid++;
    dfch_ = wid++;
    dfch_gelu_ = wid++;
  }
  DSTRAIN_CHECK(wid == plan_.workspace.size());
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
  return layer == 0 ? act(encoded_, {b, t, C}) : act(layer_acts_[layer - 1].output, {b, t, C});
}

Tensor Gpt2::logits() const { return work(logits_, {last_b_, last_t_, config_.padded_vocab()}); }
Tensor Gpt2::losses() const { return act(losses_, {last_b_, last_t_}); }

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
    backend_.embedding_forward(act(encoded_, {b, t, C}), tokens, wte, wpe, stream);
    params.release_params(embed_block);
  }

  Tensor scratch = work(scratch_, {b, t, C});
  for (int l = 0; l < config_.n_layer; ++l) {
    const int block = ParamLayout::layer_block(l);
    const std::vector<Tensor> w = layer_tensors(layout_, block, params.acquire_params(block));
    const LayerActs& a = layer_acts_[l];
    Tensor input = layer_input(l, b, t).reshape({N, C});
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
    backend_.matmul_forward(scratch.reshape({N, C}), atty.reshape({N, C}), w[kAttnProjWeight],
                            w[kAttnProjBias], false, stream);
    backend_.residual_forward(residual2, input, scratch.reshape({N, C}), stream);
    backend_.layernorm_forward(ln2, act(a.ln2_mean, {N}), act(a.ln2_rstd, {N}), residual2,
                               w[kLn2Weight], w[kLn2Bias], stream);
    backend_.matmul_forward(fch, ln2, w[kFcWeight], w[kFcBias], false, stream);
    backend_.gelu_forward(fch_gelu, fch, stream);
    backend_.matmul_forward(scratch.reshape({N, C}), fch_gelu, w[kFcProjWeight],
                            w[kFcProjBias], false, stream);
    backend_.residual_forward(act(a.output, {N, C}), residual2, scratch.reshape({N, C}), stream);
    params.release_params(block);
  }

  const int final_block = layout_.final_block();
  {
    const std::vector<Tensor> w = layer_tensors(layout_, final_block,
                                                params.acquire_params(final_block));
    backend_.layernorm_forward(act(lnf_, {N, C}), act(lnf_mean_, {N}), act(lnf_rstd_, {N}),
                               layer_input(static_cast<int>(config_.n_layer), b, t).reshape({N, C}),
                               w[0], w[1], stream);
    params.release_params(final_block);
  }
  {
    Tensor flat = params.acquire_params(embed_block);
    Tensor wte = ParamLayout::view(layout_.find("wte.weight"), flat);
    backend_.matmul_forward(work(logits_, {N, Vp}), act(lnf_, {N, C}), wte, Tensor(), true,
                            stream);
    params.release_params(embed_block);
  }
  have_dlogits_ = false;
  if (targets.empty()) return 0.0;
  DSTRAIN_CHECK(targets.ndim == 2 && targets.size(0) == b && targets.size(1) == t)
      << targets.shape_str();
  Tensor dlogits = dloss != 0.0f ? work(dlogits_, {N, Vp}) : Tensor();
  backend_.softmax_cross_entropy(act(losses_, {N}), dlogits, work(logits_, {N, Vp}),
                                 targets.reshape({N}), static_cast<int>(config_.vocab_size),
                                 dloss, stream);
  have_dlogits_ = dloss != 0.0f;
  std::vector<float> host_losses(static_cast<size_t>(N));
  backend_.copy_bytes(host_losses.data(), act(losses_, {N}).data, N * sizeof(float), stream);
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
  Tensor dresidual = work(dresidual_, {N, C});
  Tensor dbtc = work(dbtc_, {N, C});

  // LM head (tied to wte) and the final layernorm.
  {
    Tensor flat = params.acquire_params(embed_block);
    Tensor grads = params.acquire_grads(embed_block);
    const ParamSpec& wte_spec = layout_.find("wte.weight");
    backend_.matmul_backward(dbtc, ParamLayout::view(wte_spec, grads), Tensor(),
                             work(dlogits_, {N, Vp}), act(lnf_, {N, C}),
                             ParamLayout::view(wte_spec, flat), true, stream);
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
        act(lnf_mean_, {N}), act(lnf_rstd_, {N}), stream);
    params.release_grads(final_block);
    params.release_params(final_block);
  }

  Tensor dqkv = work(dqkv_, {N, 3 * C});
  Tensor dfch = work(dfch_, {N, 4 * C}), dfch_gelu = work(dfch_gelu_, {N, 4 * C});
  for (int l = static_cast<int>(config_.n_layer) - 1; l >= 0; --l) {
    const int block = ParamLayout::layer_block(l);
    const std::vector<Tensor> w = layer_tensors(layout_, block, params.acquire_params(block));
    const std::vector<Tensor> g = layer_tensors(layout_, block, params.acquire_grads(block));
    const LayerActs& a = layer_acts_[l];
    Tensor input = layer_input(l, b, t).reshape({N, C});
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
