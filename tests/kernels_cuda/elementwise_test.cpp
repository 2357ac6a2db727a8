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

// The GELU backward with the bias gradient fused in (gelu_backward_bias): on rows the fused
// kernel takes (C % 8 == 0, aligned) it is bitwise the same op on a view 1 element into a buffer
// (misaligned: gelu_backward then the column sums, the two ops), dinp and dbias; against the CPU
// twin dinp within gelu_tolerance and dbias within a column sum's tolerance (F32 {1e-4, 1e-4,
// 1e-9} as matmul's dbias; its terms are dinp as stored, so F16/BF16 dinp storage_tolerance).
// N = 300: three chunks of rows, the last short; C = 40 (most threads of the block idle), 264,
// 2056 (9 blocks of columns). dbias F32 under BF16 (the training setup), else the dtype's own.
TEST(CudaElementwise, GeluBackwardBiasIsBitwiseTheTwoOps) {
  REQUIRE_CUDA_DEVICE();
  // `t` one element further into a buffer of the same size: t's element i at i + 1.
  const auto shifted = [](const HostTensor& t) {
    HostTensor out = t.clone();
    for (int64_t i = 0; i + 1 < t.numel(); ++i) out.set(i + 1, t.get(i));
    return out;
  };
  for (DType dtype : kFloatDTypes) {
    const DType dbias_dtype = dtype == DType::BF16 ? DType::F32 : dtype;
    for (int64_t C : {int64_t{40}, int64_t{264}, int64_t{2056}}) {
      const int64_t N = 300, size = 1 + N * C;
      Random rng(15);
      const HostTensor x = random_tensor(rng, dtype, {size}, -4.0, 4.0);
      const HostTensor dout = random_tensor(rng, dtype, {size});
      const HostTensor dinp = random_tensor(rng, dtype, {size});
      const HostTensor dbias = random_tensor(rng, dbias_dtype, {C});  // accumulates
      const HostTensor dinp_1 = shifted(dinp), dout_1 = shifted(dout), x_1 = shifted(x);
      TwinBuffers fused({&dinp, &dbias, &dout, &x}), two_ops({&dinp_1, &dbias, &dout_1, &x_1});
      const auto rows = [&](const Tensor& buffer, int64_t offset) {
        return buffer.slice(offset, {N, C});
      };
      cpu_backend().gelu_backward_bias(rows(fused.cpu[0], 0), fused.cpu[1], rows(fused.cpu[2], 0),
                                       rows(fused.cpu[3], 0), nullptr);
      GpuRun run;
      std::vector<Tensor> f, t;
      for (HostTensor& buffer : fused.gpu) f.push_back(run(buffer));
      for (HostTensor& buffer : two_ops.gpu) t.push_back(run(buffer));
      cuda_backend().gelu_backward_bias(rows(f[0], 0), f[1], rows(f[2], 0), rows(f[3], 0), nullptr);
      cuda_backend().gelu_backward_bias(rows(t[0], 1), t[1], rows(t[2], 1), rows(t[3], 1), nullptr);
      run.finish();
      const std::string where = view_case(dtype, N, C, 0);
      EXPECT_FALSE(bitwise_equal(fused.gpu[1], dbias)) << "dbias did not change, " << where;
      // The last element of the aligned run's buffer and the first of the misaligned one's are
      // outside the rows: the rest, shifted, is the same bits.
      HostTensor fused_dinp = shifted(fused.gpu[0]);
      fused_dinp.set(0, two_ops.gpu[0].get(0));
      EXPECT_TRUE(bitwise_equal(fused_dinp, two_ops.gpu[0])) << "dinp " << where;
      EXPECT_TRUE(bitwise_equal(fused.gpu[1], two_ops.gpu[1])) << "dbias " << where;
      EXPECT_TRUE(all_close(fused.gpu[0].values(), fused.cpu[0].values(), gelu_tolerance(dtype)))
          << "dinp " << where;
      const Tolerance column_sum =
          dtype == DType::F32 ? Tolerance{1e-4, 1e-4, 1e-9} : storage_tolerance(dtype);
      EXPECT_TRUE(all_close(fused.gpu[1].values(), fused.cpu[1].values(), column_sum))
          << "dbias " << where;
      EXPECT_TRUE(fused.guards_intact_all() && two_ops.guards_intact_all()) << where;
    }
  }
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

// ---- the 128-bit vector paths: scalar tails, views inside a buffer, misaligned views ----
// (rows, cols) with n % 8 != 0 (n = 5, 201, 3913: no vector, vectors + tail) and one shape of
// whole vectors; each at every offset of kViewOffsets.
const std::pair<int64_t, int64_t> kVectorShapes[] = {{1, 5}, {3, 67}, {13, 301}, {4, 96}};

TEST(CudaElementwise, GeluVectorTailsAndOffsetsMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& [rows, cols] : kVectorShapes) {
      for (int64_t offset : kViewOffsets) {
        const auto v = [&](const Tensor& buffer) { return buffer.slice(offset, {rows, cols}); };
        const int64_t size = offset + rows * cols;
        Random rng(91);
        const HostTensor x = random_tensor(rng, dtype, {size}, -4.0, 4.0);
        const HostTensor dout = random_tensor(rng, dtype, {size});
        const HostTensor out = random_tensor(rng, dtype, {size});  // not NaN: compared whole
        TwinBuffers f({&out, &x}), b({&out, &dout, &x});
        cpu_backend().gelu_forward(v(f.cpu[0]), v(f.cpu[1]), nullptr);
        cpu_backend().gelu_backward(v(b.cpu[0]), v(b.cpu[1]), v(b.cpu[2]), nullptr);
        GpuRun run;
        cuda_backend().gelu_forward(v(run(f.gpu[0])), v(run(f.gpu[1])), nullptr);
        cuda_backend().gelu_backward(v(run(b.gpu[0])), v(run(b.gpu[1])), v(run(b.gpu[2])), nullptr);
        run.finish();
        const std::string where = view_case(dtype, rows, cols, offset);
        EXPECT_GT(norm_squared(f.cpu[0].values()), 0.0);
        EXPECT_TRUE(all_close(f.gpu[0].values(), f.cpu[0].values(), gelu_tolerance(dtype)))
            << "forward " << where;
        EXPECT_TRUE(all_close(b.gpu[0].values(), b.cpu[0].values(), gelu_tolerance(dtype)))
            << "backward " << where;
        EXPECT_TRUE(bitwise_equal(f.gpu[1], x)) << where;
        EXPECT_TRUE(f.guards_intact_all()) << where;
        EXPECT_TRUE(b.guards_intact_all()) << where;
      }
    }
  }
}

