// Matmul forward/backward (both weight layouts, with and without bias) against a float64
// reference and finite differences; and the OpenBLAS thread-count finding.
#include <cblas.h>

#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct MatmulCase {
  int64_t N, C, OC;
  bool out_by_in;  // weight (OC,C) used transposed, else weight (C,OC)
  bool with_bias;
  DType dtype;
};

std::vector<int64_t> weight_shape(const MatmulCase& c) {
  return c.out_by_in ? std::vector<int64_t>{c.OC, c.C} : std::vector<int64_t>{c.C, c.OC};
}

double weight_at(const std::vector<double>& w, const MatmulCase& c, int64_t in, int64_t o) {
  return c.out_by_in ? w[o * c.C + in] : w[in * c.OC + o];
}

// out (N,OC) = x (N,C) @ W + bias, in double.
std::vector<double> matmul_reference(const std::vector<double>& x, const std::vector<double>& w,
                                     const std::vector<double>& bias, const MatmulCase& c) {
  std::vector<double> out(static_cast<size_t>(c.N * c.OC));
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t o = 0; o < c.OC; ++o) {
      double sum = bias.empty() ? 0.0 : bias[o];
      for (int64_t in = 0; in < c.C; ++in) sum += x[n * c.C + in] * weight_at(w, c, in, o);
      out[n * c.OC + o] = sum;
    }
  }
  return out;
}

struct MatmulGrads {
  std::vector<double> dinp, dweight, dbias;
};

// Analytic gradients of sum(out * dout) in double (for shapes too big for finite differences).
MatmulGrads matmul_grads_reference(const std::vector<double>& x, const std::vector<double>& w,
                                   const std::vector<double>& dout, const MatmulCase& c) {
  MatmulGrads g;
  g.dinp.assign(static_cast<size_t>(c.N * c.C), 0.0);
  g.dweight.assign(static_cast<size_t>(c.C * c.OC), 0.0);
  g.dbias.assign(static_cast<size_t>(c.OC), 0.0);
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t o = 0; o < c.OC; ++o) {
      const double d = dout[n * c.OC + o];
      g.dbias[o] += d;
      for (int64_t in = 0; in < c.C; ++in) {
        g.dinp[n * c.C + in] += d * weight_at(w, c, in, o);
        const int64_t wi = c.out_by_in ? o * c.C + in : in * c.OC + o;
        g.dweight[wi] += d * x[n * c.C + in];
      }
    }
  }
  return g;
}

Tolerance matmul_tolerance(DType dtype, int64_t K) {
  Tolerance tol = storage_tolerance(dtype);
  if (dtype == DType::F32) {
    // fp32 sums of K products of O(1) terms.
    tol.atol = 2e-6 * std::sqrt(static_cast<double>(K)) + 1e-6;
    tol.rtol = 1e-5;
  }
  return tol;
}

void check_forward(const MatmulCase& c) {
  Random rng(31);
  HostTensor x(c.dtype, {c.N, c.C}), w(c.dtype, weight_shape(c)), out(c.dtype, {c.N, c.OC});
  HostTensor bias(c.dtype, {c.OC});
  x.fill_random(rng, -1.0, 1.0);
  w.fill_random(rng, -1.0, 1.0);
  bias.fill_random(rng, -1.0, 1.0);
  out.fill_nan();
  test_backend()->matmul_forward(out, x, w, c.with_bias ? bias.t() : Tensor(), c.out_by_in,
                                 nullptr);
  const std::vector<double> ref = matmul_reference(
      x.values(), w.values(), c.with_bias ? bias.values() : std::vector<double>{}, c);
  EXPECT_TRUE(all_close(out.values(), ref, matmul_tolerance(c.dtype, c.C)));
  EXPECT_TRUE(guards_intact({&out, &x, &w, &bias}));
}

