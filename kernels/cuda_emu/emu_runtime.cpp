// The emulator's engine (see emu_runtime.h): blocks in order on the calling thread, each GPU
// thread a fiber with its own stack, a cooperative scheduler that resumes a fiber only when the
// barrier it waits on has opened.
#include "kernels/cuda_emu/emu_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "kernels/cuda_emu/emu_ptx.h"

namespace dstrain::emu {

namespace bctx = boost::context;

namespace {

// Enough for the kernels' register arrays (attention keeps 2 x 8 x 8 floats per lane) with a
// wide margin; a guard page below each stack turns an overflow into a fault, not corruption.
constexpr size_t kStackBytes = 256 * 1024;

// Stacks are mapped once per host thread and reused by every later block: creating a fiber
// then costs no system call.
class StackPool {
 public:
  ~StackPool() {
    for (void* base : mapped_) munmap(base, kStackBytes + page_);
  }
  bctx::stack_context allocate() {
    void* base;
    if (!free_.empty()) {
      base = free_.back();
      free_.pop_back();
    } else {
      base = mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (base == MAP_FAILED) throw std::bad_alloc();
      mprotect(base, page_, PROT_NONE);  // the guard page: stacks grow down into it
      mapped_.push_back(base);
    }
    bctx::stack_context stack;
    stack.size = kStackBytes;
    stack.sp = static_cast<char*>(base) + page_ + kStackBytes;
    return stack;
  }
  void deallocate(bctx::stack_context& stack) {
    free_.push_back(static_cast<char*>(stack.sp) - kStackBytes - page_);
  }

