// The tensor-core attention backward (kernels/cuda/cuda_attention_mma_backward.cu: BF16/F16
// storage, head dims 64, 128, 192, 256) against the CPU twin's backward on the same 16-bit inputs
// and the same forward out and lse (the CUDA forward's): B = 2, NH = 4 with KV = 4, 2, 1
// (multi-head and 2 or 4 query heads per kv head), T in {1, 17, 64, 100, 130} (cutting the
// 64-row query blocks, the 64- or 32-row key blocks and the 64-, 32- and 16-row streamed tiles);
// dqkv starts as NaN (every element must be written: the op overwrites it), the inputs and the
// guard regions after every buffer come back untouched, and a second run gives the same bits.
// Packed sequences (positions) on the same kernels: against the CPU twin within the same bounds
// (each query's sums run over its own sequence's keys), positions 0..T-1 give the bits of no
// positions, and a row cut at a tile boundary gives the bits of its sequences run alone (the
// tensor-core kernels, not the fp32 ones, run packed rows).
//
// Tolerance. u = 2^-8 (bf16) or 2^-11 (f16), the storage type's unit roundoff. The kernels
// differ from the CPU twin (fp32 throughout, the same P and dS formulas) in:
//   1. P rounded to 16 bits before dV = sum_i P_ij dO_i (relative error |d_ij| <= u), and dS
//      before dK = scale sum_i dS_ij Q_i and dQ = scale sum_j dS_ij K_j. P and dS themselves are
//      computed in fp32 from unrounded values, as the CPU does.
//   2. dS = P (dP - D) with dP = dO_i . v_j and D = dO_i . O_i fp32 dot products of hd 16-bit
//      products summed in another order (the mma's, the delta kernel's butterfly): each off by
//      at most hd 2^-24 sum_d |dO_id| |v_jd| (resp. |O_id|), which the difference dP - D does not
//      shrink: e_ij = P_ij 2 hd 2^-24 (sum_d |dO_id v_jd| + sum_d |dO_id O_id|).
//   3. exp2f(x log2 e - lse log2 e) for expf(x - lse), fp32 sums over up to T * NH/KV terms in
//      another order: relative O(2^-24 (|x| + T NH/KV)) <= 4e-5, against u >= 4.9e-4.
//   4. Both round their fp32 results to 16 bits: at most u |result| + eta each.
// eta, half the smallest subnormal (f16 2^-25, bf16 2^-134), bounds a rounding's absolute error
// below the normal range (small P, dS and results in f16): rounding x costs u |x| + eta.
// Per element, from the data (this file recomputes P, dS in double): with
//   A(dv_jd) = sum_i (u P_ij + eta) |dO_id|,
//   A(dk_jd) = scale sum_i (u |dS_ij| + eta + e_ij) |Q_id|,
//   A(dq_id) = scale sum_j (u |dS_ij| + eta + e_ij) |K_jd|
// (sums over the kv head's query heads too), |gpu - cpu| <= A + 2u |cpu| + 2 eta (+ 3.): the
// check is 1.25 A + 2.5 u |cpu| + 2 eta (25 % for 3. and the (1 + u) factors).
// Normalized, mse(gpu, cpu) / mse(cpu, 0): the d_ij are spread over +-half an ulp, E[d^2] <=
// u^2/3, independent of the random-sign dO, Q, K they multiply, so term 1 adds at most u^2/3 of
// the squared result (E[(sum_i P_ij d_ij dO_id)^2] <= u^2/3 E[(sum_i P_ij dO_id)^2] for
// independent signs), term 4 u^2/3 each, 2. and 3. are far below: about u^2 in all, bound 2 u^2
// (bf16 3.1e-5, f16 4.8e-7) -- the forward's bound. Not for dq and dk at T = 1: the one key's
// dS = P (dP - D) is 0 up to fp32 noise (P = 1, O = v), so both results are noise; there the
// per-element bound (its e_ij term) is the check.
#include <cmath>
#include <fstream>

#include "attention_case.h"
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

using BackwardCase = AttentionCase;

std::string case_name(const BackwardCase& c, DType dtype) {
  return std::string(dtype_name(dtype)) + "_B" + std::to_string(c.B) + "_T" + std::to_string(c.T) +
         "_NH" + std::to_string(c.NH) + "_KV" + std::to_string(c.KV) + "_hd" + std::to_string(c.hd);
}

