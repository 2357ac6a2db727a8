// Pieces every architecture's forward and backward share (model/architecture.h): the
// row-parallel matmul, the (vocabulary-parallel) cross-entropy and the head's mean loss.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/ops.h"
#include "model/architecture.h"
#include "model/fp8_linear.h"
#include "model/tensor_parallel.h"

namespace dstrain {

// The sequence-parallel buffer `full` as (rows, C), or an empty tensor when tp does not use
// sequence parallelism (the buffers have no rows then; the collectives do not touch them).
Tensor sequence_parallel_rows(const TensorParallel& tp, Tensor full, int64_t rows, int64_t C);

// A row-parallel layer: out = inp @ W + bias, the products of the tp ranks' rows of W summed
// before the bias is added, once. scratch (N, C) receives the (partial) product; stream_part
// is this rank's (N/tp, C) under sequence parallelism (else empty). Returns the stream rows of
// the result (scratch, or stream_part). weight_out_by_in as matmul_forward's; the product in
// FP8 where `fp8` has scratch and the linear fits (model/fp8_linear.h).
Tensor row_parallel_matmul(Backend& backend, const Fp8Scratch& fp8, const TensorParallel& tp,
                           Tensor scratch, Tensor stream_part, Tensor inp, Tensor weight,
                           Tensor bias, bool weight_out_by_in, Stream stream);

// The per-token losses (N) of the (N, Vp / tp) logits, and with run.dloss != 0 their gradient
// in place of the logits. Under tp the cross-entropy is vocabulary-parallel: each rank reduces
// its columns to (max, sum of exponentials, target logit) per row into stats (N, 3), the
// ranks gather those into all_stats (tp, N, 3), and each finishes the same losses. stats and
// all_stats: the workspace buffers (at least N rows; unused, and may be empty, without tp).
void vocab_parallel_cross_entropy(const HeadRun& run, const TensorParallel& tp, Tensor logits,
                                  Tensor losses, Tensor stats, Tensor all_stats,
                                  int64_t vocab_begin, int64_t vocab);

// The mean of the N losses, summed in order in fp64 on the host (waits for the stream).
double mean_loss(const HeadRun& run, Tensor losses, int64_t N);

}  // namespace dstrain
