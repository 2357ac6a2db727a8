// Rotary position embedding (rotate-half) forward/backward against float64 references: the
// formula of kernels/ops.h, Hugging Face's rotate_half written out, and a complex rotation with
// its own angles; finite differences and the adjoint identity for the backward; the table of
// kernels/rope_table.h.
//
// Tolerances: F32 {1e-6, 1e-6, 1e-12}: two products and a sum of values below 2 in fp32 are off
// by at most 3 roundings (~4e-7). F16/BF16: storage_tolerance (one rounding on store).
#include <complex>

#include "kernel_test_util.h"
#include "kernels/rope_table.h"

namespace dstrain::test {
namespace {

constexpr double kTheta = 10000.0;

// qkv (B,T,(NH+2KV)*hd); the table has table_rows >= T positions.
struct RopeCase {
  int64_t B, T, NH, KV, hd;
  DType dtype;
  int64_t table_rows;
  std::vector<int32_t> positions = {};  // (B*T), packed sequences; empty: t
  int64_t W() const { return (NH + 2 * KV) * hd; }
  int64_t rotated() const { return (NH + KV) * hd; }  // the q and k columns of a row
  int nh() const { return static_cast<int>(NH); }
  int kv() const { return static_cast<int>(KV); }
};

HostTensor make_freqs(const RopeCase& c) {
  HostTensor freqs(DType::F32, {c.table_rows, c.hd / 2, 2});
  const std::vector<float> table = rope_table(c.table_rows, c.hd, kTheta);
  freqs.set(std::vector<double>(table.begin(), table.end()));
  return freqs;
}

// The formula of kernels/ops.h in double with the table's values; sin_sign -1: the backward.
std::vector<double> rope_reference(const std::vector<double>& x, const std::vector<double>& table,
                                   const RopeCase& c, double sin_sign) {
  std::vector<double> out = x;
  const int64_t half = c.hd / 2;
  for (int64_t row = 0; row < c.B * c.T; ++row) {
    const int64_t p = c.positions.empty() ? row % c.T : c.positions[static_cast<size_t>(row)];
    const double* cos_sin = &table[p * half * 2];
    for (int64_t head = 0; head < c.NH + c.KV; ++head) {
      const int64_t base = row * c.W() + head * c.hd;
      for (int64_t i = 0; i < half; ++i) {
        const double cs = cos_sin[2 * i], sn = sin_sign * cos_sin[2 * i + 1];
        const double x1 = x[base + i], x2 = x[base + i + half];
        out[base + i] = x1 * cs - x2 * sn;
        out[base + i + half] = x2 * cs + x1 * sn;
      }
    }
  }
  return out;
}

// Hugging Face's apply_rotary_pos_emb on one head, written as there: cos and sin repeated to hd
// (cat(freqs, freqs)), rotate_half(x) = cat(-x[hd/2:], x[:hd/2]), x * cos + rotate_half(x) * sin.
std::vector<double> hugging_face_rope_head(const std::vector<double>& x, const double* cos_sin) {
  const size_t hd = x.size(), half = hd / 2;
  std::vector<double> cos_full(hd), sin_full(hd), rotated(hd), out(hd);
  for (size_t i = 0; i < hd; ++i) {
    cos_full[i] = cos_sin[2 * (i % half)];
    sin_full[i] = cos_sin[2 * (i % half) + 1];
    rotated[i] = i < half ? -x[i + half] : x[i - half];
  }
  for (size_t i = 0; i < hd; ++i) out[i] = x[i] * cos_full[i] + rotated[i] * sin_full[i];
  return out;
}

// Columns [begin, end) of every row, as doubles.
std::vector<double> columns(const std::vector<double>& values, int64_t row_width, int64_t begin,
                            int64_t end) {
  std::vector<double> out;
  for (size_t row = 0; row < values.size() / row_width; ++row) {
    out.insert(out.end(), values.begin() + row * row_width + begin,
               values.begin() + row * row_width + end);
  }
  return out;
}


Tolerance rope_tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{1e-6, 1e-6, 1e-12} : storage_tolerance(dtype);
}

// In place: x (F32/F16/BF16) -> rope(x); checks values, v bits, the table and the guards.
void check_forward(const RopeCase& c) {
  Random rng(51);
  HostTensor qkv(c.dtype, {c.B, c.T, c.W()});
  const std::vector<double> x = qkv.fill_random(rng, -2.0, 2.0);
  HostTensor freqs = make_freqs(c);
  const HostTensor freqs_saved = freqs.clone();
  const HostTensor positions = positions_tensor(c.B, c.T, c.positions);
  test_backend()->rope_forward(qkv, freqs, positions_view(positions), c.nh(), c.kv(), nullptr);
  const std::vector<double> got = qkv.values();
  const std::vector<double> ref = rope_reference(x, freqs.values(), c, 1.0);
  EXPECT_TRUE(all_close(columns(got, c.W(), 0, c.rotated()), columns(ref, c.W(), 0, c.rotated()),
                        rope_tolerance(c.dtype)));
  EXPECT_TRUE(columns(got, c.W(), c.rotated(), c.W()) == columns(x, c.W(), c.rotated(), c.W()))
      << "v must be left untouched";
  EXPECT_TRUE(bitwise_equal(freqs, freqs_saved));
  EXPECT_TRUE(guards_intact({&qkv, &freqs}));
}

// In place: g -> rope_backward(g) against the finite-difference gradient of <g, rope(x)>.
void check_backward(const RopeCase& c) {
  Random rng(52);
  HostTensor dqkv(c.dtype, {c.B, c.T, c.W()});
  const std::vector<double> g = dqkv.fill_random(rng, -1.0, 1.0);
  const std::vector<double> x = rng.vector(g.size(), -2.0, 2.0);
  HostTensor freqs = make_freqs(c);
  const std::vector<double> table = freqs.values();
  const HostTensor positions = positions_tensor(c.B, c.T, c.positions);
  test_backend()->rope_backward(dqkv, freqs, positions_view(positions), c.nh(), c.kv(), nullptr);
  const std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) { return dot(g, rope_reference(v, table, c, 1.0)); }, x);
  EXPECT_TRUE(all_close(dqkv.values(), grad, rope_tolerance(c.dtype)));
  EXPECT_TRUE(guards_intact({&dqkv, &freqs}));
}

