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

// The 128-bit vector kernel: n = 5 (tail only) and 1003 (125 vectors + 3), views 8 elements into
// their buffers (aligned: the vector kernel) or 1 (misaligned: the scalar kernel), every grad and
// param_copy dtype (F32 copy dtype: no copy), two steps; bitwise as the CPU on every path.
TEST(CudaAdamW, VectorTailsAndOffsetsBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (int64_t n : {int64_t{5}, int64_t{1003}}) {
    for (int64_t offset : kViewOffsets) {
      for (DType grad_dtype : kFloatDTypes) {
        for (DType copy_dtype : kFloatDTypes) {
          const auto v = [&](const Tensor& buffer) { return buffer.slice(offset, {n}); };
          const bool with_copy = copy_dtype != DType::F32;
          Random rng(84);
          const HostTensor param = random_tensor(rng, DType::F32, {offset + n});
          const HostTensor m = random_tensor(rng, DType::F32, {offset + n}, -0.1, 0.1);
          const HostTensor v2 = random_tensor(rng, DType::F32, {offset + n}, 0.01, 0.1);
          const HostTensor grad = random_tensor(rng, grad_dtype, {offset + n}, -2.0, 2.0);
          const HostTensor copy = random_tensor(rng, copy_dtype, {offset + n});
          TwinBuffers t({&param, &m, &v2, &grad, &copy});
          AdamWStep step;
          step.lr = 3e-3f;
          step.weight_decay = 0.1f;
          step.grad_scale = 0.5f;
          for (int s = 1; s <= 2; ++s) {
            step.step = s;
            cpu_backend().adamw(v(t.cpu[0]), v(t.cpu[3]), v(t.cpu[1]), v(t.cpu[2]),
                                with_copy ? v(t.cpu[4]) : Tensor(), step, nullptr);
            GpuRun run;
            const Tensor copy_view = v(run(t.gpu[4]));
            cuda_backend().adamw(v(run(t.gpu[0])), v(run(t.gpu[3])), v(run(t.gpu[1])),
                                 v(run(t.gpu[2])), with_copy ? copy_view : Tensor(), step, nullptr);
            run.finish();
          }
          const std::string where = "n " + std::to_string(n) + " offset " + std::to_string(offset) +
                                    " grad " + dtype_name(grad_dtype) + " copy " +
                                    dtype_name(copy_dtype);
          EXPECT_FALSE(bitwise_equal(t.cpu[0], param)) << "the reference did not change";
          EXPECT_TRUE(t.bitwise_equal_all()) << where;
          EXPECT_TRUE(t.guards_intact_all()) << where;
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
