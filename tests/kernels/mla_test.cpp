// The multi-head latent attention ops' CPU twin (kernels/cpu/cpu_mla.cpp) against float64
// references: mla_pack built as DeepSeek's attention builds its heads (q [nope | rope], k
// [k_nope | k_pe shared by the heads], v), the rotation written as a complex product; the
// backward against the gradient of <pack(x), g> by central differences (pack is linear: exact
// up to rounding); mla_unpad and its backward the same way. Odd shapes (3 heads, dn 4, dr 6,
// dv 5 < D 10), a q scale, DeepSeek's interleaved rope pairs, packed-sequence positions, F32
// and 16-bit storage. Tolerances: F32 forward {1e-6, 1e-6, 1e-12} (a rotation: two products and
// a sum); backward {2e-5, 2e-5, 1e-9} (finite differences, sums over 3 heads); 16-bit
// storage_tolerance.
#include <complex>

#include "kernel_test_util.h"
#include "kernels/rope_table.h"

namespace dstrain::test {
namespace {

constexpr Tolerance kF32{1e-6, 1e-6, 1e-12};
constexpr Tolerance kF32Gradient{2e-5, 2e-5, 1e-9};

struct MlaCase {
  int64_t B, T;
  MlaHeads heads;
  DType dtype;
  std::vector<int32_t> positions = {};  // (B*T) of packed sequences; empty: t
  int64_t H() const { return heads.heads; }
  int64_t D() const { return heads.qk_dim(); }
  int64_t q_width() const { return H() * D(); }
  int64_t kv_width() const { return H() * (heads.nope_dim + heads.v_dim); }
  int64_t rows() const { return B * T; }
};

// The inputs of mla_pack in double: q, kv, k_rope concatenated.
struct PackInputs {
  std::vector<double> q, kv, k_rope;
};

PackInputs split(const std::vector<double>& x, const MlaCase& c) {
  const auto q_end = x.begin() + c.rows() * c.q_width();
  const auto kv_end = q_end + c.rows() * c.kv_width();
  return {std::vector<double>(x.begin(), q_end), std::vector<double>(q_end, kv_end),
          std::vector<double>(kv_end, x.end())};
}

// x (dr) rotated as a complex number per pair (x[i] + i x[i + dr/2], or x[2i] + i x[2i + 1]
// interleaved) times e^(i angle).
std::vector<double> rotated(const double* x, int64_t dr, const float* cos_sin, bool interleaved) {
  std::vector<double> out(static_cast<size_t>(dr));
  for (int64_t i = 0; i < dr / 2; ++i) {
    const int64_t re = interleaved ? 2 * i : i, im = interleaved ? 2 * i + 1 : i + dr / 2;
    const std::complex<double> z(x[re], x[im]);
    const std::complex<double> turned =
        z * std::complex<double>(cos_sin[2 * i], cos_sin[2 * i + 1]);
    out[re] = turned.real();
    out[im] = turned.imag();
  }
  return out;
}

// qkv (B,T,3*H*D) as DeepSeek's attention forms its heads.
std::vector<double> pack_reference(const PackInputs& in, const std::vector<float>& table,
                                   const MlaCase& c) {
  const int64_t D = c.D(), dn = c.heads.nope_dim, dr = c.heads.rope_dim, dv = c.heads.v_dim;
  std::vector<double> qkv(static_cast<size_t>(c.rows() * 3 * c.q_width()), 0.0);
  for (int64_t row = 0; row < c.rows(); ++row) {
    const int64_t p = c.positions.empty() ? row % c.T : c.positions[static_cast<size_t>(row)];
    const float* cos_sin = &table[p * dr];
    const std::vector<double> k_pe =
        rotated(&in.k_rope[row * dr], dr, cos_sin, c.heads.interleaved);
    double* out = &qkv[row * 3 * c.q_width()];
    for (int64_t h = 0; h < c.H(); ++h) {
      const double* q = &in.q[row * c.q_width() + h * D];
      const double* kv = &in.kv[row * c.kv_width() + h * (dn + dv)];
      const std::vector<double> q_pe = rotated(q + dn, dr, cos_sin, c.heads.interleaved);
      for (int64_t k = 0; k < D; ++k) {
        out[h * D + k] = (k < dn ? q[k] : q_pe[k - dn]) * c.heads.q_scale;
        out[c.q_width() + h * D + k] = k < dn ? kv[k] : k_pe[k - dn];
        out[2 * c.q_width() + h * D + k] = k < dv ? kv[dn + k] : 0.0;
      }
    }
  }
  return qkv;
}

std::vector<double> unpad_reference(const std::vector<double>& atty, const MlaCase& c) {
  std::vector<double> out;
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int64_t h = 0; h < c.H(); ++h) {
      const auto head = atty.begin() + row * c.q_width() + h * c.D();
      out.insert(out.end(), head, head + c.heads.v_dim);
    }
  }
  return out;
}

