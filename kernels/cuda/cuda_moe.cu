// CUDA mixture-of-experts ops (semantics in kernels/ops.h, shapes in kernels/moe_checks.h), the
// first, plain versions: correct and deterministic, written as the CPU twin
// (kernels/cpu/cpu_moe.cpp) so that they differ from it only where nvcc's expf and FMA
// contraction do (on the emulator they agree bitwise, except the combine backward's dweight:
// a block's fixed tree sum, not the twin's sequential one).
// - routing: one thread per token row (E and k loops, no per-thread arrays);
// - dispatch: a stable counting sort in three launches (count per expert, the prefix sum, the
//   placement: one block per expert walking the choices in order with a block-wide scan);
// - gather, combine, combine backward: one block per row, threads over the channels;
// - grouped matmul: cuBLAS on each expert's rows (cuda_matmul.cu), which needs the offsets on
//   the host: one copy and stream synchronization per call.
// Index values out of range (an expert, a source or destination row) set kBadMoeIndex in the
// device error word and are skipped; Backend::synchronize reports it.
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/moe_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void flag_bad_index(unsigned* error_word) {
  atomicOr(error_word, static_cast<unsigned>(kBadMoeIndex));
}

// ---- routing -------------------------------------------------------------------------------

// Selection score of expert e: its score, plus the selection bias (if any).
__device__ __forceinline__ float choice_of(const float* s, const float* bias, int64_t e) {
  return bias != nullptr ? s[e] + bias[e] : s[e];
}

// A group's rank score (the CPU twin's group_score): its best selection score, or the sum of its
// two best.
__device__ float group_score_of(const float* s, const float* bias, int64_t first, int64_t size,
                                GroupScore kind) {
  float best = choice_of(s, bias, first), second = -INFINITY;
  for (int64_t e = first + 1; e < first + size; ++e) {
    const float c = choice_of(s, bias, e);
    if (c > best) {
      second = best;
      best = c;
    } else if (c > second) {
      second = c;
    }
  }
  return kind == GroupScore::Max || size < 2 ? best : best + second;
}

// Bit g: group g is among the top_groups best (ties to the lower group). Group scores are
// recomputed rather than kept in a per-thread array (no local memory).
__device__ uint64_t allowed_groups(const float* s, const float* bias, const MoeRouting& r) {
  if (r.groups == 1) return 1;
  const int64_t size = r.experts / r.groups;
  uint64_t mask = 0;
  for (int g = 0; g < r.groups; ++g) {
    const float mine = group_score_of(s, bias, g * size, size, r.group_score);
    int ahead = 0;
    for (int h = 0; h < r.groups && ahead < r.top_groups; ++h) {
      const float other = group_score_of(s, bias, h * size, size, r.group_score);
      ahead += other > mine || (other == mine && h < g);
    }
    if (ahead < r.top_groups) mask |= uint64_t{1} << g;
  }
  return mask;
}

__global__ void moe_route_kernel(float* topk_weight, int32_t* topk_expert, float* scores,
                                 DeviceTensor logits, const float* bias, int64_t N,
                                 MoeRouting routing) {
  const int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (n >= N) return;
  const int64_t E = routing.experts;
  const int k = routing.top_k;
  float* s = scores + n * E;
  if (routing.score == RouterScore::Sigmoid) {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + expf(-load(logits, n * E + e)));
  } else {
    float max = load(logits, n * E);
    for (int64_t e = 1; e < E; ++e) max = fmaxf(max, load(logits, n * E + e));
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = expf(load(logits, n * E + e) - max);
      sum += s[e];
    }
    for (int64_t e = 0; e < E; ++e) s[e] /= sum;
  }
  int32_t* experts = topk_expert + n * k;
  float* w = topk_weight + n * k;
  const uint64_t groups = allowed_groups(s, bias, routing);
  const int64_t group_size = E / routing.groups;
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = ((groups >> (e / group_size)) & 1) == 0;
      for (int i = 0; i < j; ++i) taken = taken || experts[i] == e;
      if (!taken && (best < 0 || choice_of(s, bias, e) > choice_of(s, bias, best))) {
        best = static_cast<int>(e);
      }
    }
    experts[j] = best;
    w[j] = s[best];
    sum += w[j];
  }
  for (int j = 0; j < k; ++j) {
    if (routing.norm_topk) w[j] /= sum;
    w[j] *= routing.scale;
  }
}

