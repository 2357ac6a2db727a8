// The tensor-core attention forward (kernels/cuda/cuda_attention_mma.cu: BF16/F16 storage, head
// dims 64, 128, 192, 256) against the CPU twin on the same 16-bit inputs: odd T that cut the 64-row
// query blocks and the 64- or 32-key tiles, multi-head and grouped-query (2 and 4 query heads
// per kv head), a peaked softmax whose running max moves from tile to tile; 16 and 32 query rows
// per warp (set_cuda_attention_warp_rows); the bits repeat;
// the backward takes its out and lse; P is rounded to 16 bits exactly as documented. Packed
// sequences (positions) on the same kernel: against the CPU twin, positions 0..T-1 give the bits
// of no positions, a row cut at a tile boundary gives the bits of its sequences run alone, and P
// is rounded there too (the tensor-core kernel, not the fp32 one, runs packed rows).
//
// Tolerance. u = 2^-8 (bf16) or 2^-11 (f16), the storage type's unit roundoff. The kernel
// differs from the CPU twin (fp32 throughout) in three ways:
//   1. P is rounded to 16 bits before the PV product (relative error d_j, |d_j| <= u), the row
//      sum l is not: out - ref = sum_j p_j d_j v_j / l, so |out - ref| <= u max|v|.
//   2. Both round their fp32 output to 16 bits: at most u |out| each.
//   3. fp32 sums in another order and exp2f(x log2 e) for expf(x): relative O(2^-24 hd), noise
//      next to u.
// Per element (all_close's atol + rtol |ref|): |gpu - cpu| <= u max|v| + 2u |cpu| (+ 3.), so
// atol = 1.25 u max|v|, rtol = 2.5 u (25 % for the fp32 terms and the (1 + u) factors).
// Normalized, mse(gpu, cpu) / mse(cpu, 0): the d_j are independent and spread over +-half an
// ulp, E[d^2] <= u^2/3; with v of random sign E[(sum_j p_j d_j v_j)^2] <= (u^2/3) E[(sum_j
// p_j v_j)^2], so term 1 adds <= u^2/3 and each output rounding <= u^2/3: about u^2 in all,
// bound 2 u^2 (bf16 3.1e-5, f16 4.8e-7).
// lse comes from fp32 sums of unrounded p: the fp32 kernel's bound {1e-5, 1e-5, 1e-11}.
#include <cmath>
#include <utility>

#include "attention_case.h"
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

using MmaCase = AttentionCase;

std::string case_name(const MmaCase& c, DType dtype) {
  return std::string(dtype_name(dtype)) + " B=" + std::to_string(c.B) +
         " T=" + std::to_string(c.T) + " NH=" + std::to_string(c.NH) +
         " KV=" + std::to_string(c.KV) + " hd=" + std::to_string(c.hd);
}

double unit_roundoff(DType dtype) { return dtype == DType::BF16 ? 0x1p-8 : 0x1p-11; }

// See the file comment: v_max bounds |v| of the data.
Tolerance out_tolerance(DType dtype, double v_max) {
  const double u = unit_roundoff(dtype);
  return {1.25 * u * v_max, 2.5 * u, 2.0 * u * u};
}
constexpr Tolerance kLseTolerance{1e-5, 1e-5, 1e-11};

struct Forward {
  HostTensor out, lse;
};

// positions: (B,T) of packed sequences, or nullptr (one causal sequence per row).
Forward cpu_forward(const HostTensor& qkv, const MmaCase& c,
                    const HostTensor* positions = nullptr) {
  Forward f{nan_tensor(qkv.dtype(), {c.B, c.T, c.C()}), nan_tensor(DType::F32, {c.B, c.NH, c.T})};
  cpu_backend().attention_forward(f.out, f.lse, qkv, positions ? positions->t() : Tensor(), c.nh(),
                                  c.kv(), nullptr);
  return f;
}

