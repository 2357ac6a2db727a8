// Shared helpers of the communicator tests: per-rank host buffers with guard regions on both
// sides, deterministic non-zero data that every rank can regenerate, and the reference
// reduction written straight from the contract (acc = in0; acc op= in1; ...; round once).
// Header-only: tests/comm/ compiles only *_test.cpp files.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace dstrain::test {

// For tests that do not test timeouts: long enough never to fire on a loaded machine, short
// enough that a deadlock bug ends the test with a message instead of hanging it.
constexpr double kNoTimeout = 60.0;
// For tests that do test timeouts.
constexpr double kShortTimeout = 0.25;

// The value element i of rank `rank` holds in data set `seed`, as an fp32 (for I32 the exact
// integer). Never all zero: floats in [-1, 1) scaled by 1 + rank, integers in [-1000, 1000].
inline double test_value(DType dtype, uint64_t seed, int rank, int64_t i) {
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(rank) * 0x2545f491ull +
                   static_cast<uint64_t>(i) * 0x632be59bd9b4e019ull;
  const uint64_t bits = splitmix64(state);
  if (dtype == DType::I32) return static_cast<double>(static_cast<int64_t>(bits % 2001) - 1000);
  const double unit = static_cast<double>(bits >> 11) * 0x1p-53 * 2.0 - 1.0;
  return round_through(dtype, static_cast<float>(unit * (1 + rank)));
}

// `count` elements of `dtype` between two guard regions filled with a sentinel byte: an
// out-of-bounds write on either side shows up in guards_intact().
class GuardedBuffer {
 public:
  static constexpr int64_t kGuardBytes = 256;
  static constexpr unsigned char kSentinel = 0xA7;

  GuardedBuffer() = default;
  GuardedBuffer(DType dtype, int64_t count)
      : dtype_(dtype),
        count_(count),
        bytes_(static_cast<size_t>(count) * dtype_size(dtype) + 2 * kGuardBytes, kSentinel) {
    std::memset(data(), 0, static_cast<size_t>(count_) * dtype_size(dtype_));
  }

  DType dtype() const { return dtype_; }
  int64_t count() const { return count_; }
  void* data() { return bytes_.data() + kGuardBytes; }
  const void* data() const { return bytes_.data() + kGuardBytes; }
  Tensor tensor() { return Tensor(data(), dtype_, {count_}); }
  Tensor slice(int64_t offset, int64_t count) { return tensor().slice(offset, {count}); }
  size_t nbytes() const { return static_cast<size_t>(count_) * dtype_size(dtype_); }

  bool guards_intact() const {
    for (int64_t i = 0; i < kGuardBytes; ++i) {
      if (bytes_[static_cast<size_t>(i)] != kSentinel) return false;
      if (bytes_[bytes_.size() - 1 - static_cast<size_t>(i)] != kSentinel) return false;
    }
    return true;
  }

  // Element i as a double (fp32 value of a float dtype, the integer of I32).
  double get(int64_t i) const {
    const char* p = static_cast<const char*>(data()) + static_cast<size_t>(i) * dtype_size(dtype_);
    switch (dtype_) {
      case DType::F32: { float v; std::memcpy(&v, p, 4); return v; }
      case DType::F16: { uint16_t b; std::memcpy(&b, p, 2); return fp16_bits_to_fp32(b); }
      case DType::BF16: { uint16_t b; std::memcpy(&b, p, 2); return bf16_bits_to_fp32(b); }
      case DType::I32: { int32_t v; std::memcpy(&v, p, 4); return v; }
      case DType::F8E4M3:
      case DType::F8E5M2: break;  // not communicated
    }
    ADD_FAILURE() << "no values of " << dtype_name(dtype_);
    return 0;
  }
  // Stores `value` rounded to the dtype (integers for I32).
  void set(int64_t i, double value) {
    char* p = static_cast<char*>(data()) + static_cast<size_t>(i) * dtype_size(dtype_);
    switch (dtype_) {
      case DType::F32: { const float v = static_cast<float>(value); std::memcpy(p, &v, 4); break; }
      case DType::F16: {
        const uint16_t b = fp32_to_fp16_bits(static_cast<float>(value));
        std::memcpy(p, &b, 2);
        break;
      }
      case DType::BF16: {
        const uint16_t b = fp32_to_bf16_bits(static_cast<float>(value));
        std::memcpy(p, &b, 2);
        break;
      }
      case DType::I32: {
        const int32_t v = static_cast<int32_t>(value);
        std::memcpy(p, &v, 4);
        break;
      }
      case DType::F8E4M3:
      case DType::F8E5M2:
        ADD_FAILURE() << "no values of " << dtype_name(dtype_);
        break;
    }
  }
  // Fills element i with test_value(dtype, seed, rank, first + i).
  void fill(uint64_t seed, int rank, int64_t first = 0) {
    for (int64_t i = 0; i < count_; ++i) set(i, test_value(dtype_, seed, rank, first + i));
  }
  bool same_bytes(const GuardedBuffer& other) const {
    return nbytes() == other.nbytes() && std::memcmp(data(), other.data(), nbytes()) == 0;
  }
  bool any_nonzero() const {
    for (int64_t i = 0; i < count_; ++i) {
      if (get(i) != 0) return true;
    }
    return false;
  }

