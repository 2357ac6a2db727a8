#include "core/allocator.h"

#include <cstdio>
#include <cstdlib>
#include <new>

namespace dstrain {

const char* mem_category_name(MemCategory category) {
  switch (category) {
    case MemCategory::Parameters: return "parameters";
    case MemCategory::Gradients: return "gradients";
    case MemCategory::MasterWeights: return "master_weights";
    case MemCategory::OptimizerState: return "optimizer_state";
    case MemCategory::OptimizerStateHost: return "optimizer_state_host";
    case MemCategory::GatheredParams: return "gathered_params";
    case MemCategory::Activations: return "activations";
    case MemCategory::CommBuffers: return "comm_buffers";
    case MemCategory::Workspace: return "workspace";
    case MemCategory::Data: return "data";
    case MemCategory::kCount: break;
  }
  return "?";
}

std::string format_bytes(size_t bytes) {
  char text[64];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(text, sizeof text, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(text, sizeof text, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(text, sizeof text, "%.1f KiB", b / 1024.0);
  else std::snprintf(text, sizeof text, "%zu B", bytes);
  return text;
}

Buffer::Buffer(Buffer&& other) noexcept { *this = std::move(other); }

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = other.owner_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    category_ = other.category_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

Buffer::~Buffer() { reset(); }

void Buffer::reset() {
  if (owner_ && data_) owner_->release(data_, bytes_, category_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

Device Buffer::device() const { return owner_ ? owner_->device() : Device{}; }

Tensor Buffer::view(DType dtype, std::initializer_list<int64_t> dims) const {
  Tensor tensor(data_, dtype, dims, device());
  DSTRAIN_CHECK(tensor.nbytes() <= bytes_)
      << "view " << tensor.shape_str() << " of a buffer of " << bytes_ << " bytes";
  return tensor;
}

void Allocator::set_limit(size_t bytes, std::string flag) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
  limit_flag_ = std::move(flag);
}

void Allocator::check_limit(MemCategory category, size_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (limit_ == 0 || stats_.current_total + bytes <= limit_) return;
  std::string held;
  for (int c = 0; c < kNumMemCategories; ++c) {
    if (stats_.current[c] == 0) continue;
    held += (held.empty() ? "" : ", ") + std::string(mem_category_name(MemCategory(c))) + " " +
            format_bytes(stats_.current[c]);
  }
  DSTRAIN_USER_ERROR() << limit_flag_ << ": " << format_bytes(bytes) << " more for "
                       << mem_category_name(category) << " would bring " << device_.str()
                       << " to " << format_bytes(stats_.current_total + bytes) << ", past its "
                       << format_bytes(limit_) << " (held: " << (held.empty() ? "nothing" : held)
                       << "); run `dstrain plan` with the same flag to see what fits";
}

Buffer Allocator::allocate(MemCategory category, size_t bytes) {
  if (bytes > 0) check_limit(category, bytes);
  Buffer buffer;
  buffer.owner_ = this;
  buffer.category_ = category;
  buffer.bytes_ = bytes;
  if (bytes == 0) {
    buffer.owner_ = nullptr;
    return buffer;
  }
  buffer.data_ = raw_allocate(bytes);
  if (!buffer.data_) {
    buffer.owner_ = nullptr;
    DSTRAIN_USER_ERROR() << "out of memory on " << device_.str() << " allocating "
                         << format_bytes(bytes) << " for " << mem_category_name(category)
                         << " (" << format_bytes(stats().current_total)
                         << " already in use); run `dstrain plan` to see what fits"
                         << (device_.is_cpu() ? " (with --device cpu for CPU ranks)" : "")
                         << out_of_memory_advice();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const int c = static_cast<int>(category);
  stats_.current[c] += bytes;
  stats_.current_total += bytes;
  if (stats_.current[c] > stats_.peak[c]) stats_.peak[c] = stats_.current[c];
  if (stats_.current_total > stats_.peak_total) stats_.peak_total = stats_.current_total;
  return buffer;
}

void Allocator::release(void* pointer, size_t bytes, MemCategory category) {
  raw_free(pointer);
  std::lock_guard<std::mutex> lock(mutex_);
  const int c = static_cast<int>(category);
  stats_.current[c] -= bytes;
  stats_.current_total -= bytes;
}

MemoryStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Allocator::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak = stats_.current;
  stats_.peak_total = stats_.current_total;
}

namespace {

class CpuAllocator final : public Allocator {
 public:
  explicit CpuAllocator(int index) : Allocator(Device{Device::Kind::CPU, index}) {}

 protected:
  void* raw_allocate(size_t bytes) override {
    const size_t rounded = (bytes + 63) / 64 * 64;
    return std::aligned_alloc(64, rounded);
  }
  void raw_free(void* pointer) override { std::free(pointer); }
};

}  // namespace

std::unique_ptr<Allocator> make_cpu_allocator(int index) {
  return std::make_unique<CpuAllocator>(index);
}

}  // namespace dstrain