// The CUDA backend's forward; also checks that qkv (and positions) are untouched and no guard
// region written.
Forward gpu_forward(const HostTensor& qkv, const MmaCase& c,
                    const HostTensor* positions = nullptr) {
  Forward f{nan_tensor(qkv.dtype(), {c.B, c.T, c.C()}), nan_tensor(DType::F32, {c.B, c.NH, c.T})};
  HostTensor qkv_gpu = qkv.clone();
  HostTensor positions_gpu = positions ? positions->clone() : HostTensor(DType::I32, {0});
  GpuRun run;
  cuda_backend().attention_forward(run(f.out), run(f.lse), run(qkv_gpu),
                                   positions ? run(positions_gpu) : Tensor(), c.nh(), c.kv(),
                                   nullptr);
  run.finish();
  EXPECT_TRUE(bitwise_equal(qkv_gpu, qkv)) << "qkv was written " << case_name(c, qkv.dtype());
  if (positions) {
    EXPECT_TRUE(bitwise_equal(positions_gpu, *positions)) << "positions written";
  }
  EXPECT_TRUE(guards_intact({&f.out, &f.lse, &qkv_gpu, &positions_gpu}))
      << case_name(c, qkv.dtype());
  return f;
}

// Every T of the file's list with KV = 4, 2, 1 (NH = 4), B = 2, q/k/v magnitudes in
// [1/8, 3/2): scores of standard deviation about 0.75. `warp_rows` query rows per warp (16 or
// 32): blocks of 64 or 128 rows, which T = 17, 64, 100 cut inside and 130 leaves one or three
// warps of the last block with no row.
void expect_forward_matches_cpu(DType dtype, int64_t hd, int warp_rows = 16) {
  REQUIRE_CUDA_DEVICE();
  const AttentionWarpRows rows(warp_rows);
  for (int64_t T : {1, 17, 64, 100, 130}) {
    for (int64_t KV : {4, 2, 1}) {
      const MmaCase c{2, T, 4, KV, hd};
      Random rng(static_cast<uint64_t>(1000 * hd + 10 * T + KV));
      const HostTensor qkv = nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 1.5);
      const Forward cpu = cpu_forward(qkv, c), gpu = gpu_forward(qkv, c);
      EXPECT_TRUE(all_close(gpu.out.values(), cpu.out.values(), out_tolerance(dtype, 1.5)))
          << "out " << case_name(c, dtype);
      EXPECT_TRUE(all_close(gpu.lse.values(), cpu.lse.values(), kLseTolerance))
          << "lse " << case_name(c, dtype);
    }
  }
}

TEST(CudaAttentionMma, ForwardMatchesCpu_bf16_hd64) { expect_forward_matches_cpu(DType::BF16, 64); }
TEST(CudaAttentionMma, ForwardMatchesCpu_bf16_hd128) {
  expect_forward_matches_cpu(DType::BF16, 128);
}
TEST(CudaAttentionMma, ForwardMatchesCpu_bf16_hd256) {
  expect_forward_matches_cpu(DType::BF16, 256);
}
TEST(CudaAttentionMma, ForwardMatchesCpu_bf16_hd192) {
  expect_forward_matches_cpu(DType::BF16, 192);
}
TEST(CudaAttentionMma, ForwardMatchesCpu_f16_hd64) { expect_forward_matches_cpu(DType::F16, 64); }
TEST(CudaAttentionMma, ForwardMatchesCpu_f16_hd128) { expect_forward_matches_cpu(DType::F16, 128); }
TEST(CudaAttentionMma, ForwardMatchesCpu_f16_hd192) { expect_forward_matches_cpu(DType::F16, 192); }
TEST(CudaAttentionMma, ForwardMatchesCpu_f16_hd256) { expect_forward_matches_cpu(DType::F16, 256); }
TEST(CudaAttentionMma, ForwardMatchesCpu_bf16_hd64_32RowsPerWarp) {
  expect_forward_matches_cpu(DType::BF16, 64, 32);
}
TEST(CudaAttentionMma, ForwardMatchesCpu_bf16_hd128_32RowsPerWarp) {
  expect_forward_matches_cpu(DType::BF16, 128, 32);
}
TEST(CudaAttentionMma, ForwardMatchesCpu_f16_hd64_32RowsPerWarp) {
  expect_forward_matches_cpu(DType::F16, 64, 32);
}
TEST(CudaAttentionMma, ForwardMatchesCpu_f16_hd128_32RowsPerWarp) {
  expect_forward_matches_cpu(DType::F16, 128, 32);
}

