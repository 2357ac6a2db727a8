// The tensor-core (mma.sync) attention forward (cuda_attention_mma.cu) and backward
// (cuda_attention_mma_backward.cu), FlashAttention-2 style, for bf16/f16 storage and head dims
// 64, 128, 192 (multi-head latent attention's 128 + 64: DeepSeek-V2, V2-Lite, V3) and 256,
// causal or over packed sequences (positions). cuda_attention_forward.cu and
// cuda_attention_backward.cu route to them whatever they support and keep their fp32 CUDA-core
// kernels for the rest (F32 storage, other head dims, unaligned views).
#pragma once

#include "kernels/cuda/cuda_attention.cuh"

namespace dstrain::cuda::attention {

// Rows of the mma tiles a warp owns (16, the default, or 32): query rows of the forward at head
// dims 64 and 128, key rows of the backward's dK/dV kernel at head dim 64; elsewhere 16. One
// value per process, set by set_cuda_attention_warp_rows (cuda_backend.h).
int& attention_warp_rows();

// Whether attention_forward_mma takes this case: qkv and out both BF16 or both F16, hd 64, 128,
// 192 or 256, both base pointers 16-byte aligned (every row then starts on a 16-byte boundary:
// cp.async and the 128-bit stores move 8 elements at a time).
bool mma_forward_supports(const QkvShape& s, const Tensor& qkv, const Tensor& out);

// out (B,T,NH*hd), lse (B,NH,T) F32 natural-log log-sum-exp of the scaled scores, qkv
// (B,T,(NH+2KV)*hd), positions (B,T) device I32 of packed sequences, or nullptr (one causal
// sequence per row): the contract of attention_forward (kernels/ops.h). Deterministic.
// REQUIRES: mma_forward_supports(s, qkv, out); checks of check_attention passed; positions
// valid (kernels/positions.h: each sequence starts at 0 and counts up by 1; not checked here,
// invalid ones give wrong results but no access outside the tensors).
void attention_forward_mma(const QkvShape& s, Tensor out, Tensor lse, Tensor qkv,
                           const int32_t* positions, cudaStream_t stream);

// Whether attention_backward_mma takes this case: mma_forward_supports(s, qkv, out), and dqkv
// and dout of qkv's dtype with 16-byte aligned base pointers.
bool mma_backward_supports(const QkvShape& s, const Tensor& dqkv, const Tensor& dout,
                           const Tensor& qkv, const Tensor& out);

// dqkv (B,T,(NH+2KV)*hd) written (every element: dq, dk, dv), dout (B,T,NH*hd), qkv, out, lse
// as saved by the forward, positions (B,T) or nullptr as the forward took them: the contract of
// attention_backward (kernels/ops.h), deterministic. Takes a (B,NH,T) fp32 scratch for delta
// from ctx.
// REQUIRES: mma_backward_supports(s, dqkv, dout, qkv, out); the checks of attention_backward;
// positions valid, as for attention_forward_mma.
void attention_backward_mma(const CudaContext& ctx, const QkvShape& s, Tensor dqkv, Tensor dout,
                            Tensor qkv, Tensor out, Tensor lse, const int32_t* positions,
                            cudaStream_t stream);

}  // namespace dstrain::cuda::attention