 private:
  const size_t page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<void*> free_, mapped_;
};
thread_local StackPool t_stacks;

struct PooledStack {  // Boost.Context's StackAllocator
  bctx::stack_context allocate() { return t_stacks.allocate(); }
  void deallocate(bctx::stack_context& stack) noexcept { t_stacks.deallocate(stack); }
};

enum class Wait { kNone, kBlock, kWarp };

struct Lane {
  ThreadIndex index;
  int lane = 0, warp = 0;
  bctx::fiber fiber;  // this thread's context while it is suspended
  bctx::fiber sink;   // the scheduler's context while this thread runs
  bool done = false;
  Wait wait = Wait::kNone;
  uint64_t wait_generation = 0;
  std::exception_ptr error;
  AsyncCopies async_copies;  // cp.async issued and not yet waited for
};

struct WarpState {
  unsigned live_mask = 0;     // lanes that exist and have not exited
  unsigned arrived_mask = 0;  // lanes waiting in the exchange in progress
  unsigned pending_mask = 0;  // that exchange's mask
  // That exchange's operation: a .sync.aligned collective's completion (nullptr for shuffles,
  // votes and __syncwarp), and its name for errors.
  WarpComplete pending_complete = nullptr;
  const char* pending_what = "";
  uint64_t generation = 0;
  // Exchange g writes slots[g & 1]: a lane can only write exchange g + 2 after every lane
  // arrived at g + 1, that is after every lane read g.
  uint64_t slots[2][32] = {};
};

struct Block {
  const char* kernel = "";
  std::vector<Lane> lanes;
  std::vector<WarpState> warps;
  int live = 0;
  int arrived = 0;  // at __syncthreads
  uint64_t generation = 0;
  void* dynamic_shared = nullptr;
  uint3 block_idx{};
};

thread_local Block* t_block = nullptr;
thread_local Lane* t_lane = nullptr;

// Dynamic shared memory of this host thread's running block; filled with 0xFF (NaN as fp32)
// at each block start so a read before any write shows up in the results.
thread_local std::unique_ptr<std::max_align_t[]> t_shared;
thread_local size_t t_shared_bytes = 0;

std::mutex g_attributes_mutex;
std::map<const void*, int> g_max_dynamic_shared;  // kernel -> opted-in bytes

std::string where(const Block& block, const Lane* lane) {
  std::ostringstream out;
  out << "CUDA emulator: kernel " << block.kernel << ", block (" << block.block_idx.x << ","
      << block.block_idx.y << "," << block.block_idx.z << ")";
  if (lane) {
    out << ", thread (" << lane->index.thread_idx.x << "," << lane->index.thread_idx.y << ","
        << lane->index.thread_idx.z << ")";
  }
  return out.str();
}

Lane& this_lane(const char* what) {
  DSTRAIN_CHECK(t_lane != nullptr)
      << "CUDA emulator: " << what << " used outside a kernel (host code)";
  return *t_lane;
}

// Suspends the running GPU thread; the scheduler resumes it once its barrier has opened.
void yield() {
  Lane& lane = *t_lane;
  lane.sink = std::move(lane.sink).resume();
}

void release_block_barrier(Block& block) {
  block.arrived = 0;
  ++block.generation;
}

void on_exit(Block& block, Lane& lane) {
  finish_async_copies(lane.async_copies);
  lane.done = true;
  --block.live;
  WarpState& warp = block.warps[lane.warp];
  const unsigned bit = 1u << lane.lane;
  warp.live_mask &= ~bit;
  DSTRAIN_CHECK(!(warp.arrived_mask != 0 && (warp.pending_mask & bit)))
      << where(block, &lane) << ": this thread exited while lanes 0x" << std::hex
      << warp.arrived_mask << " of its warp wait for it in " << warp.pending_what << " with mask 0x"
      << warp.pending_mask;
  // Exited threads no longer count at __syncthreads (what GPUs since Volta do).
  if (block.arrived > 0 && block.arrived == block.live) release_block_barrier(block);
}

bool runnable(const Block& block, const Lane& lane) {
  switch (lane.wait) {
    case Wait::kNone:
      return true;
    case Wait::kBlock:
      return block.generation != lane.wait_generation;
    case Wait::kWarp:
      return block.warps[lane.warp].generation != lane.wait_generation;
  }
  return true;
}

std::string describe_deadlock(const Block& block) {
  std::ostringstream out;
  int at_block = 0, at_warp = 0, exited = 0;
  const Lane* first_block = nullptr;
  const Lane* first_warp = nullptr;
  for (const Lane& lane : block.lanes) {
    if (lane.done) {
      ++exited;
    } else if (lane.wait == Wait::kBlock) {
      if (!first_block) first_block = &lane;
      ++at_block;
    } else if (lane.wait == Wait::kWarp) {
      if (!first_warp) first_warp = &lane;
      ++at_warp;
    }
  }
  out << where(block, nullptr) << ": deadlock: " << at_block << " threads wait at __syncthreads"
      << (first_block ? " (the first " + where(block, first_block) + ")" : std::string()) << ", "
      << at_warp << " in a warp shuffle, vote or __syncwarp"
      << (first_warp ? " (the first " + where(block, first_warp) + ")" : std::string()) << ", "
      << exited << " exited: a barrier that not every thread reaches";
  return out.str();
}

void run_block(Block& block, const std::function<void()>& body) {
  for (Lane& lane : block.lanes) {
    lane.fiber =
        bctx::fiber(std::allocator_arg, PooledStack{}, [&lane, &body, &block](bctx::fiber&& sink) {
          lane.sink = std::move(sink);
          try {
            body();
            on_exit(block, lane);
          } catch (const bctx::detail::forced_unwind&) {
            throw;  // the scheduler is discarding this fiber
          } catch (...) {
            lane.error = std::current_exception();
            lane.done = true;
          }
          return std::move(lane.sink);
        });
  }
  // Round-robin over the threads that can run. Any error (a thread's exception, a deadlock)
  // leaves this function with an exception; the fibers still suspended are destroyed with the
  // Block, which unwinds their stacks.
  while (block.live > 0) {
    bool progressed = false;
    for (Lane& lane : block.lanes) {
      if (lane.done || !runnable(block, lane)) continue;
      t_lane = &lane;
      lane.fiber = std::move(lane.fiber).resume();
      t_lane = nullptr;
      progressed = true;
      if (lane.error) std::rethrow_exception(lane.error);
    }
    DSTRAIN_CHECK(progressed) << describe_deadlock(block);
  }
}

}  // namespace

const ThreadIndex& current() { return this_lane("threadIdx/blockIdx/blockDim/gridDim").index; }

void* dynamic_shared() {
  this_lane("extern __shared__ memory");
  return t_block->dynamic_shared;
}

void sync_block() {
  Lane& lane = this_lane("__syncthreads()");
  Block& block = *t_block;
  lane.wait = Wait::kBlock;
  lane.wait_generation = block.generation;
  if (++block.arrived == block.live) {
    release_block_barrier(block);
  } else {
    while (block.generation == lane.wait_generation) yield();
  }
  lane.wait = Wait::kNone;
}

namespace {

// The lanes of `mask` that arrive at one exchange must all be in the same kind of operation.
void check_same_operation(const Block& block, const Lane& lane, const WarpState& warp,
                          WarpComplete complete, const char* what) {
  DSTRAIN_CHECK(warp.pending_complete == complete)
      << where(block, &lane) << ": " << what << " while lanes 0x" << std::hex << warp.arrived_mask
      << " of its warp wait in " << warp.pending_what
      << " (a .sync.aligned instruction that not every lane executes)";
}

// Every lane of `mask` arrives with `value`; returns the slots of this exchange (valid until
// this lane's next exchange). `complete` (a collective's, or nullptr) runs on the last lane to
// arrive, with every lane's value as a pointer, before any lane leaves.
const uint64_t* exchange(unsigned mask, uint64_t value, const char* what,
                         WarpComplete complete = nullptr) {
  Lane& lane = this_lane(what);
  Block& block = *t_block;
  WarpState& warp = block.warps[lane.warp];
  const unsigned bit = 1u << lane.lane;
  DSTRAIN_CHECK(mask & bit) << where(block, &lane) << ": " << what << " with mask 0x" << std::hex
                            << mask << " that does not include the calling lane " << std::dec
                            << lane.lane;
  DSTRAIN_CHECK((mask & ~warp.live_mask) == 0)
      << where(block, &lane) << ": " << what << " with mask 0x" << std::hex << mask
      << " names lanes that exited or do not exist (live lanes 0x" << warp.live_mask << ")";
  if (warp.arrived_mask == 0) {
    warp.pending_mask = mask;
    warp.pending_complete = complete;
    warp.pending_what = what;
  } else {
    check_same_operation(block, lane, warp, complete, what);
    DSTRAIN_CHECK(warp.pending_mask == mask)
        << where(block, &lane) << ": " << what << " with mask 0x" << std::hex << mask
        << " while lanes 0x" << warp.arrived_mask << " wait in one with mask 0x"
        << warp.pending_mask;
  }
  const uint64_t generation = warp.generation;
  uint64_t* slots = warp.slots[generation & 1];
  slots[lane.lane] = value;
  warp.arrived_mask |= bit;
  lane.wait = Wait::kWarp;
  lane.wait_generation = generation;
  if (warp.arrived_mask == mask) {
    if (complete) {
      void* lane_data[32];
      for (int l = 0; l < 32; ++l) lane_data[l] = reinterpret_cast<void*>(slots[l]);
      complete(lane_data);
    }
    warp.arrived_mask = 0;
    ++warp.generation;
  } else {
    while (warp.generation == generation) yield();
  }
  lane.wait = Wait::kNone;
  return slots;
}

}  // namespace

void sync_warp(unsigned mask) { exchange(mask, 0, "__syncwarp"); }

uint64_t shuffle(unsigned mask, uint64_t value, ShuffleKind kind, int operand, int width) {
  DSTRAIN_CHECK(width > 0 && width <= 32 && std::has_single_bit(static_cast<unsigned>(width)))
      << "CUDA emulator: shuffle width " << width << " is not a power of two up to 32";
  const uint64_t* slots = exchange(mask, value, "__shfl*_sync");
  const int lane = t_lane->lane;
  const int base = lane & ~(width - 1);
  int source = lane;
  switch (kind) {
    case ShuffleKind::kIndex:
      source = base + (operand & (width - 1));
      break;
    case ShuffleKind::kXor:
      source = lane ^ operand;
      if (source >= base + width) source = lane;  // a later group: own value
      break;
    case ShuffleKind::kDown:
      source = lane + operand;
      if (source >= base + width) source = lane;
      break;
    case ShuffleKind::kUp:
      source = lane - operand;
      if (source < base) source = lane;
      break;
  }
  DSTRAIN_CHECK(source >= 0 && source < 32 && (mask >> source & 1u))
      << where(*t_block, t_lane) << ": a shuffle reads lane " << source
      << ", which is not in its mask 0x" << std::hex << mask << " (undefined on a GPU)";
  return slots[source];
}

unsigned ballot(unsigned mask, bool predicate) {
  const uint64_t* slots = exchange(mask, predicate ? 1 : 0, "__ballot/__any/__all_sync");
  unsigned result = 0;
  for (int lane = 0; lane < 32; ++lane) {
    if ((mask >> lane & 1u) && slots[lane] != 0) result |= 1u << lane;
  }
  return result;
}

void warp_collective(void* lane_data, WarpComplete complete, const char* what) {
  exchange(0xffffffffu, reinterpret_cast<uint64_t>(lane_data), what, complete);
}

AsyncCopies& async_copies() { return this_lane("cp.async").async_copies; }

cudaError_t set_max_dynamic_shared(const void* kernel, int bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) > kOptinSharedBytes) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(g_attributes_mutex);
  g_max_dynamic_shared[kernel] = bytes;
  return cudaSuccess;
}

