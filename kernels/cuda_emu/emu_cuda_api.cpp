// The CUDA runtime API as the emulator provides it: the functions dstrain's CUDA host code calls,
// with the declarations of the toolkit's own cuda_runtime_api.h (so the host code compiles
// unchanged), defined on host memory. "Device" memory is host memory. Streams queue their work
// and run it lazily (emu_streams.h): as late as CUDA's rules allow, so a missing wait shows up.
// Copies follow the runtime's synchronization rules by memory kind: an asynchronous copy
// from pageable host memory reads its source before it returns, one into pageable memory
// returns once it has landed, and copies between device and pinned memory (cudaHostAlloc) are
// truly asynchronous. One emulated device by default; DSTRAIN_CUDA_EMU_DEVICES=N gives N,
// DSTRAIN_CUDA_EMU_MEMORY=BYTES caps each device's memory (for out-of-memory tests).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "kernels/cuda_emu/emu_runtime.h"
#include "kernels/cuda_emu/emu_streams.h"

namespace dstrain::emu {

namespace {

constexpr size_t kAlignment = 256;  // what cudaMalloc guarantees

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;

int device_count() {
  static const int count = [] {
    const char* text = std::getenv("DSTRAIN_CUDA_EMU_DEVICES");
    const int n = text ? std::atoi(text) : 1;
    return std::clamp(n, 0, 64);
  }();
  return count;
}

size_t device_memory() {
  static const size_t bytes = [] {
    const char* text = std::getenv("DSTRAIN_CUDA_EMU_MEMORY");
    return text ? static_cast<size_t>(std::strtoull(text, nullptr, 10)) : size_t{16} << 30;
  }();
  return bytes;
}

// Device allocations: pointer -> (device, bytes), for cudaMemGetInfo and the memory cap; and
// pinned host allocations: pointer -> bytes.
struct Allocations {
  std::mutex mutex;
  std::map<const void*, std::pair<int, size_t>> sizes;
  std::map<int, size_t> used;
  std::map<const void*, size_t> pinned;
};
Allocations& allocations() {
  static Allocations* all = new Allocations;  // outlives static destructors that free memory
  return *all;
}

cudaError_t fail(cudaError_t error) {
  t_last_error = error;
  return error;
}

cudaError_t device_malloc(void** pointer, size_t bytes) {
  if (!pointer) return fail(cudaErrorInvalidValue);
  *pointer = nullptr;
  if (device_count() == 0) return fail(cudaErrorNoDevice);
  Allocations& all = allocations();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (all.used[t_device] + bytes > device_memory()) return fail(cudaErrorMemoryAllocation);
  void* memory =
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{kAlignment}, std::nothrow);
  if (!memory) return fail(cudaErrorMemoryAllocation);
  // Poisoned (0xFF bytes: NaN as floats) as the runtime promises nothing about new memory: a
  // read before the first write shows up in the results.
  std::memset(memory, 0xFF, bytes);
  all.sizes[memory] = {t_device, bytes};
  all.used[t_device] += bytes;
  *pointer = memory;
  return cudaSuccess;
}

cudaError_t device_free(void* pointer) {
  if (!pointer) return cudaSuccess;
  Allocations& all = allocations();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto it = all.sizes.find(pointer);
  if (it == all.sizes.end()) return fail(cudaErrorInvalidValue);
  all.used[it->second.first] -= it->second.second;
  all.sizes.erase(it);
  ::operator delete (pointer, std::align_val_t{kAlignment});
  return cudaSuccess;
}

// The entry of `map` (base -> allocation) whose allocation holds [pointer, pointer + bytes), or
// nullptr. REQUIRES: the allocations' mutex held.
template <class Map, class Size>
const typename Map::mapped_type* find_allocation(const Map& map, const void* pointer, size_t bytes,
                                                 Size size_of) {
  auto it = map.upper_bound(pointer);
  if (it == map.begin()) return nullptr;
  --it;
  const char* base = static_cast<const char*>(it->first);
  const char* p = static_cast<const char*>(pointer);
  const size_t size = std::max<size_t>(size_of(it->second), 1);
  if (p < base || p >= base + size || bytes > size - static_cast<size_t>(p - base)) return nullptr;
  return &it->second;
}
const std::pair<int, size_t>* find_device_allocation(const Allocations& all, const void* pointer,
                                                     size_t bytes) {
  return find_allocation(all.sizes, pointer, bytes,
                         [](const std::pair<int, size_t>& entry) { return entry.second; });
}
bool in_pinned_allocation(const Allocations& all, const void* pointer, size_t bytes) {
  return find_allocation(all.pinned, pointer, bytes, [](size_t size) { return size; }) != nullptr;
}

// Whether `pointer` lies in pageable host memory: neither a device nor a pinned allocation.
bool is_pageable(const void* pointer) {
  Allocations& all = allocations();
  std::lock_guard<std::mutex> lock(all.mutex);
  return !find_device_allocation(all, pointer, 1) && !in_pinned_allocation(all, pointer, 1);
}

// A copy queued on `stream` with the runtime's rules for pageable memory (see the top).
cudaError_t queue_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes && (!dst || !src)) return fail(cudaErrorInvalidValue);
  if (bytes == 0) return cudaSuccess;
  if (!is_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  StreamMark mark;
  if (is_pageable(src)) {
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    mark = enqueue_work(stream, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
  } else {
    mark = enqueue_work(stream, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  }
  if (is_pageable(dst)) synchronize_mark(mark);
  return cudaSuccess;
}

// The errors the emulator returns, with the runtime's names and sentences.
struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
};
const ErrorText& describe(cudaError_t error) {
  static constexpr ErrorText kUnknown{cudaErrorUnknown, "cudaErrorUnknown", "unknown error"};
  for (const ErrorText& e : kErrors) {
    if (e.error == error) return e;
  }
  return kUnknown;
}

// The emulated GPU: few "SMs", so grid-stride kernels launch few blocks and each block does
// more of the work; compute capability 8.9, the release architecture with the least shared
// memory per block (kOptinSharedBytes).
constexpr int kSmCount = 2;
constexpr int kCcMajor = 8, kCcMinor = 9;

// An event: the position its last record captured, and the model time that record ran at
// (emu_streams.h; shared with the queued record, which may run after the event is destroyed).
struct Event {
  StreamMark mark;
  bool recorded = false;
  std::shared_ptr<std::chrono::steady_clock::time_point> time =
      std::make_shared<std::chrono::steady_clock::time_point>();
};

std::atomic<uintptr_t> g_next_handle{1};

}  // namespace

