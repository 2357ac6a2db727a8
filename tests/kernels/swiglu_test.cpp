// SwiGLU forward/backward (the CPU twin) against a float64 reference and finite differences.
// Tolerances: F16/BF16 storage_tolerance (one rounding of each stored output); F32 forward
// {1e-6, 1e-5, 1e-11} (a few fp32 ulps through expf); F32 gradients {2e-5, 2e-4, 1e-9}
// (central differences in double, as for layernorm).
#include <cmath>

#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct SwigluCase {
  int64_t N, I;
  DType dtype;
};

// out (N,I) = silu(gate) * up over inp (N,2I) = [gate | up] per row, in double.
std::vector<double> swiglu_reference(const std::vector<double>& inp, int64_t N, int64_t I) {
  std::vector<double> out(static_cast<size_t>(N * I));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < I; ++i) {
      const double gate = inp[n * 2 * I + i], up = inp[n * 2 * I + I + i];
      out[n * I + i] = gate / (1.0 + std::exp(-gate)) * up;
    }
  }
  return out;
}

// Gates over [-6, 6] reach both tails of the sigmoid; ups in [-2, 2].
HostTensor random_inputs(Random& rng, const SwigluCase& c) {
  HostTensor inp(c.dtype, {c.N, 2 * c.I});
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t i = 0; i < c.I; ++i) {
      inp.set(n * 2 * c.I + i, rng.uniform(-6.0, 6.0));
      inp.set(n * 2 * c.I + c.I + i, rng.uniform(-2.0, 2.0));
    }
  }
  return inp;
}

void check_forward(const SwigluCase& c) {
  Random rng(51);
  HostTensor inp = random_inputs(rng, c);
  const HostTensor inp_saved = inp.clone();
  HostTensor out(c.dtype, {c.N, c.I});
  out.fill_nan();
  test_backend()->swiglu_forward(out, inp, Tensor(), nullptr);
  const Tolerance tol =
      c.dtype == DType::F32 ? Tolerance{1e-6, 1e-5, 1e-11} : storage_tolerance(c.dtype);
  EXPECT_TRUE(all_close(out.values(), swiglu_reference(inp.values(), c.N, c.I), tol));
  EXPECT_TRUE(bitwise_equal(inp, inp_saved)) << "inp must be left unchanged";
  EXPECT_TRUE(guards_intact({&out, &inp}));
}

void check_backward(const SwigluCase& c) {
  Random rng(52);
  HostTensor inp = random_inputs(rng, c);
  HostTensor dout(c.dtype, {c.N, c.I});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  // dinp is overwritten, not accumulated: non-zero starting values must not show through.
  HostTensor dinp(c.dtype, {c.N, 2 * c.I});
  dinp.fill_random(rng, -1.0, 1.0);
  const HostTensor inp_saved = inp.clone(), dout_saved = dout.clone();
  test_backend()->swiglu_backward(dinp, dout, inp, Tensor(), nullptr);
  EXPECT_TRUE(bitwise_equal(inp, inp_saved) && bitwise_equal(dout, dout_saved))
      << "inputs must be left unchanged";
  const std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) { return dot(swiglu_reference(v, c.N, c.I), r); },
      inp.values());
  Tolerance tol = storage_tolerance(c.dtype);
  if (c.dtype == DType::F32) tol = {2e-5, 2e-4, 1e-9};
  EXPECT_TRUE(all_close(dinp.values(), grad, tol)) << "dinp";
  EXPECT_TRUE(guards_intact({&dinp, &dout, &inp}));
}

TEST(Swiglu, ForwardRoundShapeF32) { check_forward({16, 64, DType::F32}); }
TEST(Swiglu, ForwardOddShapeF32) { check_forward({7, 37, DType::F32}); }
TEST(Swiglu, ForwardRoundShapeF16) { check_forward({16, 64, DType::F16}); }
TEST(Swiglu, ForwardOddShapeF16) { check_forward({7, 37, DType::F16}); }
TEST(Swiglu, ForwardRoundShapeBF16) { check_forward({16, 64, DType::BF16}); }
TEST(Swiglu, ForwardOddShapeBF16) { check_forward({7, 37, DType::BF16}); }

