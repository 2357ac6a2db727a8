// The mixture-of-experts kernels (kernels/cuda/cuda_moe.cu) against the CPU twin on the same
// data: routing and its backward, the dispatch, gather, combine and its backward, the grouped
// matmul, in every storage dtype, round and odd shapes, with an expert that receives no token
// and dropped choices. The kernels' arithmetic is the twin's: on the emulator the results are
// bitwise equal (the index outputs always), except the combine backward's dweight (a block's
// tree sum, not the twin's sequential one: fp32 rounding). On a GPU nvcc's expf and FMA
// contraction differ in the last bits: F32 {2e-6, 2e-5, 1e-10}, 16-bit storage_tolerance.
#include <numeric>
#include <string>

#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

const MoeRouting kRoutings[] = {{8, 2, RouterScore::Softmax, true, 1.0f},
                                {5, 3, RouterScore::Softmax, false, 1.0f},
                                {6, 2, RouterScore::Sigmoid, true, 2.5f}};

TEST(CudaMoe, RoutingAndItsBackwardMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const MoeRouting& routing : kRoutings) {
      for (int64_t N : {16, 7}) {
        Random rng(81);
        const int64_t E = routing.experts, k = routing.top_k;
        HostTensor logits = random_tensor(rng, dtype, {N, E}, -3.0, 3.0);
        HostTensor w_cpu = nan_tensor(DType::F32, {N, k}), w_gpu = w_cpu.clone();
        HostTensor s_cpu = nan_tensor(DType::F32, {N, E}), s_gpu = s_cpu.clone();
        HostTensor e_cpu(DType::I32, {N, k}), e_gpu(DType::I32, {N, k});
        cpu_backend().moe_route(w_cpu, e_cpu, s_cpu, logits, routing, nullptr);
        HostTensor dw = random_tensor(rng, DType::F32, {N, k});
        HostTensor ds = random_tensor(rng, DType::F32, {N, E});
        HostTensor dl_cpu = random_tensor(rng, dtype, {N, E}), dl_gpu = dl_cpu.clone();
        cpu_backend().moe_route_backward(dl_cpu, dw, ds, s_cpu, e_cpu, routing, nullptr);
        GpuRun run;
        HostTensor logits_gpu = logits.clone(), dw_gpu = dw.clone(), ds_gpu = ds.clone();
        const Tensor s = run(s_gpu), e = run(e_gpu);
        cuda_backend().moe_route(run(w_gpu), e, s, run(logits_gpu), routing, nullptr);
        cuda_backend().moe_route_backward(run(dl_gpu), run(dw_gpu), run(ds_gpu), s, e, routing,
                                          nullptr);
        run.finish();
        const std::string where = std::string(dtype_name(dtype)) + " N " + std::to_string(N) +
                                  " E " + std::to_string(E) + " k " + std::to_string(k);
        EXPECT_TRUE(bitwise_equal(e_gpu, e_cpu)) << where;
        EXPECT_TRUE(matches_twin(w_gpu, w_cpu)) << where;
        EXPECT_TRUE(matches_twin(s_gpu, s_cpu)) << where;
        EXPECT_TRUE(matches_twin(dl_gpu, dl_cpu)) << where;
        EXPECT_TRUE(guards_intact({&w_gpu, &s_gpu, &e_gpu, &dl_gpu})) << where;
      }
    }
  }
}

// DeepSeek's routers: V2's group-limited choice, V3's biased one by the sum of each group's two
// best (the bias a device tensor on the GPU, the host's on the twin).
TEST(CudaMoe, DeepSeekRoutingMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  Random rng(83);
  HostTensor bias = random_tensor(rng, DType::F32, {16}, -0.3, 0.3);
  for (bool v3 : {false, true}) {
    MoeRouting routing{16, v3 ? 4 : 3, v3 ? RouterScore::Sigmoid : RouterScore::Softmax, v3,
                       v3 ? 2.5f : 1.5f, 4, 2, v3 ? GroupScore::TopTwoSum : GroupScore::Max};
    const int64_t N = 37, E = 16, k = routing.top_k;
    HostTensor logits = random_tensor(rng, DType::BF16, {N, E}, -3.0, 3.0);
    HostTensor w_cpu = nan_tensor(DType::F32, {N, k}), w_gpu = w_cpu.clone();
    HostTensor s_cpu = nan_tensor(DType::F32, {N, E}), s_gpu = s_cpu.clone();
    HostTensor e_cpu(DType::I32, {N, k}), e_gpu(DType::I32, {N, k});
    if (v3) routing.selection_bias = bias;
    cpu_backend().moe_route(w_cpu, e_cpu, s_cpu, logits, routing, nullptr);
    GpuRun run;
    HostTensor logits_gpu = logits.clone(), bias_gpu = bias.clone();
    if (v3) routing.selection_bias = run(bias_gpu);
    cuda_backend().moe_route(run(w_gpu), run(e_gpu), run(s_gpu), run(logits_gpu), routing, nullptr);
    run.finish();
    EXPECT_TRUE(bitwise_equal(e_gpu, e_cpu)) << (v3 ? "V3" : "V2");
    EXPECT_TRUE(matches_twin(w_gpu, w_cpu)) << (v3 ? "V3" : "V2");
    EXPECT_TRUE(matches_twin(s_gpu, s_cpu)) << (v3 ? "V3" : "V2");
    EXPECT_TRUE(guards_intact({&w_gpu, &s_gpu, &e_gpu})) << (v3 ? "V3" : "V2");
  }
}