// Round: GQA with 2 query heads per kv head, hd a power of two. Odd: odd T, odd head counts,
// hd/2 odd (10 and 6), a table with more positions than T, multi-query and multi-head.
const RopeCase kRound{2, 16, 4, 2, 16, DType::F32, 16};
const RopeCase kOdd{3, 7, 3, 1, 10, DType::F32, 12};
const RopeCase kOddMultiHead{1, 5, 3, 3, 6, DType::F32, 5};

RopeCase with_dtype(RopeCase c, DType dtype) {
  c.dtype = dtype;
  return c;
}

// Packed rows (sequences of 3 and 4, then 7): the angles restart with each sequence.
RopeCase packed(DType dtype) {
  RopeCase c{2, 7, 3, 1, 10, dtype, 12};
  c.positions = {0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6};
  return c;
}
TEST(Rope, PackedForwardAndBackward) {
  for (DType dtype : kFloatDTypes) {
    check_forward(packed(dtype));
    check_backward(packed(dtype));
  }
}

TEST(Rope, ForwardRoundShape) {
  for (DType dtype : kFloatDTypes) check_forward(with_dtype(kRound, dtype));
}
TEST(Rope, ForwardOddShape) {
  for (DType dtype : kFloatDTypes) {
    check_forward(with_dtype(kOdd, dtype));
    check_forward(with_dtype(kOddMultiHead, dtype));
  }
}
TEST(Rope, BackwardRoundShape) {
  for (DType dtype : kFloatDTypes) check_backward(with_dtype(kRound, dtype));
}
TEST(Rope, BackwardOddShape) {
  for (DType dtype : kFloatDTypes) {
    check_backward(with_dtype(kOdd, dtype));
    check_backward(with_dtype(kOddMultiHead, dtype));
  }
}

