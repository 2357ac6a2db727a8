// ArenaPlan: a list of tensors laid out in one allocation. The plan is the single source of
// truth for how many bytes a group of buffers takes: the trainer allocates plan.bytes() and
// the planner's memory model calls the same function that builds the plan.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace dstrain {

class ArenaPlan {
 public:
  // Adds a tensor; returns its id. Each starts on a 256-byte boundary.
  int add(std::string name, DType dtype, std::vector<int64_t> shape);
  size_t bytes() const { return bytes_; }
  int size() const { return static_cast<int>(entries_.size()); }
  const std::string& name(int id) const { return entries_.at(id).name; }
  // The bytes entry `id` takes of bytes() (its size rounded up to the alignment).
  size_t entry_bytes(int id) const;
  // The tensor `id` inside an allocation of bytes() at `base`.
  Tensor view(int id, void* base, Device device) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    size_t offset;
  };
  std::vector<Entry> entries_;
  size_t bytes_ = 0;
};

}  // namespace dstrain
