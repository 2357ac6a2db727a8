// The FP8 cast (kernels/ops.h: fp8_quantize) on the GPU; the FP8 GEMM is in cuda_matmul.cu.
//
// Four launches on the stream: a memset of the amax word (scale_inv's own storage), the amax
// (each block's maximum by warp butterflies, then one atomicMax on the bits: magnitudes are
// non-negative floats, whose order is their bits' order, and a NaN's bits are above infinity's,
// so a NaN wins as the twin's does; a maximum is the same in any order), the cast, which
// computes the power-of-two scale from that word in every block and casts through the
// toolkit's __nv_cvt_float_to_fp8 with __NV_SATFINITE (cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 on
// sm_89 and later, the toolkit's own exact software conversion before sm_89 and on the
// emulator), and a one-thread launch that turns the word into scale_inv = 1 / s after every
// block has read it. With the amax given (an F32 whose bits are the word) the first two are
// not needed; fp8_amax is those two alone.
//
// The amax and the cast move 128 bits at a time (cuda_vector.cuh: 8 elements a load; the cast
// stores 16 FP8 bytes at once): on an H100 the first, scalar, kernels reached 18% of the copy
// peak (benchmarks/RESULTS.md). The transposed cast stages a 64 x 64 tile in shared memory so
// that its reads run along the input's rows and its 16-byte stores along the output's; asked
// for both copies, it also stores the straight one from its registers (8 bytes a store), so
// the input is read once for both. Shapes or pointers these cannot take (a misaligned pointer;
// transposed, rows not a multiple of 16 or columns not of 8) take the scalar kernels, which
// give the same bytes.

#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "core/fp8.h"
#include "kernels/cuda/cuda_amax.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_vector.cuh"
#include "kernels/fp8_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kTile = 32;     // the scalar cast's tile: kTile x kTile elements
constexpr int kTileRows = 8;  // a block is kTile x kTileRows threads, 4 elements each
constexpr int kAmaxThreads = 256;
constexpr int kCastThreads = 256;   // the vector casts' blocks
constexpr int kCastElements = 16;   // the vector cast: 16 elements, one 16-byte store
constexpr int kWideTile = 64;       // the transposed vector cast's tile: 64 x 64 elements
constexpr int kWideTilePitch = 68;  // its shared rows' bytes (4-byte aligned, 2-way conflicts)

// max |inp| into *amax_bits (which holds 0 or a smaller magnitude's bits).
__global__ void fp8_amax_kernel(DeviceTensor inp, int64_t n, unsigned* amax_bits) {
  unsigned local = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    local = max(local, magnitude_bits(load(inp, i)));
  }
  block_amax<kAmaxThreads>(local, amax_bits);
}

// The same, 8 elements a 128-bit load (inp 16-byte aligned), the n % 8 last ones one at a time.
template <class T>
__global__ void fp8_amax_wide_kernel(const T* inp, int64_t n, unsigned* amax_bits) {
  unsigned local = 0;
  const int64_t vectors = n / kVectorElements;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < vectors;
       v += int64_t{gridDim.x} * blockDim.x) {
    float values[kVectorElements];
    load_vector(inp + v * kVectorElements, values);
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      local = max(local, magnitude_bits(values[j]));
    }
  }
  const int64_t tail = vectors * kVectorElements + blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (tail < n) local = max(local, magnitude_bits(to_float(inp[tail])));
  block_amax<kAmaxThreads>(local, amax_bits);
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

