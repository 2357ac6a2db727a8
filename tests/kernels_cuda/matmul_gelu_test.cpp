// matmul_gelu_forward on CUDA (cuBLASLt BIAS epilogue + the GELU kernel) against the CPU twin,
// every dtype, round and odd shapes, with and without bias, and mixed dtypes that take the
// cuBLAS fallbacks; and bitwise against the CUDA backend's own matmul_forward + gelu_forward,
// which kernels/ops.h requires (backward and selective recompute read those bits).
// Tolerances: pre_gelu as matmul_forward's out (tests/kernels_cuda/matmul_test.cpp); out adds
// gelu' (<= 1.13) times pre_gelu's difference (a whole unit when pre_gelu is 16-bit) and tanhf's
// last bit: pre_gelu's tolerance, atol x1.2, rtol and nmse x2; for a 16-bit out at least its
// storage_tolerance.
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct MatmulGeluCase {
  int64_t N, C, OC;
};

const MatmulGeluCase kCases[] = {{128, 256, 384}, {7, 13, 11}, {64, 1024, 96}};

struct Dtypes {
  DType inp, weight, bias, pre_gelu, out;
  DType operands() const { return inp == weight ? inp : DType::F32; }
};
Dtypes uniform(DType dtype) { return {dtype, dtype, dtype, dtype, dtype}; }

Tolerance pre_gelu_tolerance(const Dtypes& d) {
  if (d.pre_gelu != DType::F32) return storage_tolerance(d.pre_gelu);
  return d.operands() == DType::F32 ? Tolerance{1e-4, 1e-4, 1e-10} : Tolerance{5e-4, 1e-3, 1e-8};
}
Tolerance out_tolerance(const Dtypes& d) {
  const Tolerance pre = pre_gelu_tolerance(d);
  Tolerance tol{pre.atol * 1.2, pre.rtol * 2, pre.nmse * 2};
  if (d.out != DType::F32) {
    const Tolerance stored = storage_tolerance(d.out);
    tol = {std::max(tol.atol, stored.atol), std::max(tol.rtol, stored.rtol),
           std::max(tol.nmse, stored.nmse)};
  }
  return tol;
}

std::string case_name(const MatmulGeluCase& c, const Dtypes& d, bool with_bias) {
  return std::string("N=") + std::to_string(c.N) + " C=" + std::to_string(c.C) +
         " OC=" + std::to_string(c.OC) + " inp " + dtype_name(d.inp) + " weight " +
         dtype_name(d.weight) + " pre_gelu " + dtype_name(d.pre_gelu) + " out " +
         dtype_name(d.out) + (with_bias ? " bias " + std::string(dtype_name(d.bias)) : "");
}

struct Inputs {
  HostTensor inp, weight, bias;
};
Inputs random_inputs(const MatmulGeluCase& c, const Dtypes& d) {
  Random rng(71);
  return {random_tensor(rng, d.inp, {c.N, c.C}), random_tensor(rng, d.weight, {c.C, c.OC}),
          random_tensor(rng, d.bias, {c.OC})};
}

// The fused op against the CPU twin's.
void check_against_cpu(const MatmulGeluCase& c, const Dtypes& d, bool with_bias) {
  SCOPED_TRACE(case_name(c, d, with_bias));
  Inputs in = random_inputs(c, d);
  HostTensor pre_cpu = nan_tensor(d.pre_gelu, {c.N, c.OC}), pre_gpu = pre_cpu.clone();
  HostTensor out_cpu = nan_tensor(d.out, {c.N, c.OC}), out_gpu = out_cpu.clone();
  cpu_backend().matmul_gelu_forward(out_cpu, pre_cpu, in.inp, in.weight,
                                    with_bias ? in.bias.t() : Tensor(), nullptr);
  HostTensor inp_gpu = in.inp.clone(), weight_gpu = in.weight.clone(), bias_gpu = in.bias.clone();
  GpuRun run;
  const Tensor bias_view = run(bias_gpu);
  cuda_backend().matmul_gelu_forward(run(out_gpu), run(pre_gpu), run(inp_gpu), run(weight_gpu),
                                     with_bias ? bias_view : Tensor(), nullptr);
  run.finish();
  EXPECT_TRUE(all_close(pre_gpu.values(), pre_cpu.values(), pre_gelu_tolerance(d))) << "pre_gelu";
  EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), out_tolerance(d))) << "out";
  EXPECT_TRUE(bitwise_equal(inp_gpu, in.inp) && bitwise_equal(weight_gpu, in.weight) &&
              bitwise_equal(bias_gpu, in.bias))
      << "inputs must be left unchanged";
  EXPECT_TRUE(guards_intact({&out_gpu, &pre_gpu, &inp_gpu, &weight_gpu, &bias_gpu}));
}

