// The PTX primitives of kernels/cuda/cuda_ptx.cuh on the CUDA emulator, checked against the PTX
// ISA's own tables: the mma.m16n8k16 fragment formulas and the ldmatrix lane layout are written
// here again, independently of kernels/cuda_emu/emu_ptx.cpp, so a layout wrong in either fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"

// The emulator's device prelude comes before any kernel header (as in the .cu wrappers).
// clang-format off
#include "kernels/cuda_emu/emu_device.h"
#include "kernels/cuda/cuda_ptx.cuh"
// clang-format on

namespace {

using dstrain::cuda::Bf16x8;
namespace ptx = dstrain::cuda;

// ---- mma.m16n8k16: the ISA's fragment formulas (groupID = lane >> 2, tig = lane % 4) ----

struct Position {
  int row, col;
};
Position a_element(int lane, int i) {  // a_i, i = 0..7
  const int group = lane >> 2, tig = lane % 4;
  const bool upper_rows = (i >= 0 && i < 2) || (i >= 4 && i < 6);
  return {upper_rows ? group : group + 8, tig * 2 + (i & 1) + (i < 4 ? 0 : 8)};
}
Position b_element(int lane, int i) {  // b_i, i = 0..3
  const int group = lane >> 2, tig = lane % 4;
  return {tig * 2 + (i & 1) + (i < 2 ? 0 : 8), group};
}
Position c_element(int lane, int i) {  // c_i / d_i, i = 0..3
  const int group = lane >> 2, tig = lane % 4;
  return {i < 2 ? group : group + 8, tig * 2 + (i & 1)};
}

// One warp; lane l's fragments at a_regs[4l..], b_regs[2l..], c[4l..]; its D to d[4l..].
// The accumulator is updated in place (d aliases c), as kernels use it.
__global__ void mma_kernel(const uint32_t* a_regs, const uint32_t* b_regs, const float* c, float* d,
                           bool f16) {
  const int lane = threadIdx.x % 32;
  uint32_t a[4], b[2];
  float accumulator[4];
  for (int i = 0; i < 4; ++i) a[i] = a_regs[4 * lane + i];
  for (int i = 0; i < 2; ++i) b[i] = b_regs[2 * lane + i];
  for (int i = 0; i < 4; ++i) accumulator[i] = c[4 * lane + i];
  if (f16) {
    ptx::mma_m16n8k16_f16(accumulator, a, b, accumulator);
  } else {
    ptx::mma_m16n8k16_bf16(accumulator, a, b, accumulator);
  }
  for (int i = 0; i < 4; ++i) d[4 * lane + i] = accumulator[i];
}

// Lane 3 leaves before the mma: undefined on a GPU (.aligned).
__global__ void mma_exited_lane_kernel(float* d) {
  if (threadIdx.x == 3) return;
  uint32_t a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u}, b[2] = {a[0], a[1]};
  float c[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  ptx::mma_m16n8k16_bf16(c, a, b, c);
  d[threadIdx.x] = c[0];
}

// A (16, 16), B (16, 8) in bf16 or f16 with their exact values, C (16, 8) in fp32: never zero.
struct MmaCase {
  bool f16 = false;
  std::vector<uint16_t> a_bits, b_bits;  // (16, 16), (16, 8)
  std::vector<double> a, b, c;           // exact values: (16, 16), (16, 8), (16, 8)
};

// `value` rounded to the 16-bit type: its bits and its exact value.
uint16_t round_to_16_bits(float value, bool f16, double& exact) {
  uint16_t bits;
  if (f16) {
    const __half h = __float2half_rn(value);
    exact = __half2float(h);
    std::memcpy(&bits, &h, 2);
  } else {
    const __nv_bfloat16 h = __float2bfloat16_rn(value);
    exact = __bfloat162float(h);
    std::memcpy(&bits, &h, 2);
  }
  return bits;
}

// Magnitudes in [0.25, 2] with random signs, or (integers) whole numbers in [1, 8]: exact sums.
MmaCase make_mma_case(bool f16, bool integers, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> magnitude(0.25f, 2.0f);
  std::uniform_int_distribution<int> whole(1, 8), sign(0, 1);
  auto draw = [&] {
    const float m = integers ? static_cast<float>(whole(rng)) : magnitude(rng);
    return sign(rng) ? -m : m;
  };
  MmaCase mma;
  mma.f16 = f16;
  mma.a.resize(16 * 16);
  mma.b.resize(16 * 8);
  mma.c.resize(16 * 8);
  for (double& v : mma.a) mma.a_bits.push_back(round_to_16_bits(draw(), f16, v));
  for (double& v : mma.b) mma.b_bits.push_back(round_to_16_bits(draw(), f16, v));
  for (double& v : mma.c) v = static_cast<float>(draw() * (integers ? 8.0f : 1.0f));
  return mma;
}

// Runs the mma on the emulator: fragments built by the ISA's formulas, D read back by them.
std::vector<float> run_mma(const MmaCase& mma) {
  std::vector<uint32_t> a_regs(32 * 4, 0), b_regs(32 * 2, 0);
  std::vector<float> c(32 * 4), d(32 * 4, NAN), result(16 * 8, NAN);
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      const Position p = a_element(lane, i);
      a_regs[4 * lane + i / 2] |= uint32_t{mma.a_bits[p.row * 16 + p.col]} << (16 * (i % 2));
    }
    for (int i = 0; i < 4; ++i) {
      const Position p = b_element(lane, i);
      b_regs[2 * lane + i / 2] |= uint32_t{mma.b_bits[p.row * 8 + p.col]} << (16 * (i % 2));
      const Position q = c_element(lane, i);
      c[4 * lane + i] = static_cast<float>(mma.c[q.row * 8 + q.col]);
    }
  }
  DSTRAIN_LAUNCH(mma_kernel, 1, 32, 0, nullptr)
  (a_regs.data(), b_regs.data(), c.data(), d.data(), mma.f16);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const Position p = c_element(lane, i);
      result[p.row * 8 + p.col] = d[4 * lane + i];
    }
  }
  return result;
}