void set_last_error(cudaError_t error) { t_last_error = error; }

int allocation_device(const void* pointer, size_t bytes) {
  Allocations& all = allocations();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (const auto* device = find_device_allocation(all, pointer, bytes)) return device->first;
  return in_pinned_allocation(all, pointer, bytes) ? kPinnedHost : kNotAllocated;
}

int current_device() { return t_device; }

}  // namespace dstrain::emu

using namespace dstrain::emu;

extern "C" {

cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  if (!count) return fail(cudaErrorInvalidValue);
  *count = device_count();
  if (*count == 0) return fail(cudaErrorNoDevice);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  if (!device) return fail(cudaErrorInvalidValue);
  if (device_count() == 0) return fail(cudaErrorNoDevice);
  *device = t_device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (!prop) return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "dstrain CUDA emulator");
  prop->totalGlobalMem = device_memory();
  prop->sharedMemPerBlock = kDefaultSharedBytes;
  prop->sharedMemPerBlockOptin = kOptinSharedBytes;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = kMaxThreadsPerBlock;
  prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = static_cast<int>(kMaxGridY);
  prop->maxGridSize[2] = static_cast<int>(kMaxGridZ);
  prop->multiProcessorCount = kSmCount;
  prop->major = kCcMajor;
  prop->minor = kCcMinor;
  prop->pciBusID = device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (!value) return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = kSmCount;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = kCcMajor;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = kCcMinor;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(kOptinSharedBytes);
      return cudaSuccess;
    default:
      return fail(cudaErrorInvalidValue);
  }
}

cudaError_t CUDARTAPI cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (!can) return fail(cudaErrorInvalidValue);
  *can = 0;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceSynchronize(void) {
  synchronize_device(t_device);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const cudaError_t error = t_last_error;
  t_last_error = cudaSuccess;
  return error;
}

cudaError_t CUDARTAPI cudaPeekAtLastError(void) { return t_last_error; }

const char* CUDARTAPI cudaGetErrorName(cudaError_t error) { return describe(error).name; }
const char* CUDARTAPI cudaGetErrorString(cudaError_t error) { return describe(error).text; }

