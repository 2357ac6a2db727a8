// The per-device allocator: every byte dstrain allocates goes through one, tagged with a
// memory category, so current and peak bytes per category are known exactly. The planner's
// memory model calls the same sizing functions the trainer allocates with, and tests compare
// the two through these counters.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "core/tensor.h"

namespace dstrain {

enum class MemCategory : uint8_t {
  Parameters,          // the low-precision (or fp32) working weights a rank holds
  Gradients,           // parameter gradients a rank holds
  MasterWeights,       // fp32 master copy when parameters are stored in fp16/bf16
  OptimizerState,      // Adam moments on the device
  OptimizerStateHost,  // master weights + Adam moments in (pinned) host memory, with offload
  GatheredParams,      // full-block buffers filled by all-gather (ZeRO-3)
  Activations,         // the activation store kept for backward
  CommBuffers,         // staging buffers of collectives and transfers
  Workspace,           // scratch of ops (logits, gradients of activations, GEMM workspace)
  Data,                // token batches
  kCount
};
constexpr int kNumMemCategories = static_cast<int>(MemCategory::kCount);
const char* mem_category_name(MemCategory category);  // "parameters", "gradients", ...

struct MemoryStats {
  std::array<size_t, kNumMemCategories> current{};
  std::array<size_t, kNumMemCategories> peak{};
  size_t current_total = 0;
  size_t peak_total = 0;  // the peak of the sum, not the sum of peaks
};

class Allocator;

// Owns one allocation; returns it to its allocator when destroyed. Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  Device device() const;
  bool empty() const { return data_ == nullptr; }
  // A view of the first numel(dims) elements as `dtype`. REQUIRES: it fits.
  Tensor view(DType dtype, std::initializer_list<int64_t> dims) const;
  void reset();

 private:
  friend class Allocator;
  Allocator* owner_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_ = MemCategory::Workspace;
};

class Allocator {
 public:
  explicit Allocator(Device device) : device_(device) {}
  virtual ~Allocator() = default;

  // Throws UserError naming the category and size when the memory is not there, or when it
  // would pass the limit.
  Buffer allocate(MemCategory category, size_t bytes);
  // Refuse any allocation that would bring what this allocator holds past `bytes` (0: none),
  // as if the device had only that memory; `flag` names where the limit came from
  // ("--gpu-memory 24G").
  void set_limit(size_t bytes, std::string flag);
  Device device() const { return device_; }
  MemoryStats stats() const;
  void reset_peaks();

 protected:
  // 64-byte aligned; nullptr when out of memory.
  virtual void* raw_allocate(size_t bytes) = 0;
  // What to say after "out of memory ... allocating N for X" (e.g. a limit that may be why).
  virtual std::string out_of_memory_advice() const { return ""; }
  virtual void raw_free(void* pointer) = 0;

 private:
  friend class Buffer;
  void release(void* pointer, size_t bytes, MemCategory category);

  void check_limit(MemCategory category, size_t bytes) const;

  Device device_;
  mutable std::mutex mutex_;
  MemoryStats stats_;
  size_t limit_ = 0;
  std::string limit_flag_;
};

// Host memory allocator (the CPU backend's device memory, and host staging without CUDA).
std::unique_ptr<Allocator> make_cpu_allocator(int index = 0);

std::string format_bytes(size_t bytes);  // "1.50 GiB", "12.0 MiB", "512 B"

}  // namespace dstrain