double unit_roundoff(DType dtype) { return dtype == DType::BF16 ? 0x1p-8 : 0x1p-11; }
// Half the smallest subnormal: a rounding's absolute error below the normal range.
double subnormal_eta(DType dtype) { return dtype == DType::BF16 ? 0x1p-134 : 0x1p-25; }

// positions (B,T) of packed sequences, or empty (no positions: one causal sequence per row).
struct Inputs {
  HostTensor qkv, out, lse, dout;
  HostTensor positions{DType::I32, {0}};
  bool packed() const { return positions.numel() > 0; }
  Tensor positions_tensor() const { return packed() ? positions.t() : Tensor(); }
};

// The CUDA forward's out and lse for qkv (q, k, v magnitudes in [1/8, 3/2)), dout in [1/8, 1);
// with `positions` (B,T) its packed sequences, else none.
Inputs make_inputs(DType dtype, const BackwardCase& c, uint64_t seed,
                   const HostTensor* positions = nullptr) {
  Random rng(seed);
  Inputs in{nonzero_tensor(rng, dtype, {c.B, c.T, c.W()}, 0.125, 1.5),
            nan_tensor(dtype, {c.B, c.T, c.C()}), nan_tensor(DType::F32, {c.B, c.NH, c.T}),
            nonzero_tensor(rng, dtype, {c.B, c.T, c.C()}, 0.125, 1.0)};
  if (positions) in.positions = positions->clone();
  HostTensor qkv_gpu = in.qkv.clone(), positions_gpu = in.positions.clone();
  GpuRun run;
  cuda_backend().attention_forward(run(in.out), run(in.lse), run(qkv_gpu),
                                   in.packed() ? run(positions_gpu) : Tensor(), c.nh(), c.kv(),
                                   nullptr);
  run.finish();
  return in;
}

HostTensor cpu_backward(const Inputs& in, const BackwardCase& c) {
  HostTensor dqkv = nan_tensor(in.qkv.dtype(), {c.B, c.T, c.W()});
  cpu_backend().attention_backward(dqkv, in.dout, in.qkv, in.out, in.lse, in.positions_tensor(),
                                   c.nh(), c.kv(), nullptr);
  return dqkv;
}

// The CUDA backend's backward (with in's positions, if any; none with `without_positions`);
// also checks that the inputs are untouched and no guard region written.
HostTensor gpu_backward(const Inputs& in, const BackwardCase& c, bool without_positions = false) {
  const DType dtype = in.qkv.dtype();
  HostTensor dqkv = nan_tensor(dtype, {c.B, c.T, c.W()});
  HostTensor dout = in.dout.clone(), qkv = in.qkv.clone(), out = in.out.clone(),
             lse = in.lse.clone(), positions = in.positions.clone();
  const bool packed = in.packed() && !without_positions;
  GpuRun run;
  cuda_backend().attention_backward(run(dqkv), run(dout), run(qkv), run(out), run(lse),
                                    packed ? run(positions) : Tensor(), c.nh(), c.kv(), nullptr);
  run.finish();
  EXPECT_TRUE(bitwise_equal(dout, in.dout) && bitwise_equal(qkv, in.qkv) &&
              bitwise_equal(out, in.out) && bitwise_equal(lse, in.lse) &&
              bitwise_equal(positions, in.positions))
      << "an input was written " << case_name(c, dtype);
  EXPECT_TRUE(guards_intact({&dqkv, &dout, &qkv, &out, &lse, &positions})) << case_name(c, dtype);
  return dqkv;
}

