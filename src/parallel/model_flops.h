// Floating-point work of a GPT-2 model per token (PaLM's model-FLOPs convention, Chowdhery et
// al. 2022, appendix B: 2 FLOPs per multiply-add, attention counted without the causal
// halving). Used by the cost model and by the pipeline split's balance.
#pragma once

#include <cstdint>

#include "model/config.h"

namespace dstrain {

struct ModelFlops {
  double layer_forward = 0;  // one layer: 24 C^2 (QKV 6, proj 2, fc 8, fc_proj 8) + 4 T C
  double head_forward = 0;   // the tied LM head: 2 C Vp
};

inline ModelFlops model_flops(const ModelConfig& config, int64_t seq_len) {
  const double C = static_cast<double>(config.n_embd), T = static_cast<double>(seq_len);
  ModelFlops f;
  f.layer_forward = 24 * C * C + 4 * T * C;
  f.head_forward = 2 * C * static_cast<double>(config.padded_vocab());
  return f;
}

}  // namespace dstrain