// D against the float64 product: |d - ref| <= 17 * 2^-23 * (|c| + sum |a * b|) covers fp32
// accumulation of the 17 terms in any order, rounded or truncated at each step (the
// hardware's order is unspecified). `exact` demands equality (integer data: every partial sum
// is exact in fp32).
void expect_matches_reference(const MmaCase& mma, const std::vector<float>& d, bool exact) {
  double reference_norm = 0.0;
  for (int row = 0; row < 16; ++row) {
    for (int col = 0; col < 8; ++col) {
      double reference = mma.c[row * 8 + col], magnitude = std::fabs(reference);
      for (int k = 0; k < 16; ++k) {
        reference += mma.a[row * 16 + k] * mma.b[k * 8 + col];
        magnitude += std::fabs(mma.a[row * 16 + k] * mma.b[k * 8 + col]);
      }
      reference_norm += reference * reference;
      const double tolerance = exact ? 0.0 : 17.0 * std::ldexp(1.0, -23) * magnitude;
      EXPECT_NEAR(d[row * 8 + col], reference, tolerance) << "D[" << row << "][" << col << "]";
    }
  }
  EXPECT_GT(reference_norm, 0.0) << "a test on all-zero results proves nothing";
}

TEST(CudaEmulatorPtx, MmaFragmentFormulasMatchTheIsaFigures) {
  // Entries read off the ISA's figures for m16n8k16 (f16/bf16 A and B, f32 C/D).
  auto at = [](Position p) { return std::make_pair(p.row, p.col); };
  using P = std::pair<int, int>;
  EXPECT_EQ(at(a_element(0, 0)), P(0, 0));
  EXPECT_EQ(at(a_element(5, 0)), P(1, 2));  // T5: a0, a1 = A[1][2], A[1][3]
  EXPECT_EQ(at(a_element(5, 1)), P(1, 3));
  EXPECT_EQ(at(a_element(5, 2)), P(9, 2));
  EXPECT_EQ(at(a_element(5, 4)), P(1, 10));
  EXPECT_EQ(at(a_element(5, 7)), P(9, 11));
  EXPECT_EQ(at(a_element(31, 7)), P(15, 15));
  EXPECT_EQ(at(b_element(0, 1)), P(1, 0));
  EXPECT_EQ(at(b_element(5, 0)), P(2, 1));  // T5: b0, b1 = B[2][1], B[3][1]
  EXPECT_EQ(at(b_element(5, 2)), P(10, 1));
  EXPECT_EQ(at(b_element(31, 3)), P(15, 7));
  EXPECT_EQ(at(c_element(5, 0)), P(1, 2));  // T5: c0..c3 = C[1][2], C[1][3], C[9][2], C[9][3]
  EXPECT_EQ(at(c_element(5, 3)), P(9, 3));
  EXPECT_EQ(at(c_element(31, 3)), P(15, 7));
}

