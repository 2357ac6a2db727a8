// NCCL as the CUDA emulator provides it (DSTRAIN_CUDA=EMULATOR): the functions dstrain's NCCL
// communicator (src/comm/nccl_communicator.cpp) calls, with the declarations of NCCL's own
// nccl.h, for ranks that are host threads of this process -- or one thread driving several
// communicators inside ncclGroupStart/End -- on emulated devices. libnccl is not linked. This
// file: the communicators; emu_nccl_calls.cpp: the collectives, send/recv and groups.
//
// What is emulated
// - Communicators: ncclCommInitRank(Config) joins the ranks sharing an ncclUniqueId,
//   ncclCommSplit the ranks of a parent (by color; ranked by (key, parent rank);
//   NCCL_SPLIT_NOCOLOR: *newcomm = NULL). A non-blocking communicator (config.blocking = 0)
//   returns at once and ncclCommGetAsyncError says ncclInProgress until every rank has joined;
//   a blocking one waits for them on the host (the streams are not involved). Two ranks of one
//   communicator on the same device are ncclInvalidUsage, as in NCCL.
// - Collectives (AllReduce, ReduceScatter, AllGather, Broadcast) and Send/Recv are
//   stream-ordered, like NCCL's kernels: each queues on its stream (a) a "contribute" step that
//   copies this rank's input into the exchange shared with its peers and (b) a "finish" step
//   gated (emu::enqueue_work's ready) on every peer having contributed, which writes this rank's
//   output. So the output is written only when the stream gets there (the emulator's streams are
//   lazy), and in-place forms work. Collectives are matched across ranks by their call number
//   on the communicator, messages by (source, destination, number of the pair). A send
//   completes once its receive is posted (NCCL: "blocking for the GPU"): a send-first ring
//   deadlocks as on NCCL unless the calls are grouped. Ranks calling different collectives, counts,
//   types, ops or roots at one call number, or a send/recv pair of different count or type, are
//   ncclInvalidUsage on every rank's ncclCommGetAsyncError (NCCL would hang or corrupt).
// - Reductions: Sum and Max over F32, F16, BF16 and I32 in rank order (acc = in0; acc op= in1;
//   ...), in fp32 for the 16-bit types, rounded once to nearest even; I32 sums wrap; Max
//   propagates NaN. Deterministic, and the local communicator's order (NCCL's ring and tree
//   orders differ in the last bits, see comm/nccl_communicator.h).
// - ncclGroupStart/End (nestable): the calls between them are queued at the outermost End, all
//   contribute steps before any finish step, so send/recv pairs in a group do not deadlock;
//   blocking inits and splits in a group wait at End.
// - ncclCommAbort releases the peers: their pending steps become no-ops and their
//   ncclCommGetAsyncError reports ncclRemoteError. ncclCommFinalize flushes the communicator's
//   work (ncclInProgress until its streams have run it), ncclCommDestroy frees the handle
//   without waiting (queued work keeps what it needs).
// - Argument checks as NCCL's (ncclInvalidArgument): null or dead communicator, buffers not in
//   device memory of the communicator's device (or pinned host memory), unknown types and ops,
//   root or peer outside the communicator; ncclGetLastError gives the sentence.
// Not emulated: ncclProd/Min/Avg and reductions of other types (ncclInvalidArgument, saying so),
// the other collectives (Reduce, AllToAll, Gather, Scatter), user-defined ops, buffer and window
// registration, ncclCommInitAll, shrink and revoke; timing and bandwidth; a check that a stream
// belongs to the communicator's device (nullptr is taken as that device's legacy stream).
#include "kernels/cuda_emu/emu_nccl.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda_emu/emu_runtime.h"
#include "kernels/cuda_emu/emu_streams.h"