 private:
  DType dtype_ = DType::F32;
  int64_t count_ = 0;
  std::vector<unsigned char> bytes_;
};

// The reduction of the contract for one element, over values given in rank order: fp32
// accumulation left to right (int32 with wrap-around for I32), NaN-propagating max.
inline double reference_reduce(DType dtype, ReduceOp op, const std::vector<double>& values) {
  if (dtype == DType::I32) {
    int32_t acc = static_cast<int32_t>(values[0]);
    for (size_t r = 1; r < values.size(); ++r) {
      const int32_t v = static_cast<int32_t>(values[r]);
      acc = op == ReduceOp::Sum
                ? static_cast<int32_t>(static_cast<uint32_t>(acc) + static_cast<uint32_t>(v))
                : (v > acc ? v : acc);
    }
    return acc;
  }
  float acc = static_cast<float>(values[0]);
  for (size_t r = 1; r < values.size(); ++r) {
    const float v = static_cast<float>(values[r]);
    if (op == ReduceOp::Sum) {
      acc = acc + v;
    } else if (std::isnan(v) || v > acc) {
      acc = v;
    }
  }
  return acc;  // set() rounds it once to the storage dtype
}

inline std::string case_name(DType dtype, ReduceOp op, int ranks, int64_t n) {
  return std::string(dtype_name(dtype)) + (op == ReduceOp::Sum ? "_sum" : "_max") + "_" +
         std::to_string(ranks) + "ranks_n" + std::to_string(n);
}

// One all_to_all over `ranks` ranks: counts[src][dst] elements from src to dst, drawn from
// [0, 4] with zeros forced in (rank 0 sends nothing to anyone and the last rank receives nothing
// from rank 1, where there are such ranks); each rank's input filled from `seed`, the expected
// outputs cut from the inputs, the outputs zeroed.
struct AllToAllCase {
  int ranks;
  DType dtype;
  std::vector<std::vector<int64_t>> counts;
  std::vector<GuardedBuffer> inputs, outputs, expected;

