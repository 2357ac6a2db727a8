// Embedding forward and backward against the CPU twin. Both sum the rows that share a token in
// (b, t) order in fp32 and round once, so the results are bitwise equal in every dtype.
// Bad token ids are flagged on the device and reported by the next synchronize.
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct EmbeddingCase {
  int64_t B, T, C, Vp, maxT, distinct;  // ids drawn from [0, distinct): repeats
};

const EmbeddingCase kCases[] = {
    {4, 64, 128, 512, 64, 40},       // round
    {3, 7, 13, 11, 9, 5},            // odd, maxT > T
    {2, 33, 300, 70000, 40, 70000},  // a C above one channel block, many distinct ids
};

TEST(CudaEmbedding, ForwardBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const EmbeddingCase& c : kCases) {
      Random rng(21);
      HostTensor tokens = random_ids(rng, {c.B, c.T}, c.distinct);
      HostTensor wte = random_tensor(rng, dtype, {c.Vp, c.C});
      HostTensor wpe = random_tensor(rng, DType::F32, {c.maxT, c.C});  // another dtype on purpose
      HostTensor out_cpu = nan_tensor(dtype, {c.B, c.T, c.C}), out_gpu = out_cpu.clone();
      cpu_backend().embedding_forward(out_cpu, tokens, wte, wpe, 0, c.Vp, nullptr);
      HostTensor tokens_gpu = tokens.clone(), wte_gpu = wte.clone(), wpe_gpu = wpe.clone();
      GpuRun run;
      cuda_backend().embedding_forward(run(out_gpu), run(tokens_gpu), run(wte_gpu), run(wpe_gpu),
                                       0, c.Vp, nullptr);
      run.finish();
      EXPECT_GT(norm_squared(out_cpu.values()), 0.0);
      EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << dtype_name(dtype) << " C=" << c.C;
      EXPECT_TRUE(guards_intact({&out_gpu, &tokens_gpu, &wte_gpu, &wpe_gpu}));
    }
  }
}

TEST(CudaEmbedding, BackwardBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const EmbeddingCase& c : kCases) {
      Random rng(22);
      HostTensor tokens = random_ids(rng, {c.B, c.T}, c.distinct);
      HostTensor dout = random_tensor(rng, dtype, {c.B, c.T, c.C});
      // Gradients accumulate (+=): start from non-zero values.
      HostTensor dwte_cpu = random_tensor(rng, dtype, {c.Vp, c.C});
      HostTensor dwpe_cpu = random_tensor(rng, DType::F32, {c.maxT, c.C});
      HostTensor dwte_gpu = dwte_cpu.clone(), dwpe_gpu = dwpe_cpu.clone();
      const HostTensor dwte_before = dwte_cpu.clone();
      cpu_backend().embedding_backward(dwte_cpu, dwpe_cpu, dout, tokens, 0, c.Vp, nullptr);
      HostTensor tokens_gpu = tokens.clone(), dout_gpu = dout.clone();
      GpuRun run;
      cuda_backend().embedding_backward(run(dwte_gpu), run(dwpe_gpu), run(dout_gpu),
                                        run(tokens_gpu), 0, c.Vp, nullptr);
      run.finish();
      EXPECT_FALSE(bitwise_equal(dwte_cpu, dwte_before)) << "the reference did not change";
      EXPECT_TRUE(bitwise_equal(dwte_gpu, dwte_cpu))
          << "dwte " << dtype_name(dtype) << " C=" << c.C;
      EXPECT_TRUE(bitwise_equal(dwpe_gpu, dwpe_cpu))
          << "dwpe " << dtype_name(dtype) << " C=" << c.C;
      EXPECT_TRUE(bitwise_equal(tokens_gpu, tokens));
      EXPECT_TRUE(guards_intact({&dwte_gpu, &dwpe_gpu, &tokens_gpu, &dout_gpu}));
    }
  }
}

// Packed sequences: wpe rows by position forward, dwpe scattered by position backward (the
// rows sharing a position in (b, t) order), bitwise the twin's.
TEST(CudaEmbedding, PackedPositionsBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    const EmbeddingCase c{3, 33, 300, 64, 40, 20};
    Random rng(24);
    HostTensor tokens = random_ids(rng, {c.B, c.T}, c.distinct);
    HostTensor positions = random_positions(rng, c.B, c.T, 6);
    HostTensor wte = random_tensor(rng, dtype, {c.Vp, c.C});
    HostTensor wpe = random_tensor(rng, dtype, {c.maxT, c.C});
    HostTensor out_cpu = nan_tensor(dtype, {c.B, c.T, c.C}), out_gpu = out_cpu.clone();
    HostTensor dout = random_tensor(rng, dtype, {c.B, c.T, c.C});
    HostTensor dwte_cpu = random_tensor(rng, dtype, {c.Vp, c.C});
    HostTensor dwpe_cpu = random_tensor(rng, dtype, {c.maxT, c.C});
    HostTensor dwte_gpu = dwte_cpu.clone(), dwpe_gpu = dwpe_cpu.clone();
    const HostTensor dwpe_before = dwpe_cpu.clone();
    cpu_backend().embedding_forward(out_cpu, tokens, positions, wte, wpe, 0, c.Vp, nullptr);
    cpu_backend().embedding_backward(dwte_cpu, dwpe_cpu, dout, tokens, positions, 0, c.Vp,
                                     nullptr);
    HostTensor tokens_gpu = tokens.clone(), positions_gpu = positions.clone();
    HostTensor wte_gpu = wte.clone(), wpe_gpu = wpe.clone(), dout_gpu = dout.clone();
    GpuRun run;
    cuda_backend().embedding_forward(run(out_gpu), run(tokens_gpu), run(positions_gpu),
                                     run(wte_gpu), run(wpe_gpu), 0, c.Vp, nullptr);
    cuda_backend().embedding_backward(run(dwte_gpu), run(dwpe_gpu), run(dout_gpu),
                                      run(tokens_gpu), run(positions_gpu), 0, c.Vp, nullptr);
    run.finish();
    EXPECT_FALSE(bitwise_equal(dwpe_cpu, dwpe_before)) << "the reference did not change";
    EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << "out " << dtype_name(dtype);
    EXPECT_TRUE(bitwise_equal(dwte_gpu, dwte_cpu)) << "dwte " << dtype_name(dtype);
    EXPECT_TRUE(bitwise_equal(dwpe_gpu, dwpe_cpu)) << "dwpe " << dtype_name(dtype);
    EXPECT_TRUE(guards_intact({&out_gpu, &dwte_gpu, &dwpe_gpu, &positions_gpu}));
  }
}

