#include "core/tensor.h"

#include <sstream>

namespace dstrain {

std::string Device::str() const {
  return (kind == Kind::CPU ? "cpu:" : "cuda:") + std::to_string(index);
}

Tensor::Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> dims, Device device_)
    : data(data_), dtype(dtype_), device(device_) {
  DSTRAIN_CHECK(dims.size() <= static_cast<size_t>(kMaxDims)) << "at most 4 dims";
  for (int64_t d : dims) {
    DSTRAIN_CHECK(d >= 0) << "negative dimension " << d;
    shape[ndim++] = d;
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return ndim == 0 ? (data ? 1 : 0) : n;
}

int64_t Tensor::size(int d) const {
  if (d < 0) d += ndim;
  DSTRAIN_CHECK(d >= 0 && d < ndim) << "dim " << d << " of " << shape_str();
  return shape[d];
}

std::string Tensor::shape_str() const {
  std::ostringstream out;
  out << "(";
  for (int i = 0; i < ndim; ++i) out << (i ? ", " : "") << shape[i];
  out << ") " << dtype_name(dtype);
  return out.str();
}

static int64_t count_of(std::initializer_list<int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

Tensor Tensor::slice(int64_t offset, std::initializer_list<int64_t> dims) const {
  const int64_t count = count_of(dims);
  DSTRAIN_CHECK(offset >= 0 && offset + count <= numel())
      << "slice [" << offset << ", " << offset + count << ") of " << shape_str();
  char* base = static_cast<char*>(data) + static_cast<size_t>(offset) * dtype_size(dtype);
  return Tensor(base, dtype, dims, device);
}

Tensor Tensor::reshape(std::initializer_list<int64_t> dims) const {
  DSTRAIN_CHECK(count_of(dims) == numel()) << "reshape of " << shape_str();
  return Tensor(data, dtype, dims, device);
}

}  // namespace dstrain
