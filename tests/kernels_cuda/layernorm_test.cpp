// Layernorm forward and backward against the CPU twin. The row sums run in another order
// (warp butterfly vs sequential), so results agree within a tolerance:
//   out, dinp: F32 {atol 2e-5, rtol 1e-4, nmse 1e-10}; F16/BF16 storage_tolerance
//   mean, rstd: row_stat_tolerance(C, 1e-12): {1e-6, 1e-5, 1e-12} up to C = 1000, the nmse
//   bound growing with C beyond (the twin's sequential sum, see cuda_test_util.h)
//   dweight, dbias (sums over N rows, in partials): F32 {1e-4, 1e-4, 1e-9};
//   F16/BF16 storage_tolerance
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct LayernormCase {
  std::vector<int64_t> shape;  // (..., C)
};

const LayernormCase kCases[] = {{{64, 768}}, {{5, 7, 13}}, {{300, 1600}}};

Tolerance value_tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{2e-5, 1e-4, 1e-10} : storage_tolerance(dtype);
}

Tolerance column_sum_tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{1e-4, 1e-4, 1e-9} : storage_tolerance(dtype);
}

TEST(CudaLayernorm, ForwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const LayernormCase& c : kCases) {
      const int64_t C = c.shape.back(), N = HostTensor(DType::F32, c.shape).numel() / C;
      Random rng(31);
      HostTensor inp = random_tensor(rng, dtype, c.shape, -2.0, 3.0);
      HostTensor weight = random_tensor(rng, dtype, {C}, 0.5, 1.5);
      HostTensor bias = random_tensor(rng, DType::F32, {C});
      HostTensor out_cpu = nan_tensor(dtype, c.shape), out_gpu = out_cpu.clone();
      HostTensor mean_cpu = nan_tensor(DType::F32, {N}), mean_gpu = mean_cpu.clone();
      HostTensor rstd_cpu = nan_tensor(DType::F32, {N}), rstd_gpu = rstd_cpu.clone();
      cpu_backend().layernorm_forward(out_cpu, mean_cpu, rstd_cpu, inp, weight, bias, nullptr);
      HostTensor inp_gpu = inp.clone();
      GpuRun run;
      cuda_backend().layernorm_forward(run(out_gpu), run(mean_gpu), run(rstd_gpu), run(inp_gpu),
                                       run(weight), run(bias), nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " " + inp.t().shape_str();
      EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), value_tolerance(dtype))) << where;
      EXPECT_TRUE(all_close(mean_gpu.values(), mean_cpu.values(), row_stat_tolerance(C, 1e-12)))
          << where;
      EXPECT_TRUE(all_close(rstd_gpu.values(), rstd_cpu.values(), row_stat_tolerance(C, 1e-12)))
          << where;
      EXPECT_TRUE(bitwise_equal(inp_gpu, inp));
      EXPECT_TRUE(guards_intact({&out_gpu, &mean_gpu, &rstd_gpu, &inp_gpu}));
    }
  }
}

TEST(CudaLayernorm, BackwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const LayernormCase& c : kCases) {
      const int64_t C = c.shape.back(), N = HostTensor(DType::F32, c.shape).numel() / C;
      Random rng(32);
      HostTensor inp = random_tensor(rng, dtype, c.shape, -2.0, 3.0);
      HostTensor weight = random_tensor(rng, dtype, {C}, 0.5, 1.5);
      HostTensor bias = random_tensor(rng, dtype, {C});
      HostTensor out = nan_tensor(dtype, c.shape);
      HostTensor mean = nan_tensor(DType::F32, {N}), rstd = nan_tensor(DType::F32, {N});
      cpu_backend().layernorm_forward(out, mean, rstd, inp, weight, bias, nullptr);
      HostTensor dout = random_tensor(rng, dtype, c.shape);
      // All three gradients accumulate: start from non-zero values.
      HostTensor dinp_cpu = random_tensor(rng, dtype, c.shape), dinp_gpu = dinp_cpu.clone();
      HostTensor dweight_cpu = random_tensor(rng, DType::F32, {C}),
                 dweight_gpu = dweight_cpu.clone();
      HostTensor dbias_cpu = random_tensor(rng, dtype, {C}), dbias_gpu = dbias_cpu.clone();
      cpu_backend().layernorm_backward(dinp_cpu, dweight_cpu, dbias_cpu, dout, inp, weight, mean,
                                       rstd, nullptr);
      GpuRun run;
      cuda_backend().layernorm_backward(run(dinp_gpu), run(dweight_gpu), run(dbias_gpu), run(dout),
                                        run(inp), run(weight), run(mean), run(rstd), nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " " + inp.t().shape_str();
      EXPECT_TRUE(all_close(dinp_gpu.values(), dinp_cpu.values(), value_tolerance(dtype)))
          << "dinp " << where;
      EXPECT_TRUE(
          all_close(dweight_gpu.values(), dweight_cpu.values(), column_sum_tolerance(DType::F32)))
          << "dweight " << where;
      EXPECT_TRUE(all_close(dbias_gpu.values(), dbias_cpu.values(), column_sum_tolerance(dtype)))
          << "dbias " << where;
      EXPECT_TRUE(guards_intact({&dinp_gpu, &dweight_gpu, &dbias_gpu}));
    }
  }
}