// Finite differences of L = sum(out * R) (small shapes) or the analytic gradients.
void check_backward(const MatmulCase& c, bool with_dinp, bool finite_differences) {
  Random rng(32);
  HostTensor x(c.dtype, {c.N, c.C}), w(c.dtype, weight_shape(c)), dout(c.dtype, {c.N, c.OC});
  HostTensor dinp(c.dtype, {c.N, c.C}), dweight(c.dtype, weight_shape(c)), dbias(c.dtype, {c.OC});
  const std::vector<double> xv = x.fill_random(rng, -1.0, 1.0);
  const std::vector<double> wv = w.fill_random(rng, -1.0, 1.0);
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  dinp.fill_nan();
  const std::vector<double> dweight_before = dweight.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dbias_before = dbias.fill_random(rng, -1.0, 1.0);
  const HostTensor x_saved = x.clone(), w_saved = w.clone(), dout_saved = dout.clone();
  test_backend()->matmul_backward(with_dinp ? dinp.t() : Tensor(), dweight,
                                  c.with_bias ? dbias.t() : Tensor(), dout, x, w, c.out_by_in,
                                  nullptr);
  MatmulGrads g;
  if (finite_differences) {
    const std::vector<double> b0 = Random(33).vector(static_cast<size_t>(c.OC), -1.0, 1.0);
    g.dinp = numeric_gradient(
        [&](const std::vector<double>& v) { return dot(matmul_reference(v, wv, b0, c), r); }, xv);
    g.dweight = numeric_gradient(
        [&](const std::vector<double>& v) { return dot(matmul_reference(xv, v, b0, c), r); }, wv);
    g.dbias = numeric_gradient(
        [&](const std::vector<double>& v) { return dot(matmul_reference(xv, wv, v, c), r); }, b0);
  } else {
    g = matmul_grads_reference(xv, wv, r, c);
  }
  Tolerance tol = matmul_tolerance(c.dtype, std::max(c.N, c.OC));
  if (finite_differences && c.dtype == DType::F32) tol.atol += 1e-6;
  if (with_dinp) {
    EXPECT_TRUE(all_close(dinp.values(), g.dinp, tol)) << "dinp";
  } else {
    for (int64_t i = 0; i < dinp.numel(); ++i) ASSERT_TRUE(std::isnan(dinp.get(i))) << i;
  }
  EXPECT_TRUE(all_close(dweight.values(), add(dweight_before, g.dweight), tol)) << "dweight";
  if (c.with_bias) {
    EXPECT_TRUE(all_close(dbias.values(), add(dbias_before, g.dbias), tol)) << "dbias";
  } else {
    EXPECT_EQ(dbias.values(), dbias_before) << "dbias was not passed and must be untouched";
  }
  EXPECT_TRUE(guards_intact({&dinp, &dweight, &dbias, &dout, &x, &w}));
  EXPECT_TRUE(bitwise_equal(x, x_saved) && bitwise_equal(w, w_saved) &&
              bitwise_equal(dout, dout_saved))
      << "inputs must be left unchanged";
}

TEST(Matmul, ForwardRoundShapeF32) { check_forward({16, 32, 48, false, true, DType::F32}); }
TEST(Matmul, ForwardOddShapeF32) { check_forward({21, 13, 11, false, true, DType::F32}); }
TEST(Matmul, ForwardOddShapeNoBiasF32) { check_forward({21, 13, 11, false, false, DType::F32}); }
TEST(Matmul, ForwardOddShapeOutByInF32) { check_forward({21, 13, 11, true, false, DType::F32}); }
TEST(Matmul, ForwardOddShapeOutByInBiasF32) { check_forward({21, 13, 11, true, true, DType::F32}); }
TEST(Matmul, ForwardOddShapeF16) { check_forward({21, 13, 11, false, true, DType::F16}); }
TEST(Matmul, ForwardOddShapeBF16) { check_forward({21, 13, 11, false, true, DType::BF16}); }
TEST(Matmul, ForwardOddShapeOutByInBF16) { check_forward({21, 13, 11, true, true, DType::BF16}); }
// Several 256 x 256 output tiles in each direction, with partial edge tiles.
TEST(Matmul, ForwardMultiTileF32) { check_forward({300, 70, 600, false, true, DType::F32}); }
TEST(Matmul, ForwardMultiTileOutByInF32) { check_forward({300, 70, 600, true, true, DType::F32}); }
TEST(Matmul, ForwardMultiTileF16) { check_forward({300, 70, 600, false, true, DType::F16}); }
TEST(Matmul, ForwardMultiTileOutByInBF16) {
  check_forward({300, 70, 600, true, false, DType::BF16});
}

TEST(Matmul, BackwardRoundShapeF32) {
  check_backward({16, 32, 48, false, true, DType::F32}, true, true);
}
TEST(Matmul, BackwardOddShapeF32) {
  check_backward({21, 13, 11, false, true, DType::F32}, true, true);
}
TEST(Matmul, BackwardOddShapeOutByInF32) {
  check_backward({21, 13, 11, true, true, DType::F32}, true, true);
}
TEST(Matmul, BackwardOddShapeNoDinpNoBiasF32) {
  check_backward({21, 13, 11, false, false, DType::F32}, false, true);
}
TEST(Matmul, BackwardOddShapeF16) {
  check_backward({21, 13, 11, false, true, DType::F16}, true, true);
}
TEST(Matmul, BackwardOddShapeBF16) {
  check_backward({21, 13, 11, false, true, DType::BF16}, true, true);
}
TEST(Matmul, BackwardOddShapeOutByInBF16) {
  check_backward({21, 13, 11, true, false, DType::BF16}, true, true);
}
TEST(Matmul, BackwardMultiTileF32) {
  check_backward({300, 70, 600, false, true, DType::F32}, true, false);
}
TEST(Matmul, BackwardMultiTileOutByInF32) {
  check_backward({300, 70, 600, true, false, DType::F32}, true, false);
}
TEST(Matmul, BackwardMultiTileBF16) {
  check_backward({300, 70, 600, false, true, DType::BF16}, true, false);
}

