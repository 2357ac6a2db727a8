#include "model/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "core/check.h"
#include "model/layout.h"
#include "model/presets.h"

namespace dstrain {

const char* model_type_name(ModelType type) {
  switch (type) {
    case ModelType::Gpt2:
      return "gpt2";
    case ModelType::Llama:
      return "llama";
    case ModelType::Qwen2:
      return "qwen2";
    case ModelType::Mixtral:
      return "mixtral";
    case ModelType::Qwen2Moe:
      return "qwen2_moe";
    case ModelType::DeepSeekMoe:
      return "deepseek";
    case ModelType::DeepSeekV2:
      return "deepseek_v2";
    case ModelType::DeepSeekV3:
      return "deepseek_v3";
  }
  return "?";
}

bool MoeConfig::moe_layer(int64_t layer) const {
  // Qwen2MoeDecoderLayer: experts unless listed in mlp_only_layers, every sparse_step-th layer.
  // DeepSeek's: from first_k_dense_replace on, every moe_layer_freq-th.
  if (!enabled() || layer < first_dense || layer % layer_freq != 0) return false;
  for (int64_t dense : mlp_only_layers) {
    if (dense == layer) return false;
  }
  return (layer + 1) % sparse_step == 0;
}

int64_t ModelConfig::num_parameters() const {
  // What the parts declare (model/layout.h): every tensor as files hold it, a tied head once.
  const ParamLayout layout(*this);
  int64_t total = 0;
  for (const ParamSpec& spec : layout.params()) total += spec.file_numel();
  return total;
}

static nlohmann::json gpt2_json(const ModelConfig& c) {
  return nlohmann::json{{"model_type", "gpt2"},
                        {"architectures", {"GPT2LMHeadModel"}},
                        {"vocab_size", c.vocab_size},
                        {"n_positions", c.n_positions},
                        {"n_ctx", c.n_positions},
                        {"n_embd", c.n_embd},
                        {"n_layer", c.n_layer},
                        {"n_head", c.n_head},
                        {"n_inner", nullptr},
                        {"layer_norm_epsilon", 1e-5},
                        {"activation_function", "gelu_new"},
                        {"resid_pdrop", 0.0},
                        {"embd_pdrop", 0.0},
                        {"attn_pdrop", 0.0},
                        {"tie_word_embeddings", true}};
}

static const char* architecture_name(ModelType type) {
  switch (type) {
    case ModelType::Qwen2:
      return "Qwen2ForCausalLM";
    case ModelType::Mixtral:
      return "MixtralForCausalLM";
    case ModelType::Qwen2Moe:
      return "Qwen2MoeForCausalLM";
    case ModelType::DeepSeekMoe:
      return "DeepseekForCausalLM";
    case ModelType::DeepSeekV2:
      return "DeepseekV2ForCausalLM";
    case ModelType::DeepSeekV3:
      return "DeepseekV3ForCausalLM";
    default:
      return "LlamaForCausalLM";
  }
}

// DeepSeek-V2/V3's router fields (configuration_deepseek.py).
static void deepseek_router_json(const ModelConfig& c, nlohmann::json& json) {
  json["n_group"] = c.moe.groups;
  json["topk_group"] = c.moe.top_groups;
  json["topk_method"] = c.type == ModelType::DeepSeekV3 ? "noaux_tc"
                        : c.moe.groups > 1          ? "group_limited_greedy"
                                                    : "greedy";
  json["routed_scaling_factor"] = c.moe.routed_scale;
}

// The mixture-of-experts fields of DeepSeekMoE's config.json (its configuration_deepseek.py).
static void deepseek_moe_json(const ModelConfig& c, nlohmann::json& json) {
  json["n_routed_experts"] = c.moe.experts;
  json["moe_intermediate_size"] = c.moe.expert_width;
  json["n_shared_experts"] = c.moe.shared_width / c.moe.expert_width;
  json["first_k_dense_replace"] = c.moe.first_dense;
  json["moe_layer_freq"] = c.moe.layer_freq;
  json["norm_topk_prob"] = c.moe.norm_topk;
  json["scoring_func"] = c.moe.sigmoid ? "sigmoid" : "softmax";
  json["aux_loss_alpha"] = c.moe.aux_alpha;
  json["seq_aux"] = c.moe.seq_aux;
  json["pretraining_tp"] = 1;
  if (c.is_deepseek_v2_or_v3()) deepseek_router_json(c, json);
}

// Multi-head latent attention's fields (DeepSeek-V2/V3).
static void mla_json(const ModelConfig& c, nlohmann::json& json) {
  json["q_lora_rank"] = c.mla.q_lora_rank > 0 ? nlohmann::json(c.mla.q_lora_rank) : nullptr;
  json["kv_lora_rank"] = c.mla.kv_lora_rank;
  json["qk_nope_head_dim"] = c.mla.nope_dim;
  json["qk_rope_head_dim"] = c.mla.rope_dim;
  json["v_head_dim"] = c.mla.v_dim;
  if (c.type == ModelType::DeepSeekV3) json["num_nextn_predict_layers"] = c.mtp_layers;
}

// The mixture-of-experts fields of a Mixtral, Qwen2-MoE or DeepSeekMoE config.json.
static void moe_json(const ModelConfig& c, nlohmann::json& json) {
  json["num_experts_per_tok"] = c.moe.top_k;
  if (c.type == ModelType::DeepSeekMoe || c.is_deepseek_v2_or_v3()) {
    return deepseek_moe_json(c, json);
  }
  json["output_router_logits"] = c.moe.aux_loss_coef > 0;
  if (c.moe.aux_loss_coef > 0) json["router_aux_loss_coef"] = c.moe.aux_loss_coef;
  if (c.type == ModelType::Mixtral) {
    json["num_local_experts"] = c.moe.experts;
    json["intermediate_size"] = c.moe.expert_width;
    return;
  }
  json["num_experts"] = c.moe.experts;
  json["moe_intermediate_size"] = c.moe.expert_width;
  json["shared_expert_intermediate_size"] = c.moe.shared_width;
  json["norm_topk_prob"] = c.moe.norm_topk;
  json["decoder_sparse_step"] = c.moe.sparse_step;
  json["mlp_only_layers"] = c.moe.mlp_only_layers;
}

static nlohmann::json llama_json(const ModelConfig& c) {
  nlohmann::json json = c.passthrough;
  const bool qwen2 = c.type == ModelType::Qwen2 || c.type == ModelType::Qwen2Moe;
  json["model_type"] = model_type_name(c.type);
  json["architectures"] = {architecture_name(c.type)};
  json["vocab_size"] = c.vocab_size;
  json["max_position_embeddings"] = c.n_positions;
  json["hidden_size"] = c.n_embd;
  json["intermediate_size"] = c.mlp_width();
  json["num_hidden_layers"] = c.n_layer;
  json["num_attention_heads"] = c.n_head;
  json["num_key_value_heads"] = c.kv_heads();
  json["hidden_act"] = "silu";
  json["rms_norm_eps"] = c.norm_eps;
  json["rope_theta"] = c.rope_theta;
  json["rope_scaling"] = c.rope_scaling;
  json["tie_word_embeddings"] = c.tie_word_embeddings;
  json["torch_dtype"] = "float32";  // what dstrain's checkpoints hold
  json["attention_dropout"] = 0.0;  // dstrain trains without it (anything else is refused)
  if (!qwen2 && c.type != ModelType::Mixtral) {
    json["attention_bias"] = c.qkv_bias;
    // DeepSeek's configs have no mlp_bias.
    const bool deepseek = c.type == ModelType::DeepSeekMoe || c.is_deepseek_v2_or_v3();
    if (!deepseek) json["mlp_bias"] = c.mlp_bias;
  }
  if (c.moe.enabled()) moe_json(c, json);
  if (c.mla.enabled()) mla_json(c, json);
  return json;
}

nlohmann::json ModelConfig::to_json() const {
  return type == ModelType::Gpt2 ? gpt2_json(*this) : llama_json(*this);
}

namespace {

// Reads the fields of one config.json, naming it in every error.
class ConfigFields {
 public:
  ConfigFields(const nlohmann::json& json, const std::string& origin)
      : json_(json), origin_(origin) {}