struct PackTensors {
  HostTensor q, kv, k_rope, qkv, freqs, positions;
  std::vector<float> table;
  explicit PackTensors(const MlaCase& c)
      : q(c.dtype, {c.B, c.T, c.q_width()}),
        kv(c.dtype, {c.B, c.T, c.kv_width()}),
        k_rope(c.dtype, {c.B, c.T, int64_t{c.heads.rope_dim}}),
        qkv(c.dtype, {c.B, c.T, 3 * c.q_width()}),
        freqs(DType::F32, {c.T + 3, int64_t{c.heads.rope_dim / 2}, 2}),
        positions(DType::I32, {c.B, c.T}),
        table(rope_table(c.T + 3, c.heads.rope_dim, 10000.0)) {
    freqs.set(std::vector<double>(table.begin(), table.end()));
    for (int64_t i = 0; i < c.rows(); ++i) {
      positions.i32()[i] =
          c.positions.empty() ? static_cast<int32_t>(i % c.T) : c.positions[static_cast<size_t>(i)];
    }
  }
  Tensor position_tensor(const MlaCase& c) const {
    return c.positions.empty() ? Tensor() : positions.t();
  }
};

Tolerance forward_tolerance(DType dtype) {
  return dtype == DType::F32 ? kF32 : storage_tolerance(dtype);
}

void check_pack(const MlaCase& c) {
  Random rng(91);
  PackTensors t(c);
  PackInputs in{t.q.fill_random(rng, -2.0, 2.0), t.kv.fill_random(rng, -2.0, 2.0),
                t.k_rope.fill_random(rng, -2.0, 2.0)};
  t.qkv.fill_random(rng, -1.0, 1.0);  // overwritten
  test_backend()->mla_pack(t.qkv, t.q, t.kv, t.k_rope, t.freqs, t.position_tensor(c), c.heads,
                           nullptr);
  EXPECT_TRUE(
      all_close(t.qkv.values(), pack_reference(in, t.table, c), forward_tolerance(c.dtype)));
  EXPECT_TRUE(guards_intact({&t.q, &t.kv, &t.k_rope, &t.qkv}));
}

void check_pack_backward(const MlaCase& c) {
  Random rng(92);
  PackTensors t(c);
  const std::vector<double> g = t.qkv.fill_random(rng, -1.0, 1.0);  // dqkv
  t.q.fill_random(rng, -1.0, 1.0);                                  // the outputs, overwritten
  t.kv.fill_random(rng, -1.0, 1.0);
  t.k_rope.fill_random(rng, -1.0, 1.0);
  test_backend()->mla_pack_backward(t.q, t.kv, t.k_rope, t.qkv, t.freqs, t.position_tensor(c),
                                    c.heads, nullptr);
  std::vector<double> x(
      static_cast<size_t>(c.rows() * (c.q_width() + c.kv_width() + c.heads.rope_dim)));
  Random point(93);
  for (double& v : x) v = point.uniform(-1.0, 1.0);
  const std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) { return dot(pack_reference(split(v, c), t.table, c), g); },
      x);
  const PackInputs want = split(grad, c);
  const Tolerance tol = c.dtype == DType::F32 ? kF32Gradient : storage_tolerance(c.dtype);
  EXPECT_TRUE(all_close(t.q.values(), want.q, tol)) << "dq";
  EXPECT_TRUE(all_close(t.kv.values(), want.kv, tol)) << "dkv";
  EXPECT_TRUE(all_close(t.k_rope.values(), want.k_rope, tol)) << "dk_rope";
  EXPECT_TRUE(guards_intact({&t.q, &t.kv, &t.k_rope, &t.qkv}));
}

