// Rotary position embedding forward and backward against the CPU twin, every dtype, round and odd
// shapes (odd T, odd head counts, hd/2 odd, grouped-query and multi-head, a table longer than
// T; hd/2 a multiple of 8 takes the 128-bit form, the odd ones the element-wise). Bitwise: both
// backends compute the same two products and one sum per output in fp32 without FMA (the
// kernel's __fmul_rn/__fadd_rn, the CPU's -ffp-contract=off) and round once.
#include "cuda_test_util.h"
#include "kernels/rope_table.h"

namespace dstrain::test {
namespace {

struct RopeCase {
  int64_t B, T, NH, KV, hd, table_rows;
  int64_t W() const { return (NH + 2 * KV) * hd; }
};

const RopeCase kCases[] = {
    {2, 64, 8, 2, 64, 64},     // round: Llama-like, 4 query heads per kv head
    {3, 7, 3, 1, 10, 12},      // odd: multi-query, hd/2 = 5, table longer than T
    {1, 33, 5, 5, 6, 33},      // odd: multi-head, hd/2 = 3
    {1, 17, 4, 2, 128, 20},    // Llama 3 8B's head dim
    {2, 5, 3, 1, 16, 9},       // hd/2 = 8: one pack of 8 pairs per head (the 128-bit form)
};

std::string case_name(const RopeCase& c, DType dtype, bool backward) {
  return std::string(backward ? "backward " : "forward ") + dtype_name(dtype) +
         " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
         " NH=" + std::to_string(c.NH) + " KV=" + std::to_string(c.KV) +
         " hd=" + std::to_string(c.hd);
}

HostTensor rope_freqs(const RopeCase& c) {
  HostTensor freqs(DType::F32, {c.table_rows, c.hd / 2, 2});
  const std::vector<float> table = rope_table(c.table_rows, c.hd, 500000.0);
  freqs.set(std::vector<double>(table.begin(), table.end()));
  return freqs;
}

TEST(CudaRope, ForwardAndBackwardMatchCpuBitwise) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const RopeCase& c : kCases) {
      for (bool backward : {false, true}) {
        Random rng(71);
        HostTensor x_cpu = random_tensor(rng, dtype, {c.B, c.T, c.W()}, -2.0, 2.0);
        HostTensor x_gpu = x_cpu.clone();
        const HostTensor x_before = x_cpu.clone();
        HostTensor freqs = rope_freqs(c), freqs_gpu = freqs.clone();
        const int nh = static_cast<int>(c.NH), kv = static_cast<int>(c.KV);
        GpuRun run;
        if (backward) {
          cpu_backend().rope_backward(x_cpu, freqs, nh, kv, nullptr);
          cuda_backend().rope_backward(run(x_gpu), run(freqs_gpu), nh, kv, nullptr);
        } else {
          cpu_backend().rope_forward(x_cpu, freqs, nh, kv, nullptr);
          cuda_backend().rope_forward(run(x_gpu), run(freqs_gpu), nh, kv, nullptr);
        }
        run.finish();
        EXPECT_FALSE(bitwise_equal(x_cpu, x_before)) << "rope changed nothing: the test is void";
        EXPECT_TRUE(bitwise_equal(x_gpu, x_cpu)) << case_name(c, dtype, backward);
        EXPECT_TRUE(bitwise_equal(freqs_gpu, freqs));
        EXPECT_TRUE(guards_intact({&x_gpu, &freqs_gpu}));
      }
    }
  }
}

// Packed sequences: the angle of each token's own position, bitwise the twin's (both forms).
TEST(CudaRope, PackedPositionsMatchCpuBitwise) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const RopeCase& c : {RopeCase{2, 33, 4, 2, 16, 40}, RopeCase{3, 7, 3, 1, 10, 12}}) {
      for (bool backward : {false, true}) {
        Random rng(73);
        HostTensor x_cpu = random_tensor(rng, dtype, {c.B, c.T, c.W()}, -2.0, 2.0);
        HostTensor x_gpu = x_cpu.clone(), freqs = rope_freqs(c), freqs_gpu = freqs.clone();
        HostTensor positions = random_positions(rng, c.B, c.T, 5), positions_gpu = positions.clone();
        HostTensor unpacked = x_cpu.clone();
        const int nh = static_cast<int>(c.NH), kv = static_cast<int>(c.KV);
        GpuRun run;
        if (backward) {
          cpu_backend().rope_backward(x_cpu, freqs, positions, nh, kv, nullptr);
          cuda_backend().rope_backward(run(x_gpu), run(freqs_gpu), run(positions_gpu), nh, kv,
                                       nullptr);
          cpu_backend().rope_backward(unpacked, freqs, nh, kv, nullptr);
        } else {
          cpu_backend().rope_forward(x_cpu, freqs, positions, nh, kv, nullptr);
          cuda_backend().rope_forward(run(x_gpu), run(freqs_gpu), run(positions_gpu), nh, kv,
                                      nullptr);
          cpu_backend().rope_forward(unpacked, freqs, nh, kv, nullptr);
        }
        run.finish();
        EXPECT_FALSE(bitwise_equal(x_cpu, unpacked)) << "the positions changed nothing";
        EXPECT_TRUE(bitwise_equal(x_gpu, x_cpu)) << case_name(c, dtype, backward) << " packed";
      }
    }
  }
}

TEST(CudaRope, BadShapeThrows) {
  REQUIRE_CUDA_DEVICE();
  Random rng(72);
  const RopeCase c{1, 5, 4, 2, 6, 4};  // a table of 4 positions for T = 5
  HostTensor qkv = random_tensor(rng, DType::F32, {c.B, c.T, c.W()});
  HostTensor freqs = rope_freqs(c);
  GpuRun run;
  EXPECT_THROW(cuda_backend().rope_forward(run(qkv), run(freqs), 4, 2, nullptr), Error);
  EXPECT_THROW(cuda_backend().rope_forward(run(qkv), run(freqs), 4, 3, nullptr), Error);
  run.finish();
}

}  // namespace
}  // namespace dstrain::test
