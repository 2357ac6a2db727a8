#include "model/parts.h"

#include "model/rotary.h"

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

// DeepSeek's routers (DeepSeekMoE, V2, V3): the top-k weights renormalized only where k > 1;
// V2 scales them by routed_scaling_factor where they are not renormalized, V3 always; the
// group limit and V3's sigmoid scores and selection bias.
void deepseek_router(const ModelConfig& config, MlpPart& mlp) {
  const MoeConfig& moe = config.moe;
  mlp.norm_topk = moe.norm_topk && moe.top_k > 1;
  const bool scaled = config.type == ModelType::DeepSeekV3 || !mlp.norm_topk;
  mlp.routed_scale = scaled ? static_cast<float>(moe.routed_scale) : 1.0f;
  mlp.sigmoid = moe.sigmoid;
  mlp.groups = moe.groups;
  mlp.top_groups = moe.top_groups;
  mlp.group_top_two = moe.group_top_two;
  mlp.selection_bias = moe.selection_bias;
}

// Multi-head latent attention (DeepSeek-V2/V3) and its tensor names.
void latent_attention(const ModelConfig& config, DecoderParts& parts) {
  const MlaConfig& mla = config.mla;
  AttentionPart& a = parts.attention;
  a.kind = AttentionKind::Latent;
  a.kv_heads = a.heads;
  a.head_dim = mla.qk_dim();
  a.qkv_bias = a.o_bias = false;
  a.q_rank = mla.q_lora_rank;
  a.kv_rank = mla.kv_lora_rank;
  a.nope_dim = mla.nope_dim;
  a.rope_dim = mla.rope_dim;
  a.v_dim = mla.v_dim;
  a.q_scale = static_cast<float>(attention_softmax_factor(config));
  TensorNames& n = parts.names;
  n.qkv = {};
  if (mla.q_lora_rank > 0) {
    n.q_a = "self_attn.q_a_proj";
    n.q_norm = "self_attn.q_a_layernorm";
    n.q_b = "self_attn.q_b_proj";
  } else {
    n.q = "self_attn.q_proj";
  }
  n.kv_a = "self_attn.kv_a_proj_with_mqa";
  n.kv_norm = "self_attn.kv_a_layernorm";
  n.kv_b = "self_attn.kv_b_proj";
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
    const bool deepseek = config.type == ModelType::DeepSeekMoe || config.is_deepseek_v2_or_v3();
    parts.mlp = {MlpKind::MoE,
                 config.moe.expert_width,
                 false,
                 mixtral ? "the expert width intermediate_size" : "moe_intermediate_size",
                 config.moe.experts,
                 config.moe.top_k,
                 config.moe.norm_topk,
                 config.moe.shared_width,
                 config.moe.aux_loss_coef > 0 || config.moe.deepseek_aux_alpha() > 0,
                 config.moe.shared_gate};
    if (deepseek) {
      parts.mlp.width_name = "moe_intermediate_size";
      deepseek_router(config, parts.mlp);
    }
    parts.names.router = mixtral ? "block_sparse_moe.gate" : "mlp.gate";
    parts.names.experts = mixtral ? "block_sparse_moe.experts." : "mlp.experts.";
    parts.names.expert_up = mixtral ? std::vector<std::string>{"w1", "w3"}
                                    : std::vector<std::string>{"gate_proj", "up_proj"};
    parts.names.expert_down = mixtral ? "w2" : "down_proj";
    parts.names.shared_expert = deepseek ? "mlp.shared_experts." : "mlp.shared_expert.";
    parts.names.shared_gate = deepseek ? "" : "mlp.shared_expert_gate";
    if (config.moe.selection_bias) parts.names.router_bias = "mlp.gate.e_score_correction_bias";
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
  parts.attention.heads = config.n_head;
  parts.attention.kv_heads = config.kv_heads();
  parts.attention.head_dim = config.head_dim();
  parts.attention.qkv_bias = config.qkv_bias;
  parts.attention.o_bias = config.o_bias;
  if (config.mla.enabled()) latent_attention(config, parts);
  parts.width = config.n_embd;
  parts.layers = config.n_layer;
  return parts;
}

}  // namespace dstrain
