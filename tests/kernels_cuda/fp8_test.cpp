// The FP8 ops on CUDA against their CPU twin. fp8_quantize: the same bytes and scale_inv, every
// input dtype, both formats, straight, transposed or both copies, shapes across the 32 x 32 tiles,
// a NaN, an all zero tensor; its cast is the toolkit's __nv_cvt_float_to_fp8 (hardware cvt on
// sm_89+, the toolkit's own software conversion on the emulator), so bitwise equality also checks
// the twin's conversion against NVIDIA's. matmul_fp8 (cuBLASLt's FP8 GEMM; the emulator models its
// requirements): within the FP8 tensor cores' accumulation of the twin, for every operand
// pairing, with a bias and accumulating; the forms it refuses.
#include "core/fp8.h"

#include <cmath>
#include <string>

#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

constexpr DType kFp8[] = {DType::F8E4M3, DType::F8E5M2};

// Which copies an fp8_quantize call writes: out (R, C), out_t (C, R), or both.
enum Copies { kStraight = 1, kTransposed = 2, kBoth = 3 };
constexpr Copies kCopies[] = {kStraight, kTransposed, kBoth};

// The copies `copies` asks for of (out, out_t), the others empty.
Tensor straight(Copies copies, Tensor out) { return copies & kStraight ? out : Tensor(); }
Tensor transposed(Copies copies, Tensor out_t) { return copies & kTransposed ? out_t : Tensor(); }

TEST(CudaFp8, QuantizeMatchesTheTwinBitwise) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<std::vector<int64_t>> shapes = {{70, 45}, {1, 1}, {33, 100}, {64, 32}};
  for (DType in_dtype : kFloatDTypes) {
    for (DType format : kFp8) {
      for (Copies copies : kCopies) {
        for (const auto& shape : shapes) {
          Random rng(91);
          // A wide range: subnormal FP8 values, overflow of nothing (the scale fits amax).
          HostTensor inp = random_tensor(rng, in_dtype, shape, -5.0, 5.0);
          for (int64_t i = 0; i < inp.numel(); i += 7) inp.set(i, inp.get(i) * 1e-4);
          const std::vector<int64_t> shape_t = {shape[1], shape[0]};
          HostTensor out_cpu(format, shape), out_t_cpu(format, shape_t), scale_cpu(DType::F32, {1});
          cpu_backend().fp8_quantize(straight(copies, out_cpu), transposed(copies, out_t_cpu),
                                     scale_cpu, inp, Tensor(), nullptr);
          HostTensor out_gpu(format, shape), out_t_gpu(format, shape_t), scale_gpu(DType::F32, {1});
          GpuRun run;
          cuda_backend().fp8_quantize(straight(copies, run(out_gpu)),
                                      transposed(copies, run(out_t_gpu)), run(scale_gpu), run(inp),
                                      Tensor(), nullptr);
          run.finish();
          const std::string where = std::string(dtype_name(in_dtype)) + " -> " +
                                    dtype_name(format) + " " + inp.t().shape_str() + " copies " +
                                    std::to_string(copies);
          EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << where;
          EXPECT_TRUE(bitwise_equal(out_t_gpu, out_t_cpu)) << where;
          EXPECT_TRUE(bitwise_equal(scale_gpu, scale_cpu)) << where;
          EXPECT_TRUE(guards_intact({&out_gpu, &out_t_gpu, &scale_gpu})) << where;
        }
      }
    }
  }
}

