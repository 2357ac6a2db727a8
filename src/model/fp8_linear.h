// The decoder's linear layers in FP8 (--precision fp8, issue 34): the GEMMs of a projection on
// FP8 tensor cores, everything around them (the activations, the parameters, their gradients,
// the master weights and the optimizer) as with bf16.
//
//   forward  out (N, OC) = e4m3(inp) (N, C) x e4m3(W) (OC, C)^T          [+ bias]
//   dgrad    dinp (N, C) = e5m2(dout) (N, OC) x e4m3(W^T) (C, OC)^T
//   wgrad    dW (OC, C) += e5m2(dout^T) (OC, N) x e4m3(inp^T) (C, N)^T   (or its transpose)
//   dbias   (OC)        += column sums of dout in its own dtype           (Backend::bias_backward)
//
// Activations and weights in E4M3 (3 mantissa bits, range +-448), the gradients in E5M2 (2
// mantissa bits, range +-57344): gradients span more orders of magnitude than they need
// precision, which is Transformer Engine's "hybrid" recipe and the one the FP8 formats paper
// (Micikevicius et al., 2022) trained with. Each cast scales its tensor by the power of two that
// puts its current amax at the format's largest value (kernels/ops.h fp8_quantize: "current
// scaling", no history to carry in a checkpoint), so every run of a step is the same bits. The
// GEMMs accumulate in fp32 (CUBLASLT_MATMUL_DESC_FAST_ACCUM off: on Hopper, partial sums of
// about 14 bits within an MMA, promoted to fp32 between MMAs).
//
// matmul_fp8 takes the "TN" form only (both operands K-contiguous), so the casts transpose
// where a GEMM needs it: the weight for dgrad (out-by-in layouts) or for forward and wgrad
// (in-by-out layouts), dout and inp for wgrad. dout is cast once into both of its layouts (one
// amax, one pass over it: fp8_quantize's out and out_t). A linear runs in FP8 where matmul_fp8
// takes all three GEMMs: its widths and the micro-batch's token rows multiples of 16. Otherwise,
// and with no scratch, it runs as Backend::matmul_forward / matmul_backward in the activations'
// dtype.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace dstrain {

// --precision fp8 for the decoder (model/architecture.h make_architecture): `enabled`, the
// linears in FP8; `cache_weights`, each linear's FP8 weight kept from one use to the next while
// the parameters do not change (ParamProvider::params_version), in both layouts: 2 bytes a
// parameter of those linears, in the stage's workspace (model/stage.h). With gradient
// accumulation the weights are cast once a step, not twice a micro-batch. Worth it where the
// parameters stay resident (not ZeRO-3, not offloaded: parallel/plan.h fp8_options).
// `found_amax`: the casts take the amaxes the ops before them found (SwiGLU's of its output and
// of its input gradient; forward's of each linear's input, kept for its backward) instead of a
// pass of their own; off (for tests), every cast finds its own: the same values, the same bits.
struct Fp8Options {
  bool enabled = false;
  bool cache_weights = false;
  bool found_amax = true;
};

// The FP8 operands of one GEMM at a time, reused by the next (one stream orders them): `bytes`
// (F8E4M3, viewed as F8E5M2 where a gradient is cast) holds the two operands of the largest
// GEMM, `scales` (F32, kFp8Scales) their scale_invs. Empty: no FP8.
//
// With the weight cache, also the linear's cached weight: `w` (out, in) for forward, `wt`
// (in, out) for dgrad, E4M3, and `weight_scale_inv` (1) F32; `weight_fresh` when they hold the
// weight's current values, else the linear casts them first (both layouts in one pass). Empty
// `w`: the weight is cast at each use into `bytes`.
//
// `input_amax` (1) F32, where the caller keeps it from the forward to the backward of the same
// micro-batch (a layer's activation): forward finds the input's amax into it, backward casts
// the input's transpose with it (the same values: no second pass over the input for it).
//
// `input_amax_found`: the op that wrote the input found its amax into input_amax already
// (SwiGLU's output, the down projection's input). `dout_amax` (1) F32: dout's amax, found by the
// op that wrote dout (SwiGLU's backward, for the up projection), in dout_amax_slot(); empty:
// found here.
struct Fp8Scratch {
  static constexpr int64_t kFp8Scales = 3;  // the GEMM's two scale_invs, then dout_amax_slot()
  Tensor bytes;
  Tensor scales;
  Tensor w, wt, weight_scale_inv;
  bool weight_fresh = false;
  Tensor input_amax;
  bool input_amax_found = false;
  Tensor dout_amax;
  bool enabled() const { return bytes.numel() > 0; }
  Tensor dout_amax_slot() const { return scales.slice(2, {1}); }
  bool caches_weight() const { return !w.empty(); }
};

// Whether a linear of `in` -> `out` features over `tokens` rows runs in FP8: matmul_fp8's K and
// N of its three GEMMs (in, out and tokens) all multiples of 16.
bool fp8_linear_fits(int64_t tokens, int64_t in, int64_t out);

// Bytes of FP8 scratch such a linear needs: the most it holds at once (forward (tokens + out) x
// in; with backward also dout in both layouts, 2 x tokens x out, with W^T for dgrad, in x out,
// then inp^T for wgrad, in x tokens, in its place); 0 where it does not fit.
int64_t fp8_scratch_bytes(int64_t tokens, int64_t in, int64_t out, bool with_backward);

// Backend::matmul_forward's contract (out (N, OC) = inp (N, C) @ W + bias), in FP8 where the
// scratch is there and the linear fits.
void linear_forward(Backend& backend, const Fp8Scratch& fp8, Tensor out, Tensor inp, Tensor weight,
                    Tensor bias, bool weight_out_by_in, Stream stream);

// Backend::matmul_backward's contract (dinp = dout @ W^T, skipped when empty; dweight +=,
// dbias += column sums of dout, skipped when empty), in FP8 where the scratch is there and the
// linear fits.
void linear_backward(Backend& backend, const Fp8Scratch& fp8, Tensor dinp, Tensor dweight,
                     Tensor dbias, Tensor dout, Tensor inp, Tensor weight, bool weight_out_by_in,
                     Stream stream);

}  // namespace dstrain
