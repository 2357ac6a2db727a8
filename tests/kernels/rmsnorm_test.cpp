// RMSNorm forward/backward (the CPU twin) against a float64 reference and finite differences,
// and the Hugging Face rounding of the normalized value, bit for bit.
// Tolerances: out and gradients storage_tolerance (F16/BF16 round the normalized value and the
// output: two roundings, within one storage tolerance); F32 gradients {2e-5, 2e-4, 1e-9} (central
// differences in double, as for layernorm); rstd is F32 whatever the storage: {1e-5, 1e-5, 1e-10}.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

constexpr float kEps = 1e-5f;

struct RmsnormCase {
  int64_t N, C;
  DType dtype;
};

struct RmsnormResult {
  std::vector<double> out, rstd;
};

// out (N,C) = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), in double (no rounding).
RmsnormResult rmsnorm_reference(const std::vector<double>& x, const std::vector<double>& w,
                                int64_t N, int64_t C) {
  RmsnormResult r;
  r.out.resize(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double squares = 0.0;
    for (int64_t c = 0; c < C; ++c) squares += x[n * C + c] * x[n * C + c];
    const double rstd = 1.0 / std::sqrt(squares / static_cast<double>(C) + kEps);
    for (int64_t c = 0; c < C; ++c) r.out[n * C + c] = x[n * C + c] * rstd * w[c];
    r.rstd.push_back(rstd);
  }
  return r;
}

struct RmsnormInputs {
  HostTensor inp, weight;
};

RmsnormInputs random_inputs(Random& rng, const RmsnormCase& c) {
  RmsnormInputs in{HostTensor(c.dtype, {c.N, c.C}), HostTensor(c.dtype, {c.C})};
  in.inp.fill_random(rng, -2.0, 2.0);
  in.weight.fill_random(rng, 0.5, 1.5);
  return in;
}

void check_forward(const RmsnormCase& c) {
  Random rng(41);
  RmsnormInputs in = random_inputs(rng, c);
  const HostTensor inp_saved = in.inp.clone();
  HostTensor out(c.dtype, {c.N, c.C}), rstd(DType::F32, {c.N});
  out.fill_nan();
  rstd.fill_nan();
  test_backend()->rmsnorm_forward(out, rstd, in.inp, in.weight, kEps, nullptr);
  const RmsnormResult ref = rmsnorm_reference(in.inp.values(), in.weight.values(), c.N, c.C);
  EXPECT_TRUE(all_close(out.values(), ref.out, storage_tolerance(c.dtype))) << "out";
  EXPECT_TRUE(all_close(rstd.values(), ref.rstd, {1e-5, 1e-5, 1e-10})) << "rstd";
  EXPECT_TRUE(bitwise_equal(in.inp, inp_saved)) << "inp must be left unchanged";
  EXPECT_TRUE(guards_intact({&out, &rstd, &in.inp}));
}

void check_backward(const RmsnormCase& c) {
  Random rng(42);
  RmsnormInputs in = random_inputs(rng, c);
  const std::vector<double> x = in.inp.values(), w = in.weight.values();
  HostTensor rstd(DType::F32, {c.N});
  rstd.set(rmsnorm_reference(x, w, c.N, c.C).rstd);
  HostTensor dout(c.dtype, {c.N, c.C});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  // Both gradients accumulate: start from non-zero values.
  HostTensor dinp(c.dtype, {c.N, c.C}), dweight(c.dtype, {c.C});
  const std::vector<double> dinp_before = dinp.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dweight_before = dweight.fill_random(rng, -1.0, 1.0);
  const HostTensor inp_saved = in.inp.clone(), dout_saved = dout.clone();
  test_backend()->rmsnorm_backward(dinp, dweight, dout, in.inp, in.weight, rstd, nullptr);
  EXPECT_TRUE(bitwise_equal(in.inp, inp_saved) && bitwise_equal(dout, dout_saved))
      << "inputs must be left unchanged";

  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    return dot(rmsnorm_reference(xv, wv, c.N, c.C).out, r);
  };
  const std::vector<double> grad_x =
      numeric_gradient([&](const std::vector<double>& v) { return loss(v, w); }, x);
  const std::vector<double> grad_w =
      numeric_gradient([&](const std::vector<double>& v) { return loss(x, v); }, w);
  Tolerance tol = storage_tolerance(c.dtype);
  if (c.dtype == DType::F32) tol = {2e-5, 2e-4, 1e-9};
  EXPECT_TRUE(all_close(dinp.values(), add(dinp_before, grad_x), tol)) << "dinp";
  EXPECT_TRUE(all_close(dweight.values(), add(dweight_before, grad_w), tol)) << "dweight";
  EXPECT_TRUE(guards_intact({&dinp, &dweight, &dout}));
}

TEST(Rmsnorm, ForwardRoundShapeF32) { check_forward({16, 64, DType::F32}); }
TEST(Rmsnorm, ForwardOddShapeF32) { check_forward({7, 37, DType::F32}); }
TEST(Rmsnorm, ForwardRoundShapeF16) { check_forward({16, 64, DType::F16}); }
TEST(Rmsnorm, ForwardOddShapeF16) { check_forward({7, 37, DType::F16}); }
TEST(Rmsnorm, ForwardRoundShapeBF16) { check_forward({16, 64, DType::BF16}); }
TEST(Rmsnorm, ForwardOddShapeBF16) { check_forward({7, 37, DType::BF16}); }