// At 32 rows per warp hd 64 keeps its 64-key tiles and every row's sums run in the same order
// (the n-tiles a warp of 16 rows would skip hold only masked keys: P = +0): the bits of 16 rows
// per warp. hd 128 takes 32-key tiles there (the registers), so its running max and sums are
// rescaled every 32 keys: other bits, within the same bound (above) -- which also shows that the
// setting reaches the kernel. Random data over several blocks (T = 300), grouped-query.
TEST(CudaAttentionMma, ThirtyTwoRowsPerWarpKeepTheBitsWhereTheTilesAreTheSame) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int64_t hd : {64, 128}) {
      const MmaCase c{2, 300, 4, 2, hd};
      Random rng(static_cast<uint64_t>(31 + hd));
      const HostTensor qkv = nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 1.5);
      const Forward narrow = gpu_forward(qkv, c);
      const Forward wide = [&] {
        const AttentionWarpRows rows(32);
        return gpu_forward(qkv, c);
      }();
      const bool same = bitwise_equal(narrow.out, wide.out) && bitwise_equal(narrow.lse, wide.lse);
      EXPECT_EQ(same, hd == 64) << case_name(c, dtype);
      EXPECT_TRUE(
          all_close(wide.out.values(), cpu_forward(qkv, c).out.values(), out_tolerance(dtype, 1.5)))
          << case_name(c, dtype);
    }
  }
}

// q and k up to 4 in magnitude: scores of standard deviation about 5, a softmax dominated by a
// few keys, and a running max that grows from tile to tile (the rescaling of O and the sums).
// Also at 32 rows per warp (hd 128: 32-key tiles, more rescaling).
TEST(CudaAttentionMma, PeakedSoftmaxAcrossTilesMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (auto [hd, warp_rows] : {std::pair{64, 16}, {192, 16}, {256, 16}, {128, 32}}) {
      const AttentionWarpRows rows(warp_rows);
      const MmaCase c{1, 130, 2, 1, hd};
      Random rng(static_cast<uint64_t>(7 + hd));
      HostTensor qkv = nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 4.0);
      const Forward cpu = cpu_forward(qkv, c), gpu = gpu_forward(qkv, c);
      EXPECT_TRUE(all_close(gpu.out.values(), cpu.out.values(), out_tolerance(dtype, 4.0)))
          << "out " << case_name(c, dtype);
      EXPECT_TRUE(all_close(gpu.lse.values(), cpu.lse.values(), kLseTolerance))
          << "lse " << case_name(c, dtype);
    }
  }
}

// No atomics, sums in a fixed order: a second run gives the same bits.
TEST(CudaAttentionMma, ForwardRepeatsBitwise) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    const MmaCase c{2, 130, 4, 2, 128};
    Random rng(5);
    const HostTensor qkv = nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 1.5);
    const Forward first = gpu_forward(qkv, c), second = gpu_forward(qkv, c);
    EXPECT_TRUE(bitwise_equal(first.out, second.out)) << case_name(c, dtype);
    EXPECT_TRUE(bitwise_equal(first.lse, second.lse)) << case_name(c, dtype);
  }
}

// The backward (CUDA-core kernels) given this forward's out and lse: the CUDA and CPU backwards
// agree within attention_test.cpp's bound, and the forward's own outputs are within bounds.
TEST(CudaAttentionMma, BackwardTakesTheForwardsOutAndLse) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    const MmaCase c{2, 100, 4, 2, 64};
    Random rng(9);
    const HostTensor qkv = nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 1.5);
    const Forward gpu = gpu_forward(qkv, c), cpu = cpu_forward(qkv, c);
    ASSERT_TRUE(all_close(gpu.out.values(), cpu.out.values(), out_tolerance(dtype, 1.5)));
    const HostTensor dout = nonzero_tensor(rng, dtype, {c.B, c.T, c.C()}, 0.125, 1.0);
    HostTensor dqkv_cpu = nan_tensor(dtype, {c.B, c.T, c.W()}), dqkv_gpu = dqkv_cpu.clone();
    cpu_backend().attention_backward(dqkv_cpu, dout, qkv, gpu.out, gpu.lse, c.nh(), c.kv(),
                                     nullptr);
    HostTensor dout_gpu = dout.clone(), qkv_gpu = qkv.clone(), out_gpu = gpu.out.clone(),
               lse_gpu = gpu.lse.clone();
    GpuRun run;
    cuda_backend().attention_backward(run(dqkv_gpu), run(dout_gpu), run(qkv_gpu), run(out_gpu),
                                      run(lse_gpu), c.nh(), c.kv(), nullptr);
    run.finish();
    EXPECT_TRUE(all_close(dqkv_gpu.values(), dqkv_cpu.values(), storage_tolerance(dtype)))
        << "dqkv " << case_name(c, dtype);
    EXPECT_TRUE(guards_intact({&dqkv_gpu}));
  }
}

