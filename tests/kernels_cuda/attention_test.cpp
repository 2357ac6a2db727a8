// Causal attention forward and backward against the CPU twin, every dtype, head dims that take
// each kernel instance (<= 64, <= 128, <= 256), odd T / hd that cut the tiles, multi-head
// (KV == NH) and grouped-query (KV < NH: 2 and 3 query heads per kv head, and multi-query). The
// GPU's online softmax and tiled sums run in another order:
//   out: F32 {atol 1e-5, rtol 1e-4, nmse 1e-10}; F16/BF16 storage_tolerance
//   lse: {1e-5, 1e-5, 1e-11}
//   dqkv (dK, dV sum over up to T queries): F32 {5e-5, 1e-3, 1e-9}; F16/BF16 storage_tolerance
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct AttentionCase {
  int64_t B, T, NH, KV, hd;
  int64_t C() const { return NH * hd; }             // an out row
  int64_t W() const { return (NH + 2 * KV) * hd; }  // a qkv row
  int nh() const { return static_cast<int>(NH); }
  int kv() const { return static_cast<int>(KV); }
};

const AttentionCase kCases[] = {
    {2, 64, 4, 4, 64},   // round
    {1, 37, 3, 3, 5},    // odd
    {2, 70, 2, 2, 128},  // 4 columns per lane
    {1, 100, 2, 2, 96},  // 3 of 4 columns per lane used
    {1, 45, 1, 1, 256},  // 8 columns per lane, 2 warps per block
    {1, 37, 6, 2, 5},    // grouped-query, odd: 3 query heads per kv head
    {2, 40, 4, 1, 64},   // multi-query: every query head on one kv head
    {1, 34, 4, 2, 128},  // grouped-query, 2 per kv head, 4 columns per lane
};

std::string case_name(const AttentionCase& c, DType dtype) {
  return std::string(dtype_name(dtype)) + " B=" + std::to_string(c.B) +
         " T=" + std::to_string(c.T) + " NH=" + std::to_string(c.NH) +
         " KV=" + std::to_string(c.KV) + " hd=" + std::to_string(c.hd);
}

TEST(CudaAttention, ForwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const AttentionCase& c : kCases) {
      Random rng(61);
      HostTensor qkv = random_tensor(rng, dtype, {c.B, c.T, c.W()}, -1.5, 1.5);
      HostTensor out_cpu = nan_tensor(dtype, {c.B, c.T, c.C()}), out_gpu = out_cpu.clone();
      HostTensor lse_cpu = nan_tensor(DType::F32, {c.B, c.NH, c.T}), lse_gpu = lse_cpu.clone();
      cpu_backend().attention_forward(out_cpu, lse_cpu, qkv, c.nh(), c.kv(), nullptr);
      HostTensor qkv_gpu = qkv.clone();
      GpuRun run;
      cuda_backend().attention_forward(run(out_gpu), run(lse_gpu), run(qkv_gpu), c.nh(), c.kv(),
                                       nullptr);
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
      HostTensor qkv = random_tensor(rng, dtype, {c.B, c.T, c.W()}, -1.5, 1.5);
      HostTensor out = nan_tensor(dtype, {c.B, c.T, c.C()});
      HostTensor lse = nan_tensor(DType::F32, {c.B, c.NH, c.T});
      cpu_backend().attention_forward(out, lse, qkv, c.nh(), c.kv(), nullptr);
      HostTensor dout = random_tensor(rng, dtype, {c.B, c.T, c.C()});
      HostTensor dqkv_cpu = nan_tensor(dtype, {c.B, c.T, c.W()}), dqkv_gpu = dqkv_cpu.clone();
      cpu_backend().attention_backward(dqkv_cpu, dout, qkv, out, lse, c.nh(), c.kv(), nullptr);
      HostTensor dout_gpu = dout.clone(), qkv_gpu = qkv.clone(), out_gpu = out.clone(),
                 lse_gpu = lse.clone();
      GpuRun run;
      cuda_backend().attention_backward(run(dqkv_gpu), run(dout_gpu), run(qkv_gpu), run(out_gpu),
                                        run(lse_gpu), c.nh(), c.kv(), nullptr);
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

// Packed sequences (positions): query i sees only its own sequence's keys, forward and backward,
// against the CPU twin; sequences of 1 to 2 x 12 tokens over 70 and 100 positions, so that some
// whole key tiles lie before a query's sequence. Every dtype: bf16 / f16 at hd 64 and 128 run on
// the tensor-core kernels (attention_mma_test.cpp and attention_mma_backward_test.cpp test them
// on packed rows within their own bounds), the rest (F32, hd 5) on the fp32 ones.
TEST(CudaAttention, PackedPositionsMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const AttentionCase& c : {AttentionCase{2, 70, 4, 2, 64}, AttentionCase{1, 100, 3, 3, 5},
                                   AttentionCase{1, 45, 2, 1, 128}}) {
      Random rng(65);
      HostTensor qkv = random_tensor(rng, dtype, {c.B, c.T, c.W()}, -1.5, 1.5);
      HostTensor positions = random_positions(rng, c.B, c.T, 12);
      HostTensor out_cpu = nan_tensor(dtype, {c.B, c.T, c.C()}), out_gpu = out_cpu.clone();
      HostTensor lse_cpu = nan_tensor(DType::F32, {c.B, c.NH, c.T}), lse_gpu = lse_cpu.clone();
      cpu_backend().attention_forward(out_cpu, lse_cpu, qkv, positions, c.nh(), c.kv(), nullptr);
      HostTensor dout = random_tensor(rng, dtype, {c.B, c.T, c.C()});
      HostTensor dqkv_cpu = nan_tensor(dtype, {c.B, c.T, c.W()}), dqkv_gpu = dqkv_cpu.clone();
      cpu_backend().attention_backward(dqkv_cpu, dout, qkv, out_cpu, lse_cpu, positions, c.nh(),
                                       c.kv(), nullptr);
      HostTensor qkv_gpu = qkv.clone(), positions_gpu = positions.clone(), dout_gpu = dout.clone();
      HostTensor out_saved = out_cpu.clone(), lse_saved = lse_cpu.clone();
      GpuRun run;
      cuda_backend().attention_forward(run(out_gpu), run(lse_gpu), run(qkv_gpu),
                                       run(positions_gpu), c.nh(), c.kv(), nullptr);
      cuda_backend().attention_backward(run(dqkv_gpu), run(dout_gpu), run(qkv_gpu),
                                        run(out_saved), run(lse_saved), run(positions_gpu),
                                        c.nh(), c.kv(), nullptr);
      run.finish();
      const bool f32 = dtype == DType::F32;
      EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(),
                            f32 ? Tolerance{1e-5, 1e-4, 1e-10} : storage_tolerance(dtype)))
          << "out " << case_name(c, dtype);
      EXPECT_TRUE(all_close(lse_gpu.values(), lse_cpu.values(), {1e-5, 1e-5, 1e-11}))
          << "lse " << case_name(c, dtype);
      EXPECT_TRUE(all_close(dqkv_gpu.values(), dqkv_cpu.values(),
                            f32 ? Tolerance{5e-5, 1e-3, 1e-9} : storage_tolerance(dtype)))
          << "dqkv " << case_name(c, dtype);
    }
  }
}