// Against Hugging Face's formulation (rotate_half) per head, in double on the same table.
TEST(Rope, MatchesHuggingFaceRotateHalf) {
  const RopeCase c = kOdd;
  Random rng(53);
  HostTensor qkv(DType::F32, {c.B, c.T, c.W()});
  const std::vector<double> x = qkv.fill_random(rng, -2.0, 2.0);
  HostTensor freqs = make_freqs(c);
  const std::vector<double> table = freqs.values();
  test_backend()->rope_forward(qkv, freqs, c.nh(), c.kv(), nullptr);
  std::vector<double> got, ref;
  for (int64_t row = 0; row < c.B * c.T; ++row) {
    for (int64_t head = 0; head < c.NH + c.KV; ++head) {
      const int64_t base = row * c.W() + head * c.hd;
      const std::vector<double> head_x(x.begin() + base, x.begin() + base + c.hd);
      const std::vector<double> rotated =
          hugging_face_rope_head(head_x, &table[(row % c.T) * c.hd]);
      ref.insert(ref.end(), rotated.begin(), rotated.end());
      for (int64_t d = 0; d < c.hd; ++d) got.push_back(qkv.get(base + d));
    }
  }
  EXPECT_TRUE(all_close(got, ref, rope_tolerance(DType::F32)));
}

// Against a complex rotation (x[i] + i x[i + hd/2]) * e^(i t theta^(-2i/hd)) whose angles are
// computed here, not read from the table: checks the table too (one float rounding of cos/sin).
TEST(Rope, MatchesComplexRotation) {
  const RopeCase c{2, 40, 4, 1, 8, DType::F32, 40};
  Random rng(54);
  HostTensor qkv(DType::F32, {c.B, c.T, c.W()});
  const std::vector<double> x = qkv.fill_random(rng, -2.0, 2.0);
  HostTensor freqs = make_freqs(c);
  test_backend()->rope_forward(qkv, freqs, c.nh(), c.kv(), nullptr);
  const int64_t half = c.hd / 2;
  std::vector<double> got, ref;
  for (int64_t row = 0; row < c.B * c.T; ++row) {
    const double t = static_cast<double>(row % c.T);
    for (int64_t head = 0; head < c.NH + c.KV; ++head) {
      const int64_t base = row * c.W() + head * c.hd;
      for (int64_t i = 0; i < half; ++i) {
        const double frequency = std::pow(kTheta, -2.0 * static_cast<double>(i) / c.hd);
        const std::complex<double> z = std::complex<double>(x[base + i], x[base + i + half]) *
                                       std::polar(1.0, t * frequency);
        ref.insert(ref.end(), {z.real(), z.imag()});
        got.insert(got.end(), {qkv.get(base + i), qkv.get(base + i + half)});
      }
    }
  }
  EXPECT_TRUE(all_close(got, ref, {2e-6, 1e-5, 1e-11}));
}

// Linear: <rope_backward(g), x> == <g, rope_forward(x)>, and the backward undoes the forward.
TEST(Rope, BackwardIsTheAdjointAndTheInverse) {
  const RopeCase c{2, 9, 6, 2, 10, DType::F32, 9};
  Random rng(55);
  HostTensor x(DType::F32, {c.B, c.T, c.W()}), g(DType::F32, {c.B, c.T, c.W()});
  const std::vector<double> x_values = x.fill_random(rng, -2.0, 2.0);
  const std::vector<double> g_values = g.fill_random(rng, -1.0, 1.0);
  HostTensor freqs = make_freqs(c);
  test_backend()->rope_forward(x, freqs, c.nh(), c.kv(), nullptr);
  test_backend()->rope_backward(g, freqs, c.nh(), c.kv(), nullptr);
  const double forward_side = dot(g_values, x.values()), backward_side = dot(g.values(), x_values);
  EXPECT_NEAR(forward_side, backward_side, 1e-5 * std::abs(forward_side) + 1e-5);
  test_backend()->rope_backward(x, freqs, c.nh(), c.kv(), nullptr);
  EXPECT_TRUE(all_close(x.values(), x_values, {2e-6, 1e-6, 1e-12})) << "backward(forward(x))";
}

