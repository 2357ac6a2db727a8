// CUDA embedding: forward gathers wte and wpe rows; backward is deterministic without
// atomics on dwte:
//   1. key each position (b,t) by its token id (bad ids get the key Vp and raise a flag),
//   2. a stable radix sort (CUB) groups the positions by token, (b,t) order kept inside a group,
//   3. one block column per group sums its dout rows in that order in fp32 and adds the sum to
//      the token's dwte row once -- the same order and rounding as the CPU twin, so the result
//      is bitwise the CPU's.
// dwpe[t] += the sum over b of dout[b,t], b in order (bitwise the CPU's too); with positions
// (packed sequences) dwpe's rows are scattered by position as dwte's by token.
// Vocabulary parallelism: wte is rows [begin, begin + Vs) of the whole (vocab_rows, C) table;
// a valid token outside them embeds as a zero row and is keyed like a bad id in backward (sorted
// last, skipped) without raising the flag.
// Cost note: a group is summed by one block, so a token that fills most of a batch is summed
// serially over its rows; with text data groups are a few hundred rows at most.
#include <bit>
#include <climits>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/positions.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;  // channels per block

// out (BT, C) = wte[ids - begin] (+ wpe[p] with has_positions, p = positions[row] or t) for
// ids in [begin, begin + Vs), else 0; ids (BT); an id outside [0, vocab_rows) gives a NaN row
// and raises the flag.
__global__ void embedding_forward_kernel(DeviceTensor out, const int32_t* ids,
                                         const int32_t* positions, DeviceTensor wte,
                                         DeviceTensor wpe, bool has_positions, int64_t T, int64_t C,
                                         int64_t begin, int64_t Vs, int64_t vocab_rows,
                                         unsigned* error_word) {
  const int64_t row = blockIdx.x;
  const int64_t c = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const int32_t id = ids[row];
  if (id < 0 || id >= vocab_rows) {
    if (c == 0) atomicOr(error_word, kBadTokenId);
    store(out, row * C + c, NAN);
    return;
  }
  if (id < begin || id >= begin + Vs) {
    store(out, row * C + c, 0.0f);  // another slice's token
    return;
  }
  const float token = load(wte, (id - begin) * C + c);
  // No position table (LLaMA): the token row alone.
  if (!has_positions) {
    store(out, row * C + c, token);
    return;
  }
  const int64_t p = positions != nullptr ? positions[row] : row % T;
  store(out, row * C + c, __fadd_rn(token, load(wpe, p * C + c)));
}

// keys (BT) = the token's row in the slice, or Vs for a token outside it (sorted last, then
// skipped; a bad id also raises the flag); rows (BT) = 0..BT-1.
__global__ void embedding_keys_kernel(const int32_t* ids, int64_t BT, int64_t begin, int64_t Vs,
                                      int64_t vocab_rows, uint32_t* keys, int32_t* rows,
                                      unsigned* error_word) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < BT;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_rows) atomicOr(error_word, kBadTokenId);
    const bool inside = id >= begin && id < begin + Vs;
    keys[i] = static_cast<uint32_t>(inside ? id - begin : Vs);
    rows[i] = static_cast<int32_t>(i);
  }
}

// One block column per sorted position i that starts a group: dwte[key] += sum of the group's
// dout rows, in sorted (= (b,t)) order. sorted_keys, sorted_rows (BT).
__global__ void embedding_group_sum_kernel(DeviceTensor dwte, DeviceTensor dout,
                                           const uint32_t* sorted_keys, const int32_t* sorted_rows,
                                           int64_t BT, int64_t C, int64_t Vp) {
  const int64_t i = blockIdx.x;
  const uint32_t key = sorted_keys[i];
  if (key >= Vp || (i > 0 && sorted_keys[i - 1] == key)) return;  // not ours, or not a start
  const int64_t c = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  float sum = 0.0f;
  for (int64_t j = i; j < BT && sorted_keys[j] == key; ++j) {
    sum = __fadd_rn(sum, load(dout, sorted_rows[j] * C + c));
  }
  const int64_t dst = static_cast<int64_t>(key) * C + c;
  store(dwte, dst, __fadd_rn(load(dwte, dst), sum));
}

