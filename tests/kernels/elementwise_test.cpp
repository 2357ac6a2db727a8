// GELU, residual and accumulate against float64 references and finite differences.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

double gelu_reference(double x) {
  const double s = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(s * (x + 0.044715 * x * x * x)));
}

void check_gelu_forward(std::vector<int64_t> shape, DType dtype) {
  Random rng(51);
  HostTensor inp(dtype, shape), out(dtype, shape);
  const std::vector<double> x = inp.fill_random(rng, -5.0, 5.0);
  out.fill_nan();
  test_backend()->gelu_forward(out, inp, nullptr);
  std::vector<double> ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) ref[i] = gelu_reference(x[i]);
  EXPECT_TRUE(all_close(out.values(), ref, storage_tolerance(dtype)));
  EXPECT_TRUE(guards_intact({&out, &inp}));
}

void check_gelu_backward(std::vector<int64_t> shape, DType dtype) {
  Random rng(52);
  HostTensor inp(dtype, shape), dout(dtype, shape), dinp(dtype, shape);
  const std::vector<double> x = inp.fill_random(rng, -5.0, 5.0);
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  dinp.fill_nan();
  test_backend()->gelu_backward(dinp, dout, inp, nullptr);
  // Elementwise: d/dx_i of sum(gelu(x) * R) is one central difference per element.
  std::vector<double> grad(x.size());
  const double eps = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    grad[i] = (gelu_reference(x[i] + eps) - gelu_reference(x[i] - eps)) / (2 * eps) * r[i];
  }
  Tolerance tol = storage_tolerance(dtype);
  if (dtype == DType::F32) tol = {1e-6, 1e-5, 1e-11};
  EXPECT_TRUE(all_close(dinp.values(), grad, tol));
  EXPECT_TRUE(guards_intact({&dinp, &dout, &inp}));
}

TEST(Gelu, ForwardRoundShapeF32) { check_gelu_forward({2, 8, 32}, DType::F32); }
TEST(Gelu, ForwardOddShapeF32) { check_gelu_forward({3, 7, 13}, DType::F32); }
TEST(Gelu, ForwardOddShapeF16) { check_gelu_forward({3, 7, 13}, DType::F16); }
TEST(Gelu, ForwardOddShapeBF16) { check_gelu_forward({3, 7, 13}, DType::BF16); }
// Several fixed chunks (8192 elements) with a partial last one.
TEST(Gelu, ForwardMultiChunkBF16) { check_gelu_forward({3, 7001}, DType::BF16); }
TEST(Gelu, BackwardRoundShapeF32) { check_gelu_backward({2, 8, 32}, DType::F32); }
TEST(Gelu, BackwardOddShapeF32) { check_gelu_backward({3, 7, 13}, DType::F32); }
TEST(Gelu, BackwardOddShapeF16) { check_gelu_backward({3, 7, 13}, DType::F16); }
TEST(Gelu, BackwardOddShapeBF16) { check_gelu_backward({3, 7, 13}, DType::BF16); }
TEST(Gelu, BackwardMultiChunkF32) { check_gelu_backward({3, 7001}, DType::F32); }

// gelu_backward_bias: dinp bitwise gelu_backward's (the same op), dbias (accumulated onto random
// values) against the float64 column sums of the finite-difference gradient of sum(gelu(x) * R)
// w.r.t. the bias that feeds x: d/db_c = sum over rows of gelu'(x) R. F32 {1e-5, 1e-5, 1e-10};
// F16/BF16 inputs the storage tolerance of dinp, summed over the rows.
void check_gelu_backward_bias(int64_t N, int64_t C, DType dtype) {
  Random rng(54);
  HostTensor inp(dtype, {N, C}), dout(dtype, {N, C}), dinp(dtype, {N, C}), alone(dtype, {N, C});
  HostTensor dbias(DType::F32, {C});
  const std::vector<double> x = inp.fill_random(rng, -5.0, 5.0);
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  const std::vector<double> bias0 = dbias.fill_random(rng, -1.0, 1.0);
  test_backend()->gelu_backward_bias(dinp, dbias, dout, inp, nullptr);
  test_backend()->gelu_backward(alone, dout, inp, nullptr);
  EXPECT_TRUE(bitwise_equal(dinp, alone));
  std::vector<double> expected(bias0);
  const double eps = 1e-6;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      const double xi = x[n * C + c];
      expected[c] +=
          (gelu_reference(xi + eps) - gelu_reference(xi - eps)) / (2 * eps) * r[n * C + c];
    }
  }
  Tolerance tol = {1e-5, 1e-5, 1e-10};
  if (dtype != DType::F32) {
    const Tolerance one = storage_tolerance(dtype);
    tol = {one.atol * static_cast<double>(N), one.rtol, one.nmse};
  }
  EXPECT_TRUE(all_close(dbias.values(), expected, tol));
  EXPECT_TRUE(guards_intact({&dinp, &dbias, &dout, &inp}));
}

