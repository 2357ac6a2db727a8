#include "optim/adamw.h"

#include <algorithm>

namespace dstrain {

float clip_coefficient(double grad_norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double coefficient = max_norm / (grad_norm + 1e-6);
  return static_cast<float>(std::min(1.0, coefficient));
}

void adamw_update_range(Backend& backend, const ParamLayout& layout, const FlatRange& range,
                        Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
                        const AdamWConfig& config, double lr, int64_t step, float grad_scale,
                        Stream stream) {
  DSTRAIN_CHECK(param.numel() == range.numel && grad.numel() == range.numel &&
                m.numel() == range.numel && v.numel() == range.numel);
  AdamWStep adam;
  adam.lr = static_cast<float>(lr);
  adam.beta1 = static_cast<float>(config.beta1);
  adam.beta2 = static_cast<float>(config.beta2);
  adam.eps = static_cast<float>(config.eps);
  adam.step = step;
  adam.grad_scale = grad_scale;
  const int64_t range_end = range.begin + range.numel;
  for (int index : layout.block_params(range.block)) {
    const ParamSpec& spec = layout.params()[index];
    // Only the rows files hold: padded vocabulary rows are never touched.
    const int64_t begin = std::max(range.begin, spec.offset);
    const int64_t end = std::min(range_end, spec.offset + spec.file_numel());
    if (begin >= end) continue;
    adam.weight_decay = spec.weight_decay ? static_cast<float>(config.weight_decay) : 0.0f;
    const int64_t local = begin - range.begin, count = end - begin;
    backend.adamw(param.slice(local, {count}), grad.slice(local, {count}),
                  m.slice(local, {count}), v.slice(local, {count}),
                  param_copy.empty() ? Tensor() : param_copy.slice(local, {count}), adam, stream);
  }
}

}  // namespace dstrain
