// Internal to the CUDA emulator's NCCL: what its two files share -- emu_nccl.cpp (communicators:
// init, split, errors, finalize, abort) and emu_nccl_calls.cpp (collectives, send/recv,
// groups). What is emulated, and how: emu_nccl.cpp.
#pragma once

#include <nccl.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda_emu/emu_streams.h"

namespace dstrain::emu::nccl {
struct Clique;
struct Join;
}  // namespace dstrain::emu::nccl

// The handle nccl.h declares (ncclComm_t): one rank's view of a communicator.
struct ncclComm {
  int rank = -1;  // in the communicator (while joining: the rank asked for, or the parent's)
  int device = 0;
  bool blocking = true;
  std::shared_ptr<dstrain::emu::nccl::Clique> clique;   // null until every rank has joined
  std::shared_ptr<dstrain::emu::nccl::Join> joining;    // its init or split, while in progress
  std::shared_ptr<dstrain::emu::nccl::Join> splitting;  // a split of this one, in progress
  ncclResult_t join_error = ncclSuccess;                // its init or split failed
  std::string join_error_text;
  uint64_t collectives = 0, splits = 0;     // calls issued: the numbers peers are matched by
  std::map<int, uint64_t> sends, receives;  // messages issued, by peer
  // The last finish step issued on each engine stream (ncclCommFinalize flushes them).
  std::map<const void*, dstrain::emu::StreamMark> last_steps;
  bool finalizing = false;
};

// The types ncclComm points to.
namespace dstrain::emu::nccl {

// What one rank asked for at one call number: every rank must ask for the same.
struct Signature {
  const char* call = "";  // "ncclAllReduce"; a send and its receive share "ncclSend/ncclRecv"
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  int op = -1;    // reductions
  int root = -1;  // broadcast
  bool operator==(const Signature& o) const {
    return std::strcmp(call, o.call) == 0 && count == o.count && type == o.type && op == o.op &&
           root == o.root;
  }
};

// One collective, or one message, shared by the ranks taking part: their inputs by slot (a
// collective: the rank; a message: 0 holds the sent data, 1 marks the posted receive).
struct Exchange {
  explicit Exchange(int slots) : inputs(static_cast<size_t>(slots)), arrived(slots, false) {}
  Signature signature;  // of the first slot to arrive
  int first_slot = -1;
  std::vector<std::vector<char>> inputs;
  std::vector<bool> arrived;
  int arrivals = 0;
  int issued = 0;  // ranks that have issued it (it leaves the clique's map when all have)
};

// The shared state of one communicator's ranks.
struct Clique {
  int size = 0;
  std::vector<int> devices;  // by rank
  // Set once: a mismatch between ranks (ncclInvalidUsage) or an abort (ncclRemoteError). Every
  // pending step becomes a no-op and every rank's ncclCommGetAsyncError reports it.
  ncclResult_t error = ncclSuccess;
  std::string error_text;
  std::map<uint64_t, std::shared_ptr<Exchange>> collectives;                     // by call number
  std::map<std::tuple<int, int, uint64_t>, std::shared_ptr<Exchange>> messages;  // (src, dst, n)
  std::map<uint64_t, std::shared_ptr<Join>> splits;                              // by split number
};

// An init (the ranks of an ncclUniqueId) or a split (the ranks of a parent) in progress.
struct Join {
  struct Member {
    ncclComm* comm = nullptr;    // the new communicator (nullptr: a split's NCCL_SPLIT_NOCOLOR)
    ncclComm* parent = nullptr;  // a split's parent
    int color = 0, key = 0, device = 0;
  };
  bool split = false;
  int expected = 0;
  std::map<int, Member> members;     // by rank (init) or parent rank (split)
  std::string id;                    // an init's ncclUniqueId
  ncclResult_t error = ncclSuccess;  // a failed split: what ranks joining it late get
  std::string error_text;
};

using Lock = std::unique_lock<std::mutex>;

// Everything above, behind one mutex. Lock order: the stream engine's lock, then this one (steps
// run with the engine's lock held); so no emulated CUDA call may be made while holding it.
struct State {
  std::mutex mutex;
  std::condition_variable joined;  // a join completed or failed
  std::set<const ncclComm*> live;
  std::map<std::string, std::shared_ptr<Join>> inits;  // by ncclUniqueId
  uint64_t next_id = 1;
};
State& state();

// This thread's ncclGetLastError text.
std::string& last_error();
// Returns `result`, the sentence made of `parts` becoming ncclGetLastError's.
template <class... Parts>
ncclResult_t fail(ncclResult_t result, const Parts&... parts) {
  std::ostringstream text;
  (text << ... << parts);
  last_error() = text.str();
  return result;
}
inline constexpr char kNotReady[] =
    ": communicator used before ncclCommGetAsyncError reported ncclSuccess for its "
    "initialization or split";

// REQUIRES (these four): the state's mutex held.
bool is_live(const ncclComm* comm);
// The communicator's state as ncclCommGetAsyncError reports it, its flush aside.
ncclResult_t comm_state(const ncclComm* comm, std::string* text);
// Marks the clique failed (once) and releases everything waiting on it; the caller then calls
// notify_progress() (after unlocking) so that host threads waiting on streams look again.
void fail_clique(State& s, Clique& clique, ncclResult_t error, const std::string& text);
// Waits (a blocking communicator) until `comm`'s init or split has completed or failed.
ncclResult_t wait_joined(State& s, ncclComm* comm, Lock& lock);

// Groups (emu_nccl_calls.cpp): whether this thread is between ncclGroupStart and End, and an
// init or split started there (`comm`: the communicator to wait for at End, if `blocking`).
bool in_group();
void add_group_join(ncclComm* comm, bool blocking);

}  // namespace dstrain::emu::nccl
