// The LLaMA family (Llama 2/3, DeepSeek-LLM, Qwen2) as the decoder's parts (model/parts.h):
// RMSNorm, rotary positions (Hugging Face's rotate-half convention), grouped-query attention, a
// SwiGLU MLP, a tied or untied head, biases only where the config asks (Qwen2's q/k/v).
#pragma once

#include <cstdint>
#include <vector>

#include "model/architecture.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/layout.h"

namespace dstrain {

// The decoder, under the name the LLaMA tests know it by: nothing in it is the family's own.
using LlamaArchitecture = Decoder;

// The LLaMA family's initialization as Hugging Face's (init_model_parameters): N(0, 0.02) for
// the matrices and the embedding, zero biases, RMSNorm weights 1; each tensor from its own
// stream (seed, name), the same for any layout or sharding.
inline void init_llama_parameters(const ParamLayout& layout, const ModelConfig& config,
                                  uint64_t seed, const std::vector<Tensor>& block_flats) {
  init_model_parameters(layout, config, seed, block_flats);
}

}  // namespace dstrain
