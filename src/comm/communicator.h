// Communicator: the collectives ranks use. Two implementations: `local` (the ranks are
// threads of this process; CPU memory, and CUDA memory through copies with the wrapper of
// comm/staged_communicator.h) and `nccl` (comm/nccl_communicator.h: one GPU per rank, built
// with NCCL).
//
// Conventions
// - Every method is collective over the communicator's ranks unless it says otherwise: all
//   ranks call it in the same order with matching sizes (SPMD).
// - Reductions run in a fixed order, rank 0 first, then 1, 2, ... (acc = in0; acc += in1;
//   ...), in fp32 for F32/F16/BF16 (16-bit inputs are widened, summed in fp32 and rounded
//   once), so results never depend on thread timing and every rank gets the same bits.
// - `stream`: on CUDA the operation is ordered on it; the local implementation finishes
//   before it returns.
// - Failure: when any rank of the world fails (throws) or a rank waits in a collective longer
//   than the timeout, every rank blocked in or entering a collective throws dstrain::Error
//   naming the failed rank and operation; no rank hangs.
// - Max propagates NaN (a NaN on any rank gives NaN); I32 Sum wraps around on overflow.
// - A communicator is used by one thread at a time (the rank's own thread, in call order).
//
// The local implementation (run_local_ranks) in particular
// - moves CPU memory only (a CUDA tensor is an Error; make_staged_communicator wraps it for
//   device memory, through host copies); `stream` is ignored.
// - checks every collective across ranks before touching data: a different operation, dtype,
//   count, reduce op or root on some rank, or two ranks passing overlapping buffers (ranks
//   are threads of one address space), is a dstrain::Error on every rank naming each rank's
//   call ("mismatched collectives at all_reduce #3 on group 'world': rank 0 called
//   all_reduce(count 10, F32, sum), but rank 1 called all_reduce(count 12, F32, sum)");
//   a send/recv pair of different dtype or count is an Error on both sides.
// - exchange: posts every send (each lent to its receiver), then takes every receive in the
//   order given, then waits until every send has been received; one timeout covers the whole
//   call. A failure, timeout, abort or mismatch of one of its operations is the Error
//   send/recv would give for it ("send #2 from rank 0 to rank 1 on group 'world' timed
//   out ..."); the exchange then ends at once: its sends not yet received are withdrawn (their
//   receivers are released by the failure of this rank, or by their own timeout). A receive
//   buffer overlapping another buffer of the same exchange is an Error (the peer would read
//   while this rank writes).
// - times only the wait for the other ranks to arrive (the watchdog of NCCL): once all have
//   arrived, the copies run to completion however long they take. A rank waiting for one
//   that has already returned from its function fails at once, without waiting for the
//   timeout. Messages name the group ('world', 'world/split0[color 1]' for the first split
//   of the world), the call number on it, and for every missing rank what it is doing
//   ("rank 3 never joined (it is in barrier #2 on group 'world')").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace dstrain {

enum class ReduceOp { Sum, Max };

// One point-to-point operation of an exchange().
struct P2POp {
  enum class Kind : uint8_t { Send, Recv };
  Kind kind = Kind::Send;
  Tensor buffer;
  int peer = -1;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // buffer (n), in place: the elementwise reduction over ranks.
  virtual void all_reduce(Tensor buffer, ReduceOp op, Stream stream) = 0;
  // input (size * n) on every rank; output (n) on rank r = reduction over ranks of
  // input[r*n : (r+1)*n]. output and input must not overlap.
  virtual void reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream stream) = 0;
  // input (n) on every rank; output (size * n) = concatenation of every rank's input in rank
  // order. input may be output's own slice [rank*n, (rank+1)*n) (in-place gather).
  virtual void all_gather(Tensor output, Tensor input, Stream stream) = 0;
  // buffer (n): root's contents on every rank.
  virtual void broadcast(Tensor buffer, int root, Stream stream) = 0;
  // Point to point (not collective): send blocks until the peer has received it.
  virtual void send(Tensor buffer, int peer, Stream stream) = 0;
  virtual void recv(Tensor buffer, int peer, Stream stream) = 0;
  // Point to point (not collective): every operation of `ops` at once, as one group (torch's
  // batch_isend_irecv, NCCL's ncclGroupStart/ncclGroupEnd): all sends are posted, all receives
  // taken, and it returns when every one is done. Each matches the peer's send or recv (plain or
  // inside its own exchange) in per-pair order, exactly as send/recv do; several to (or from)
  // one peer in one call go in the order listed (a pipeline's activation and the small message
  // beside it). REQUIRES: no peer is this rank.
  virtual void exchange(const std::vector<P2POp>& ops, Stream stream) = 0;
  // Collective: a personalized exchange with per-peer counts (torch's all_to_all_single with
  // split sizes; the dispatch and combine of expert parallelism). input holds send_counts[p]
  // elements for each peer p, in peer order; output receives recv_counts[p] elements from each
  // peer p, in peer order. recv_counts[p] on this rank must equal send_counts[this rank] on p;
  // zero counts move nothing. The default is one exchange() with every other peer and a copy of
  // this rank's own part (copy_own_part), so it fails, times out and reports as exchange does.
  // REQUIRES: size() counts each, >= 0, summing to at most input's (output's) numel; one dtype;
  // input and output do not overlap.
  virtual void all_to_all(Tensor output, const std::vector<int64_t>& recv_counts, Tensor input,
                          const std::vector<int64_t>& send_counts, Stream stream);
  virtual void barrier() = 0;
  // Not collective: a label of what this rank is doing in its own code ("pipeline stage 1
  // (rank 3), forward of micro-batch 5"), for the messages about it. The local implementation
  // names it when another rank times out waiting for this one; others may ignore it. Empty
  // clears it. Any communicator of the world may set it (it belongs to the rank).
  virtual void annotate(const std::string& what) {}
  // Collective: ranks with the same color form a new communicator, ranked by (key, old rank).
  // color < 0: this rank joins none and gets nullptr.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

 protected:
  // all_to_all's own part: dst = src, ordered on `stream`. The default copies host memory (a
  // device tensor is an Error); a communicator of device memory overrides it.
  virtual void copy_own_part(Tensor dst, Tensor src, Stream stream);
};

// A transfer that failed because its peer closed the connection (Gloo): the consequence of
// the peer's own failure, which a process running several ranks reports instead when the peer
// is one of its ranks (run_gloo_ranks). Code that adds context to a communicator's error keeps
// this type.
class PeerClosedError : public Error {
 public:
  using Error::Error;
};

// Runs fn(communicator) on `world_size` threads, one rank each, sharing one local world.
// Each thread's thread_error_context() names its rank. If any rank throws, the others are
// released from their collectives with an error and the first error (the root cause, not
// the follow-on "rank r failed" errors) is rethrown here, after every thread has joined.
// timeout_seconds: how long a rank may wait inside one collective before the run fails with
// a message naming the rank and the operation (like NCCL's watchdog). REQUIRES: > 0
// (infinity: no timeout); world_size >= 1 (UserError otherwise). A rank that never calls
// into the communicator again (an endless loop in its own code) cannot be interrupted: the
// others fail at their timeout, and this call returns once that rank's function returns.
void run_local_ranks(int world_size, double timeout_seconds,
                     const std::function<void(Communicator&)>& fn);

}  // namespace dstrain
