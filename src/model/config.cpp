#include "model/config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/check.h"
#include "model/presets.h"

namespace dstrain {

int64_t ModelConfig::num_parameters() const {
  const int64_t C = n_embd;
  const int64_t per_layer = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C +
                            (C * 4 * C + 4 * C) + (4 * C * C + C);
  return vocab_size * C + n_positions * C + n_layer * per_layer + 2 * C;
}

nlohmann::json ModelConfig::to_json() const {
  return nlohmann::json{{"model_type", "gpt2"},
                        {"architectures", {"GPT2LMHeadModel"}},
                        {"vocab_size", vocab_size},
                        {"n_positions", n_positions},
                        {"n_ctx", n_positions},
                        {"n_embd", n_embd},
                        {"n_layer", n_layer},
                        {"n_head", n_head},
                        {"n_inner", nullptr},
                        {"layer_norm_epsilon", 1e-5},
                        {"activation_function", "gelu_new"},
                        {"resid_pdrop", 0.0},
                        {"embd_pdrop", 0.0},
                        {"attn_pdrop", 0.0},
                        {"tie_word_embeddings", true}};
}

static int64_t positive_field(const nlohmann::json& json, const char* field, int64_t limit,
                              const std::string& origin) {
  DSTRAIN_USER_CHECK(json.contains(field))
      << "model config " << origin << " has no \"" << field << "\" field";
  const nlohmann::json& value = json.at(field);
  DSTRAIN_USER_CHECK(value.is_number_integer())
      << "model config " << origin << ": \"" << field << "\" must be an integer, not "
      << value.dump();
  const int64_t number = value.get<int64_t>();
  DSTRAIN_USER_CHECK(number > 0 && number <= limit)
      << "model config " << origin << ": \"" << field << "\" = " << number
      << " is out of range (1.." << limit << ")";
  return number;
}

ModelConfig model_config_from_json(const std::string& text, const std::string& origin) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    DSTRAIN_USER_ERROR() << "model config " << origin << " is not valid JSON ("
                         << error.what() << ")";
  }
  DSTRAIN_USER_CHECK(json.is_object()) << "model config " << origin << " is not a JSON object";
  if (json.contains("model_type")) {
    DSTRAIN_USER_CHECK(json["model_type"] == "gpt2")
        << "model config " << origin << " has model_type " << json["model_type"].dump()
        << "; dstrain trains GPT-2-style models (model_type \"gpt2\")";
  }
  ModelConfig config;
  config.name = origin;
  config.vocab_size = positive_field(json, "vocab_size", int64_t{1} << 24, origin);
  config.n_positions = positive_field(json, "n_positions", int64_t{1} << 20, origin);
  config.n_embd = positive_field(json, "n_embd", 65536, origin);
  config.n_layer = positive_field(json, "n_layer", 1024, origin);
  config.n_head = positive_field(json, "n_head", 1024, origin);
  DSTRAIN_USER_CHECK(config.n_embd % config.n_head == 0)
      << "model config " << origin << ": n_embd " << config.n_embd
      << " is not divisible by n_head " << config.n_head;
  if (json.contains("layer_norm_epsilon")) {
    const auto& eps = json["layer_norm_epsilon"];
    DSTRAIN_USER_CHECK(eps.is_number() && std::abs(eps.get<double>() - 1e-5) < 1e-12)
        << "model config " << origin << ": layer_norm_epsilon " << eps.dump()
        << " is not supported (dstrain's GPT-2 uses 1e-5)";
  }
  if (json.contains("activation_function")) {
    const auto& act = json["activation_function"];
    DSTRAIN_USER_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast")
        << "model config " << origin << ": activation_function " << act.dump()
        << " is not supported (dstrain uses the tanh GELU, \"gelu_new\")";
  }
  if (json.contains("n_inner") && !json["n_inner"].is_null()) {
    DSTRAIN_USER_CHECK(json["n_inner"].is_number_integer() &&
                       json["n_inner"].get<int64_t>() == 4 * config.n_embd)
        << "model config " << origin << ": n_inner must be null or 4 * n_embd";
  }
  if (json.contains("tie_word_embeddings")) {
    DSTRAIN_USER_CHECK(json["tie_word_embeddings"] == true)
        << "model config " << origin << ": only tied word embeddings are supported";
  }
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
                               name_or_path.ends_with(".json");
  if (!looks_like_path) {
    std::ostringstream known;
    for (const std::string& name : model_preset_names()) known << " " << name;
    DSTRAIN_USER_ERROR() << "unknown model '" << name_or_path
                         << "': give a preset name (" << known.str().substr(1)
                         << ") or the path of a config.json";
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