TEST(Gelu, BackwardBiasF32) { check_gelu_backward_bias(37, 300, DType::F32); }
TEST(Gelu, BackwardBiasBF16) { check_gelu_backward_bias(37, 300, DType::BF16); }
// An empty dbias: the op is gelu_backward.
TEST(Gelu, BackwardBiasWithoutABiasIsTheGeluBackward) {
  Random rng(55);
  HostTensor inp(DType::F32, {5, 9}), dout(DType::F32, {5, 9}), a(DType::F32, {5, 9}),
      b(DType::F32, {5, 9});
  inp.fill_random(rng, -3.0, 3.0);
  dout.fill_random(rng, -1.0, 1.0);
  test_backend()->gelu_backward_bias(a, Tensor(), dout, inp, nullptr);
  test_backend()->gelu_backward(b, dout, inp, nullptr);
  EXPECT_TRUE(bitwise_equal(a, b));
  double squares = 0.0;
  for (double v : a.values()) squares += v * v;
  EXPECT_GT(squares, 0.0);
}

TEST(Gelu, LargeInputsStayFinite) {
  HostTensor inp(DType::F32, {4}), out(DType::F32, {4}), dinp(DType::F32, {4}),
      dout(DType::F32, {4});
  inp.set({-100.0, 100.0, -1e4, 1e4});
  dout.set({1.0, 1.0, 1.0, 1.0});
  test_backend()->gelu_forward(out, inp, nullptr);
  test_backend()->gelu_backward(dinp, dout, inp, nullptr);
  EXPECT_EQ(out.get(0), 0.0);
  EXPECT_EQ(out.get(1), 100.0);
  EXPECT_EQ(dinp.get(0), 0.0);
  EXPECT_EQ(dinp.get(1), 1.0);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::isfinite(out.get(i)) && std::isfinite(dinp.get(i))) << i;
  }
}

void check_residual(std::vector<int64_t> shape, DType dtype) {
  Random rng(53);
  HostTensor a(dtype, shape), b(dtype, shape), out(dtype, shape);
  const std::vector<double> av = a.fill_random(rng, -1.0, 1.0);
  const std::vector<double> bv = b.fill_random(rng, -1.0, 1.0);
  out.fill_nan();
  test_backend()->residual_forward(out, a, b, nullptr);
  EXPECT_TRUE(all_close(out.values(), add(av, bv), storage_tolerance(dtype)));
  EXPECT_TRUE(guards_intact({&out, &a, &b}));
  // The backward of a residual is the identity into each branch; the ops use accumulate.
  HostTensor dst = a.clone();
  test_backend()->accumulate(dst, b, nullptr);
  EXPECT_TRUE(bitwise_equal(dst, out)) << "accumulate must round like residual_forward";
  EXPECT_TRUE(guards_intact({&dst}));
}

TEST(Residual, ForwardRoundShapeF32) { check_residual({2, 8, 32}, DType::F32); }
TEST(Residual, ForwardOddShapeF32) { check_residual({3, 7, 13}, DType::F32); }
TEST(Residual, ForwardOddShapeF16) { check_residual({3, 7, 13}, DType::F16); }
TEST(Residual, ForwardOddShapeBF16) { check_residual({3, 7, 13}, DType::BF16); }
TEST(Residual, ForwardMultiChunkF16) { check_residual({2, 9001}, DType::F16); }

TEST(Accumulate, MixedDTypesF32PlusBF16) {
  Random rng(54);
  HostTensor dst(DType::F32, {3, 7, 13}), src(DType::BF16, {3, 7, 13});
  const std::vector<double> before = dst.fill_random(rng, -1.0, 1.0);
  const std::vector<double> s = src.fill_random(rng, -1.0, 1.0);
  test_backend()->accumulate(dst, src, nullptr);
  EXPECT_TRUE(all_close(dst.values(), add(before, s), storage_tolerance(DType::F32)));
  EXPECT_TRUE(guards_intact({&dst, &src}));
}

// x (N,OC) += bias (OC): each element rounded once, to x's dtype.
void check_add_bias(int64_t N, int64_t OC, DType dtype, DType bias_dtype) {
  Random rng(55);
  HostTensor x(dtype, {N, OC}), bias(bias_dtype, {OC});
  const std::vector<double> before = x.fill_random(rng, -1.0, 1.0);
  const std::vector<double> b = bias.fill_random(rng, -1.0, 1.0);
  test_backend()->add_bias(x, bias, nullptr);
  std::vector<double> expected(before.size());
  for (size_t i = 0; i < before.size(); ++i) expected[i] = before[i] + b[i % OC];
  EXPECT_TRUE(all_close(x.values(), expected, storage_tolerance(dtype)));
  EXPECT_TRUE(guards_intact({&x, &bias}));
}

TEST(AddBias, RoundShapeF32) { check_add_bias(16, 64, DType::F32, DType::F32); }
TEST(AddBias, OddShapeBF16) { check_add_bias(7, 37, DType::BF16, DType::BF16); }
TEST(AddBias, OddShapeF16WithF32Bias) { check_add_bias(7, 37, DType::F16, DType::F32); }

TEST(AddBias, ShapeMismatchThrows) {
  HostTensor x(DType::F32, {3, 4}), bias(DType::F32, {3});
  EXPECT_THROW(test_backend()->add_bias(x, bias, nullptr), Error);
}

TEST(Accumulate, SizeMismatchThrows) {
  HostTensor dst(DType::F32, {4}), src(DType::F32, {5});
  EXPECT_THROW(test_backend()->accumulate(dst, src, nullptr), Error);
  HostTensor tokens(DType::I32, {4});
  EXPECT_THROW(test_backend()->accumulate(dst, tokens, nullptr), Error);
}

}  // namespace
}  // namespace dstrain::test