// The rounding itself, exactly: query 1 sees key 0 (q . k0 = 8: the row max, p = 1) and key 1
// (q . k1 = -8: p = e^(-16 / sqrt(hd)), not a 16-bit number); q is 0.5 on the first 64 columns
// and 0 on the others. The kernel rounds p to 16 bits for the PV product and divides by the
// unrounded sum: out = rnd(v0 + rnd(p) v1) / (1 + p)), which v0 near p, v1 = -1 (cancellation)
// make several ulps away from the unrounded rnd((v0 + p v1) / (1 + p)) that the CPU twin and the
// fp32 kernel give. Also proves that the tensor-core kernel is the one attention_forward runs for
// 16-bit storage: at hd 64 and at latent attention's 192.
TEST(CudaAttentionMma, RoundsPToSixteenBitsBeforeThePvProduct) {
  REQUIRE_CUDA_DEVICE();
  for (auto [hd, v0] : {std::pair<int64_t, double>{64, 0.125}, {192, 0.3125}}) {
    const MmaCase c{1, 2, 1, 1, hd};
    for (DType dtype : {DType::BF16, DType::F16}) {
      HostTensor qkv(dtype, {c.B, c.T, c.W()});  // row t: q (hd) | k (hd) | v (hd)
      for (int64_t t = 0; t < c.T; ++t) {
        for (int64_t d = 0; d < c.hd; ++d) {
          qkv.set(t * c.W() + d, d < 64 ? 0.5 : 0.0);
          qkv.set(t * c.W() + c.hd + d, t == 0 ? 0.25 : -0.25);
          qkv.set(t * c.W() + 2 * c.hd + d, t == 0 ? v0 : -1.0);  // v0, v1
        }
      }
      const double score = 8.0 / std::sqrt(static_cast<double>(hd));
      const double p1 = std::exp(-2.0 * score), sum = 1.0 + p1;
      const double rounded = round_to(dtype, (v0 - round_to(dtype, p1)) / sum);
      const double unrounded = round_to(dtype, (v0 - p1) / sum);
      ASSERT_GT(std::fabs(rounded - unrounded), 4 * unit_roundoff(dtype) * std::fabs(rounded))
          << "the case must tell the two apart";
      const Forward gpu = gpu_forward(qkv, c);
      for (int64_t d = 0; d < c.hd; ++d) {
        EXPECT_EQ(gpu.out.get(d), v0) << "row 0 sees only v0, column " << d;
        EXPECT_EQ(gpu.out.get(c.hd + d), rounded)
            << dtype_name(dtype) << " hd " << hd << " row 1, column " << d
            << " (unrounded P gives " << unrounded << ")";
      }
      EXPECT_NEAR(gpu.lse.get(0), score, 1e-6);
      EXPECT_NEAR(gpu.lse.get(1), score + std::log(sum), 1e-6);
    }
  }
}