// The per-element bound A of the file comment for every element of dqkv (B,T,(NH+2KV)*hd), in
// double from the stored 16-bit inputs and the forward's out and lse: the sums over the keys
// j <= i of query i's sequence (from i - positions[b,i] with positions, else from 0).
std::vector<double> element_bounds(const Inputs& in, const BackwardCase& c) {
  const double u = unit_roundoff(in.qkv.dtype()), eta = subnormal_eta(in.qkv.dtype());
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
  const int64_t T = c.T, hd = c.hd, W = c.W(), C = c.C(), group = c.NH / c.KV;
  const std::vector<double> qkv = in.qkv.values(), out = in.out.values(), dout = in.dout.values(),
                            lse = in.lse.values();
  std::vector<double> bound(static_cast<size_t>(c.B * T * W), 0.0);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.NH; ++h) {
      const int64_t kv = h / group;
      const int64_t q_col = h * hd, k_col = (c.NH + kv) * hd, v_col = (c.NH + c.KV + kv) * hd;
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * W + q_col];
        const double* d_o = &dout[(b * T + i) * C + h * hd];
        const double* o = &out[(b * T + i) * C + h * hd];
        double delta = 0.0, delta_abs = 0.0;
        for (int64_t d = 0; d < hd; ++d) {
          delta += d_o[d] * o[d];
          delta_abs += std::fabs(d_o[d] * o[d]);
        }
        const int64_t first = in.packed() ? i - in.positions.i32()[b * T + i] : 0;
        for (int64_t j = first; j <= i; ++j) {
          const double* k = &qkv[(b * T + j) * W + k_col];
          const double* v = &qkv[(b * T + j) * W + v_col];
          double s = 0.0, dp = 0.0, dp_abs = 0.0;
          for (int64_t d = 0; d < hd; ++d) {
            s += q[d] * k[d];
            dp += d_o[d] * v[d];
            dp_abs += std::fabs(d_o[d] * v[d]);
          }
          const double p = std::exp(s * scale - lse[(b * c.NH + h) * T + i]);
          const double ds = p * (dp - delta);
          const double e = p * 2.0 * static_cast<double>(hd) * 0x1p-24 * (dp_abs + delta_abs);
          const double ds_term = scale * (u * std::fabs(ds) + eta + e);
          double* dq_bound = &bound[(b * T + i) * W + q_col];
          double* dk_bound = &bound[(b * T + j) * W + k_col];
          double* dv_bound = &bound[(b * T + j) * W + v_col];
          for (int64_t d = 0; d < hd; ++d) {
            dq_bound[d] += ds_term * std::fabs(k[d]);
            dk_bound[d] += ds_term * std::fabs(q[d]);
            dv_bound[d] += (u * p + eta) * std::fabs(d_o[d]);
          }
        }
      }
    }
  }
  return bound;
}

enum class Part { kDq, kDk, kDv };
const char* part_name(Part part) {
  return part == Part::kDq ? "dq" : part == Part::kDk ? "dk" : "dv";
}
bool in_part(Part part, int64_t column, const BackwardCase& c) {
  const int64_t head_slot = column / c.hd;
  switch (part) {
    case Part::kDq:
      return head_slot < c.NH;
    case Part::kDk:
      return head_slot >= c.NH && head_slot < c.NH + c.KV;
    default:
      return head_slot >= c.NH + c.KV;
  }
}

// On a failure: the inputs and both results, one value a line, named after the case.
void dump_case(const std::string& name, const Inputs& in, const HostTensor& gpu,
               const HostTensor& cpu) {
  std::ofstream file("attention_mma_backward_" + name + ".txt");
  const auto write = [&](const char* what, const HostTensor& t) {
    file << "# " << what << " " << t.t().shape_str() << "\n";
    for (double x : t.values()) file << x << "\n";
  };
  write("qkv", in.qkv);
  write("out", in.out);
  write("lse", in.lse);
  write("dout", in.dout);
  write("dqkv gpu", gpu);
  write("dqkv cpu", cpu);
}

// One part (dq, dk or dv) of dqkv: every element within 1.25 A + 2.5 u |cpu| + 2 eta, and
// (with_nmse)
// the normalized error within 2 u^2 on a reference that is not all zeros.
::testing::AssertionResult part_close(Part part, const std::vector<double>& gpu,
                                      const std::vector<double>& cpu,
                                      const std::vector<double>& bound, const BackwardCase& c,
                                      double u, double eta, bool with_nmse) {
  double ref_norm = 0.0, err_norm = 0.0;
  int64_t mismatches = 0, first_bad = -1;
  for (size_t idx = 0; idx < gpu.size(); ++idx) {
    if (!in_part(part, static_cast<int64_t>(idx) % c.W(), c)) continue;
    if (!std::isfinite(gpu[idx])) {
      return ::testing::AssertionFailure() << part_name(part) << ": non-finite " << gpu[idx]
                                           << " at " << idx << " (reference " << cpu[idx] << ")";
    }
    const double err = gpu[idx] - cpu[idx];
    ref_norm += cpu[idx] * cpu[idx];
    err_norm += err * err;
    if (std::fabs(err) > 1.25 * bound[idx] + 2.5 * u * std::fabs(cpu[idx]) + 2.0 * eta) {
      if (first_bad < 0) first_bad = static_cast<int64_t>(idx);
      ++mismatches;
    }
  }
  const double nmse = ref_norm > 0.0 ? err_norm / ref_norm : 0.0;
  if (with_nmse && !(ref_norm > 0.0)) {
    return ::testing::AssertionFailure() << part_name(part) << ": reference all zeros";
  }
  if (mismatches > 0 || (with_nmse && nmse > 2.0 * u * u)) {
    auto failure = ::testing::AssertionFailure();
    failure << part_name(part) << ": " << mismatches << " elements beyond the bound, normalized "
            << "mse " << nmse << " (bound " << 2.0 * u * u << ")";
    if (first_bad >= 0) {
      failure << "; first at " << first_bad << ": got " << gpu[first_bad] << ", reference "
              << cpu[first_bad] << ", bound " << 1.25 * bound[first_bad]
              << " + 2.5 u |ref| + 2 eta";
    }
    return failure;
  }
  return ::testing::AssertionSuccess();
}