TEST(CudaEmulatorPtx, MmaBf16WithIntegersIsExact) {
  const MmaCase mma = make_mma_case(/*f16=*/false, /*integers=*/true, 11);
  expect_matches_reference(mma, run_mma(mma), /*exact=*/true);
}

TEST(CudaEmulatorPtx, MmaF16WithIntegersIsExact) {
  const MmaCase mma = make_mma_case(/*f16=*/true, /*integers=*/true, 12);
  expect_matches_reference(mma, run_mma(mma), /*exact=*/true);
}

TEST(CudaEmulatorPtx, MmaBf16MatchesFloat64Reference) {
  for (unsigned seed : {1u, 2u, 3u}) {
    const MmaCase mma = make_mma_case(/*f16=*/false, /*integers=*/false, seed);
    expect_matches_reference(mma, run_mma(mma), /*exact=*/false);
  }
}

TEST(CudaEmulatorPtx, MmaF16MatchesFloat64Reference) {
  for (unsigned seed : {4u, 5u, 6u}) {
    const MmaCase mma = make_mma_case(/*f16=*/true, /*integers=*/false, seed);
    expect_matches_reference(mma, run_mma(mma), /*exact=*/false);
  }
}

// Throws: the error the emulator reports when the kernel runs, at the wait for its stream.
template <class Launch>
std::string launch_error(Launch&& launch) {
  try {
    launch();
    cudaDeviceSynchronize();
  } catch (const dstrain::Error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaEmulatorPtx, MmaFromAPartialWarpOrWithAnExitedLaneIsAnError) {
  std::vector<uint32_t> a_regs(128, 0x3f803f80u), b_regs(64, 0x3f803f80u);
  std::vector<float> c(128, 1.0f), d(128, 0.0f);
  const std::string partial = launch_error([&] {
    DSTRAIN_LAUNCH(mma_kernel, 1, 16, 0, nullptr)
    (a_regs.data(), b_regs.data(), c.data(), d.data(), false);
  });
  EXPECT_NE(partial.find("mma.sync.aligned.m16n8k16"), std::string::npos) << partial;
  EXPECT_NE(partial.find("exited or do not exist"), std::string::npos) << partial;
  const std::string exited = launch_error([&] {
    DSTRAIN_LAUNCH(mma_exited_lane_kernel, 1, 32, 0, nullptr)
    (d.data());
  });
  EXPECT_NE(exited.find("mma.sync.aligned.m16n8k16"), std::string::npos) << exited;
}

// ---- ldmatrix ----

// Four 8x8 matrices of distinct, non-zero 16-bit values.
uint16_t matrix_value(int matrix, int row, int col) {
  return static_cast<uint16_t>(0x100 * (matrix + 1) + 0x10 * row + col);
}
// Row r of matrix m sits at shared row slot_of(m, r), rows 24 elements apart: rows need be
// neither contiguous nor in order, only 16-byte aligned.
constexpr int kRowStride = 24;
int slot_of(int matrix, int row) { return 8 * matrix + (5 * row + 3) % 8; }

// ldmatrix of kMatrices into the first registers of `regs`.
template <int kMatrices, bool kTranspose>
__device__ void ldmatrix_into(uint32_t (&regs)[4], const void* row) {
  uint32_t loaded[kMatrices];
  ptx::ldmatrix<kMatrices, kTranspose>(loaded, row);
  for (int m = 0; m < kMatrices; ++m) regs[m] = loaded[m];
}

// One warp: regs of every lane to out (32, 4); registers the instruction does not write keep
// 0xdeadbeef. Lanes whose address the instruction does not read pass nullptr.
__global__ void ldmatrix_kernel(uint32_t* out, int matrices, bool transpose) {
  DSTRAIN_DYNAMIC_SHARED(uint16_t, tile);  // (32, kRowStride)
  const int lane = threadIdx.x;
  for (int col = 0; col < 8; ++col)
    tile[slot_of(lane / 8, lane % 8) * kRowStride + col] = matrix_value(lane / 8, lane % 8, col);
  __syncwarp();
  const void* row = lane < 8 * matrices ? &tile[slot_of(lane / 8, lane % 8) * kRowStride] : nullptr;
  uint32_t regs[4] = {0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu};
  switch (2 * matrices + (transpose ? 1 : 0)) {
    case 2:
      ldmatrix_into<1, false>(regs, row);
      break;
    case 3:
      ldmatrix_into<1, true>(regs, row);
      break;
    case 4:
      ldmatrix_into<2, false>(regs, row);
      break;
    case 5:
      ldmatrix_into<2, true>(regs, row);
      break;
    case 8:
      ldmatrix_into<4, false>(regs, row);
      break;
    default:
      ldmatrix_into<4, true>(regs, row);
      break;
  }
  for (int m = 0; m < 4; ++m) out[4 * lane + m] = regs[m];
}

std::vector<uint32_t> run_ldmatrix(int matrices, bool transpose) {
  std::vector<uint32_t> out(32 * 4, 0);
  DSTRAIN_LAUNCH(ldmatrix_kernel, 1, 32, 32 * kRowStride * 2, nullptr)
  (out.data(), matrices, transpose);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return out;
}

uint32_t pack(uint16_t low, uint16_t high) { return uint32_t{low} | uint32_t{high} << 16; }

TEST(CudaEmulatorPtx, LdmatrixGivesLaneRowLaneDiv4ColumnsTwiceLaneMod4) {
  for (int matrices : {1, 2, 4}) {
    const std::vector<uint32_t> out = run_ldmatrix(matrices, false);
    for (int lane = 0; lane < 32; ++lane) {
      for (int m = 0; m < 4; ++m) {
        const uint32_t expected = m < matrices ? pack(matrix_value(m, lane / 4, 2 * (lane % 4)),
                                                      matrix_value(m, lane / 4, 2 * (lane % 4) + 1))
                                               : 0xdeadbeefu;
        EXPECT_EQ(out[4 * lane + m], expected) << ".x" << matrices << " lane " << lane << " r" << m;
      }
    }
    // From the ISA's figure: T5 holds row 1, columns 2 and 3; T31 row 7, columns 6 and 7.
    EXPECT_EQ(out[4 * 5], pack(matrix_value(0, 1, 2), matrix_value(0, 1, 3)));
    EXPECT_EQ(out[4 * 31], pack(matrix_value(0, 7, 6), matrix_value(0, 7, 7)));
  }
}

TEST(CudaEmulatorPtx, LdmatrixTransGivesTheTransposedMatrix) {
  for (int matrices : {1, 2, 4}) {
    const std::vector<uint32_t> out = run_ldmatrix(matrices, true);
    for (int lane = 0; lane < 32; ++lane) {
      for (int m = 0; m < 4; ++m) {
        const uint32_t expected = m < matrices ? pack(matrix_value(m, 2 * (lane % 4), lane / 4),
                                                      matrix_value(m, 2 * (lane % 4) + 1, lane / 4))
                                               : 0xdeadbeefu;
        EXPECT_EQ(out[4 * lane + m], expected) << ".x" << matrices << " lane " << lane << " r" << m;
      }
    }
    // T5 holds column 1, rows 2 and 3 of each matrix.
    EXPECT_EQ(out[4 * 5], pack(matrix_value(0, 2, 1), matrix_value(0, 3, 1)));
  }
}

// Lane 0 gives a row address that is not 16-byte aligned, or (global) one in device memory.
__global__ void ldmatrix_bad_address_kernel(const uint16_t* global_rows, bool use_global) {
  DSTRAIN_DYNAMIC_SHARED(uint16_t, tile);  // (8, 8)
  const int lane = threadIdx.x;
  const uint16_t* base = use_global ? global_rows : tile;
  const uint16_t* row = base + 8 * (lane % 8) + (lane == 0 && !use_global ? 1 : 0);
  uint32_t regs[1];
  ptx::ldmatrix<1>(regs, row);
}

// Half the warp in ldmatrix, half in a shuffle: not the same .sync.aligned instruction.
__global__ void ldmatrix_divergent_kernel(float* out) {
  DSTRAIN_DYNAMIC_SHARED(uint16_t, tile);  // (8, 8)
  if (threadIdx.x < 16) {
    uint32_t regs[1];
    ptx::ldmatrix<1>(regs, tile + 8 * (threadIdx.x % 8));
  } else {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
  }
}

TEST(CudaEmulatorPtx, LdmatrixMisalignedGlobalOrDivergentIsAnError) {
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 256), cudaSuccess);
  const auto* rows = static_cast<const uint16_t*>(device);
  const std::string misaligned = launch_error([&] {
    DSTRAIN_LAUNCH(ldmatrix_bad_address_kernel, 1, 32, 128, nullptr)(rows, false);
  });
  EXPECT_NE(misaligned.find("16-byte aligned"), std::string::npos) << misaligned;
  const std::string global = launch_error([&] {
    DSTRAIN_LAUNCH(ldmatrix_bad_address_kernel, 1, 32, 128, nullptr)(rows, true);
  });
  EXPECT_NE(global.find("shared-memory address"), std::string::npos) << global;
  std::vector<float> out(32, 0.0f);
  const std::string divergent = launch_error([&] {
    DSTRAIN_LAUNCH(ldmatrix_divergent_kernel, 1, 32, 128, nullptr)(out.data());
  });
  EXPECT_NE(divergent.find("ldmatrix"), std::string::npos) << divergent;
  cudaFree(device);
}

