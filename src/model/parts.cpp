#include "model/parts.h"

namespace dstrain {

namespace {

// GPT-2: LayerNorm, learned positions, multi-head attention with biases, a tanh-GELU MLP of
// 4 C with biases, the head tied; Conv1D weights; residual projections initialized scaled.
DecoderParts gpt2_parts(const ModelConfig& config) {
  DecoderParts parts;
  parts.norm = {NormKind::LayerNorm, 1e-5f};
  parts.position = {PositionKind::Learned, config.n_positions};
  parts.mlp = {MlpKind::Gelu, config.mlp_width(), config.mlp_bias, "the MLP width 4 * n_embd"};
  parts.head.tied = true;
  parts.names = {.in_by_out = true,
                 .embedding = "wte.weight",
                 .positions = "wpe.weight",
                 .layer_prefix = "h.",
                 .norm1 = "ln_1",
                 .norm2 = "ln_2",
                 .final_norm = "ln_f",
                 .qkv = {"attn.c_attn"},
                 .up = {"mlp.c_fc"},
                 .o = "attn.c_proj",
                 .down = "mlp.c_proj",
                 .head = ""};
  parts.scaled_residual_init = true;
  return parts;
}

// The LLaMA family (Llama, DeepSeek-LLM, Qwen2): RMSNorm, rotary positions, grouped-query
// attention (Qwen2: q, k, v biases), a SwiGLU MLP, the head tied or not; nn.Linear weights.
DecoderParts llama_parts(const ModelConfig& config) {
  DecoderParts parts;
  parts.norm = {NormKind::RMSNorm, static_cast<float>(config.norm_eps)};
  parts.position = {PositionKind::Rotary, 0};
  parts.mlp = {MlpKind::SwiGLU, config.mlp_width(), config.mlp_bias,
               "the MLP width intermediate_size"};
  parts.head.tied = config.tie_word_embeddings;
  parts.names = {.in_by_out = false,
                 .embedding = "model.embed_tokens.weight",
                 .positions = "",
                 .layer_prefix = "model.layers.",
                 .norm1 = "input_layernorm",
                 .norm2 = "post_attention_layernorm",
                 .final_norm = "model.norm",
                 .qkv = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"},
                 .up = {"mlp.gate_proj", "mlp.up_proj"},
                 .o = "self_attn.o_proj",
                 .down = "mlp.down_proj",
                 .head = "lm_head.weight"};
  if (config.moe.enabled()) {
    // Mixtral's names (block_sparse_moe, w1 w3 w2), or Qwen2-MoE's and DeepSeekMoE's (mlp,
    // gate_proj ...).
    const bool mixtral = config.type == ModelType::Mixtral;
    const bool deepseek = config.type == ModelType::DeepSeekMoe;
    parts.mlp = {MlpKind::MoE,
                 config.moe.expert_width,
                 false,
                 mixtral ? "the expert width intermediate_size" : "moe_intermediate_size",
                 config.moe.experts,
                 config.moe.top_k,
                 config.moe.norm_topk,
                 config.moe.shared_width,
                 config.moe.aux_loss_coef > 0 || config.moe.aux_alpha > 0,
                 config.moe.shared_gate};
    if (deepseek) parts.mlp.width_name = "moe_intermediate_size";
    parts.names.router = mixtral ? "block_sparse_moe.gate" : "mlp.gate";
    parts.names.experts = mixtral ? "block_sparse_moe.experts." : "mlp.experts.";
    parts.names.expert_up = mixtral ? std::vector<std::string>{"w1", "w3"}
                                    : std::vector<std::string>{"gate_proj", "up_proj"};
    parts.names.expert_down = mixtral ? "w2" : "down_proj";
    parts.names.shared_expert = deepseek ? "mlp.shared_experts." : "mlp.shared_expert.";
    parts.names.shared_gate = deepseek ? "" : "mlp.shared_expert_gate";
    parts.dense_mlp = {MlpKind::SwiGLU, config.mlp_width(), config.mlp_bias,
                       "the MLP width intermediate_size"};
    for (int64_t layer = 0; layer < config.n_layer; ++layer) {
      parts.moe_layers.push_back(config.moe.moe_layer(layer));
    }
  }
  return parts;
}

}  // namespace

DecoderParts decoder_parts(const ModelConfig& config) {
  DecoderParts parts = config.type == ModelType::Gpt2 ? gpt2_parts(config) : llama_parts(config);
  parts.attention = {config.n_head, config.kv_heads(), config.head_dim(), config.qkv_bias,
                     config.o_bias};
  parts.width = config.n_embd;
  parts.layers = config.n_layer;
  return parts;
}

}  // namespace dstrain