// out (rows, cols) and/or out_t (cols, rows) = fp8(inp * s) (a null one skipped); one kTile x
// kTile tile per block, staged in shared memory so that both the reads and the (transposed)
// writes are row-contiguous.
__global__ void fp8_cast_kernel(uint8_t* out, uint8_t* out_t, DeviceTensor inp, int64_t rows,
                                int64_t cols, const unsigned* amax_bits, unsigned max_bits,
                                __nv_fp8_interpretation_t format) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float scale = scale_for_amax_bits(*amax_bits, max_bits);
  const int64_t row0 = int64_t{blockIdx.y} * kTile, col0 = int64_t{blockIdx.x} * kTile;
  for (int r = threadIdx.y; r < kTile; r += kTileRows) {
    const int64_t row = row0 + r, col = col0 + threadIdx.x;
    if (row < rows && col < cols) {
      const uint8_t byte =
          __nv_cvt_float_to_fp8(load(inp, row * cols + col) * scale, __NV_SATFINITE, format);
      tile[r][threadIdx.x] = byte;
      if (out != nullptr) out[row * cols + col] = byte;
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  for (int r = threadIdx.y; r < kTile; r += kTileRows) {  // out_t row (col0 + r)
    const int64_t row = row0 + threadIdx.x, col = col0 + r;
    if (row < rows && col < cols) out_t[col * rows + row] = tile[threadIdx.x][r];
  }
}

// The saturating cast of one value, already scaled, to the format's byte.
__device__ __forceinline__ uint8_t fp8_byte(float scaled, __nv_fp8_interpretation_t format) {
  return __nv_cvt_float_to_fp8(scaled, __NV_SATFINITE, format);
}

// The bytes of v[0..4) * scale, v[0]'s the lowest: two paired conversions (one
// cvt.rn.satfinite.*x2.f32 each on sm_89+; the .x of the pair is the low byte).
__device__ __forceinline__ uint32_t fp8_word(const float* v, float scale,
                                             __nv_fp8_interpretation_t format) {
  const uint32_t low =
      __nv_cvt_float2_to_fp8x2(make_float2(v[0] * scale, v[1] * scale), __NV_SATFINITE, format);
  const uint32_t high =
      __nv_cvt_float2_to_fp8x2(make_float2(v[2] * scale, v[3] * scale), __NV_SATFINITE, format);
  return low | high << 16;
}

// 16 bytes of FP8 (4 words, the lowest byte first): what one 128-bit store moves.
struct alignas(16) Fp8Pack {
  uint32_t words[kCastElements / 4];
};

// out[0, n) = fp8(inp * s), 16 elements a thread (two 128-bit loads of bf16/f16, four of fp32,
// one 128-bit store); the n % 16 last ones one at a time. inp and out 16-byte aligned.
template <class T>
__global__ void fp8_cast_vector_kernel(uint8_t* out, const T* inp, int64_t n,
                                       const unsigned* amax_bits, unsigned max_bits,
                                       __nv_fp8_interpretation_t format) {
  const float scale = scale_for_amax_bits(*amax_bits, max_bits);
  const int64_t packs = n / kCastElements;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < packs;
       p += int64_t{gridDim.x} * blockDim.x) {
    Fp8Pack pack;
#pragma unroll
    for (int half = 0; half < kCastElements / kVectorElements; ++half) {
      float values[kVectorElements];
      load_vector(inp + p * kCastElements + half * kVectorElements, values);
      pack.words[2 * half] = fp8_word(values, scale, format);
      pack.words[2 * half + 1] = fp8_word(values + 4, scale, format);
    }
    store_128(reinterpret_cast<Fp8Pack*>(out) + p, pack);
  }
  const int64_t tail = packs * kCastElements + blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (tail < n) out[tail] = fp8_byte(to_float(inp[tail]) * scale, format);
}

