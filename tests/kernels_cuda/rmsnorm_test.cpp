// RMSNorm forward and backward against the CPU twin. The row sums run in another order (warp
// butterfly vs sequential), so rstd may differ in its last bit and results agree within a
// tolerance:
//   out, dinp: F32 {atol 2e-5, rtol 1e-4, nmse 1e-10}; F16/BF16 storage_tolerance (a last-bit
//   change of rstd can move the normalized value to the neighbouring storage value)
//   rstd: row_stat_tolerance(C, 1e-11): {1e-6, 1e-5, 1e-11} up to C = 1000 (the twin's
//   sequential fp32 sum of C = 1000 squares is off by ~sqrt(C) ulps, a relative rms error ~1e-6:
//   nmse ~1e-12 happens, seen at 1.5e-12), the nmse bound growing with C beyond (its square)
//   dweight (sums over N rows, in partials): F32 {1e-4, 1e-4, 1e-9}; F16/BF16 activations
//   storage_tolerance (its terms use the normalized value rounded to storage, see above)
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

constexpr float kEps = 1e-5f;

// (..., C): round, odd (C = 37, 3-D), 300 rows (three dweight chunks) of 1000 channels, and rows
// of 4104 (a block of 8 warps per row).
const std::vector<std::vector<int64_t>> kShapes = {{64, 768}, {5, 7, 37}, {300, 1000}, {3, 4104}};

Tolerance value_tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{2e-5, 1e-4, 1e-10} : storage_tolerance(dtype);
}

Tolerance column_sum_tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{1e-4, 1e-4, 1e-9} : storage_tolerance(dtype);
}

int64_t rows(const std::vector<int64_t>& shape) {
  return HostTensor(DType::F32, shape).numel() / shape.back();
}

TEST(CudaRmsnorm, ForwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& shape : kShapes) {
      const int64_t C = shape.back(), N = rows(shape);
      Random rng(61);
      HostTensor inp = random_tensor(rng, dtype, shape, -2.0, 3.0);
      HostTensor weight = random_tensor(rng, dtype, {C}, 0.5, 1.5);
      HostTensor out_cpu = nan_tensor(dtype, shape), out_gpu = out_cpu.clone();
      HostTensor rstd_cpu = nan_tensor(DType::F32, {N}), rstd_gpu = rstd_cpu.clone();
      cpu_backend().rmsnorm_forward(out_cpu, rstd_cpu, inp, weight, kEps, nullptr);
      HostTensor inp_gpu = inp.clone();
      GpuRun run;
      cuda_backend().rmsnorm_forward(run(out_gpu), run(rstd_gpu), run(inp_gpu), run(weight), kEps,
                                     nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " " + inp.t().shape_str();
      EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), value_tolerance(dtype))) << where;
      EXPECT_TRUE(all_close(rstd_gpu.values(), rstd_cpu.values(), row_stat_tolerance(C, 1e-11)))
          << where;
      EXPECT_TRUE(bitwise_equal(inp_gpu, inp)) << where;
      EXPECT_TRUE(guards_intact({&out_gpu, &rstd_gpu, &inp_gpu})) << where;
    }
  }
}

TEST(CudaRmsnorm, BackwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    // BF16 activations with an F32 weight gradient (the training setup); F32 and F16 keep
    // dweight in their own dtype so its rounding on accumulate is covered too.
    const DType dweight_dtype = dtype == DType::BF16 ? DType::F32 : dtype;
    for (const auto& shape : kShapes) {
      const int64_t C = shape.back(), N = rows(shape);
      Random rng(62);
      HostTensor inp = random_tensor(rng, dtype, shape, -2.0, 3.0);
      HostTensor weight = random_tensor(rng, dtype, {C}, 0.5, 1.5);
      HostTensor out = nan_tensor(dtype, shape), rstd = nan_tensor(DType::F32, {N});
      cpu_backend().rmsnorm_forward(out, rstd, inp, weight, kEps, nullptr);
      HostTensor dout = random_tensor(rng, dtype, shape);
      // Both gradients accumulate: start from non-zero values.
      HostTensor dinp_cpu = random_tensor(rng, dtype, shape), dinp_gpu = dinp_cpu.clone();
      HostTensor dweight_cpu = random_tensor(rng, dweight_dtype, {C});
      HostTensor dweight_gpu = dweight_cpu.clone();
      cpu_backend().rmsnorm_backward(dinp_cpu, dweight_cpu, dout, inp, weight, rstd, nullptr);
      GpuRun run;
      cuda_backend().rmsnorm_backward(run(dinp_gpu), run(dweight_gpu), run(dout), run(inp),
                                      run(weight), run(rstd), nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " " + inp.t().shape_str();
      EXPECT_TRUE(all_close(dinp_gpu.values(), dinp_cpu.values(), value_tolerance(dtype)))
          << "dinp " << where;
      EXPECT_TRUE(
          all_close(dweight_gpu.values(), dweight_cpu.values(), column_sum_tolerance(dtype)))
          << "dweight " << where;
      EXPECT_TRUE(guards_intact({&dinp_gpu, &dweight_gpu})) << where;
    }
  }
}

