// CUDA GELU backward with the up-projection's bias gradient fused in (kernels/ops.h's
// gelu_backward_bias): dinp = gelu'(inp) * dout is stored, and dbias += the column sums of dinp
// as stored, in one pass over the rows, where C % 8 == 0 and dinp, dout and inp share a dtype
// and are 16-byte aligned (dinp is then not read back for the sums: one of the four reads and
// writes per element saved). The GELU of cuda_gelu.cuh (gelu_backward's bits) and the column order
// of cuda_columns.cuh (column_sums_accumulate's bits over the stored dinp): bitwise the two ops,
// which run elsewhere.
#include "kernels/cuda/cuda_columns.cuh"
#include "kernels/cuda/cuda_gelu.cuh"
#include "kernels/op_checks.h"

namespace dstrain::cuda {

namespace {

// dinp (N,C) = gelu'(inp) * dout; partial (chunks, C) = per chunk of rows the column sums of
// dinp as stored, in the order of cuda_columns.cuh. dinp may be dout (each element is read
// before the same thread writes it). REQUIRES: C % 8 == 0; the rows 16-byte aligned.
template <class T>
__global__ void gelu_backward_bias_vector_kernel(T* dinp, const T* dout, const T* inp,
                                                 float* partial, int64_t N, int64_t C) {
  const int64_t c = vector_column();
  float sum[kVectorElements] = {};
  for_chunk_rows(N, c, C, [&](int64_t r) {
    float dy[kVectorElements], x[kVectorElements];
    load_vector(dout + r * C + c, dy);
    load_vector(inp + r * C + c, x);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      dy[j] = to_float(from_float<T>(GeluBackward{}(dy[j], x[j])));  // dinp as stored
      sum[j] += dy[j];
    }
    store_vector(dinp + r * C + c, dy);
  });
  column_block_sum(partial + blockIdx.y * C, sum, c, C);
}

bool fusable(int64_t C, Tensor dinp, Tensor dout, Tensor inp) {
  return C % kVectorElements == 0 && dout.dtype == dinp.dtype && inp.dtype == dinp.dtype &&
         vector_aligned(dinp.data) && vector_aligned(dout.data) && vector_aligned(inp.data);
}

}  // namespace

void gelu_backward_bias(const CudaContext& ctx, Tensor dinp, Tensor dbias, Tensor dout, Tensor inp,
                        cudaStream_t stream) {
  const int64_t C = cols_of(dinp), N = rows_of(dinp);
  if (!dbias.empty()) {
    check_float_tensor(ctx, dbias, "gelu dbias");
    DSTRAIN_CHECK(dbias.numel() == C) << "gelu dbias " << dbias.shape_str() << " must have the "
                                      << C << " columns of dinp " << dinp.shape_str();
  }
  if (dbias.empty() || !fusable(C, dinp, dout, inp)) {
    gelu_backward(ctx, dinp, dout, inp, stream);
    if (!dbias.empty()) column_sums_accumulate(ctx, dbias, dinp, stream);
    return;
  }
  check_float_tensor(ctx, dinp, "gelu dinp");
  check_float_tensor(ctx, dout, "gelu dout");
  check_float_tensor(ctx, inp, "gelu inp");
  check_same_numel(dinp, "gelu dinp", inp, "inp");
  check_same_numel(dout, "gelu dout", inp, "inp");
  if (N == 0) return;
  const int64_t chunks = (N + kPartialRows - 1) / kPartialRows;
  DSTRAIN_CHECK(chunks <= 65535) << "gelu dbias over " << N << " rows: at most "
                                 << 65535 * int64_t{kPartialRows} << " rows";
  Scratch partials(ctx, static_cast<size_t>(chunks * C) * sizeof(float), stream);
  const dim3 grid(ceil_div(C, kColumnPacks * kVectorElements), static_cast<unsigned>(chunks));
  with_storage_type(dinp.dtype, [&](auto tag) {
    using T = decltype(tag);
    DSTRAIN_LAUNCH(gelu_backward_bias_vector_kernel<T>, grid, dim3(kColumnPacks, kColumnThreadsY),
                   0, stream)
    (static_cast<T*>(dinp.data), static_cast<const T*>(dout.data), static_cast<const T*>(inp.data),
     partials.as<float>(), N, C);
  });
  CUDA_CHECK_LAUNCH();
  add_column_partials(dbias, partials.as<float>(), chunks, stream);
}

}  // namespace dstrain::cuda