// ---- cp.async ----

// Group 0 copies src[0, 128) to tile[0, 128), group 1 src[128, 256) to tile[128, 256); each
// thread snapshots its own 2 x 4 floats of the tile before any wait, after wait_group 1, after
// wait_group 0: snapshots (3, 256).
__global__ void cp_async_groups_kernel(const float* src, float* snapshots) {
  DSTRAIN_DYNAMIC_SHARED(float, tile);  // (256): the emulator's poison (0xFF bytes) at start
  const int t = threadIdx.x;
  ptx::cp_async_cg_16(&tile[4 * t], &src[4 * t]);
  ptx::cp_async_commit_group();
  ptx::cp_async_cg_16(&tile[128 + 4 * t], &src[128 + 4 * t]);
  ptx::cp_async_commit_group();
  auto snapshot = [&](int s) {
    for (int j = 0; j < 4; ++j) {
      snapshots[256 * s + 4 * t + j] = tile[4 * t + j];
      snapshots[256 * s + 128 + 4 * t + j] = tile[128 + 4 * t + j];
    }
  };
  snapshot(0);
  ptx::cp_async_wait_group<1>();
  snapshot(1);
  ptx::cp_async_wait_group<0>();
  snapshot(2);
}

bool is_poison(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits == 0xffffffffu;
}

