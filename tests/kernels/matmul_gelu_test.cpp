// matmul_gelu_forward (the MLP up-projection) on the CPU backend: bitwise matmul_forward then
// gelu_forward, as kernels/ops.h defines it, for every dtype mix, round and odd shapes, with and
// without bias; and against a float64 reference of that definition (GELU of the STORED,
// rounded pre_gelu -- what selective recompute recomputes).
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct MatmulGeluCase {
  int64_t N, C, OC;
};

const MatmulGeluCase kCases[] = {{16, 32, 48}, {7, 13, 11}, {300, 70, 600}};

struct Dtypes {
  DType inp, weight, bias, pre_gelu, out;
};
Dtypes uniform(DType dtype) { return {dtype, dtype, dtype, dtype, dtype}; }

std::string case_name(const MatmulGeluCase& c, const Dtypes& d, bool with_bias) {
  return std::string("N=") + std::to_string(c.N) + " C=" + std::to_string(c.C) +
         " OC=" + std::to_string(c.OC) + " inp " + dtype_name(d.inp) + " weight " +
         dtype_name(d.weight) + " pre_gelu " + dtype_name(d.pre_gelu) + " out " +
         dtype_name(d.out) + (with_bias ? " bias " + std::string(dtype_name(d.bias)) : "");
}

double gelu_reference(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

void check(const MatmulGeluCase& c, const Dtypes& d, bool with_bias) {
  SCOPED_TRACE(case_name(c, d, with_bias));
  Random rng(61);
  HostTensor inp(d.inp, {c.N, c.C}), weight(d.weight, {c.C, c.OC}), bias(d.bias, {c.OC});
  const std::vector<double> x = inp.fill_random(rng, -1.0, 1.0);
  const std::vector<double> w = weight.fill_random(rng, -1.0, 1.0);
  const std::vector<double> b = bias.fill_random(rng, -1.0, 1.0);
  HostTensor pre_gelu(d.pre_gelu, {c.N, c.OC}), out(d.out, {c.N, c.OC});
  pre_gelu.fill_nan();
  out.fill_nan();
  HostTensor pre_gelu_composed = pre_gelu.clone(), out_composed = out.clone();
  const HostTensor inp_saved = inp.clone(), weight_saved = weight.clone();
  const Tensor bias_view = with_bias ? bias.t() : Tensor();

  test_backend()->matmul_gelu_forward(out, pre_gelu, inp, weight, bias_view, nullptr);
  test_backend()->matmul_forward(pre_gelu_composed, inp, weight, bias_view, false, nullptr);
  test_backend()->gelu_forward(out_composed, pre_gelu_composed, nullptr);

  EXPECT_TRUE(bitwise_equal(pre_gelu, pre_gelu_composed)) << "pre_gelu";
  EXPECT_TRUE(bitwise_equal(out, out_composed)) << "out";
  // The definition in float64: pre_gelu = x @ w + b; out = gelu(pre_gelu as stored).
  std::vector<double> pre_ref(static_cast<size_t>(c.N * c.OC)), out_ref(pre_ref.size());
  const std::vector<double> pre_stored = pre_gelu.values();
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t o = 0; o < c.OC; ++o) {
      double sum = with_bias ? b[o] : 0.0;
      for (int64_t i = 0; i < c.C; ++i) sum += x[n * c.C + i] * w[i * c.OC + o];
      pre_ref[n * c.OC + o] = sum;
      out_ref[n * c.OC + o] = gelu_reference(pre_stored[n * c.OC + o]);
    }
  }
  Tolerance pre_tol = storage_tolerance(d.pre_gelu);
  if (d.pre_gelu == DType::F32) pre_tol = {2e-6 * std::sqrt(double(c.C)) + 1e-6, 1e-5, 1e-10};
  EXPECT_TRUE(all_close(pre_stored, pre_ref, pre_tol)) << "pre_gelu vs float64";
  EXPECT_TRUE(all_close(out.values(), out_ref, storage_tolerance(d.out))) << "out vs float64";
  EXPECT_TRUE(bitwise_equal(inp, inp_saved) && bitwise_equal(weight, weight_saved))
      << "inputs must be left unchanged";
  EXPECT_TRUE(guards_intact({&out, &pre_gelu, &inp, &weight, &bias}));
}

