// Causal self-attention forward/backward against a float64 reference and finite differences;
// with positions (packed sequences), each query sees only its own sequence's keys.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

// Multi-head (KV == NH) or grouped-query (KV < NH) attention: qkv (B,T,(NH+2KV)*hd).
struct AttentionCase {
  int64_t B, T, NH, KV, hd;
  DType dtype;
  std::vector<std::vector<int64_t>> packed = {};  // per row, its sequences' lengths (sum T)
  int64_t C() const { return NH * hd; }               // an out row
  int64_t W() const { return (NH + 2 * KV) * hd; }    // a qkv row
  int64_t kv_of(int64_t h) const { return h / (NH / KV); }
  int nh() const { return static_cast<int>(NH); }
  int kv() const { return static_cast<int>(KV); }
};

struct AttentionResult {
  std::vector<double> out, lse;  // out (B,T,C), lse (B,NH,T)
};

// positions (B,T) of c.packed: each sequence counts from 0; (0) without packing.
HostTensor positions_of(const AttentionCase& c) {
  if (c.packed.empty()) return HostTensor(DType::I32, {0});
  HostTensor positions(DType::I32, {c.B, c.T});
  for (int64_t b = 0; b < c.B; ++b) {
    int64_t t = 0;
    for (int64_t length : c.packed[static_cast<size_t>(b)]) {
      for (int64_t p = 0; p < length; ++p) positions.i32()[b * c.T + t++] = static_cast<int32_t>(p);
    }
    EXPECT_EQ(t, c.T) << "row " << b << "'s sequences must fill T";
  }
  return positions;
}

// The first key query i of row b sees: the start of its sequence (0 without packing).
int64_t first_key(const AttentionCase& c, int64_t b, int64_t i) {
  if (c.packed.empty()) return 0;
  int64_t start = 0;
  for (int64_t length : c.packed[static_cast<size_t>(b)]) {
    if (i < start + length) return start;
    start += length;
  }
  return start;
}

// float64 causal attention; query head h reads k and v of kv head h / (NH/KV).
AttentionResult attention_reference(const std::vector<double>& qkv, const AttentionCase& c) {
  const int64_t T = c.T, C = c.C(), W = c.W(), hd = c.hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  AttentionResult r;
  r.out.assign(static_cast<size_t>(c.B * T * C), 0.0);
  r.lse.assign(static_cast<size_t>(c.B * c.NH * T), 0.0);
  std::vector<double> scores(static_cast<size_t>(T));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.NH; ++h) {
      const int64_t k_column = (c.NH + c.kv_of(h)) * hd, v_column = k_column + c.KV * hd;
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * W + h * hd];
        double max_score = -INFINITY;
        const int64_t first = first_key(c, b, i);
        for (int64_t j = first; j <= i; ++j) {
          const double* k = &qkv[(b * T + j) * W + k_column];
          double s = 0.0;
          for (int64_t d = 0; d < hd; ++d) s += q[d] * k[d];
          scores[j] = s * scale;
          max_score = std::max(max_score, scores[j]);
        }
        double sum = 0.0;
        for (int64_t j = first; j <= i; ++j) sum += std::exp(scores[j] - max_score);
        for (int64_t j = first; j <= i; ++j) {
          const double p = std::exp(scores[j] - max_score) / sum;
          const double* v = &qkv[(b * T + j) * W + v_column];
          for (int64_t d = 0; d < hd; ++d) r.out[(b * T + i) * C + h * hd + d] += p * v[d];
        }
        r.lse[(b * c.NH + h) * T + i] = max_score + std::log(sum);
      }
    }
  }
  return r;
}

void check_forward(const AttentionCase& c) {
  Random rng(41);
  HostTensor qkv(c.dtype, {c.B, c.T, c.W()});
  HostTensor out(c.dtype, {c.B, c.T, c.C()}), lse(DType::F32, {c.B, c.NH, c.T});
  qkv.fill_random(rng, -1.5, 1.5);
  out.fill_nan();
  lse.fill_nan();
  const HostTensor positions = positions_of(c);
  test_backend()->attention_forward(out, lse, qkv, positions_view(positions), c.nh(), c.kv(),
                                    nullptr);
  const AttentionResult ref = attention_reference(qkv.values(), c);
  Tolerance tol = storage_tolerance(c.dtype);
  if (c.dtype == DType::F32) tol = {2e-6, 1e-5, 1e-11};
  EXPECT_TRUE(all_close(out.values(), ref.out, tol)) << "out";
  EXPECT_TRUE(all_close(lse.values(), ref.lse, {1e-6, 1e-6, 1e-12})) << "lse";
  EXPECT_TRUE(guards_intact({&out, &lse, &qkv}));
}