// Enough choices for several rounds of the placement's block scan (256 at a time), one expert
// without a token.
TEST(CudaMoe, DispatchMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (int64_t N : {700, 3}) {
    const int E = 9, k = 2;
    Random rng(82);
    HostTensor experts(DType::I32, {N, k});
    for (int64_t i = 0; i < N * k; ++i) {
      const int e = static_cast<int>(rng.integer(E - 1));
      experts.i32()[i] = e >= 6 ? e + 1 : e;
    }
    HostTensor o_cpu(DType::I32, {E + 1}), src_cpu(DType::I32, {N * k}),
        dst_cpu(DType::I32, {N, k});
    HostTensor o_gpu = o_cpu.clone(), src_gpu = src_cpu.clone(), dst_gpu = dst_cpu.clone();
    cpu_backend().moe_dispatch(o_cpu, src_cpu, dst_cpu, experts, E, nullptr);
    HostTensor experts_gpu = experts.clone();
    GpuRun run;
    cuda_backend().moe_dispatch(run(o_gpu), run(src_gpu), run(dst_gpu), run(experts_gpu), E,
                                nullptr);
    run.finish();
    EXPECT_TRUE(bitwise_equal(o_gpu, o_cpu)) << N;
    EXPECT_TRUE(bitwise_equal(src_gpu, src_cpu)) << N;
    EXPECT_TRUE(bitwise_equal(dst_gpu, dst_cpu)) << N;
    EXPECT_EQ(o_gpu.i32()[6], o_gpu.i32()[7]) << "expert 6 has no token";
    EXPECT_TRUE(guards_intact({&o_gpu, &src_gpu, &dst_gpu})) << N;
  }
}

// A random permutation of M rows over the N x k choices, the last token's choices dropped.
HostTensor dest_rows(Random& rng, int64_t N, int64_t k) {
  HostTensor dest(DType::I32, {N, k});
  std::vector<int32_t> rows(static_cast<size_t>((N - 1) * k));
  std::iota(rows.begin(), rows.end(), 0);
  for (size_t i = rows.size(); i > 1; --i) {
    std::swap(rows[i - 1], rows[static_cast<size_t>(rng.integer(static_cast<int64_t>(i)))]);
  }
  for (int64_t i = 0; i < N * k; ++i) {
    dest.i32()[i] = i < (N - 1) * k ? rows[static_cast<size_t>(i)] : -1;
  }
  return dest;
}

