// Deterministic column sums (dweight and dbias of the norms, dbias of the matmuls and of the
// fused GELU backward): the rows are cut into fixed chunks of kPartialRows (a function of N only,
// not of the GPU); one block per (columns, chunk) sums its chunk into a partial row, and
// add_column_partials (cuda_layernorm.cu) adds the partials in chunk order to the gradient.
//
// The vector kernels' block is (kColumnPacks, kColumnThreadsY): thread (x, y) sums 8 adjacent
// columns c = 8 * (blockIdx.x * kColumnPacks + x) over the chunk's rows row_begin + y,
// + kColumnThreadsY, ... in that order, then column_block_sum adds the kColumnThreadsY sums of
// a column in y order. The scalar kernels (one column per thread, block (32, kColumnThreadsY))
// add the same terms in the same order: every kernel built on these constants gives a column the
// same bits. No atomics: the same inputs give the same bits on every run.
#pragma once

#include "kernels/cuda/cuda_vector.cuh"

namespace dstrain::cuda {

constexpr int kPartialRows = 128;  // rows per partial
constexpr int kColumnThreadsY = 8;
constexpr int kColumnPacks = 32;  // threads along the columns of a vector kernel's block

// The chunk of rows of this block: [begin, end).
struct ColumnChunk {
  int64_t begin, end;
  __device__ __forceinline__ explicit ColumnChunk(int64_t N)
      : begin(blockIdx.y * int64_t{kPartialRows}), end(min(begin + kPartialRows, N)) {}
};

// The first of the 8 columns of this thread of a vector kernel.
__device__ __forceinline__ int64_t vector_column() {
  return (blockIdx.x * int64_t{kColumnPacks} + threadIdx.x) * kVectorElements;
}

// Calls f(r) for this thread's rows r of the block's chunk in the order of the header comment
// (none where c >= C): every vector column kernel walks its rows through this.
template <class F>
__device__ __forceinline__ void for_chunk_rows(int64_t N, int64_t c, int64_t C, F&& f) {
  if (c >= C) return;
  const ColumnChunk rows(N);
  for (int64_t r = rows.begin + threadIdx.y; r < rows.end; r += kColumnThreadsY) f(r);
}

// partial[c .. c + 8) = the sums of the block's kColumnThreadsY threads of columns c .. c + 8
// (`sum`, this thread's), added in y order; partial is this chunk's row of C floats. Every thread
// of the block calls it. (partial + c) * 4 bytes is a multiple of 32 where C % 8 == 0: 16-byte
// aligned stores.
__device__ __forceinline__ void column_block_sum(float* partial,
                                                 const float (&sum)[kVectorElements], int64_t c,
                                                 int64_t C) {
  __shared__ float sums[kColumnThreadsY][kColumnPacks * kVectorElements];
  const int column = threadIdx.x * kVectorElements;
#pragma unroll
  for (int j = 0; j < kVectorElements; ++j) sums[threadIdx.y][column + j] = sum[j];
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float total[kVectorElements] = {};
    for (int y = 0; y < kColumnThreadsY; ++y) {  // fixed order
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) total[j] += sums[y][column + j];
    }
    store_vector(partial + c, total);
  }
  __syncthreads();  // sums is free for the next call
}

}  // namespace dstrain::cuda
