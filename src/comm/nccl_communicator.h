// The NCCL communicator: the Communicator of communicator.h over NCCL, one GPU per rank, the
// ranks being threads of this process (run_nccl_ranks, the twin of run_local_ranks). Built only
// with DSTRAIN_WITH_NCCL (CMake finds NCCL next to the CUDA toolkit); this header includes no
// CUDA or NCCL header, and without NCCL nccl_available() is false and run_nccl_ranks throws.
//
// How it differs from the local communicator
// - Memory: device memory of the rank's GPU. Host tensors are accepted too (the small control
//   values of the trainer: an overflow flag, a squared norm, memory counts, the gather of the
//   final weights) and staged through a device buffer the communicator owns.
// - `stream` is the cudaStream_t (nullptr: the legacy default stream) the operation is
//   enqueued on. Every call then waits until the operation has completed on that stream, as
//   the local communicator does, so a caller may read or reuse its buffers on return. The wait
//   polls the stream and NCCL's asynchronous error instead of blocking, so a rank never hangs:
//   when another rank of the world fails, or the wait exceeds the timeout (it includes work
//   queued on the stream before the collective), the communicator is aborted (ncclCommAbort)
//   and the call throws dstrain::Error naming the rank and the operation. A rank whose
//   function returns while the others wait is only detected by the timeout (NCCL cannot tell
//   "not yet arrived" from "never coming").
// - Determinism: NCCL's reduction order is fixed for a fixed topology, rank count, algorithm
//   and protocol (and NCCL version): the same run on the same machine gives the same bits.
//   It is not the local communicator's order (rank 0, 1, 2, ... in fp32 with one rounding):
//   ring and tree algorithms combine partial sums in another order, and F16/BF16 sums are
//   rounded to their storage type along the way, so results differ from the CPU backend's in
//   the last bits. NCCL may choose another algorithm on another machine or version; pin it with
//   NCCL_ALGO and NCCL_PROTO when bits must match across machines. Max with a NaN input is
//   whatever NCCL's max gives (not promised to propagate NaN). No mismatch check across ranks:
//   a rank calling a different collective is undefined behaviour in NCCL (usually a hang, then
//   the timeout).
// - dtypes: F32, F16, BF16, I32 (ncclFloat32, ncclFloat16, ncclBfloat16, ncclInt32).
// - split: ncclCommSplit (color < 0: NCCL_SPLIT_NOCOLOR, and nullptr is returned).
// - barrier: a one-element all-reduce on the device.
// - Errors: every NCCL call goes through NCCL_CHECK, which throws dstrain::Error with the NCCL
//   error and ncclGetLastError's text, the statement, file:line, the operation
//   ("all_reduce #3 on group 'world'"), the device and the rank.
#pragma once

#include <functional>
#include <string>

#include "comm/communicator.h"

namespace dstrain {

// True when this build has NCCL.
bool nccl_available();

// Runs fn(communicator) on `world_size` threads, rank r on GPU r (made current on its thread),
// with one ncclUniqueId shared by the threads and ncclCommInitRank on each (NCCL's
// one-thread-per-GPU initialization: the calls of the threads meet inside NCCL). If any rank
// throws, the others are released from their NCCL calls (their communicators are aborted) and
// the first error is rethrown here after every thread has joined. timeout_seconds as for
// run_local_ranks (> 0; infinity: none).
// REQUIRES: 1 <= world_size <= the number of GPUs (UserError otherwise); a build with NCCL
// (Error otherwise).
void run_nccl_ranks(int world_size, double timeout_seconds,
                    const std::function<void(Communicator&)>& fn);

// A new ncclUniqueId as bytes (ncclGetUniqueId; node 0 makes it and the rendezvous hands it to
// every node). REQUIRES: a build with NCCL.
std::string nccl_unique_id();

// This process's ranks of an NCCL world spanning several processes (one per node): world ranks
// first_rank .. first_rank + local_ranks - 1 of world_size, rank first_rank + i on GPU
// first_device + i (first_device: 0 on a node of its own; several "nodes" of one machine, as
// the tests run them on the emulator, give each its own GPUs),
// joined with the shared `unique_id` (nccl_unique_id()'s bytes). Otherwise as run_nccl_ranks:
// a failure of one of this process's ranks aborts the others here; NCCL itself reports a rank
// of another process that fails (its asynchronous error), or the timeout does.
// REQUIRES: 0 <= first_rank, first_device + local_ranks <= the GPUs here, first_rank +
// local_ranks <= world_size; unique_id from nccl_unique_id().
struct NcclNodeRanks {
  int first_rank = 0;
  int local_ranks = 1;
  int world_size = 1;
  std::string unique_id;
  int first_device = 0;
};
void run_nccl_node_ranks(const NcclNodeRanks& ranks, double timeout_seconds,
                         const std::function<void(Communicator&)>& fn);

}  // namespace dstrain