// ---- the register-held vector rows (kRowC: one warp or one block per row), views 16 bytes
// into a buffer (vector path) or 1 element in (misaligned: the scalar kernels). Every row
// tensor, weight and bias start at the same offset. ----

TEST(CudaLayernorm, ForwardVectorRowsAndOffsetsMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  // Both row forms where C <= 2048: one warp per row (the default) and a block of 8 warps.
  for (bool block_per_row : {false, true}) {
    const BlockPerRowNorms form(block_per_row);
    for (DType dtype : kFloatDTypes) {
      for (int64_t C : kRowC) {
        for (int64_t offset : kViewOffsets) {
          const int64_t N = 5, size = offset + N * C;
          Random rng(33);
          const HostTensor inp = random_tensor(rng, dtype, {size}, -2.0, 3.0);
          const HostTensor weight = random_tensor(rng, dtype, {offset + C}, 0.5, 1.5);
          const HostTensor bias = random_tensor(rng, DType::F32, {offset + C});
          const HostTensor out = random_tensor(rng, dtype, {size});  // not NaN: compared whole
          const HostTensor stats = nan_tensor(DType::F32, {N});
          TwinBuffers t({&out, &stats, &stats, &inp, &weight, &bias});
          const auto rows = [&](const Tensor& buffer) { return buffer.slice(offset, {N, C}); };
          const auto cols = [&](const Tensor& buffer) { return buffer.slice(offset, {C}); };
          cpu_backend().layernorm_forward(rows(t.cpu[0]), t.cpu[1], t.cpu[2], rows(t.cpu[3]),
                                          cols(t.cpu[4]), cols(t.cpu[5]), nullptr);
          GpuRun run;
          cuda_backend().layernorm_forward(rows(run(t.gpu[0])), run(t.gpu[1]), run(t.gpu[2]),
                                           rows(run(t.gpu[3])), cols(run(t.gpu[4])),
                                           cols(run(t.gpu[5])), nullptr);
          run.finish();
          const std::string where =
              view_case(dtype, N, C, offset) + (block_per_row ? " (8 warps per row)" : "");
          EXPECT_GT(norm_squared(t.cpu[0].values()), 0.0);
          EXPECT_TRUE(all_close(t.gpu[0].values(), t.cpu[0].values(), value_tolerance(dtype)))
              << where;
          for (int stat : {1, 2}) {
            EXPECT_TRUE(
                all_close(t.gpu[stat].values(), t.cpu[stat].values(), row_stat_tolerance(C, 1e-12)))
                << (stat == 1 ? "mean " : "rstd ") << where;
          }
          EXPECT_TRUE(bitwise_equal(t.gpu[3], inp)) << where;
          EXPECT_TRUE(t.guards_intact_all()) << where;
        }
      }
    }
  }
}