// The 128-bit paths (the amax and cast 8 and 16 elements a thread, the transposed cast's 64 x 64
// tiles, with the straight copy's 64-bit stores) and their fallbacks: views 0, 8 and 1 elements
// into a buffer (the last misaligned: the scalar kernels), shapes with partial tiles and scalar
// tails, one over many blocks. Transposed, rows % 16 and cols % 8 pick the vector tile (80 x
// 136, 48 x 24, 1024 x 520) or not (3 x 67).
TEST(CudaFp8, QuantizeVectorPathsAndViewsMatchTheTwinBitwise) {
  REQUIRE_CUDA_DEVICE();
  const std::pair<int64_t, int64_t> shapes[] = {{80, 136}, {48, 24}, {3, 67}, {1024, 520}};
  for (DType in_dtype : kFloatDTypes) {
    for (const auto& [rows, cols] : shapes) {
      for (int64_t offset : kViewOffsets) {
        for (Copies copies : kCopies) {
          const int64_t size = offset + rows * cols;
          Random rng(94);
          HostTensor inp = random_tensor(rng, in_dtype, {size}, -30.0, 30.0);
          HostTensor out_cpu(DType::F8E4M3, {size}), out_t_cpu(DType::F8E4M3, {size}),
              scale_cpu(DType::F32, {1});
          HostTensor out_gpu = out_cpu.clone(), out_t_gpu = out_t_cpu.clone(),
                     scale_gpu(DType::F32, {1});
          auto view = [&](Tensor t, bool transpose) {
            return transpose ? t.slice(offset, {cols, rows}) : t.slice(offset, {rows, cols});
          };
          cpu_backend().fp8_quantize(straight(copies, view(out_cpu, false)),
                                     transposed(copies, view(out_t_cpu, true)), scale_cpu,
                                     view(inp, false), Tensor(), nullptr);
          GpuRun run;
          cuda_backend().fp8_quantize(straight(copies, view(run(out_gpu), false)),
                                      transposed(copies, view(run(out_t_gpu), true)),
                                      run(scale_gpu), view(run(inp), false), Tensor(), nullptr);
          run.finish();
          const std::string where =
              view_case(in_dtype, rows, cols, offset) + " copies " + std::to_string(copies);
          EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << where;
          EXPECT_TRUE(bitwise_equal(out_t_gpu, out_t_cpu)) << where;
          EXPECT_TRUE(bitwise_equal(scale_gpu, scale_cpu)) << where;
          EXPECT_TRUE(guards_intact({&out_gpu, &out_t_gpu, &scale_gpu})) << where;
        }
      }
    }
  }
}

// fp8_amax and fp8_quantize with the amax given (no amax pass): the twin's bits, on the vector
// and scalar paths (an aligned and a misaligned view).
TEST(CudaFp8, AmaxAndQuantizeWithAGivenAmaxMatchTheTwin) {
  REQUIRE_CUDA_DEVICE();
  for (DType in_dtype : kFloatDTypes) {
    for (int64_t offset : kViewOffsets) {
      const int64_t rows = 48, cols = 136, size = offset + rows * cols;
      Random rng(95);
      HostTensor inp = random_tensor(rng, in_dtype, {size}, -30.0, 30.0);
      HostTensor amax_cpu(DType::F32, {1}), amax_gpu(DType::F32, {1});
      HostTensor out_cpu(DType::F8E5M2, {cols, rows}), out_gpu(DType::F8E5M2, {cols, rows});
      HostTensor scale_cpu(DType::F32, {1}), scale_gpu(DType::F32, {1});
      const Tensor view = inp.t().slice(offset, {rows, cols});
      cpu_backend().fp8_amax(amax_cpu, view, nullptr);
      cpu_backend().fp8_quantize(Tensor(), out_cpu, scale_cpu, view, amax_cpu, nullptr);
      GpuRun run;
      const Tensor gpu_view = run(inp).slice(offset, {rows, cols}), gpu_amax = run(amax_gpu);
      cuda_backend().fp8_amax(gpu_amax, gpu_view, nullptr);
      cuda_backend().fp8_quantize(Tensor(), run(out_gpu), run(scale_gpu), gpu_view, gpu_amax,
                                  nullptr);
      run.finish();
      const std::string where = view_case(in_dtype, rows, cols, offset);
      EXPECT_TRUE(bitwise_equal(amax_gpu, amax_cpu)) << where;
      EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << where;
      EXPECT_TRUE(bitwise_equal(scale_gpu, scale_cpu)) << where;
      EXPECT_TRUE(guards_intact({&amax_gpu, &out_gpu, &scale_gpu})) << where;
    }
  }
}

TEST(CudaFp8, QuantizeOfANaNOrOfZerosHasScaleOne) {
  REQUIRE_CUDA_DEVICE();
  Random rng(92);
  HostTensor with_nan = random_tensor(rng, DType::F32, {40, 40}, -1000.0, 1000.0);
  with_nan.set(1234, std::nan(""));
  HostTensor zeros(DType::BF16, {3, 16});
  zeros.set(std::vector<double>(48, 0.0));
  for (HostTensor* inp : {&with_nan, &zeros}) {
    HostTensor out_cpu(DType::F8E4M3, inp->shape()), scale_cpu(DType::F32, {1});
    cpu_backend().fp8_quantize(out_cpu, Tensor(), scale_cpu, *inp, Tensor(), nullptr);
    HostTensor out_gpu(DType::F8E4M3, inp->shape()), scale_gpu(DType::F32, {1});
    GpuRun run;
    cuda_backend().fp8_quantize(run(out_gpu), Tensor(), run(scale_gpu), run(*inp), Tensor(),
                                nullptr);
    run.finish();
    EXPECT_EQ(scale_gpu.get(0), 1.0);
    EXPECT_TRUE(bitwise_equal(out_gpu, out_cpu)) << inp->t().shape_str();
  }
}

struct GemmCase {
  int64_t M, N, K;
  DType a, b, out;
  bool bias, accumulate;
};

