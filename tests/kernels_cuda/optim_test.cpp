// AdamW, sum_squares, scale and has_inf_or_nan against the CPU twin, and their multi-tensor
// forms (adamw_multi, gradient_stats) against the ops buffer by buffer.
// AdamW follows the CPU's op order with one rounding per op (no FMA contraction): bitwise equal
// for every grad dtype and param_copy dtype, over several steps. sum_squares accumulates in
// fp64 in another order: relative 1e-12; gradient_stats gives each buffer the bits of
// sum_squares alone.
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

// Buffers of a multi-tensor case: views into one arena per tensor kind, at offsets that make
// some 16-byte aligned (the vector path) and some not (the scalar path), of sizes below, at and
// around a chunk (8192) and a vector (8).
struct MultiView {
  int64_t offset, n;
};
std::vector<MultiView> multi_views() {
  const int64_t sizes[] = {5, 1003, 8192, 8193, 20011, 1, 64, 16384 * 3 + 7};
  const int64_t shifts[] = {0, 8, 1, 0, 16, 3, 0, 8};
  std::vector<MultiView> views;
  int64_t offset = 0;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    offset += shifts[i];
    views.push_back({offset, sizes[i]});
    offset += sizes[i] + 8;  // a gap the op must leave alone
    offset = (offset + 7) / 8 * 8;
  }
  return views;
}
int64_t arena_size(const std::vector<MultiView>& views) {
  return views.back().offset + views.back().n + 8;
}

// Every buffer of one adamw_multi call comes out bitwise as the CPU's adamw on it alone: every
// grad and copy dtype of the launch, buffers with and without a copy, with and without weight
// decay, one buffer whose grad has another dtype (the scalar path of a mixed launch); the gaps
// between the views and the guards are untouched.
TEST(CudaAdamWMulti, EveryBufferBitwiseAsTheCpuAdamWAlone) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<MultiView> views = multi_views();
  const int64_t size = arena_size(views);
  for (DType grad_dtype : kFloatDTypes) {
    for (DType copy_dtype : kFloatDTypes) {
      Random rng(91);
      const DType other_grad = grad_dtype == DType::F32 ? DType::BF16 : DType::F32;
      const HostTensor param = random_tensor(rng, DType::F32, {size});
      const HostTensor m = random_tensor(rng, DType::F32, {size}, -0.1, 0.1);
      const HostTensor v2 = random_tensor(rng, DType::F32, {size}, 0.01, 0.1);
      const HostTensor grad = random_tensor(rng, grad_dtype, {size}, -2.0, 2.0);
      const HostTensor grad_other = random_tensor(rng, other_grad, {size}, -2.0, 2.0);
      const HostTensor copy = random_tensor(rng, copy_dtype, {size});
      TwinBuffers t({&param, &m, &v2, &grad, &grad_other, &copy});
      const auto buffers = [&](std::vector<Tensor> arena) {
        std::vector<AdamWTensors> list;
        for (size_t i = 0; i < views.size(); ++i) {
          const auto view = [&](const Tensor& a) { return a.slice(views[i].offset, {views[i].n}); };
          const bool with_copy = i % 3 != 1;
          list.push_back({view(arena[0]), view(arena[i == 4 ? 4 : 3]), view(arena[1]),
                          view(arena[2]), with_copy ? view(arena[5]) : Tensor(),
                          i % 2 == 0 ? 0.1f : 0.0f});
        }
        return list;
      };
      AdamWStep step;
      step.lr = 3e-3f;
      step.weight_decay = 123.0f;  // not used: each buffer has its own
      step.grad_scale = 0.5f;
      for (int s = 1; s <= 2; ++s) {
        step.step = s;
        for (const AdamWTensors& b : buffers({t.cpu.begin(), t.cpu.end()})) {
          AdamWStep alone = step;
          alone.weight_decay = b.weight_decay;
          cpu_backend().adamw(b.param, b.grad, b.m, b.v, b.param_copy, alone, nullptr);
        }
        GpuRun run;
        std::vector<Tensor> device;
        for (HostTensor& buffer : t.gpu) device.push_back(run(buffer));
        cuda_backend().adamw_multi(buffers(device), step, nullptr);
        run.finish();
      }
      const std::string where =
          std::string("grad ") + dtype_name(grad_dtype) + " copy " + dtype_name(copy_dtype);
      EXPECT_FALSE(bitwise_equal(t.cpu[0], param)) << "the reference did not change";
      EXPECT_TRUE(t.bitwise_equal_all()) << where;
      EXPECT_TRUE(t.guards_intact_all()) << where;
    }
  }
}

// gradient_stats over buffers of every dtype, aligned and not, counted and not: each counted
// buffer's squares are the bits sum_squares gives it alone (and within 1e-12 of the CPU's), an
// uncounted one gives 0; an inf or NaN at the first, middle or last element of any one buffer,
// counted or not, is found.
TEST(CudaGradientStats, SquaresAsSumSquaresAloneAndAnInfAnywhereIsFound) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<MultiView> views = multi_views();
  const int64_t size = arena_size(views);
  Random rng(92);
  std::vector<HostTensor> arenas;
  for (DType dtype : kFloatDTypes) arenas.push_back(random_tensor(rng, dtype, {size}, -3.0, 3.0));
  const auto buffers = [&](const std::vector<Tensor>& arena) {
    std::vector<GradientTensor> list;
    for (size_t i = 0; i < views.size(); ++i) {
      list.push_back({arena[i % 3].slice(views[i].offset, {views[i].n}), i != 2 && i != 5});
    }
    return list;
  };
  const auto device_stats = [&](std::vector<HostTensor>& host) {
    GpuRun run;
    std::vector<Tensor> device;
    for (HostTensor& arena : host) device.push_back(run(arena));
    const GradientStats stats = cuda_backend().gradient_stats(buffers(device), nullptr);
    std::vector<double> alone;
    for (const GradientTensor& b : buffers(device)) {
      alone.push_back(cuda_backend().sum_squares(b.x, nullptr));
    }
    run.finish();
    return std::make_pair(stats, alone);
  };
  const auto [stats, alone] = device_stats(arenas);
  const std::vector<GradientTensor> host_buffers =
      buffers({arenas[0].t(), arenas[1].t(), arenas[2].t()});
  EXPECT_FALSE(stats.found_inf);
  ASSERT_EQ(stats.squares.size(), views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    if (!host_buffers[i].count_squares) {
      EXPECT_EQ(stats.squares[i], 0.0) << "buffer " << i << " is not counted";
      continue;
    }
    const double reference = cpu_backend().sum_squares(host_buffers[i].x, nullptr);
    ASSERT_GT(reference, 0.0);
    EXPECT_EQ(stats.squares[i], alone[i]) << "buffer " << i;
    EXPECT_NEAR(stats.squares[i], reference, 1e-12 * reference) << "buffer " << i;
  }
  for (size_t i = 0; i < views.size(); ++i) {
    for (int64_t where : {int64_t{0}, views[i].n / 2, views[i].n - 1}) {
      std::vector<HostTensor> bad;
      for (const HostTensor& arena : arenas) bad.push_back(arena.clone());
      bad[i % 3].set(views[i].offset + where, i % 2 ? std::nan("") : double{INFINITY});
      EXPECT_TRUE(device_stats(bad).first.found_inf) << "buffer " << i << " at " << where;
    }
  }
  const GradientStats none = cuda_backend().gradient_stats({}, nullptr);
  EXPECT_FALSE(none.found_inf);
  EXPECT_TRUE(none.squares.empty());
}

}  // namespace
}  // namespace dstrain::test