void check_backward(const AttentionCase& c) {
  Random rng(42);
  HostTensor qkv(c.dtype, {c.B, c.T, c.W()});
  const std::vector<double> x = qkv.fill_random(rng, -1.5, 1.5);
  const AttentionResult saved = attention_reference(x, c);
  HostTensor out(c.dtype, {c.B, c.T, c.C()}), lse(DType::F32, {c.B, c.NH, c.T});
  out.set(saved.out);
  lse.set(saved.lse);
  HostTensor dout(c.dtype, {c.B, c.T, c.C()}), dqkv(c.dtype, {c.B, c.T, c.W()});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  dqkv.fill_nan();
  const HostTensor qkv_saved = qkv.clone(), out_saved = out.clone(), lse_saved = lse.clone(),
                   dout_saved = dout.clone();
  const HostTensor positions = positions_of(c);
  test_backend()->attention_backward(dqkv, dout, qkv, out, lse, positions_view(positions), c.nh(),
                                     c.kv(), nullptr);
  const std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) { return dot(attention_reference(v, c).out, r); }, x);
  Tolerance tol = storage_tolerance(c.dtype);
  if (c.dtype == DType::F32) tol = {1e-5, 1e-4, 1e-9};
  EXPECT_TRUE(all_close(dqkv.values(), grad, tol)) << "dqkv";
  EXPECT_TRUE(guards_intact({&dqkv, &dout, &qkv, &out, &lse}));
  EXPECT_TRUE(bitwise_equal(qkv, qkv_saved) && bitwise_equal(out, out_saved) &&
              bitwise_equal(lse, lse_saved) && bitwise_equal(dout, dout_saved))
      << "inputs must be left unchanged";
}

TEST(Attention, ForwardRoundShapeF32) { check_forward({2, 8, 4, 4, 8, DType::F32}); }
// Odd T and a head dimension that is not a power of two.
TEST(Attention, ForwardOddShapeF32) { check_forward({3, 7, 3, 3, 5, DType::F32}); }
TEST(Attention, ForwardOddShapeF16) { check_forward({3, 7, 3, 3, 5, DType::F16}); }
TEST(Attention, ForwardOddShapeBF16) { check_forward({3, 7, 3, 3, 5, DType::BF16}); }
TEST(Attention, ForwardLongF32) { check_forward({1, 67, 2, 2, 12, DType::F32}); }

TEST(Attention, BackwardRoundShapeF32) { check_backward({2, 8, 4, 4, 8, DType::F32}); }
TEST(Attention, BackwardOddShapeF32) { check_backward({2, 7, 3, 3, 5, DType::F32}); }
TEST(Attention, BackwardOddShapeF16) { check_backward({2, 7, 3, 3, 5, DType::F16}); }
TEST(Attention, BackwardOddShapeBF16) { check_backward({2, 7, 3, 3, 5, DType::BF16}); }
TEST(Attention, BackwardLongF32) { check_backward({1, 23, 2, 2, 6, DType::F32}); }

// Grouped-query attention: 2 and 3 query heads per kv head, and all heads on one kv head
// (multi-query). Odd T and odd hd cut every loop.
// Packed rows: sequences of 5, 1 and 7 tokens in row 0, 2 and 11 in row 1.
const std::vector<std::vector<int64_t>> kPacked = {{5, 1, 7}, {2, 11}};
TEST(Attention, PackedForwardOddShapeF32) { check_forward({2, 13, 3, 3, 5, DType::F32, kPacked}); }
TEST(Attention, PackedForwardOddShapeBF16) { check_forward({2, 13, 3, 3, 5, DType::BF16, kPacked}); }
TEST(Attention, PackedGqaForwardF32) { check_forward({2, 13, 6, 2, 4, DType::F32, kPacked}); }
TEST(Attention, PackedBackwardOddShapeF32) { check_backward({2, 13, 3, 3, 5, DType::F32, kPacked}); }
TEST(Attention, PackedGqaBackwardF32) { check_backward({2, 13, 6, 2, 4, DType::F32, kPacked}); }
TEST(Attention, PackedBackwardF16) { check_backward({2, 13, 3, 3, 5, DType::F16, kPacked}); }

