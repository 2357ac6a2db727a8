// Tensor: a view (pointer, dtype, shape, device). It never owns memory: a Buffer does.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/check.h"
#include "core/dtype.h"

namespace dstrain {

struct Device {
  enum class Kind : uint8_t { CPU, CUDA };
  Kind kind = Kind::CPU;
  int index = 0;

  bool is_cpu() const { return kind == Kind::CPU; }
  bool is_cuda() const { return kind == Kind::CUDA; }
  std::string str() const;  // "cpu:0", "cuda:1"
  friend bool operator==(const Device&, const Device&) = default;
};

constexpr int kMaxDims = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::array<int64_t, kMaxDims> shape{};  // only the first ndim entries mean anything
  int ndim = 0;
  Device device{};

  Tensor() = default;
  Tensor(void* data, DType dtype, std::initializer_list<int64_t> dims, Device device = {});

  bool empty() const { return data == nullptr; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  // REQUIRES: 0 <= d < ndim (negative d counts from the back).
  int64_t size(int d) const;
  std::string shape_str() const;  // "(4, 64, 768) F32"

  // Typed pointer; REQUIRES: dtype matches T.
  template <class T>
  T* as() const {
    DSTRAIN_CHECK(dtype == dtype_of<T>()) << "tensor is " << dtype_name(dtype) << ", asked for "
                                          << dtype_name(dtype_of<T>());
    return static_cast<T*>(data);
  }
  float* f32() const { return as<float>(); }
  int32_t* i32() const { return as<int32_t>(); }

  // A contiguous sub-view of `count` elements starting at element `offset`, with a new shape.
  // REQUIRES: offset + numel(dims) <= numel().
  Tensor slice(int64_t offset, std::initializer_list<int64_t> dims) const;
  // The same memory seen with another shape of equal numel.
  Tensor reshape(std::initializer_list<int64_t> dims) const;
};

// True when the bytes of `a` and `b` share an address (two views of one buffer may).
inline bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.empty() || b.empty() || !(a.device == b.device)) return false;
  const auto a_begin = reinterpret_cast<uintptr_t>(a.data);
  const auto b_begin = reinterpret_cast<uintptr_t>(b.data);
  return a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

}  // namespace dstrain