// The elements of out (M, N) farther from the twin's than the FP8 tensor cores allow. Hopper's
// FP8 MMA (and cuBLASLt on it, even with CUBLASLT_MATMUL_DESC_FAST_ACCUM off, which only moves
// partial sums to fp32 between MMAs) adds the K products of one instruction with about 14
// significant bits, aligned to the largest (DeepSeek-V3's report measured it on H800s; on an
// H100 this test saw 59.75 for 61.75 where the products reach 6,272). So the bound is the
// output's storage rounding plus 2^-12 of the sum of |products| (scale included): a wrong scale,
// operand or layout misses it by orders of magnitude. The twin and the emulator sum in fp32.
int64_t fp8_gemm_mismatches(const HostTensor& out, const HostTensor& reference, const HostTensor& a,
                            const HostTensor& b, double scale) {
  const int64_t M = a.shape()[0], K = a.shape()[1], N = b.shape()[0];
  const Tolerance tol = storage_tolerance(out.dtype());
  int64_t mismatches = 0;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double magnitude = 0.0;
      for (int64_t k = 0; k < K; ++k) magnitude += std::fabs(a.get(i * K + k) * b.get(j * K + k));
      const double want = reference.get(i * N + j), got = out.get(i * N + j);
      const double bound =
          tol.atol + tol.rtol * std::fabs(want) + std::ldexp(magnitude * scale, -12);
      if (std::fabs(got - want) <= bound) continue;
      if (mismatches++ == 0) {
        ADD_FAILURE() << "out[" << i << ", " << j << "] = " << got << ", the twin's " << want
                      << ", bound " << bound;
      }
    }
  }
  return mismatches;
}

TEST(CudaFp8, MatmulMatchesTheTwin) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<GemmCase> cases = {
      {5, 16, 32, DType::F8E4M3, DType::F8E4M3, DType::F32, false, false},
      {33, 48, 64, DType::F8E4M3, DType::F8E5M2, DType::BF16, true, false},
      {7, 32, 16, DType::F8E5M2, DType::F8E4M3, DType::F16, false, true},
      {40, 64, 48, DType::F8E4M3, DType::F8E4M3, DType::BF16, false, true},
  };
  for (const GemmCase& g : cases) {
    Random rng(93);
    HostTensor a = random_tensor(rng, g.a, {g.M, g.K}, -448.0, 448.0);
    HostTensor b = random_tensor(rng, g.b, {g.N, g.K}, -448.0, 448.0);
    HostTensor a_scale_inv(DType::F32, {1}), b_scale_inv(DType::F32, {1});
    a_scale_inv.set({0.0078125});
    b_scale_inv.set({4.0});
    HostTensor bias = random_tensor(rng, g.out, {g.bias ? g.N : 0});
    HostTensor out_cpu = random_tensor(rng, g.out, {g.M, g.N}), out_gpu = out_cpu.clone();
    cpu_backend().matmul_fp8(out_cpu, a, a_scale_inv, b, b_scale_inv, bias, g.accumulate, nullptr);
    GpuRun run;
    cuda_backend().matmul_fp8(run(out_gpu), run(a), run(a_scale_inv), run(b), run(b_scale_inv),
                              g.bias ? run(bias) : Tensor(), g.accumulate, nullptr);
    run.finish();
    const std::string where = std::to_string(g.M) + "x" + std::to_string(g.N) + "x" +
                              std::to_string(g.K) + " " + dtype_name(g.a) + " x " + dtype_name(g.b);
    EXPECT_EQ(fp8_gemm_mismatches(out_gpu, out_cpu, a, b, 0.0078125 * 4.0), 0) << where;
    EXPECT_TRUE(guards_intact({&out_gpu})) << g.M;
  }
}

TEST(CudaFp8, MatmulRefusesWhatTheFp8TensorCoresCannotTake) {
  REQUIRE_CUDA_DEVICE();
  const auto run_gemm = [](DType a_dtype, DType b_dtype, int64_t N, int64_t K) {
    HostTensor a(a_dtype, {4, K}), b(b_dtype, {N, K}), out(DType::BF16, {4, N});
    HostTensor a_scale_inv(DType::F32, {1}), b_scale_inv(DType::F32, {1});
    GpuRun run;
    cuda_backend().matmul_fp8(run(out), run(a), run(a_scale_inv), run(b), run(b_scale_inv),
                              Tensor(), false, nullptr);
    run.finish();
  };
  EXPECT_THROW(run_gemm(DType::F8E5M2, DType::F8E5M2, 16, 16), Error);
  EXPECT_THROW(run_gemm(DType::F8E4M3, DType::F8E4M3, 16, 24), Error);
}

}  // namespace
}  // namespace dstrain::test
