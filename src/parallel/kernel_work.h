// What dstrain's CUDA kernels execute per token besides the GEMMs (model_flops.h): the causal
// attention's FLOPs as its tiles run them, and the elements the memory-bound kernels read and
// write. The cost model (cost_model.cpp) times them; MFU keeps model_flops.h's PaLM count.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "model/config.h"

namespace dstrain {

// Which attention kernels run: the tensor-core ones (kernels/cuda/cuda_attention_mma.cu and
// cuda_attention_mma_backward.cu: mma.sync m16n8k16) for bf16/f16 storage with head dim 64, 128,
// 192 (latent attention's qk dim: DeepSeek-V2/V3) or 256; otherwise cuda_attention_forward.cu / _backward.cu, fp32 arithmetic on CUDA cores.
enum class AttentionKernels { TensorCore, CudaCore };
AttentionKernels attention_kernels(const ModelConfig& config, DType storage);

// FLOPs the attention kernels execute per token, all query heads of the model (a tp rank runs
// 1/tp of them; key/value heads shared by a group of query heads change nothing). Query i sees
// keys 0..i; the kernels skip the work above the diagonal at the granularity g of their tiles,
// so a query head executes T (T + g) / 2 query-key pairs (exact for T a multiple of the tiles),
// 2 hd FLOPs per pair for each product S = Q K^T, P V, dP = dO V^T, dV, dK, dQ. The backward
// runs two passes (dK/dV per key block, dQ per query block, for fixed-order sums without atomics)
// and each recomputes S and dP: 7 products, not FlashAttention-2's 5.
struct AttentionWork {
  double forward = 0;
  double backward = 0;
};
AttentionWork attention_work(const ModelConfig& config, int64_t seq_len, DType storage);

// Elements (of the activation dtype) the memory-bound kernels read plus write per token on one
// tp rank, counted from the kernels (the per-op table in kernel_work.cpp). The MLP's and the
// attention's columns split over tp; the norm and residual rows only with sequence parallelism.
struct MemoryTraffic {
  double layer_forward = 0;  // also what full recompute repeats
  double layer_backward = 0;
  double layer_selective = 0;  // what selective recompute repeats: the norms and the activation
  double embed_forward = 0, embed_backward = 0;  // on the first stage
  double head_forward = 0, head_backward = 0;    // the last: final norm, softmax + cross-entropy
};
MemoryTraffic memory_traffic(const ModelConfig& config, int tp, bool sequence_parallel);

// --precision fp8: the bytes one layer's casts move per micro-batch of `tokens` rows on one tp
// rank (model/fp8_linear.h), forward and backward. A cast reads its tensor (of `storage`) twice
// (the amax, then the cast) and writes a byte an element: forward each projection's input
// (tokens x in) and weight (in x out); backward dout once into both its layouts (tokens x out,
// two bytes an element written), the weight again, the input again but read once (forward's
// amax kept). SwiGLU finds the amax of its output (the down projection's input) and of its
// input gradient (the up projection's dout): their casts read them once. The projections FP8
// takes: multi-head attention's qkv, every attention's o (latent attention's too), the dense
// MLPs' (their mean over the layers). With `cached_weights` (model/fp8_linear.h Fp8Options) the
// weights are not cast per micro-batch but once a step into both layouts (two bytes an element
// written): `weights_per_step`.
struct Fp8CastBytes {
  double forward = 0, backward = 0;
  double weights_per_step = 0;
};
Fp8CastBytes fp8_cast_bytes(const ModelConfig& config, int tp, DType storage, double tokens,
                            bool cached_weights);

}  // namespace dstrain
