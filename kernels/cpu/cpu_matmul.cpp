// CPU matmul: OpenBLAS sgemm on a fixed tile grid.
//
// Why tiles: OpenBLAS's multi-threaded sgemm does not give the same bits as its
// single-threaded one (it splits K differently; see Matmul.OpenBlasThreadCountChangesBits), so
// OpenBLAS runs with 1 thread and OpenMP threads over output tiles whose grid depends only on
// the shape. Every output element is computed by one single-threaded sgemm call of the same
// shape whatever the thread count, so results are bitwise independent of it.
//
// F16/BF16 operands are converted once per call to fp32 scratch (F32 ones are used in place);
// a non-F32 output tile is computed in fp32 scratch and rounded once when stored. FP8 operands
// (matmul_fp8) are decoded to fp32, the first with both scale_invs folded in: powers of two, so
// every product stays the exact product of the FP8 values, scaled.
#include <cblas.h>

#include <climits>
#include <vector>

#include "core/fp8.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/fp8_checks.h"

namespace dstrain::cpu {

namespace {

// Tile of the output computed by one sgemm call: large enough that OpenBLAS's packing and
// call overhead stay small (256 x 256 tiles ran at 89-93% of one whole-matrix sgemm at GPT-2
// block shapes on one core), small enough that (1024, 768) outputs still give 12 tasks.
constexpr int64_t kTileRows = 256;
constexpr int64_t kTileCols = 256;
constexpr int64_t kBiasColumnBlock = 256;

// op(X) of a row-major fp32 matrix: `data` holds X with leading dimension `ld`;
// when `transposed`, the logical matrix is X^T.
struct Operand {
  const float* data;
  int64_t ld;
  bool transposed;
};

// c (M,N) = op(a) (M,K) @ op(b) (K,N) [+ bias (N)], or c += op(a) @ op(b) when `accumulate`.
void tiled_gemm(const CpuContext& ctx, const Tensor& c, int64_t M, int64_t N, int64_t K, Operand a,
                Operand b, const float* bias, bool accumulate) {
  if (M == 0 || N == 0) return;
  DSTRAIN_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && a.ld <= INT_MAX && b.ld <= INT_MAX)
      << "matmul (" << M << ", " << N << ", " << K << ") too large for 32-bit BLAS";
  const int64_t tile_rows = (M + kTileRows - 1) / kTileRows;
  const int64_t tile_cols = (N + kTileCols - 1) / kTileCols;
  const bool direct = c.dtype == DType::F32;
  ThreadScratch scratch(ctx, direct ? 0 : kTileRows * kTileCols);
  parallel_for(ctx, tile_rows * tile_cols, [&](int64_t tile, int thread) {
    const int64_t i0 = (tile / tile_cols) * kTileRows, j0 = (tile % tile_cols) * kTileCols;
    const int64_t rows = std::min(kTileRows, M - i0), cols = std::min(kTileCols, N - j0);
    const float* a_tile = a.transposed ? a.data + i0 : a.data + i0 * a.ld;
    const float* b_tile = b.transposed ? b.data + j0 * b.ld : b.data + j0;
    float* c_tile;
    int64_t ldc;
    float beta;
    if (direct) {
      c_tile = static_cast<float*>(c.data) + i0 * N + j0;
      ldc = N;
      beta = accumulate ? 1.0f : 0.0f;
    } else {
      c_tile = scratch.get(thread);
      ldc = cols;
      beta = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, a.transposed ? CblasTrans : CblasNoTrans,
                b.transposed ? CblasTrans : CblasNoTrans, static_cast<int>(rows),
                static_cast<int>(cols), static_cast<int>(K), 1.0f, a_tile, static_cast<int>(a.ld),
                b_tile, static_cast<int>(b.ld), beta, c_tile, static_cast<int>(ldc));
    // Epilogue on the tile while it is in cache: bias, then rounding to the storage dtype.
    for (int64_t i = 0; i < rows; ++i) {
      float* row = c_tile + i * ldc;
      if (bias) {
        for (int64_t j = 0; j < cols; ++j) row[j] += bias[j0 + j];
      }
      if (direct) continue;
      const int64_t offset = (i0 + i) * N + j0;
      if (accumulate) {
        accumulate_span(c, offset, cols, row);
      } else {
        commit_span(c, offset, cols, row);
      }
    }
  });
}

struct MatmulShape {
  int64_t N, C, OC;
};

// Checks inp (N,C), weight (C,OC) or (OC,C), and returns the sizes.
MatmulShape check_matmul(const Tensor& inp, const Tensor& weight, bool weight_out_by_in) {
  check_float_tensor(inp, "matmul inp");
  check_float_tensor(weight, "matmul weight");
  DSTRAIN_CHECK(weight.ndim == 2) << "matmul weight " << weight.shape_str() << " must be 2-D";
  const int64_t C = cols_of(inp);
  const int64_t weight_in = weight_out_by_in ? weight.shape[1] : weight.shape[0];
  const int64_t OC = weight_out_by_in ? weight.shape[0] : weight.shape[1];
  DSTRAIN_CHECK(C > 0 && weight_in == C)
      << "matmul inp " << inp.shape_str() << " does not match weight " << weight.shape_str()
      << (weight_out_by_in ? " (OC, C)" : " (C, OC)");
  return {rows_of(inp), C, OC};
}

void check_rows_cols(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  check_float_tensor(t, name);
  DSTRAIN_CHECK(cols_of(t) == cols && rows_of(t) == rows)
      << name << " " << t.shape_str() << " must be (" << rows << ", " << cols << ")";
}

// dsum (OC) += column sums of dy (N,OC) F32, rows in order, one task per column block.
void column_sums(const CpuContext& ctx, Tensor dsum, const float* dy, int64_t N, int64_t OC) {
  const int64_t blocks = (OC + kBiasColumnBlock - 1) / kBiasColumnBlock;
  ThreadScratch scratch(ctx, kBiasColumnBlock);
  parallel_for(ctx, blocks, [&](int64_t block, int thread) {
    const int64_t j0 = block * kBiasColumnBlock, width = std::min(kBiasColumnBlock, OC - j0);
    float* sum = scratch.get(thread);
    std::fill(sum, sum + width, 0.0f);
    for (int64_t n = 0; n < N; ++n) {
      const float* row = dy + n * OC + j0;
      for (int64_t j = 0; j < width; ++j) sum[j] += row[j];
    }
    accumulate_span(dsum, j0, width, sum);
  });
}

}  // namespace