// The backward on the register-held rows (kRowC: one warp and one block per row) at
// aligned offsets and on the scalar kernels (1 element in), against the CPU twin. Every buffer
// compared whole: the elements before a view and the guards come back as they were.
TEST(CudaRmsnorm, BackwardVectorRowsAndOffsetsMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  // Both row forms where C <= 2048: one warp per row (the default) and a block of 8 warps.
  for (bool block_per_row : {false, true}) {
    const BlockPerRowNorms form(block_per_row);
    for (DType dtype : kFloatDTypes) {
      for (int64_t C : kRowC) {
        for (int64_t offset : kViewOffsets) {
          const int64_t N = 5, size = offset + N * C;
          const auto rows = [&](const Tensor& buffer) { return buffer.slice(offset, {N, C}); };
          const auto cols = [&](const Tensor& buffer) { return buffer.slice(offset, {C}); };
          Random rng(63);
          const HostTensor inp = random_tensor(rng, dtype, {size}, -2.0, 3.0);
          const HostTensor weight = random_tensor(rng, dtype, {offset + C}, 0.5, 1.5);
          HostTensor out = nan_tensor(dtype, {size}), rstd = nan_tensor(DType::F32, {N});
          cpu_backend().rmsnorm_forward(rows(out), rstd, rows(inp), cols(weight), kEps, nullptr);
          const HostTensor dout = random_tensor(rng, dtype, {size});
          const HostTensor dinp = random_tensor(rng, dtype, {size});  // both accumulate
          const HostTensor dweight = random_tensor(rng, DType::F32, {offset + C});
          TwinBuffers t({&dinp, &dweight, &dout, &inp, &weight});
          cpu_backend().rmsnorm_backward(rows(t.cpu[0]), cols(t.cpu[1]), rows(t.cpu[2]),
                                         rows(t.cpu[3]), cols(t.cpu[4]), rstd, nullptr);
          GpuRun run;
          cuda_backend().rmsnorm_backward(rows(run(t.gpu[0])), cols(run(t.gpu[1])),
                                          rows(run(t.gpu[2])), rows(run(t.gpu[3])),
                                          cols(run(t.gpu[4])), run(rstd), nullptr);
          run.finish();
          const std::string where =
              view_case(dtype, N, C, offset) + (block_per_row ? " (8 warps per row)" : "");
          EXPECT_FALSE(bitwise_equal(t.gpu[0], dinp)) << "dinp did not change, " << where;
          EXPECT_TRUE(all_close(t.gpu[0].values(), t.cpu[0].values(), value_tolerance(dtype)))
              << "dinp " << where;
          EXPECT_TRUE(
              all_close(t.gpu[1].values(), t.cpu[1].values(), column_sum_tolerance(DType::F32)))
              << "dweight " << where;
          EXPECT_TRUE(bitwise_equal(t.gpu[2], dout) && bitwise_equal(t.gpu[3], inp)) << where;
          EXPECT_TRUE(t.guards_intact_all()) << where;
        }
      }
    }
  }
}

// dweight takes 8 columns per thread with 128-bit loads where the rows allow and one column per
// thread where they do not (a view 1 element in): per column the same terms in the same order,
// so the same bits. N = 300: three chunks of rows, the last short; C = 8200 is above the
// register-held rows' bound but still in packs of 8.
TEST(CudaRmsnorm, DweightVectorAndScalarPathsGiveTheSameBits) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (int64_t C : {int64_t{40}, int64_t{264}, int64_t{8200}}) {
      const int64_t N = 300;
      Random rng(64);
      HostTensor inp = random_tensor(rng, dtype, {N, C}, -2.0, 3.0);
      HostTensor dout = random_tensor(rng, dtype, {N, C});
      HostTensor weight = random_tensor(rng, dtype, {C}, 0.5, 1.5);
      const HostTensor dweight = random_tensor(rng, DType::F32, {C});
      HostTensor rstd(DType::F32, {N}), out(dtype, {N, C});
      cpu_backend().rmsnorm_forward(out, rstd, inp, weight, kEps, nullptr);
      // The rows again, 1 element into a buffer: misaligned for every dtype.
      HostTensor shifted_inp = one_element_in(inp), shifted_dout = one_element_in(dout);
      HostTensor dw_vector = dweight.clone(), dw_scalar = dweight.clone();
      HostTensor dinp_vector = random_tensor(rng, dtype, {N, C}), dinp_scalar = dinp_vector.clone();
      GpuRun run;
      const Tensor w = run(weight), s = run(rstd);
      cuda_backend().rmsnorm_backward(run(dinp_vector), run(dw_vector), run(dout), run(inp), w, s,
                                      nullptr);
      cuda_backend().rmsnorm_backward(run(dinp_scalar), run(dw_scalar),
                                      run(shifted_dout).slice(1, {N, C}),
                                      run(shifted_inp).slice(1, {N, C}), w, s, nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " C " + std::to_string(C);
      EXPECT_FALSE(bitwise_equal(dw_vector, dweight)) << "dweight did not change, " << where;
      EXPECT_TRUE(bitwise_equal(dw_vector, dw_scalar)) << "dweight " << where;
    }
  }
}

