// The linear layers in FP8 (model/fp8_linear.h).
#include "model/fp8_linear.h"

#include <algorithm>

#include "core/check.h"

namespace dstrain {

namespace {

constexpr int64_t kFp8Multiple = 16;  // matmul_fp8's K and N

// (rows, cols) FP8 of `format` at byte `offset` of the scratch.
Tensor operand(const Fp8Scratch& fp8, int64_t offset, DType format, int64_t rows, int64_t cols) {
  DSTRAIN_CHECK(offset + rows * cols <= fp8.bytes.numel())
      << "FP8 scratch of " << fp8.bytes.numel() << " bytes cannot hold " << rows << " x " << cols
      << " at " << offset;
  return Tensor(static_cast<uint8_t*>(fp8.bytes.data) + offset, format, {rows, cols},
                fp8.bytes.device);
}

Tensor scale_inv(const Fp8Scratch& fp8, int index) { return fp8.scales.slice(index, {1}); }

struct LinearShape {
  int64_t N, C, OC;
};

LinearShape linear_shape(const Tensor& inp, const Tensor& weight, bool weight_out_by_in) {
  DSTRAIN_CHECK(weight.ndim == 2) << "linear weight " << weight.shape_str() << " must be 2-d";
  const int64_t C = weight_out_by_in ? weight.shape[1] : weight.shape[0];
  const int64_t OC = weight_out_by_in ? weight.shape[0] : weight.shape[1];
  DSTRAIN_CHECK(C > 0 && inp.numel() % C == 0)
      << "linear inp " << inp.shape_str() << " does not match weight " << weight.shape_str();
  return {inp.numel() / C, C, OC};
}

bool runs_in_fp8(const Fp8Scratch& fp8, const LinearShape& s) {
  return fp8.enabled() && fp8_linear_fits(s.N, s.C, s.OC);
}

// `out` = the FP8 copy of `inp`, or of its transpose.
void cast(Backend& backend, Tensor out, Tensor scale_inv, Tensor inp, bool transpose,
          Stream stream) {
  backend.fp8_quantize(transpose ? Tensor() : out, transpose ? out : Tensor(), scale_inv, inp,
                       Tensor(), stream);
}

// A stale cached weight cast again: (out, in) and (in, out) from one amax, one pass over it.
// Whether or not this call's GEMMs run in FP8 (a micro-batch of tokens not a multiple of 16
// does not), so that the cache is what the stage takes it for after the layer ran.
void refresh_cached_weight(Backend& backend, const Fp8Scratch& fp8, const LinearShape& s,
                           Tensor weight, bool weight_out_by_in, Stream stream) {
  if (!fp8.caches_weight() || fp8.weight_fresh) return;
  DSTRAIN_CHECK(fp8.w.numel() == s.OC * s.C && fp8.wt.numel() == s.OC * s.C)
      << "cached FP8 weight " << fp8.w.shape_str() << " does not match the linear's " << s.C
      << " -> " << s.OC;
  backend.fp8_quantize(weight_out_by_in ? fp8.w : fp8.wt, weight_out_by_in ? fp8.wt : fp8.w,
                       fp8.weight_scale_inv, weight, Tensor(), stream);
}

// The weight's FP8 copy for forward ((out, in), w) or dgrad ((in, out), wt) and its scale_inv:
// the cached one, or cast now into the scratch at `offset`.
struct Fp8Weight {
  Tensor bytes, scale_inv;
};
Fp8Weight fp8_weight(Backend& backend, const Fp8Scratch& fp8, const LinearShape& s, Tensor weight,
                     bool weight_out_by_in, bool for_dgrad, int64_t offset, Stream stream) {
  if (fp8.caches_weight()) return {for_dgrad ? fp8.wt : fp8.w, fp8.weight_scale_inv};
  const Tensor bytes = for_dgrad ? operand(fp8, offset, DType::F8E4M3, s.C, s.OC)
                                 : operand(fp8, offset, DType::F8E4M3, s.OC, s.C);
  // Forward wants (out, in): a transpose of an (in, out) weight; dgrad (in, out): of (out, in).
  cast(backend, bytes, scale_inv(fp8, 1), weight, for_dgrad == weight_out_by_in, stream);
  return {bytes, scale_inv(fp8, 1)};
}

}  // namespace

bool fp8_linear_fits(int64_t tokens, int64_t in, int64_t out) {
  return tokens > 0 && tokens % kFp8Multiple == 0 && in % kFp8Multiple == 0 &&
         out % kFp8Multiple == 0;
}

int64_t fp8_scratch_bytes(int64_t tokens, int64_t in, int64_t out, bool with_backward) {
  if (!fp8_linear_fits(tokens, in, out)) return 0;
  const int64_t forward = (tokens + out) * in;
  // Backward: dout in both layouts, then W^T (dgrad) or, in its place, inp^T (wgrad).
  const int64_t backward = 2 * tokens * out + in * std::max(out, tokens);
  return with_backward ? std::max(forward, backward) : forward;
}

void linear_forward(Backend& backend, const Fp8Scratch& fp8, Tensor out, Tensor inp, Tensor weight,
                    Tensor bias, bool weight_out_by_in, Stream stream) {
  const LinearShape s = linear_shape(inp, weight, weight_out_by_in);
  refresh_cached_weight(backend, fp8, s, weight, weight_out_by_in, stream);
  if (!runs_in_fp8(fp8, s)) {
    backend.matmul_forward(out, inp, weight, bias, weight_out_by_in, stream);
    return;
  }
  const Tensor x = operand(fp8, 0, DType::F8E4M3, s.N, s.C), flat = inp.reshape({s.N, s.C});
  if (!fp8.input_amax.empty() && !fp8.input_amax_found) {
    backend.fp8_amax(fp8.input_amax, flat, stream);
  }
  backend.fp8_quantize(x, Tensor(), scale_inv(fp8, 0), flat, fp8.input_amax, stream);
  const Fp8Weight w =
      fp8_weight(backend, fp8, s, weight, weight_out_by_in, false, s.N * s.C, stream);
  backend.matmul_fp8(out.reshape({s.N, s.OC}), x, scale_inv(fp8, 0), w.bytes, w.scale_inv, bias,
                     false, stream);
}

void linear_backward(Backend& backend, const Fp8Scratch& fp8, Tensor dinp, Tensor dweight,
                     Tensor dbias, Tensor dout, Tensor inp, Tensor weight, bool weight_out_by_in,
                     Stream stream) {
  const LinearShape s = linear_shape(inp, weight, weight_out_by_in);
  refresh_cached_weight(backend, fp8, s, weight, weight_out_by_in, stream);
  if (!runs_in_fp8(fp8, s)) {
    backend.matmul_backward(dinp, dweight, dbias, dout, inp, weight, weight_out_by_in, stream);
    return;
  }
  const Tensor dy = dout.reshape({s.N, s.OC}), x = inp.reshape({s.N, s.C});
  // dout cast once, into both layouts where dgrad runs: dgrad's (N, OC), wgrad's (OC, N).
  const Tensor g = dinp.empty() ? Tensor() : operand(fp8, 0, DType::F8E5M2, s.N, s.OC);
  const int64_t after_g = dinp.empty() ? 0 : s.N * s.OC;
  const Tensor gt = operand(fp8, after_g, DType::F8E5M2, s.OC, s.N);
  backend.fp8_quantize(g, gt, scale_inv(fp8, 0), dy, fp8.dout_amax, stream);
  const int64_t after_gt = after_g + s.OC * s.N;
  if (!dinp.empty()) {  // dinp (N, C) = dout (N, OC) x (W^T (C, OC))^T
    const Fp8Weight w =
        fp8_weight(backend, fp8, s, weight, weight_out_by_in, true, after_gt, stream);
    backend.matmul_fp8(dinp.reshape({s.N, s.C}), g, scale_inv(fp8, 0), w.bytes, w.scale_inv,
                       Tensor(), false, stream);
  }
  // dW (OC, C) += dout^T (OC, N) x (inp^T (C, N))^T, or (C, OC) += inp^T x (dout^T)^T.
  const Tensor xt = operand(fp8, after_gt, DType::F8E4M3, s.C, s.N);
  backend.fp8_quantize(Tensor(), xt, scale_inv(fp8, 1), x, fp8.input_amax, stream);
  if (weight_out_by_in) {
    backend.matmul_fp8(dweight, gt, scale_inv(fp8, 0), xt, scale_inv(fp8, 1), Tensor(), true,
                       stream);
  } else {
    backend.matmul_fp8(dweight, xt, scale_inv(fp8, 1), gt, scale_inv(fp8, 0), Tensor(), true,
                       stream);
  }
  if (!dbias.empty()) backend.bias_backward(dbias, dy, stream);
}

}  // namespace dstrain
