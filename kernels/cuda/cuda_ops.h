// Internal to the CUDA backend (kernels/cuda/): the context every launcher gets, stream-ordered
// scratch, argument checks, and the entry points the Backend methods forward to (one .cu file
// per op family). Shapes and semantics are those of kernels/ops.h.
//
// How kernels see storage: each float tensor reaches a kernel as a DeviceTensor (pointer +
// dtype) and is read and written through load()/store() (cuda_common.cuh), which convert to
// and from fp32 with round-to-nearest-even. So every kernel is compiled once, whatever mix of
// F32/F16/BF16 its tensors have (the dtype branch is uniform across a warp).
#pragma once

#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/check.h"
#include "core/tensor.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/ops.h"

namespace dstrain::cuda {

// Bits of the backend's device error word (set by kernels, read after the stream is waited on).
enum DeviceErrorBits : unsigned {
  kBadTokenId = 1u,   // embedding: a token id outside [0, Vp)
  kBadTargetId = 2u,  // cross-entropy: a target id outside [0, V)
  kBadMoeIndex = 4u,  // mixture of experts: an expert, source or destination row out of range
};

struct CudaContext {
  int device = 0;
  int sm_count = 1;
  cublasHandle_t cublas = nullptr;
  cublasLtHandle_t cublaslt = nullptr;  // the GEMMs with a bias epilogue (cuda_matmul.cu)
  // cublas_workspace_bytes of device memory, shared by cuBLAS and cuBLASLt (stream-ordered).
  void* cublas_workspace = nullptr;
  size_t cublas_workspace_bytes = 0;
  cudaMemPool_t scratch_pool = nullptr;
  unsigned* error_word = nullptr;  // device view of a mapped pinned word (DeviceErrorBits)
};

// Device memory for the duration of one op, allocated and freed in stream order from the
// backend's pool: no synchronization, and no race with another stream's scratch.
class Scratch {
 public:
  Scratch(const CudaContext& ctx, size_t bytes, cudaStream_t stream);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

// The cuBLAS / CUDA library type of a float storage dtype (F32 for F32).
inline cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::F16:
      return CUDA_R_16F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F8E4M3:
      return CUDA_R_8F_E4M3;
    case DType::F8E5M2:
      return CUDA_R_8F_E5M2;
    default:
      return CUDA_R_32F;
  }
}

// Round `bytes` up to 256 so several arrays can share one Scratch, each aligned.
inline size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// ---- argument checks (throw dstrain::Error naming the argument) ----
bool is_float_dtype(DType dtype);
// `t` is non-empty, on this backend's GPU, and a float dtype (resp. exactly `dtype`).
void check_float_tensor(const CudaContext& ctx, const Tensor& t, const char* name);
void check_tensor_dtype(const CudaContext& ctx, const Tensor& t, DType dtype, const char* name);
// residual, a, b: float tensors of this GPU with the same rows (op_checks.h).
void check_residual_operands(const CudaContext& ctx, const Tensor& residual, const Tensor& a,
                             const Tensor& b);
void check_same_numel(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name);
int64_t rows_of(const Tensor& t);  // numel / last dim
int64_t cols_of(const Tensor& t);  // the last dim

// ---- launchers, one family per .cu file ----
// cuda_elementwise.cu
void copy_convert(const CudaContext& ctx, Tensor dst, Tensor src, cudaStream_t stream);
void gelu_forward(const CudaContext& ctx, Tensor out, Tensor inp, cudaStream_t stream);
void gelu_backward(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp,
                   cudaStream_t stream);
void residual_forward(const CudaContext& ctx, Tensor out, Tensor a, Tensor b, cudaStream_t stream);
void accumulate(const CudaContext& ctx, Tensor dst, Tensor src, cudaStream_t stream);
void add_bias(const CudaContext& ctx, Tensor x, Tensor bias, cudaStream_t stream);
void scale(const CudaContext& ctx, Tensor x, float s, cudaStream_t stream);

