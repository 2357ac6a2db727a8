// The model configuration: field names as in a Hugging Face GPT-2 config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dstrain {

struct ModelConfig {
  std::string name;        // preset name or file path it came from
  int64_t vocab_size = 0;  // V: the real vocabulary; files always hold V rows
  int64_t n_positions = 0; // maxT
  int64_t n_embd = 0;      // C
  int64_t n_layer = 0;     // L
  int64_t n_head = 0;      // NH

  // Vp: the vocabulary padded inside dstrain to a multiple of 64 (GEMM-friendly). The padded
  // rows of wte are zero, never indexed, masked out of the softmax, and never saved.
  int64_t padded_vocab() const { return (vocab_size + 63) / 64 * 64; }
  int64_t head_dim() const { return n_embd / n_head; }
  // Number of parameters as Hugging Face counts them (real vocabulary, tied head).
  int64_t num_parameters() const;

  nlohmann::json to_json() const;  // a config.json transformers can load
};

// Parses a config.json text. `origin` names it in errors.
// Throws UserError on missing or absurd fields (n_embd not divisible by n_head, ...).
ModelConfig model_config_from_json(const std::string& text, const std::string& origin);

// `--model`: a preset name ("tiny", "gpt2-124m", ...) or the path of a config.json.
ModelConfig load_model_config(const std::string& name_or_path);

std::vector<std::string> model_preset_names();

}  // namespace dstrain
