// Internal to the CPU backend (kernels/cpu/): the kernel entry points the Backend methods
// forward to, and the helpers they share. Nothing outside kernels/cpu/ includes this.
//
// How a kernel sees storage: every float tensor is read and written through fp32 "spans"
// (a contiguous element range). For an F32 tensor a span is a pointer into the tensor itself
// (no copy); for F16/BF16 it is converted into per-thread scratch on load and rounded (RNE) on
// store. So each kernel is written once in fp32, each tensor of an op may have its own storage
// dtype (e.g. BF16 activations with F32 gradients), and an output is rounded exactly once,
// where it is stored.
//
// How kernels thread: parallel_for over a task count that does not depend on the thread
// count; each output element is written by exactly one task; every reduction runs inside one
// task in a fixed order. So results are bitwise identical for any number of threads.
// Arguments are validated before any parallel region: nothing throws inside one.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace dstrain::cpu {

struct CpuContext {
  int num_threads = 1;  // >= 1
};

// ---- argument checks (throw dstrain::Error naming the argument) ----
bool is_float_dtype(DType dtype);
// REQUIRES-style checks: `t` is non-empty, on the CPU, and of the stated dtype family.
void check_float_tensor(const Tensor& t, const char* name);
void check_tensor_dtype(const Tensor& t, DType dtype, const char* name);
// Rows of `t` seen as (rows, cols) with cols = its last dimension.
int64_t rows_of(const Tensor& t);
int64_t cols_of(const Tensor& t);

// ---- fp32 spans over storage ----
template <class T>
inline void convert_to_f32(const T* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = load_f32(src[i]);
}
template <class T>
inline void convert_from_f32(const float* src, int64_t count, T* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = store_as<T>(src[i]);
}

// Rotates x (2 * half) by the angles of cos_sin (half, 2), pairs (x[i], x[i + half]) (rotary
// embeddings' rotate-half); sin_sign -1 rotates by the negated angles (the transpose). Products
// and sums as written: the build has no FMA contraction, and the CUDA kernels round the same
// operations the same way.
inline void rotate_half_pairs(float* x, const float* cos_sin, int64_t half, float sin_sign) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = cos_sin[2 * i], s = sin_sign * cos_sin[2 * i + 1];
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

// Elements [offset, offset + count) of float tensor `t` as fp32: a pointer into `t` when it
// is F32, else `scratch` (>= count floats) filled by conversion.
inline const float* load_span(const Tensor& t, int64_t offset, int64_t count, float* scratch) {
  switch (t.dtype) {
    case DType::F16:
      convert_to_f32(static_cast<const half_t*>(t.data) + offset, count, scratch);
      return scratch;
    case DType::BF16:
      convert_to_f32(static_cast<const bf16_t*>(t.data) + offset, count, scratch);
      return scratch;
    default:
      return static_cast<const float*>(t.data) + offset;
  }
}

// Like load_span but always into `dst` (a copy even for F32).
inline void load_span_into(const Tensor& t, int64_t offset, int64_t count, float* dst) {
  const float* span = load_span(t, offset, count, dst);
  if (span != dst) std::memcpy(dst, span, static_cast<size_t>(count) * sizeof(float));
}

// Where to compute elements [offset, offset + count) of output `t`: a pointer into `t` when
// it is F32, else `scratch`. Follow with commit_span, which rounds scratch into `t`.
inline float* output_span(const Tensor& t, int64_t offset, int64_t count, float* scratch) {
  return t.dtype == DType::F32 ? static_cast<float*>(t.data) + offset : scratch;
}

inline void commit_span(const Tensor& t, int64_t offset, int64_t count, const float* values) {
  switch (t.dtype) {
    case DType::F16:
      convert_from_f32(values, count, static_cast<half_t*>(t.data) + offset);
      break;
    case DType::BF16:
      convert_from_f32(values, count, static_cast<bf16_t*>(t.data) + offset);
      break;
    default: {
      float* dst = static_cast<float*>(t.data) + offset;
      if (dst != values) std::memcpy(dst, values, static_cast<size_t>(count) * sizeof(float));
    }
  }
}