// The selected weights' path into their scores: w_j = scale * s_j / sum (sum = 1 without
// norm_topk), so dL/ds_j = scale * (dw_j - dot / sum) / sum with dot = sum_i dw_i s_i.
struct TopKGrad {
  const float* dw;  // (k)
  float sum, dot;
};

// dL/d(score e) of one row: dscores[e], plus the path of choice j where e = experts[j]. The same
// arithmetic as the CPU twin's; recomputed per e (no per-thread array: no local memory).
__device__ __forceinline__ float score_grad(const float* dscores, const int32_t* experts,
                                            const TopKGrad& g, const MoeRouting& routing,
                                            int64_t e) {
  float ds = dscores == nullptr ? 0.0f : dscores[e];
  for (int j = 0; j < routing.top_k; ++j) {
    if (experts[j] != e) continue;
    ds += routing.norm_topk ? routing.scale * (g.dw[j] - g.dot / g.sum) / g.sum
                            : routing.scale * g.dw[j];
  }
  return ds;
}

__global__ void moe_route_backward_kernel(DeviceTensor dlogits, const float* dtopk_weight,
                                          const float* dscores, const float* scores,
                                          const int32_t* topk_expert, int64_t N, MoeRouting routing,
                                          unsigned* error_word) {
  const int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (n >= N) return;
  const int64_t E = routing.experts;
  const int k = routing.top_k;
  const float* s = scores + n * E;
  const float* ds_row = dscores == nullptr ? nullptr : dscores + n * E;
  const int32_t* experts = topk_expert + n * k;
  for (int j = 0; j < k; ++j) {
    if (experts[j] < 0 || experts[j] >= E) {
      flag_bad_index(error_word);
      return;
    }
  }
  TopKGrad g{dtopk_weight + n * k, 0.0f, 0.0f};
  for (int j = 0; j < k; ++j) g.sum += s[experts[j]];
  for (int j = 0; j < k; ++j) g.dot += g.dw[j] * s[experts[j]];
  if (routing.score == RouterScore::Sigmoid) {
    for (int64_t e = 0; e < E; ++e) {
      store(dlogits, n * E + e, score_grad(ds_row, experts, g, routing, e) * s[e] * (1.0f - s[e]));
    }
    return;
  }
  float weighted = 0.0f;
  for (int64_t e = 0; e < E; ++e) weighted += s[e] * score_grad(ds_row, experts, g, routing, e);
  for (int64_t e = 0; e < E; ++e) {
    store(dlogits, n * E + e, s[e] * (score_grad(ds_row, experts, g, routing, e) - weighted));
  }
}

// ---- dispatch: a stable counting sort ------------------------------------------------------

// offsets[e + 1] = the choices of expert e (block e).
__global__ void moe_count_kernel(int32_t* offsets, const int32_t* topk_expert, int64_t choices,
                                 int experts, unsigned* error_word) {
  __shared__ int total;  // integer adds: the same sum in any order
  const int e = static_cast<int>(blockIdx.x);
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  int count = 0;
  for (int64_t i = threadIdx.x; i < choices; i += blockDim.x) {
    const int32_t expert = topk_expert[i];
    count += expert == e;
    if (e == 0 && (expert < 0 || expert >= experts)) flag_bad_index(error_word);
  }
  atomicAdd(&total, count);
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[e + 1] = total;
    if (e == 0) offsets[0] = 0;
  }
}

// The prefix sum of the counts, in place (E + 1 values: one thread).
__global__ void moe_offsets_kernel(int32_t* offsets, int experts) {
  for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
}

