// GELU, residual, accumulate and scale against the CPU twin, every dtype, round and odd shapes.
// residual / accumulate / scale / add_bias are one IEEE operation per element: bitwise equal.
// GELU uses tanhf, which may differ from glibc's in the last bit: tolerance
//   F32 {atol 1e-6, rtol 1e-5, nmse 1e-11}, F16/BF16 one unit of storage rounding
//   (storage_tolerance: F16 {2e-3, 2e-3, 1e-6}, BF16 {1.6e-2, 1.6e-2, 1e-4}).
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

const std::vector<std::vector<int64_t>> kShapes = {{64, 1024}, {5, 7, 11, 13}};

Tolerance gelu_tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{1e-6, 1e-5, 1e-11} : storage_tolerance(dtype);
}

TEST(CudaElementwise, GeluForwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& shape : kShapes) {
      Random rng(11);
      HostTensor x = random_tensor(rng, dtype, shape, -4.0, 4.0);
      HostTensor out_cpu = nan_tensor(dtype, shape), out_gpu = out_cpu.clone();
      cpu_backend().gelu_forward(out_cpu, x, nullptr);
      HostTensor x_gpu = x.clone();
      GpuRun run;
      cuda_backend().gelu_forward(run(out_gpu), run(x_gpu), nullptr);
      run.finish();
      EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), gelu_tolerance(dtype)))
          << dtype_name(dtype) << " " << out_cpu.t().shape_str();
      EXPECT_TRUE(bitwise_equal(x_gpu, x));
      EXPECT_TRUE(guards_intact({&out_gpu, &x_gpu}));
    }
  }
}

TEST(CudaElementwise, GeluBackwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& shape : kShapes) {
      Random rng(12);
      HostTensor x = random_tensor(rng, dtype, shape, -4.0, 4.0);
      HostTensor dout = random_tensor(rng, dtype, shape);
      HostTensor dinp_cpu = nan_tensor(dtype, shape), dinp_gpu = dinp_cpu.clone();
      cpu_backend().gelu_backward(dinp_cpu, dout, x, nullptr);
      HostTensor x_gpu = x.clone(), dout_gpu = dout.clone();
      GpuRun run;
      cuda_backend().gelu_backward(run(dinp_gpu), run(dout_gpu), run(x_gpu), nullptr);
      run.finish();
      EXPECT_TRUE(all_close(dinp_gpu.values(), dinp_cpu.values(), gelu_tolerance(dtype)))
          << dtype_name(dtype) << " " << dinp_cpu.t().shape_str();
      EXPECT_TRUE(guards_intact({&dinp_gpu, &x_gpu, &dout_gpu}));
    }
  }
}

// Mixed dtypes in one op: BF16 activations with an F32 gradient, as ops.h allows.
TEST(CudaElementwise, GeluBackwardMixedDTypes) {
  REQUIRE_CUDA_DEVICE();
  Random rng(13);
  const std::vector<int64_t> shape = {37, 129};
  HostTensor x = random_tensor(rng, DType::BF16, shape, -3.0, 3.0);
  HostTensor dout = random_tensor(rng, DType::F32, shape);
  HostTensor dinp_cpu = nan_tensor(DType::F16, shape), dinp_gpu = dinp_cpu.clone();
  cpu_backend().gelu_backward(dinp_cpu, dout, x, nullptr);
  HostTensor x_gpu = x.clone(), dout_gpu = dout.clone();
  GpuRun run;
  cuda_backend().gelu_backward(run(dinp_gpu), run(dout_gpu), run(x_gpu), nullptr);
  run.finish();
  EXPECT_TRUE(all_close(dinp_gpu.values(), dinp_cpu.values(), storage_tolerance(DType::F16)));
  EXPECT_TRUE(guards_intact({&dinp_gpu}));
}

TEST(CudaElementwise, ResidualAccumulateScaleBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType out_dtype : kFloatDTypes) {
    for (DType in_dtype : kFloatDTypes) {
      for (const auto& shape : kShapes) {
        Random rng(14);
        HostTensor a = random_tensor(rng, in_dtype, shape),
                   b = random_tensor(rng, out_dtype, shape);
        // residual: out = a + b
        HostTensor out_cpu = nan_tensor(out_dtype, shape), out_gpu = out_cpu.clone();
        cpu_backend().residual_forward(out_cpu, a, b, nullptr);
        HostTensor a_gpu = a.clone(), b_gpu = b.clone();
        {
          GpuRun run;
          cuda_backend().residual_forward(run(out_gpu), run(a_gpu), run(b_gpu), nullptr);
          run.finish();
        }
        EXPECT_GT(norm_squared(out_cpu.values()), 0.0);
        EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << "residual " << dtype_name(out_dtype);
        // accumulate: dst (starts as b) += a
        HostTensor dst_cpu = b.clone(), dst_gpu = b.clone();
        cpu_backend().accumulate(dst_cpu, a, nullptr);
        {
          GpuRun run;
          cuda_backend().accumulate(run(dst_gpu), run(a_gpu), nullptr);
          run.finish();
        }
        EXPECT_TRUE(bitwise_equal(dst_gpu, dst_cpu)) << "accumulate " << dtype_name(out_dtype);
        // scale: x *= s
        HostTensor x_cpu = a.clone(), x_gpu = a.clone();
        cpu_backend().scale(x_cpu, 0.3f, nullptr);
        {
          GpuRun run;
          cuda_backend().scale(run(x_gpu), 0.3f, nullptr);
          run.finish();
        }
        EXPECT_TRUE(bitwise_equal(x_gpu, x_cpu)) << "scale " << dtype_name(in_dtype);
        EXPECT_TRUE(guards_intact({&out_gpu, &dst_gpu, &x_gpu, &a_gpu, &b_gpu}));
      }
    }
  }
}

TEST(CudaElementwise, AddBiasBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{64, 256}, {7, 37}}) {
      Random rng(75);
      HostTensor x_cpu = random_tensor(rng, dtype, {rows, cols});
      HostTensor bias = random_tensor(rng, DType::F32, {cols});  // another dtype on purpose
      HostTensor x_gpu = x_cpu.clone(), bias_gpu = bias.clone();
      const HostTensor before = x_cpu.clone();
      cpu_backend().add_bias(x_cpu, bias, nullptr);
      GpuRun run;
      cuda_backend().add_bias(run(x_gpu), run(bias_gpu), nullptr);
      run.finish();
      EXPECT_FALSE(bitwise_equal(x_cpu, before)) << "the reference did not change";
      EXPECT_TRUE(bitwise_equal(x_gpu, x_cpu)) << dtype_name(dtype) << " " << rows << "x" << cols;
      EXPECT_TRUE(guards_intact({&x_gpu, &bias_gpu}));
    }
  }
}

}  // namespace
}  // namespace dstrain::test