TEST(CudaMoe, GatherCombineAndBackwardMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (int64_t C : {256, 37}) {
      const int64_t N = 6, k = 2, M = (N - 1) * k;
      Random rng(83);
      HostTensor dest = dest_rows(rng, N, k);
      HostTensor source(DType::I32, {M});
      for (int64_t i = 0; i < M; ++i) source.i32()[dest.i32()[i]] = static_cast<int32_t>(i / k);
      HostTensor x = random_tensor(rng, dtype, {N, C}), y = random_tensor(rng, dtype, {M, C});
      HostTensor w = random_tensor(rng, DType::F32, {N, k}, 0.0, 1.0);
      HostTensor dout = random_tensor(rng, dtype, {N, C});
      HostTensor g_cpu = nan_tensor(dtype, {M, C}), c_cpu = nan_tensor(dtype, {N, C});
      HostTensor dy_cpu = nan_tensor(dtype, {M, C}), dw_cpu = nan_tensor(DType::F32, {N, k});
      HostTensor g_gpu = g_cpu.clone(), c_gpu = c_cpu.clone(), dy_gpu = dy_cpu.clone(),
                 dw_gpu = dw_cpu.clone();
      cpu_backend().moe_gather(g_cpu, x, source, nullptr);
      cpu_backend().moe_combine(c_cpu, y, dest, w, nullptr);
      cpu_backend().moe_combine_backward(dy_cpu, dw_cpu, dout, y, dest, w, nullptr);
      HostTensor x_gpu = x.clone(), y_gpu = y.clone(), w_gpu = w.clone(), dout_gpu = dout.clone(),
                 dest_gpu = dest.clone(), source_gpu = source.clone();
      GpuRun run;
      const Tensor yd = run(y_gpu), dd = run(dest_gpu), wd = run(w_gpu);
      cuda_backend().moe_gather(run(g_gpu), run(x_gpu), run(source_gpu), nullptr);
      cuda_backend().moe_combine(run(c_gpu), yd, dd, wd, nullptr);
      cuda_backend().moe_combine_backward(run(dy_gpu), run(dw_gpu), run(dout_gpu), yd, dd, wd,
                                          nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " C " + std::to_string(C);
      EXPECT_TRUE(bitwise_equal(g_gpu, g_cpu)) << where;
      EXPECT_TRUE(matches_twin(c_gpu, c_cpu)) << where;
      EXPECT_TRUE(matches_twin(dy_gpu, dy_cpu)) << where;
      EXPECT_TRUE(all_close(dw_gpu.values(), dw_cpu.values(), {1e-5, 1e-4, 1e-10})) << where;
      EXPECT_EQ(dw_gpu.get((N - 1) * k), 0.0) << "a dropped choice";
      EXPECT_TRUE(guards_intact({&g_gpu, &c_gpu, &dy_gpu, &dw_gpu})) << where;
    }
  }
}

TEST(CudaMoe, GroupedMatmulAndItsBackwardMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    const std::vector<int> rows = {5, 0, 12, 3};
    const int64_t E = 4, C = 24, OC = 40, M = 20 + 2;  // 2 rows past the last expert's
    Random rng(84);
    HostTensor offsets(DType::I32, {E + 1});
    offsets.i32()[0] = 0;
    for (int64_t e = 0; e < E; ++e) offsets.i32()[e + 1] = offsets.i32()[e] + rows[e];
    HostTensor x = random_tensor(rng, dtype, {M, C}), w = random_tensor(rng, dtype, {E, OC, C});
    HostTensor dout = random_tensor(rng, dtype, {M, OC});
    HostTensor out_cpu = random_tensor(rng, dtype, {M, OC}), out_gpu = out_cpu.clone();
    HostTensor dx_cpu = random_tensor(rng, dtype, {M, C}), dx_gpu = dx_cpu.clone();
    HostTensor dw_cpu = random_tensor(rng, DType::F32, {E, OC, C}), dw_gpu = dw_cpu.clone();
    cpu_backend().grouped_matmul_forward(out_cpu, x, w, offsets, nullptr);
    cpu_backend().grouped_matmul_backward(dx_cpu, dw_cpu, dout, x, w, offsets, nullptr);
    HostTensor x_gpu = x.clone(), w_gpu = w.clone(), dout_gpu = dout.clone(),
               offsets_gpu = offsets.clone();
    GpuRun run;
    const Tensor xd = run(x_gpu), wd = run(w_gpu), od = run(offsets_gpu);
    cuda_backend().grouped_matmul_forward(run(out_gpu), xd, wd, od, nullptr);
    cuda_backend().grouped_matmul_backward(run(dx_gpu), run(dw_gpu), run(dout_gpu), xd, wd, od,
                                           nullptr);
    run.finish();
    // cuBLAS sums in its own order: the matmul tests' tolerances.
    const Tolerance tol =
        dtype == DType::F32 ? Tolerance{1e-5, 1e-4, 1e-10} : storage_tolerance(dtype);
    const std::string where = dtype_name(dtype);
    EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), tol)) << where;
    EXPECT_TRUE(all_close(dx_gpu.values(), dx_cpu.values(), tol)) << where;
    EXPECT_TRUE(all_close(dw_gpu.values(), dw_cpu.values(), {1e-5, 1e-4, 1e-10})) << where;
    EXPECT_TRUE(guards_intact({&out_gpu, &dx_gpu, &dw_gpu})) << where;
  }
}

}  // namespace
}  // namespace dstrain::test
