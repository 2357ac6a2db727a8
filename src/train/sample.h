// A short sample from the trained model at the end of a run: the model in action.
#pragma once

#include <cstdint>
#include <vector>

#include "core/allocator.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/param_provider.h"
#include "train/weights_io.h"

namespace dstrain {

// A ParamProvider over full host copies (no gradients).
class HostParams : public ParamProvider {
 public:
  explicit HostParams(const HostBlocks& blocks) : blocks_(blocks) {}
  Tensor acquire_params(int block) override { return blocks_.block(block); }
  Tensor acquire_grads(int block) override;

 private:
  const HostBlocks& blocks_;
};

// Samples `count` tokens after `prompt` with temperature 1, seeded, with the whole model on
// `backend` (host memory: a CPU backend). T: the longest context.
std::vector<int32_t> sample_tokens(const ModelConfig& config, Backend& backend,
                                   Allocator& allocator, ParamProvider& params,
                                   std::vector<int32_t> prompt, int64_t count, int64_t T,
                                   uint64_t seed);

}  // namespace dstrain
