// The CUDA emulator's NCCL calls (see emu_nccl.cpp for what is emulated): collectives and
// send/recv as stream-ordered steps -- "contribute" (this rank's input into the exchange shared
// with its peers) and a "finish" gated on every peer having contributed (this rank's output) --
// and ncclGroupStart/End, which queue the calls between them at the outermost End, every
// contribute step before any finish step.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda_emu/emu_blas.h"
#include "kernels/cuda_emu/emu_nccl.h"
#include "kernels/cuda_emu/emu_runtime.h"
#include "kernels/cuda_emu/emu_streams.h"

namespace dstrain::emu::nccl {
namespace {

// A call made between ncclGroupStart and ncclGroupEnd, queued at the outermost End.
struct GroupedCall {
  ncclComm* comm = nullptr;
  int device = 0;
  cudaStream_t stream = nullptr;
  std::function<void()> contribute, finish;
  std::function<bool()> ready;
};
struct Group {
  int depth = 0;
  std::vector<GroupedCall> calls;
  // Inits and splits started in the group: the communicator to wait for (a split's parent
  // for NCCL_SPLIT_NOCOLOR) and whether that is a blocking wait.
  std::vector<std::pair<ncclComm*, bool>> joins;
};
thread_local Group t_group;

const char* type_name(ncclDataType_t type) {
  static constexpr const char* kNames[] = {"ncclInt8",     "ncclUint8",      "ncclInt32",
                                           "ncclUint32",   "ncclInt64",      "ncclUint64",
                                           "ncclFloat16",  "ncclFloat32",    "ncclFloat64",
                                           "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2"};
  return type >= 0 && type < ncclNumTypes ? kNames[type] : "an unknown type";
}
size_t type_size(ncclDataType_t type) {
  static constexpr size_t kSizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
  return kSizes[type];
}
const char* op_name(int op) {
  static constexpr const char* kNames[] = {"ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"};
  return op >= 0 && op < ncclNumOps ? kNames[op] : "an unknown op";
}

std::string describe(const Signature& s) {
  std::ostringstream text;
  text << s.call << "(count " << s.count << ", " << type_name(s.type);
  if (s.op >= 0) text << ", " << op_name(s.op);
  if (s.root >= 0) text << ", root " << s.root;
  text << ")";
  return text.str();
}

// ---- the data of collectives ----

// The CUDA type of a floating-point NCCL type the emulator reduces.
cudaDataType cuda_type(ncclDataType_t type) {
  return type == ncclFloat16 ? CUDA_R_16F : type == ncclBfloat16 ? CUDA_R_16BF : CUDA_R_32F;
}

bool reducible(ncclDataType_t type) {
  return type == ncclFloat32 || type == ncclFloat16 || type == ncclBfloat16 || type == ncclInt32;
}

// out[i] = inputs[0][first + i] op inputs[1][first + i] op ..., in rank order, for i < count.
void reduce(const std::vector<std::vector<char>>& inputs, size_t first, size_t count,
            ncclDataType_t type, int op, char* out) {
  for (size_t i = first; i < first + count; ++i) {
    if (type == ncclInt32) {
      int32_t acc;
      std::memcpy(&acc, inputs[0].data() + 4 * i, 4);
      for (size_t r = 1; r < inputs.size(); ++r) {
        int32_t v;
        std::memcpy(&v, inputs[r].data() + 4 * i, 4);
        acc = op == ncclSum
                  ? static_cast<int32_t>(static_cast<uint32_t>(acc) + static_cast<uint32_t>(v))
                  : std::max(acc, v);
      }
      std::memcpy(out + 4 * (i - first), &acc, 4);
      continue;
    }
    const cudaDataType element = cuda_type(type);
    float acc = blas_load(inputs[0].data(), element, static_cast<int64_t>(i));
    for (size_t r = 1; r < inputs.size(); ++r) {
      const float v = blas_load(inputs[r].data(), element, static_cast<int64_t>(i));
      if (op == ncclSum) {
        acc = acc + v;
      } else if (std::isnan(v) || v > acc) {  // Max: a NaN wins, and stays
        acc = v;
      }
    }
    blas_store(out, element, static_cast<int64_t>(i - first), acc);
  }
}

// ---- issuing calls ----

// Sets the device of the calling thread for its scope (nullptr names the current device's
// legacy stream: NCCL queues on the communicator's).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

void queue(const std::vector<GroupedCall>& calls) {
  std::vector<StreamMark> finishes;
  for (const GroupedCall& call : calls) {
    DeviceScope scope(call.device);
    enqueue_work(call.stream, call.contribute);
  }
  for (const GroupedCall& call : calls) {
    DeviceScope scope(call.device);
    finishes.push_back(enqueue_work(call.stream, call.finish, call.ready));
  }
  State& s = state();
  Lock lock(s.mutex);
  for (size_t i = 0; i < calls.size(); ++i) {
    if (is_live(calls[i].comm)) calls[i].comm->last_steps[finishes[i].stream] = finishes[i];
  }
}

void issue(GroupedCall call) {
  if (t_group.depth > 0) {
    t_group.calls.push_back(std::move(call));
  } else {
    queue({std::move(call)});
  }
}

// The checks every collective and message shares; on success `lock` holds the state's mutex.
ncclResult_t begin_call(const char* call, const ncclComm* comm, size_t count, ncclDataType_t type,
                        cudaStream_t stream, Lock& lock) {
  // The stream engine first: it may not be asked with the state's mutex held.
  if (!is_stream(stream)) return fail(ncclInvalidArgument, call, ": invalid stream");
  lock = Lock(state().mutex);
  if (!is_live(comm)) {
    return fail(ncclInvalidArgument, call, ": comm ", static_cast<const void*>(comm),
                " is not a communicator (NULL, destroyed or aborted)");
  }
  std::string error;
  const ncclResult_t status = comm_state(comm, &error);
  if (status == ncclInProgress) return fail(ncclInvalidArgument, call, kNotReady);
  if (status != ncclSuccess) return fail(status, call, ": ", error);
  if (comm->finalizing) {
    return fail(ncclInvalidUsage, call, ": communicator used after ncclCommFinalize");
  }
  if (type < 0 || type >= ncclNumTypes) {
    return fail(ncclInvalidArgument, call, ": invalid data type ", static_cast<int>(type));
  }
  if (count > (size_t{1} << 40)) return fail(ncclInvalidArgument, call, ": invalid count ", count);
  return ncclSuccess;
}

ncclResult_t check_reduction(const char* call, ncclDataType_t type, ncclRedOp_t op) {
  if (op < 0 || op >= ncclNumOps) {
    return fail(ncclInvalidArgument, call, ": invalid reduction operation ", static_cast<int>(op));
  }
  if ((op != ncclSum && op != ncclMax) || !reducible(type)) {
    return fail(ncclInvalidArgument, call, ": ", op_name(op), " over ", type_name(type),
                ": the NCCL emulator reduces only ncclSum and ncclMax over ncclFloat32, "
                "ncclFloat16, ncclBfloat16 and ncclInt32");
  }
  return ncclSuccess;
}

// `bytes` at `buffer` must be device memory of the communicator's device (or pinned host
// memory, which the device can address).
ncclResult_t check_buffer(const char* call, const char* name, const void* buffer, size_t bytes,
                          const ncclComm* comm) {
  if (bytes == 0) return ncclSuccess;
  const int device = buffer == nullptr ? kNotAllocated : allocation_device(buffer, bytes);
  if (device == comm->device || device == kPinnedHost) return ncclSuccess;
  if (device >= 0) {
    return fail(ncclInvalidArgument, call, ": ", name, " ", buffer, " (", bytes,
                " bytes) is on device ", device, ", not the communicator's device ", comm->device);
  }
  return fail(ncclInvalidArgument, call, ": ", name, " ", buffer, " (", bytes,
              " bytes) is not device memory of device ", comm->device,
              " (host memory, freed memory, or past the end of its allocation)");
}

// Records this rank's arrival at `exchange`'s `slot` with `signature` (the contribute step of
// every call). False: the ranks disagree (the clique is failed, with a sentence naming both).
// REQUIRES: the state's mutex held.
bool arrive(State& s, Clique& clique, Exchange& exchange, int slot, const Signature& signature,
            const std::string& where) {
  if (exchange.first_slot < 0) {
    exchange.first_slot = slot;
    exchange.signature = signature;
  } else if (!(exchange.signature == signature)) {
    std::ostringstream text;
    text << "mismatched calls at " << where << " of a communicator of " << clique.size
         << " ranks: rank " << exchange.first_slot << " called " << describe(exchange.signature)
         << ", but rank " << slot << " called " << describe(signature);
    fail_clique(s, clique, ncclInvalidUsage, text.str());
    return false;
  }
  exchange.arrived[static_cast<size_t>(slot)] = true;
  ++exchange.arrivals;
  return true;
}

// The contribute step of a call: arrives at the exchange's `slot` and copies `bytes` of `send`
// there (the copy lets in-place calls overwrite their input before the peers have read it).
std::function<void()> contribute_step(std::shared_ptr<Clique> clique,
                                      std::shared_ptr<Exchange> exchange, int slot,
                                      Signature signature, std::string where, const void* send,
                                      size_t bytes) {
  return [=] {
    State& s = state();
    {
      Lock lock(s.mutex);
      if (clique->error != ncclSuccess) return;
      if (!arrive(s, *clique, *exchange, slot, signature, where)) return;
      const char* data = static_cast<const char*>(send);
      exchange->inputs[static_cast<size_t>(slot)].assign(data, data + bytes);
    }
    notify_progress();  // host threads waiting on gated steps look again
  };
}

enum class Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

// A collective: `count` is NCCL's (the per-rank count of reduce-scatter and all-gather).
ncclResult_t collective(Kind kind, const char* call, const void* send, void* recv, size_t count,
                        ncclDataType_t type, ncclRedOp_t op, int root, ncclComm* comm,
                        cudaStream_t stream) {
  Lock lock;
  ncclResult_t result = begin_call(call, comm, count, type, stream, lock);
  if (result != ncclSuccess) return result;
  const bool reduces = kind == Kind::kAllReduce || kind == Kind::kReduceScatter;
  if (reduces && (result = check_reduction(call, type, op)) != ncclSuccess) return result;
  std::shared_ptr<Clique> clique = comm->clique;
  const int size = clique->size, rank = comm->rank;
  if (kind == Kind::kBroadcast && (root < 0 || root >= size)) {
    return fail(ncclInvalidArgument, call, ": invalid root ", root, " (the communicator has ", size,
                " ranks)");
  }
  if (count == 0) return ncclSuccess;  // NCCL: nothing to do, nothing matched
  const size_t element = type_size(type);
  const size_t block = count * element;
  const size_t send_bytes = kind == Kind::kReduceScatter               ? block * size
                            : kind == Kind::kBroadcast && rank != root ? 0
                                                                       : block;
  const size_t recv_bytes = kind == Kind::kAllGather ? block * size : block;
  if ((result = check_buffer(call, "sendbuff", send, send_bytes, comm)) != ncclSuccess ||
      (result = check_buffer(call, "recvbuff", recv, recv_bytes, comm)) != ncclSuccess) {
    return result;
  }

  Signature signature;
  signature.call = call;
  signature.count = count;
  signature.type = type;
  signature.op = reduces ? op : -1;
  signature.root = kind == Kind::kBroadcast ? root : -1;
  const uint64_t number = comm->collectives++;
  std::shared_ptr<Exchange>& slot = clique->collectives[number];
  if (!slot) slot = std::make_shared<Exchange>(size);
  std::shared_ptr<Exchange> exchange = slot;
  if (++exchange->issued == size) clique->collectives.erase(number);
  const std::string where = "collective #" + std::to_string(number + 1);

  GroupedCall grouped;
  grouped.comm = comm;
  grouped.device = comm->device;
  grouped.stream = stream;
  grouped.contribute = contribute_step(clique, exchange, rank, signature, where, send, send_bytes);
  grouped.ready = [clique, exchange, size] {
    Lock lock(state().mutex);
    return clique->error != ncclSuccess || exchange->arrivals == size;
  };
  grouped.finish = [kind, clique, exchange, rank, root, recv, count, block, type, op, size] {
    Lock lock(state().mutex);
    if (clique->error != ncclSuccess) return;  // aborted or mismatched: writes nothing
    char* out = static_cast<char*>(recv);
    switch (kind) {
      case Kind::kAllReduce:
        reduce(exchange->inputs, 0, count, type, op, out);
        break;
      case Kind::kReduceScatter:
        reduce(exchange->inputs, static_cast<size_t>(rank) * count, count, type, op, out);
        break;
      case Kind::kAllGather:
        for (int r = 0; r < size; ++r) {
          std::memcpy(out + static_cast<size_t>(r) * block, exchange->inputs[r].data(), block);
        }
        break;
      case Kind::kBroadcast:
        std::memcpy(out, exchange->inputs[static_cast<size_t>(root)].data(), block);
        break;
    }
  };
  lock.unlock();
  issue(std::move(grouped));
  return ncclSuccess;
}

// A send (sending) or a receive: slot 0 of the message's exchange is the sender's.
ncclResult_t message(bool sending, const void* send, void* recv, size_t count, ncclDataType_t type,
                     int peer, ncclComm* comm, cudaStream_t stream) {
  const char* call = sending ? "ncclSend" : "ncclRecv";
  Lock lock;
  ncclResult_t result = begin_call(call, comm, count, type, stream, lock);
  if (result != ncclSuccess) return result;
  std::shared_ptr<Clique> clique = comm->clique;
  if (peer < 0 || peer >= clique->size) {
    return fail(ncclInvalidArgument, call, ": invalid peer ", peer, " (the communicator has ",
                clique->size, " ranks)");
  }
  if (count == 0) return ncclSuccess;
  const size_t bytes = count * type_size(type);
  if ((result = check_buffer(call, sending ? "sendbuff" : "recvbuff", sending ? send : recv, bytes,
                             comm)) != ncclSuccess) {
    return result;
  }
  const int rank = comm->rank;
  const int source = sending ? rank : peer, destination = sending ? peer : rank;
  const uint64_t number = sending ? comm->sends[peer]++ : comm->receives[peer]++;
  const auto key = std::make_tuple(source, destination, number);
  std::shared_ptr<Exchange>& slot = clique->messages[key];
  if (!slot) slot = std::make_shared<Exchange>(2);
  std::shared_ptr<Exchange> exchange = slot;
  if (++exchange->issued == 2) clique->messages.erase(key);

  Signature signature;
  signature.call = "ncclSend/ncclRecv";
  signature.count = count;
  signature.type = type;
  const std::string where = "message #" + std::to_string(number + 1) + " from rank " +
                            std::to_string(source) + " to rank " + std::to_string(destination);
  GroupedCall grouped;
  grouped.comm = comm;
  grouped.device = comm->device;
  grouped.stream = stream;
  grouped.contribute = contribute_step(clique, exchange, sending ? 0 : 1, signature, where, send,
                                       sending ? bytes : 0);
  // Both sides complete once both have arrived: a send blocks its stream until the receive is
  // posted (NCCL's rendezvous); its data is in the exchange by then.
  grouped.ready = [clique, exchange] {
    Lock lock(state().mutex);
    return clique->error != ncclSuccess || (exchange->arrived[0] && exchange->arrived[1]);
  };
  grouped.finish = [sending, clique, exchange, recv, bytes] {
    Lock lock(state().mutex);
    if (!sending && clique->error == ncclSuccess) {
      std::memcpy(recv, exchange->inputs[0].data(), bytes);
    }
  };
  lock.unlock();
  issue(std::move(grouped));
  return ncclSuccess;
}

}  // namespace

bool in_group() { return t_group.depth > 0; }
void add_group_join(ncclComm* comm, bool blocking) { t_group.joins.push_back({comm, blocking}); }

}  // namespace dstrain::emu::nccl