// cuda_gelu_bias.cu: gelu_backward, then dbias (cols; may be empty) += column sums of dinp as
// stored (column_sums_accumulate): bitwise the two ops, in one pass where the rows allow.
void gelu_backward_bias(const CudaContext& ctx, Tensor dinp, Tensor dbias, Tensor dout, Tensor inp,
                        cudaStream_t stream);

// cuda_embedding.cu
void embedding_forward(const CudaContext& ctx, Tensor out, Tensor tokens, Tensor positions,
                       Tensor wte, Tensor wpe, int64_t vocab_begin, int64_t vocab_rows,
                       cudaStream_t stream);
void embedding_backward(const CudaContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout,
                        Tensor tokens, Tensor positions, int64_t vocab_begin, int64_t vocab_rows,
                        cudaStream_t stream);

// cuda_layernorm.cu
void layernorm_forward(const CudaContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias, cudaStream_t stream);
void layernorm_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias,
                        Tensor dout, Tensor inp, Tensor weight, Tensor mean, Tensor rstd,
                        cudaStream_t stream);
// dsum (cols) += column sums of x (rows, cols), rows added in a fixed order: deterministic.
// Used for matmul's dbias.
void column_sums_accumulate(const CudaContext& ctx, Tensor dsum, Tensor x, cudaStream_t stream);
// dst (C) += partials (chunks, C) F32 added in chunk order, one thread per column: the second
// stage of a deterministic column reduction (rmsnorm's dweight).
void add_column_partials(Tensor dst, const float* partials, int64_t chunks, cudaStream_t stream);

// residual (N,C) = a + b (residual_forward), then the layernorm of it as stored: bitwise the
// two ops, in one pass where the rows fit in registers.
void residual_layernorm_forward(const CudaContext& ctx, Tensor residual, Tensor out, Tensor mean,
                                Tensor rstd, Tensor a, Tensor b, Tensor weight, Tensor bias,
                                cudaStream_t stream);

// cuda_rmsnorm.cu
void residual_rmsnorm_forward(const CudaContext& ctx, Tensor residual, Tensor out, Tensor rstd,
                              Tensor a, Tensor b, Tensor weight, float eps, cudaStream_t stream);
void rmsnorm_forward(const CudaContext& ctx, Tensor out, Tensor rstd, Tensor inp, Tensor weight,
                     float eps, cudaStream_t stream);
void rmsnorm_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                      Tensor weight, Tensor rstd, cudaStream_t stream);

// cuda_swiglu.cu
void swiglu_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor amax,
                    cudaStream_t stream);
void swiglu_backward(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp, Tensor amax,
                     cudaStream_t stream);

// cuda_moe.cu: the mixture-of-experts ops.
void moe_route(const CudaContext& ctx, Tensor topk_weight, Tensor topk_expert, Tensor scores,
               Tensor logits, const MoeRouting& routing, cudaStream_t stream);
void moe_route_backward(const CudaContext& ctx, Tensor dlogits, Tensor dtopk_weight,
                        Tensor dscores, Tensor scores, Tensor topk_expert,
                        const MoeRouting& routing, cudaStream_t stream);
void moe_dispatch(const CudaContext& ctx, Tensor expert_offsets, Tensor source_rows,
                  Tensor dest_rows, Tensor topk_expert, int experts, cudaStream_t stream);
void moe_gather(const CudaContext& ctx, Tensor out, Tensor inp, Tensor source_rows,
                cudaStream_t stream);
void moe_combine(const CudaContext& ctx, Tensor out, Tensor inp, Tensor dest_rows, Tensor weight,
                 cudaStream_t stream);
void moe_combine_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                          Tensor inp, Tensor dest_rows, Tensor weight, cudaStream_t stream);
// cuda_fp8.cu; matmul_fp8 in cuda_matmul.cu
void fp8_quantize(const CudaContext& ctx, Tensor out, Tensor out_t, Tensor scale_inv, Tensor inp,
                  Tensor amax, cudaStream_t stream);