// out_t (cols, rows) = fp8(inp (rows, cols) * s)^T through a 64 x 64 tile per block: each
// thread casts 8 elements of an input row a pass (one or two 128-bit loads) into the shared
// tile, and into out (rows, cols) with one 64-bit store where out is not null, then gathers 16
// of a tile column, 16 input rows, into one 128-bit store along an out_t row.
// REQUIRES: rows % 16 == 0, cols % 8 == 0, inp and out_t (and out) 16-byte aligned.
template <class T>
__global__ void fp8_cast_transpose_vector_kernel(uint8_t* out, uint8_t* out_t, const T* inp,
                                                 int64_t rows, int64_t cols,
                                                 const unsigned* amax_bits, unsigned max_bits,
                                                 __nv_fp8_interpretation_t format) {
  __shared__ uint32_t tile_words[kWideTile * kWideTilePitch / 4];
  auto* tile = reinterpret_cast<uint8_t*>(tile_words);
  const float scale = scale_for_amax_bits(*amax_bits, max_bits);
  const int64_t row0 = int64_t{blockIdx.y} * kWideTile, col0 = int64_t{blockIdx.x} * kWideTile;
  constexpr int kChunks = kWideTile / kVectorElements;  // 8-element chunks in a tile row
  for (int r = threadIdx.x / kChunks; r < kWideTile; r += kCastThreads / kChunks) {
    const int c = threadIdx.x % kChunks * kVectorElements;
    const int64_t row = row0 + r, col = col0 + c;
    if (row >= rows || col >= cols) continue;
    float values[kVectorElements];
    load_vector(inp + row * cols + col, values);
    const uint2 words =
        make_uint2(fp8_word(values, scale, format), fp8_word(values + 4, scale, format));
    auto* at = reinterpret_cast<uint32_t*>(tile + r * kWideTilePitch + c);
    at[0] = words.x;
    at[1] = words.y;
    if (out != nullptr) *reinterpret_cast<uint2*>(out + row * cols + col) = words;
  }
  __syncthreads();
  constexpr int kRowChunks = kWideTile / kCastElements;  // 16-row chunks in a tile column
  static_assert(kWideTile * kRowChunks == kCastThreads, "a thread a 16-byte store");
  const int c = threadIdx.x / kRowChunks, r = threadIdx.x % kRowChunks * kCastElements;
  const int64_t out_row = col0 + c, out_col = row0 + r;
  if (out_row >= cols || out_col >= rows) return;
  Fp8Pack pack{};
#pragma unroll
  for (int j = 0; j < kCastElements; ++j) {
    pack.words[j / 4] |= uint32_t{tile[(r + j) * kWideTilePitch + c]} << (8 * (j % 4));
  }
  store_128(reinterpret_cast<Fp8Pack*>(out_t + out_row * rows + out_col), pack);
}

// After every cast block has read the amax word: scale_inv = 1 / s (scale_inv may be the word).
__global__ void fp8_scale_inv_kernel(const unsigned* amax_bits, float* scale_inv,
                                     unsigned max_bits) {
  *scale_inv = 1.0f / scale_for_amax_bits(*amax_bits, max_bits);
}

// What the amax and cast launches of one fp8_quantize share.
struct Fp8Launch {
  const CudaContext& ctx;
  cudaStream_t stream;
  uint8_t* out;    // (rows, cols), or null
  uint8_t* out_t;  // (cols, rows), or null
  Tensor inp;
  RowShape shape;
  unsigned* word;
  unsigned max_bits;
  __nv_fp8_interpretation_t kind;

  int64_t n() const { return shape.rows * shape.cols; }
  // inp and the copies 16-byte aligned (a null copy is).
  bool aligned() const {
    return vector_aligned(inp.data) && vector_aligned(out) && vector_aligned(out_t);
  }
  // A grid-stride launch over `items`: a block at least, at most 8 a multiprocessor.
  int blocks(int64_t items, int threads) const {
    return static_cast<int>(std::min<int64_t>(std::max<int64_t>(1, ceil_div(items, threads)),
                                              int64_t{ctx.sm_count} * 8));
  }
};

template <class T>
void launch_amax(const Fp8Launch& l) {
  if (l.aligned()) {
    DSTRAIN_LAUNCH(fp8_amax_wide_kernel<T>, l.blocks(l.n() / kVectorElements, kAmaxThreads),
                   kAmaxThreads, 0, l.stream)
    (static_cast<const T*>(l.inp.data), l.n(), l.word);
  } else {
    DSTRAIN_LAUNCH(fp8_amax_kernel, l.blocks(l.n(), kAmaxThreads), kAmaxThreads, 0, l.stream)
    (device_tensor(l.inp), l.n(), l.word);
  }
  CUDA_CHECK(cudaGetLastError());
}