void matmul_forward(const CpuContext& ctx, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                    bool weight_out_by_in) {
  const MatmulShape s = check_matmul(inp, weight, weight_out_by_in);
  check_rows_cols(out, "matmul out", s.N, s.OC);
  if (!bias.empty()) {
    check_float_tensor(bias, "matmul bias");
    DSTRAIN_CHECK(bias.numel() == s.OC)
        << "matmul bias " << bias.shape_str() << " must have " << s.OC << " elements";
  }
  const F32View x(ctx, inp), w(ctx, weight);
  std::vector<float> bias_f32;
  if (!bias.empty()) {
    bias_f32.resize(static_cast<size_t>(s.OC));
    load_span_into(bias, 0, s.OC, bias_f32.data());
  }
  // out = inp @ weight (C,OC), or inp @ weight^T for weight (OC,C).
  const Operand a{x.data(), s.C, false};
  const Operand b =
      weight_out_by_in ? Operand{w.data(), s.C, true} : Operand{w.data(), s.OC, false};
  tiled_gemm(ctx, out, s.N, s.OC, s.C, a, b, bias.empty() ? nullptr : bias_f32.data(), false);
}

void matmul_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                     Tensor inp, Tensor weight, bool weight_out_by_in) {
  const MatmulShape s = check_matmul(inp, weight, weight_out_by_in);
  check_rows_cols(dout, "matmul dout", s.N, s.OC);
  if (!dinp.empty()) check_rows_cols(dinp, "matmul dinp", s.N, s.C);
  check_float_tensor(dweight, "matmul dweight");
  DSTRAIN_CHECK(dweight.ndim == 2 && dweight.shape[0] == weight.shape[0] &&
                dweight.shape[1] == weight.shape[1])
      << "matmul dweight " << dweight.shape_str() << " must match weight " << weight.shape_str();
  if (!dbias.empty()) {
    check_float_tensor(dbias, "matmul dbias");
    DSTRAIN_CHECK(dbias.numel() == s.OC)
        << "matmul dbias " << dbias.shape_str() << " must have " << s.OC << " elements";
  }
  const F32View dy(ctx, dout), x(ctx, inp);
  if (!dinp.empty()) {
    // dinp (N,C) = dout (N,OC) @ W^T: weight (C,OC) transposed, or weight (OC,C) as is.
    const F32View w(ctx, weight);
    const Operand b =
        weight_out_by_in ? Operand{w.data(), s.C, false} : Operand{w.data(), s.OC, true};
    tiled_gemm(ctx, dinp, s.N, s.C, s.OC, Operand{dy.data(), s.OC, false}, b, nullptr, false);
  }
  if (weight_out_by_in) {
    // dweight (OC,C) += dout^T (OC,N) @ inp (N,C)
    tiled_gemm(ctx, dweight, s.OC, s.C, s.N, Operand{dy.data(), s.OC, true},
               Operand{x.data(), s.C, false}, nullptr, true);
  } else {
    // dweight (C,OC) += inp^T (C,N) @ dout (N,OC)
    tiled_gemm(ctx, dweight, s.C, s.OC, s.N, Operand{x.data(), s.C, true},
               Operand{dy.data(), s.OC, false}, nullptr, true);
  }
  if (!dbias.empty()) column_sums(ctx, dbias, dy.data(), s.N, s.OC);
}