// Elements [offset, offset + count) of `t` set to 0. REQUIRES: scratch holds count floats.
inline void zero_span(const Tensor& t, int64_t offset, int64_t count, float* scratch) {
  float* out = output_span(t, offset, count, scratch);
  std::fill(out, out + count, 0.0f);
  commit_span(t, offset, count, out);
}

// t[offset + i] = round(t[offset + i] + values[i]): one rounding per element.
template <class T>
inline void accumulate_typed(T* dst, const float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = store_as<T>(load_f32(dst[i]) + values[i]);
}
inline void accumulate_span(const Tensor& t, int64_t offset, int64_t count, const float* values) {
  switch (t.dtype) {
    case DType::F16:
      accumulate_typed(static_cast<half_t*>(t.data) + offset, values, count);
      break;
    case DType::BF16:
      accumulate_typed(static_cast<bf16_t*>(t.data) + offset, values, count);
      break;
    default:
      accumulate_typed(static_cast<float*>(t.data) + offset, values, count);
  }
}

// A whole float tensor as fp32: its own memory when F32, else a converted copy (in parallel).
class F32View {
 public:
  F32View(const CpuContext& ctx, const Tensor& t);
  const float* data() const { return data_; }

 private:
  std::unique_ptr<float[]> converted_;  // not zero-filled: every element is written
  const float* data_ = nullptr;
};

// ---- threading ----
// body(task, thread) for task in [0, count), static schedule, `thread` in [0, num_threads).
template <class Body>
void parallel_for(const CpuContext& ctx, int64_t count, Body&& body) {
  if (count <= 0) return;
  if (ctx.num_threads == 1 || count == 1) {
    for (int64_t task = 0; task < count; ++task) body(task, 0);
    return;
  }
  const int threads = static_cast<int>(std::min<int64_t>(ctx.num_threads, count));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < count; ++task) body(task, omp_get_thread_num());
}

// Per-thread fp32 scratch, allocated before the parallel region (so no allocation can throw
// inside it), each thread's slice padded to a cache line.
class ThreadScratch {
 public:
  ThreadScratch(const CpuContext& ctx, int64_t floats_per_thread)
      : stride_((std::max<int64_t>(floats_per_thread, 1) + 15) / 16 * 16),
        storage_(static_cast<size_t>(stride_ * ctx.num_threads)) {}
  float* get(int thread) { return storage_.data() + stride_ * thread; }

 private:
  int64_t stride_;
  std::vector<float> storage_;
};

// Fixed chunk of elementwise work per task: independent of the thread count.
constexpr int64_t kElementChunk = 8192;
inline int64_t num_chunks(int64_t n) { return (n + kElementChunk - 1) / kElementChunk; }

// ---- kernels (shapes and semantics as in kernels/ops.h) ----
void fill_zero(const CpuContext& ctx, Tensor t);
void copy(const CpuContext& ctx, Tensor dst, Tensor src);

void embedding_forward(const CpuContext& ctx, Tensor out, Tensor tokens, Tensor positions,
                       Tensor wte, Tensor wpe, int64_t vocab_begin, int64_t vocab_rows);
void embedding_backward(const CpuContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout,
                        Tensor tokens, Tensor positions, int64_t vocab_begin, int64_t vocab_rows);
void layernorm_forward(const CpuContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias);
void layernorm_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias,
                        Tensor dout, Tensor inp, Tensor weight, Tensor mean, Tensor rstd);
// cpu_llama_ops.cpp: RMSNorm and SwiGLU.
void rmsnorm_forward(const CpuContext& ctx, Tensor out, Tensor rstd, Tensor inp, Tensor weight,
                     float eps);
void rmsnorm_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                      Tensor weight, Tensor rstd);
void swiglu_forward(const CpuContext& ctx, Tensor out, Tensor inp, Tensor amax);
void swiglu_backward(const CpuContext& ctx, Tensor dinp, Tensor dout, Tensor inp, Tensor amax);
void gelu_forward(const CpuContext& ctx, Tensor out, Tensor inp);
void gelu_backward(const CpuContext& ctx, Tensor dinp, Tensor dout, Tensor inp);
void residual_forward(const CpuContext& ctx, Tensor out, Tensor a, Tensor b);
void accumulate(const CpuContext& ctx, Tensor dst, Tensor src);
void add_bias(const CpuContext& ctx, Tensor x, Tensor bias);
void softmax_cross_entropy(const CpuContext& ctx, Tensor losses, Tensor dlogits, Tensor logits,
                           Tensor targets, int vocab, float dloss);