namespace dstrain::emu::nccl {
namespace {

constexpr unsigned kConfigMagic = 0xcafebeef;  // what NCCL_CONFIG_INITIALIZER writes
constexpr char kIdMagic[] = "dstrain NCCL emulator id";

// ---- joining: ncclCommInitRank and ncclCommSplit (REQUIRES: the state's mutex held) ----

void fail_join(State& s, Join& join, ncclResult_t error, const std::string& text) {
  join.error = error;
  join.error_text = text;
  if (!join.split) s.inits.erase(join.id);  // a later init with the id starts afresh
  for (auto& [slot, member] : join.members) {
    if (member.comm != nullptr && member.comm->joining.get() == &join) {
      member.comm->joining = nullptr;
      member.comm->join_error = error;
      member.comm->join_error_text = text;
    }
    if (member.parent != nullptr && member.parent->splitting.get() == &join) {
      member.parent->splitting = nullptr;
    }
  }
  join.members.clear();
  s.joined.notify_all();
}

// Every rank is there: forms the communicators.
void complete_join(State& s, Join& join) {
  std::map<int, std::vector<std::pair<std::pair<int, int>, Join::Member>>> by_color;
  for (const auto& [slot, member] : join.members) {
    // An init is one color; a split's ranks are ordered by (key, parent rank).
    if (member.comm != nullptr) by_color[member.color].push_back({{member.key, slot}, member});
  }
  for (auto& [color, members] : by_color) {
    std::sort(members.begin(), members.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    auto clique = std::make_shared<Clique>();
    clique->size = static_cast<int>(members.size());
    for (const auto& entry : members) clique->devices.push_back(entry.second.device);
    for (int a = 0; a < clique->size; ++a) {
      for (int b = 0; b < a; ++b) {
        if (clique->devices[a] == clique->devices[b]) {
          std::ostringstream text;
          text << "duplicate GPU detected: rank " << b << " and rank " << a
               << " both on CUDA device " << clique->devices[a]
               << " (NCCL needs one device per rank of a communicator)";
          fail_join(s, join, ncclInvalidUsage, text.str());
          return;
        }
      }
    }
    for (int rank = 0; rank < clique->size; ++rank) {
      ncclComm* comm = members[static_cast<size_t>(rank)].second.comm;
      comm->rank = rank;
      comm->clique = clique;
      comm->joining = nullptr;
    }
  }
  for (auto& [slot, member] : join.members) {
    if (member.parent != nullptr) member.parent->splitting = nullptr;
  }
  join.members.clear();
  s.joined.notify_all();
}

// Frees `comm` (nullptr: nothing to do); `aborting`: the peers are released with ncclRemoteError.
ncclResult_t remove_comm(ncclComm* comm, bool aborting, const char* call) {
  if (comm == nullptr) return ncclSuccess;
  State& s = state();
  {
    Lock lock(s.mutex);
    if (!is_live(comm)) return fail(ncclInvalidArgument, call, ": comm is not a communicator");
    std::ostringstream text;
    text << "rank " << comm->rank << " left the communicator (" << call << ")";
    for (const std::shared_ptr<Join>& join : {comm->joining, comm->splitting}) {
      if (join) fail_join(s, *join, ncclRemoteError, text.str() + " while it was forming");
    }
    if (comm->clique && aborting) fail_clique(s, *comm->clique, ncclRemoteError, text.str());
    s.live.erase(comm);
  }
  delete comm;
  notify_progress();
  return ncclSuccess;
}

// ncclCommCount and its kind: *out = field(*comm) once the communicator has formed.
template <class Field>
ncclResult_t query(const ncclComm* comm, int* out, const char* call, Field field) {
  Lock lock(state().mutex);
  if (out == nullptr || !is_live(comm)) {
    return fail(ncclInvalidArgument, call, ": invalid comm or NULL output");
  }
  std::string text;
  const ncclResult_t status = comm_state(comm, &text);
  if (status == ncclInProgress && !comm->clique) return fail(ncclInvalidArgument, call, kNotReady);
  if (!comm->clique) return fail(status, call, ": ", text);
  *out = field(*comm);
  return ncclSuccess;
}

bool valid_config(const ncclConfig_t* config) {
  return config == nullptr || config->magic == kConfigMagic;
}
bool blocking_config(const ncclConfig_t* config, bool otherwise) {
  if (config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT) return otherwise;
  return config->blocking != 0;
}

// ncclCommInitRank(Config).
ncclResult_t init_rank(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank,
                       const ncclConfig_t* config) {
  const char* call = "ncclCommInitRank";
  if (out == nullptr) return fail(ncclInvalidArgument, call, ": comm is NULL");
  *out = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return fail(ncclInvalidArgument, call, ": invalid rank ", rank, " of nranks ", nranks);
  }
  if (!valid_config(config)) {
    return fail(ncclInvalidArgument, call, ": config not initialized with NCCL_CONFIG_INITIALIZER");
  }
  if (std::memcmp(id.internal, kIdMagic, sizeof kIdMagic) != 0) {
    return fail(ncclInvalidArgument, call, ": the ncclUniqueId does not come from ncclGetUniqueId");
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return fail(ncclUnhandledCudaError, call, ": no current CUDA device");
  }
  State& s = state();
  Lock lock(s.mutex);
  const std::string key(id.internal, sizeof id.internal);
  std::shared_ptr<Join>& entry = s.inits[key];
  if (!entry) {
    entry = std::make_shared<Join>();
    entry->expected = nranks;
    entry->id = key;
  }
  std::shared_ptr<Join> join = entry;
  if (join->expected != nranks) {
    return fail(ncclInvalidUsage, call, ": rank ", rank, " was given nranks ", nranks,
                ", but another rank of the same ncclUniqueId ", join->expected);
  }
  if (join->members.count(rank)) {
    return fail(ncclInvalidUsage, call, ": rank ", rank, " joined the same ncclUniqueId twice");
  }
  auto* comm = new ncclComm;
  comm->rank = rank;
  comm->device = device;
  comm->blocking = blocking_config(config, true);
  comm->joining = join;
  s.live.insert(comm);
  join->members[rank] = {comm, nullptr, 0, 0, device};
  *out = comm;
  if (static_cast<int>(join->members.size()) == nranks) {
    s.inits.erase(key);
    complete_join(s, *join);
  }
  if (in_group()) {
    add_group_join(comm, comm->blocking);
    return ncclSuccess;
  }
  if (comm->blocking) return wait_joined(s, comm, lock);
  std::string text;
  const ncclResult_t result = comm_state(comm, &text);
  return result == ncclSuccess || result == ncclInProgress ? result
                                                           : fail(result, call, ": ", text);
}

ncclResult_t split(ncclComm* parent, int color, int key, ncclComm_t* out,
                   const ncclConfig_t* config) {
  const char* call = "ncclCommSplit";
  if (out == nullptr) return fail(ncclInvalidArgument, call, ": newcomm is NULL");
  *out = nullptr;
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) {
    return fail(ncclInvalidArgument, call, ": invalid color ", color,
                " (a color is >= 0, or NCCL_SPLIT_NOCOLOR)");
  }
  if (!valid_config(config)) {
    return fail(ncclInvalidArgument, call, ": config not initialized with NCCL_CONFIG_INITIALIZER");
  }
  State& s = state();
  Lock lock(s.mutex);
  if (!is_live(parent)) return fail(ncclInvalidArgument, call, ": comm is not a communicator");
  std::string text;
  const ncclResult_t status = comm_state(parent, &text);
  if (status == ncclInProgress) return fail(ncclInvalidArgument, call, kNotReady);
  if (status != ncclSuccess) return fail(status, call, ": ", text);
  Clique& clique = *parent->clique;
  const uint64_t number = parent->splits++;
  std::shared_ptr<Join>& entry = clique.splits[number];
  if (!entry) {
    entry = std::make_shared<Join>();
    entry->split = true;
    entry->expected = clique.size;
  }
  std::shared_ptr<Join> join = entry;
  if (join->error != ncclSuccess) return fail(join->error, call, ": ", join->error_text);
  ncclComm* child = nullptr;
  if (color != NCCL_SPLIT_NOCOLOR) {
    child = new ncclComm;
    child->rank = parent->rank;
    child->device = parent->device;
    child->blocking = blocking_config(config, parent->blocking);
    child->joining = join;
    s.live.insert(child);
  }
  join->members[parent->rank] = {child, parent, color, key, parent->device};
  parent->splitting = join;
  *out = child;
  if (static_cast<int>(join->members.size()) == join->expected) {
    clique.splits.erase(number);
    complete_join(s, *join);
  }
  ncclComm* waited = child != nullptr ? child : parent;
  const bool blocking = blocking_config(config, parent->blocking);
  if (in_group()) {
    add_group_join(waited, blocking);
    return ncclSuccess;
  }
  if (blocking) return wait_joined(s, waited, lock);
  return parent->splitting ? ncclInProgress : ncclSuccess;
}

// NCCL's sentences for its results.
const char* result_text(ncclResult_t result) {
  static constexpr const char* kTexts[] = {
      "no error",
      "unhandled cuda error",
      "unhandled system error",
      "internal error - please report this issue to the NCCL developers",
      "invalid argument",
      "invalid usage",
      "remote process exited or there was a network error",
      "NCCL operation in progress"};
  return result >= 0 && result < ncclNumResults ? kTexts[result] : "unknown result code";
}

}  // namespace

