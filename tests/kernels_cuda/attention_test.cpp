// Causal attention forward and backward against the CPU twin, every dtype, head dims that take
// each kernel instance (<= 64, <= 128, <= 256) and odd T / hd that cut the tiles. The GPU's
// online softmax and tiled sums run in another order:
//   out: F32 {atol 1e-5, rtol 1e-4, nmse 1e-10}; F16/BF16 storage_tolerance
//   lse: {1e-5, 1e-5, 1e-11}
//   dqkv (dK, dV sum over up to T queries): F32 {5e-5, 1e-3, 1e-9}; F16/BF16 storage_tolerance
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct AttentionCase {
  int64_t B, T, NH, hd;
  int64_t C() const { return NH * hd; }
};

const AttentionCase kCases[] = {
    {2, 64, 4, 64},   // round
    {1, 37, 3, 5},    // odd
    {2, 70, 2, 128},  // 4 columns per lane
    {1, 100, 2, 96},  // 3 of 4 columns per lane used
    {1, 45, 1, 256},  // 8 columns per lane, 2 warps per block
};

std::string case_name(const AttentionCase& c, DType dtype) {
  return std::string(dtype_name(dtype)) + " B=" + std::to_string(c.B) +
         " T=" + std::to_string(c.T) + " NH=" + std::to_string(c.NH) +
         " hd=" + std::to_string(c.hd);
}

TEST(CudaAttention, ForwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const AttentionCase& c : kCases) {
      Random rng(61);
      HostTensor qkv = random_tensor(rng, dtype, {c.B, c.T, 3 * c.C()}, -1.5, 1.5);
      HostTensor out_cpu = nan_tensor(dtype, {c.B, c.T, c.C()}), out_gpu = out_cpu.clone();
      HostTensor lse_cpu = nan_tensor(DType::F32, {c.B, c.NH, c.T}), lse_gpu = lse_cpu.clone();
      cpu_backend().attention_forward(out_cpu, lse_cpu, qkv, static_cast<int>(c.NH), nullptr);
      HostTensor qkv_gpu = qkv.clone();
      GpuRun run;
      cuda_backend().attention_forward(run(out_gpu), run(lse_gpu), run(qkv_gpu),
                                       static_cast<int>(c.NH), nullptr);
      run.finish();
      const Tolerance tol =
          dtype == DType::F32 ? Tolerance{1e-5, 1e-4, 1e-10} : storage_tolerance(dtype);
      EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), tol))
          << "out " << case_name(c, dtype);
      EXPECT_TRUE(all_close(lse_gpu.values(), lse_cpu.values(), {1e-5, 1e-5, 1e-11}))
          << "lse " << case_name(c, dtype);
      EXPECT_TRUE(bitwise_equal(qkv_gpu, qkv));
      EXPECT_TRUE(guards_intact({&out_gpu, &lse_gpu, &qkv_gpu}));
    }
  }
}

TEST(CudaAttention, BackwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const AttentionCase& c : kCases) {
      Random rng(62);
      HostTensor qkv = random_tensor(rng, dtype, {c.B, c.T, 3 * c.C()}, -1.5, 1.5);
      HostTensor out = nan_tensor(dtype, {c.B, c.T, c.C()});
      HostTensor lse = nan_tensor(DType::F32, {c.B, c.NH, c.T});
      cpu_backend().attention_forward(out, lse, qkv, static_cast<int>(c.NH), nullptr);
      HostTensor dout = random_tensor(rng, dtype, {c.B, c.T, c.C()});
      HostTensor dqkv_cpu = nan_tensor(dtype, {c.B, c.T, 3 * c.C()}), dqkv_gpu = dqkv_cpu.clone();
      cpu_backend().attention_backward(dqkv_cpu, dout, qkv, out, lse, static_cast<int>(c.NH),
                                       nullptr);
      HostTensor dout_gpu = dout.clone(), qkv_gpu = qkv.clone(), out_gpu = out.clone(),
                 lse_gpu = lse.clone();
      GpuRun run;
      cuda_backend().attention_backward(run(dqkv_gpu), run(dout_gpu), run(qkv_gpu), run(out_gpu),
                                        run(lse_gpu), static_cast<int>(c.NH), nullptr);
      run.finish();
      const Tolerance tol =
          dtype == DType::F32 ? Tolerance{5e-5, 1e-3, 1e-9} : storage_tolerance(dtype);
      EXPECT_TRUE(all_close(dqkv_gpu.values(), dqkv_cpu.values(), tol))
          << "dqkv " << case_name(c, dtype);
      EXPECT_TRUE(bitwise_equal(qkv_gpu, qkv));
      EXPECT_TRUE(bitwise_equal(lse_gpu, lse));
      EXPECT_TRUE(guards_intact({&dqkv_gpu, &dout_gpu, &qkv_gpu, &out_gpu, &lse_gpu}));
    }
  }
}

// A longer sequence with many tiles, against the CPU in fp32: the online softmax's rescaling
// across 16 key tiles.
TEST(CudaAttention, LongSequenceF32) {
  REQUIRE_CUDA_DEVICE();
  const AttentionCase c{1, 512, 2, 64};
  Random rng(63);
  HostTensor qkv = random_tensor(rng, DType::F32, {c.B, c.T, 3 * c.C()}, -2.0, 2.0);
  HostTensor out_cpu = nan_tensor(DType::F32, {c.B, c.T, c.C()}), out_gpu = out_cpu.clone();
  HostTensor lse_cpu = nan_tensor(DType::F32, {c.B, c.NH, c.T}), lse_gpu = lse_cpu.clone();
  cpu_backend().attention_forward(out_cpu, lse_cpu, qkv, static_cast<int>(c.NH), nullptr);
  GpuRun run;
  cuda_backend().attention_forward(run(out_gpu), run(lse_gpu), run(qkv), static_cast<int>(c.NH),
                                   nullptr);
  run.finish();
  EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), {1e-5, 1e-4, 1e-10}));
  EXPECT_TRUE(all_close(lse_gpu.values(), lse_cpu.values(), {1e-5, 1e-5, 1e-11}));
}

}  // namespace
}  // namespace dstrain::test
