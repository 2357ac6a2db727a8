// The PTX instructions of kernels/cuda/cuda_ptx.cuh on the emulator (see emu_ptx.h): fragment
// layouts from the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point type" and
// ldmatrix sections, cp.async groups from the cp.async.commit_group / wait_group sections.
#include "kernels/cuda_emu/emu_ptx.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "core/check.h"
#include "kernels/cuda_emu/emu_runtime.h"

namespace dstrain::emu {

namespace {

// ---- element decoding: exact, every bf16 and f16 value is a float ----

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

float f16_to_float(uint16_t bits) {
  const int exponent = bits >> 10 & 0x1f;
  const int mantissa = bits & 0x3ff;
  const float sign = bits & 0x8000 ? -1.0f : 1.0f;
  if (exponent == 0x1f) return mantissa ? NAN : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  return sign * std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
}

// Element i (low half first) of a register array of packed 16-bit elements.
uint16_t element(const uint32_t* regs, int i) {
  return static_cast<uint16_t>(regs[i / 2] >> (16 * (i % 2)));
}

// ---- mma.m16n8k16: the ISA's fragment layouts (groupID = lane >> 2, tig = lane % 4) ----

struct MmaLane {      // one lane's operands, on its stack while the warp completes the mma
  const uint32_t* a;  // 4 registers: a0..a7
  const uint32_t* b;  // 2 registers: b0..b3
  float c[4];
  float d[4];
};

// A element a_i of `lane`: row groupID (+8 for i in {2,3,6,7}), column 2 * tig + (i & 1)
// (+8 for i >= 4).
void a_position(int lane, int i, int& row, int& col) {
  row = (lane >> 2) + ((i / 2) % 2 == 1 ? 8 : 0);
  col = 2 * (lane % 4) + (i & 1) + (i >= 4 ? 8 : 0);
}
// B element b_i: row 2 * tig + (i & 1) (+8 for i >= 2), column groupID.
void b_position(int lane, int i, int& row, int& col) {
  row = 2 * (lane % 4) + (i & 1) + (i >= 2 ? 8 : 0);
  col = lane >> 2;
}
// C/D element c_i: row groupID (+8 for i >= 2), column 2 * tig + (i & 1).
void c_position(int lane, int i, int& row, int& col) {
  row = (lane >> 2) + (i >= 2 ? 8 : 0);
  col = 2 * (lane % 4) + (i & 1);
}

// The warp's matrices gathered from its lanes' fragments.
struct MmaTile {
  float a[16][16], b[16][8], c[16][8];
};

template <MmaInput kInput>
float decode(uint16_t bits) {
  return kInput == MmaInput::kBf16 ? bf16_to_float(bits) : f16_to_float(bits);
}

template <MmaInput kInput>
void gather(MmaLane* const lanes[32], MmaTile& tile) {
  int row, col;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      a_position(lane, i, row, col);
      tile.a[row][col] = decode<kInput>(element(lanes[lane]->a, i));
    }
    for (int i = 0; i < 4; ++i) {
      b_position(lane, i, row, col);
      tile.b[row][col] = decode<kInput>(element(lanes[lane]->b, i));
      c_position(lane, i, row, col);
      tile.c[row][col] = lanes[lane]->c[i];
    }
  }
}

// D[row][col] = C first, then k ascending, in fp32 (each product is exact in fp32: at most
// 11 + 11 significant bits and an exponent well inside fp32's range).
float dot_accumulate(const MmaTile& tile, int row, int col) {
  float sum = tile.c[row][col];
  for (int k = 0; k < 16; ++k) sum += tile.a[row][k] * tile.b[k][col];
  return sum;
}

template <MmaInput kInput>
void complete_mma(void* const lane_data[32]) {
  MmaLane* lanes[32];
  for (int l = 0; l < 32; ++l) lanes[l] = static_cast<MmaLane*>(lane_data[l]);
  MmaTile tile;
  gather<kInput>(lanes, tile);
  int row, col;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      c_position(lane, i, row, col);
      lanes[lane]->d[i] = dot_accumulate(tile, row, col);
    }
  }
}

// ---- ldmatrix ----

struct LdmatrixLane {
  const void* row_address;  // row (lane % 8) of matrix (lane / 8)
  uint32_t regs[4];
};

std::string address_text(const void* address) {
  std::ostringstream out;
  out << address;
  return out.str();
}

// Shared memory is neither a device allocation nor pinned host memory: catches a global
// pointer passed where the instruction reads or writes .shared.
void check_shared(const void* address, size_t bytes, const char* what) {
  DSTRAIN_CHECK(allocation_device(address, bytes) == kNotAllocated)
      << "CUDA emulator: " << what << " with address " << address
      << " in device (global) or pinned memory: it takes a shared-memory address";
}

void check_row_address(const void* address, int lane, const char* what) {
  DSTRAIN_CHECK(address != nullptr && reinterpret_cast<uintptr_t>(address) % 16 == 0)
      << "CUDA emulator: " << what << ": lane " << lane << " gives row address "
      << address_text(address) << ", not a 16-byte aligned address of an 8-element row";
  check_shared(address, 16, what);
}

// Element `col` of the row that `lane` addresses.
uint16_t row_element(LdmatrixLane* const lanes[32], int lane, int col) {
  uint16_t value;
  std::memcpy(&value, static_cast<const char*>(lanes[lane]->row_address) + 2 * col, 2);
  return value;
}

constexpr const char* ldmatrix_name(int matrices, bool transpose) {
  switch (matrices) {
    case 1:
      return transpose ? "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16"
                       : "ldmatrix.sync.aligned.m8n8.x1.shared.b16";
    case 2:
      return transpose ? "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16"
                       : "ldmatrix.sync.aligned.m8n8.x2.shared.b16";
    default:
      return transpose ? "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
                       : "ldmatrix.sync.aligned.m8n8.x4.shared.b16";
  }
}