TEST(CudaEmulatorPtx, CpAsyncDataArrivesAtTheWaitAndWaitGroupOneLeavesTheNewestPending) {
  std::vector<float> src(256), snapshots(3 * 256, 0.0f);
  for (int i = 0; i < 256; ++i) src[i] = 1.0f + static_cast<float>(i);
  DSTRAIN_LAUNCH(cp_async_groups_kernel, 1, 32, 256 * sizeof(float), nullptr)
  (src.data(), snapshots.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < 256; ++i) {
    EXPECT_TRUE(is_poison(snapshots[i])) << "before any wait: stale, element " << i;
    if (i < 128) {
      EXPECT_EQ(snapshots[256 + i], src[i]) << "group 0 done after wait_group 1, element " << i;
    } else {
      EXPECT_TRUE(is_poison(snapshots[256 + i])) << "group 1 pending, element " << i;
    }
    EXPECT_EQ(snapshots[512 + i], src[i]) << "after wait_group 0, element " << i;
  }
}

// Per thread 64 bytes of tile: .ca 4 bytes at 0, .ca 8 at 8, .ca 16 at 16, .cg 16 with
// src-size `src_bytes` at 32, .cg 16 at 48; never committed: wait_all covers them.
// before/after: (32, 64) bytes.
__global__ void cp_async_sizes_kernel(const uint8_t* src, uint8_t* before, uint8_t* after,
                                      int src_bytes) {
  DSTRAIN_DYNAMIC_SHARED(uint8_t, tile);  // (32, 64)
  const int base = 64 * threadIdx.x;
  ptx::cp_async_ca<4>(&tile[base], &src[base]);
  ptx::cp_async_ca<8>(&tile[base + 8], &src[base + 8]);
  ptx::cp_async_ca<16>(&tile[base + 16], &src[base + 16]);
  ptx::cp_async_cg_16_zfill(&tile[base + 32], &src[base + 32], src_bytes);
  ptx::cp_async_cg_16(&tile[base + 48], &src[base + 48]);
  for (int i = 0; i < 64; ++i) before[base + i] = tile[base + i];
  ptx::cp_async_wait_all();
  for (int i = 0; i < 64; ++i) after[base + i] = tile[base + i];
}