State& state() {
  static State* instance = new State;  // outlives static destructors that free communicators
  return *instance;
}

std::string& last_error() {
  thread_local std::string text;
  return text;
}

bool is_live(const ncclComm* comm) { return comm != nullptr && state().live.count(comm) > 0; }

ncclResult_t comm_state(const ncclComm* comm, std::string* text) {
  if (comm->join_error != ncclSuccess) {
    *text = comm->join_error_text;
    return comm->join_error;
  }
  if (comm->joining) return ncclInProgress;
  if (comm->clique->error != ncclSuccess) {
    *text = comm->clique->error_text;
    return comm->clique->error;
  }
  return comm->splitting ? ncclInProgress : ncclSuccess;
}

void fail_clique(State& s, Clique& clique, ncclResult_t error, const std::string& text) {
  if (clique.error != ncclSuccess) return;
  clique.error = error;
  clique.error_text = text;
  for (auto& [number, join] : clique.splits) fail_join(s, *join, error, text);
  clique.splits.clear();
  clique.collectives.clear();
  clique.messages.clear();
}

ncclResult_t wait_joined(State& s, ncclComm* comm, Lock& lock) {
  s.joined.wait(lock, [&] { return !comm->joining && !comm->splitting; });
  std::string text;
  const ncclResult_t result = comm_state(comm, &text);
  return result == ncclSuccess ? result : fail(result, text);
}

}  // namespace dstrain::emu::nccl

