// Layernorm forward/backward against a float64 reference and finite differences.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct LayernormCase {
  int64_t N, C;
  DType dtype;
};

struct LayernormResult {
  std::vector<double> out, mean, rstd;
};

LayernormResult layernorm_reference(const std::vector<double>& x, const std::vector<double>& w,
                                    const std::vector<double>& b, int64_t N, int64_t C) {
  LayernormResult r;
  r.out.resize(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double mean = 0.0, var = 0.0;
    for (int64_t c = 0; c < C; ++c) mean += x[n * C + c];
    mean /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) var += (x[n * C + c] - mean) * (x[n * C + c] - mean);
    var /= static_cast<double>(C);
    const double rstd = 1.0 / std::sqrt(var + 1e-5);
    for (int64_t c = 0; c < C; ++c) {
      r.out[n * C + c] = (x[n * C + c] - mean) * rstd * w[c] + b[c];
    }
    r.mean.push_back(mean);
    r.rstd.push_back(rstd);
  }
  return r;
}

struct LayernormInputs {
  HostTensor inp, weight, bias;
};

LayernormInputs random_inputs(Random& rng, const LayernormCase& c) {
  LayernormInputs in{HostTensor(c.dtype, {c.N, c.C}), HostTensor(c.dtype, {c.C}),
                     HostTensor(c.dtype, {c.C})};
  // A row offset so the mean is far from 0 (catches one-pass variance cancellation).
  in.inp.fill_random(rng, 2.0, 4.0);
  in.weight.fill_random(rng, 0.5, 1.5);
  in.bias.fill_random(rng, -0.5, 0.5);
  return in;
}

void check_forward(const LayernormCase& c) {
  Random rng(21);
  LayernormInputs in = random_inputs(rng, c);
  HostTensor out(c.dtype, {c.N, c.C}), mean(DType::F32, {c.N}), rstd(DType::F32, {c.N});
  out.fill_nan();
  mean.fill_nan();
  rstd.fill_nan();
  test_backend()->layernorm_forward(out, mean, rstd, in.inp, in.weight, in.bias, nullptr);
  const LayernormResult ref =
      layernorm_reference(in.inp.values(), in.weight.values(), in.bias.values(), c.N, c.C);
  EXPECT_TRUE(all_close(out.values(), ref.out, storage_tolerance(c.dtype))) << "out";
  // Statistics are F32 whatever the storage: fp32 accuracy on the (rounded) inputs.
  EXPECT_TRUE(all_close(mean.values(), ref.mean, {1e-6, 1e-6, 1e-12})) << "mean";
  EXPECT_TRUE(all_close(rstd.values(), ref.rstd, {1e-5, 1e-5, 1e-10})) << "rstd";
  EXPECT_TRUE(guards_intact({&out, &mean, &rstd, &in.inp}));
}

void check_backward(const LayernormCase& c) {
  Random rng(22);
  LayernormInputs in = random_inputs(rng, c);
  const std::vector<double> x = in.inp.values(), w = in.weight.values(), b = in.bias.values();
  const LayernormResult saved = layernorm_reference(x, w, b, c.N, c.C);
  HostTensor mean(DType::F32, {c.N}), rstd(DType::F32, {c.N});
  mean.set(saved.mean);
  rstd.set(saved.rstd);
  HostTensor dout(c.dtype, {c.N, c.C});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  HostTensor dinp(c.dtype, {c.N, c.C}), dweight(c.dtype, {c.C}), dbias(c.dtype, {c.C});
  const std::vector<double> dinp_before = dinp.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dweight_before = dweight.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dbias_before = dbias.fill_random(rng, -1.0, 1.0);
  const HostTensor inp_saved = in.inp.clone(), dout_saved = dout.clone();
  test_backend()->layernorm_backward(dinp, dweight, dbias, dout, in.inp, in.weight, mean, rstd,
                                     nullptr);
  EXPECT_TRUE(bitwise_equal(in.inp, inp_saved) && bitwise_equal(dout, dout_saved))
      << "inputs must be left unchanged";

  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv,
                  const std::vector<double>& bv) {
    return dot(layernorm_reference(xv, wv, bv, c.N, c.C).out, r);
  };
  const std::vector<double> grad_x =
      numeric_gradient([&](const std::vector<double>& v) { return loss(v, w, b); }, x);
  const std::vector<double> grad_w =
      numeric_gradient([&](const std::vector<double>& v) { return loss(x, v, b); }, w);
  const std::vector<double> grad_b =
      numeric_gradient([&](const std::vector<double>& v) { return loss(x, w, v); }, b);
  Tolerance tol = storage_tolerance(c.dtype);
  if (c.dtype == DType::F32) tol = {2e-5, 2e-4, 1e-9};
  EXPECT_TRUE(all_close(dinp.values(), add(dinp_before, grad_x), tol)) << "dinp";
  EXPECT_TRUE(all_close(dweight.values(), add(dweight_before, grad_w), tol)) << "dweight";
  EXPECT_TRUE(all_close(dbias.values(), add(dbias_before, grad_b), tol)) << "dbias";
  EXPECT_TRUE(guards_intact({&dinp, &dweight, &dbias, &dout}));
}

