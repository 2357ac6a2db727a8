// CPU twins of the LLaMA-family ops: RMSNorm and SwiGLU (shapes and semantics in kernels/ops.h,
// shape checks in kernels/op_checks.h).
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/op_checks.h"

namespace dstrain::cpu {

namespace {

// Columns per task of the dweight reduction: the tasks do not depend on the thread count.
constexpr int64_t kColumnBlock = 256;

// values[0, count) rounded through `dtype` in place (nothing to do for F32).
void round_span(DType dtype, float* values, int64_t count) {
  if (dtype == DType::F32) return;
  for (int64_t i = 0; i < count; ++i) values[i] = round_through(dtype, values[i]);
}

// norm (C) = x * rstd rounded to the input's dtype: Hugging Face's LlamaRMSNorm casts the
// normalized value back to the input dtype (`.to(input_dtype)`) before the weight multiply.
void normalized_row(const float* x, float rstd, int64_t C, DType inp_dtype, float* norm) {
  for (int64_t c = 0; c < C; ++c) norm[c] = x[c] * rstd;
  round_span(inp_dtype, norm, C);
}

}  // namespace

void rmsnorm_forward(const CpuContext& ctx, Tensor out, Tensor rstd, Tensor inp, Tensor weight,
                     float eps) {
  check_float_tensor(out, "rmsnorm out");
  check_float_tensor(inp, "rmsnorm inp");
  check_float_tensor(weight, "rmsnorm weight");
  check_tensor_dtype(rstd, DType::F32, "rmsnorm rstd");
  const RowShape s = check_rmsnorm_shapes(out, rstd, inp, weight, eps);
  const int64_t N = s.rows, C = s.cols;

  const F32View w(ctx, weight);  // (C)
  float* rstd_out = rstd.f32();  // (N)
  ThreadScratch scratch(ctx, 2 * C);
  parallel_for(ctx, N, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const float* x = load_span(inp, n * C, C, buffers);  // (C)
    float squares = 0.0f;
    for (int64_t c = 0; c < C; ++c) squares += x[c] * x[c];
    const float r = 1.0f / std::sqrt(squares / static_cast<float>(C) + eps);
    float* y = output_span(out, n * C, C, buffers + C);
    normalized_row(x, r, C, inp.dtype, y);
    for (int64_t c = 0; c < C; ++c) y[c] *= w.data()[c];
    commit_span(out, n * C, C, y);
    rstd_out[n] = r;
  });
}

namespace {

// dinp (N,C) += rstd * (dnorm - norm * mean(dnorm * norm)), dnorm = w * dout, norm = x * rstd
// (unrounded: the rounding to storage passes the gradient straight through).
void rmsnorm_backward_dinp(const CpuContext& ctx, const Tensor& dinp, const Tensor& dout,
                           const Tensor& inp, const float* w, const float* rstd, RowShape s) {
  const int64_t C = s.cols;
  ThreadScratch scratch(ctx, 3 * C);
  parallel_for(ctx, s.rows, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const float* x = load_span(inp, n * C, C, buffers);        // (C)
    const float* dy = load_span(dout, n * C, C, buffers + C);  // (C)
    float* dx = buffers + 2 * C;                               // (C)
    const float r = rstd[n];
    float dnorm_norm_sum = 0.0f;
    for (int64_t c = 0; c < C; ++c) dnorm_norm_sum += w[c] * dy[c] * (x[c] * r);
    const float dnorm_norm_mean = dnorm_norm_sum / static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) dx[c] = (w[c] * dy[c] - x[c] * r * dnorm_norm_mean) * r;
    accumulate_span(dinp, n * C, C, dx);
  });
}

