#include "core/arena.h"

namespace dstrain {

constexpr size_t kArenaAlignment = 256;

int ArenaPlan::add(std::string name, DType dtype, std::vector<int64_t> shape) {
  DSTRAIN_CHECK(!shape.empty() && shape.size() <= static_cast<size_t>(kMaxDims)) << name;
  size_t count = 1;
  for (int64_t d : shape) {
    DSTRAIN_CHECK(d >= 0) << name;
    count *= static_cast<size_t>(d);
  }
  entries_.push_back(Entry{std::move(name), dtype, std::move(shape), bytes_});
  bytes_ += (count * dtype_size(dtype) + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
  return static_cast<int>(entries_.size()) - 1;
}

size_t ArenaPlan::entry_bytes(int id) const {
  const size_t end = id + 1 < size() ? entries_.at(static_cast<size_t>(id) + 1).offset : bytes_;
  return end - entries_.at(static_cast<size_t>(id)).offset;
}

Tensor ArenaPlan::view(int id, void* base, Device device) const {
  const Entry& entry = entries_.at(id);
  Tensor tensor(static_cast<char*>(base) + entry.offset, entry.dtype, {}, device);
  tensor.ndim = static_cast<int>(entry.shape.size());
  for (int i = 0; i < tensor.ndim; ++i) tensor.shape[i] = entry.shape[i];
  return tensor;
}

}  // namespace dstrain
