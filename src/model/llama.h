// The LLaMA family (Llama 2/3, DeepSeek-LLM, Qwen2): pre-norm blocks with RMSNorm, rotary
// position embeddings (Hugging Face's rotate-half convention), grouped-query attention, a
// SwiGLU MLP, a tied or untied LM head, biases only where the config asks (Qwen2's q/k/v).
// Written against Backend as an Architecture (model/architecture.h): the stage driver runs
// it on any range of layers, with the same pipeline, ZeRO, offload and recompute machinery as
// GPT-2.
//
// Tensor parallelism, Megatron's splits as for GPT-2: the attention by heads (q and k/v heads
// split evenly: tp divides num_key_value_heads), [gate | up] column-parallel and down
// row-parallel, o_proj row-parallel, the embedding and the head vocabulary-parallel.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "model/architecture.h"
#include "model/config.h"
#include "model/layout.h"

namespace dstrain {

// The rotary frequencies of `config` (head_dim / 2 of them): inv_freq[i] = rope_theta^(-2i/hd),
// with Llama 3's rope scaling when the config has it. In double.
std::vector<double> rope_inverse_frequencies(const ModelConfig& config);

// The (T, hd/2, 2) table of (cos, sin) of position t times inv_freq[i], as rope_forward takes it.
std::vector<float> rope_table(const std::vector<double>& inv_freq, int64_t T);

class LlamaArchitecture final : public Architecture {
 public:
  // REQUIRES: config.llama_family(), and the model splits over tp.size ranks.
  explicit LlamaArchitecture(const ModelConfig& config, const TensorParallel& tp = {});

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  const TensorParallel& tensor_parallel() const override { return tp_; }
  std::vector<ActivationSpec> layer_activations(int64_t B, int64_t T, DType dtype,
                                                Recompute recompute) const override;
  std::vector<TensorSpec> layer_workspace(int64_t B, int64_t T, DType dtype,
                                          bool with_backward) const override;
  std::vector<TensorSpec> head_workspace(int64_t B, int64_t T, DType dtype,
                                         bool with_backward) const override;
  void embed_forward(ParamProvider& params, const EmbedRun& run, int next) const override;
  void embed_backward(ParamProvider& params, const EmbedRun& run) const override;
  void layer_forward(const LayerRun& run) const override;
  void layer_recompute(const LayerRun& run, Recompute recompute) const override;
  void layer_backward(const LayerRun& run) const override;
  double head_forward(ParamProvider& params, const HeadRun& run, bool release_grads,
                      int next) const override;
  int head_first_block() const override { return layout_.final_block(); }
  Tensor head_logits(const std::vector<Tensor>& workspace, int64_t b, int64_t t) const override;

  // Indices of a layer's tensors in its block (LayerRun::weights), -1 where the config has none.
  struct LayerTensors {
    int attn_norm = -1, q = -1, q_bias = -1, o = -1, o_bias = -1, mlp_norm = -1, gate = -1,
        gate_bias = -1, down = -1, down_bias = -1;
  };

 private:
  struct Widths {
    int64_t heads, kv_heads, qkv, attn, mlp;  // this tp rank's
  };
  Widths widths() const;
  Tensor rope_freqs(const LayerRun& run) const;
  void attention_backward(const LayerRun& run, Tensor dout) const;
  void mlp_backward(const LayerRun& run, Tensor dout) const;
  void head_backward(ParamProvider& params, const HeadRun& run, Tensor head, Tensor norm_full,
                     std::vector<Tensor> final_weights, bool release_grads, int next) const;
  Tensor row_parallel(const LayerRun& run, Tensor inp, Tensor weight, Tensor bias) const;
  Tensor sequence_parallel_view(Tensor full, int64_t rows) const;
  Tensor stream_part(const LayerRun& run) const;
  Tensor gathered(const LayerRun& run) const;
  int64_t vocab_begin() const;
  int head_block() const;

  ModelConfig config_;
  TensorParallel tp_;
  ParamLayout layout_;
  LayerTensors tensors_;
  std::vector<double> inv_freq_;
  mutable std::mutex rope_mutex_;
  // rope_table for each longer T asked so far: kept, never moved (a stream may still copy).
  mutable std::vector<std::unique_ptr<const std::vector<float>>> rope_tables_;
};

// LLaMA-family initialization as Hugging Face's: N(0, 0.02) for the matrices and the
// embedding, zero biases, RMSNorm weights 1; each tensor from its own stream (seed, name), the
// same for any layout or sharding.
void init_llama_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                           const std::vector<Tensor>& block_flats);

}  // namespace dstrain
