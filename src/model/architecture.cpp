#include "model/architecture.h"

#include "model/gpt2.h"
#include "model/llama.h"

namespace dstrain {

std::unique_ptr<Architecture> make_architecture(const ModelConfig& config,
                                                const TensorParallel& tp) {
  if (config.llama_family()) return std::make_unique<LlamaArchitecture>(config, tp);
  return std::make_unique<Gpt2Architecture>(config, tp);
}

void init_model_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                           const std::vector<Tensor>& block_flats) {
  if (config.llama_family()) {
    init_llama_parameters(layout, config, seed, block_flats);
  } else {
    init_gpt2_parameters(layout, config, seed, block_flats);
  }
}

}  // namespace dstrain
