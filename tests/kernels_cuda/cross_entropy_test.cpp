// Fused softmax + cross-entropy against the CPU twin: losses only, losses + dlogits, and
// dlogits over logits in place; every dtype; padded columns (V < Vp) must come back as 0.
//   losses: {atol 1e-5, rtol 1e-5, nmse 1e-11}
//   dlogits: F32 {1e-7, 1e-4, 1e-10} (values ~ dloss / V); F16/BF16 storage_tolerance
// A bad target id is flagged on the device and reported by the next synchronize.
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct CrossEntropyCase {
  int64_t N, V, Vp;
};

const CrossEntropyCase kCases[] = {{64, 1000, 1024}, {7, 11, 13}, {5, 50257, 50304}};

Tolerance dlogits_tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{1e-7, 1e-4, 1e-10} : storage_tolerance(dtype);
}

HostTensor random_targets(Random& rng, int64_t N, int64_t V) {
  HostTensor t(DType::I32, {N});
  for (int64_t i = 0; i < N; ++i) t.i32()[i] = static_cast<int32_t>(rng.integer(V));
  return t;
}

TEST(CudaCrossEntropy, LossesAndGradientMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const CrossEntropyCase& c : kCases) {
      for (bool with_grad : {false, true}) {
        Random rng(71);
        HostTensor logits = random_tensor(rng, dtype, {c.N, c.Vp}, -4.0, 4.0);
        HostTensor targets = random_targets(rng, c.N, c.V);
        const float dloss = 1.0f / static_cast<float>(c.N);
        HostTensor losses_cpu = nan_tensor(DType::F32, {c.N}), losses_gpu = losses_cpu.clone();
        HostTensor dlogits_cpu = nan_tensor(dtype, {c.N, c.Vp}), dlogits_gpu = dlogits_cpu.clone();
        cpu_backend().softmax_cross_entropy(losses_cpu, with_grad ? dlogits_cpu.t() : Tensor(),
                                            logits, targets, static_cast<int>(c.V), dloss, nullptr);
        HostTensor logits_gpu = logits.clone(), targets_gpu = targets.clone();
        GpuRun run;
        const Tensor dlogits_view = run(dlogits_gpu);
        cuda_backend().softmax_cross_entropy(run(losses_gpu), with_grad ? dlogits_view : Tensor(),
                                             run(logits_gpu), run(targets_gpu),
                                             static_cast<int>(c.V), dloss, nullptr);
        run.finish();
        const std::string where = std::string(dtype_name(dtype)) + " N=" + std::to_string(c.N) +
                                  " V=" + std::to_string(c.V) + " Vp=" + std::to_string(c.Vp);
        EXPECT_TRUE(all_close(losses_gpu.values(), losses_cpu.values(), {1e-5, 1e-5, 1e-11}))
            << "losses " << where;
        if (with_grad) {
          EXPECT_TRUE(
              all_close(dlogits_gpu.values(), dlogits_cpu.values(), dlogits_tolerance(dtype)))
              << "dlogits " << where;
          for (int64_t n = 0; n < c.N; ++n) {
            for (int64_t j = c.V; j < c.Vp; ++j) {
              ASSERT_EQ(dlogits_gpu.get(n * c.Vp + j), 0.0)
                  << "padded column " << j << " " << where;
            }
          }
        } else {
          EXPECT_TRUE(std::isnan(dlogits_gpu.get(0))) << "dlogits written without being asked";
        }
        EXPECT_TRUE(bitwise_equal(logits_gpu, logits));
        EXPECT_TRUE(guards_intact({&losses_gpu, &dlogits_gpu, &logits_gpu, &targets_gpu}));
      }
    }
  }
}

TEST(CudaCrossEntropy, GradientInPlaceOverLogits) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const CrossEntropyCase& c : kCases) {
      Random rng(72);
      HostTensor logits_cpu = random_tensor(rng, dtype, {c.N, c.Vp}, -4.0, 4.0);
      HostTensor logits_gpu = logits_cpu.clone();
      HostTensor targets = random_targets(rng, c.N, c.V);
      HostTensor losses_cpu = nan_tensor(DType::F32, {c.N}), losses_gpu = losses_cpu.clone();
      cpu_backend().softmax_cross_entropy(losses_cpu, logits_cpu, logits_cpu, targets,
                                          static_cast<int>(c.V), 0.25f, nullptr);
      GpuRun run;
      const Tensor logits_view = run(logits_gpu);
      cuda_backend().softmax_cross_entropy(run(losses_gpu), logits_view, logits_view, run(targets),
                                           static_cast<int>(c.V), 0.25f, nullptr);
      run.finish();
      EXPECT_TRUE(all_close(losses_gpu.values(), losses_cpu.values(), {1e-5, 1e-5, 1e-11}))
          << dtype_name(dtype) << " V=" << c.V;
      EXPECT_TRUE(all_close(logits_gpu.values(), logits_cpu.values(), dlogits_tolerance(dtype)))
          << dtype_name(dtype) << " V=" << c.V;
      EXPECT_TRUE(guards_intact({&losses_gpu, &logits_gpu}));
    }
  }
}

TEST(CudaCrossEntropy, BadTargetIsAUserErrorAtTheNextWait) {
  REQUIRE_CUDA_DEVICE();
  Random rng(73);
  HostTensor logits = random_tensor(rng, DType::F32, {4, 16});
  HostTensor targets = random_targets(rng, 4, 10);
  targets.i32()[2] = 10;  // == V: a padded column is not a class
  HostTensor losses = nan_tensor(DType::F32, {4});
  GpuRun run;
  cuda_backend().softmax_cross_entropy(run(losses), Tensor(), run(logits), run(targets), 10, 1.0f,
                                       nullptr);
  try {
    run.finish();
    FAIL() << "no error for target 10 with V = 10";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("target id"), std::string::npos) << e.what();
  }
  cuda_backend().synchronize(nullptr);
}

}  // namespace
}  // namespace dstrain::test
