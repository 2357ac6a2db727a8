// ParamProvider: how the model gets each block's parameters and the gradient buffer to add
// into. The model owns neither: with replicated weights they are the trainer's own buffers;
// with ZeRO-3 the provider gathers the block first (parallel/sharded_model.h).
#pragma once

#include <cstdint>
#include <optional>

#include "core/tensor.h"

namespace dstrain {

class ParamProvider {
 public:
  virtual ~ParamProvider() = default;
  // The block's full flat parameters (ParamLayout::block_numel elements), valid until
  // release_params(block).
  virtual Tensor acquire_params(int block) = 0;
  virtual void release_params(int block) {}
  // A hint: `block` is the next one whose parameters will be acquired. Called once the work of
  // the block in hand is queued, before it is released, so a provider that gathers (ZeRO-3)
  // can fetch the next block while that work runs.
  virtual void prefetch_params(int block) {}
  // The block's full flat gradient buffer; backward adds (+=) into it.
  virtual Tensor acquire_grads(int block) = 0;
  // This micro-batch's gradient of the block is all added.
  virtual void release_grads(int block) {}
  // A number that changes whenever the parameters' values may have (an optimizer step, a load),
  // so that what a stage derives from them may be kept while it stays (model/stage.h: the FP8
  // weight cache); nullopt: never assume they stayed.
  virtual std::optional<uint64_t> params_version() const { return std::nullopt; }
};

}  // namespace dstrain