  AllToAllCase(int ranks_, DType dtype_, uint64_t seed) : ranks(ranks_), dtype(dtype_) {
    Rng rng(seed);
    counts.assign(static_cast<size_t>(ranks), std::vector<int64_t>(static_cast<size_t>(ranks)));
    for (int src = 0; src < ranks; ++src) {
      for (int dst = 0; dst < ranks; ++dst) {
        const bool silent = (ranks > 2 && src == 0) || (ranks > 2 && src == 1 && dst == ranks - 1);
        counts[src][dst] = silent ? 0 : static_cast<int64_t>(rng.below(5));
      }
    }
    for (int r = 0; r < ranks; ++r) {
      inputs.emplace_back(dtype, total(send_counts(r)) + 3);  // a spare tail: never sent
      inputs.back().fill(seed, r);
      outputs.emplace_back(dtype, total(recv_counts(r)));
      expected.emplace_back(dtype, total(recv_counts(r)));
    }
    for (int dst = 0; dst < ranks; ++dst) {
      int64_t at = 0;
      for (int src = 0; src < ranks; ++src) {
        int64_t from = 0;
        for (int d = 0; d < dst; ++d) from += counts[src][d];
        for (int64_t i = 0; i < counts[src][dst]; ++i) {
          expected[dst].set(at++, inputs[src].get(from + i));
        }
      }
    }
  }
  std::vector<int64_t> send_counts(int r) const { return counts[static_cast<size_t>(r)]; }
  std::vector<int64_t> recv_counts(int r) const {
    std::vector<int64_t> column;
    for (int src = 0; src < ranks; ++src) column.push_back(counts[src][static_cast<size_t>(r)]);
    return column;
  }
  static int64_t total(const std::vector<int64_t>& v) {
    int64_t sum = 0;
    for (int64_t x : v) sum += x;
    return sum;
  }
  // The collective on `comm` (rank r's buffers).
  void run(Communicator& comm) {
    const int r = comm.rank();
    comm.all_to_all(outputs[static_cast<size_t>(r)].tensor(), recv_counts(r),
                    inputs[static_cast<size_t>(r)].tensor(), send_counts(r), nullptr);
  }
  // Every rank received exactly what was sent to it, guards intact, and the data not all zeros.
  void expect_delivered(const std::string& what) const {
    bool any = false;
    for (int r = 0; r < ranks; ++r) {
      any = any || expected[static_cast<size_t>(r)].any_nonzero();
      EXPECT_TRUE(outputs[r].same_bytes(expected[r])) << what << " rank " << r;
      EXPECT_TRUE(outputs[r].guards_intact() && inputs[r].guards_intact()) << what << " rank " << r;
    }
    EXPECT_TRUE(ranks == 1 || any) << what << ": a test on zeros proves nothing";
  }
};

// Several messages to one peer in one exchange, as a pipeline stage sends an activation and a
// small message beside it: rank 0 sends both in one call; rank 1 receives them and sends its
// gradient and a small message back in one call; rank 0 takes those in a later call. As two
// calls each, rank 1's first call would wait for rank 0's receive while rank 0 waited in its
// second send. Run by each rank of 2; expect_several_messages_arrived checks what they got.
struct SeveralMessages {
  std::vector<int32_t> got_by_zero, got_by_one;
};

inline void exchange_several_messages(Communicator& comm, SeveralMessages& got) {
  std::vector<int32_t> activation(1000, 7), side = {1, 2, 3}, gradient(1000, 9), back = {4, 5};
  std::vector<int32_t> a(1000, -1), s(3, -1), g(1000, -1), b(2, -1);
  auto t = [](std::vector<int32_t>& v) {
    return Tensor(v.data(), DType::I32, {static_cast<int64_t>(v.size())});
  };
  using Kind = P2POp::Kind;
  if (comm.rank() == 0) {
    comm.exchange({{Kind::Send, t(activation), 1}, {Kind::Send, t(side), 1}}, nullptr);
    comm.exchange({{Kind::Recv, t(g), 1}, {Kind::Recv, t(b), 1}}, nullptr);
    got.got_by_zero = g;
    got.got_by_zero.insert(got.got_by_zero.end(), b.begin(), b.end());
  } else {
    comm.exchange({{Kind::Recv, t(a), 0}, {Kind::Send, t(gradient), 0}, {Kind::Recv, t(s), 0},
                   {Kind::Send, t(back), 0}},
                  nullptr);
    got.got_by_one = a;
    got.got_by_one.insert(got.got_by_one.end(), s.begin(), s.end());
  }
}

inline void expect_several_messages_arrived(const SeveralMessages& got) {
  std::vector<int32_t> want_one(1000, 7), want_zero(1000, 9);
  want_one.insert(want_one.end(), {1, 2, 3});
  want_zero.insert(want_zero.end(), {4, 5});
  EXPECT_EQ(got.got_by_one, want_one);
  EXPECT_EQ(got.got_by_zero, want_zero);
}

}  // namespace dstrain::test
