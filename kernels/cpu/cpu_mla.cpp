// CPU twins of the multi-head latent attention ops (semantics in kernels/ops.h, shapes in
// kernels/mla_checks.h): mla_pack and its backward, mla_unpad and its backward. One task per
// position: its rows are loaded as fp32 spans, rearranged (the rope parts rotated), and each
// output span committed once, so every element is rounded once and copies are exact.
#include <algorithm>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/mla_checks.h"
#include "kernels/positions.h"

namespace dstrain::cpu {

namespace {

// x (n) times scale in fp32 (nothing when scale is 1: the copies stay exact).
void scale_by(float* x, int64_t n, float scale) {
  if (scale == 1.0f) return;
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// Rotates the rope part x (dr = 2 * half) by cos_sin's angles: rotate_half_pairs, or on the
// pairs (x[2i], x[2i + 1]) with the same arithmetic.
void rotate_rope(float* x, const float* cos_sin, int64_t half, float sin_sign, bool interleaved) {
  if (!interleaved) return rotate_half_pairs(x, cos_sin, half, sin_sign);
  for (int64_t i = 0; i < half; ++i) {
    const float c = cos_sin[2 * i], s = sin_sign * cos_sin[2 * i + 1];
    const float x1 = x[2 * i], x2 = x[2 * i + 1];
    x[2 * i] = x1 * c - x2 * s;
    x[2 * i + 1] = x2 * c + x1 * s;
  }
}

// The (cos, sin) table row of position row (b * T + t).
const float* angles(const Tensor& freqs, const int32_t* positions, const MlaShape& s, int64_t row) {
  return freqs.f32() + position_at(positions, row / s.T, row % s.T, s.T) * s.dr;
}

// One position's spans: q (H*D), kv (H*(dn+dv)), k_rope (dr), qkv (3*H*D) in fp32.
struct RowSpans {
  float *q, *kv, *k_rope, *qkv;
};
RowSpans row_spans(float* scratch, const MlaShape& s) {
  RowSpans r;
  r.q = scratch;
  r.kv = r.q + s.q_width();
  r.k_rope = r.kv + s.kv_width();
  r.qkv = r.k_rope + s.dr;
  return r;
}
int64_t row_floats(const MlaShape& s) {
  return s.q_width() + s.kv_width() + s.dr + 3 * s.q_width();
}

}  // namespace

void mla_pack(const CpuContext& ctx, Tensor qkv, Tensor q, Tensor kv, Tensor k_rope, Tensor freqs,
              Tensor positions, const MlaHeads& heads) {
  check_float_tensor(qkv, "mla qkv");
  const MlaShape s = check_mla_pack_shapes(qkv, q, kv, k_rope, freqs, heads, "mla_pack");
  const int32_t* position = checked_host_positions(positions, s.B, s.T, "mla_pack");
  const int64_t D = s.D(), half = s.dr / 2;
  ThreadScratch scratch(ctx, row_floats(s));
  parallel_for(ctx, s.rows(), [&](int64_t row, int thread) {
    const RowSpans r = row_spans(scratch.get(thread), s);
    load_span_into(q, row * s.q_width(), s.q_width(), r.q);
    load_span_into(kv, row * s.kv_width(), s.kv_width(), r.kv);
    load_span_into(k_rope, row * s.dr, s.dr, r.k_rope);
    const float* cos_sin = angles(freqs, position, s, row);
    rotate_rope(r.k_rope, cos_sin, half, 1.0f, heads.interleaved);
    for (int64_t h = 0; h < s.H; ++h) {
      float* qh = r.qkv + h * D;
      float* kh = r.qkv + s.q_width() + h * D;
      float* vh = r.qkv + 2 * s.q_width() + h * D;
      const float* kvh = r.kv + h * (s.dn + s.dv);
      std::copy(r.q + h * D, r.q + (h + 1) * D, qh);
      rotate_rope(qh + s.dn, cos_sin, half, 1.0f, heads.interleaved);
      scale_by(qh, D, heads.q_scale);
      std::copy(kvh, kvh + s.dn, kh);
      std::copy(r.k_rope, r.k_rope + s.dr, kh + s.dn);
      std::copy(kvh + s.dn, kvh + s.dn + s.dv, vh);
      std::fill(vh + s.dv, vh + D, 0.0f);
    }
    commit_span(qkv, row * 3 * s.q_width(), 3 * s.q_width(), r.qkv);
  });
}

void mla_pack_backward(const CpuContext& ctx, Tensor dq, Tensor dkv, Tensor dk_rope, Tensor dqkv,
                       Tensor freqs, Tensor positions, const MlaHeads& heads) {
  check_float_tensor(dqkv, "mla dqkv");
  const MlaShape s =
      check_mla_pack_shapes(dqkv, dq, dkv, dk_rope, freqs, heads, "mla_pack_backward");
  const int32_t* position = checked_host_positions(positions, s.B, s.T, "mla_pack_backward");
  const int64_t D = s.D(), half = s.dr / 2;
  ThreadScratch scratch(ctx, row_floats(s));
  parallel_for(ctx, s.rows(), [&](int64_t row, int thread) {
    const RowSpans r = row_spans(scratch.get(thread), s);
    load_span_into(dqkv, row * 3 * s.q_width(), 3 * s.q_width(), r.qkv);
    const float* cos_sin = angles(freqs, position, s, row);
    std::fill(r.k_rope, r.k_rope + s.dr, 0.0f);
    for (int64_t h = 0; h < s.H; ++h) {
      const float* qh = r.qkv + h * D;
      const float* kh = r.qkv + s.q_width() + h * D;
      const float* vh = r.qkv + 2 * s.q_width() + h * D;
      float* dqh = r.q + h * D;
      float* dkvh = r.kv + h * (s.dn + s.dv);
      std::copy(qh, qh + D, dqh);
      scale_by(dqh, D, heads.q_scale);
      rotate_rope(dqh + s.dn, cos_sin, half, -1.0f, heads.interleaved);
      std::copy(kh, kh + s.dn, dkvh);
      std::copy(vh, vh + s.dv, dkvh + s.dn);
      for (int64_t i = 0; i < s.dr; ++i) r.k_rope[i] += kh[s.dn + i];
    }
    rotate_rope(r.k_rope, cos_sin, half, -1.0f, heads.interleaved);
    commit_span(dq, row * s.q_width(), s.q_width(), r.q);
    commit_span(dkv, row * s.kv_width(), s.kv_width(), r.kv);
    commit_span(dk_rope, row * s.dr, s.dr, r.k_rope);
  });
}

void mla_unpad(const CpuContext& ctx, Tensor out, Tensor atty, const MlaHeads& heads) {
  check_float_tensor(atty, "mla atty");
  const MlaShape s = check_mla_unpad_shapes(out, atty, heads, "mla_unpad");
  const int64_t D = s.D(), width = s.H * s.dv;
  ThreadScratch scratch(ctx, s.q_width() + width);
  parallel_for(ctx, s.rows(), [&](int64_t row, int thread) {
    float* padded = scratch.get(thread);
    float* heads_v = padded + s.q_width();
    load_span_into(atty, row * s.q_width(), s.q_width(), padded);
    for (int64_t h = 0; h < s.H; ++h) {
      std::copy(padded + h * D, padded + h * D + s.dv, heads_v + h * s.dv);
    }
    commit_span(out, row * width, width, heads_v);
  });
}

void mla_unpad_backward(const CpuContext& ctx, Tensor datty, Tensor dout, const MlaHeads& heads) {
  check_float_tensor(dout, "mla dout");
  const MlaShape s = check_mla_unpad_shapes(dout, datty, heads, "mla_unpad_backward");
  const int64_t D = s.D(), width = s.H * s.dv;
  ThreadScratch scratch(ctx, s.q_width() + width);
  parallel_for(ctx, s.rows(), [&](int64_t row, int thread) {
    float* padded = scratch.get(thread);
    float* heads_v = padded + s.q_width();
    load_span_into(dout, row * width, width, heads_v);
    for (int64_t h = 0; h < s.H; ++h) {
      std::copy(heads_v + h * s.dv, heads_v + (h + 1) * s.dv, padded + h * D);
      std::fill(padded + h * D + s.dv, padded + (h + 1) * D, 0.0f);
    }
    commit_span(datty, row * s.q_width(), s.q_width(), padded);
  });
}

}  // namespace dstrain::cpu