const MlaHeads kOdd{3, 4, 6, 5};                                   // D 10, v padded by 5
const MlaHeads kNoPadding{2, 8, 4, 12};                            // dv = D: no padding
const MlaHeads kScaled{3, 4, 6, 5, 1.3f};                          // V3's q scale (YaRN's mscale^2)
const MlaHeads kInterleaved{3, 4, 6, 5, 1.0f, true};               // DeepSeek's pair order
const std::vector<int32_t> kPacked{0, 1, 2, 0, 1, 0, 1, 2, 3, 4};  // B 2, T 5

TEST(MlaPack, OddHeadsF32) { check_pack({2, 5, kOdd, DType::F32}); }
TEST(MlaPack, OddHeadsBF16) { check_pack({2, 5, kOdd, DType::BF16}); }
TEST(MlaPack, PackedSequencesF16) { check_pack({2, 5, kOdd, DType::F16, kPacked}); }
TEST(MlaPack, VAsWideAsQkF32) { check_pack({1, 7, kNoPadding, DType::F32}); }
TEST(MlaPackBackward, OddHeadsMatchesFiniteDifferencesF32) {
  check_pack_backward({2, 5, kOdd, DType::F32});
}
TEST(MlaPackBackward, PackedSequencesF32) {
  check_pack_backward({2, 5, kOdd, DType::F32, kPacked});
}
TEST(MlaPackBackward, OddHeadsBF16) { check_pack_backward({1, 3, kOdd, DType::BF16}); }
TEST(MlaPack, QScaledF32) { check_pack({2, 5, kScaled, DType::F32}); }
TEST(MlaPack, InterleavedPairsF32) { check_pack({2, 5, kInterleaved, DType::F32}); }
TEST(MlaPack, InterleavedPairsPackedBF16) {
  check_pack({2, 5, kInterleaved, DType::BF16, kPacked});
}
TEST(MlaPackBackward, InterleavedPairsMatchesFiniteDifferencesF32) {
  check_pack_backward({2, 5, kInterleaved, DType::F32, kPacked});
}
TEST(MlaPackBackward, QScaledMatchesFiniteDifferencesF32) {
  check_pack_backward({2, 5, kScaled, DType::F32, kPacked});
}

void check_unpad(const MlaCase& c) {
  Random rng(94);
  HostTensor atty(c.dtype, {c.B, c.T, c.q_width()});
  HostTensor out(c.dtype, {c.B, c.T, c.H() * c.heads.v_dim});
  const std::vector<double> a = atty.fill_random(rng, -2.0, 2.0);
  out.fill_random(rng, -1.0, 1.0);
  test_backend()->mla_unpad(out, atty, c.heads, nullptr);
  EXPECT_TRUE(all_close(out.values(), unpad_reference(a, c), forward_tolerance(c.dtype)));
  // The backward: the gradient of <unpad(atty), g>.
  const std::vector<double> g = out.fill_random(rng, -1.0, 1.0);
  atty.fill_random(rng, -1.0, 1.0);  // overwritten
  test_backend()->mla_unpad_backward(atty, out, c.heads, nullptr);
  const std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) { return dot(unpad_reference(v, c), g); }, a);
  EXPECT_TRUE(all_close(atty.values(), grad,
                        c.dtype == DType::F32 ? kF32Gradient : storage_tolerance(c.dtype)));
  EXPECT_TRUE(guards_intact({&atty, &out}));
}

TEST(MlaUnpad, OddHeadsF32) { check_unpad({2, 5, kOdd, DType::F32}); }
TEST(MlaUnpad, OddHeadsBF16) { check_unpad({3, 2, kOdd, DType::BF16}); }

TEST(MlaPack, BadShapesThrow) {
  const MlaCase c{1, 4, kOdd, DType::F32};
  PackTensors t(c);
  HostTensor wrong(DType::F32, {1, 4, c.q_width() + 1});
  EXPECT_THROW(
      test_backend()->mla_pack(t.qkv, wrong, t.kv, t.k_rope, t.freqs, Tensor(), c.heads, nullptr),
      Error);
  EXPECT_THROW(test_backend()->mla_pack(t.qkv, t.q, t.kv, t.k_rope, t.freqs, Tensor(),
                                        MlaHeads{3, 4, 5, 5}, nullptr),
               Error);  // an odd rope dim
  EXPECT_THROW(test_backend()->mla_unpad(t.q, t.qkv, MlaHeads{3, 4, 6, 11}, nullptr), Error);
}

}  // namespace
}  // namespace dstrain::test