void matmul_fp8(const CpuContext& ctx, Tensor out, Tensor a, Tensor a_scale_inv, Tensor b,
                Tensor b_scale_inv, Tensor bias, bool accumulate) {
  const Fp8MatmulShape s = check_matmul_fp8(out, a, a_scale_inv, b, b_scale_inv, bias, accumulate);
  const float scale =
      *static_cast<const float*>(a_scale_inv.data) * *static_cast<const float*>(b_scale_inv.data);
  // Each byte's value times `factor` from a 256-entry table: the fp32 product an element-by-
  // element loop gives, computed once per byte.
  const auto decode = [&](const Tensor& t, int64_t count, float factor) {
    std::vector<float> values(static_cast<size_t>(count));
    const auto* bits = static_cast<const uint8_t*>(t.data);
    const Fp8Format format = fp8_format(t.dtype);
    float table[256];
    for (int byte = 0; byte < 256; ++byte) {
      table[byte] = fp8_bits_to_fp32(static_cast<uint8_t>(byte), format) * factor;
    }
    parallel_for(ctx, (count + 4095) / 4096, [&](int64_t task, int) {
      const int64_t end = std::min(count, (task + 1) * 4096);
      for (int64_t i = task * 4096; i < end; ++i) values[static_cast<size_t>(i)] = table[bits[i]];
    });
    return values;
  };
  const std::vector<float> x = decode(a, s.M * s.K, scale), w = decode(b, s.N * s.K, 1.0f);
  std::vector<float> bias_f32;
  if (!bias.empty()) {
    bias_f32.resize(static_cast<size_t>(s.N));
    load_span_into(bias, 0, s.N, bias_f32.data());
  }
  // out (M,N) = x (M,K) @ w^T, w (N,K) row-major.
  tiled_gemm(ctx, out, s.M, s.N, s.K, Operand{x.data(), s.K, false}, Operand{w.data(), s.K, true},
             bias.empty() ? nullptr : bias_f32.data(), accumulate);
}

void column_sums_accumulate(const CpuContext& ctx, Tensor dsum, Tensor x) {
  check_float_tensor(dsum, "column sums dst");
  check_float_tensor(x, "column sums x");
  const int64_t cols = cols_of(x);
  DSTRAIN_CHECK(dsum.numel() == cols) << "column sums dst " << dsum.shape_str() << " must have "
                                      << cols << " elements for x " << x.shape_str();
  if (cols == 0) return;
  const F32View values(ctx, x);
  column_sums(ctx, dsum, values.data(), x.numel() / cols, cols);
}

void matmul_gelu_forward(const CpuContext& ctx, Tensor out, Tensor pre_gelu, Tensor inp,
                         Tensor weight, Tensor bias) {
  const MatmulShape s = check_matmul(inp, weight, false);
  check_rows_cols(out, "matmul_gelu out", s.N, s.OC);
  DSTRAIN_CHECK(!overlaps(out, pre_gelu))
      << "matmul_gelu out " << out.shape_str() << " overlaps pre_gelu " << pre_gelu.shape_str();
  // The definition itself (kernels/ops.h): GELU of pre_gelu as stored, by gelu_forward's code.
  matmul_forward(ctx, pre_gelu, inp, weight, bias, false);
  gelu_forward(ctx, out, pre_gelu);
}

}  // namespace dstrain::cpu
