#include "optim/adamw.h"

#include <algorithm>
#include <cstring>

#include "optim/host_adamw.h"

namespace dstrain {

float clip_coefficient(double grad_norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double coefficient = max_norm / (grad_norm + 1e-6);
  return static_cast<float>(std::min(1.0, coefficient));
}

AdamWStep adamw_step(const AdamWConfig& config, double lr, int64_t step, float grad_scale) {
  AdamWStep adam;
  adam.lr = static_cast<float>(lr);
  adam.beta1 = static_cast<float>(config.beta1);
  adam.beta2 = static_cast<float>(config.beta2);
  adam.eps = static_cast<float>(config.eps);
  adam.step = step;
  adam.grad_scale = grad_scale;
  return adam;
}

void for_each_decay_piece(const ParamLayout& layout, int tp_rank, const FlatRange& range,
                          double weight_decay,
                          const std::function<void(int64_t, int64_t, float)>& fn) {
  const int64_t range_end = range.begin + range.numel;
  for (int index : layout.block_params(range.block)) {
    const ParamSpec& spec = layout.params()[index];
    // Only the rows files hold: padded vocabulary rows are never touched.
    const int64_t begin = std::max(range.begin, spec.offset);
    const int64_t end = std::min(range_end, spec.offset + spec.slice_file_numel(tp_rank));
    if (begin >= end) continue;
    fn(begin - range.begin, end - begin,
       spec.weight_decay ? static_cast<float>(weight_decay) : 0.0f);
  }
}

void append_adamw_buffers(const ParamLayout& layout, int tp_rank, const FlatRange& range,
                          Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
                          double weight_decay, std::vector<AdamWTensors>& buffers) {
  DSTRAIN_CHECK(param.numel() == range.numel && grad.numel() == range.numel &&
                m.numel() == range.numel && v.numel() == range.numel);
  for_each_decay_piece(layout, tp_rank, range, weight_decay,
                       [&](int64_t local, int64_t count, float piece_decay) {
    const auto piece = [&](const Tensor& t) { return t.slice(local, {count}); };
    buffers.push_back({piece(param), piece(grad), piece(m), piece(v),
                       param_copy.empty() ? Tensor() : piece(param_copy), piece_decay});
  });
}

void adamw_update_range(Backend& backend, const ParamLayout& layout, int tp_rank,
                        const FlatRange& range, Tensor param, Tensor grad, Tensor m, Tensor v,
                        Tensor param_copy,
                        const AdamWConfig& config, double lr, int64_t step, float grad_scale,
                        Stream stream) {
  std::vector<AdamWTensors> buffers;
  append_adamw_buffers(layout, tp_rank, range, param, grad, m, v, param_copy, config.weight_decay,
                       buffers);
  backend.adamw_multi(buffers, adamw_step(config, lr, step, grad_scale), stream);
}

void host_adamw_update_range(const ParamLayout& layout, int tp_rank, const FlatRange& range,
                             Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
                             const AdamWConfig& config, double lr, int64_t step,
                             float grad_scale, int num_threads) {
  DSTRAIN_CHECK(param.numel() == range.numel && grad.numel() == range.numel &&
                m.numel() == range.numel && v.numel() == range.numel && m.dtype == v.dtype);
  DSTRAIN_CHECK(param.device.is_cpu() && grad.device.is_cpu() && m.device.is_cpu() &&
                v.device.is_cpu() && (param_copy.empty() || param_copy.device.is_cpu()))
      << "the host AdamW works on host memory";
  AdamWStep adam = adamw_step(config, lr, step, grad_scale);
  const size_t grad_width = dtype_size(grad.dtype);
  for_each_decay_piece(layout, tp_rank, range, config.weight_decay,
                       [&](int64_t local, int64_t count, float weight_decay) {
    adam.weight_decay = weight_decay;
    float* piece = param.f32() + local;
    const void* grads = static_cast<const char*>(grad.data) + local * grad_width;
    uint16_t* copy16 = nullptr;
    if (!param_copy.empty() && param_copy.dtype != DType::F32) {
      copy16 = static_cast<uint16_t*>(param_copy.data) + local;
    }
    const size_t moment_width = dtype_size(m.dtype);
    host_adamw_moments(HostAdamWIsa::Auto, piece, grads, grad.dtype,
                       static_cast<char*>(m.data) + local * moment_width,
                       static_cast<char*>(v.data) + local * moment_width, m.dtype, copy16,
                       param_copy.empty() ? DType::F32 : param_copy.dtype, count, adam,
                       num_threads);
    if (!param_copy.empty() && param_copy.dtype == DType::F32) {
      std::memcpy(param_copy.f32() + local, piece, count * sizeof(float));
    }
  });
}

}  // namespace dstrain