// dwpe[t] += sum over b of dout[b, t], b in order. Grid (T, channel blocks).
__global__ void embedding_position_sum_kernel(DeviceTensor dwpe, DeviceTensor dout, int64_t B,
                                              int64_t T, int64_t C) {
  const int64_t t = blockIdx.x;
  const int64_t c = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  float sum = 0.0f;
  for (int64_t b = 0; b < B; ++b) sum = __fadd_rn(sum, load(dout, (b * T + t) * C + c));
  store(dwpe, t * C + c, __fadd_rn(load(dwpe, t * C + c), sum));
}

struct EmbeddingShape {
  int64_t B, T, C, Vp;  // Vp: the slice's rows (Vs)
};

EmbeddingShape check_embedding(const CudaContext& ctx, const Tensor& x, const char* x_name,
                               const Tensor& tokens, const Tensor& table, const char* table_name,
                               const Tensor& positions, const char* positions_name) {
  check_float_tensor(ctx, x, x_name);
  check_float_tensor(ctx, table, table_name);
  if (!positions.empty()) check_float_tensor(ctx, positions, positions_name);
  check_tensor_dtype(ctx, tokens, DType::I32, "tokens");
  DSTRAIN_CHECK(x.ndim == 3) << x_name << " " << x.shape_str() << " must be (B, T, C)";
  const EmbeddingShape s{x.shape[0], x.shape[1], x.shape[2], table.ndim == 2 ? table.shape[0] : 0};
  DSTRAIN_CHECK(table.ndim == 2 && table.shape[1] == s.C)
      << table_name << " " << table.shape_str() << " must be (Vp, " << s.C << ")";
  DSTRAIN_CHECK(positions.empty() ||
                (positions.ndim == 2 && positions.shape[1] == s.C && positions.shape[0] >= s.T))
      << positions_name << " " << positions.shape_str() << " must be (maxT >= " << s.T << ", "
      << s.C << ")";
  DSTRAIN_CHECK(tokens.ndim == 2 && tokens.shape[0] == s.B && tokens.shape[1] == s.T)
      << "tokens " << tokens.shape_str() << " must be (" << s.B << ", " << s.T << ")";
  DSTRAIN_CHECK(s.B * s.T <= INT_MAX && s.Vp < (int64_t{1} << 31))
      << "embedding of " << s.B * s.T << " positions and " << s.Vp << " rows is too large";
  return s;
}

void check_slice(const EmbeddingShape& s, const char* table_name, int64_t vocab_begin,
                 int64_t vocab_rows) {
  DSTRAIN_CHECK(vocab_begin >= 0 && vocab_begin + s.Vp <= vocab_rows && vocab_rows < INT32_MAX)
      << table_name << " of " << s.Vp << " rows from row " << vocab_begin
      << " is not inside a vocabulary of " << vocab_rows << " rows";
}

}  // namespace

void embedding_forward(const CudaContext& ctx, Tensor out, Tensor tokens, Tensor positions,
                       Tensor wte, Tensor wpe, int64_t vocab_begin, int64_t vocab_rows,
                       cudaStream_t stream) {
  const EmbeddingShape s =
      check_embedding(ctx, out, "embedding out", tokens, wte, "wte", wpe, "wpe");
  check_slice(s, "wte", vocab_begin, vocab_rows);
  check_positions_shape(positions, s.B, s.T, "embedding");
  if (s.B * s.T == 0 || s.C == 0) return;
  const dim3 grid(static_cast<unsigned>(s.B * s.T), ceil_div(s.C, kThreads));
  DSTRAIN_LAUNCH(embedding_forward_kernel, grid, kThreads, 0, stream)
  (device_tensor(out), static_cast<const int32_t*>(tokens.data),
   positions.empty() ? nullptr : positions.i32(), device_tensor(wte), device_tensor(wpe),
   !wpe.empty(), s.T, s.C, vocab_begin, s.Vp, vocab_rows, ctx.error_word);
  CUDA_CHECK_LAUNCH();
}