TEST(Attention, GqaForwardRoundShapeF32) { check_forward({2, 8, 4, 1, 8, DType::F32}); }
TEST(Attention, GqaForwardOddShapeF32) { check_forward({3, 7, 6, 2, 5, DType::F32}); }
TEST(Attention, GqaForwardOddShapeF16) { check_forward({3, 7, 6, 2, 5, DType::F16}); }
TEST(Attention, GqaForwardOddShapeBF16) { check_forward({3, 7, 6, 2, 5, DType::BF16}); }
TEST(Attention, GqaForwardLongF32) { check_forward({1, 41, 6, 3, 10, DType::F32}); }

TEST(Attention, GqaBackwardRoundShapeF32) { check_backward({2, 8, 4, 1, 8, DType::F32}); }
TEST(Attention, GqaBackwardOddShapeF32) { check_backward({2, 7, 6, 2, 5, DType::F32}); }
TEST(Attention, GqaBackwardOddShapeF16) { check_backward({2, 7, 6, 2, 5, DType::F16}); }
TEST(Attention, GqaBackwardOddShapeBF16) { check_backward({2, 7, 6, 2, 5, DType::BF16}); }
TEST(Attention, GqaBackwardLongF32) { check_backward({1, 19, 4, 2, 6, DType::F32}); }

// qkv (B,T,(NH+2KV)*hd) -> the multi-head qkv (B,T,3*NH*hd) whose k and v heads are the kv heads
// repeated for each query head (Hugging Face's repeat_kv), same dtype, same bits.
HostTensor repeat_kv(const HostTensor& qkv, const AttentionCase& c) {
  const AttentionCase mha{c.B, c.T, c.NH, c.NH, c.hd, c.dtype};
  HostTensor expanded(c.dtype, {c.B, c.T, mha.W()});
  for (int64_t row = 0; row < c.B * c.T; ++row) {
    for (int64_t h = 0; h < c.NH; ++h) {
      for (int64_t d = 0; d < c.hd; ++d) {
        const int64_t k = row * c.W() + (c.NH + c.kv_of(h)) * c.hd + d;
        expanded.set(row * mha.W() + h * c.hd + d, qkv.get(row * c.W() + h * c.hd + d));
        expanded.set(row * mha.W() + (c.NH + h) * c.hd + d, qkv.get(k));
        expanded.set(row * mha.W() + (2 * c.NH + h) * c.hd + d, qkv.get(k + c.KV * c.hd));
      }
    }
  }
  return expanded;
}

// Columns [begin, begin + width) of every row of a (rows, row_width) tensor, as doubles.
std::vector<double> columns(const HostTensor& t, int64_t row_width, int64_t begin, int64_t width) {
  std::vector<double> values;
  for (int64_t row = 0; row < t.numel() / row_width; ++row) {
    for (int64_t col = begin; col < begin + width; ++col) {
      values.push_back(t.get(row * row_width + col));
    }
  }
  return values;
}

// The same values, bit for bit (no NaN expected): the first difference on failure.
::testing::AssertionResult identical(const std::vector<double>& got,
                                     const std::vector<double>& ref) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != ref[i]) {
      return ::testing::AssertionFailure()
             << "element " << i << ": " << got[i] << " vs " << ref[i] << " (bits differ)";
    }
  }
  return ::testing::AssertionSuccess();
}