  bool has(const char* field) const { return json_.contains(field) && !json_[field].is_null(); }
  const nlohmann::json& at(const char* field) const { return json_.at(field); }

  int64_t positive(const char* field, int64_t limit) const {
    DSTRAIN_USER_CHECK(json_.contains(field))
        << "model config " << origin_ << " has no \"" << field << "\" field";
    const nlohmann::json& value = json_.at(field);
    DSTRAIN_USER_CHECK(value.is_number_integer()) << "model config " << origin_ << ": \"" << field
                                                  << "\" must be an integer, not " << value.dump();
    const int64_t number = value.get<int64_t>();
    DSTRAIN_USER_CHECK(number > 0 && number <= limit)
        << "model config " << origin_ << ": \"" << field << "\" = " << number
        << " is out of range (1.." << limit << ")";
    return number;
  }
  int64_t positive_or(const char* field, int64_t limit, int64_t fallback) const {
    return has(field) ? positive(field, limit) : fallback;
  }
  // An integer in 0..limit (0 allowed), or the fallback when absent.
  int64_t count_or(const char* field, int64_t limit, int64_t fallback) const {
    if (has(field) && at(field).is_number_integer() && at(field).get<int64_t>() == 0) return 0;
    return positive_or(field, limit, fallback);
  }
  double number_or(const char* field, double low, double high, double fallback) const {
    if (!has(field)) return fallback;
    const nlohmann::json& value = json_.at(field);
    DSTRAIN_USER_CHECK(value.is_number() && value.get<double>() > low && value.get<double>() < high)
        << "model config " << origin_ << ": \"" << field << "\" = " << value.dump()
        << " is not a number in (" << low << ", " << high << ")";
    return value.get<double>();
  }
  bool flag_or(const char* field, bool fallback) const {
    if (!has(field)) return fallback;
    DSTRAIN_USER_CHECK(json_.at(field).is_boolean())
        << "model config " << origin_ << ": \"" << field << "\" must be true or false";
    return json_.at(field).get<bool>();
  }
  // One sentence: `what` is not supported.
  void unsupported(const std::string& what) const {
    DSTRAIN_USER_ERROR() << "model config " << origin_ << ": " << what;
  }
  const std::string& origin() const { return origin_; }