TEST(Rope, ThreadCountInvariant) {
  const RopeCase c{2, 33, 6, 2, 12, DType::F32, 40};  // the dtype comes from the loop
  for (DType dtype : {DType::F32, DType::BF16}) {
    Random rng(56);
    HostTensor reference(dtype, {c.B, c.T, c.W()});
    reference.fill_random(rng, -2.0, 2.0);
    HostTensor freqs = make_freqs(c);
    HostTensor threaded = reference.clone();
    make_cpu_backend(1)->rope_forward(reference, freqs, c.nh(), c.kv(), nullptr);
    make_cpu_backend(3)->rope_forward(threaded, freqs, c.nh(), c.kv(), nullptr);
    EXPECT_TRUE(bitwise_equal(reference, threaded)) << dtype_name(dtype);
  }
}

TEST(RopeTable, MatchesDefinition) {
  for (const double theta : {10000.0, 500000.0, 1000000.0}) {  // GPT-NeoX/Llama 2, Llama 3, Qwen2
    const int64_t T = 70, hd = 64;
    const std::vector<double> inv_freq = rope_inv_freq(hd, theta);
    ASSERT_EQ(inv_freq.size(), size_t{32});
    EXPECT_EQ(inv_freq[0], 1.0);
    EXPECT_NEAR(inv_freq[31], 1.0 / std::pow(theta, 62.0 / 64.0), 1e-18);
    const std::vector<float> table = rope_table(T, hd, theta);
    ASSERT_EQ(table.size(), static_cast<size_t>(T * hd));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < hd / 2; ++i) {
        const std::complex<double> unit =
            std::polar(1.0, static_cast<double>(t) * std::pow(theta, -2.0 * i / hd));
        EXPECT_EQ(table[(t * hd / 2 + i) * 2], static_cast<float>(unit.real()));
        EXPECT_EQ(table[(t * hd / 2 + i) * 2 + 1], static_cast<float>(unit.imag()));
      }
    }
    EXPECT_EQ(table[0], 1.0f);  // position 0: no rotation
    EXPECT_EQ(table[1], 0.0f);
  }
  EXPECT_THROW(rope_inv_freq(7, kTheta), Error);
}

TEST(Rope, ShapeMismatchThrows) {
  Random rng(57);
  // NH = 4, KV = 2, hd = 6: rows of (4 + 4) * 6 = 48.
  HostTensor qkv(DType::F32, {1, 5, 48});
  qkv.fill_random(rng, -1.0, 1.0);
  HostTensor freqs = make_freqs({1, 5, 4, 2, 6, DType::F32, 5});
  EXPECT_NO_THROW(test_backend()->rope_forward(qkv, freqs, 4, 2, nullptr));
  EXPECT_THROW(test_backend()->rope_forward(qkv, freqs, 4, 3, nullptr), Error);  // 4 % 3
  // NH = 2, KV = 1: hd = 48 / 4 = 12, the table is for hd 6.
  EXPECT_THROW(test_backend()->rope_forward(qkv, freqs, 2, 1, nullptr), Error);
  HostTensor short_table = make_freqs({1, 4, 4, 2, 6, DType::F32, 4});  // 4 positions < T = 5
  EXPECT_THROW(test_backend()->rope_backward(qkv, short_table, 4, 2, nullptr), Error);
  HostTensor f16_table(DType::F16, {5, 3, 2});
  f16_table.fill_random(rng, -1.0, 1.0);
  EXPECT_THROW(test_backend()->rope_forward(qkv, f16_table, 4, 2, nullptr), Error);
  // NH = 3, KV = 3: hd = 48 / 9 is not whole.
  EXPECT_THROW(test_backend()->rope_forward(qkv, freqs, 3, 3, nullptr), Error);
  // Odd head dim: NH = 2, KV = 1 over rows of 4 * 5 = 20.
  HostTensor odd(DType::F32, {1, 5, 20});
  odd.fill_random(rng, -1.0, 1.0);
  HostTensor odd_freqs(DType::F32, {5, 2, 2});
  odd_freqs.fill_random(rng, -1.0, 1.0);
  EXPECT_THROW(test_backend()->rope_forward(odd, odd_freqs, 2, 1, nullptr), Error);
}

}  // namespace
}  // namespace dstrain::test