// Packed sequences (attention_case.h's packed_positions: random short sequences, single tokens,
// sequences longer than any tile, a warp whose rows start in two key tiles, a row of one
// sequence) against the CPU twin within the bounds above (their derivation holds row by row,
// whatever keys a row sees): B = 3, T = 70, 100, 200 (none a multiple of the tiles), NH = 4
// over KV = 2 (grouped-query) and 4; 16 and 32 query rows per warp (hd 192 and 256: 16 only).
void expect_packed_forward_matches_cpu(DType dtype, int64_t hd) {
  REQUIRE_CUDA_DEVICE();
  for (int warp_rows : {16, 32}) {
    if (warp_rows == 32 && hd > 128) continue;
    const AttentionWarpRows rows(warp_rows);
    for (int64_t T : {70, 100, 200}) {
      for (int64_t KV : {2, 4}) {
        const MmaCase c{3, T, 4, KV, hd};
        Random rng(static_cast<uint64_t>(7000 + hd + 10 * T + KV));
        const HostTensor qkv = nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 1.5);
        const HostTensor positions = packed_positions(rng, c.T);
        const Forward cpu = cpu_forward(qkv, c, &positions);
        const Forward gpu = gpu_forward(qkv, c, &positions);
        EXPECT_TRUE(all_close(gpu.out.values(), cpu.out.values(), out_tolerance(dtype, 1.5)))
            << "out " << case_name(c, dtype) << ", " << warp_rows << " rows per warp";
        EXPECT_TRUE(all_close(gpu.lse.values(), cpu.lse.values(), kLseTolerance))
            << "lse " << case_name(c, dtype) << ", " << warp_rows << " rows per warp";
      }
    }
  }
}

TEST(CudaAttentionMma, PackedForwardMatchesCpu_bf16_hd64) {
  expect_packed_forward_matches_cpu(DType::BF16, 64);
}
TEST(CudaAttentionMma, PackedForwardMatchesCpu_bf16_hd128) {
  expect_packed_forward_matches_cpu(DType::BF16, 128);
}
TEST(CudaAttentionMma, PackedForwardMatchesCpu_f16_hd64) {
  expect_packed_forward_matches_cpu(DType::F16, 64);
}
TEST(CudaAttentionMma, PackedForwardMatchesCpu_f16_hd128) {
  expect_packed_forward_matches_cpu(DType::F16, 128);
}
TEST(CudaAttentionMma, PackedForwardMatchesCpu_hd192) {
  expect_packed_forward_matches_cpu(DType::BF16, 192);
  expect_packed_forward_matches_cpu(DType::F16, 192);
}
TEST(CudaAttentionMma, PackedForwardMatchesCpu_hd256) {
  expect_packed_forward_matches_cpu(DType::BF16, 256);
  expect_packed_forward_matches_cpu(DType::F16, 256);
}

// Positions 0..T-1 (every row one sequence) give the bits of no positions: with them the kernel
// skips no tile, takes the unmasked path on the same tiles and masks nothing more. Every head
// dim, 16 and 32 rows per warp, ragged T over several blocks, grouped-query.
TEST(CudaAttentionMma, CountingPositionsKeepTheBitsOfNoPositions) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int64_t hd : {64, 128, 192, 256}) {
      for (int warp_rows : {16, 32}) {
        const AttentionWarpRows rows(warp_rows);
        const MmaCase c{2, 130, 4, 2, hd};
        Random rng(static_cast<uint64_t>(41 + hd));
        const HostTensor qkv = nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 1.5);
        const HostTensor positions = counting_positions(c.B, c.T);
        const Forward plain = gpu_forward(qkv, c), counted = gpu_forward(qkv, c, &positions);
        EXPECT_TRUE(bitwise_equal(counted.out, plain.out))
            << case_name(c, dtype) << ", " << warp_rows << " rows per warp";
        EXPECT_TRUE(bitwise_equal(counted.lse, plain.lse))
            << case_name(c, dtype) << ", " << warp_rows << " rows per warp";
      }
    }
  }
}