void cross_entropy_stats(const CpuContext& ctx, Tensor stats, Tensor logits, Tensor targets,
                         int64_t vocab_begin, int vocab);
void cross_entropy_from_stats(const CpuContext& ctx, Tensor losses, Tensor dlogits, Tensor logits,
                              Tensor stats, Tensor targets, int64_t vocab_begin, int vocab,
                              float dloss);

void matmul_forward(const CpuContext& ctx, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                    bool weight_out_by_in);
// dsum (cols) += column sums of x (rows, cols), rows in order: matmul_backward's dbias.
void column_sums_accumulate(const CpuContext& ctx, Tensor dsum, Tensor x);
void matmul_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                     Tensor inp, Tensor weight, bool weight_out_by_in);
void matmul_gelu_forward(const CpuContext& ctx, Tensor out, Tensor pre_gelu, Tensor inp,
                         Tensor weight, Tensor bias);

// cpu_moe.cpp: the mixture-of-experts ops.
void moe_route(const CpuContext& ctx, Tensor topk_weight, Tensor topk_expert, Tensor scores,
               Tensor logits, const MoeRouting& routing);
void moe_route_backward(const CpuContext& ctx, Tensor dlogits, Tensor dtopk_weight,
                        Tensor dscores, Tensor scores, Tensor topk_expert,
                        const MoeRouting& routing);
void moe_dispatch(const CpuContext& ctx, Tensor expert_offsets, Tensor source_rows,
                  Tensor dest_rows, Tensor topk_expert, int experts);
void moe_gather(const CpuContext& ctx, Tensor out, Tensor inp, Tensor source_rows);
void moe_combine(const CpuContext& ctx, Tensor out, Tensor inp, Tensor dest_rows, Tensor weight);
void moe_combine_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                          Tensor inp, Tensor dest_rows, Tensor weight);
void grouped_matmul_forward(const CpuContext& ctx, Tensor out, Tensor inp, Tensor weight,
                            Tensor expert_offsets);
void grouped_matmul_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                             Tensor inp, Tensor weight, Tensor expert_offsets);

void fp8_quantize(const CpuContext& ctx, Tensor out, Tensor out_t, Tensor scale_inv, Tensor inp,
                  Tensor amax);
void fp8_amax(const CpuContext& ctx, Tensor amax, Tensor inp);
void matmul_fp8(const CpuContext& ctx, Tensor out, Tensor a, Tensor a_scale_inv, Tensor b,
                Tensor b_scale_inv, Tensor bias, bool accumulate);

void attention_forward(const CpuContext& ctx, Tensor out, Tensor lse, Tensor qkv,
                       Tensor positions, int n_head, int n_kv_head);
void attention_backward(const CpuContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                        Tensor lse, Tensor positions, int n_head, int n_kv_head);
// cpu_rope.cpp; `transposed` rotates by -angle (the backward).
void rope(const CpuContext& ctx, Tensor qkv, Tensor freqs, Tensor positions, int n_head,
          int n_kv_head,
          bool transposed);

void mla_pack(const CpuContext& ctx, Tensor qkv, Tensor q, Tensor kv, Tensor k_rope, Tensor freqs,
              Tensor positions, const MlaHeads& heads);
void mla_pack_backward(const CpuContext& ctx, Tensor dq, Tensor dkv, Tensor dk_rope, Tensor dqkv,
                       Tensor freqs, Tensor positions, const MlaHeads& heads);
void mla_unpad(const CpuContext& ctx, Tensor out, Tensor atty, const MlaHeads& heads);
void mla_unpad_backward(const CpuContext& ctx, Tensor datty, Tensor dout, const MlaHeads& heads);
void adamw(const CpuContext& ctx, Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
           const AdamWStep& step);
double sum_squares(const CpuContext& ctx, Tensor x);
void scale(const CpuContext& ctx, Tensor x, float s);
bool has_inf_or_nan(const CpuContext& ctx, Tensor x);

}  // namespace dstrain::cpu