// One token everywhere: the whole batch is one group, summed serially in (b, t) order.
TEST(CudaEmbedding, BackwardSingleTokenGroup) {
  REQUIRE_CUDA_DEVICE();
  Random rng(23);
  HostTensor tokens = random_ids(rng, {8, 128}, 1);
  HostTensor dout = random_tensor(rng, DType::BF16, {8, 128, 64});
  HostTensor dwte_cpu = random_tensor(rng, DType::F32, {3, 64});
  HostTensor dwpe_cpu = random_tensor(rng, DType::F32, {128, 64});
  HostTensor dwte_gpu = dwte_cpu.clone(), dwpe_gpu = dwpe_cpu.clone();
  cpu_backend().embedding_backward(dwte_cpu, dwpe_cpu, dout, tokens, 0, 3, nullptr);
  GpuRun run;
  cuda_backend().embedding_backward(run(dwte_gpu), run(dwpe_gpu), run(dout), run(tokens), 0, 3,
                                    nullptr);
  run.finish();
  EXPECT_TRUE(bitwise_equal(dwte_gpu, dwte_cpu));
  EXPECT_TRUE(bitwise_equal(dwpe_gpu, dwpe_cpu));
}

// Vocabulary parallelism: each of 3 slices of a 96-row table against the CPU twin, bitwise;
// tokens outside a slice give zero rows forward and no dwte row backward.
TEST(CudaEmbedding, VocabularySlicesBitwiseEqualCpu) {
  REQUIRE_CUDA_DEVICE();
  const int64_t B = 3, T = 17, C = 300, Vp = 96, Vs = 32;
  for (DType dtype : kFloatDTypes) {
    Random rng(25);
    HostTensor tokens = random_ids(rng, {B, T}, Vp);
    HostTensor wpe = random_tensor(rng, dtype, {T, C}), dout = random_tensor(rng, dtype, {B, T, C});
    for (int64_t s = 0; s < Vp / Vs; ++s) {
      HostTensor wte = random_tensor(rng, dtype, {Vs, C});
      HostTensor out_cpu = nan_tensor(dtype, {B, T, C}), out_gpu = out_cpu.clone();
      HostTensor dwte_cpu = random_tensor(rng, dtype, {Vs, C});
      HostTensor dwpe_cpu = random_tensor(rng, dtype, {T, C});
      HostTensor dwte_gpu = dwte_cpu.clone(), dwpe_gpu = dwpe_cpu.clone();
      cpu_backend().embedding_forward(out_cpu, tokens, wte, wpe, s * Vs, Vp, nullptr);
      cpu_backend().embedding_backward(dwte_cpu, dwpe_cpu, dout, tokens, s * Vs, Vp, nullptr);
      HostTensor tokens_gpu = tokens.clone(), wte_gpu = wte.clone(), wpe_gpu = wpe.clone();
      HostTensor dout_gpu = dout.clone();
      GpuRun run;
      cuda_backend().embedding_forward(run(out_gpu), run(tokens_gpu), run(wte_gpu), run(wpe_gpu),
                                       s * Vs, Vp, nullptr);
      cuda_backend().embedding_backward(run(dwte_gpu), run(dwpe_gpu), run(dout_gpu),
                                        run(tokens_gpu), s * Vs, Vp, nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " slice " + std::to_string(s);
      EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << "out " << where;
      EXPECT_TRUE(bitwise_equal(dwte_gpu, dwte_cpu)) << "dwte " << where;
      EXPECT_TRUE(bitwise_equal(dwpe_gpu, dwpe_cpu)) << "dwpe " << where;
      EXPECT_TRUE(guards_intact({&out_gpu, &dwte_gpu, &dwpe_gpu, &tokens_gpu}));
    }
  }
}

TEST(CudaEmbedding, BadTokenIdIsAUserErrorAtTheNextWait) {
  REQUIRE_CUDA_DEVICE();
  Random rng(24);
  HostTensor tokens = random_ids(rng, {2, 5}, 7);
  tokens.i32()[6] = 7;  // == Vp
  HostTensor wte = random_tensor(rng, DType::F32, {7, 16});
  HostTensor wpe = random_tensor(rng, DType::F32, {5, 16});
  HostTensor out = nan_tensor(DType::F32, {2, 5, 16});
  GpuRun run;
  cuda_backend().embedding_forward(run(out), run(tokens), run(wte), run(wpe), 0, 7, nullptr);
  try {
    run.finish();
    FAIL() << "no error for token id 7 with Vp = 7";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("token id"), std::string::npos) << e.what();
  }
  cuda_backend().synchronize(nullptr);  // the flag was cleared: the backend works again
}

}  // namespace
}  // namespace dstrain::test
