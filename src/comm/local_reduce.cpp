#include "comm/local_reduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/check.h"

namespace dstrain::comm_detail {
namespace {

// Elements per block: the accumulator (8 KiB of fp32) and the rounded copy stay in L1 while
// every input's block streams through once and every output's block is written once.
constexpr int64_t kBlock = 2048;

template <class T>
using Accumulator = std::conditional_t<std::is_same_v<T, int32_t>, int32_t, float>;

template <class T>
inline Accumulator<T> widen(T value) {
  if constexpr (std::is_same_v<T, int32_t>) {
    return value;
  } else {
    return load_f32(value);
  }
}

template <ReduceOp Op>
inline float combine(float acc, float value) {
  if constexpr (Op == ReduceOp::Sum) {
    return acc + value;
  } else {
    // NaN wins either way: a NaN acc is kept (NaN > x is false), a NaN value replaces it.
    return (value > acc || std::isnan(value)) ? value : acc;
  }
}

template <ReduceOp Op>
inline int32_t combine(int32_t acc, int32_t value) {
  if constexpr (Op == ReduceOp::Sum) {
    // Unsigned arithmetic: overflow wraps around instead of being undefined.
    return static_cast<int32_t>(static_cast<uint32_t>(acc) + static_cast<uint32_t>(value));
  } else {
    return std::max(acc, value);
  }
}

template <class T, ReduceOp Op>
void reduce_typed(std::span<const void* const> inputs, std::span<void* const> outputs,
                  int64_t count) {
  using Acc = Accumulator<T>;
  alignas(64) Acc acc[kBlock];
  alignas(64) T rounded[kBlock];
  // `len` is a compile-time constant for every full block, so the loops vectorize at -O2.
  const auto reduce_block = [&](int64_t begin, auto len) {
    const T* first = static_cast<const T*>(inputs[0]) + begin;
    for (int64_t i = 0; i < len; ++i) acc[i] = widen(first[i]);
    for (size_t s = 1; s < inputs.size(); ++s) {
      const T* in = static_cast<const T*>(inputs[s]) + begin;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine<Op>(acc[i], widen(in[i]));
    }
    // Round once, then copy the same bits to every output.
    const void* result = acc;
    if constexpr (!std::is_same_v<T, Acc>) {
      for (int64_t i = 0; i < len; ++i) rounded[i] = store_as<T>(acc[i]);
      result = rounded;
    }
    const size_t bytes = static_cast<size_t>(len) * sizeof(T);
    for (void* output : outputs) std::memcpy(static_cast<T*>(output) + begin, result, bytes);
  };
  int64_t begin = 0;
  for (; begin + kBlock <= count; begin += kBlock) {
    reduce_block(begin, std::integral_constant<int64_t, kBlock>{});
  }
  if (begin < count) reduce_block(begin, count - begin);
}

template <class T>
void reduce_dispatch_op(ReduceOp op, std::span<const void* const> inputs,
                        std::span<void* const> outputs, int64_t count) {
  switch (op) {
    case ReduceOp::Sum: return reduce_typed<T, ReduceOp::Sum>(inputs, outputs, count);
    case ReduceOp::Max: return reduce_typed<T, ReduceOp::Max>(inputs, outputs, count);
  }
  DSTRAIN_CHECK(false) << "unknown reduce op " << static_cast<int>(op);
}

}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

void reduce_in_order(DType dtype, ReduceOp op, std::span<const void* const> inputs,
                     std::span<void* const> outputs, int64_t count) {
  DSTRAIN_CHECK(!inputs.empty()) << "a reduction needs at least one input";
  if (count <= 0) return;
  switch (dtype) {
    case DType::F32: return reduce_dispatch_op<float>(op, inputs, outputs, count);
    case DType::F16: return reduce_dispatch_op<half_t>(op, inputs, outputs, count);
    case DType::BF16: return reduce_dispatch_op<bf16_t>(op, inputs, outputs, count);
    case DType::I32: return reduce_dispatch_op<int32_t>(op, inputs, outputs, count);
    case DType::F8E4M3:
    case DType::F8E5M2: break;  // never reduced
  }
  DSTRAIN_CHECK(false) << "unknown dtype " << static_cast<int>(dtype);
}

}  // namespace dstrain::comm_detail