// residual, accumulate, scale: one IEEE operation per element, bitwise on every path.
TEST(CudaElementwise, AddScaleVectorTailsAndOffsetsBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& [rows, cols] : kVectorShapes) {
      for (int64_t offset : kViewOffsets) {
        const auto v = [&](const Tensor& buffer) { return buffer.slice(offset, {rows, cols}); };
        const int64_t size = offset + rows * cols;
        Random rng(92);
        const HostTensor a = random_tensor(rng, dtype, {size});
        const HostTensor b = random_tensor(rng, dtype, {size});
        const HostTensor out = random_tensor(rng, dtype, {size});
        TwinBuffers t({&out, &a, &b});
        for (Backend* backend : {&cpu_backend(), &cuda_backend()}) {
          const bool gpu = backend == &cuda_backend();
          std::vector<HostTensor>& buffers = gpu ? t.gpu : t.cpu;
          GpuRun run;
          const auto view = [&](HostTensor& h) { return v(gpu ? run(h) : h.t()); };
          const Tensor out_view = view(buffers[0]), a_view = view(buffers[1]),
                       b_view = view(buffers[2]);
          backend->residual_forward(out_view, a_view, b_view, nullptr);
          backend->accumulate(b_view, out_view, nullptr);  // b += a + b
          backend->scale(a_view, 0.3f, nullptr);
          run.finish();
        }
        const std::string where = view_case(dtype, rows, cols, offset);
        EXPECT_GT(norm_squared(t.cpu[0].values()), 0.0);
        EXPECT_TRUE(t.bitwise_equal_all()) << where;
        EXPECT_TRUE(t.guards_intact_all()) << where;
      }
    }
  }
}

// copy (copy_convert) between every pair of dtypes (the vector kernel converts 8 at a time).
TEST(CudaElementwise, ConvertVectorTailsAndOffsetsBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dst_dtype : kFloatDTypes) {
    for (DType src_dtype : kFloatDTypes) {
      for (int64_t offset : kViewOffsets) {
        const int64_t rows = 13, cols = 301, size = offset + rows * cols;
        const auto v = [&](const Tensor& buffer) { return buffer.slice(offset, {rows, cols}); };
        Random rng(93);
        const HostTensor src = random_tensor(rng, src_dtype, {size}, -300.0, 300.0);
        const HostTensor dst = random_tensor(rng, dst_dtype, {size});
        TwinBuffers t({&dst, &src});
        cpu_backend().copy(v(t.cpu[0]), v(t.cpu[1]), nullptr);
        GpuRun run;
        cuda_backend().copy(v(run(t.gpu[0])), v(run(t.gpu[1])), nullptr);
        run.finish();
        const std::string where =
            std::string(dtype_name(src_dtype)) + " -> " + view_case(dst_dtype, rows, cols, offset);
        EXPECT_TRUE(t.bitwise_equal_all()) << where;
        EXPECT_TRUE(t.guards_intact_all()) << where;
      }
    }
  }
}

// add_bias: the vector kernel needs cols % 8 == 0 and x, bias aligned (bias in another dtype).
TEST(CudaElementwise, AddBiasVectorOffsetsBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{5, 40}, {3, 37}}) {
      for (int64_t offset : kViewOffsets) {
        const int64_t size = offset + rows * cols;
        Random rng(94);
        const HostTensor x = random_tensor(rng, dtype, {size});
        const HostTensor bias = random_tensor(rng, DType::F32, {offset + cols});
        TwinBuffers t({&x, &bias});
        cpu_backend().add_bias(t.cpu[0].t().slice(offset, {rows, cols}),
                               t.cpu[1].t().slice(offset, {cols}), nullptr);
        GpuRun run;
        cuda_backend().add_bias(run(t.gpu[0]).slice(offset, {rows, cols}),
                                run(t.gpu[1]).slice(offset, {cols}), nullptr);
        run.finish();
        const std::string where = view_case(dtype, rows, cols, offset);
        EXPECT_FALSE(bitwise_equal(t.cpu[0], x)) << "the reference did not change";
        EXPECT_TRUE(t.bitwise_equal_all()) << where;
        EXPECT_TRUE(t.guards_intact_all()) << where;
      }
    }
  }
}

}  // namespace
}  // namespace dstrain::test