// Grouped-query attention IS multi-head attention on repeated k and v: out, lse and dq are
// bitwise those of the expanded problem (the same fp32 arithmetic per query head), and dk, dv of
// a kv head are the sums of its query heads' (one accumulator instead of rounded partial sums,
// hence a tolerance).
TEST(Attention, GqaIsMultiHeadOnRepeatedKv) {
  for (DType dtype : kFloatDTypes) {
    const AttentionCase c{2, 9, 6, 2, 6, dtype}, mha{2, 9, 6, 6, 6, dtype};
    Random rng(43);
    HostTensor qkv(dtype, {c.B, c.T, c.W()}), dout(dtype, {c.B, c.T, c.C()});
    qkv.fill_random(rng, -1.5, 1.5);
    dout.fill_random(rng, -1.0, 1.0);
    const HostTensor qkv_mha = repeat_kv(qkv, c);
    HostTensor out(dtype, {c.B, c.T, c.C()}), lse(DType::F32, {c.B, c.NH, c.T});
    HostTensor out_mha(dtype, {c.B, c.T, c.C()}), lse_mha(DType::F32, {c.B, c.NH, c.T});
    test_backend()->attention_forward(out, lse, qkv, c.nh(), c.kv(), nullptr);
    test_backend()->attention_forward(out_mha, lse_mha, qkv_mha, mha.nh(), mha.kv(), nullptr);
    EXPECT_TRUE(bitwise_equal(out, out_mha)) << dtype_name(dtype);
    EXPECT_TRUE(bitwise_equal(lse, lse_mha)) << dtype_name(dtype);

    HostTensor dqkv(dtype, {c.B, c.T, c.W()}), dqkv_mha(dtype, {c.B, c.T, mha.W()});
    test_backend()->attention_backward(dqkv, dout, qkv, out, lse, c.nh(), c.kv(), nullptr);
    test_backend()->attention_backward(dqkv_mha, dout, qkv_mha, out_mha, lse_mha, mha.nh(),
                                       mha.kv(), nullptr);
    EXPECT_TRUE(identical(columns(dqkv, c.W(), 0, c.C()), columns(dqkv_mha, mha.W(), 0, c.C())))
        << "dq " << dtype_name(dtype);
    // dk and dv (B*T, 2, KV, hd) against the group sums of the multi-head gradients.
    const std::vector<double> dkv = columns(dqkv, c.W(), c.C(), 2 * c.KV * c.hd);
    std::vector<double> group_sums(dkv.size(), 0.0);
    for (int64_t row = 0; row < c.B * c.T; ++row) {
      for (int64_t h = 0; h < 2 * c.NH; ++h) {  // k heads, then v heads of the expanded qkv
        const int64_t kv_slot = h < c.NH ? c.kv_of(h) : c.KV + c.kv_of(h - c.NH);
        for (int64_t d = 0; d < c.hd; ++d) {
          group_sums[(row * 2 * c.KV + kv_slot) * c.hd + d] +=
              dqkv_mha.get(row * mha.W() + (c.NH + h) * c.hd + d);
        }
      }
    }
    Tolerance tol = storage_tolerance(dtype);
    if (dtype == DType::F32) tol = {1e-6, 1e-5, 1e-12};
    EXPECT_TRUE(all_close(dkv, group_sums, tol)) << "dk, dv " << dtype_name(dtype);
  }
}

TEST(Attention, ShapeMismatchThrows) {
  HostTensor qkv(DType::F32, {1, 4, 3 * 12}), out(DType::F32, {1, 4, 12});
  HostTensor lse(DType::F32, {1, 5, 4});
  // 12 channels are not divisible by 5 heads.
  EXPECT_THROW(test_backend()->attention_forward(out, lse, qkv, 5, 5, nullptr), Error);
  HostTensor lse_wrong(DType::F32, {1, 3, 4});
  EXPECT_THROW(test_backend()->attention_forward(out, lse_wrong, qkv, 4, 4, nullptr), Error);
  HostTensor lse_f16(DType::F16, {1, 4, 4});
  EXPECT_THROW(test_backend()->attention_forward(out, lse_f16, qkv, 4, 4, nullptr), Error);
}