// One case against the CPU twin: every part (dq, dk, dv) within its bounds, the normalized
// error of dq and dk only `with_dq_dk_nmse`; the inputs and both results dumped on a failure.
void expect_case_matches_cpu(const Inputs& in, const BackwardCase& c, const std::string& name,
                             bool with_dq_dk_nmse) {
  const DType dtype = in.qkv.dtype();
  const double u = unit_roundoff(dtype), eta = subnormal_eta(dtype);
  const HostTensor cpu = cpu_backward(in, c), gpu = gpu_backward(in, c);
  const std::vector<double> bound = element_bounds(in, c);
  const std::vector<double> got = gpu.values(), ref = cpu.values();
  bool ok = true;
  for (Part part : {Part::kDq, Part::kDk, Part::kDv}) {
    const bool with_nmse = with_dq_dk_nmse || part == Part::kDv;
    const auto result = part_close(part, got, ref, bound, c, u, eta, with_nmse);
    EXPECT_TRUE(result) << name;
    ok = ok && result;
  }
  if (!ok) dump_case(name, in, gpu, cpu);
}

void expect_backward_matches_cpu(DType dtype, int64_t hd) {
  REQUIRE_CUDA_DEVICE();
  for (int64_t T : {1, 17, 64, 100, 130}) {
    for (int64_t KV : {4, 2, 1}) {
      const BackwardCase c{2, T, 4, KV, hd};
      const Inputs in = make_inputs(dtype, c, static_cast<uint64_t>(3000 * hd + 10 * T + KV));
      expect_case_matches_cpu(in, c, case_name(c, dtype), T > 1);
    }
  }
}

TEST(CudaAttentionMmaBackward, MatchesCpu_bf16_hd64) {
  expect_backward_matches_cpu(DType::BF16, 64);
}
TEST(CudaAttentionMmaBackward, MatchesCpu_bf16_hd128) {
  expect_backward_matches_cpu(DType::BF16, 128);
}
TEST(CudaAttentionMmaBackward, MatchesCpu_bf16_hd192) {
  expect_backward_matches_cpu(DType::BF16, 192);
}
TEST(CudaAttentionMmaBackward, MatchesCpu_bf16_hd256) {
  expect_backward_matches_cpu(DType::BF16, 256);
}
TEST(CudaAttentionMmaBackward, MatchesCpu_f16_hd64) { expect_backward_matches_cpu(DType::F16, 64); }
TEST(CudaAttentionMmaBackward, MatchesCpu_f16_hd128) {
  expect_backward_matches_cpu(DType::F16, 128);
}
TEST(CudaAttentionMmaBackward, MatchesCpu_f16_hd192) {
  expect_backward_matches_cpu(DType::F16, 192);
}
TEST(CudaAttentionMmaBackward, MatchesCpu_f16_hd256) {
  expect_backward_matches_cpu(DType::F16, 256);
}

