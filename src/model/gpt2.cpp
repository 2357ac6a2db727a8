#include "model/gpt2.h"

namespace dstrain {

Gpt2::Gpt2(const ModelConfig& config, Backend& backend, Allocator& allocator, int64_t B, int64_t T,
           DType act_dtype, bool with_backward, Recompute recompute)
    : arch_(config),
      stage_(arch_, whole_model(config), backend, allocator, B, T, act_dtype, with_backward,
             recompute, 1) {}

double Gpt2::forward(ParamProvider& params, Tensor tokens, Tensor targets, float dloss,
                     Stream stream) {
  DSTRAIN_CHECK(tokens.ndim == 2 && tokens.dtype == DType::I32) << tokens.shape_str();
  return stage_.forward(params, 0, tokens.size(0), tokens.size(1), tokens, targets, dloss, stream);
}

void Gpt2::backward(ParamProvider& params, Tensor tokens, Stream stream) {
  stage_.backward(params, 0, tokens, stream);
}

}  // namespace dstrain