TEST(CudaLayernorm, BackwardVectorRowsAndOffsetsMatchCpu) {
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
          Random rng(34);
          const HostTensor inp = random_tensor(rng, dtype, {size}, -2.0, 3.0);
          const HostTensor weight = random_tensor(rng, dtype, {offset + C}, 0.5, 1.5);
          const HostTensor bias = random_tensor(rng, dtype, {offset + C});
          HostTensor out = nan_tensor(dtype, {size});
          HostTensor mean = nan_tensor(DType::F32, {N}), rstd = nan_tensor(DType::F32, {N});
          cpu_backend().layernorm_forward(rows(out), mean, rstd, rows(inp), cols(weight),
                                          cols(bias), nullptr);
          const HostTensor dout = random_tensor(rng, dtype, {size});
          // All three gradients accumulate: start from non-zero values.
          const HostTensor dinp = random_tensor(rng, dtype, {size});
          const HostTensor dweight = random_tensor(rng, DType::F32, {offset + C});
          const HostTensor dbias = random_tensor(rng, dtype, {offset + C});
          TwinBuffers t({&dinp, &dweight, &dbias, &dout, &inp, &weight});
          cpu_backend().layernorm_backward(rows(t.cpu[0]), cols(t.cpu[1]), cols(t.cpu[2]),
                                           rows(t.cpu[3]), rows(t.cpu[4]), cols(t.cpu[5]), mean,
                                           rstd, nullptr);
          GpuRun run;
          cuda_backend().layernorm_backward(
              rows(run(t.gpu[0])), cols(run(t.gpu[1])), cols(run(t.gpu[2])), rows(run(t.gpu[3])),
              rows(run(t.gpu[4])), cols(run(t.gpu[5])), run(mean), run(rstd), nullptr);
          run.finish();
          const std::string where =
              view_case(dtype, N, C, offset) + (block_per_row ? " (8 warps per row)" : "");
          EXPECT_TRUE(all_close(t.gpu[0].values(), t.cpu[0].values(), value_tolerance(dtype)))
              << "dinp " << where;
          EXPECT_TRUE(
              all_close(t.gpu[1].values(), t.cpu[1].values(), column_sum_tolerance(DType::F32)))
              << "dweight " << where;
          EXPECT_TRUE(all_close(t.gpu[2].values(), t.cpu[2].values(), column_sum_tolerance(dtype)))
              << "dbias " << where;
          EXPECT_TRUE(t.guards_intact_all()) << where;
        }
      }
    }
  }
}

// The residual add fused into the layernorm: on the GPU bitwise what residual_forward then
// layernorm_forward give there (the residual stream, the normalized rows, mean and rstd), on
// the vector rows (kFusedNormC at aligned offsets) and on the fallback (misaligned views, C = 13);
// against the CPU's two ops the residual is bitwise, the rest within the layernorm's
// tolerances. Every buffer compared whole, guards intact.
TEST(CudaLayernorm, ResidualFusedIsBitwiseTheTwoOps) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (int64_t C : kFusedNormC) {
      for (int64_t offset : kViewOffsets) {
        const int64_t N = 5, size = offset + N * C;
        Random rng(34);
        const HostTensor a = random_tensor(rng, dtype, {size}, -2.0, 3.0);
        const HostTensor b = random_tensor(rng, dtype, {size}, -1.0, 1.0);
        const HostTensor weight = random_tensor(rng, dtype, {offset + C}, 0.5, 1.5);
        const HostTensor bias = random_tensor(rng, DType::F32, {offset + C});
        const HostTensor residual = random_tensor(rng, dtype, {size});  // compared whole
        const HostTensor out = random_tensor(rng, dtype, {size});
        const HostTensor stats = nan_tensor(DType::F32, {N});
        TwinBuffers fused({&residual, &out, &stats, &stats, &a, &b, &weight, &bias});
        TwinBuffers two_ops({&residual, &out, &stats, &stats, &a, &b, &weight, &bias});
        const auto rows = [&](const Tensor& buffer) { return buffer.slice(offset, {N, C}); };
        const auto cols = [&](const Tensor& buffer) { return buffer.slice(offset, {C}); };
        std::vector<Tensor> f(fused.cpu.begin(), fused.cpu.end());
        cpu_backend().residual_layernorm_forward(rows(f[0]), rows(f[1]), f[2], f[3], rows(f[4]),
                                                 rows(f[5]), cols(f[6]), cols(f[7]), nullptr);
        GpuRun run;
        std::vector<Tensor> g, h;
        for (HostTensor& buffer : fused.gpu) g.push_back(run(buffer));
        for (HostTensor& buffer : two_ops.gpu) h.push_back(run(buffer));
        cuda_backend().residual_layernorm_forward(rows(g[0]), rows(g[1]), g[2], g[3], rows(g[4]),
                                                  rows(g[5]), cols(g[6]), cols(g[7]), nullptr);
        cuda_backend().residual_forward(rows(h[0]), rows(h[4]), rows(h[5]), nullptr);
        cuda_backend().layernorm_forward(rows(h[1]), h[2], h[3], rows(h[0]), cols(h[6]), cols(h[7]),
                                         nullptr);
        run.finish();
        const std::string where = view_case(dtype, N, C, offset);
        EXPECT_GT(norm_squared(fused.cpu[1].values()), 0.0);
        EXPECT_TRUE(gpu_buffers_bitwise_equal(fused, two_ops)) << where;
        EXPECT_TRUE(bitwise_equal(fused.gpu[0], fused.cpu[0])) << "residual " << where;
        EXPECT_TRUE(all_close(fused.gpu[1].values(), fused.cpu[1].values(), value_tolerance(dtype)))
            << where;
        for (int stat : {2, 3}) {
          EXPECT_TRUE(all_close(fused.gpu[stat].values(), fused.cpu[stat].values(),
                                row_stat_tolerance(C, 1e-12)))
              << (stat == 2 ? "mean " : "rstd ") << where;
        }
        EXPECT_TRUE(fused.guards_intact_all()) << where;
      }
    }
  }
}

