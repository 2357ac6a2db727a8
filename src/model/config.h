// The model configuration, read from a Hugging Face config.json (or a preset: the same text,
// embedded). The model_types: gpt2 (GPT-2 field names), and the LLaMA family, llama and qwen2
// (hidden_size, num_attention_heads, ... mapped onto the same members below), with its
// mixture-of-experts members mixtral, qwen2_moe and deepseek (DeepSeekMoE, whose config.json and
// modeling code ship with its checkpoints), and deepseek_v2 / deepseek_v3 (DeepSeek-V2, V2-Lite,
// V3, R1: multi-head latent attention and DeepSeek's routers). DeepSeek-LLM checkpoints are
// model_type llama.
// Which parts a model is made of: model/parts.h.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dstrain {

// gpt2: pre-LN blocks with LayerNorm, learned positions, tanh GELU MLP, tied head, biases.
// llama / qwen2: pre-norm blocks with RMSNorm, rotary positions, grouped-query attention, a
// SwiGLU MLP; biases only where the config asks (Qwen2: q/k/v).
enum class ModelType { Gpt2, Llama, Qwen2, Mixtral, Qwen2Moe, DeepSeekMoe, DeepSeekV2, DeepSeekV3 };
// "gpt2" | "llama" | "qwen2" | "mixtral" | "qwen2_moe" | "deepseek" | "deepseek_v2" |
// "deepseek_v3"
const char* model_type_name(ModelType type);

// A mixture-of-experts MLP (experts > 0): a router picks top_k of `experts` SwiGLU experts of
// expert_width per token (Mixtral: num_local_experts, num_experts_per_tok, intermediate_size;
// Qwen2-MoE: num_experts, num_experts_per_tok, moe_intermediate_size), their weights
// renormalized where norm_topk (norm_topk_prob; Mixtral always), plus Qwen2-MoE's shared expert
// of shared_width (shared_expert_intermediate_size) behind a sigmoid gate. Qwen2-MoE's layers
// may be dense (a SwiGLU MLP of intermediate_size): those in mlp_only_layers, and all but every
// sparse_step-th (decoder_sparse_step), as transformers decides. DeepSeekMoE (n_routed_experts,
// num_experts_per_tok, moe_intermediate_size): n_shared_experts shared experts, one SwiGLU of
// n_shared_experts x the expert width without a gate; the first first_k_dense_replace layers
// and all but every moe_layer_freq-th dense; its own auxiliary loss (aux_loss_alpha, seq_aux).
// DeepSeek-V2 and V3 add their routers: group-limited choice (n_group, topk_group; V2's
// group_limited_greedy ranks a group by its best score, V3's noaux_tc by the sum of its best
// two), V3's sigmoid scores with a per-expert selection bias (e_score_correction_bias, read and
// written with the weights, never trained by the gradient), and routed_scaling_factor (V2:
// where the weights are not renormalized; V3: always).
struct MoeConfig {
  int64_t experts = 0;  // 0: a dense model
  int64_t top_k = 0;
  bool norm_topk = true;
  int64_t expert_width = 0;
  int64_t shared_width = 0;  // 0: no shared expert
  int64_t sparse_step = 1;
  std::vector<int64_t> mlp_only_layers = {};
  int64_t first_dense = 0;    // first_k_dense_replace
  int64_t layer_freq = 1;     // moe_layer_freq
  bool shared_gate = true;    // the shared expert's output scaled by sigmoid(x @ w_gate)
  // DeepSeek's auxiliary loss: aux_loss_alpha (0: none), per sequence (seq_aux) or over the
  // micro-batch's tokens (model/moe_aux_loss.h).
  double aux_alpha = 0;
  bool seq_aux = true;
  bool uses_aux_alpha = true;  // false: DeepSeek-V3's code, which never reads aux_loss_alpha
  // The load-balancing loss's coefficient where output_router_logits asks for it
  // (router_aux_loss_coef; model/moe_aux_loss.h); 0: none.
  double aux_loss_coef = 0;
  bool sigmoid = false;           // scoring_func "sigmoid" (V3), else softmax
  int64_t groups = 1;             // n_group (1: no group limit)
  int64_t top_groups = 1;         // topk_group
  bool group_top_two = false;     // a group's rank: the sum of its best two scores (noaux_tc)
  double routed_scale = 1.0;      // the routed weights' factor (after any renormalization)
  bool selection_bias = false;    // e_score_correction_bias
  bool enabled() const { return experts > 0; }
  // DeepSeek's auxiliary loss's coefficient where the model computes it (0: none).
  double deepseek_aux_alpha() const { return uses_aux_alpha ? aux_alpha : 0.0; }
  // Whether layer `layer` (0-based) has the experts.
  bool moe_layer(int64_t layer) const;
};