// Block e walks the choices in order, kThreads at a time: a choice of expert e takes the next
// row of e's range (an inclusive scan of the block's matches gives each its place).
__global__ void moe_place_kernel(int32_t* source_rows, int32_t* dest_rows,
                                 const int32_t* topk_expert, const int32_t* offsets,
                                 int64_t choices, int64_t k) {
  __shared__ int scan[kThreads];
  const int e = static_cast<int>(blockIdx.x);
  const int t = static_cast<int>(threadIdx.x);
  int64_t next = offsets[e];
  for (int64_t base = 0; base < choices; base += kThreads) {
    const int64_t i = base + t;
    const bool match = i < choices && topk_expert[i] == e;
    scan[t] = match;
    __syncthreads();
    for (int step = 1; step < kThreads; step <<= 1) {
      const int add = t >= step ? scan[t - step] : 0;
      __syncthreads();
      scan[t] += add;
      __syncthreads();
    }
    if (match) {
      const auto row = static_cast<int32_t>(next + scan[t] - 1);
      source_rows[row] = static_cast<int32_t>(i / k);
      dest_rows[i] = row;
    }
    next += scan[kThreads - 1];
    __syncthreads();  // scan[] is rewritten next round
  }
}

// ---- gather and combine --------------------------------------------------------------------

__global__ void moe_gather_kernel(DeviceTensor out, DeviceTensor inp, const int32_t* source_rows,
                                  int64_t N, int64_t C, unsigned* error_word) {
  const int64_t r = blockIdx.x;
  const int64_t source = source_rows[r];
  if (source < 0 || source >= N) {
    if (threadIdx.x == 0) flag_bad_index(error_word);
    return;
  }
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    store(out, r * C + c, load(inp, source * C + c));
  }
}

__global__ void moe_combine_kernel(DeviceTensor out, DeviceTensor inp, const int32_t* dest_rows,
                                   const float* weight, int64_t M, int64_t C, int64_t k,
                                   unsigned* error_word) {
  const int64_t n = blockIdx.x;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = dest_rows[n * k + j];
      if (r < 0) continue;
      if (r >= M) {
        flag_bad_index(error_word);
        continue;
      }
      const float w = weight == nullptr ? 1.0f : weight[n * k + j];
      sum += w * load(inp, r * C + c);
    }
    store(out, n * C + c, sum);
  }
}

__global__ void moe_combine_backward_kernel(DeviceTensor dinp, float* dweight, DeviceTensor dout,
                                            DeviceTensor inp, const int32_t* dest_rows,
                                            const float* weight, int64_t M, int64_t C, int64_t k,
                                            unsigned* error_word) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = dest_rows[n * k + j];
    if (r < 0 || r >= M) {
      if (r >= M && threadIdx.x == 0) flag_bad_index(error_word);
      if (dweight != nullptr && threadIdx.x == 0) dweight[n * k + j] = 0.0f;
      continue;
    }
    const float w = weight == nullptr ? 1.0f : weight[n * k + j];
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float dy = load(dout, n * C + c);
      store(dinp, r * C + c, w * dy);
      if (dweight != nullptr) dot += dy * load(inp, r * C + c);
    }
    if (dweight == nullptr) continue;
    dot = block_sum(dot, shared);
    if (threadIdx.x == 0) dweight[n * k + j] = dot;
  }
}

// ---- grouped matmul ------------------------------------------------------------------------