template <class T>
void launch_cast(const Fp8Launch& l) {
  const auto* inp = static_cast<const T*>(l.inp.data);
  const int64_t rows = l.shape.rows, cols = l.shape.cols;
  if (l.aligned() && l.out_t == nullptr) {
    DSTRAIN_LAUNCH(fp8_cast_vector_kernel<T>, l.blocks(l.n() / kCastElements, kCastThreads),
                   kCastThreads, 0, l.stream)
    (l.out, inp, l.n(), l.word, l.max_bits, l.kind);
  } else if (l.aligned() && rows % kCastElements == 0 && cols % kVectorElements == 0) {
    const dim3 grid(ceil_div(cols, kWideTile), ceil_div(rows, kWideTile));
    DSTRAIN_LAUNCH(fp8_cast_transpose_vector_kernel<T>, grid, kCastThreads, 0, l.stream)
    (l.out, l.out_t, inp, rows, cols, l.word, l.max_bits, l.kind);
  } else {
    const dim3 grid(ceil_div(cols, kTile), ceil_div(rows, kTile));
    DSTRAIN_LAUNCH(fp8_cast_kernel, grid, dim3(kTile, kTileRows), 0, l.stream)
    (l.out, l.out_t, device_tensor(l.inp), rows, cols, l.word, l.max_bits, l.kind);
  }
  CUDA_CHECK(cudaGetLastError());
}

unsigned host_float_bits(float value) {
  unsigned bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

}  // namespace

void fp8_quantize(const CudaContext& ctx, Tensor out, Tensor out_t, Tensor scale_inv, Tensor inp,
                  Tensor amax, cudaStream_t stream) {
  const RowShape s = check_fp8_quantize(out, out_t, scale_inv, inp, amax);
  check_float_tensor(ctx, inp, "fp8_quantize inp");
  check_tensor_dtype(ctx, scale_inv, DType::F32, "fp8_quantize scale_inv");
  if (!out.empty()) check_tensor_dtype(ctx, out, out.dtype, "fp8_quantize out");
  if (!out_t.empty()) check_tensor_dtype(ctx, out_t, out_t.dtype, "fp8_quantize out_t");
  const bool known = !amax.empty();
  if (known) check_tensor_dtype(ctx, amax, DType::F32, "fp8_quantize amax");
  // The amax word: the given amax, or found into scale_inv's own storage.
  auto* word = static_cast<unsigned*>(known ? amax.data : scale_inv.data);
  const Fp8Format format = fp8_format(out.empty() ? out_t.dtype : out.dtype);
  const unsigned max_bits = host_float_bits(fp8_layout(format).max);
  const __nv_fp8_interpretation_t kind = format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  if (!known) CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(unsigned), stream));
  if (s.rows * s.cols > 0) {
    const Fp8Launch launch{ctx,
                           stream,
                           static_cast<uint8_t*>(out.data),
                           static_cast<uint8_t*>(out_t.data),
                           inp,
                           s,
                           word,
                           max_bits,
                           kind};
    with_storage_type(inp.dtype, [&](auto type) {
      if (!known) launch_amax<decltype(type)>(launch);
      launch_cast<decltype(type)>(launch);
    });
  }
  DSTRAIN_LAUNCH(fp8_scale_inv_kernel, 1, 1, 0, stream)(word, scale_inv.f32(), max_bits);
  CUDA_CHECK(cudaGetLastError());
}

void fp8_amax(const CudaContext& ctx, Tensor amax, Tensor inp, cudaStream_t stream) {
  check_fp8_amax(amax, inp);
  check_float_tensor(ctx, inp, "fp8_amax inp");
  check_tensor_dtype(ctx, amax, DType::F32, "fp8_amax amax");
  auto* word = static_cast<unsigned*>(amax.data);
  CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(unsigned), stream));
  const RowShape s = row_shape(inp);
  if (s.rows * s.cols == 0) return;
  const Fp8Launch launch{ctx, stream, nullptr, nullptr, inp, s, word, 0, __NV_E4M3};
  with_storage_type(inp.dtype, [&](auto type) { launch_amax<decltype(type)>(launch); });
}

}  // namespace dstrain::cuda