// Multi-head latent attention (DeepSeek-V2/V3; enabled where kv_lora_rank > 0): queries through
// a low-rank path of q_lora_rank (0: one q_proj), keys and values through a latent of
// kv_lora_rank (each path's RMSNorm with eps 1e-6), per head qk_nope_head_dim + qk_rope_head_dim
// (one rotary key of rope_dim shared by every head; the rotary pairs interleaved, as DeepSeek's
// checkpoints hold them) and values of v_head_dim.
struct MlaConfig {
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t nope_dim = 0, rope_dim = 0, v_dim = 0;
  bool enabled() const { return kv_lora_rank > 0; }
  int64_t qk_dim() const { return nope_dim + rope_dim; }
};

struct ModelConfig {
  std::string name;  // preset name or file path it came from
  ModelType type = ModelType::Gpt2;
  int64_t vocab_size = 0;         // V: the real vocabulary; files always hold V rows
  int64_t n_positions = 0;        // maxT (max_position_embeddings)
  int64_t n_embd = 0;             // C (hidden_size)
  int64_t n_layer = 0;            // L (num_hidden_layers)
  int64_t n_head = 0;             // NH (num_attention_heads)
  int64_t n_kv_head = 0;          // KV (num_key_value_heads); 0: n_head
  int64_t intermediate_size = 0;  // the MLP's hidden width; 0: 4 * n_embd (GPT-2)
  double norm_eps = 1e-5;         // layer_norm_epsilon | rms_norm_eps
  double rope_theta = 10000.0;    // the LLaMA family's rotary base
  // null, Llama 3's {"rope_type": "llama3", "factor", ...}, or DeepSeek's {"type": "yarn", ...}
  nlohmann::json rope_scaling;
  bool tie_word_embeddings = true;
  // Biases: GPT-2 has all of them; Llama only with attention_bias (q, k, v, o) / mlp_bias;
  // Qwen2 on q, k and v.
  bool qkv_bias = true, o_bias = true, mlp_bias = true;
  MoeConfig moe;
  MlaConfig mla;
  // DeepSeek-V3's multi-token prediction layers (num_nextn_predict_layers): in its checkpoints
  // as model.layers.<n_layer + i>.*, which dstrain does not train and loading skips.
  int64_t mtp_layers = 0;
  // The config.json fields dstrain does not use (token ids, torch_dtype, ...), written back
  // unchanged into a checkpoint's config.json.
  nlohmann::json passthrough = nlohmann::json::object();

  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t mlp_width() const { return intermediate_size > 0 ? intermediate_size : 4 * n_embd; }
  // Vp: the vocabulary padded inside dstrain to a multiple of 64 (GEMM-friendly). The padded
  // rows of the embedding (and head) are zero, never indexed, masked out of the softmax, and
  // never saved.
  int64_t padded_vocab() const { return (vocab_size + 63) / 64 * 64; }
  int64_t head_dim() const { return n_embd / n_head; }
  // The attention ops' head dim: head_dim, or MLA's qk dims (its v heads padded to them).
  int64_t attention_head_dim() const { return mla.enabled() ? mla.qk_dim() : head_dim(); }
  // The dims a rotary position turns per head: head_dim, or MLA's rope part.
  int64_t rotary_dim() const { return mla.enabled() ? mla.rope_dim : head_dim(); }
  bool is_deepseek_v2_or_v3() const {
    return type == ModelType::DeepSeekV2 || type == ModelType::DeepSeekV3;
  }
  // Number of parameters as Hugging Face counts them (real vocabulary; a tied head once).
  int64_t num_parameters() const;

  nlohmann::json to_json() const;  // a config.json transformers can load
};

// Parses a config.json text. `origin` names it in errors.
// Throws UserError on missing or absurd fields (n_embd not divisible by n_head, ...) and on
// what dstrain does not implement (another model_type, activation, rope scaling type, ...).
ModelConfig model_config_from_json(const std::string& text, const std::string& origin);

// `--model`: a preset name ("tiny", "gpt2-124m", "llama-tiny", ...), the path of a
// config.json, or a Hugging Face model directory holding one.
ModelConfig load_model_config(const std::string& name_or_path);

std::vector<std::string> model_preset_names();

}  // namespace dstrain