// The offsets on the host (one small copy; the stream is waited on).
std::vector<int32_t> host_offsets(const Tensor& expert_offsets, int64_t M, cudaStream_t stream) {
  std::vector<int32_t> offsets(static_cast<size_t>(expert_offsets.numel()));
  CUDA_CHECK(cudaMemcpyAsync(offsets.data(), expert_offsets.data, offsets.size() * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  check_expert_offsets(offsets.data(), expert_offsets.numel(), M);
  return offsets;
}

void check_index_on_device(const CudaContext& ctx, const Tensor& t, const char* name) {
  check_tensor_dtype(ctx, t, DType::I32, name);
}

}  // namespace

void moe_route(const CudaContext& ctx, Tensor topk_weight, Tensor topk_expert, Tensor scores,
               Tensor logits, const MoeRouting& routing, cudaStream_t stream) {
  check_float_tensor(ctx, logits, "moe logits");
  const int64_t N = check_moe_route_shapes(topk_weight, topk_expert, scores, logits, routing);
  check_tensor_dtype(ctx, scores, DType::F32, "moe scores");
  check_tensor_dtype(ctx, topk_weight, DType::F32, "moe topk_weight");
  check_index_on_device(ctx, topk_expert, "moe topk_expert");
  if (N == 0) return;
  const Tensor& bias = routing.selection_bias;
  if (!bias.empty()) check_tensor_dtype(ctx, bias, DType::F32, "moe selection_bias");
  DSTRAIN_LAUNCH(moe_route_kernel, ceil_div(N, kThreads), kThreads, 0, stream)
  (topk_weight.f32(), topk_expert.i32(), scores.f32(), device_tensor(logits),
   bias.empty() ? nullptr : bias.f32(), N, routing);
}

void moe_route_backward(const CudaContext& ctx, Tensor dlogits, Tensor dtopk_weight, Tensor dscores,
                        Tensor scores, Tensor topk_expert, const MoeRouting& routing,
                        cudaStream_t stream) {
  check_float_tensor(ctx, dlogits, "moe dlogits");
  const int64_t N = check_moe_route_shapes(dtopk_weight, topk_expert, scores, dlogits, routing);
  check_tensor_dtype(ctx, scores, DType::F32, "moe scores");
  check_tensor_dtype(ctx, dtopk_weight, DType::F32, "moe dtopk_weight");
  check_index_on_device(ctx, topk_expert, "moe topk_expert");
  if (!dscores.empty()) {
    check_matrix(dscores, "moe dscores", N, routing.experts);
    check_tensor_dtype(ctx, dscores, DType::F32, "moe dscores");
  }
  if (N == 0) return;
  DSTRAIN_LAUNCH(moe_route_backward_kernel, ceil_div(N, kThreads), kThreads, 0, stream)
  (device_tensor(dlogits), dtopk_weight.f32(), dscores.empty() ? nullptr : dscores.f32(),
   scores.f32(), topk_expert.i32(), N, routing, ctx.error_word);
}

void moe_dispatch(const CudaContext& ctx, Tensor expert_offsets, Tensor source_rows,
                  Tensor dest_rows, Tensor topk_expert, int experts, cudaStream_t stream) {
  check_moe_dispatch_shapes(expert_offsets, source_rows, dest_rows, topk_expert, experts);
  for (const Tensor* t : {&expert_offsets, &source_rows, &dest_rows, &topk_expert}) {
    check_index_on_device(ctx, *t, "moe dispatch index tensor");
  }
  const int64_t choices = topk_expert.numel();
  const auto grid = static_cast<unsigned>(experts);
  DSTRAIN_LAUNCH(moe_count_kernel, grid, kThreads, 0, stream)
  (expert_offsets.i32(), topk_expert.i32(), choices, experts, ctx.error_word);
  DSTRAIN_LAUNCH(moe_offsets_kernel, 1, 1, 0, stream)(expert_offsets.i32(), experts);
  DSTRAIN_LAUNCH(moe_place_kernel, grid, kThreads, 0, stream)
  (source_rows.i32(), dest_rows.i32(), topk_expert.i32(), expert_offsets.i32(), choices,
   topk_expert.size(1));
}

void moe_gather(const CudaContext& ctx, Tensor out, Tensor inp, Tensor source_rows,
                cudaStream_t stream) {
  check_float_tensor(ctx, out, "moe gather out");
  check_float_tensor(ctx, inp, "moe gather inp");
  check_moe_gather_shapes(out, inp, source_rows);
  check_index_on_device(ctx, source_rows, "moe source_rows");
  if (out.size(0) == 0) return;
  DSTRAIN_LAUNCH(moe_gather_kernel, static_cast<unsigned>(out.size(0)), kThreads, 0, stream)
  (device_tensor(out), device_tensor(inp), source_rows.i32(), inp.size(0), inp.size(1),
   ctx.error_word);
}

void moe_combine(const CudaContext& ctx, Tensor out, Tensor inp, Tensor dest_rows, Tensor weight,
                 cudaStream_t stream) {
  check_float_tensor(ctx, out, "moe combine out");
  check_float_tensor(ctx, inp, "moe combine inp");
  check_moe_combine_shapes(out, inp, dest_rows, weight);
  check_index_on_device(ctx, dest_rows, "moe dest_rows");
  if (out.size(0) == 0) return;
  DSTRAIN_LAUNCH(moe_combine_kernel, static_cast<unsigned>(out.size(0)), kThreads, 0, stream)
  (device_tensor(out), device_tensor(inp), dest_rows.i32(), weight.empty() ? nullptr : weight.f32(),
   inp.size(0), inp.size(1), dest_rows.size(1), ctx.error_word);
}

void moe_combine_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                          Tensor inp, Tensor dest_rows, Tensor weight, cudaStream_t stream) {
  check_float_tensor(ctx, dinp, "moe combine dinp");
  check_float_tensor(ctx, dout, "moe combine dout");
  check_moe_combine_shapes(dout, dinp, dest_rows, weight);
  check_index_on_device(ctx, dest_rows, "moe dest_rows");
  if (!dweight.empty()) {
    check_float_tensor(ctx, inp, "moe combine inp");
    check_tensor_dtype(ctx, dweight, DType::F32, "moe dweight");
    check_moe_dweight_shapes(dweight, inp, dinp, dest_rows);
  }
  if (dout.size(0) == 0) return;
  DSTRAIN_LAUNCH(moe_combine_backward_kernel, static_cast<unsigned>(dout.size(0)), kThreads, 0,
                 stream)
  (device_tensor(dinp), dweight.empty() ? nullptr : dweight.f32(), device_tensor(dout),
   dweight.empty() ? DeviceTensor{nullptr, DType::F32} : device_tensor(inp), dest_rows.i32(),
   weight.empty() ? nullptr : weight.f32(), dinp.size(0), dinp.size(1), dest_rows.size(1),
   ctx.error_word);
}

