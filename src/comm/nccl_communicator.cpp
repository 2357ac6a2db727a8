// The NCCL communicator (see nccl_communicator.h). Everything NCCL-specific is inside
// DSTRAIN_WITH_NCCL: a build without NCCL compiles only the two stubs at the bottom.
//
// Every communicator is created non-blocking (ncclConfig_t::blocking = 0): NCCL calls return
// at once (ncclSuccess or ncclInProgress) and the state is polled with ncclCommGetAsyncError.
// That lets a waiting rank notice another rank's failure or its own timeout and abort, instead
// of blocking inside NCCL forever.
#include "comm/nccl_communicator.h"

#include "core/check.h"

#ifdef DSTRAIN_WITH_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/rank_threads.h"
#include "kernels/cuda/cuda_check.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void raise_nccl_error(ncclResult_t result, const char* statement, const char* file,
                                   int line, const std::string& operation) {
  std::ostringstream text;
  text << "NCCL error " << ncclGetErrorString(result);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') text << " (" << last << ")";
  text << " in " << operation << ": `" << statement << "` at " << file << ":" << line << " ["
       << cuda::where_running() << "]";
  throw Error(text.str());
}

}  // namespace
}  // namespace dstrain

// The NCCL member of the check family: `operation` names what the rank was doing
// ("all_reduce #3 on group 'world'"); the device and rank come from where_running().
// ncclInProgress is not an error: non-blocking communicators return it while work is pending.
#define NCCL_CHECK(expr, operation)                                                            \
  do {                                                                                         \
    const ncclResult_t dstrain_nccl_status_ = (expr);                                          \
    if (dstrain_nccl_status_ != ncclSuccess && dstrain_nccl_status_ != ncclInProgress)         \
      ::dstrain::raise_nccl_error(dstrain_nccl_status_, #expr, __FILE__, __LINE__, operation); \
  } while (0)

namespace dstrain {
namespace {

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return ncclFloat32;
    case DType::F16:
      return ncclFloat16;
    case DType::BF16:
      return ncclBfloat16;
    case DType::I32:
      return ncclInt32;
    case DType::F8E4M3:
    case DType::F8E5M2:
      break;  // never communicated
  }
  DSTRAIN_CHECK(false) << "no NCCL type for dtype " << dtype_name(dtype);
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// What the rank threads of one run_nccl_ranks share: the first failure and its owner.
struct NcclWorld {
  NcclWorld(int size_, double timeout_seconds_) : size(size_), timeout_seconds(timeout_seconds_) {}
  const int size;
  const double timeout_seconds;
  std::atomic<bool> aborted{false};  // polled by waiting ranks without the mutex

  // Records the root cause unless there is one already.
  void record_failure(int rank, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex);
    if (aborted.load()) return;
    failed_rank = rank;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      failure_message = e.what();
    } catch (...) {
      failure_message = "an exception that is not a std::exception";
    }
    root_error = std::move(error);
    aborted.store(true);
  }
  [[noreturn]] void throw_aborted(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    const std::string who = failed_rank >= 0 ? "rank " + std::to_string(failed_rank)
                                             : std::string("the launcher of the ranks");
    throw Error(what + " aborted: " + who + " failed: " + failure_message);
  }
  Clock::time_point deadline_from_now() const {
    if (!(timeout_seconds < 1e9)) return Clock::time_point::max();
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(timeout_seconds));
  }

  std::mutex mutex;
  int failed_rank = -1;
  std::string failure_message;
  std::exception_ptr root_error;
};

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (possibly still initializing: call wait_ready before use).
  NcclCommunicator(std::shared_ptr<NcclWorld> world, ncclComm_t comm, int device, std::string name)
      : world_(std::move(world)), comm_(comm), device_(device), name_(std::move(name)) {}

  ~NcclCommunicator() override { release(); }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Waits for the communicator's initialization (or split) to finish, then learns its rank
  // and size.
  void wait_ready(const std::string& what) {
    wait(nullptr, /*query_stream=*/false, what);
    NCCL_CHECK(ncclCommUserRank(comm_, &rank_), what);
    NCCL_CHECK(ncclCommCount(comm_, &size_), what);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(Tensor buffer, ReduceOp op, Stream stream) override {
    const std::string what = enter("all_reduce");
    if (buffer.numel() == 0) return;
    const cudaStream_t s = to_stream(stream);
    Staging staging(*this, s, what, {buffer});
    void* data = staging.in(buffer, /*copy_in=*/true);
    NCCL_CHECK(ncclAllReduce(data, data, static_cast<size_t>(buffer.numel()),
                             nccl_dtype(buffer.dtype), nccl_op(op), comm_, s),
               what);
    wait(s, true, what);
    staging.out(buffer, data);
  }

  void reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream stream) override {
    const std::string what = enter("reduce_scatter");
    DSTRAIN_CHECK(input.dtype == output.dtype && input.numel() == output.numel() * size_)
        << what << ": input " << input.shape_str() << " must hold size (" << size_ << ") * output "
        << output.shape_str() << " elements of the same dtype";
    if (output.numel() == 0) return;
    const cudaStream_t s = to_stream(stream);
    Staging staging(*this, s, what, {input, output});
    const void* send = staging.in(input, true);
    void* recv = staging.in(output, false);
    NCCL_CHECK(ncclReduceScatter(send, recv, static_cast<size_t>(output.numel()),
                                 nccl_dtype(output.dtype), nccl_op(op), comm_, s),
               what);
    wait(s, true, what);
    staging.out(output, recv);
  }

  void all_gather(Tensor output, Tensor input, Stream stream) override {
    const std::string what = enter("all_gather");
    DSTRAIN_CHECK(input.dtype == output.dtype && output.numel() == input.numel() * size_)
        << what << ": output " << output.shape_str() << " must hold size (" << size_ << ") * input "
        << input.shape_str() << " elements of the same dtype";
    const int64_t n = input.numel();
    if (n == 0) return;
    const cudaStream_t s = to_stream(stream);
    const size_t slice = static_cast<size_t>(n) * rank_ * dtype_size(input.dtype);
    const bool in_place =
        input.device == output.device && input.data == static_cast<char*>(output.data) + slice;
    Staging staging(*this, s, what, {output, in_place ? Tensor() : input});
    void* recv = staging.in(output, false);
    const void* send = nullptr;
    if (in_place) {
      // NCCL's in-place form: the send buffer is the receive buffer's own slice.
      send = static_cast<char*>(recv) + slice;
      if (recv != output.data)
        staging.copy(static_cast<char*>(recv) + slice, input.data, input.nbytes());
    } else {
      send = staging.in(input, true);
    }
    NCCL_CHECK(ncclAllGather(send, recv, static_cast<size_t>(n), nccl_dtype(input.dtype), comm_, s),
               what);
    wait(s, true, what);
    staging.out(output, recv);
  }

  void broadcast(Tensor buffer, int root, Stream stream) override {
    const std::string what = enter("broadcast");
    DSTRAIN_CHECK(root >= 0 && root < size_)
        << what << ": root " << root << " is not a rank of a group of " << size_;
    if (buffer.numel() == 0) return;
    const cudaStream_t s = to_stream(stream);
    Staging staging(*this, s, what, {buffer});
    void* data = staging.in(buffer, /*copy_in=*/rank_ == root);
    NCCL_CHECK(ncclBroadcast(data, data, static_cast<size_t>(buffer.numel()),
                             nccl_dtype(buffer.dtype), root, comm_, s),
               what);
    wait(s, true, what);
    if (rank_ != root) staging.out(buffer, data);
  }

  void send(Tensor buffer, int peer, Stream stream) override {
    const std::string what = enter("send");
    check_peer(peer, what);
    if (buffer.numel() == 0) return;
    const cudaStream_t s = to_stream(stream);
    Staging staging(*this, s, what, {buffer});
    const void* data = staging.in(buffer, true);
    NCCL_CHECK(ncclSend(data, static_cast<size_t>(buffer.numel()), nccl_dtype(buffer.dtype), peer,
                        comm_, s),
               what);
    wait(s, true, what);
  }

  void recv(Tensor buffer, int peer, Stream stream) override {
    const std::string what = enter("recv");
    check_peer(peer, what);
    if (buffer.numel() == 0) return;
    const cudaStream_t s = to_stream(stream);
    Staging staging(*this, s, what, {buffer});
    void* data = staging.in(buffer, false);
    NCCL_CHECK(ncclRecv(data, static_cast<size_t>(buffer.numel()), nccl_dtype(buffer.dtype), peer,
                        comm_, s),
               what);
    wait(s, true, what);
    staging.out(buffer, data);
  }

  void exchange(const std::vector<P2POp>& ops, Stream stream) override {
    const std::string what = enter("exchange");
    std::vector<Tensor> buffers;  // those with elements: NCCL moves nothing for the others
    for (const P2POp& op : ops) {
      check_peer(op.peer, what);
      if (op.buffer.numel() > 0) buffers.push_back(op.buffer);
    }
    if (buffers.empty()) return;
    const cudaStream_t s = to_stream(stream);
    Staging staging(*this, s, what, buffers);
    std::vector<void*> data(ops.size(), nullptr);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].buffer.numel() > 0) {
        data[i] = staging.in(ops[i].buffer, /*copy_in=*/ops[i].kind == P2POp::Kind::Send);
      }
    }
    issue_group(ops, data, s, what);
    wait(s, true, what);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (data[i] != nullptr && ops[i].kind == P2POp::Kind::Recv) {
        staging.out(ops[i].buffer, data[i]);
      }
    }
  }

  void barrier() override {
    const std::string what = enter("barrier");
    // NCCL has no barrier: a one-element all-reduce every rank must join.
    void* word = device_scratch(sizeof(float), nullptr, what);
    CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(float), nullptr));
    NCCL_CHECK(ncclAllReduce(word, word, 1, ncclFloat32, ncclSum, comm_, nullptr), what);
    wait(nullptr, true, what);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const std::string what = enter("split");
    const int split_number = splits_++;
    ncclConfig_t config = nonblocking_config();
    ncclComm_t child = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config),
               what);
    wait(nullptr, false, what);  // the parent is usable again
    if (child == nullptr) return nullptr;
    auto communicator = std::make_unique<NcclCommunicator>(
        world_, child, device_,
        name_ + "/split" + std::to_string(split_number) + "[color " + std::to_string(color) + "]");
    communicator->wait_ready(what);
    return communicator;
  }

 protected:
  // all_to_all (the default, through exchange): the own part by a copy on the stream, device
  // or host memory alike (unified addressing).
  void copy_own_part(Tensor dst, Tensor src, Stream stream) override {
    enter("all_to_all's own part");
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDefault,
                               to_stream(stream)));
  }

 private:
  static cudaStream_t to_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }

  // Starts an operation: makes the communicator's GPU current on this thread (the legacy
  // stream and the scratch buffer are per device) and returns its label for messages.
  std::string enter(const char* op) {
    std::string what =
        std::string(op) + " #" + std::to_string(++calls_) + " on group '" + name_ + "'";
    int current = -1;
    CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_) CUDA_CHECK(cudaSetDevice(device_));
    return what;
  }

  // The sends and receives of an exchange as one NCCL group: NCCL starts them together, so
  // two neighbours each sending to the other do not wait for each other's receive.
  void issue_group(const std::vector<P2POp>& ops, const std::vector<void*>& data, cudaStream_t s,
                   const std::string& what) {
    NCCL_CHECK(ncclGroupStart(), what);
    try {
      for (size_t i = 0; i < ops.size(); ++i) {
        if (data[i] == nullptr) continue;
        const Tensor& buffer = ops[i].buffer;
        const size_t count = static_cast<size_t>(buffer.numel());
        if (ops[i].kind == P2POp::Kind::Send) {
          NCCL_CHECK(ncclSend(data[i], count, nccl_dtype(buffer.dtype), ops[i].peer, comm_, s),
                     what);
        } else {
          NCCL_CHECK(ncclRecv(data[i], count, nccl_dtype(buffer.dtype), ops[i].peer, comm_, s),
                     what);
        }
      }
    } catch (...) {
      ncclGroupEnd();  // this thread's group must be closed, whatever it reports now
      throw;
    }
    NCCL_CHECK(ncclGroupEnd(), what);
  }

  void check_peer(int peer, const std::string& what) const {
    DSTRAIN_CHECK(peer >= 0 && peer < size_ && peer != rank_)
        << what << ": peer " << peer << " is not another rank of a group of " << size_;
  }

  // A device buffer of at least `bytes` for staged host tensors (grown, never shrunk).
  void* device_scratch(size_t bytes, cudaStream_t stream, const std::string& what) {
    if (bytes > scratch_bytes_) {
      if (scratch_ != nullptr) {
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaFree(scratch_));
        scratch_ = nullptr;
        scratch_bytes_ = 0;
      }
      const size_t rounded = (bytes + 255) / 256 * 256;
      CUDA_CHECK(cudaMalloc(&scratch_, rounded));
      scratch_bytes_ = rounded;
    }
    return scratch_;
  }

  // The device pointers of one call: a tensor on this rank's GPU is used as it is; a host
  // tensor gets a region of the scratch buffer (copied down when asked, and back by out()).
  class Staging {
   public:
    // `tensors`: those of the call that in() will be asked for.
    Staging(NcclCommunicator& owner, cudaStream_t stream, const std::string& what,
            const std::vector<Tensor>& tensors)
        : owner_(owner), stream_(stream), what_(what) {
      size_t total = 0;
      for (const Tensor& t : tensors) {
        if (!t.device.is_cuda()) total += aligned(t.nbytes());
      }
      if (total > 0) base_ = static_cast<char*>(owner_.device_scratch(total, stream_, what_));
    }

    void* in(const Tensor& t, bool copy_in) {
      if (t.device.is_cuda()) {
        DSTRAIN_CHECK(t.device.index == owner_.device_)
            << what_ << ": a tensor " << t.shape_str() << " on " << t.device.str()
            << " given to the NCCL communicator of cuda:" << owner_.device_;
        return t.data;
      }
      DSTRAIN_CHECK(t.data != nullptr && base_ != nullptr)
          << what_ << ": host tensor " << t.shape_str() << " without data or staging";
      void* device = base_ + used_;
      used_ += aligned(t.nbytes());
      if (copy_in) copy(device, t.data, t.nbytes());
      return device;
    }
    // Copies a staged result back to its host tensor and waits for it.
    void out(const Tensor& t, const void* device) {
      if (device == t.data) return;
      copy(t.data, device, t.nbytes());
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    void copy(void* dst, const void* src, size_t bytes) {
      CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    }

   private:
    static size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }
    NcclCommunicator& owner_;
    cudaStream_t stream_;
    const std::string& what_;
    char* base_ = nullptr;
    size_t used_ = 0;
  };

  // Polls until NCCL has no work pending on the communicator and (query_stream) `stream` has
  // drained. Aborts the communicator and throws on an NCCL error, another rank's failure, or
  // the timeout.
  void wait(cudaStream_t stream, bool query_stream, const std::string& what) {
    const Clock::time_point deadline = world_->deadline_from_now();
    for (int polls = 0;; ++polls) {
      ncclResult_t state = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(comm_, &state), what);
      if (state != ncclSuccess && state != ncclInProgress) {
        abort_comm();
        NCCL_CHECK(state, what + " (asynchronous error)");
      }
      bool done = state == ncclSuccess;
      if (done && query_stream) {
        const cudaError_t query = cudaStreamQuery(stream);
        if (query == cudaErrorNotReady) {
          done = false;
        } else {
          CUDA_CHECK(query);
        }
      }
      if (done) return;
      if (world_->aborted.load()) {
        abort_comm();
        world_->throw_aborted(what);
      }
      if (Clock::now() >= deadline) {
        abort_comm();
        std::ostringstream text;
        text << what << " timed out: rank " << rank_ << " waited " << world_->timeout_seconds
             << " s for the other ranks of group '" << name_ << "' (or for the work queued "
             << "before it on the stream) [" << cuda::where_running() << "]";
        throw Error(text.str());
      }
      // Spin briefly (most collectives finish in microseconds), then back off.
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  void abort_comm() {
    if (comm_ != nullptr && !aborted_) {
      ncclCommAbort(comm_);  // releases the kernels waiting on other ranks
      comm_ = nullptr;
      aborted_ = true;
    }
  }

  // Best effort, never throws (a destructor): finalize and destroy when all went well, abort
  // when this or another rank failed or an exception is unwinding through the owner.
  void release() noexcept {
    if (comm_ != nullptr) {
      const bool failing = world_->aborted.load() || std::uncaught_exceptions() > 0;
      bool finalized = false;
      const ncclResult_t started = failing ? ncclInternalError : ncclCommFinalize(comm_);
      if (started == ncclSuccess || started == ncclInProgress) {
        const Clock::time_point deadline = world_->deadline_from_now();
        for (;;) {
          ncclResult_t state = ncclSuccess;
          if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
          if (state == ncclSuccess) {
            finalized = true;
            break;
          }
          if (state != ncclInProgress || world_->aborted.load() || Clock::now() >= deadline) {
            break;
          }
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    if (scratch_ != nullptr) {
      cudaFree(scratch_);
      scratch_ = nullptr;
    }
    cudaGetLastError();
  }

  std::shared_ptr<NcclWorld> world_;
  ncclComm_t comm_ = nullptr;
  const int device_;
  const std::string name_;  // "world", "world/split0[color 1]"
  int rank_ = -1, size_ = 0;
  uint64_t calls_ = 0;
  int splits_ = 0;
  bool aborted_ = false;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

void run_nccl_rank(const std::shared_ptr<NcclWorld>& world, const ncclUniqueId& id, int rank,
                   int device, const std::function<void(Communicator&)>& fn) {
  thread_error_context().rank = rank;
  thread_error_context().device = "cuda:" + std::to_string(device);
  std::unique_ptr<NcclCommunicator> communicator;
  try {
    CUDA_CHECK(cudaSetDevice(device));
    const std::string what = "ncclCommInitRank of rank " + std::to_string(rank);
    ncclConfig_t config = nonblocking_config();
    ncclComm_t comm = nullptr;
    NCCL_CHECK(ncclCommInitRankConfig(&comm, world->size, id, rank, &config), what);
    communicator = std::make_unique<NcclCommunicator>(world, comm, rank, "world");
    communicator->wait_ready(what);
    fn(*communicator);
  } catch (...) {
    world->record_failure(rank, std::current_exception());
  }
  // After the failure is recorded: a failed run aborts the communicator instead of
  // finalizing it (which would wait for the ranks that are gone).
  communicator.reset();
}

int usable_gpus() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  return devices;
}

// Runs this process's ranks (first_rank + i on GPU i) and rethrows the first failure.
void run_local_nccl_ranks(const NcclNodeRanks& ranks, const ncclUniqueId& id,
                          double timeout_seconds, const std::function<void(Communicator&)>& fn) {
  auto world = std::make_shared<NcclWorld>(ranks.world_size, timeout_seconds);
  comm_detail::run_rank_threads(
      ranks.local_ranks,
      [&](int local) {
        run_nccl_rank(world, id, ranks.first_rank + local, ranks.first_device + local, fn);
      },
      // Could not start every rank: the started ones wait in ncclCommInitRank for the missing
      // ones, see the recorded failure there and abort.
      [&](std::exception_ptr error) { world->record_failure(-1, std::move(error)); });
  if (world->root_error) std::rethrow_exception(world->root_error);
}

}  // namespace

bool nccl_available() { return true; }

void run_nccl_ranks(int world_size, double timeout_seconds,
                    const std::function<void(Communicator&)>& fn) {
  DSTRAIN_USER_CHECK(world_size >= 1)
      << "the number of NCCL ranks must be at least 1 (got " << world_size << ")";
  DSTRAIN_USER_CHECK(timeout_seconds > 0)
      << "the collective timeout must be positive (got " << timeout_seconds << " s)";
  const int devices = usable_gpus();
  DSTRAIN_USER_CHECK(world_size <= devices) << "NCCL needs one GPU per rank: " << world_size
                                            << " ranks, but " << devices << " GPUs are usable here";
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id), std::string("ncclGetUniqueId"));
  run_local_nccl_ranks(NcclNodeRanks{0, world_size, world_size, {}, 0}, id, timeout_seconds, fn);
}