// The fused op against matmul_forward + gelu_forward of the same (CUDA) backend: same bits.
void check_composition(const MatmulGeluCase& c, const Dtypes& d, bool with_bias) {
  SCOPED_TRACE(case_name(c, d, with_bias));
  Inputs in = random_inputs(c, d);
  HostTensor pre_fused = nan_tensor(d.pre_gelu, {c.N, c.OC}), pre_composed = pre_fused.clone();
  HostTensor out_fused = nan_tensor(d.out, {c.N, c.OC}), out_composed = out_fused.clone();
  GpuRun run;
  const Tensor inp = run(in.inp), weight = run(in.weight), bias = run(in.bias);
  const Tensor bias_view = with_bias ? bias : Tensor();
  const Tensor pre_composed_view = run(pre_composed);
  cuda_backend().matmul_gelu_forward(run(out_fused), run(pre_fused), inp, weight, bias_view,
                                     nullptr);
  cuda_backend().matmul_forward(pre_composed_view, inp, weight, bias_view, false, nullptr);
  cuda_backend().gelu_forward(run(out_composed), pre_composed_view, nullptr);
  run.finish();
  EXPECT_GT(norm_squared(out_fused.values()), 0.0);
  EXPECT_TRUE(bitwise_equal(pre_fused, pre_composed)) << "pre_gelu";
  EXPECT_TRUE(bitwise_equal(out_fused, out_composed)) << "out";
}

TEST(CudaMatmulGelu, MatchesCpuEveryDTypeShapeAndBias) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const MatmulGeluCase& c : kCases) {
      for (bool with_bias : {true, false}) check_against_cpu(c, uniform(dtype), with_bias);
    }
  }
}

// Operands of two dtypes (fp32 staging), a bias of another dtype than pre_gelu (the fp32
// epilogue kernel instead of cuBLASLt's), an F32 pre_gelu of 16-bit operands (cuBLASLt writes F32
// from BF16), F32 out of a 16-bit pre_gelu.
const Dtypes kMixed[] = {
    {DType::BF16, DType::F32, DType::F32, DType::BF16, DType::F32},
    {DType::F16, DType::F16, DType::F32, DType::F16, DType::F16},
    {DType::BF16, DType::BF16, DType::F32, DType::F32, DType::BF16},
};

TEST(CudaMatmulGelu, MatchesCpuMixedDTypes) {
  REQUIRE_CUDA_DEVICE();
  for (const Dtypes& d : kMixed) {
    for (const MatmulGeluCase& c : kCases) check_against_cpu(c, d, true);
  }
}

TEST(CudaMatmulGelu, IsMatmulThenGeluBitwiseEveryDType) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const MatmulGeluCase& c : kCases) {
      for (bool with_bias : {true, false}) check_composition(c, uniform(dtype), with_bias);
    }
  }
  for (const Dtypes& d : kMixed) check_composition(kCases[1], d, true);
}

// A view at an odd element offset (2-byte aligned for 16-bit data): cuBLASLt must only be offered
// algorithms for the real alignment (the emulated cuBLASLt refuses a pointer less aligned than
// the heuristic was told).
TEST(CudaMatmulGelu, UnalignedViews) {
  REQUIRE_CUDA_DEVICE();
  const MatmulGeluCase c{7, 13, 11};
  for (DType dtype : kFloatDTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    Random rng(72);
    HostTensor inp = random_tensor(rng, dtype, {c.N * c.C + 1});
    HostTensor weight = random_tensor(rng, dtype, {c.C * c.OC + 1});
    HostTensor bias = random_tensor(rng, dtype, {c.OC + 1});
    HostTensor pre_cpu = nan_tensor(dtype, {c.N * c.OC + 1}), pre_gpu = pre_cpu.clone();
    HostTensor out_cpu = nan_tensor(dtype, {c.N, c.OC}), out_gpu = out_cpu.clone();
    auto shifted = [](const Tensor& t, std::initializer_list<int64_t> dims) {
      return t.slice(1, dims);
    };
    cpu_backend().matmul_gelu_forward(out_cpu, shifted(pre_cpu, {c.N, c.OC}),
                                      shifted(inp, {c.N, c.C}), shifted(weight, {c.C, c.OC}),
                                      shifted(bias, {c.OC}), nullptr);
    GpuRun run;
    const Tensor pre_view = run(pre_gpu);
    const Tensor inp_view = run(inp), weight_view = run(weight), bias_view = run(bias);
    cuda_backend().matmul_gelu_forward(
        run(out_gpu), shifted(pre_view, {c.N, c.OC}), shifted(inp_view, {c.N, c.C}),
        shifted(weight_view, {c.C, c.OC}), shifted(bias_view, {c.OC}), nullptr);
    run.finish();
    const Dtypes d = uniform(dtype);
    auto past_first = [](const HostTensor& t) {  // element 0 is before the view: still NaN
      std::vector<double> values = t.values();
      EXPECT_TRUE(std::isnan(values[0])) << "written before the view";
      return std::vector<double>(values.begin() + 1, values.end());
    };
    EXPECT_TRUE(all_close(past_first(pre_gpu), past_first(pre_cpu), pre_gelu_tolerance(d)))
        << "pre_gelu";
    EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), out_tolerance(d))) << "out";
    EXPECT_TRUE(guards_intact({&out_gpu, &pre_gpu}));
  }
}

}  // namespace
}  // namespace dstrain::test