// At hd 64 a warp of the dQ kernel may own 32 query rows and one of the dK/dV kernel 32 key rows
// (set_cuda_attention_warp_rows(32): blocks of 128 rows, 32-row streamed tiles). Every dQ, dK
// and dV element still sums the same 16-row mma steps in the same order -- the steps one form
// has and the other skips hold only masked pairs (P = dS = +0) -- and delta the same products:
// the bits of 16 rows, which MatchesCpu_*_hd64 bound. (tests/cuda_emu/launch_counts_test.cpp
// checks that the setting changes the blocks.) Ragged T over several blocks, multi-head and
// grouped-query.
TEST(CudaAttentionMmaBackward, ThirtyTwoRowsPerWarpKeepTheBits) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int64_t T : {17, 300}) {
      for (int64_t KV : {4, 1}) {
        const BackwardCase c{2, T, 4, KV, 64};
        const Inputs in = make_inputs(dtype, c, static_cast<uint64_t>(500 + T + KV));
        const HostTensor narrow = gpu_backward(in, c);
        const AttentionWarpRows rows(32);
        EXPECT_TRUE(bitwise_equal(gpu_backward(in, c), narrow)) << case_name(c, dtype);
      }
    }
  }
}

// No atomics, sums in a fixed order: a second run gives the same bits (grouped-query, every
// head dim, ragged T).
TEST(CudaAttentionMmaBackward, RepeatsBitwise) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int64_t hd : {64, 128, 192, 256}) {
      const BackwardCase c{2, 100, 4, 1, hd};
      const Inputs in = make_inputs(dtype, c, static_cast<uint64_t>(11 + hd));
      const HostTensor first = gpu_backward(in, c), second = gpu_backward(in, c);
      EXPECT_TRUE(bitwise_equal(first, second)) << case_name(c, dtype);
    }
  }
}

// Packed sequences (attention_case.h's packed_positions: random short sequences, single tokens,
// sequences longer than any tile, a warp whose rows start in two key tiles, a row of one
// sequence) against the CPU twin, with the forward's out and lse for them: B = 3, T = 70, 100,
// 200 (none a multiple of the tiles), NH = 4 over KV = 2 and 1 (grouped-query). The normalized
// errors too: a single-token sequence's dq and dk are fp32 noise (as at T = 1), but few among
// the rest.
void expect_packed_backward_matches_cpu(DType dtype, int64_t hd) {
  REQUIRE_CUDA_DEVICE();
  for (int64_t T : {70, 100, 200}) {
    for (int64_t KV : {2, 1}) {
      const BackwardCase c{3, T, 4, KV, hd};
      Random rng(static_cast<uint64_t>(9000 + hd + 10 * T + KV));
      const HostTensor positions = packed_positions(rng, c.T);
      const Inputs in =
          make_inputs(dtype, c, static_cast<uint64_t>(9000 + hd + 10 * T + KV), &positions);
      expect_case_matches_cpu(in, c, "packed_" + case_name(c, dtype), true);
    }
  }
}

TEST(CudaAttentionMmaBackward, PackedMatchesCpu_bf16_hd64) {
  expect_packed_backward_matches_cpu(DType::BF16, 64);
}
TEST(CudaAttentionMmaBackward, PackedMatchesCpu_bf16_hd128) {
  expect_packed_backward_matches_cpu(DType::BF16, 128);
}
TEST(CudaAttentionMmaBackward, PackedMatchesCpu_f16_hd64) {
  expect_packed_backward_matches_cpu(DType::F16, 64);
}
TEST(CudaAttentionMmaBackward, PackedMatchesCpu_f16_hd128) {
  expect_packed_backward_matches_cpu(DType::F16, 128);
}

// hd 192 and 256 (32-key blocks whose warps split the columns, 16-row tiles): one ragged case
// per dtype.
TEST(CudaAttentionMmaBackward, PackedMatchesCpu_hd192And256) {
  REQUIRE_CUDA_DEVICE();
  for (int64_t hd : {192, 256}) {
    for (DType dtype : {DType::BF16, DType::F16}) {
      const BackwardCase c{3, 100, 4, 2, hd};
      Random rng(77);
      const HostTensor positions = packed_positions(rng, c.T);
      const Inputs in = make_inputs(dtype, c, 78, &positions);
      expect_case_matches_cpu(in, c, "packed_" + case_name(c, dtype), true);
    }
  }
}