// ---- memory ----
cudaError_t CUDARTAPI cudaMalloc(void** pointer, size_t bytes) {
  return device_malloc(pointer, bytes);
}
// cudaFree waits for the device: no queued work may still use the memory.
cudaError_t CUDARTAPI cudaFree(void* pointer) {
  synchronize_device(t_device);
  return device_free(pointer);
}
cudaError_t CUDARTAPI cudaMallocAsync(void** pointer, size_t bytes, cudaStream_t) {
  return device_malloc(pointer, bytes);
}
// Stream-ordered: freed once the stream's earlier work has run.
cudaError_t CUDARTAPI cudaFreeAsync(void* pointer, cudaStream_t stream) {
  if (!pointer) return cudaSuccess;
  if (!is_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  enqueue_work(stream, [pointer] { device_free(pointer); });
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMallocFromPoolAsync(void** pointer, size_t bytes, cudaMemPool_t,
                                              cudaStream_t) {
  return device_malloc(pointer, bytes);
}

cudaError_t CUDARTAPI cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
  if (!pool || !props) return fail(cudaErrorInvalidValue);
  *pool = reinterpret_cast<cudaMemPool_t>(g_next_handle.fetch_add(1));
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMemPoolDestroy(cudaMemPool_t) { return cudaSuccess; }
cudaError_t CUDARTAPI cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void* value) {
  return value ? cudaSuccess : fail(cudaErrorInvalidValue);
}

cudaError_t CUDARTAPI cudaHostAlloc(void** pointer, size_t bytes, unsigned int) {
  if (!pointer) return fail(cudaErrorInvalidValue);
  *pointer =
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{kAlignment}, std::nothrow);
  if (!*pointer) return fail(cudaErrorMemoryAllocation);
  Allocations& all = allocations();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.pinned[*pointer] = bytes;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMallocHost(void** pointer, size_t bytes) {
  return cudaHostAlloc(pointer, bytes, 0);
}
cudaError_t CUDARTAPI cudaFreeHost(void* pointer) {
  if (!pointer) return cudaSuccess;
  synchronize_device(t_device);
  Allocations& all = allocations();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (all.pinned.erase(pointer) == 0) return fail(cudaErrorInvalidValue);
  ::operator delete (pointer, std::align_val_t{kAlignment});
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaHostGetDevicePointer(void** device_pointer, void* host_pointer,
                                               unsigned int) {
  if (!device_pointer || !host_pointer) return fail(cudaErrorInvalidValue);
  *device_pointer = host_pointer;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  Allocations& all = allocations();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (total_bytes) *total_bytes = device_memory();
  if (free_bytes) *free_bytes = device_memory() - all.used[t_device];
  return cudaSuccess;
}

// Synchronous: on the legacy stream, and returns once the copy has landed.
cudaError_t CUDARTAPI cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  const cudaError_t error = queue_copy(dst, src, bytes, nullptr);
  if (error == cudaSuccess) synchronize_stream(nullptr);
  return error;
}
cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                      cudaStream_t stream) {
  return queue_copy(dst, src, bytes, stream);
}
cudaError_t CUDARTAPI cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream) {
  if (bytes && !dst) return fail(cudaErrorInvalidValue);
  if (!is_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  if (bytes) enqueue_work(stream, [dst, value, bytes] { std::memset(dst, value, bytes); });
  return cudaSuccess;
}
// Asynchronous to the host for device memory, like the runtime's: on the legacy stream.
cudaError_t CUDARTAPI cudaMemset(void* dst, int value, size_t bytes) {
  return cudaMemsetAsync(dst, value, bytes, nullptr);
}

// ---- streams and events (emu_streams.h) ----
cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (!stream) return fail(cudaErrorInvalidValue);
  *stream = create_stream(t_device, (flags & cudaStreamNonBlocking) == 0);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t CUDARTAPI cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int) {
  return cudaStreamCreateWithFlags(stream, flags);
}
cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
  return destroy_stream(stream) ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}
cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  if (!is_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  synchronize_stream(stream);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaStreamQuery(cudaStream_t stream) {
  if (!is_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  return query_stream(stream) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  if (!is_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  const auto* e = reinterpret_cast<const Event*>(event);
  if (e->recorded) enqueue_wait(stream, e->mark);  // a never-recorded event: nothing to wait for
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t* event) {
  if (!event) return fail(cudaErrorInvalidValue);
  *event = reinterpret_cast<cudaEvent_t>(new Event);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  return cudaEventCreate(event);
}
cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  delete reinterpret_cast<Event*>(event);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  if (!is_stream(stream)) return fail(cudaErrorInvalidResourceHandle);
  auto* e = reinterpret_cast<Event*>(event);
  e->mark = enqueue_work(stream, [time = e->time] { *time = model_now(); });
  e->recorded = true;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  const auto* e = reinterpret_cast<const Event*>(event);
  if (e->recorded) synchronize_mark(e->mark);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  const auto* e = reinterpret_cast<const Event*>(event);
  return !e->recorded || query_mark(e->mark) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t CUDARTAPI cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms || !start || !end) return fail(cudaErrorInvalidValue);
  auto* a = reinterpret_cast<Event*>(start);
  auto* b = reinterpret_cast<Event*>(end);
  if (!a->recorded || !b->recorded) return fail(cudaErrorInvalidResourceHandle);
  if (!query_mark(a->mark) || !query_mark(b->mark)) return fail(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(*b->time - *a->time).count();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    const cudaError_t error = set_max_dynamic_shared(kernel, value);
    return error == cudaSuccess ? error : fail(error);
  }
  return cudaSuccess;
}

}  // extern "C"
