// Shared helpers of the kernel tests: host tensors with guard regions, deterministic random
// data, the error metric (normalized MSE + per-element atol/rtol + NaN/inf checks), and
// central finite differences. Header-only: tests/kernels/ compiles only *_test.cpp files.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/fp8.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace dstrain::test {

// Uniform doubles from mt19937_64 bits: <random>'s distributions are implementation-defined,
// the engine is not, so the data is the same on every platform.
class Random {
 public:
  explicit Random(uint64_t seed) : engine_(seed) {}
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * (static_cast<double>(engine_() >> 11) * 0x1p-53);
  }
  int64_t integer(int64_t n) { return static_cast<int64_t>(engine_() % static_cast<uint64_t>(n)); }
  std::vector<double> vector(size_t n, double lo, double hi) {
    std::vector<double> values(n);
    for (double& v : values) v = uniform(lo, hi);
    return values;
  }

 private:
  std::mt19937_64 engine_;
};

inline double round_to(DType dtype, double value) {
  return round_through(dtype, static_cast<float>(value));
}

// Guard elements after each test tensor. A sanitizer build sets 0 (-DDSTRAIN_TEST_GUARD_ELEMENTS=0)
// so that AddressSanitizer sees every out-of-bounds read as well.
#ifndef DSTRAIN_TEST_GUARD_ELEMENTS
#define DSTRAIN_TEST_GUARD_ELEMENTS 64
#endif

// A host tensor followed by a guard region of kGuardElements elements holding a sentinel byte
// pattern; guard_intact() says whether an op wrote past the end.
class HostTensor {
 public:
  static constexpr int64_t kGuardElements = DSTRAIN_TEST_GUARD_ELEMENTS;
  static constexpr uint8_t kSentinel = 0xA7;

  HostTensor(DType dtype, std::initializer_list<int64_t> dims) {
    std::vector<int64_t> shape(dims);
    init(dtype, shape);
  }
  HostTensor(DType dtype, const std::vector<int64_t>& dims) { init(dtype, dims); }
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;
  HostTensor(const HostTensor&) = delete;

  HostTensor clone() const {
    HostTensor copy(tensor_.dtype, shape());
    std::memcpy(copy.storage_.data(), storage_.data(), storage_.size());
    return copy;
  }

  const Tensor& t() const { return tensor_; }
  operator Tensor() const { return tensor_; }
  DType dtype() const { return tensor_.dtype; }
  int64_t numel() const { return tensor_.numel(); }
  std::vector<int64_t> shape() const {
    return std::vector<int64_t>(tensor_.shape.begin(), tensor_.shape.begin() + tensor_.ndim);
  }