// The residual add fused into the RMSNorm: on the GPU bitwise what residual_forward then
// rmsnorm_forward give there (the residual stream, the normalized rows, rstd), on the
// register-held rows (kFusedNormC at aligned offsets) and on the fallback (misaligned views,
// C = 13); against the CPU's two ops the residual is bitwise, the rest within the RMSNorm's
// tolerances. Buffers compared whole.
TEST(CudaRmsnorm, ResidualFusedIsBitwiseTheTwoOps) {
  REQUIRE_CUDA_DEVICE();
  // Both row forms where C <= 2048: one warp per row (the default) and a block of 8 warps.
  for (bool block_per_row : {false, true}) {
    const BlockPerRowNorms form(block_per_row);
    for (DType dtype : kFloatDTypes) {
      for (int64_t C : kFusedNormC) {
        for (int64_t offset : kViewOffsets) {
          const int64_t N = 5, size = offset + N * C;
          Random rng(62);
          const HostTensor a = random_tensor(rng, dtype, {size}, -2.0, 3.0);
          const HostTensor b = random_tensor(rng, dtype, {size}, -1.0, 1.0);
          const HostTensor weight = random_tensor(rng, dtype, {offset + C}, 0.5, 1.5);
          const HostTensor residual = random_tensor(rng, dtype, {size});  // compared whole
          const HostTensor out = random_tensor(rng, dtype, {size});
          const HostTensor rstd = nan_tensor(DType::F32, {N});
          TwinBuffers fused({&residual, &out, &rstd, &a, &b, &weight});
          TwinBuffers two_ops({&residual, &out, &rstd, &a, &b, &weight});
          const auto rows = [&](const Tensor& buffer) { return buffer.slice(offset, {N, C}); };
          const auto cols = [&](const Tensor& buffer) { return buffer.slice(offset, {C}); };
          std::vector<Tensor> f(fused.cpu.begin(), fused.cpu.end());
          cpu_backend().residual_rmsnorm_forward(rows(f[0]), rows(f[1]), f[2], rows(f[3]),
                                                 rows(f[4]), cols(f[5]), kEps, nullptr);
          GpuRun run;
          std::vector<Tensor> g, h;
          for (HostTensor& buffer : fused.gpu) g.push_back(run(buffer));
          for (HostTensor& buffer : two_ops.gpu) h.push_back(run(buffer));
          cuda_backend().residual_rmsnorm_forward(rows(g[0]), rows(g[1]), g[2], rows(g[3]),
                                                  rows(g[4]), cols(g[5]), kEps, nullptr);
          cuda_backend().residual_forward(rows(h[0]), rows(h[3]), rows(h[4]), nullptr);
          cuda_backend().rmsnorm_forward(rows(h[1]), h[2], rows(h[0]), cols(h[5]), kEps, nullptr);
          run.finish();
          const std::string where =
              view_case(dtype, N, C, offset) + (block_per_row ? " (8 warps per row)" : "");
          EXPECT_GT(norm_squared(fused.cpu[1].values()), 0.0);
          EXPECT_TRUE(gpu_buffers_bitwise_equal(fused, two_ops)) << where;
          EXPECT_TRUE(bitwise_equal(fused.gpu[0], fused.cpu[0])) << "residual " << where;
          EXPECT_TRUE(
              all_close(fused.gpu[1].values(), fused.cpu[1].values(), value_tolerance(dtype)))
              << where;
          EXPECT_TRUE(
              all_close(fused.gpu[2].values(), fused.cpu[2].values(), row_stat_tolerance(C, 1e-11)))
              << "rstd " << where;
          EXPECT_TRUE(fused.guards_intact_all()) << where;
        }
      }
    }
  }
}

}  // namespace
}  // namespace dstrain::test