// A longer sequence with many tiles, against the CPU in fp32: the online softmax's rescaling
// across 16 key tiles.
TEST(CudaAttention, LongSequenceF32) {
  REQUIRE_CUDA_DEVICE();
  const AttentionCase c{1, 512, 2, 2, 64};
  Random rng(63);
  HostTensor qkv = random_tensor(rng, DType::F32, {c.B, c.T, c.W()}, -2.0, 2.0);
  HostTensor out_cpu = nan_tensor(DType::F32, {c.B, c.T, c.C()}), out_gpu = out_cpu.clone();
  HostTensor lse_cpu = nan_tensor(DType::F32, {c.B, c.NH, c.T}), lse_gpu = lse_cpu.clone();
  cpu_backend().attention_forward(out_cpu, lse_cpu, qkv, c.nh(), c.kv(), nullptr);
  GpuRun run;
  cuda_backend().attention_forward(run(out_gpu), run(lse_gpu), run(qkv), c.nh(), c.kv(), nullptr);
  run.finish();
  EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), {1e-5, 1e-4, 1e-10}));
  EXPECT_TRUE(all_close(lse_gpu.values(), lse_cpu.values(), {1e-5, 1e-5, 1e-11}));
}

// Grouped-query backward twice on the GPU: the dK/dV sums over a kv head's query heads run in a
// fixed order (no atomics), so the bits repeat.
TEST(CudaAttention, GqaBackwardRepeatsBitwise) {
  REQUIRE_CUDA_DEVICE();
  const AttentionCase c{2, 45, 6, 2, 10};
  Random rng(64);
  HostTensor qkv = random_tensor(rng, DType::BF16, {c.B, c.T, c.W()}, -1.5, 1.5);
  HostTensor out = nan_tensor(DType::BF16, {c.B, c.T, c.C()});
  HostTensor lse = nan_tensor(DType::F32, {c.B, c.NH, c.T});
  cpu_backend().attention_forward(out, lse, qkv, c.nh(), c.kv(), nullptr);
  HostTensor dout = random_tensor(rng, DType::BF16, {c.B, c.T, c.C()});
  HostTensor first = nan_tensor(DType::BF16, {c.B, c.T, c.W()}), second = first.clone();
  for (HostTensor* dqkv : {&first, &second}) {
    GpuRun run;
    cuda_backend().attention_backward(run(*dqkv), run(dout), run(qkv), run(out), run(lse), c.nh(),
                                      c.kv(), nullptr);
    run.finish();
  }
  EXPECT_TRUE(bitwise_equal(first, second));
  EXPECT_TRUE(all_close(first.values(), first.values(), storage_tolerance(DType::BF16)))
      << "no NaN left: every dqkv element was written";
}

}  // namespace
}  // namespace dstrain::test