TEST(CudaEmulatorPtx, CpAsyncSizesZeroFillAndWaitAllOfUncommittedCopies) {
  const int src_bytes = 5;
  alignas(16) static uint8_t src[32 * 64];
  for (int i = 0; i < 32 * 64; ++i) src[i] = static_cast<uint8_t>(1 + (i * 7) % 254);
  std::vector<uint8_t> before(32 * 64, 0), after(32 * 64, 0);
  DSTRAIN_LAUNCH(cp_async_sizes_kernel, 1, 32, 32 * 64, nullptr)
  (src, before.data(), after.data(), src_bytes);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < 32 * 64; ++i) {
    const int offset = i % 64;
    EXPECT_EQ(before[i], 0xFF) << "byte " << i << " before the wait";
    uint8_t expected = src[i];
    if (offset >= 4 && offset < 8) expected = 0xFF;             // no copy there
    if (offset >= 32 + src_bytes && offset < 48) expected = 0;  // zero-filled
    EXPECT_EQ(after[i], expected) << "byte " << i << " (offset " << offset << ")";
  }
}

// A 16-byte copy to shared + 4 (misaligned), or into device memory.
__global__ void cp_async_bad_address_kernel(const float* src, float* global_dst, bool global) {
  DSTRAIN_DYNAMIC_SHARED(float, tile);  // (64)
  ptx::cp_async_cg_16(global ? global_dst : &tile[1], src);
  ptx::cp_async_wait_all();
}

TEST(CudaEmulatorPtx, CpAsyncMisalignedOrIntoGlobalMemoryIsAnError) {
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 256), cudaSuccess);
  alignas(16) static float src[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  auto* global_dst = static_cast<float*>(device);
  const std::string misaligned = launch_error([&] {
    DSTRAIN_LAUNCH(cp_async_bad_address_kernel, 1, 32, 256, nullptr)(src, global_dst, false);
  });
  EXPECT_NE(misaligned.find("aligned to the copy size"), std::string::npos) << misaligned;
  const std::string global = launch_error([&] {
    DSTRAIN_LAUNCH(cp_async_bad_address_kernel, 1, 32, 256, nullptr)(src, global_dst, true);
  });
  EXPECT_NE(global.find("shared-memory address"), std::string::npos) << global;
  cudaFree(device);
}