template <int kMatrices, bool kTranspose>
void complete_ldmatrix(void* const lane_data[32]) {
  LdmatrixLane* lanes[32];
  for (int l = 0; l < 32; ++l) lanes[l] = static_cast<LdmatrixLane*>(lane_data[l]);
  const char* what = ldmatrix_name(kMatrices, kTranspose);
  for (int l = 0; l < 8 * kMatrices; ++l) check_row_address(lanes[l]->row_address, l, what);
  for (int lane = 0; lane < 32; ++lane) {
    for (int m = 0; m < kMatrices; ++m) {
      const int first = 8 * m;  // the lanes holding matrix m's row addresses
      uint16_t low, high;
      if (kTranspose) {  // column lane / 4 of rows 2 * (lane % 4) and + 1
        low = row_element(lanes, first + 2 * (lane % 4), lane / 4);
        high = row_element(lanes, first + 2 * (lane % 4) + 1, lane / 4);
      } else {  // row lane / 4, columns 2 * (lane % 4) and + 1
        low = row_element(lanes, first + lane / 4, 2 * (lane % 4));
        high = row_element(lanes, first + lane / 4, 2 * (lane % 4) + 1);
      }
      lanes[lane]->regs[m] = uint32_t{low} | uint32_t{high} << 16;
    }
  }
}

template <int kMatrices>
WarpComplete ldmatrix_completion(bool transpose) {
  return transpose ? complete_ldmatrix<kMatrices, true> : complete_ldmatrix<kMatrices, false>;
}

// ---- cp.async ----

void perform(const AsyncCopy& copy) {
  std::memcpy(copy.dst, copy.src, copy.src_bytes);
  std::memset(static_cast<char*>(copy.dst) + copy.src_bytes, 0, copy.copy_bytes - copy.src_bytes);
}

void perform_oldest_group(AsyncCopies& copies) {
  for (const AsyncCopy& copy : copies.committed.front()) perform(copy);
  copies.committed.pop_front();
}

}  // namespace

void mma_m16n8k16(MmaInput input, float d[4], const uint32_t a[4], const uint32_t b[2],
                  const float c[4]) {
  MmaLane lane{a, b, {c[0], c[1], c[2], c[3]}, {}};
  if (input == MmaInput::kBf16) {
    warp_collective(&lane, complete_mma<MmaInput::kBf16>,
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32");
  } else {
    warp_collective(&lane, complete_mma<MmaInput::kF16>,
                    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32");
  }
  for (int i = 0; i < 4; ++i) d[i] = lane.d[i];
}

void ldmatrix(int matrices, bool transpose, uint32_t regs[], const void* row_address) {
  DSTRAIN_CHECK(matrices == 1 || matrices == 2 || matrices == 4)
      << "CUDA emulator: ldmatrix of " << matrices << " matrices (.x1, .x2 or .x4)";
  // One completion per shape and .trans: lanes that disagree on them are an error.
  const WarpComplete complete = matrices == 1   ? ldmatrix_completion<1>(transpose)
                                : matrices == 2 ? ldmatrix_completion<2>(transpose)
                                                : ldmatrix_completion<4>(transpose);
  LdmatrixLane lane{row_address, {}};
  warp_collective(&lane, complete, ldmatrix_name(matrices, transpose));
  for (int m = 0; m < matrices; ++m) regs[m] = lane.regs[m];
}

void cp_async(void* shared_dst, const void* global_src, int copy_bytes, int src_bytes,
              const char* what) {
  DSTRAIN_CHECK(copy_bytes == 4 || copy_bytes == 8 || copy_bytes == 16)
      << "CUDA emulator: " << what << " of " << copy_bytes << " bytes (4, 8 or 16)";
  DSTRAIN_CHECK(src_bytes >= 0 && src_bytes <= copy_bytes)
      << "CUDA emulator: " << what << " with src-size " << src_bytes << " outside [0, "
      << copy_bytes << "]";
  const auto aligned = [&](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(copy_bytes) == 0;
  };
  DSTRAIN_CHECK(shared_dst != nullptr && aligned(shared_dst) && aligned(global_src))
      << "CUDA emulator: " << what << " of " << copy_bytes << " bytes from " << global_src << " to "
      << shared_dst << ": both addresses must be aligned to the copy size";
  check_shared(shared_dst, copy_bytes, what);
  async_copies().uncommitted.push_back({shared_dst, global_src, copy_bytes, src_bytes});
}

void cp_async_commit_group() {
  AsyncCopies& copies = async_copies();
  copies.committed.push_back(std::move(copies.uncommitted));
  copies.uncommitted.clear();
}

void cp_async_wait_group(int n) {
  DSTRAIN_CHECK(n >= 0) << "CUDA emulator: cp.async.wait_group " << n;
  AsyncCopies& copies = async_copies();
  while (copies.committed.size() > static_cast<size_t>(n)) perform_oldest_group(copies);
}

void cp_async_wait_all() {
  cp_async_commit_group();
  cp_async_wait_group(0);
}

float ex2_approx_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

void finish_async_copies(AsyncCopies& copies) {
  while (!copies.committed.empty()) perform_oldest_group(copies);
  for (const AsyncCopy& copy : copies.uncommitted) perform(copy);
  copies.uncommitted.clear();
}

void check_vector_address(const void* address, const char* what) {
  DSTRAIN_CHECK(address != nullptr && reinterpret_cast<uintptr_t>(address) % 16 == 0)
      << "CUDA emulator: " << what << " at " << address_text(address)
      << ": a 128-bit access needs a 16-byte aligned address (misaligned address on a GPU)";
}

}  // namespace dstrain::emu