using namespace dstrain::emu::nccl;

extern "C" {

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(Kind::kAllReduce, "ncclAllReduce", sendbuff, recvbuff, count, datatype, op, -1,
                    comm, stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return collective(Kind::kReduceScatter, "ncclReduceScatter", sendbuff, recvbuff, recvcount,
                    datatype, op, -1, comm, stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return collective(Kind::kAllGather, "ncclAllGather", sendbuff, recvbuff, sendcount, datatype,
                    ncclSum, -1, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(Kind::kBroadcast, "ncclBroadcast", sendbuff, recvbuff, count, datatype, ncclSum,
                    root, comm, stream);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return message(true, sendbuff, nullptr, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return message(false, nullptr, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++t_group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group.depth == 0) {
    return fail(ncclInvalidUsage, "ncclGroupEnd: not inside ncclGroupStart/ncclGroupEnd");
  }
  if (--t_group.depth > 0) return ncclSuccess;
  std::vector<GroupedCall> calls = std::move(t_group.calls);
  std::vector<std::pair<ncclComm*, bool>> joins = std::move(t_group.joins);
  t_group.calls.clear();
  t_group.joins.clear();
  queue(calls);
  // The inits and splits of the group: blocking ones are waited for here.
  State& s = state();
  Lock lock(s.mutex);
  ncclResult_t result = ncclSuccess;
  for (const auto& [comm, blocking] : joins) {
    if (!is_live(comm)) continue;
    if (blocking) {
      const ncclResult_t joined = wait_joined(s, comm, lock);
      if (joined != ncclSuccess && result == ncclSuccess) result = joined;
    } else if (comm->joining || comm->splitting) {
      if (result == ncclSuccess) result = ncclInProgress;
    }
  }
  return result;
}

}  // extern "C"