void run_grid(const char* name, dim3 grid, dim3 block_dim, size_t shared_bytes,
              const std::function<void()>& body);

void launch(const void* kernel, const char* name, dim3 grid, dim3 block_dim, size_t shared_bytes,
            cudaStream_t stream, std::function<void()> body) {
  DSTRAIN_CHECK(t_lane == nullptr)
      << "CUDA emulator: kernel " << name << " launched from inside a kernel (not supported)";
  HostCounters& counters = this_thread_counters();
  ++counters.kernel_launches;
  if (counters.record_grids) counters.grids.push_back(grid);
  const uint64_t threads = uint64_t{block_dim.x} * block_dim.y * block_dim.z;
  size_t shared_limit = kDefaultSharedBytes;
  {
    std::lock_guard<std::mutex> lock(g_attributes_mutex);
    auto it = g_max_dynamic_shared.find(kernel);
    if (it != g_max_dynamic_shared.end()) shared_limit = std::max<size_t>(shared_limit, it->second);
  }
  if (threads == 0 || threads > kMaxThreadsPerBlock || block_dim.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.y > kMaxGridY || grid.z > kMaxGridZ ||
      grid.x > 0x7fffffffu) {
    set_last_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (shared_bytes > shared_limit) {
    // What the runtime reports for too much dynamic shared memory.
    set_last_error(cudaErrorInvalidValue);
    return;
  }
  // The grid runs when its stream reaches it (emu_streams.h), on whichever host thread that is.
  enqueue(stream, [name, grid, block_dim, shared_bytes, body = std::move(body)] {
    run_grid(name, grid, block_dim, shared_bytes, body);
  });
}

void run_grid(const char* name, dim3 grid, dim3 block_dim, size_t shared_bytes,
              const std::function<void()>& body) {
  const uint64_t threads = uint64_t{block_dim.x} * block_dim.y * block_dim.z;
  if (shared_bytes > t_shared_bytes) {
    t_shared.reset(new std::max_align_t[(shared_bytes + sizeof(std::max_align_t) - 1) /
                                        sizeof(std::max_align_t)]);
    t_shared_bytes = shared_bytes;
  }
  const int n = static_cast<int>(threads);
  const int warps = (n + 31) / 32;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block block;
        block.kernel = name;
        block.block_idx = uint3{bx, by, bz};
        block.live = n;
        block.dynamic_shared = shared_bytes ? t_shared.get() : nullptr;
        if (shared_bytes) std::memset(t_shared.get(), 0xFF, shared_bytes);
        block.warps.resize(warps);
        for (int w = 0; w < warps; ++w) {
          const int lanes = std::min(32, n - 32 * w);
          block.warps[w].live_mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
        }
        block.lanes.resize(n);
        for (int t = 0; t < n; ++t) {
          Lane& lane = block.lanes[t];
          lane.lane = t % 32;
          lane.warp = t / 32;
          lane.index.thread_idx = uint3{static_cast<unsigned>(t) % block_dim.x,
                                        static_cast<unsigned>(t) / block_dim.x % block_dim.y,
                                        static_cast<unsigned>(t) / (block_dim.x * block_dim.y)};
          lane.index.block_idx = block.block_idx;
          lane.index.block_dim = block_dim;
          lane.index.grid_dim = grid;
        }
        Block* outer = t_block;
        t_block = &block;
        try {
          run_block(block, body);
        } catch (...) {
          t_block = outer;
          t_lane = nullptr;
          throw;
        }
        t_block = outer;
      }
    }
  }
}

}  // namespace dstrain::emu
