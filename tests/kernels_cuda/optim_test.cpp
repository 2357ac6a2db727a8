// AdamW, sum_squares, scale and has_inf_or_nan against the CPU twin.
// AdamW follows the CPU's op order with one rounding per op (no FMA contraction): bitwise equal
// for every grad dtype and param_copy dtype, over several steps. sum_squares accumulates in
// fp64 in another order: relative 1e-12.
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct AdamWCase {
  int64_t n;
  DType grad_dtype;
  DType copy_dtype;  // F32 here: no param_copy
  float weight_decay;
};

TEST(CudaAdamW, BitwiseEqualCpuOverSteps) {
  REQUIRE_CUDA_DEVICE();
  for (int64_t n : {int64_t{10007}, int64_t{1} << 16}) {
    for (DType grad_dtype : kFloatDTypes) {
      for (DType copy_dtype : kFloatDTypes) {
        Random rng(81);
        HostTensor param_cpu = random_tensor(rng, DType::F32, {n});
        HostTensor m_cpu(DType::F32, {n}), v_cpu(DType::F32, {n});
        m_cpu.set(std::vector<double>(static_cast<size_t>(n), 0.0));
        v_cpu.set(std::vector<double>(static_cast<size_t>(n), 0.0));
        HostTensor param_gpu = param_cpu.clone(), m_gpu = m_cpu.clone(), v_gpu = v_cpu.clone();
        const bool with_copy = copy_dtype != DType::F32;
        AdamWStep step;
        step.lr = 3e-3f;
        step.weight_decay = 0.1f;
        step.grad_scale = 0.5f;
        for (int s = 1; s <= 4; ++s) {
          step.step = s;
          step.beta1 = s == 4 ? 0.3f : 0.9f;  // ATen's other lerp form (weight >= 0.5)
          HostTensor grad = random_tensor(rng, grad_dtype, {n}, -2.0, 2.0);
          HostTensor copy_cpu = nan_tensor(copy_dtype, {n}), copy_gpu = copy_cpu.clone();
          cpu_backend().adamw(param_cpu, grad, m_cpu, v_cpu, with_copy ? copy_cpu.t() : Tensor(),
                              step, nullptr);
          GpuRun run;
          const Tensor copy_view = run(copy_gpu);
          cuda_backend().adamw(run(param_gpu), run(grad), run(m_gpu), run(v_gpu),
                               with_copy ? copy_view : Tensor(), step, nullptr);
          run.finish();
          const std::string where = std::string("grad ") + dtype_name(grad_dtype) + " copy " +
                                    dtype_name(copy_dtype) + " step " + std::to_string(s);
          ASSERT_TRUE(bitwise_equal(param_gpu, param_cpu)) << "param " << where;
          ASSERT_TRUE(bitwise_equal(m_gpu, m_cpu)) << "m " << where;
          ASSERT_TRUE(bitwise_equal(v_gpu, v_cpu)) << "v " << where;
          if (with_copy) {
            ASSERT_TRUE(bitwise_equal(copy_gpu, copy_cpu)) << "param_copy " << where;
          }
          ASSERT_TRUE(guards_intact({&param_gpu, &m_gpu, &v_gpu, &copy_gpu, &grad}));
        }
      }
    }
  }
}

TEST(CudaSumSquares, MatchesCpuAndRepeatsBitwise) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{10007}, int64_t{3} << 20}) {
      Random rng(82);
      HostTensor x = random_tensor(rng, dtype, {n}, -3.0, 3.0);
      const double reference = cpu_backend().sum_squares(x, nullptr);
      ASSERT_GT(reference, 0.0);
      GpuRun run;
      const Tensor x_view = run(x);
      const double first = cuda_backend().sum_squares(x_view, nullptr);
      const double second = cuda_backend().sum_squares(x_view, nullptr);
      run.finish();
      EXPECT_NEAR(first, reference, 1e-12 * reference) << dtype_name(dtype) << " n=" << n;
      EXPECT_EQ(first, second) << "not deterministic";
      EXPECT_TRUE(guards_intact({&x}));
    }
  }
}

TEST(CudaHasInfOrNan, FindsOneBadElementAnywhere) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    const int64_t n = 100003;
    Random rng(83);
    HostTensor x = random_tensor(rng, dtype, {n}, -100.0, 100.0);
    {
      GpuRun run;
      EXPECT_FALSE(cuda_backend().has_inf_or_nan(run(x), nullptr)) << dtype_name(dtype);
      run.finish();
    }
    for (int64_t where : {int64_t{0}, n / 2, n - 1}) {
      for (double bad : {std::nan(""), double{INFINITY}, -double{INFINITY}}) {
        HostTensor y = x.clone();
        y.set(where, bad);
        GpuRun run;
        EXPECT_TRUE(cuda_backend().has_inf_or_nan(run(y), nullptr))
            << dtype_name(dtype) << " " << bad << " at " << where;
        run.finish();
      }
    }
  }
}

}  // namespace
}  // namespace dstrain::test