// ---- 128-bit global accesses ----

// Thread t copies in[t] -> out[t] (default caching), in[n + t] -> out[n + t] (.cs), and the
// .lu load of in[2n + t] -> out[2n + t]: in, out (3n, 8 bf16).
__global__ void copy_128_kernel(const Bf16x8* in, Bf16x8* out, int n) {
  const int t = threadIdx.x;
  ptx::store_128(&out[t], ptx::load_128(&in[t]));
  ptx::store_128_cs(&out[n + t], ptx::load_128_cs(&in[n + t]));
  ptx::store_128(&out[2 * n + t], ptx::load_128_lu(&in[2 * n + t]));
}

TEST(CudaEmulatorPtx, Load128AndStore128RoundTripEightBf16PerThread) {
  const int n = 64;
  std::vector<Bf16x8> in(3 * n), out(3 * n);
  for (int i = 0; i < 3 * n; ++i) {
    for (int j = 0; j < 8; ++j) {
      in[i].values[j] = __float2bfloat16_rn(1.0f + static_cast<float>(8 * i + j));
      out[i].values[j] = __float2bfloat16_rn(-1.0f);
    }
  }
  DSTRAIN_LAUNCH(copy_128_kernel, 1, n, 0, nullptr)(in.data(), out.data(), n);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < 3 * n; ++i) {
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(__bfloat162float(out[i].values[j]), __bfloat162float(in[i].values[j]))
          << "vector " << i << " element " << j;
    }
  }
}

TEST(CudaEmulatorPtx, Load128OfAMisalignedAddressIsAnError) {
  alignas(16) static uint8_t bytes[16 * 8 * 4];
  const auto* misaligned = reinterpret_cast<const Bf16x8*>(bytes + 8);
  std::vector<Bf16x8> out(3);
  const std::string error = launch_error([&] {
    DSTRAIN_LAUNCH(copy_128_kernel, 1, 1, 0, nullptr)(misaligned, out.data(), 1);
  });
  EXPECT_NE(error.find("16-byte aligned"), std::string::npos) << error;
}

// ex2.approx.ftz.f32 as the ISA states it: subnormal inputs count as 0 and subnormal results
// are flushed to +0, the infinities and NaN pass through; elsewhere 2^x (to the approximation's
// accuracy: within 2 ulp of the float64 value here).
TEST(CudaEmulatorPtx, Ex2ApproxFtzFlushesSubnormals) {
  const float smallest_normal = std::ldexp(1.0f, -126);
  EXPECT_EQ(ptx::exp2_approx_ftz(std::ldexp(1.0f, -140)), 1.0f) << "subnormal input";
  EXPECT_EQ(ptx::exp2_approx_ftz(-std::ldexp(1.0f, -140)), 1.0f) << "negative subnormal input";
  EXPECT_EQ(ptx::exp2_approx_ftz(-126.0f), smallest_normal) << "the smallest normal result";
  const float flushed = ptx::exp2_approx_ftz(-126.5f);  // 2^-126.5: subnormal
  EXPECT_EQ(flushed, 0.0f);
  EXPECT_FALSE(std::signbit(flushed)) << "flushed to +0";
  EXPECT_EQ(ptx::exp2_approx_ftz(-INFINITY), 0.0f);
  EXPECT_EQ(ptx::exp2_approx_ftz(INFINITY), INFINITY);
  EXPECT_TRUE(std::isnan(ptx::exp2_approx_ftz(NAN)));
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-125.0f, 127.0f);
  for (int i = 0; i < 1000; ++i) {
    const float x = uniform(rng);
    const double exact = std::exp2(static_cast<double>(x));
    const float y = ptx::exp2_approx_ftz(x);
    EXPECT_LE(std::fabs(y - exact), 2.0 * std::ldexp(1.0, std::ilogb(exact) - 23)) << "x " << x;
  }
}

}  // namespace
