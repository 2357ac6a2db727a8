// Gpt2: a whole model (any config: the decoder of model/decoder.h) as one stage with one
// micro-batch slot, what the model tests use. The name is the tests' first model's.
#pragma once

#include <cstdint>
#include <vector>

#include "core/allocator.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/layout.h"
#include "model/param_provider.h"
#include "model/stage.h"

namespace dstrain {

// The whole model: one stage of every layer, one micro-batch slot.
class Gpt2 {
 public:
  // Allocates activations and workspace for micro-batches of at most (B, T).
  // REQUIRES: T <= config.n_positions.
  Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B, int64_t T,
       DType act_dtype, bool with_backward, Recompute recompute = Recompute::None);

  const ModelConfig& config() const { return arch_.config(); }
  const ParamLayout& layout() const { return arch_.layout(); }
  int64_t max_batch() const { return stage_.max_batch(); }
  int64_t max_seq() const { return stage_.max_seq(); }

  // tokens (b,T') I32 with b <= B, T' <= T. With targets (b,T'): computes the per-token losses
  // and returns their mean (fp64 sum in order). With dloss != 0 it also computes the gradient
  // of the logits (weight dloss per token) and backpropagates it through the head for a
  // backward() that follows. Without targets it computes logits only and returns 0.
  double forward(ParamProvider& params, Tensor tokens, Tensor targets, float dloss, Stream stream);
  // Backpropagates the last forward (which must have had dloss != 0), adding into the
  // gradients of every block.
  void backward(ParamProvider& params, Tensor tokens, Stream stream);

  // (b, T', Vp) logits of the last forward (after a forward with dloss != 0: their gradient).
  Tensor logits() const { return stage_.logits(); }

 private:
  Decoder arch_;
  ModelStage stage_;
};

}  // namespace dstrain