void grouped_matmul_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight,
                            Tensor expert_offsets, cudaStream_t stream) {
  check_grouped_matmul_shapes(out, inp, weight, expert_offsets);
  check_index_on_device(ctx, expert_offsets, "grouped matmul expert_offsets");
  const std::vector<int32_t> offsets = host_offsets(expert_offsets, inp.size(0), stream);
  for (int64_t e = 0; e < weight.size(0); ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    matmul_forward(ctx, row_range(out, offsets[e], offsets[e + 1]),
                   row_range(inp, offsets[e], offsets[e + 1]), expert_matrix(weight, e), Tensor(),
                   true, stream);
  }
}

void grouped_matmul_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                             Tensor inp, Tensor weight, Tensor expert_offsets,
                             cudaStream_t stream) {
  check_grouped_matmul_backward_shapes(dinp, dweight, dout, inp, weight, expert_offsets);
  check_index_on_device(ctx, expert_offsets, "grouped matmul expert_offsets");
  const std::vector<int32_t> offsets = host_offsets(expert_offsets, inp.size(0), stream);
  for (int64_t e = 0; e < weight.size(0); ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    if (begin == end) continue;
    matmul_backward(ctx, dinp.empty() ? Tensor() : row_range(dinp, begin, end),
                    expert_matrix(dweight, e), Tensor(), row_range(dout, begin, end),
                    row_range(inp, begin, end), expert_matrix(weight, e), true, stream);
  }
}

}  // namespace dstrain::cuda