using namespace dstrain::emu::nccl;

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) { return result_text(result); }

const char* ncclGetLastError(ncclComm_t) { return last_error().c_str(); }

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
  State& s = state();
  Lock lock(s.mutex);
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, kIdMagic, sizeof kIdMagic);
  const uint64_t number = s.next_id++;
  std::memcpy(id->internal + sizeof kIdMagic, &number, sizeof number);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
  return init_rank(comm, nranks, commId, rank, config);
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank(comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  return split(comm, color, key, newcomm, config);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (asyncError == nullptr) {
    return fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
  }
  State& s = state();
  std::vector<dstrain::emu::StreamMark> flush;
  {
    Lock lock(s.mutex);
    if (!is_live(comm)) {
      return fail(ncclInvalidArgument, "ncclCommGetAsyncError: comm is not a communicator");
    }
    std::string text;
    *asyncError = comm_state(comm, &text);
    if (*asyncError != ncclSuccess) {
      if (*asyncError != ncclInProgress) last_error() = text;
      return ncclSuccess;
    }
    if (!comm->finalizing) return ncclSuccess;
    for (const auto& [stream, mark] : comm->last_steps) flush.push_back(mark);
  }
  // Finalizing: in progress until the streams have run its work (this poll lets them progress,
  // as the GPU would by itself).
  for (const dstrain::emu::StreamMark& mark : flush) {
    if (!dstrain::emu::query_mark(mark)) *asyncError = ncclInProgress;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  return query(comm, count, "ncclCommCount", [](const ncclComm& c) { return c.clique->size; });
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  return query(comm, rank, "ncclCommUserRank", [](const ncclComm& c) { return c.rank; });
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  return query(comm, device, "ncclCommCuDevice", [](const ncclComm& c) { return c.device; });
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::vector<dstrain::emu::StreamMark> flush;
  {
    State& s = state();
    Lock lock(s.mutex);
    if (!is_live(comm)) {
      return fail(ncclInvalidArgument, "ncclCommFinalize: comm is not a communicator");
    }
    if (comm->finalizing) {
      return fail(ncclInvalidUsage, "ncclCommFinalize: the communicator is finalized already");
    }
    comm->finalizing = true;
    if (!comm->blocking) return ncclInProgress;
    for (const auto& [stream, mark] : comm->last_steps) flush.push_back(mark);
  }
  for (const dstrain::emu::StreamMark& mark : flush) dstrain::emu::synchronize_mark(mark);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  return remove_comm(comm, /*aborting=*/false, "ncclCommDestroy");
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  return remove_comm(comm, /*aborting=*/true, "ncclCommAbort");
}

}  // extern "C"