namespace dstrain::test {
namespace {

// YaRN as DeepSeek-V3 configures it (factor 40, original context 4096, beta_fast 32, beta_slow 1,
// rope head dim 64, theta 10000), against the formula written out here; and the tiny V3
// fixture's (head dim 4, factor 16, original 1024), whose frequencies the reference script
// states: [1, (1/100 + 1/1600) / 2] (tests/reference/make_deepseek_v2_reference.py).
TEST(RopeTable, YarnFrequenciesAsDeepSeekComputesThem) {
  const std::vector<double> tiny = rope_inv_freq_yarn(4, 10000.0, 16.0, 1024.0, 32.0, 1.0);
  ASSERT_EQ(tiny.size(), 2u);
  EXPECT_DOUBLE_EQ(tiny[0], 1.0);
  EXPECT_DOUBLE_EQ(tiny[1], (1.0 / 100 + 1.0 / 1600) / 2);
  const std::vector<double> v3 = rope_inv_freq_yarn(64, 10000.0, 40.0, 4096.0, 32.0, 1.0);
  const double pi = 3.14159265358979323846;
  // corr(32) = 64 ln(4096 / (64 pi)) / (2 ln 10000) = 10.3..., corr(1) = 22.8...
  const double low = std::floor(64 * std::log(4096 / (2 * pi * 32)) / (2 * std::log(10000.0)));
  const double high = std::ceil(64 * std::log(4096 / (2 * pi * 1)) / (2 * std::log(10000.0)));
  ASSERT_EQ(low, 10.0);
  ASSERT_EQ(high, 23.0);
  for (int i = 0; i < 32; ++i) {
    const double original = std::pow(10000.0, -i / 32.0);
    const double ramp = std::min(1.0, std::max(0.0, (i - low) / (high - low)));
    EXPECT_NEAR(v3[i], original * (1 - ramp) + original / 40.0 * ramp, 1e-15 * original) << i;
  }
  EXPECT_DOUBLE_EQ(v3[5], std::pow(10000.0, -5 / 32.0));  // below the ramp: the original one
  EXPECT_NEAR(v3[30], std::pow(10000.0, -30 / 32.0) / 40.0, 1e-18);  // above it: interpolated
  // mscale: 0.1 * 1 * ln(40) + 1; 1 for factor <= 1.
  EXPECT_DOUBLE_EQ(yarn_mscale(40.0, 1.0), 0.1 * std::log(40.0) + 1.0);
  EXPECT_EQ(yarn_mscale(1.0, 1.0), 1.0);
  // The table carries the magnitude on both cos and sin.
  std::vector<float> table(2 * 2 * 3);
  fill_rope_table(table.data(), 3, tiny, 0.5);
  EXPECT_FLOAT_EQ(table[(2 * 2 + 1) * 2], static_cast<float>(0.5 * std::cos(2 * tiny[1])));
  EXPECT_FLOAT_EQ(table[(2 * 2 + 1) * 2 + 1], static_cast<float>(0.5 * std::sin(2 * tiny[1])));
}

}  // namespace
}  // namespace dstrain::test