TEST(Attention, GqaShapeMismatchThrows) {
  // NH = 6, KV = 2, hd = 4: qkv rows of (6 + 4) * 4 = 40, out rows of 24.
  HostTensor qkv(DType::F32, {1, 4, 40}), out(DType::F32, {1, 4, 24});
  HostTensor lse(DType::F32, {1, 6, 4});
  HostTensor dout(DType::F32, {1, 4, 24}), dqkv(DType::F32, {1, 4, 40});
  Random rng(44);
  qkv.fill_random(rng, -1.0, 1.0);
  dout.fill_random(rng, -1.0, 1.0);
  EXPECT_NO_THROW(test_backend()->attention_forward(out, lse, qkv, 6, 2, nullptr));
  EXPECT_NO_THROW(test_backend()->attention_backward(dqkv, dout, qkv, out, lse, 6, 2, nullptr));
  // 6 query heads cannot share 4 kv heads evenly; no heads; 40 is not (6 + 2*3) * hd.
  EXPECT_THROW(test_backend()->attention_forward(out, lse, qkv, 6, 4, nullptr), Error);
  EXPECT_THROW(test_backend()->attention_forward(out, lse, qkv, 6, 0, nullptr), Error);
  EXPECT_THROW(test_backend()->attention_forward(out, lse, qkv, 6, 3, nullptr), Error);
  // dqkv as wide as a multi-head qkv (3 * 24) instead of 40.
  HostTensor dqkv_mha(DType::F32, {1, 4, 72});
  EXPECT_THROW(test_backend()->attention_backward(dqkv_mha, dout, qkv, out, lse, 6, 2, nullptr),
               Error);
}

// Rows [first, first + count) of a tensor of rows `width` wide.
std::vector<double> rows_of(const HostTensor& t, int64_t width, int64_t first, int64_t count) {
  const std::vector<double> all = t.values();
  return std::vector<double>(all.begin() + first * width, all.begin() + (first + count) * width);
}

// A packed row is its sequences attended alone, bit for bit (forward and backward).
TEST(Attention, PackedRowIsEachSequenceAloneBitwise) {
  const AttentionCase c{1, 13, 4, 2, 6, DType::F32, {{5, 1, 7}}};
  Random rng(43);
  HostTensor qkv(c.dtype, {1, c.T, c.W()}), dout(c.dtype, {1, c.T, c.C()});
  qkv.fill_random(rng, -1.5, 1.5);
  dout.fill_random(rng, -1.0, 1.0);
  HostTensor out(c.dtype, {1, c.T, c.C()}), lse(DType::F32, {1, c.NH, c.T});
  HostTensor dqkv(c.dtype, {1, c.T, c.W()});
  const HostTensor positions = positions_of(c);
  test_backend()->attention_forward(out, lse, qkv, positions.t(), c.nh(), c.kv(), nullptr);
  test_backend()->attention_backward(dqkv, dout, qkv, out, lse, positions.t(), c.nh(), c.kv(),
                                     nullptr);
  int64_t start = 0;
  for (int64_t length : c.packed[0]) {
    HostTensor q1(c.dtype, {1, length, c.W()}), o1(c.dtype, {1, length, c.C()});
    HostTensor l1(DType::F32, {1, c.NH, length}), d1(c.dtype, {1, length, c.C()});
    HostTensor dq1(c.dtype, {1, length, c.W()});
    q1.set(rows_of(qkv, c.W(), start, length));
    d1.set(rows_of(dout, c.C(), start, length));
    test_backend()->attention_forward(o1, l1, q1, c.nh(), c.kv(), nullptr);
    test_backend()->attention_backward(dq1, d1, q1, o1, l1, c.nh(), c.kv(), nullptr);
    EXPECT_EQ(o1.values(), rows_of(out, c.C(), start, length)) << "out at " << start;
    EXPECT_EQ(dq1.values(), rows_of(dqkv, c.W(), start, length)) << "dqkv at " << start;
    for (int64_t h = 0; h < c.NH; ++h) {
      for (int64_t i = 0; i < length; ++i) {
        EXPECT_EQ(l1.get(h * length + i), lse.get(h * c.T + start + i)) << "lse";
      }
    }
    start += length;
  }
}

TEST(Attention, BadPositionsThrow) {
  const AttentionCase c{1, 4, 2, 2, 4, DType::F32};
  HostTensor qkv(c.dtype, {1, c.T, c.W()}), out(c.dtype, {1, c.T, c.C()});
  HostTensor lse(DType::F32, {1, c.NH, c.T}), positions(DType::I32, {1, c.T});
  Random rng(44);
  qkv.fill_random(rng, -1.0, 1.0);
  for (const std::vector<double>& bad : {std::vector<double>{1, 2, 3, 4}, {0, 1, 3, 4},
                                         {0, 0, 2, 0}}) {
    positions.set(bad);
    EXPECT_THROW(test_backend()->attention_forward(out, lse, qkv, positions.t(), c.nh(), c.kv(),
                                                   nullptr),
                 Error);
  }
}

}  // namespace
}  // namespace dstrain::test