TEST(Layernorm, ForwardRoundShapeF32) { check_forward({16, 32, DType::F32}); }
TEST(Layernorm, ForwardOddShapeF32) { check_forward({21, 13, DType::F32}); }
// Long rows: fp32 sums over 600 channels.
TEST(Layernorm, ForwardWideF32) { check_forward({5, 600, DType::F32}); }
TEST(Layernorm, ForwardOddShapeF16) { check_forward({21, 13, DType::F16}); }
TEST(Layernorm, ForwardOddShapeBF16) { check_forward({21, 13, DType::BF16}); }

TEST(Layernorm, BackwardRoundShapeF32) { check_backward({16, 32, DType::F32}); }
TEST(Layernorm, BackwardOddShapeF32) { check_backward({21, 13, DType::F32}); }
// More than one column block (256) in the dweight/dbias reductions.
TEST(Layernorm, BackwardWideF32) { check_backward({3, 300, DType::F32}); }
TEST(Layernorm, BackwardOddShapeF16) { check_backward({21, 13, DType::F16}); }
TEST(Layernorm, BackwardOddShapeBF16) { check_backward({21, 13, DType::BF16}); }

TEST(Layernorm, MixedStorageBF16ActivationsF32Params) {
  // Activations in BF16 with F32 parameters and gradients: each tensor keeps its own dtype.
  const int64_t N = 6, C = 10;
  Random rng(23);
  HostTensor inp(DType::BF16, {N, C}), weight(DType::F32, {C}), bias(DType::F32, {C});
  inp.fill_random(rng, -1.0, 1.0);
  weight.fill_random(rng, 0.5, 1.5);
  bias.fill_random(rng, -0.5, 0.5);
  HostTensor out(DType::BF16, {N, C}), mean(DType::F32, {N}), rstd(DType::F32, {N});
  test_backend()->layernorm_forward(out, mean, rstd, inp, weight, bias, nullptr);
  const LayernormResult ref =
      layernorm_reference(inp.values(), weight.values(), bias.values(), N, C);
  EXPECT_TRUE(all_close(out.values(), ref.out, storage_tolerance(DType::BF16)));
  EXPECT_TRUE(all_close(rstd.values(), ref.rstd, {1e-5, 1e-5, 1e-10}));
}

TEST(Layernorm, ShapeMismatchThrows) {
  HostTensor inp(DType::F32, {4, 8}), out(DType::F32, {4, 8}), weight(DType::F32, {7}),
      bias(DType::F32, {8}), mean(DType::F32, {4}), rstd(DType::F32, {4}),
      mean_f16(DType::F16, {4});
  EXPECT_THROW(test_backend()->layernorm_forward(out, mean, rstd, inp, weight, bias, nullptr),
               Error);
  HostTensor weight8(DType::F32, {8});
  EXPECT_THROW(test_backend()->layernorm_forward(out, mean_f16, rstd, inp, weight8, bias, nullptr),
               Error);
}

}  // namespace
}  // namespace dstrain::test