void fp8_amax(const CudaContext& ctx, Tensor amax, Tensor inp, cudaStream_t stream);
void matmul_fp8(const CudaContext& ctx, Tensor out, Tensor a, Tensor a_scale_inv, Tensor b,
                Tensor b_scale_inv, Tensor bias, bool accumulate, cudaStream_t stream);

void grouped_matmul_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight,
                            Tensor expert_offsets, cudaStream_t stream);
void grouped_matmul_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                             Tensor inp, Tensor weight, Tensor expert_offsets,
                             cudaStream_t stream);

// cuda_matmul.cu
void matmul_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                    bool weight_out_by_in, cudaStream_t stream);
void matmul_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                     Tensor inp, Tensor weight, bool weight_out_by_in, cudaStream_t stream);
void matmul_gelu_forward(const CudaContext& ctx, Tensor out, Tensor pre_gelu, Tensor inp,
                         Tensor weight, Tensor bias, cudaStream_t stream);

// cuda_attention_forward.cu / cuda_attention_backward.cu
void attention_forward(const CudaContext& ctx, Tensor out, Tensor lse, Tensor qkv,
                       Tensor positions, int n_head, int n_kv_head, cudaStream_t stream);
void attention_backward(const CudaContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                        Tensor lse, Tensor positions, int n_head, int n_kv_head,
                        cudaStream_t stream);

// cuda_rope.cu; `transposed` rotates by -angle (the backward).
void mla_pack(const CudaContext& ctx, Tensor qkv, Tensor q, Tensor kv, Tensor k_rope,
              Tensor freqs, Tensor positions, const MlaHeads& heads, cudaStream_t stream);
void mla_pack_backward(const CudaContext& ctx, Tensor dq, Tensor dkv, Tensor dk_rope, Tensor dqkv,
                       Tensor freqs, Tensor positions, const MlaHeads& heads, cudaStream_t stream);
void mla_unpad(const CudaContext& ctx, Tensor out, Tensor atty, const MlaHeads& heads,
               cudaStream_t stream);
void mla_unpad_backward(const CudaContext& ctx, Tensor datty, Tensor dout, const MlaHeads& heads,
                        cudaStream_t stream);
void rope(const CudaContext& ctx, Tensor qkv, Tensor freqs, Tensor positions, int n_head,
          int n_kv_head,
          bool transposed, cudaStream_t stream);

// cuda_cross_entropy.cu
void softmax_cross_entropy(const CudaContext& ctx, Tensor losses, Tensor dlogits, Tensor logits,
                           Tensor targets, int vocab, float dloss, cudaStream_t stream);
void cross_entropy_stats(const CudaContext& ctx, Tensor stats, Tensor logits, Tensor targets,
                         int64_t vocab_begin, int vocab, cudaStream_t stream);
void cross_entropy_from_stats(const CudaContext& ctx, Tensor losses, Tensor dlogits,
                              Tensor logits, Tensor stats, Tensor targets, int64_t vocab_begin,
                              int vocab, float dloss, cudaStream_t stream);

// cuda_optim.cu: every buffer of the list in one launch; adamw is a list of one.
void adamw_multi(const CudaContext& ctx, std::span<const AdamWTensors> buffers,
                 const AdamWStep& step, cudaStream_t stream);
void adamw(const CudaContext& ctx, Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
           const AdamWStep& step, cudaStream_t stream);
// Backend::gradient_stats, and the device error word read in the same copy: one wait for the
// stream (the results land in this host thread's pinned readback buffer).
struct GradientReadback {
  GradientStats stats;
  unsigned device_error = 0;  // DeviceErrorBits set by earlier kernels (not cleared here)
};
GradientReadback gradient_stats(const CudaContext& ctx, std::span<const GradientTensor> buffers,
                                cudaStream_t stream);

// cuda_backend.cpp: pinned host memory of at least `bytes` for device-to-host results, this
// host thread's own (ranks sharing a backend do not share it), valid until its next call. A
// copy into pinned memory is truly asynchronous: the op waits once, for its stream, instead of
// once per copy as a copy into pageable memory would.
void* pinned_readback(size_t bytes);

}  // namespace dstrain::cuda