TEST(Swiglu, BackwardRoundShapeF32) { check_backward({16, 64, DType::F32}); }
TEST(Swiglu, BackwardOddShapeF32) { check_backward({7, 37, DType::F32}); }
TEST(Swiglu, BackwardRoundShapeF16) { check_backward({16, 64, DType::F16}); }
TEST(Swiglu, BackwardOddShapeF16) { check_backward({7, 37, DType::F16}); }
TEST(Swiglu, BackwardRoundShapeBF16) { check_backward({16, 64, DType::BF16}); }
TEST(Swiglu, BackwardOddShapeBF16) { check_backward({7, 37, DType::BF16}); }

// Gates far in the tails (exp(-gate) overflows to inf, or underflows): finite results at the
// limits silu(-inf) = 0 with zero slope, silu(+inf) = gate with slope 1.
TEST(Swiglu, ExtremeGatesStayFinite) {
  const int64_t I = 2;
  HostTensor inp(DType::F32, {1, 2 * I}), out(DType::F32, {1, I}), dout(DType::F32, {1, I}),
      dinp(DType::F32, {1, 2 * I});
  inp.set({-200.0, 200.0, 3.0, 5.0});  // [gate | up]
  dout.set({1.0, 1.0});
  test_backend()->swiglu_forward(out, inp, Tensor(), nullptr);
  test_backend()->swiglu_backward(dinp, dout, inp, Tensor(), nullptr);
  EXPECT_EQ(out.get(0), 0.0);
  EXPECT_EQ(out.get(1), 200.0 * 5.0);
  EXPECT_EQ(dinp.get(0), 0.0);    // dgate = dout * up * silu'(-200) = 0
  EXPECT_EQ(dinp.get(1), 5.0);    // dgate = dout * up * silu'(200) = up
  EXPECT_EQ(dinp.get(2), 0.0);    // dup = dout * silu(-200) = 0
  EXPECT_EQ(dinp.get(3), 200.0);  // dup = dout * silu(200) = 200
}

// Asked for it, forward and backward find max |output| as stored (found here from the outputs'
// values), and leave the outputs as without it.
TEST(Swiglu, TheAmaxFoundIsTheOutputsLargestMagnitude) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const SwigluCase c{9, 24, dtype};
    Random rng(53);
    HostTensor inp = random_inputs(rng, c);
    HostTensor dout(dtype, {c.N, c.I});
    dout.fill_random(rng, -1.0, 1.0);
    HostTensor out(dtype, {c.N, c.I}), plain_out(dtype, {c.N, c.I}), amax(DType::F32, {1});
    HostTensor dinp(dtype, {c.N, 2 * c.I}), plain_dinp(dtype, {c.N, 2 * c.I});
    HostTensor damax(DType::F32, {1});
    test_backend()->swiglu_forward(out, inp, amax, nullptr);
    test_backend()->swiglu_forward(plain_out, inp, Tensor(), nullptr);
    test_backend()->swiglu_backward(dinp, dout, inp, damax, nullptr);
    test_backend()->swiglu_backward(plain_dinp, dout, inp, Tensor(), nullptr);
    auto largest = [](const HostTensor& t) {
      double m = 0.0;
      for (double v : t.values()) m = std::max(m, std::fabs(v));
      return m;
    };
    EXPECT_EQ(amax.get(0), largest(out)) << dtype_name(dtype);
    EXPECT_EQ(damax.get(0), largest(dinp)) << dtype_name(dtype);
    EXPECT_TRUE(bitwise_equal(out, plain_out) && bitwise_equal(dinp, plain_dinp));
    HostTensor wide(DType::F32, {2});
    EXPECT_THROW(test_backend()->swiglu_forward(out, inp, wide, nullptr), Error);
  }
}

TEST(Swiglu, ShapeMismatchThrows) {
  HostTensor inp(DType::F32, {4, 16}), out(DType::F32, {4, 8}), out_wide(DType::F32, {4, 9}),
      out_rows(DType::F32, {3, 8}), inp_odd(DType::F32, {4, 15}), dinp_wide(DType::F32, {4, 18});
  Backend& backend = *test_backend();
  EXPECT_THROW(backend.swiglu_forward(out_wide, inp, Tensor(), nullptr), Error);
  EXPECT_THROW(backend.swiglu_forward(out_rows, inp, Tensor(), nullptr), Error);
  EXPECT_THROW(backend.swiglu_forward(out, inp_odd, Tensor(), nullptr), Error);
  EXPECT_THROW(backend.swiglu_backward(dinp_wide, out, inp, Tensor(), nullptr), Error);
  EXPECT_THROW(backend.swiglu_backward(inp, out_wide, inp, Tensor(), nullptr), Error);
}

}  // namespace
}  // namespace dstrain::test