  // Values as double (exactly the stored values).
  std::vector<double> values() const {
    std::vector<double> out(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
    return out;
  }
  double get(int64_t i) const {
    switch (tensor_.dtype) {
      case DType::F32:
        return static_cast<const float*>(tensor_.data)[i];
      case DType::F16:
        return load_f32(static_cast<const half_t*>(tensor_.data)[i]);
      case DType::BF16:
        return load_f32(static_cast<const bf16_t*>(tensor_.data)[i]);
      case DType::I32:
        return static_cast<const int32_t*>(tensor_.data)[i];
      case DType::F8E4M3:
        return load_f32(static_cast<const fp8e4m3_t*>(tensor_.data)[i]);
      case DType::F8E5M2:
        return load_f32(static_cast<const fp8e5m2_t*>(tensor_.data)[i]);
    }
    return 0.0;
  }
  // Stores each value rounded to the dtype (through fp32, RNE).
  void set(const std::vector<double>& values) {
    EXPECT_EQ(static_cast<int64_t>(values.size()), numel());
    for (int64_t i = 0; i < numel(); ++i) set(i, values[i]);
  }
  void set(int64_t i, double value) {
    const float f = static_cast<float>(value);
    switch (tensor_.dtype) {
      case DType::F32:
        static_cast<float*>(tensor_.data)[i] = f;
        break;
      case DType::F16:
        static_cast<half_t*>(tensor_.data)[i] = store_as<half_t>(f);
        break;
      case DType::BF16:
        static_cast<bf16_t*>(tensor_.data)[i] = store_as<bf16_t>(f);
        break;
      case DType::I32:
        static_cast<int32_t*>(tensor_.data)[i] = static_cast<int32_t>(value);
        break;
      case DType::F8E4M3:
        static_cast<fp8e4m3_t*>(tensor_.data)[i] = store_as<fp8e4m3_t>(f);
        break;
      case DType::F8E5M2:
        static_cast<fp8e5m2_t*>(tensor_.data)[i] = store_as<fp8e5m2_t>(f);
        break;
    }
  }
  // Random values in [lo, hi), rounded to the dtype; returns them as stored.
  std::vector<double> fill_random(Random& rng, double lo, double hi) {
    for (int64_t i = 0; i < numel(); ++i) set(i, rng.uniform(lo, hi));
    return values();
  }
  void fill_nan() {
    for (int64_t i = 0; i < numel(); ++i) set(i, std::nan(""));
  }
  int32_t* i32() const { return static_cast<int32_t*>(tensor_.data); }

  bool guard_intact() const {
    for (size_t i = data_bytes_; i < storage_.size(); ++i) {
      if (storage_[i] != kSentinel) return false;
    }
    return true;
  }
  std::vector<uint8_t> bytes() const {
    return std::vector<uint8_t>(storage_.begin(), storage_.begin() + data_bytes_);
  }

 private:
  void init(DType dtype, const std::vector<int64_t>& dims) {
    tensor_ = Tensor();
    tensor_.dtype = dtype;
    int64_t n = 1;
    for (int64_t d : dims) {
      tensor_.shape[tensor_.ndim++] = d;
      n *= d;
    }
    data_bytes_ = static_cast<size_t>(n) * dtype_size(dtype);
    storage_.assign(data_bytes_ + kGuardElements * dtype_size(dtype), kSentinel);
    tensor_.data = storage_.data();
  }

  std::vector<uint8_t> storage_;
  size_t data_bytes_ = 0;
  Tensor tensor_;
};

struct Tolerance {
  double atol;
  double rtol;
  double nmse;  // bound on sum((got - ref)^2) / sum(ref^2)
};

// Loose enough for the output rounding of each storage dtype plus fp32 compute.
inline Tolerance storage_tolerance(DType dtype) {
  switch (dtype) {
    case DType::F16:
      return {2e-3, 2e-3, 1e-6};
    case DType::BF16:
      return {1.6e-2, 1.6e-2, 1e-4};
    default:
      return {1e-5, 1e-4, 1e-10};
  }
}

// got vs ref: no NaN/inf in got, ref not all zeros, normalized MSE and every element within
// atol + |ref| * rtol. On failure: the first mismatching index with both values.
inline ::testing::AssertionResult all_close(const std::vector<double>& got,
                                            const std::vector<double>& ref, const Tolerance& tol) {
  if (got.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " vs reference " << ref.size();
  }
  double ref_norm = 0.0, err_norm = 0.0;
  int64_t mismatches = 0, first_bad = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      return ::testing::AssertionFailure() << "non-finite value " << got[i] << " at index " << i
                                           << " (reference " << ref[i] << ")";
    }
    const double err = got[i] - ref[i];
    ref_norm += ref[i] * ref[i];
    err_norm += err * err;
    if (std::abs(err) > tol.atol + std::abs(ref[i]) * tol.rtol) {
      if (first_bad < 0) first_bad = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  if (!(ref_norm > 0.0)) {
    return ::testing::AssertionFailure() << "reference is all zeros: the test proves nothing";
  }
  const double nmse = err_norm / ref_norm;
  if (mismatches > 0 || nmse > tol.nmse) {
    std::ostringstream out;
    out.precision(9);
    out << mismatches << " of " << got.size() << " elements beyond atol " << tol.atol << " + rtol "
        << tol.rtol << ", normalized mse " << nmse << " (bound " << tol.nmse << ")";
    if (first_bad >= 0) {
      out << "; first at index " << first_bad << ": got " << got[first_bad] << ", reference "
          << ref[first_bad];
    }
    return ::testing::AssertionFailure() << out.str();
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult guards_intact(std::initializer_list<const HostTensor*> tensors) {
  int index = 0;
  for (const HostTensor* t : tensors) {
    if (!t->guard_intact()) {
      return ::testing::AssertionFailure() << "guard region after tensor #" << index << " "
                                           << t->t().shape_str() << " was overwritten";
    }
    ++index;
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult bitwise_equal(const HostTensor& a, const HostTensor& b) {
  const std::vector<uint8_t> x = a.bytes(), y = b.bytes();
  if (x.size() != y.size()) return ::testing::AssertionFailure() << "sizes differ";
  const size_t element = dtype_size(a.dtype());
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] != y[i]) {
      const int64_t index = static_cast<int64_t>(i / element);
      return ::testing::AssertionFailure()
             << "first differing element " << index << " of " << a.t().shape_str() << ": "
             << a.get(index) << " vs " << b.get(index);
    }
  }
  return ::testing::AssertionSuccess();
}

// Central finite differences of a scalar function of x, in double.
inline std::vector<double> numeric_gradient(
    const std::function<double(const std::vector<double>&)>& f, std::vector<double> x,
    double eps = 1e-6) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double plus = f(x);
    x[i] = saved - eps;
    const double minus = f(x);
    x[i] = saved;
    grad[i] = (plus - minus) / (2.0 * eps);
  }
  return grad;
}

