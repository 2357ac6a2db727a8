// The multi-head latent attention kernels (kernels/cuda/cuda_mla.cu) against the CPU twin on the
// same data: mla_pack and its backward (with and without packed-sequence positions), mla_unpad
// and its backward, in every storage dtype. Copies and the twin's rotation arithmetic: bitwise
// equal on the emulator and on a GPU (no expf, no FMA).
#include <string>

#include "cuda_test_util.h"
#include "kernels/rope_table.h"

namespace dstrain::test {
namespace {

TEST(CudaMla, PackAndItsBackwardMatchCpuBitwise) {
  REQUIRE_CUDA_DEVICE();
  const int64_t B = 2, T = 5, qw = 3 * 10, kvw = 3 * 9;
  for (DType dtype : kFloatDTypes) {
    for (bool packed : {false, true}) {
      // A q scale and DeepSeek's interleaved pairs on the packed rows.
      const MlaHeads heads{3, 4, 6, 5, packed ? 1.3f : 1.0f, packed};
      Random rng(95);
      HostTensor q = random_tensor(rng, dtype, {B, T, qw}, -2.0, 2.0);
      HostTensor kv = random_tensor(rng, dtype, {B, T, kvw}, -2.0, 2.0);
      HostTensor k_rope = random_tensor(rng, dtype, {B, T, 6}, -2.0, 2.0);
      HostTensor freqs(DType::F32, {T + 2, 3, 2});
      const std::vector<float> table = rope_table(T + 2, 6, 10000.0);
      freqs.set(std::vector<double>(table.begin(), table.end()));
      HostTensor positions(DType::I32, {B, T});
      const int32_t restart[] = {0, 1, 0, 1, 2, 0, 1, 2, 3, 0};
      for (int i = 0; i < B * T; ++i) positions.i32()[i] = restart[i];
      const Tensor pos = packed ? positions.t() : Tensor();
      HostTensor qkv_cpu = nan_tensor(dtype, {B, T, 3 * qw}), qkv_gpu = qkv_cpu.clone();
      cpu_backend().mla_pack(qkv_cpu, q, kv, k_rope, freqs, pos, heads, nullptr);
      HostTensor dq_cpu = nan_tensor(dtype, {B, T, qw}), dq_gpu = dq_cpu.clone();
      HostTensor dkv_cpu = nan_tensor(dtype, {B, T, kvw}), dkv_gpu = dkv_cpu.clone();
      HostTensor dk_cpu = nan_tensor(dtype, {B, T, 6}), dk_gpu = dk_cpu.clone();
      HostTensor dqkv = random_tensor(rng, dtype, {B, T, 3 * qw}, -1.0, 1.0);
      cpu_backend().mla_pack_backward(dq_cpu, dkv_cpu, dk_cpu, dqkv, freqs, pos, heads, nullptr);
      GpuRun run;
      HostTensor q_g = q.clone(), kv_g = kv.clone(), k_g = k_rope.clone(), f_g = freqs.clone();
      HostTensor p_g = positions.clone(), dqkv_g = dqkv.clone();
      const Tensor pos_g = packed ? run(p_g) : Tensor();
      const Tensor f = run(f_g);
      cuda_backend().mla_pack(run(qkv_gpu), run(q_g), run(kv_g), run(k_g), f, pos_g, heads,
                              nullptr);
      cuda_backend().mla_pack_backward(run(dq_gpu), run(dkv_gpu), run(dk_gpu), run(dqkv_g), f,
                                       pos_g, heads, nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + (packed ? " packed" : "");
      EXPECT_TRUE(bitwise_equal(qkv_gpu, qkv_cpu)) << where;
      EXPECT_TRUE(bitwise_equal(dq_gpu, dq_cpu)) << where;
      EXPECT_TRUE(bitwise_equal(dkv_gpu, dkv_cpu)) << where;
      EXPECT_TRUE(bitwise_equal(dk_gpu, dk_cpu)) << where;
      EXPECT_TRUE(guards_intact({&qkv_gpu, &dq_gpu, &dkv_gpu, &dk_gpu})) << where;
    }
  }
}

TEST(CudaMla, UnpadAndItsBackwardMatchCpuBitwise) {
  REQUIRE_CUDA_DEVICE();
  const MlaHeads heads{3, 4, 6, 5};
  for (DType dtype : kFloatDTypes) {
    Random rng(96);
    HostTensor atty = random_tensor(rng, dtype, {2, 3, 30}, -2.0, 2.0);
    HostTensor dout = random_tensor(rng, dtype, {2, 3, 15}, -2.0, 2.0);
    HostTensor out_cpu = nan_tensor(dtype, {2, 3, 15}), out_gpu = out_cpu.clone();
    HostTensor da_cpu = nan_tensor(dtype, {2, 3, 30}), da_gpu = da_cpu.clone();
    cpu_backend().mla_unpad(out_cpu, atty, heads, nullptr);
    cpu_backend().mla_unpad_backward(da_cpu, dout, heads, nullptr);
    GpuRun run;
    HostTensor atty_g = atty.clone(), dout_g = dout.clone();
    cuda_backend().mla_unpad(run(out_gpu), run(atty_g), heads, nullptr);
    cuda_backend().mla_unpad_backward(run(da_gpu), run(dout_g), heads, nullptr);
    run.finish();
    EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << dtype_name(dtype);
    EXPECT_TRUE(bitwise_equal(da_gpu, da_cpu)) << dtype_name(dtype);
    EXPECT_TRUE(guards_intact({&out_gpu, &da_gpu})) << dtype_name(dtype);
  }
}

}  // namespace
}  // namespace dstrain::test
