// Timing the collectives of a communicator as nccl-tests does (its doc/PERFORMANCE.md), on the
// communicator training would use: NCCL on GPUs, the local communicator (ranks are threads) on
// the CPU backend. Used by `dstrain bench comm` and benchmarks/bench_comm.cpp.
//
// - S, the size of a row: the bytes of the full buffer (the all_reduce buffer, the
//   reduce_scatter input, the all_gather output, the message each send_recv rank sends, the
//   all_to_all input: count / n elements for each peer, as expert parallelism's dispatch);
//   count = S / dtype size elements (nccl-tests prints the per-rank count for reduce_scatter
//   and all_gather; here it is always the full buffer's).
// - algbw = S / t; busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (reduce_scatter,
//   all_gather, all_to_all), x 1 (send_recv), n ranks: what each rank's link carries.
// - t: per iteration, the slowest rank's time from leaving a barrier to the collective's end
//   (the call has returned and the rank's stream is synchronized: on CUDA the work has completed
//   on the GPU), on the steady clock; the row's time is the median of --iters such iterations
//   after --warmup untimed ones.
// - send_recv is a ring: rank r sends to r+1 and receives from r-1 (mod n) in one exchange
//   (NCCL: one group), as nccl-tests' sendrecv does.
// - Data is never zero: every element is a multiple of 1/8 in [1/8, 17/8] depending on its
//   index and rank, exact in fp16 and bf16, so sums stay exact too. all_reduce works in place:
//   its buffer is restored from a copy before every iteration, outside the timed interval.
// - After the last iteration of every row each rank checks its whole result against the
//   values the collective must produce; a wrong one is a dstrain::Error (a benchmark of a
//   broken collective is worthless).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "core/dtype.h"
#include "kernels/ops.h"
#include "train/devices.h"

namespace dstrain {

enum class CommOp : uint8_t { AllReduce, ReduceScatter, AllGather, SendRecv, AllToAll };

// "all_reduce", "reduce_scatter", "all_gather", "send_recv", "all_to_all"
const char* comm_op_name(CommOp op);
// The inverse of comm_op_name; UserError naming the choices otherwise.
CommOp parse_comm_op(const std::string& name);
const std::vector<CommOp>& all_comm_ops();  // in the order above

// nccl-tests' bus bandwidth factor for `ranks` ranks (see above). REQUIRES: ranks >= 1.
double bus_factor(CommOp op, int ranks);

// The elements a row of `bytes` moves: bytes / dtype size, rounded down to a multiple of
// `ranks` for reduce_scatter and all_gather (as nccl-tests does). 0 when less than one element
// per rank.
int64_t comm_bench_count(CommOp op, int64_t bytes, DType dtype, int ranks);

// min, 2 min, 4 min, ... up to max (both included when max is min times a power of two).
// REQUIRES: 0 < min <= max.
std::vector<int64_t> doubling_sizes(int64_t min, int64_t max);

struct CommBenchRequest {
  std::vector<CommOp> ops;
  std::vector<int64_t> sizes;  // S of each row, bytes
  DType dtype = DType::F32;
  int warmup = 5;              // untimed iterations first
  int iters = 20;              // timed iterations: the median is the row's time
  double timeout_seconds = 600;
};

struct CommBenchRow {
  CommOp op = CommOp::AllReduce;
  int64_t bytes = 0;   // S: count x dtype size
  int64_t count = 0;   // elements of the full buffer
  DType dtype = DType::F32;
  int ranks = 0;
  double seconds = 0;  // the median over iterations of the slowest rank's time
  double algbw = 0;    // bytes per second: bytes / seconds
  double busbw = 0;    // algbw x bus_factor(op, ranks)
};

// What one rank times with: its communicator, the backend that copies its memory, where its
// buffers come from, and the stream the collectives are ordered on.
struct CommBenchRank {
  Communicator& comm;
  Backend& backend;
  Allocator& memory;
  Stream stream = nullptr;
};

// On one rank's thread, collectively with the other ranks: times every (op, size) of
// `request`, in that order, and checks each result. Returns this rank's seconds, one vector
// per row (ops outer, sizes inner) of request.iters times. Throws dstrain::Error when a
// collective gives a wrong result. REQUIRES: every size gives comm_bench_count > 0, at least
// 2 ranks.
std::vector<std::vector<double>> time_collectives_on_rank(const CommBenchRank& rank,
                                                          const CommBenchRequest& request);

// The rows from every rank's time_collectives_on_rank result (indexed by rank).
std::vector<CommBenchRow> summarize_comm_bench(
    const CommBenchRequest& request, const std::vector<std::vector<std::vector<double>>>& seconds);

// Launches devices.ranks ranks as training would (launch_ranks, make_rank_devices with one
// CPU thread each), times the request on each, and returns the rows.
std::vector<CommBenchRow> run_comm_bench(const RunDevices& devices,
                                         const CommBenchRequest& request);

}  // namespace dstrain