// A row packed from a sequence of 64 tokens (a multiple of every tile and block of the kernel)
// and one of 70 gives, bit for bit, what each sequence gives run alone without positions: every
// row sees its keys in the same tiles, the same n-tiles, the same order. The other sequence's
// tiles are never read: poisoned with NaN there (which a masked read would carry into the
// output through P V, 0 NaN = NaN), the bits stay. As the runs alone are the tensor-core
// kernel's (RoundsPToSixteenBitsBeforeThePvProduct), so is the packed one: the fp32 kernel's
// bits differ. Every head dim, 16 and 32 rows per warp, grouped-query.
TEST(CudaAttentionMma, PackedRowCutAtATileHasTheBitsOfEachSequenceAlone) {
  REQUIRE_CUDA_DEVICE();
  constexpr int64_t kFirst = 64, kSecond = 70;
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int64_t hd : {64, 128, 192, 256}) {
      for (int warp_rows : {16, 32}) {
        const AttentionWarpRows rows(warp_rows);
        const MmaCase packed{1, kFirst + kSecond, 4, 2, hd};
        Random rng(static_cast<uint64_t>(43 + hd));
        const HostTensor qkv = nonzero_tensor(rng, dtype, {1, packed.T, packed.W()}, 0.125, 1.5);
        HostTensor positions(DType::I32, {1, packed.T});
        set_sequences(positions, 0, {kFirst, kSecond});
        for (auto [first, count] : {std::pair{int64_t{0}, kFirst}, {kFirst, kSecond}}) {
          const int64_t other_first = first == 0 ? kFirst : 0, other_count = packed.T - count;
          const Forward together =
              gpu_forward(with_nan_rows(qkv, other_first, other_count), packed, &positions);
          const MmaCase alone_case{1, count, 4, 2, hd};
          const Forward alone = gpu_forward(row_slice(qkv, first, count), alone_case);
          const std::string name = case_name(alone_case, dtype) + " from row " +
                                   std::to_string(first) + ", " + std::to_string(warp_rows) +
                                   " rows per warp";
          EXPECT_TRUE(bitwise_equal(row_slice(together.out, first, count), alone.out)) << name;
          EXPECT_TRUE(bitwise_equal(column_slice(together.lse, first, count), alone.lse)) << name;
        }
      }
    }
  }
}

// RoundsPToSixteenBitsBeforeThePvProduct on a packed row: token 0 is a sequence of its own
// (positions 0, 0, 1), tokens 1 and 2 the case's two tokens. Query 2 sees keys 1 and 2 only --
// key 0's score (2) would be the row max and its value (1/2) would move the output far -- and
// its output is P's rounding's, not the unrounded one of the CPU twin and the fp32 kernel: the
// tensor-core kernel runs packed rows, and masks the keys before a sequence.
TEST(CudaAttentionMma, PackedRowsRoundPToSixteenBits) {
  REQUIRE_CUDA_DEVICE();
  const MmaCase c{1, 3, 1, 1, 64};
  HostTensor positions(DType::I32, {1, 3});
  set_sequences(positions, 0, {1, 2});
  for (DType dtype : {DType::BF16, DType::F16}) {
    HostTensor qkv(dtype, {c.B, c.T, c.W()});  // row t: q (64) | k (64) | v (64)
    const double k[3] = {0.5, 0.25, -0.25}, v[3] = {0.5, 0.125, -1.0};  // scores 2, 1, -1
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t d = 0; d < c.hd; ++d) {
        qkv.set(t * c.W() + d, 0.5);
        qkv.set(t * c.W() + c.hd + d, k[t]);
        qkv.set(t * c.W() + 2 * c.hd + d, v[t]);
      }
    }
    const double p2 = std::exp(-2.0), sum = 1.0 + p2;
    const double rounded = round_to(dtype, (0.125 - round_to(dtype, p2)) / sum);
    const double unrounded = round_to(dtype, (0.125 - p2) / sum);
    ASSERT_GT(std::fabs(rounded - unrounded), 4 * unit_roundoff(dtype) * std::fabs(rounded))
        << "the case must tell the two apart";
    const Forward gpu = gpu_forward(qkv, c, &positions);
    for (int64_t d = 0; d < c.hd; ++d) {
      EXPECT_EQ(gpu.out.get(d), 0.5) << "row 0 sees only v0, column " << d;
      EXPECT_EQ(gpu.out.get(c.hd + d), 0.125) << "row 1 sees only v1, column " << d;
      EXPECT_EQ(gpu.out.get(2 * c.hd + d), rounded) << dtype_name(dtype) << " row 2, column " << d
                                                    << " (unrounded P gives " << unrounded << ")";
    }
    EXPECT_NEAR(gpu.lse.get(0), 2.0, 1e-6);
    EXPECT_NEAR(gpu.lse.get(1), 1.0, 1e-6);
    EXPECT_NEAR(gpu.lse.get(2), 1.0 + std::log(sum), 1e-6);
  }
}

}  // namespace
}  // namespace dstrain::test
