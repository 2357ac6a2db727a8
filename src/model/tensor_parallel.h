// Tensor parallelism (Megatron-LM): a layer's matrices are split over the tp ranks of a group,
// and a handful of collectives join the pieces. Every collective comes with its conjugate, the
// collective its backward runs (Megatron's tensor_parallel/mappings.py); they are written here
// once, as two pairs, and used by every split layer of every architecture:
//
//   enter a column-parallel region   forward: identity        backward: all-reduce
//     (the fused qkv, the MLP's up-projection, the vocabulary-parallel head)
//     with sequence parallelism       forward: all-gather     backward: reduce-scatter
//   leave a row-parallel region      forward: all-reduce      backward: identity
//     (the attention and MLP output projections, the vocabulary-parallel embedding)
//     with sequence parallelism       forward: reduce-scatter  backward: all-gather
//
// The residual stream. Outside the tensor-parallel regions (layernorms, residual adds) every tp
// rank holds the whole (N, C) stream, the same values on each. With sequence parallelism each
// holds a contiguous 1/tp of its N = b*t token rows instead ((N/tp, C): rows [r*N/tp,
// (r+1)*N/tp) on rank r), so those activations take 1/tp of the memory; the regions gather the
// rows they need. dstrain's activations are (B, T, C) with the token index b*T + t, so a
// contiguous block of token rows is what an all-gather or reduce-scatter moves without a copy
// (Megatron, whose activations are (T, B, C), splits along the sequence for the same reason).
//
// Gradients of replicated parameters (layernorms, the row-parallel layers' biases, wpe) are
// the same on every tp rank, except for those inside the sequence-parallel region: each rank's
// layernorm gradient then covers its own rows only, and the tp ranks' parts are summed before
// the step (ParamSpec::tp_partial_grad, parallel/sharded_model.h).
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace dstrain {

// What a rank's tensor-parallel collectives did (the functions below add to it). Volume in
// all-reduce equivalents, as the cost model counts it (parallel/cost_model.h): an all-reduce
// of X bytes counts X, an all-gather or reduce-scatter of a whole buffer of X bytes X / 2.
// seconds: host time inside the calls: the whole collective on CPU ranks (the copies and the
// wait for the slowest rank), only the launch on a GPU (NCCL runs on the stream).
struct TensorParallelStats {
  int64_t collectives = 0;
  double all_reduce_bytes = 0;
  double seconds = 0;
};

struct TensorParallel {
  int size = 1;  // tp: the ranks a layer is split over
  int rank = 0;  // this rank's index among them
  bool sequence_parallel = false;
  // The tp group (rank() == rank): needed to run with size > 1, not to plan (memory model).
  Communicator* comm = nullptr;
  TensorParallelStats* stats = nullptr;  // optional

  bool enabled() const { return size > 1; }
  // The rows of the residual stream this rank holds for n token rows.
  // REQUIRES under sequence parallelism: size divides n.
  int64_t stream_rows(int64_t n) const;
};

// One rank's (N, K) or full (N, K) rows: `part` is this rank's stream (N/tp rows under sequence
// parallelism, else N), `full` a buffer of N rows. Each function returns the tensor that holds
// its result (which may be its input: identity), in `part`'s or `full`'s dtype.
//
// Entering a column-parallel region: the whole input every rank's slice of the matrix needs.
// forward: (SP) all-gather `part` into `full`; else `part` itself is whole.
Tensor enter_region_forward(const TensorParallel& tp, Tensor part, Tensor full, Stream stream);
// backward: `full_grad` (N rows) holds this rank's partial dL/d(input) (from its slice of the
// matrix); the result is the sum over tp ranks of this rank's rows: (SP) reduce-scattered into
// `part_grad`, else all-reduced in place in `full_grad`.
Tensor enter_region_backward(const TensorParallel& tp, Tensor full_grad, Tensor part_grad,
                             Stream stream);
// Leaving a row-parallel region: `full` (N rows) holds this rank's partial output; the result is
// the sum over tp ranks, of this rank's rows: (SP) reduce-scattered into `part`, else
// all-reduced in place in `full`.
Tensor exit_region_forward(const TensorParallel& tp, Tensor full, Tensor part, Stream stream);
// backward: dL/d(output) of the whole N rows every rank's slice needs: (SP) all-gathered from
// `part_grad` into `full_grad`; else `part_grad` itself is whole.
Tensor exit_region_backward(const TensorParallel& tp, Tensor part_grad, Tensor full_grad,
                            Stream stream);

// Every tp rank's `part` side by side in `full` (tp times its numel), with or without sequence
// parallelism: the vocabulary-parallel loss's per-row statistics.
void all_gather_parts(const TensorParallel& tp, Tensor full, Tensor part, Stream stream);

}  // namespace dstrain
