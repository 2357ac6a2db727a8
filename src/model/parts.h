// The parts a decoder is assembled from, chosen by the model configuration: a model is a table
// of parts (as Megatron's layer specs and llama.cpp's build_norm / build_ffn), not a class of its
// own. decoder_parts() is the one place that reads the model_type; the layout (model/layout.h),
// the decoder (model/decoder.h), the cost model (parallel/kernel_work.h, model_flops.h) and the
// initialization ask the parts.
//
//   part       choices                                 config fields (Hugging Face names)
//   norm       LayerNorm (weight, bias) | RMSNorm      layer_norm_epsilon | rms_norm_eps
//   position   learned table | rotary                  n_positions | rope_theta, rope_scaling
//   attention  heads, kv heads, head dim, biases       num_attention_heads, num_key_value_heads,
//                                                      attention_bias (Qwen2: q, k, v)
//              | multi-head latent attention          q_lora_rank, kv_lora_rank, qk_nope_head_dim,
//                                                      qk_rope_head_dim, v_head_dim
//   MLP        GELU (tanh) | SwiGLU | mixture of       activation_function | hidden_act, mlp_bias;
//              SwiGLU experts (router, top-k)          num_local_experts | num_experts, ...,
//                                                      DeepSeek's n_group, scoring_func, ...
//   head       tied to the embedding | its own tensor  tie_word_embeddings
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace dstrain {

enum class NormKind { LayerNorm, RMSNorm };
enum class PositionKind { Learned, Rotary };
enum class MlpKind { Gelu, SwiGLU, MoE };
enum class AttentionKind { MultiHead, Latent };

struct NormPart {
  NormKind kind = NormKind::LayerNorm;
  float eps = 1e-5f;  // LayerNorm: the kernels' fixed 1e-5
  bool has_bias() const { return kind == NormKind::LayerNorm; }
  // Whether forward keeps the rows' mean (LayerNorm) besides their 1/rms.
  bool keeps_mean() const { return kind == NormKind::LayerNorm; }
};

struct PositionPart {
  PositionKind kind = PositionKind::Learned;
  int64_t table_rows = 0;  // learned: n_positions rows of C
};

// Multi-head (grouped-query) attention: q, k, v from one projection of the normed input. Or
// multi-head latent attention (DeepSeek-V2/V3, kernels/ops.h mla_pack): q through q_lora_rank
// (0: one projection), k and v through a latent of kv_lora_rank, each latent RMSNorm'ed (eps
// latent_eps); heads of qk dim nope + rope and v dim v_dim, the attention ops run them at head
// dim nope + rope (v padded). head_dim is the attention ops' head dim either way.
struct AttentionPart {
  AttentionKind kind = AttentionKind::MultiHead;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  bool qkv_bias = false, o_bias = false;
  // Latent attention.
  int64_t q_rank = 0, kv_rank = 0, nope_dim = 0, rope_dim = 0, v_dim = 0;
  float latent_eps = 1e-6f;
  float q_scale = 1.0f;  // the softmax scale beyond head_dim^-1/2 (YaRN's mscale^2)
  bool latent() const { return kind == AttentionKind::Latent; }
  int64_t q_width() const { return heads * head_dim; }
  int64_t kv_width() const { return kv_heads * head_dim; }
  // The attention ops' input (q, k, v heads of head_dim) and output (the o projection's input).
  int64_t qkv_width() const { return q_width() + 2 * kv_width(); }
  int64_t out_width() const { return latent() ? heads * v_dim : q_width(); }
  int64_t kv_latent_width() const { return heads * (nope_dim + v_dim); }  // kv_b's output
};

// A dense MLP, or a mixture of SwiGLU experts of `width` each: a router (a linear layer to
// `experts` logits) picks top_k experts per token (Backend::moe_route, kernels/ops.h).
struct MlpPart {
  MlpKind kind = MlpKind::Gelu;
  int64_t width = 0;       // I: the hidden width (of gate and of up for SwiGLU; of each expert)
  bool bias = false;       // on the up (gate and up) and down projections
  std::string width_name;  // the config field that gives the width, for messages
  int64_t experts = 0, top_k = 0;  // MoE
  bool norm_topk = true;           // MoE: the top-k weights renormalized
  // MoE: a shared SwiGLU expert of this width every token passes through, its output scaled by
  // sigmoid(x @ w_gate) (Qwen2-MoE); 0: none.
  int64_t shared_width = 0;
  // MoE: with a load-balancing loss (model/moe_aux_loss.h), whose gradient reaches the scores.
  bool aux_loss = false;
  // MoE: the shared expert's output scaled by sigmoid(x @ w_gate) (Qwen2-MoE), or added as it
  // is (DeepSeekMoE's shared experts).
  bool shared_gate = true;
  // MoE: the router (kernels/ops.h MoeRouting): sigmoid scores (DeepSeek-V3), the routed
  // weights' factor, group-limited choice, and a per-expert selection bias tensor (V3's
  // e_score_correction_bias, loaded and saved, not trained).
  bool sigmoid = false;
  float routed_scale = 1.0f;
  int64_t groups = 1, top_groups = 1;
  bool group_top_two = false;
  bool selection_bias = false;
  // The up projection's output per hidden unit: GELU 1, SwiGLU (and its experts) 2 ([gate | up]).
  int64_t up_factor() const { return kind == MlpKind::Gelu ? 1 : 2; }
  // Rows the experts see per token: top_k for MoE (each token copied to k experts), else 1.
  int64_t rows_per_token() const { return kind == MlpKind::MoE ? top_k : 1; }
};

struct HeadPart {
  bool tied = true;  // the LM head is the embedding's matrix
};

// The tensor names of a family's Hugging Face checkpoints, and how it stores a linear layer.
// A name list of one entry is one tensor holding every group (GPT-2's c_attn: q, k, v), of
// several entries one tensor per group (q_proj, k_proj, v_proj), packed side by side in the
// block so that they form one matrix.
struct TensorNames {
  // Weights (in, out) as GPT-2's Conv1D; else (out, in) as nn.Linear.
  bool in_by_out = false;
  std::string embedding, positions;  // positions: the learned table, if any
  std::string layer_prefix;          // "h." | "model.layers.", then the layer's index and "."
  std::string norm1, norm2, final_norm;
  std::vector<std::string> qkv, up;
  std::string o, down;
  std::string head;  // an untied head's matrix
  // MoE: the router's matrix, expert e's tensors "<experts><e>.<name>.weight".
  std::string router = {}, experts = {};
  std::vector<std::string> expert_up = {};  // gate, up
  std::string expert_down = {};
  std::string shared_expert = {}, shared_gate = {};  // "<shared_expert><up or down name>.weight"
  std::string router_bias = {};                       // the router's selection bias
  // Latent attention: q (no q rank) or q_a, its norm, q_b; kv_a (latent | rope key), its norm
  // (of the latent), kv_b. The o projection is `o`.
  std::string q = {}, q_a = {}, q_norm = {}, q_b = {}, kv_a = {}, kv_norm = {}, kv_b = {};
};

// Initialization: every matrix and embedding N(0, init_std); the projections into the residual
// stream (attention output, MLP down) N(0, init_std / sqrt(2 n_layer)) where scaled_residual_init
// (GPT-2's, as Hugging Face initializes it); biases 0, norm weights 1.
struct DecoderParts {
  NormPart norm;
  PositionPart position;
  AttentionPart attention;
  MlpPart mlp;  // every layer's, or the MoE layers' of a model with dense layers among them
  // The dense layers' MLP among MoE layers (Qwen2-MoE's mlp_only_layers, decoder_sparse_step),
  // and which layers are MoE; empty: every layer has `mlp`.
  MlpPart dense_mlp;
  std::vector<bool> moe_layers;
  HeadPart head;
  TensorNames names;
  double init_std = 0.02;
  bool scaled_residual_init = false;
  int64_t width = 0;   // C: the residual stream (hidden_size)
  int64_t layers = 0;  // L

  // Layer `layer`'s MLP part.
  const MlpPart& layer_mlp(int64_t layer) const {
    return moe_layers.empty() || moe_layers[static_cast<size_t>(layer)] ? mlp : dense_mlp;
  }
  // Whether the layers' MLPs differ (a dense layer among MoE layers).
  bool mixed_layers() const {
    for (bool moe : moe_layers) {
      if (!moe) return true;
    }
    return false;
  }
};

// The parts of `config`'s model: the table of each model_type.
DecoderParts decoder_parts(const ModelConfig& config);

}  // namespace dstrain