// Packed rows at 32 rows per warp (hd 64) give the bits of 16, as without positions
// (ThirtyTwoRowsPerWarpKeepTheBits: the steps one form has and the other skips hold only masked
// pairs, P = dS = +0, now also those before a sequence's start and after its end); a second
// run gives the same bits (no atomics).
TEST(CudaAttentionMmaBackward, PackedThirtyTwoRowsPerWarpKeepTheBitsAndRepeat) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    const BackwardCase c{3, 200, 4, 2, 64};
    Random rng(79);
    const HostTensor positions = packed_positions(rng, c.T);
    const Inputs in = make_inputs(dtype, c, 80, &positions);
    const HostTensor narrow = gpu_backward(in, c);
    EXPECT_TRUE(bitwise_equal(gpu_backward(in, c), narrow)) << "repeat " << case_name(c, dtype);
    const AttentionWarpRows rows(32);
    EXPECT_TRUE(bitwise_equal(gpu_backward(in, c), narrow)) << "32 rows " << case_name(c, dtype);
  }
}

// Positions 0..T-1 (every row one sequence) give the bits of no positions: the kernels then skip
// no tile, take the unmasked path on the same tiles and mask nothing more. Every head dim (and
// 32 rows per warp at hd 64), ragged T, grouped-query.
TEST(CudaAttentionMmaBackward, CountingPositionsKeepTheBitsOfNoPositions) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (auto [hd, warp_rows] : {std::pair{64, 16}, {64, 32}, {128, 16}, {192, 16}, {256, 16}}) {
      const AttentionWarpRows rows(warp_rows);
      const BackwardCase c{1, 100, 4, 2, hd};
      const HostTensor positions = counting_positions(c.B, c.T);
      const Inputs in = make_inputs(dtype, c, static_cast<uint64_t>(81 + hd), &positions);
      EXPECT_TRUE(bitwise_equal(gpu_backward(in, c), gpu_backward(in, c, true)))
          << case_name(c, dtype) << ", " << warp_rows << " rows per warp";
    }
  }
}

// A row packed from a sequence of 64 tokens (a multiple of every tile and block of both
// kernels) and one of 70 gives, bit for bit, the dq, dk and dv that each sequence gives run
// alone without positions (from the same qkv, out, lse and dout rows): every query and key
// meets its tiles in the same order. No warp computes with the other sequence's rows: poisoned
// with NaN there (qkv, out, lse, dout; a masked use would carry it into dK, dV or dQ through
// 0 NaN = NaN), the bits stay -- at 32 rows per warp too, where a 128-key block of the dK/dV
// kernel holds keys of both sequences and its warps skip the other's query tiles. The runs alone
// are the tensor-core kernels' (16-bit storage, hd 64, 128, 192, 256): so is the packed run; the
// fp32 kernels' bits differ.
TEST(CudaAttentionMmaBackward, PackedRowCutAtATileHasTheBitsOfEachSequenceAlone) {
  REQUIRE_CUDA_DEVICE();
  constexpr int64_t kFirst = 64, kSecond = 70;
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (auto [hd, warp_rows] : {std::pair{64, 16}, {64, 32}, {128, 16}, {192, 16}, {256, 16}}) {
      const AttentionWarpRows rows(warp_rows);
      const BackwardCase packed{1, kFirst + kSecond, 4, 2, hd};
      HostTensor positions(DType::I32, {1, packed.T});
      set_sequences(positions, 0, {kFirst, kSecond});
      const Inputs in = make_inputs(dtype, packed, static_cast<uint64_t>(83 + hd), &positions);
      for (auto [first, count] : {std::pair{int64_t{0}, kFirst}, {kFirst, kSecond}}) {
        const int64_t other_first = first == 0 ? kFirst : 0, other_count = packed.T - count;
        const Inputs packed_in{with_nan_rows(in.qkv, other_first, other_count),
                               with_nan_rows(in.out, other_first, other_count),
                               with_nan_columns(in.lse, other_first, other_count),
                               with_nan_rows(in.dout, other_first, other_count),
                               in.positions.clone()};
        const HostTensor together = gpu_backward(packed_in, packed);
        const BackwardCase alone_case{1, count, 4, 2, hd};
        const Inputs alone{row_slice(in.qkv, first, count), row_slice(in.out, first, count),
                           column_slice(in.lse, first, count), row_slice(in.dout, first, count)};
        EXPECT_TRUE(
            bitwise_equal(row_slice(together, first, count), gpu_backward(alone, alone_case)))
            << case_name(alone_case, dtype) << " from row " << first << ", " << warp_rows
            << " rows per warp";
      }
    }
  }
}

}  // namespace
}  // namespace dstrain::test