void check_every_case(const Dtypes& d) {
  for (const MatmulGeluCase& c : kCases) {
    for (bool with_bias : {true, false}) check(c, d, with_bias);
  }
}

TEST(MatmulGelu, IsMatmulThenGeluBitwiseF32) { check_every_case(uniform(DType::F32)); }
TEST(MatmulGelu, IsMatmulThenGeluBitwiseF16) { check_every_case(uniform(DType::F16)); }
TEST(MatmulGelu, IsMatmulThenGeluBitwiseBF16) { check_every_case(uniform(DType::BF16)); }
// Each tensor its own dtype: F32 out of a BF16 pre_gelu, 16-bit out of an F32 pre_gelu.
TEST(MatmulGelu, IsMatmulThenGeluBitwiseMixedDTypes) {
  check_every_case({DType::BF16, DType::F32, DType::F32, DType::BF16, DType::F32});
  check_every_case({DType::F32, DType::F32, DType::F16, DType::F32, DType::F16});
}

// With a 16-bit pre_gelu the GELU of the fp32 sum (what cuBLASLt's GELU_AUX_BIAS epilogue would
// compute) and the GELU of the stored pre_gelu differ: the op must be the second.
TEST(MatmulGelu, GeluReadsTheRoundedPreGeluNotTheFp32Sum) {
  const MatmulGeluCase c{32, 64, 48};
  Random rng(62);
  HostTensor inp(DType::F32, {c.N, c.C}), weight(DType::F32, {c.C, c.OC});
  inp.fill_random(rng, -1.0, 1.0);
  weight.fill_random(rng, -1.0, 1.0);
  HostTensor pre_gelu(DType::BF16, {c.N, c.OC}), out(DType::F32, {c.N, c.OC});
  HostTensor unrounded(DType::F32, {c.N, c.OC}), out_of_unrounded(DType::F32, {c.N, c.OC});
  test_backend()->matmul_gelu_forward(out, pre_gelu, inp, weight, Tensor(), nullptr);
  test_backend()->matmul_forward(unrounded, inp, weight, Tensor(), false, nullptr);
  test_backend()->gelu_forward(out_of_unrounded, unrounded, nullptr);
  int64_t differ = 0;
  for (int64_t i = 0; i < out.numel(); ++i) differ += out.get(i) != out_of_unrounded.get(i);
  EXPECT_GT(differ, out.numel() / 2) << "the case must tell the two definitions apart";
}

TEST(MatmulGelu, RejectsOverlappingOutputsAndBadShapes) {
  Random rng(63);
  HostTensor inp(DType::F32, {4, 8}), weight(DType::F32, {8, 6}), both(DType::F32, {2, 4, 6});
  inp.fill_random(rng, -1.0, 1.0);
  weight.fill_random(rng, -1.0, 1.0);
  const Tensor whole = both.t();
  EXPECT_THROW(test_backend()->matmul_gelu_forward(whole.slice(0, {4, 6}), whole.slice(0, {4, 6}),
                                                   inp, weight, Tensor(), nullptr),
               Error);
  EXPECT_THROW(test_backend()->matmul_gelu_forward(whole.slice(0, {4, 6}), whole.slice(3, {4, 6}),
                                                   inp, weight, Tensor(), nullptr),
               Error);
  HostTensor out(DType::F32, {4, 5}), pre_gelu(DType::F32, {4, 6});
  EXPECT_THROW(test_backend()->matmul_gelu_forward(out, pre_gelu, inp, weight, Tensor(), nullptr),
               Error);
}

}  // namespace
}  // namespace dstrain::test