std::string nccl_unique_id() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id), std::string("ncclGetUniqueId"));
  return std::string(id.internal, sizeof id.internal);
}

void run_nccl_node_ranks(const NcclNodeRanks& ranks, double timeout_seconds,
                         const std::function<void(Communicator&)>& fn) {
  DSTRAIN_CHECK(ranks.first_rank >= 0 && ranks.local_ranks >= 1 &&
                ranks.first_rank + ranks.local_ranks <= ranks.world_size)
      << "run_nccl_node_ranks: ranks " << ranks.first_rank << " + " << ranks.local_ranks
      << " of " << ranks.world_size;
  DSTRAIN_CHECK(timeout_seconds > 0) << "timeout " << timeout_seconds;
  const int devices = usable_gpus();
  DSTRAIN_USER_CHECK(ranks.first_device >= 0 && ranks.first_device + ranks.local_ranks <= devices)
      << "NCCL needs one GPU per rank: " << ranks.local_ranks << " ranks on this node"
      << (ranks.first_device > 0 ? " from GPU " + std::to_string(ranks.first_device) : "")
      << ", but " << devices << " GPUs are usable here";
  ncclUniqueId id;
  DSTRAIN_CHECK(ranks.unique_id.size() == sizeof id.internal)
      << "an ncclUniqueId of " << ranks.unique_id.size() << " bytes";
  std::memcpy(id.internal, ranks.unique_id.data(), sizeof id.internal);
  run_local_nccl_ranks(ranks, id, timeout_seconds, fn);
}

}  // namespace dstrain

#else  // no NCCL in this build

namespace dstrain {

bool nccl_available() { return false; }

void run_nccl_ranks(int, double, const std::function<void(Communicator&)>&) {
  DSTRAIN_CHECK(false) << "this build has no NCCL (it needs the CUDA toolkit with NCCL)";
}

std::string nccl_unique_id() {
  DSTRAIN_CHECK(false) << "this build has no NCCL (it needs the CUDA toolkit with NCCL)";
  return {};
}

void run_nccl_node_ranks(const NcclNodeRanks&, double, const std::function<void(Communicator&)>&) {
  DSTRAIN_CHECK(false) << "this build has no NCCL (it needs the CUDA toolkit with NCCL)";
}

}  // namespace dstrain

#endif
