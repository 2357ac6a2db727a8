// The CUDA emulator's execution engine: runs a kernel's grid on the calling host thread, one
// block at a time, every GPU thread of the block as a fiber (Boost.Context). A fiber runs until
// it reaches a synchronization point (__syncthreads, a warp shuffle or vote, __syncwarp) and
// waits there until every thread that must take part has arrived, as on the GPU.
//
// What this is for: the kernels of kernels/cuda/ compiled as host C++ (emu_device.h) run in CI
// on machines without a GPU, against the same tests as on a GPU. It checks a kernel's indexing,
// arithmetic, shared-memory use and barrier structure: a barrier some threads never reach, a
// shuffle whose partner lane has exited, or a launch the smallest release GPU could not run
// (threads, grid, shared memory) is reported as an error naming the kernel. It does not model
// timing, memory coalescing, or races between threads that a schedule of whole fibers hides.
#pragma once

#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace dstrain::emu {

// Limits the emulator enforces at launch: those of the smallest release architecture (sm_86 /
// sm_89: 99 KiB of opt-in dynamic shared memory per block), so a launch that passes here runs
// on every GPU dstrain is built for.
constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr size_t kOptinSharedBytes = 99 * 1024;
constexpr unsigned kMaxGridY = 65535, kMaxGridZ = 65535;

// The per-GPU-thread and per-block state a kernel reads through threadIdx, blockIdx, ...
struct ThreadIndex {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadIndex& current();

// Dynamic shared memory of the running block (the launch's shared_bytes).
void* dynamic_shared();

// __syncthreads(): waits for every live thread of the block.
void sync_block();
// __syncwarp(mask)
void sync_warp(unsigned mask);

// Exchange within a warp: every lane of `mask` offers `value` (up to 8 bytes) and receives the
// value of lane `source(lane)`; `vote` also returns the OR (bit 0) and AND (bit 1) of the
// lanes' (value != 0). One implementation for shuffles and votes.
enum class ShuffleKind { kIndex, kXor, kDown, kUp };
uint64_t shuffle(unsigned mask, uint64_t value, ShuffleKind kind, int operand, int width);
unsigned ballot(unsigned mask, bool predicate);

// A .sync.aligned warp instruction (mma, ldmatrix; emu_ptx.cpp): every lane of the full warp
// arrives with a pointer to its own operands, and the last to arrive calls
// complete(lane_data), lane_data[l] being lane l's pointer, while the others wait inside this
// call (so every pointer is live). A lane that exited, a partial warp, or lanes waiting in
// another warp operation (another `complete`, a shuffle) is an error naming `what`.
using WarpComplete = void (*)(void* const lane_data[32]);
void warp_collective(void* lane_data, WarpComplete complete, const char* what);

// The calling GPU thread's cp.async copies not yet performed (emu_ptx.h).
struct AsyncCopies;
AsyncCopies& async_copies();

// A kernel launch: checks the configuration (an invalid one sets the sticky launch error that
// cudaGetLastError returns, as CUDA does) and runs `body` once per GPU thread of the grid.
// The grid runs when the stream reaches it (see enqueue below): `body` owns copies of the
// arguments.
void launch(const void* kernel, const char* name, dim3 grid, dim3 block, size_t shared_bytes,
            cudaStream_t stream, std::function<void()> body);

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes).
cudaError_t set_max_dynamic_shared(const void* kernel, int bytes);

// The runtime's error state (emu_cuda_api.cpp): sticky per host thread, like the runtime's
// last error.
void set_last_error(cudaError_t error);

// Where [pointer, pointer + bytes) lies (emu_cuda_api.cpp): inside one device allocation (its
// device), inside one pinned host allocation (kPinnedHost), or neither (kNotAllocated: pageable
// memory, freed memory, or a range running past the end of its allocation). For the emulated
// libraries' argument checks (emu_nccl_calls.cpp).
constexpr int kPinnedHost = -1, kNotAllocated = -2;
int allocation_device(const void* pointer, size_t bytes);

// What the calling host thread has asked of the emulated GPUs so far: kernel launches, and host
// waits (a stream, event or device synchronization, or a copy into pageable memory, which
// returns once it has landed); while record_grids is set, each launch's grid too. For tests that
// count how often an op stops the host, or check which tiling an op's kernels were launched with.
struct HostCounters {
  uint64_t kernel_launches = 0;
  uint64_t host_waits = 0;
  bool record_grids = false;
  std::vector<dim3> grids;  // in launch order, while record_grids
};
HostCounters& this_thread_counters();

// ---- stream-ordered work (emu_streams.cpp) ----
// Queues `work` on `stream` (nullptr or cudaStreamLegacy: the calling thread's device's legacy
// stream). Work runs lazily -- when the host waits for it (cudaStreamSynchronize, an event, a
// synchronous copy...) or for later work of another stream that depends on it -- so a missing
// wait between two streams, or a host read of memory an async copy has not written yet, shows
// up as wrong data, as it can on a GPU. `ready` (optional) gates the work: it runs only once
// ready() returns true (e.g. an emulated NCCL collective waiting for its peers); call
// notify_progress() when something a ready() reads may have changed.
// `work` runs with the emulator's stream lock held, on whichever host thread forces it: it must
// not call the emulated CUDA API itself. An exception it throws reaches that host call.
void enqueue(cudaStream_t stream, std::function<void()> work, std::function<bool()> ready = {});
void notify_progress();

// `kernel<<<grid, block, shared, stream>>>(args...)` as an object: Launch(...)(args...).
template <class... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), const char* name, dim3 grid, dim3 block, size_t shared_bytes,
         cudaStream_t stream)
      : kernel_(kernel),
        name_(name),
        grid_(grid),
        block_(block),
        shared_(shared_bytes),
        stream_(stream) {}

  template <class... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "kernel launch: wrong argument count");
    // The launch keeps a copy of the arguments (the kernel may run later), and each GPU thread
    // gets its own copy of those, as on the GPU.
    std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    auto kernel = kernel_;
    launch(reinterpret_cast<const void*>(kernel), name_, grid_, block_, shared_, stream_,
           [kernel, params = std::move(params)] { std::apply(kernel, params); });
  }

 private:
  void (*kernel_)(Params...);
  const char* name_;
  dim3 grid_, block_;
  size_t shared_;
  cudaStream_t stream_;
};

}  // namespace dstrain::emu
