// Fused softmax + cross-entropy against the CPU twin: losses only, losses + dlogits, and
// dlogits over logits in place; every dtype; padded columns (V < Vp) must come back as 0.
//   losses: {atol 1e-5, rtol 1e-5, nmse 1e-11}
//   dlogits: F32 {1e-7, 1e-4, 1e-10} (values ~ dloss / V); F16/BF16 storage_tolerance
// A bad target id is flagged on the device and reported by the next synchronize; a
// kIgnoreTarget row is not (loss 0, gradient 0, as the twin).
// The vocabulary-parallel pair (cross_entropy_stats, cross_entropy_from_stats) over P slices:
// the statistics {1e-5, 1e-5, nmse 1e-10} of the CPU twin's (a slice without real columns:
// exactly (-inf, 0, 0)), losses and dlogits as above.
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
  // Rows the loss does not count (chat data's prompt and padding): loss 0, a zero gradient row.
  for (int64_t i = 2; i < N; i += 3) t.i32()[i] = kIgnoreTarget;
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

struct SliceCase {
  int64_t N, P, Vs, V;  // V real columns of P slices of Vs
};

// Columns [p * Vs, (p + 1) * Vs) of a (N, P * Vs) tensor, as a (N, Vs) tensor.
HostTensor slice_columns(const HostTensor& whole, const SliceCase& c, int64_t p) {
  HostTensor out(whole.t().dtype, {c.N, c.Vs});
  std::vector<double> values;
  const std::vector<double> all = whole.values();
  for (int64_t n = 0; n < c.N; ++n) {
    const auto row = all.begin() + n * c.P * c.Vs + p * c.Vs;
    values.insert(values.end(), row, row + c.Vs);
  }
  out.set(values);
  return out;
}

// Both halves on every slice, on the CPU and the GPU; the GPU's from_stats gets the GPU's
// statistics (as NCCL would gather them), in place over its logits when `in_place`.
void check_slices(const SliceCase& c, DType dtype, bool in_place) {
  Random rng(74);
  const HostTensor whole = random_tensor(rng, dtype, {c.N, c.P * c.Vs}, -4.0, 4.0);
  HostTensor targets = random_targets(rng, c.N, c.V);
  targets.i32()[0] = static_cast<int32_t>(c.V - 1);
  const float dloss = 1.0f / static_cast<float>(c.N);
  const int vocab = static_cast<int>(c.V);
  HostTensor stats_cpu = nan_tensor(DType::F32, {c.P, c.N, 3}), stats_gpu = stats_cpu.clone();
  std::vector<HostTensor> logits;
  for (int64_t p = 0; p < c.P; ++p) logits.push_back(slice_columns(whole, c, p));
  for (int64_t p = 0; p < c.P; ++p) {
    const HostTensor& x = logits[static_cast<size_t>(p)];
    cpu_backend().cross_entropy_stats(stats_cpu.t().slice(p * c.N * 3, {c.N, 3}), x, targets,
                                      p * c.Vs, vocab, nullptr);
    HostTensor x_gpu = x.clone(), targets_gpu = targets.clone();
    GpuRun run;
    const Tensor all = run(stats_gpu);
    cuda_backend().cross_entropy_stats(all.slice(p * c.N * 3, {c.N, 3}), run(x_gpu),
                                       run(targets_gpu), p * c.Vs, vocab, nullptr);
    run.finish();
  }
  const std::string where = std::string(dtype_name(dtype)) + " P=" + std::to_string(c.P) +
                            " Vs=" + std::to_string(c.Vs) + " V=" + std::to_string(c.V);
  // A slice without real columns: (-inf, 0, 0) exactly; the others within the tolerance.
  const int64_t real_slices = (c.V + c.Vs - 1) / c.Vs;
  const std::vector<double> got = stats_gpu.values(), want = stats_cpu.values();
  const auto real_end = static_cast<std::ptrdiff_t>(real_slices * c.N * 3);
  EXPECT_TRUE(all_close(std::vector<double>(got.begin(), got.begin() + real_end),
                        std::vector<double>(want.begin(), want.begin() + real_end),
                        {1e-5, 1e-5, 1e-10}))
      << "stats " << where;
  for (size_t i = static_cast<size_t>(real_end); i < got.size(); ++i) {
    EXPECT_EQ(got[i], i % 3 == 0 ? -INFINITY : 0.0) << "stats of a slice without real columns";
    EXPECT_EQ(got[i], want[i]);
  }
  for (int64_t p = 0; p < c.P; ++p) {
    const HostTensor& x = logits[static_cast<size_t>(p)];
    HostTensor losses_cpu = nan_tensor(DType::F32, {c.N}), losses_gpu = losses_cpu.clone();
    HostTensor dx_cpu = nan_tensor(dtype, {c.N, c.Vs}), dx_gpu = nan_tensor(dtype, {c.N, c.Vs});
    cpu_backend().cross_entropy_from_stats(losses_cpu, dx_cpu, x, stats_cpu, targets, p * c.Vs,
                                           vocab, dloss, nullptr);
    HostTensor x_gpu = x.clone(), targets_gpu = targets.clone();
    GpuRun run;
    const Tensor logits_view = run(x_gpu);
    const Tensor grad_view = in_place ? logits_view : run(dx_gpu);
    cuda_backend().cross_entropy_from_stats(run(losses_gpu), grad_view, logits_view,
                                            run(stats_gpu), run(targets_gpu), p * c.Vs, vocab,
                                            dloss, nullptr);
    run.finish();
    const HostTensor& grad = in_place ? x_gpu : dx_gpu;
    EXPECT_TRUE(all_close(losses_gpu.values(), losses_cpu.values(), {1e-5, 1e-5, 1e-11}))
        << "losses of slice " << p << " " << where;
    if (p < real_slices) {  // else all zeros, checked below
      EXPECT_TRUE(all_close(grad.values(), dx_cpu.values(), dlogits_tolerance(dtype)))
          << "dlogits of slice " << p << " " << where;
    }
    for (int64_t n = 0; n < c.N; ++n) {
      for (int64_t j = std::max<int64_t>(c.V - p * c.Vs, 0); j < c.Vs; ++j) {
        ASSERT_EQ(grad.get(n * c.Vs + j), 0.0) << "column " << p * c.Vs + j << " " << where;
      }
    }
  }
}

TEST(CudaCrossEntropy, VocabularySlicesMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    check_slices({9, 3, 40, 97}, dtype, false);   // the last slice: 17 real columns
    check_slices({6, 4, 32, 70}, dtype, true);    // slice 2: 6 real columns, slice 3: none
    check_slices({4, 2, 25152, 50257}, dtype, true);  // GPT-2's vocabulary over tp 2
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