// dweight (C) += sum over rows of dout * norm, norm rounded as in forward (it is what forward
// multiplied the weight with). One task per column block, rows in order: thread-invariant.
void rmsnorm_backward_dweight(const CpuContext& ctx, const Tensor& dweight, const Tensor& dout,
                              const Tensor& inp, const float* rstd, RowShape s) {
  const int64_t C = s.cols;
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
  ThreadScratch scratch(ctx, 4 * kColumnBlock);
  parallel_for(ctx, blocks, [&](int64_t block, int thread) {
    float* buffers = scratch.get(thread);
    const int64_t c0 = block * kColumnBlock, width = std::min(kColumnBlock, C - c0);
    float* dw = buffers;                       // (width)
    float* norm = buffers + 3 * kColumnBlock;  // (width)
    std::fill(dw, dw + width, 0.0f);
    for (int64_t n = 0; n < s.rows; ++n) {
      const float* x = load_span(inp, n * C + c0, width, buffers + kColumnBlock);
      const float* dy = load_span(dout, n * C + c0, width, buffers + 2 * kColumnBlock);
      normalized_row(x, rstd[n], width, inp.dtype, norm);
      for (int64_t c = 0; c < width; ++c) dw[c] += dy[c] * norm[c];
    }
    accumulate_span(dweight, c0, width, dw);
  });
}

}  // namespace

void rmsnorm_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                      Tensor weight, Tensor rstd) {
  check_float_tensor(dinp, "rmsnorm dinp");
  check_float_tensor(dweight, "rmsnorm dweight");
  check_float_tensor(dout, "rmsnorm dout");
  check_float_tensor(inp, "rmsnorm inp");
  check_float_tensor(weight, "rmsnorm weight");
  check_tensor_dtype(rstd, DType::F32, "rmsnorm rstd");
  const RowShape s = check_rmsnorm_backward_shapes(dinp, dweight, dout, inp, weight, rstd);
  const F32View w(ctx, weight);  // (C)
  rmsnorm_backward_dinp(ctx, dinp, dout, inp, w.data(), rstd.f32(), s);
  rmsnorm_backward_dweight(ctx, dweight, dout, inp, rstd.f32(), s);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

namespace {

// silu(g) = g / (1 + exp(-g)); exp overflows to inf for g < -88 and the quotient is then -0,
// the right limit, so no clamp is needed.
inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace

void swiglu_forward(const CpuContext& ctx, Tensor out, Tensor inp, Tensor amax) {
  check_float_tensor(out, "swiglu out");
  check_float_tensor(inp, "swiglu inp");
  check_amax_output(amax, "swiglu_forward");
  const RowShape s = check_swiglu_shapes(out, inp);
  const int64_t I = s.cols;
  ThreadScratch scratch(ctx, 3 * I);
  parallel_for(ctx, s.rows, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const float* gate = load_span(inp, n * 2 * I, I, buffers);        // (I)
    const float* up = load_span(inp, n * 2 * I + I, I, buffers + I);  // (I)
    float* y = output_span(out, n * I, I, buffers + 2 * I);           // (I)
    for (int64_t i = 0; i < I; ++i) y[i] = silu(gate[i]) * up[i];
    commit_span(out, n * I, I, y);
  });
  if (!amax.empty()) fp8_amax(ctx, amax, out);  // of the stored values
}

void swiglu_backward(const CpuContext& ctx, Tensor dinp, Tensor dout, Tensor inp, Tensor amax) {
  check_amax_output(amax, "swiglu_backward");
  check_float_tensor(dinp, "swiglu dinp");
  check_float_tensor(dout, "swiglu dout");
  check_float_tensor(inp, "swiglu inp");
  const RowShape s = check_swiglu_backward_shapes(dinp, dout, inp);
  const int64_t I = s.cols;
  ThreadScratch scratch(ctx, 5 * I);
  parallel_for(ctx, s.rows, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const float* gate = load_span(inp, n * 2 * I, I, buffers);         // (I)
    const float* up = load_span(inp, n * 2 * I + I, I, buffers + I);   // (I)
    const float* dy = load_span(dout, n * I, I, buffers + 2 * I);      // (I)
    float* dx = output_span(dinp, n * 2 * I, 2 * I, buffers + 3 * I);  // (2I) [dgate | dup]
    for (int64_t i = 0; i < I; ++i) {
      const float sigmoid = 1.0f / (1.0f + std::exp(-gate[i]));
      // silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
      const float dsilu = sigmoid * (1.0f + gate[i] * (1.0f - sigmoid));
      const float dgate = dy[i] * up[i] * dsilu;
      const float dup = dy[i] * silu(gate[i]);
      dx[i] = dgate;
      dx[I + i] = dup;
    }
    commit_span(dinp, n * 2 * I, 2 * I, dx);
  });
  if (!amax.empty()) fp8_amax(ctx, amax, dinp);
}

}  // namespace dstrain::cpu
