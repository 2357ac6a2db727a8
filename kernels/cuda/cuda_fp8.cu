// The FP8 cast (kernels/ops.h: fp8_quantize) on the GPU; the FP8 GEMM is in cuda_matmul.cu.
//
// Three launches on the stream: a memset of the amax word (scale_inv's own
// storage), the amax (each block's maximum by warp butterflies, then one atomicMax on the bits:
// magnitudes are non-negative floats, whose order is their bits' order, and a NaN's bits are
// above infinity's, so a NaN wins as the twin's does; a maximum is the same in any order), and
// the cast, which computes the power-of-two scale from that word in every block, casts through
// the toolkit's __nv_cvt_float_to_fp8 with __NV_SATFINITE (cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32
// on sm_89 and later, the toolkit's own exact software conversion before sm_89 and on the
// emulator) and transposes through a shared-memory tile when asked. A last one-thread launch
// turns the word into scale_inv = 1 / s, after every block has read it.

#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "core/fp8.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/fp8_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kTile = 32;     // the cast's tile: kTile x kTile elements
constexpr int kTileRows = 8;  // a block is kTile x kTileRows threads, 4 elements each
constexpr int kAmaxThreads = 256;

__device__ __forceinline__ unsigned float_bits_of(float value) {
  unsigned bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}
__device__ __forceinline__ float float_of_bits(unsigned bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

// max |inp| into *amax_bits (which holds 0 or a smaller magnitude's bits).
__global__ void fp8_amax_kernel(DeviceTensor inp, int64_t n, unsigned* amax_bits) {
  unsigned local = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    local = max(local, float_bits_of(load(inp, i)) & 0x7fffffffu);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    local = max(local, __shfl_xor_sync(0xffffffffu, local, offset));
  }
  __shared__ unsigned warp_max[kAmaxThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned block = 0;
    for (int w = 0; w < kAmaxThreads / 32; ++w) block = max(block, warp_max[w]);
    if (block != 0) atomicMax(amax_bits, block);
  }
}

// core/fp8.h's fp8_scale_for_amax from the amax's bits: 2^(e_max - e_amax), one less where
// amax's significand is above the format's largest finite value's; 1 for 0, infinity or NaN;
// at most 2^126 (every fp32 subnormal amax).
__device__ __forceinline__ float scale_for_amax_bits(unsigned amax, unsigned max_bits) {
  if (amax == 0 || amax >= 0x7f800000u) return 1.0f;
  if (amax < 0x00800000u) return float_of_bits(253u << 23);  // 2^126
  int power = static_cast<int>(max_bits >> 23) - static_cast<int>(amax >> 23) -
              ((amax & 0x7fffffu) > (max_bits & 0x7fffffu) ? 1 : 0);
  power = min(power, 126);
  return float_of_bits(static_cast<unsigned>(power + 127) << 23);
}

// out (rows, cols), or (cols, rows) when `transpose`, = fp8(inp * s); one kTile x kTile tile
// per block, staged in shared memory so that both the reads and the (transposed) writes are
// row-contiguous.
__global__ void fp8_cast_kernel(uint8_t* out, DeviceTensor inp, int64_t rows, int64_t cols,
                                const unsigned* amax_bits, unsigned max_bits,
                                __nv_fp8_interpretation_t format, bool transpose) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float scale = scale_for_amax_bits(*amax_bits, max_bits);
  const int64_t row0 = int64_t{blockIdx.y} * kTile, col0 = int64_t{blockIdx.x} * kTile;
  for (int r = threadIdx.y; r < kTile; r += kTileRows) {
    const int64_t row = row0 + r, col = col0 + threadIdx.x;
    if (row < rows && col < cols) {
      tile[r][threadIdx.x] =
          __nv_cvt_float_to_fp8(load(inp, row * cols + col) * scale, __NV_SATFINITE, format);
    }
  }
  __syncthreads();
  for (int r = threadIdx.y; r < kTile; r += kTileRows) {
    if (transpose) {  // out row (col0 + r), columns row0 + threadIdx.x
      const int64_t row = row0 + threadIdx.x, col = col0 + r;
      if (row < rows && col < cols) out[col * rows + row] = tile[threadIdx.x][r];
    } else {
      const int64_t row = row0 + r, col = col0 + threadIdx.x;
      if (row < rows && col < cols) out[row * cols + col] = tile[r][threadIdx.x];
    }
  }
}

// The amax word, read by every cast block, becomes scale_inv = 1 / s.
__global__ void fp8_scale_inv_kernel(unsigned* word, unsigned max_bits) {
  const float scale = scale_for_amax_bits(*word, max_bits);
  const float inverse = 1.0f / scale;
  memcpy(word, &inverse, sizeof inverse);
}

unsigned host_float_bits(float value) {
  unsigned bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

}  // namespace

void fp8_quantize(const CudaContext& ctx, Tensor out, Tensor scale_inv, Tensor inp, bool transpose,
                  cudaStream_t stream) {
  const RowShape s = check_fp8_quantize(out, scale_inv, inp, transpose);
  check_float_tensor(ctx, inp, "fp8_quantize inp");
  check_tensor_dtype(ctx, scale_inv, DType::F32, "fp8_quantize scale_inv");
  check_tensor_dtype(ctx, out, out.dtype, "fp8_quantize out");
  auto* word = static_cast<unsigned*>(scale_inv.data);
  const Fp8Format format = fp8_format(out.dtype);
  const unsigned max_bits = host_float_bits(fp8_layout(format).max);
  const __nv_fp8_interpretation_t kind = format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(unsigned), stream));
  const int64_t n = s.rows * s.cols;
  if (n > 0) {
    const int blocks = static_cast<int>(
        std::min<int64_t>((n + kAmaxThreads - 1) / kAmaxThreads, int64_t{ctx.sm_count} * 8));
    DSTRAIN_LAUNCH(fp8_amax_kernel, blocks, kAmaxThreads, 0, stream)
    (device_tensor(inp), n, word);
    CUDA_CHECK(cudaGetLastError());
    const dim3 grid(static_cast<unsigned>((s.cols + kTile - 1) / kTile),
                    static_cast<unsigned>((s.rows + kTile - 1) / kTile));
    DSTRAIN_LAUNCH(fp8_cast_kernel, grid, dim3(kTile, kTileRows), 0, stream)
    (static_cast<uint8_t*>(out.data), device_tensor(inp), s.rows, s.cols, word, max_bits, kind,
     transpose);
    CUDA_CHECK(cudaGetLastError());
  }
  DSTRAIN_LAUNCH(fp8_scale_inv_kernel, 1, 1, 0, stream)(word, max_bits);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace dstrain::cuda