// Cross-entropy in double over `rows` rows of `width` logits (columns >= V are padding):
// losses[n] = -log softmax(logits[n, :V])[targets[n]].
inline std::vector<double> cross_entropy_reference(const std::vector<double>& logits,
                                                   const std::vector<int64_t>& targets,
                                                   int64_t rows, int64_t V, int64_t width) {
  std::vector<double> losses(static_cast<size_t>(rows));
  for (int64_t n = 0; n < rows; ++n) {
    if (targets[n] == kIgnoreTarget) continue;  // not counted: loss 0
    const double* row = &logits[static_cast<size_t>(n * width)];
    double max_logit = row[0];
    for (int64_t j = 1; j < V; ++j) max_logit = std::max(max_logit, row[j]);
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(row[j] - max_logit);
    losses[static_cast<size_t>(n)] = max_logit + std::log(sum) - row[targets[n]];
  }
  return losses;
}

// d(dloss * sum of cross_entropy_reference's losses) / dlogits by central differences.
inline std::vector<double> cross_entropy_numeric_gradient(const std::vector<double>& logits,
                                                          const std::vector<int64_t>& targets,
                                                          int64_t rows, int64_t V, int64_t width,
                                                          double dloss) {
  return numeric_gradient(
      [&](const std::vector<double>& v) {
        double sum = 0.0;
        for (double loss : cross_entropy_reference(v, targets, rows, V, width)) sum += loss;
        return sum * dloss;
      },
      logits, 1e-5);
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

inline std::vector<double> add(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

// positions (B,T) I32 of packed sequences (kernels/ops.h) holding `values` (B*T), or a (0)
// tensor when values is empty: no positions.
inline HostTensor positions_tensor(int64_t B, int64_t T, const std::vector<int32_t>& values) {
  HostTensor positions(DType::I32, {values.empty() ? 0 : B, T});
  std::copy(values.begin(), values.end(), positions.i32());
  return positions;
}

// The positions argument of an op: the tensor, or an empty one when it holds nothing.
inline Tensor positions_view(const HostTensor& positions) {
  return positions.t().numel() == 0 ? Tensor() : positions.t();
}

// The storage dtypes every op supports, for parameterized loops.
constexpr DType kFloatDTypes[] = {DType::F32, DType::F16, DType::BF16};

inline std::unique_ptr<Backend>& test_backend() {
  static std::unique_ptr<Backend> backend = make_cpu_backend(2);
  return backend;
}

}  // namespace dstrain::test