 private:
  const nlohmann::json& json_;
  const std::string& origin_;
};

void check_heads(const ModelConfig& c, const ConfigFields& f) {
  DSTRAIN_USER_CHECK(c.n_embd % c.n_head == 0)
      << "model config " << f.origin() << ": the width " << c.n_embd
      << " is not divisible by the number of heads " << c.n_head;
  DSTRAIN_USER_CHECK(c.n_head % c.kv_heads() == 0)
      << "model config " << f.origin() << ": num_attention_heads " << c.n_head
      << " is not a multiple of num_key_value_heads " << c.kv_heads();
}

ModelConfig gpt2_config(const ConfigFields& f) {
  ModelConfig config;
  config.vocab_size = f.positive("vocab_size", int64_t{1} << 24);
  config.n_positions = f.positive("n_positions", int64_t{1} << 20);
  config.n_embd = f.positive("n_embd", 65536);
  config.n_layer = f.positive("n_layer", 1024);
  config.n_head = f.positive("n_head", 1024);
  check_heads(config, f);
  if (f.has("layer_norm_epsilon") &&
      std::abs(f.number_or("layer_norm_epsilon", 0, 1, 1e-5) - 1e-5) > 1e-12) {
    f.unsupported("layer_norm_epsilon " + f.at("layer_norm_epsilon").dump() +
                  " is not supported (dstrain's GPT-2 uses 1e-5)");
  }
  if (f.has("activation_function")) {
    const auto& act = f.at("activation_function");
    if (!(act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast")) {
      f.unsupported("activation_function " + act.dump() +
                    " is not supported (dstrain uses the tanh GELU, \"gelu_new\")");
    }
  }
  if (f.has("n_inner") && f.positive("n_inner", int64_t{1} << 24) != 4 * config.n_embd) {
    f.unsupported("n_inner must be null or 4 * n_embd");
  }
  if (!f.flag_or("tie_word_embeddings", true)) {
    f.unsupported("only tied word embeddings are supported for GPT-2");
  }
  return config;
}

// DeepSeek-V2/V3's YaRN rope scaling: factor and original_max_position_embeddings, and
// beta_fast, beta_slow, mscale, mscale_all_dim with DeepseekV2YarnRotaryEmbedding's defaults
// (32, 1, 1, 0) written in.
nlohmann::json yarn_scaling(const ConfigFields& f, nlohmann::json scaling) {
  for (const char* field : {"factor", "original_max_position_embeddings"}) {
    DSTRAIN_USER_CHECK(scaling.contains(field) && scaling[field].is_number() &&
                       scaling[field].get<double>() >= 1.0)
        << "model config " << f.origin() << ": yarn rope_scaling needs \"" << field
        << "\" >= 1";
  }
  struct YarnField {
    const char* name;
    double fallback;
    bool positive;  // the betas divide; the mscales may be 0
  };
  for (const YarnField& field :
       {YarnField{"beta_fast", 32.0, true}, YarnField{"beta_slow", 1.0, true},
        YarnField{"mscale", 1.0, false}, YarnField{"mscale_all_dim", 0.0, false}}) {
    nlohmann::json& value = scaling[field.name];
    if (value.is_null()) value = field.fallback;
    const bool ok = value.is_number() &&
                    (field.positive ? value.get<double>() > 0 : value.get<double>() >= 0);
    DSTRAIN_USER_CHECK(ok) << "model config " << f.origin() << ": rope_scaling's \"" << field.name
                           << "\" must be a " << (field.positive ? "positive" : "non-negative")
                           << " number";
  }
  return scaling;
}

// Llama 3's rope scaling, DeepSeek-V2/V3's yarn (`yarn`: a DeepSeek model), or none. Other
// kinds (linear, dynamic) are refused.
nlohmann::json rope_scaling(const ConfigFields& f, bool yarn) {
  if (!f.has("rope_scaling")) return nullptr;
  const nlohmann::json& scaling = f.at("rope_scaling");
  DSTRAIN_USER_CHECK(scaling.is_object())
      << "model config " << f.origin() << ": rope_scaling must be an object or null";
  for (const char* field : {"rope_type", "type"}) {
    DSTRAIN_USER_CHECK(!scaling.contains(field) || scaling[field].is_string())
        << "model config " << f.origin() << ": rope_scaling's \"" << field
        << "\" must be a string";
  }
  const std::string kind = scaling.value("rope_type", scaling.value("type", std::string()));
  if (kind == "default") return nullptr;
  if (yarn && kind == "yarn") return yarn_scaling(f, scaling);
  if (kind != "llama3" || yarn) {
    f.unsupported("rope_scaling of type \"" + kind + "\" is not supported (" +
                  (yarn ? "DeepSeek's \"yarn\"" : "only Llama 3's \"llama3\"") + ")");
  }
  for (const char* field :
       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    DSTRAIN_USER_CHECK(scaling.contains(field) && scaling[field].is_number() &&
                       scaling[field].get<double>() > 0)
        << "model config " << f.origin() << ": rope_scaling needs a positive \"" << field << "\"";
  }
  return scaling;
}

// DeepSeekMoE's experts (configuration_deepseek.py's fields and defaults; DeepSeek-V2/V3's
// alike), one sentence for what dstrain does not do: pretraining_tp.
MoeConfig deepseek_moe_config(const ConfigFields& f) {
  MoeConfig moe;
  moe.experts = f.positive("n_routed_experts", 4096);
  moe.top_k = f.positive("num_experts_per_tok", moe.experts);
  moe.expert_width = f.positive("moe_intermediate_size", int64_t{1} << 20);
  moe.shared_width = f.has("n_shared_experts")
                         ? f.positive("n_shared_experts", 4096) * moe.expert_width
                         : 0;
  moe.shared_gate = false;
  moe.first_dense = f.count_or("first_k_dense_replace", 1 << 20, 0);
  moe.layer_freq = f.positive_or("moe_layer_freq", 1024, 1);
  moe.norm_topk = f.flag_or("norm_topk_prob", false);
  moe.aux_alpha = f.has("aux_loss_alpha") && f.at("aux_loss_alpha") == 0
                      ? 0.0
                      : f.number_or("aux_loss_alpha", 0, 1e6, 0.001);
  moe.seq_aux = f.flag_or("seq_aux", true);
  if (f.has("pretraining_tp") && f.at("pretraining_tp") != 1) {
    f.unsupported("pretraining_tp " + f.at("pretraining_tp").dump() +
                  " splits the projections for a slower, equivalent computation dstrain does not "
                  "reproduce (set it to 1)");
  }
  return moe;
}

// DeepSeek-V2's router (softmax; topk_method "greedy", its misspelling "gready", or
// "group_limited_greedy" over n_group groups) or V3's (sigmoid, "noaux_tc": groups ranked by
// their best two biased scores), into `moe`; one sentence for any other.
void deepseek_router_config(const ConfigFields& f, ModelType type, MoeConfig& moe) {
  const bool v3 = type == ModelType::DeepSeekV3;
  // A string field, or the config class's default where it is absent.
  const auto text = [&](const char* field, const char* fallback) {
    if (!f.has(field)) return std::string(fallback);
    DSTRAIN_USER_CHECK(f.at(field).is_string())
        << "model config " << f.origin() << ": \"" << field << "\" must be a string, not "
        << f.at(field).dump();
    return f.at(field).get<std::string>();
  };
  const std::string scoring = text("scoring_func", v3 ? "sigmoid" : "softmax");
  const std::string method = text("topk_method", v3 ? "noaux_tc" : "greedy");
  if (scoring != (v3 ? "sigmoid" : "softmax")) {
    f.unsupported("scoring_func \"" + scoring + "\" is not supported (DeepSeek-" +
                  (v3 ? "V3's \"sigmoid\")" : "V2's \"softmax\")"));
  }
  const bool grouped = v3 || method == "group_limited_greedy";
  if (v3 ? method != "noaux_tc" : !(grouped || method == "greedy" || method == "gready")) {
    f.unsupported("topk_method \"" + method + "\" is not supported (DeepSeek-" +
                  (v3 ? "V3's \"noaux_tc\")" : "V2's \"greedy\" or \"group_limited_greedy\")"));
  }
  moe.sigmoid = v3;
  moe.uses_aux_alpha = !v3;
  moe.group_top_two = v3;
  moe.selection_bias = v3;
  moe.routed_scale = f.number_or("routed_scaling_factor", 0, 1e6, v3 ? 2.5 : 1.0);
  moe.norm_topk = f.flag_or("norm_topk_prob", v3);
  if (!grouped) return;
  moe.groups = f.positive_or("n_group", 4096, 1);
  moe.top_groups = f.positive_or("topk_group", moe.groups, 1);
  const int64_t per_group = moe.experts / moe.groups;
  DSTRAIN_USER_CHECK(moe.experts % moe.groups == 0 && moe.top_k <= moe.top_groups * per_group &&
                     (!v3 || per_group >= 2))
      << "model config " << f.origin() << ": n_group " << moe.groups << " must divide the "
      << moe.experts << " experts" << (v3 ? " into groups of 2 or more" : "")
      << ", and topk_group " << moe.top_groups << " groups must hold num_experts_per_tok "
      << moe.top_k;
}

// DeepSeekMoE's router: softmax, top-k of every expert; one sentence for any other.
void deepseek_moe_router_checks(const ConfigFields& f) {
  if (f.has("scoring_func") && f.at("scoring_func") != "softmax") {
    f.unsupported("scoring_func " + f.at("scoring_func").dump() +
                  " is not supported (DeepSeekMoE's \"softmax\")");
  }
  if (f.has("topk_method") && f.at("topk_method") != "greedy") {
    f.unsupported("topk_method " + f.at("topk_method").dump() +
                  " is not supported (DeepSeekMoE's \"greedy\")");
  }
}

// The experts of a Mixtral or Qwen2-MoE config (with its shared expert and dense layers), and one
// sentence for what dstrain does not do with them yet: router jitter, sliding windows; those of
// DeepSeek's configs.
MoeConfig moe_config(const ConfigFields& f, ModelType type) {
  if (type == ModelType::DeepSeekMoe) {
    deepseek_moe_router_checks(f);
    return deepseek_moe_config(f);
  }
  if (type == ModelType::DeepSeekV2 || type == ModelType::DeepSeekV3) {
    MoeConfig moe = deepseek_moe_config(f);
    deepseek_router_config(f, type, moe);
    return moe;
  }
  const bool mixtral = type == ModelType::Mixtral;
  MoeConfig moe;
  moe.experts = f.positive(mixtral ? "num_local_experts" : "num_experts", 4096);
  moe.top_k = f.positive("num_experts_per_tok", moe.experts);
  moe.expert_width = f.positive(mixtral ? "intermediate_size" : "moe_intermediate_size",
                                int64_t{1} << 20);
  moe.norm_topk = mixtral || f.flag_or("norm_topk_prob", false);
  if (!mixtral) moe.shared_width = f.positive_or("shared_expert_intermediate_size", 1 << 20, 0);
  if (f.flag_or("output_router_logits", false)) {
    // transformers' default coefficient (MixtralConfig, Qwen2MoeConfig).
    moe.aux_loss_coef = f.number_or("router_aux_loss_coef", 0, 1e6, 0.001);
  }
  if (f.number_or("router_jitter_noise", -1, 1e9, 0.0) != 0.0) {
    f.unsupported("router_jitter_noise " + f.at("router_jitter_noise").dump() +
                  " asks for noise on the router's inputs, which dstrain does not implement");
  }
  if (mixtral && f.has("sliding_window")) {
    f.unsupported("sliding_window " + f.at("sliding_window").dump() +
                  " asks for sliding-window attention, which dstrain does not implement (null "
                  "attends over the whole --seq-len)");
  }
  if (mixtral) return moe;
  moe.sparse_step = f.positive_or("decoder_sparse_step", 1024, 1);
  if (f.has("mlp_only_layers")) {
    const nlohmann::json& layers = f.at("mlp_only_layers");
    DSTRAIN_USER_CHECK(layers.is_array())
        << "model config " << f.origin() << ": \"mlp_only_layers\" must be a list of layers";
    for (const nlohmann::json& layer : layers) {
      DSTRAIN_USER_CHECK(layer.is_number_integer() && layer.get<int64_t>() >= 0)
          << "model config " << f.origin() << ": \"mlp_only_layers\" holds " << layer.dump()
          << ", not a layer index";
      moe.mlp_only_layers.push_back(layer.get<int64_t>());
    }
  }
  return moe;
}

// The fields the LLaMA family's parser reads; the others pass through to the checkpoint.
const std::set<std::string>& llama_fields() {
  static const std::set<std::string> fields = {"model_type",
                                               "architectures",
                                               "vocab_size",
                                               "max_position_embeddings",
                                               "hidden_size",
                                               "intermediate_size",
                                               "num_hidden_layers",
                                               "num_attention_heads",
                                               "num_key_value_heads",
                                               "hidden_act",
                                               "rms_norm_eps",
                                               "rope_theta",
                                               "rope_scaling",
                                               "tie_word_embeddings",
                                               "attention_bias",
                                               "mlp_bias",
                                               "head_dim",
                                               "use_sliding_window",
                                               "attention_dropout",
                                               // Mixtral and Qwen2-MoE
                                               "num_local_experts",
                                               "num_experts",
                                               "num_experts_per_tok",
                                               "moe_intermediate_size",
                                               "shared_expert_intermediate_size",
                                               "norm_topk_prob",
                                               "decoder_sparse_step",
                                               "mlp_only_layers",
                                               "output_router_logits",
                                               // DeepSeekMoE
                                               "n_routed_experts",
                                               "n_shared_experts",
                                               "first_k_dense_replace",
                                               "moe_layer_freq",
                                               "scoring_func",
                                               "topk_method",
                                               "aux_loss_alpha",
                                               "seq_aux",
                                               "pretraining_tp",
                                               "router_jitter_noise",
                                               // DeepSeek-V2 and V3
                                               "q_lora_rank",
                                               "kv_lora_rank",
                                               "qk_nope_head_dim",
                                               "qk_rope_head_dim",
                                               "v_head_dim",
                                               "n_group",
                                               "topk_group",
                                               "routed_scaling_factor",
                                               "num_nextn_predict_layers"};
  return fields;
}

// Multi-head latent attention's fields (DeepSeek-V2/V3), one sentence for what dstrain does not
// do with them: attention biases (no DeepSeek checkpoint has them).
MlaConfig mla_config(const ConfigFields& f) {
  MlaConfig mla;
  mla.q_lora_rank = f.positive_or("q_lora_rank", 1 << 20, 0);
  mla.kv_lora_rank = f.positive("kv_lora_rank", 1 << 20);
  mla.nope_dim = f.count_or("qk_nope_head_dim", 4096, 0);
  mla.rope_dim = f.positive("qk_rope_head_dim", 4096);
  mla.v_dim = f.positive("v_head_dim", 4096);
  DSTRAIN_USER_CHECK(mla.rope_dim % 2 == 0 && mla.v_dim <= mla.qk_dim())
      << "model config " << f.origin() << ": qk_rope_head_dim " << mla.rope_dim
      << " must be even and v_head_dim " << mla.v_dim << " at most qk_nope_head_dim + "
      << "qk_rope_head_dim (" << mla.qk_dim() << ")";
  if (f.flag_or("attention_bias", false)) {
    f.unsupported("attention_bias true (biases on q_a_proj, kv_a_proj_with_mqa and o_proj) is not "
                  "supported for multi-head latent attention");
  }
  return mla;
}

ModelConfig llama_config(const nlohmann::json& json, const ConfigFields& f, ModelType type) {
  ModelConfig config;
  config.type = type;
  config.vocab_size = f.positive("vocab_size", int64_t{1} << 24);
  config.n_positions = f.positive("max_position_embeddings", int64_t{1} << 24);
  config.n_embd = f.positive("hidden_size", 65536);
  config.intermediate_size = f.positive("intermediate_size", int64_t{1} << 20);
  config.n_layer = f.positive("num_hidden_layers", 1024);
  config.n_head = f.positive("num_attention_heads", 1024);
  config.n_kv_head = f.positive_or("num_key_value_heads", 1024, config.n_head);
  check_heads(config, f);
  if (f.has("head_dim") && f.positive("head_dim", 4096) != config.head_dim()) {
    f.unsupported("head_dim " + f.at("head_dim").dump() + " differs from hidden_size / " +
                  "num_attention_heads (" + std::to_string(config.head_dim()) + ")");
  }
  if (f.has("hidden_act") && f.at("hidden_act") != "silu") {
    f.unsupported("hidden_act " + f.at("hidden_act").dump() + " is not supported (\"silu\")");
  }
  if (f.flag_or("use_sliding_window", false)) {
    f.unsupported("use_sliding_window true asks for sliding-window attention, which dstrain does "
                  "not implement (with false it attends over the whole --seq-len)");
  }
  if (f.number_or("attention_dropout", -1, 1, 0.0) != 0.0) {
    f.unsupported("attention_dropout " + f.at("attention_dropout").dump() +
                  " asks for dropout, which dstrain does not implement (set it to 0.0)");
  }
  config.norm_eps = f.number_or("rms_norm_eps", 0, 1, 1e-6);
  config.rope_theta = f.number_or("rope_theta", 0, 1e12, 10000.0);
  const bool deepseek_mla = type == ModelType::DeepSeekV2 || type == ModelType::DeepSeekV3;
  config.rope_scaling = rope_scaling(f, deepseek_mla);
  if (deepseek_mla) {
    config.mla = mla_config(f);
    config.n_kv_head = config.n_head;  // num_key_value_heads: MLA does not read it
    config.mtp_layers = f.count_or("num_nextn_predict_layers", 1024, 0);
  }
  config.tie_word_embeddings = f.flag_or("tie_word_embeddings", false);
  const bool qwen2 = type == ModelType::Qwen2 || type == ModelType::Qwen2Moe;
  const bool attention_bias = f.flag_or("attention_bias", false);
  config.qkv_bias = qwen2 || attention_bias;
  config.o_bias = !qwen2 && attention_bias;
  config.mlp_bias = !qwen2 && f.flag_or("mlp_bias", false);
  if (type == ModelType::Mixtral || type == ModelType::Qwen2Moe ||
      type == ModelType::DeepSeekMoe || (deepseek_mla && f.has("n_routed_experts"))) {
    config.moe = moe_config(f, type);
  }
  for (const auto& [key, value] : json.items()) {
    if (!llama_fields().count(key)) config.passthrough[key] = value;
  }
  return config;
}

// The LLaMA family's model_type names (every one but gpt2).
std::optional<ModelType> llama_family_type(const std::string& name) {
  for (ModelType type : {ModelType::Llama, ModelType::Qwen2, ModelType::Mixtral,
                         ModelType::Qwen2Moe, ModelType::DeepSeekMoe, ModelType::DeepSeekV2,
                         ModelType::DeepSeekV3}) {
    if (name == model_type_name(type)) return type;
  }
  return std::nullopt;
}

}  // namespace

ModelConfig model_config_from_json(const std::string& text, const std::string& origin) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    DSTRAIN_USER_ERROR() << "model config " << origin << " is not valid JSON (" << error.what()
                         << ")";
  }
  DSTRAIN_USER_CHECK(json.is_object()) << "model config " << origin << " is not a JSON object";
  const ConfigFields fields(json, origin);
  const std::string type = json.contains("model_type") && json["model_type"].is_string()
                               ? json["model_type"].get<std::string>()
                               : "gpt2";
  ModelConfig config;
  if (type == "gpt2") {
    config = gpt2_config(fields);
  } else if (const std::optional<ModelType> kind = llama_family_type(type)) {
    config = llama_config(json, fields, *kind);
  } else {
    DSTRAIN_USER_ERROR() << "model config " << origin << " has model_type "
                         << json["model_type"].dump()
                         << "; dstrain trains model_type \"gpt2\", \"llama\", \"qwen2\", "
                            "\"mixtral\", \"qwen2_moe\", \"deepseek\", \"deepseek_v2\" and "
                            "\"deepseek_v3\"";
  }
  config.name = origin;
  return config;
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const EmbeddedPreset& preset : embedded_presets()) names.push_back(preset.name);
  return names;
}

ModelConfig load_model_config(const std::string& name_or_path) {
  for (const EmbeddedPreset& preset : embedded_presets()) {
    if (name_or_path == preset.name) return model_config_from_json(preset.json, preset.name);
  }
  const bool looks_like_path = name_or_path.find('/') != std::string::npos ||
                               name_or_path.ends_with(".json") ||
                               std::filesystem::is_directory(name_or_path);
  if (!looks_like_path) {
    std::ostringstream known;
    for (const std::string& name : model_preset_names()) known << " " << name;
    DSTRAIN_USER_ERROR() << "unknown model '" << name_or_path << "': give a preset name ("
                         << known.str().substr(1)
                         << "), the path of a config.json or a Hugging Face model directory";
  }
  std::filesystem::path path(name_or_path);
  if (std::filesystem::is_directory(path)) path /= "config.json";
  std::ifstream file(path);
  DSTRAIN_USER_CHECK(file.good()) << "cannot read model config " << path.string();
  std::stringstream text;
  text << file.rdbuf();
  return model_config_from_json(text.str(), path.string());
}

}  // namespace dstrain