namespace {

// table (rows, C) += the rows of dout (BT, C) summed per id (ids in [begin, begin + rows), as
// table row id - begin; others skipped, one outside [0, id_limit) raising the flag): a stable
// radix sort groups the rows by id, (b,t) order kept inside a group, and one block column per
// group sums it in that order.
void scatter_rows(const CudaContext& ctx, Tensor table, Tensor dout, const int32_t* ids,
                  int64_t BT, int64_t C, int64_t begin, int64_t rows, int64_t id_limit,
                  cudaStream_t stream) {
  const int items = static_cast<int>(BT);
  // Keys are < rows + 1: sort only the bits that can differ.
  const int end_bit = std::bit_width(static_cast<uint64_t>(rows));
  size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), items, 0, end_bit, stream));
  const size_t array_bytes = align_up(static_cast<size_t>(BT) * 4);
  Scratch scratch(ctx, 4 * array_bytes + align_up(sort_bytes), stream);
  char* base = scratch.as<char>();
  auto* keys = reinterpret_cast<uint32_t*>(base);
  auto* sorted_keys = reinterpret_cast<uint32_t*>(base + array_bytes);
  auto* row_ids = reinterpret_cast<int32_t*>(base + 2 * array_bytes);
  auto* sorted_rows = reinterpret_cast<int32_t*>(base + 3 * array_bytes);
  void* sort_temp = base + 4 * array_bytes;

  DSTRAIN_LAUNCH(embedding_keys_kernel, grid_for(ctx, BT, kThreads), kThreads, 0, stream)
  (ids, BT, begin, rows, id_limit, keys, row_ids, ctx.error_word);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, keys, sorted_keys, row_ids,
                                             sorted_rows, items, 0, end_bit, stream));
  DSTRAIN_LAUNCH(embedding_group_sum_kernel,
                 dim3(static_cast<unsigned>(BT), ceil_div(C, kThreads)), kThreads, 0, stream)
  (device_tensor(table), device_tensor(dout), sorted_keys, sorted_rows, BT, C, rows);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void embedding_backward(const CudaContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout,
                        Tensor tokens, Tensor positions, int64_t vocab_begin, int64_t vocab_rows,
                        cudaStream_t stream) {
  const EmbeddingShape s =
      check_embedding(ctx, dout, "embedding dout", tokens, dwte, "dwte", dwpe, "dwpe");
  check_slice(s, "dwte", vocab_begin, vocab_rows);
  check_positions_shape(positions, s.B, s.T, "embedding");
  const int64_t BT = s.B * s.T;
  if (BT == 0 || s.C == 0) return;
  scatter_rows(ctx, dwte, dout, static_cast<const int32_t*>(tokens.data), BT, s.C, vocab_begin,
               s.Vp, vocab_rows, stream);
  if (dwpe.empty()) return;  // no position table (LLaMA)
  if (!positions.empty()) {  // packed: the rows sharing a position, in (b, t) order
    const int64_t max_t = dwpe.shape[0];
    scatter_rows(ctx, dwpe, dout, positions.i32(), BT, s.C, 0, max_t, max_t, stream);
    return;
  }
  DSTRAIN_LAUNCH(embedding_position_sum_kernel,
                 dim3(static_cast<unsigned>(s.T), ceil_div(s.C, kThreads)), kThreads, 0, stream)
  (device_tensor(dwpe), device_tensor(dout), s.B, s.T, s.C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dstrain::cuda