TEST(Matmul, ShapeMismatchThrows) {
  HostTensor x(DType::F32, {4, 8}), w(DType::F32, {7, 5}), out(DType::F32, {4, 5});
  EXPECT_THROW(test_backend()->matmul_forward(out, x, w, Tensor(), false, nullptr), Error);
  HostTensor w_ok(DType::F32, {8, 5}), out_bad(DType::F32, {4, 6});
  EXPECT_THROW(test_backend()->matmul_forward(out_bad, x, w_ok, Tensor(), false, nullptr), Error);
  HostTensor dweight_bad(DType::F32, {5, 8});
  EXPECT_THROW(
      test_backend()->matmul_backward(x, dweight_bad, Tensor(), out, x, w_ok, false, nullptr),
      Error);
}

// bias_backward alone: the column sums of dout added to dbias, against double, and the bits
// matmul_backward's dbias gives (the FP8 linears take their bias gradient from it).
TEST(Matmul, BiasBackwardIsMatmulBackwardsDbias) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    Random rng(35);
    const int64_t N = 37, C = 5, OC = 19;
    HostTensor dout(dtype, {N, OC}), x(dtype, {N, C}), w(dtype, {OC, C}), dw(dtype, {OC, C});
    HostTensor dbias(DType::F32, {OC});
    for (HostTensor* t : {&dout, &x, &w, &dbias}) t->fill_random(rng, -1.0, 1.0);
    HostTensor dbias_matmul = dbias.clone();
    const std::vector<double> before = dbias.values(), dy = dout.values();
    Backend& backend = *test_backend();
    backend.bias_backward(dbias, dout, nullptr);
    backend.matmul_backward(Tensor(), dw, dbias_matmul, dout, x, w, true, nullptr);
    EXPECT_TRUE(bitwise_equal(dbias, dbias_matmul)) << dtype_name(dtype);
    std::vector<double> want = before;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t o = 0; o < OC; ++o) want[o] += dy[n * OC + o];
    }
    EXPECT_TRUE(all_close(dbias.values(), want, {1e-5, 1e-5, 1e-12})) << dtype_name(dtype);
  }
}

// OpenBLAS's multi-threaded sgemm blocks K differently from its single-threaded one, so its
// result bits depend on the thread count (found with OpenBLAS 0.3.21 at K = 1000). The backend
// therefore runs OpenBLAS with 1 thread on a fixed tile grid; this test records whether the
// raw library differs here and requires the backend to be bitwise thread-count independent at
// exactly such a shape.
TEST(Matmul, OpenBlasThreadCountChangesBits) {
  const int M = 257, N = 300, K = 1000;
  Random rng(34);
  std::vector<float> a(static_cast<size_t>(M) * K), b(static_cast<size_t>(K) * N);
  for (float& v : a) v = static_cast<float>(rng.uniform(-1.0, 1.0));
  for (float& v : b) v = static_cast<float>(rng.uniform(-1.0, 1.0));
  std::vector<float> c1(static_cast<size_t>(M) * N), c2(c1.size());
  openblas_set_num_threads(1);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, a.data(), K, b.data(), N,
              0.0f, c1.data(), N);
  openblas_set_num_threads(2);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, a.data(), K, b.data(), N,
              0.0f, c2.data(), N);
  openblas_set_num_threads(1);  // what the backend runs with
  int64_t differing = 0;
  for (size_t i = 0; i < c1.size(); ++i) differing += std::memcmp(&c1[i], &c2[i], 4) != 0;
  RecordProperty("openblas_threaded_sgemm_differing_elements", std::to_string(differing));
  std::cout << "[ info     ] raw OpenBLAS sgemm 1 vs 2 threads (" << M << "x" << N << "x" << K
            << "): " << differing << " of " << c1.size() << " elements differ in bits\n";

  // The backend at the same shape: bitwise equal for 1, 2 and 3 threads.
  HostTensor x(DType::F32, {M, K}), w(DType::F32, {K, N});
  x.fill_random(rng, -1.0, 1.0);
  w.fill_random(rng, -1.0, 1.0);
  HostTensor out1(DType::F32, {M, N});
  make_cpu_backend(1)->matmul_forward(out1, x, w, Tensor(), false, nullptr);
  for (int threads : {2, 3}) {
    HostTensor out(DType::F32, {M, N});
    make_cpu_backend(threads)->matmul_forward(out, x, w, Tensor(), false, nullptr);
    EXPECT_TRUE(bitwise_equal(out1, out)) << threads << " threads";
  }
}

}  // namespace
}  // namespace dstrain::test