// dweight and dbias (the column sums) take 8 columns per thread with 128-bit loads where the
// rows allow and one column per thread where they do not (a view 1 element in): per column the
// same terms in the same order, so the same bits. N = 300: three chunks of rows, the last short;
// C = 8200 is above the register-held rows' bound but still in packs of 8.
TEST(CudaLayernorm, ColumnSumsVectorAndScalarPathsGiveTheSameBits) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (int64_t C : {int64_t{40}, int64_t{264}, int64_t{8200}}) {
      const int64_t N = 300;
      Random rng(35);
      HostTensor inp = random_tensor(rng, dtype, {N, C}, -2.0, 3.0);
      HostTensor dout = random_tensor(rng, dtype, {N, C});
      HostTensor weight = random_tensor(rng, dtype, {C}, 0.5, 1.5);
      const HostTensor bias = random_tensor(rng, dtype, {C});
      const HostTensor dweight = random_tensor(rng, DType::F32, {C});
      const HostTensor dbias = random_tensor(rng, DType::F32, {C});
      HostTensor mean(DType::F32, {N}), rstd(DType::F32, {N}), out(dtype, {N, C});
      cpu_backend().layernorm_forward(out, mean, rstd, inp, weight, bias, nullptr);
      // The rows again, 1 element into a buffer: misaligned for every dtype.
      HostTensor shifted_inp = one_element_in(inp), shifted_dout = one_element_in(dout);
      HostTensor dw_vector = dweight.clone(), db_vector = dbias.clone();
      HostTensor dw_scalar = dweight.clone(), db_scalar = dbias.clone();
      HostTensor dinp_vector(dtype, {N, C}), dinp_scalar(dtype, {N, C});
      GpuRun run;
      const Tensor w = run(weight);
      const Tensor m = run(mean), s = run(rstd);
      cuda_backend().layernorm_backward(run(dinp_vector), run(dw_vector), run(db_vector), run(dout),
                                        run(inp), w, m, s, nullptr);
      cuda_backend().layernorm_backward(run(dinp_scalar), run(dw_scalar), run(db_scalar),
                                        run(shifted_dout).slice(1, {N, C}),
                                        run(shifted_inp).slice(1, {N, C}), w, m, s, nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " C " + std::to_string(C);
      EXPECT_FALSE(bitwise_equal(dw_vector, dweight)) << "dweight did not change, " << where;
      EXPECT_TRUE(bitwise_equal(dw_vector, dw_scalar)) << "dweight " << where;
      EXPECT_TRUE(bitwise_equal(db_vector, db_scalar)) << "dbias " << where;
    }
  }
}

}  // namespace
}  // namespace dstrain::test