TEST(Rmsnorm, BackwardRoundShapeF32) { check_backward({16, 64, DType::F32}); }
TEST(Rmsnorm, BackwardOddShapeF32) { check_backward({7, 37, DType::F32}); }
// More than one column block (256) in the dweight reduction.
TEST(Rmsnorm, BackwardWideF32) { check_backward({3, 300, DType::F32}); }
TEST(Rmsnorm, BackwardRoundShapeF16) { check_backward({16, 64, DType::F16}); }
TEST(Rmsnorm, BackwardOddShapeF16) { check_backward({7, 37, DType::F16}); }
TEST(Rmsnorm, BackwardRoundShapeBF16) { check_backward({16, 64, DType::BF16}); }
TEST(Rmsnorm, BackwardOddShapeBF16) { check_backward({7, 37, DType::BF16}); }

// Hugging Face's LlamaRMSNorm: weight * (x * rstd).to(input dtype). Given the rstd the op
// reports, out must be exactly round_out(round_inp(x * rstd) * w) in fp32: the normalized value
// is rounded to the INPUT's dtype, the product to the output's. Skipping the first rounding
// changes some of these bits.
void check_huggingface_rounding(DType inp_dtype, DType weight_dtype, DType out_dtype) {
  const int64_t N = 7, C = 37;
  Random rng(43);
  HostTensor inp(inp_dtype, {N, C}), weight(weight_dtype, {C});
  const std::vector<double> x = inp.fill_random(rng, -2.0, 2.0);
  const std::vector<double> w = weight.fill_random(rng, 0.5, 1.5);
  HostTensor out(out_dtype, {N, C}), rstd(DType::F32, {N});
  test_backend()->rmsnorm_forward(out, rstd, inp, weight, kEps, nullptr);
  HostTensor expected(out_dtype, {N, C});
  for (int64_t n = 0; n < N; ++n) {
    const float r = static_cast<float>(rstd.get(n));
    for (int64_t c = 0; c < C; ++c) {
      const float norm = round_through(inp_dtype, static_cast<float>(x[n * C + c]) * r);
      expected.set(n * C + c, norm * static_cast<float>(w[c]));
    }
  }
  EXPECT_TRUE(bitwise_equal(out, expected))
      << dtype_name(inp_dtype) << " inp, " << dtype_name(weight_dtype) << " weight, "
      << dtype_name(out_dtype) << " out";
  EXPECT_TRUE(all_close(rstd.values(), rmsnorm_reference(x, w, N, C).rstd, {1e-5, 1e-5, 1e-10}));
}

TEST(Rmsnorm, RoundsNormalizedValueLikeHuggingFaceBF16) {
  check_huggingface_rounding(DType::BF16, DType::BF16, DType::BF16);
}
TEST(Rmsnorm, RoundsNormalizedValueLikeHuggingFaceF16) {
  check_huggingface_rounding(DType::F16, DType::F16, DType::F16);
}
// Mixed storage: BF16 activations, F32 weight and output: the rounding follows the input.
TEST(Rmsnorm, RoundsNormalizedValueToInputDtypeMixed) {
  check_huggingface_rounding(DType::BF16, DType::F32, DType::F32);
}

TEST(Rmsnorm, ShapeMismatchThrows) {
  HostTensor inp(DType::F32, {4, 8}), out(DType::F32, {4, 8}), weight(DType::F32, {8}),
      weight7(DType::F32, {7}), rstd(DType::F32, {4}), rstd3(DType::F32, {3}),
      rstd_f16(DType::F16, {4}), out_wide(DType::F32, {4, 9});
  Backend& backend = *test_backend();
  EXPECT_THROW(backend.rmsnorm_forward(out, rstd, inp, weight7, kEps, nullptr), Error);
  EXPECT_THROW(backend.rmsnorm_forward(out, rstd3, inp, weight, kEps, nullptr), Error);
  EXPECT_THROW(backend.rmsnorm_forward(out, rstd_f16, inp, weight, kEps, nullptr), Error);
  EXPECT_THROW(backend.rmsnorm_forward(out_wide, rstd, inp, weight, kEps, nullptr), Error);
  EXPECT_THROW(backend.rmsnorm_forward(out, rstd, inp, weight, -1.0f, nullptr), Error);
  HostTensor dinp(DType::F32, {4, 8}), dweight(DType::F32, {8}), dweight7(DType::F32, {7});
  EXPECT_THROW(backend.rmsnorm_backward(dinp, dweight7, out, inp, weight, rstd, nullptr), Error);
  EXPECT_THROW(backend.rmsnorm_backward(out_wide, dweight, out, inp, weight, rstd, nullptr), Error);
  EXPECT_NO_THROW(backend.rmsnorm_forward(out, rstd, inp, weight, kEps, nullptr));
}

}  // namespace
}  // namespace dstrain::test
