// CPU optimizer ops: AdamW, sum of squares, scale, inf/NaN check.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace dstrain::cpu {

// Mirrors torch.optim.AdamW's single-tensor (foreach=False, fused=False) path on fp32
// tensors, op by op, each rounded to fp32 as PyTorch rounds each tensor op:
//   param.mul_(1 - lr * wd)
//   m.lerp_(g, 1 - beta1)
//   v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
//   denom = (v.sqrt() / sqrt(bias_correction2)).add_(eps)
//   param.addcdiv_(m, denom, value=-lr / bias_correction1)
// Python-float scalars are computed in double and become float where the tensor op uses them;
// addcmul is self + (value * t1) * t2 and addcdiv self + (value * t1) / t2, as in ATen.
void adamw(const CpuContext& ctx, Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
           const AdamWStep& step) {
  check_tensor_dtype(param, DType::F32, "adamw param");
  check_tensor_dtype(m, DType::F32, "adamw m");
  check_tensor_dtype(v, DType::F32, "adamw v");
  check_float_tensor(grad, "adamw grad");
  const int64_t n = param.numel();
  DSTRAIN_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n)
      << "adamw param " << param.shape_str() << ", grad " << grad.shape_str() << ", m "
      << m.shape_str() << ", v " << v.shape_str() << " must have the same number of elements";
  if (!param_copy.empty()) {
    check_float_tensor(param_copy, "adamw param_copy");
    DSTRAIN_CHECK(param_copy.numel() == n)
        << "adamw param_copy " << param_copy.shape_str() << " must have " << n << " elements";
  }
  DSTRAIN_CHECK(step.step >= 1) << "adamw step " << step.step << " must be >= 1 (1-based)";

  const double lr = step.lr, beta1 = step.beta1, beta2 = step.beta2;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step.step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step.step));
  const float decay = static_cast<float>(1.0 - lr * static_cast<double>(step.weight_decay));
  const float lerp_weight = static_cast<float>(1.0 - beta1);
  const bool lerp_weight_small = std::abs(lerp_weight) < 0.5f;
  const float beta2_f = step.beta2;
  const float one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float neg_step_size = static_cast<float>(-(lr / bias_correction1));
  const float eps = step.eps, grad_scale = step.grad_scale;

  float* p = param.f32();
  float* m_data = m.f32();
  float* v_data = v.f32();
  ThreadScratch scratch(ctx, 2 * kElementChunk);
  parallel_for(ctx, num_chunks(n), [&](int64_t chunk, int thread) {
    float* buffers = scratch.get(thread);
    const int64_t begin = chunk * kElementChunk, count = std::min(kElementChunk, n - begin);
    const float* g_in = load_span(grad, begin, count, buffers);
    for (int64_t i = begin; i < begin + count; ++i) {
      const float g = g_in[i - begin] * grad_scale;
      const float param_decayed = p[i] * decay;
      // ATen's lerp: the small-weight form when |weight| < 0.5, else the mirrored one.
      const float m_old = m_data[i];
      const float m_new = lerp_weight_small ? m_old + lerp_weight * (g - m_old)
                                            : g - (g - m_old) * (1.0f - lerp_weight);
      const float v_new = v_data[i] * beta2_f + (one_minus_beta2 * g) * g;
      const float denom = std::sqrt(v_new) / bias_correction2_sqrt + eps;
      p[i] = param_decayed + (neg_step_size * m_new) / denom;
      m_data[i] = m_new;
      v_data[i] = v_new;
    }
    if (!param_copy.empty()) commit_span(param_copy, begin, count, p + begin);
  });
}

// Fixed chunks (independent of the thread count), each summed in order in double; the chunk
// sums are then added in chunk order.
double sum_squares(const CpuContext& ctx, Tensor x) {
  if (x.numel() == 0) return 0.0;
  check_float_tensor(x, "sum_squares x");
  const int64_t n = x.numel();
  const int64_t chunks = num_chunks(n);
  std::vector<double> chunk_sums(static_cast<size_t>(chunks));
  ThreadScratch scratch(ctx, kElementChunk);
  parallel_for(ctx, chunks, [&](int64_t chunk, int thread) {
    const int64_t begin = chunk * kElementChunk, count = std::min(kElementChunk, n - begin);
    const float* values = load_span(x, begin, count, scratch.get(thread));
    double sum = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      const double value = values[i];
      sum += value * value;
    }
    chunk_sums[static_cast<size_t>(chunk)] = sum;
  });
  double total = 0.0;
  for (double sum : chunk_sums) total += sum;
  return total;
}

void scale(const CpuContext& ctx, Tensor x, float s) {
  if (x.numel() == 0) return;
  check_float_tensor(x, "scale x");
  const int64_t n = x.numel();
  ThreadScratch scratch(ctx, kElementChunk);
  parallel_for(ctx, num_chunks(n), [&](int64_t chunk, int thread) {
    const int64_t begin = chunk * kElementChunk, count = std::min(kElementChunk, n - begin);
    float* buffer = scratch.get(thread);
    const float* values = load_span(x, begin, count, buffer);
    float* result = output_span(x, begin, count, buffer);
    for (int64_t i = 0; i < count; ++i) result[i] = values[i] * s;
    commit_span(x, begin, count, result);
  });
}

bool has_inf_or_nan(const CpuContext& ctx, Tensor x) {
  if (x.numel() == 0) return false;
  check_float_tensor(x, "has_inf_or_nan x");
  const int64_t n = x.numel();
  const int64_t chunks = num_chunks(n);
  std::vector<char> chunk_bad(static_cast<size_t>(chunks), 0);
  ThreadScratch scratch(ctx, kElementChunk);
  parallel_for(ctx, chunks, [&](int64_t chunk, int thread) {
    const int64_t begin = chunk * kElementChunk, count = std::min(kElementChunk, n - begin);
    const float* values = load_span(x, begin, count, scratch.get(thread));
    bool bad = false;
    for (int64_t i = 0; i < count; ++i) bad |= !std::isfinite(values[i]);
    chunk_bad[static_cast<size_t>(chunk)] = bad;
  });
  for (char bad : chunk_bad) {
    if (bad) return true;
  }
  return false;
}

}  // namespace dstrain::cpu
