// CPU causal self-attention, flash-attention style: no T x T matrix is stored. Forward keeps
// one score row per query and saves the row's log-sum-exp; backward recomputes each
// probability row from q, k and that log-sum-exp.
//
// One task per (b, head): it loads the head's q, k, v (T, hd) into fp32 scratch (k and v also
// transposed, so a whole score row is one vectorizable loop), walks the query rows in order
// and writes only that head's columns. All reductions (including the dK/dV sums over query
// rows) run inside the task in a fixed order, so the result does not depend on the thread
// count. `omp simd` marks only loops whose iterations are independent: vectorizing them does
// not change a bit.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace dstrain::cpu {

namespace {

struct AttentionShape {
  int64_t B, T, C, NH, hd;
};

AttentionShape check_attention(const Tensor& qkv, const Tensor& out, const Tensor& lse,
                               int n_head) {
  check_float_tensor(qkv, "attention qkv");
  check_float_tensor(out, "attention out");
  check_tensor_dtype(lse, DType::F32, "attention lse");
  DSTRAIN_CHECK(qkv.ndim == 3 && qkv.shape[2] % 3 == 0)
      << "attention qkv " << qkv.shape_str() << " must be (B, T, 3C)";
  AttentionShape s;
  s.B = qkv.shape[0];
  s.T = qkv.shape[1];
  s.C = qkv.shape[2] / 3;
  s.NH = n_head;
  DSTRAIN_CHECK(n_head > 0 && s.C % n_head == 0)
      << "attention: C = " << s.C << " is not divisible by n_head = " << n_head;
  s.hd = s.C / n_head;
  DSTRAIN_CHECK(out.ndim == 3 && out.shape[0] == s.B && out.shape[1] == s.T && out.shape[2] == s.C)
      << "attention out " << out.shape_str() << " must be (" << s.B << ", " << s.T << ", " << s.C
      << ")";
  DSTRAIN_CHECK(lse.ndim == 3 && lse.shape[0] == s.B && lse.shape[1] == s.NH && lse.shape[2] == s.T)
      << "attention lse " << lse.shape_str() << " must be (" << s.B << ", " << s.NH << ", " << s.T
      << ")";
  return s;
}

// Loads rows t = 0..T-1 of one (T, hd) slice of a (B, T, width) tensor into dst (T, hd).
void load_head(const Tensor& t, int64_t b, int64_t T, int64_t width, int64_t column, int64_t hd,
               float* dst) {
  for (int64_t row = 0; row < T; ++row) {
    load_span_into(t, (b * T + row) * width + column, hd, dst + row * hd);
  }
}

float dot(const float* x, const float* y, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// dst (cols, rows) = src (rows, cols)^T
void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
}

// out[j] = (x . m_j) * scale for j < count, with m given transposed: m_t (hd, T). Each out[j]
// sums over d in order, like dot(); the loop over j is what vectorizes.
void scaled_scores(const float* x, const float* m_t, int64_t T, int64_t hd, int64_t count,
                   float scale, float* out) {
  std::fill(out, out + count, 0.0f);
  for (int64_t d = 0; d < hd; ++d) {
    const float xd = x[d];
    const float* row = m_t + d * T;
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) out[j] += xd * row[j];
  }
  for (int64_t j = 0; j < count; ++j) out[j] *= scale;
}

}  // namespace

void attention_forward(const CpuContext& ctx, Tensor out, Tensor lse, Tensor qkv, int n_head) {
  const AttentionShape s = check_attention(qkv, out, lse, n_head);
  const int64_t T = s.T, hd = s.hd, C3 = 3 * s.C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* lse_out = lse.f32();
  // Per thread: k^T (hd, T), v (T, hd); one score row (T); q and out rows (hd).
  ThreadScratch scratch(ctx, 2 * T * hd + T + 2 * hd);
  parallel_for(ctx, s.B * s.NH, [&](int64_t task, int thread) {
    const int64_t b = task / s.NH, h = task % s.NH;
    float* k_t = scratch.get(thread);
    float* v = k_t + T * hd;
    float* scores = v + T * hd;
    float* q = scores + T;
    float* o = q + hd;
    load_head(qkv, b, T, C3, s.C + h * hd, hd, v);  // k rows, staged in v's space
    transpose(v, T, hd, k_t);
    load_head(qkv, b, T, C3, 2 * s.C + h * hd, hd, v);
    for (int64_t i = 0; i < T; ++i) {
      load_span_into(qkv, (b * T + i) * C3 + h * hd, hd, q);
      scaled_scores(q, k_t, T, hd, i + 1, scale, scores);
      float max_score = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) max_score = std::max(max_score, scores[j]);
      float sum = 0.0f;
      std::fill(o, o + hd, 0.0f);
      for (int64_t j = 0; j <= i; ++j) {
        const float p = std::exp(scores[j] - max_score);
        sum += p;
        const float* vj = v + j * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) o[d] += p * vj[d];
      }
      const float inv_sum = 1.0f / sum;
      for (int64_t d = 0; d < hd; ++d) o[d] *= inv_sum;
      commit_span(out, (b * T + i) * s.C + h * hd, hd, o);
      lse_out[(b * s.NH + h) * T + i] = max_score + std::log(sum);
    }
  });
}

void attention_backward(const CpuContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                        Tensor lse, int n_head) {
  const AttentionShape s = check_attention(qkv, out, lse, n_head);
  check_float_tensor(dqkv, "attention dqkv");
  check_float_tensor(dout, "attention dout");
  DSTRAIN_CHECK(dqkv.ndim == 3 && dqkv.shape[0] == s.B && dqkv.shape[1] == s.T &&
                dqkv.shape[2] == 3 * s.C)
      << "attention dqkv " << dqkv.shape_str() << " must match qkv " << qkv.shape_str();
  DSTRAIN_CHECK(dout.ndim == 3 && dout.shape[0] == s.B && dout.shape[1] == s.T &&
                dout.shape[2] == s.C)
      << "attention dout " << dout.shape_str() << " must match out " << out.shape_str();
  const int64_t T = s.T, hd = s.hd, C3 = 3 * s.C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* lse_in = lse.f32();
  // Per thread: nine (T, hd) blocks, two score rows (T) and a dq row (hd), carved below.
  ThreadScratch scratch(ctx, 9 * T * hd + 2 * T + hd);
  parallel_for(ctx, s.B * s.NH, [&](int64_t task, int thread) {
    const int64_t b = task / s.NH, h = task % s.NH;
    float* q = scratch.get(thread);    // (T, hd)
    float* k = q + T * hd;             // (T, hd)
    float* k_t = k + T * hd;           // (hd, T)
    float* v_t = k_t + T * hd;         // (hd, T)
    float* o = v_t + T * hd;           // (T, hd)
    float* dout_head = o + T * hd;     // (T, hd)
    float* dk = dout_head + T * hd;    // (T, hd), accumulated over query rows
    float* dv = dk + T * hd;           // (T, hd), accumulated over query rows
    float* staging = dv + T * hd;      // (T, hd)
    float* scores = staging + T * hd;  // (T): q_i . k_j * scale, then P_ij
    float* dp = scores + T;            // (T): dO_i . v_j, then dS_ij
    float* dq = dp + T;                // (hd)
    load_head(qkv, b, T, C3, h * hd, hd, q);
    load_head(qkv, b, T, C3, s.C + h * hd, hd, k);
    transpose(k, T, hd, k_t);
    load_head(qkv, b, T, C3, 2 * s.C + h * hd, hd, staging);
    transpose(staging, T, hd, v_t);
    load_head(out, b, T, s.C, h * hd, hd, o);
    load_head(dout, b, T, s.C, h * hd, hd, dout_head);
    std::fill(dk, dk + 2 * T * hd, 0.0f);  // dk and dv
    const float* row_lse = lse_in + (b * s.NH + h) * T;
    for (int64_t i = 0; i < T; ++i) {
      const float* qi = q + i * hd;
      const float* doi = dout_head + i * hd;
      // D_i = dO_i . O_i = sum_j P_ij dP_ij
      const float delta = dot(doi, o + i * hd, hd);
      scaled_scores(qi, k_t, T, hd, i + 1, scale, scores);
      scaled_scores(doi, v_t, T, hd, i + 1, 1.0f, dp);
      for (int64_t j = 0; j <= i; ++j) {
        scores[j] = std::exp(scores[j] - row_lse[i]);  // P_ij
        dp[j] = scores[j] * (dp[j] - delta);           // dS_ij
      }
      std::fill(dq, dq + hd, 0.0f);
      for (int64_t j = 0; j <= i; ++j) {
        const float p = scores[j], ds = dp[j];
        const float* kj = k + j * hd;
        float* dvj = dv + j * hd;
        float* dkj = dk + j * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) {
          dvj[d] += p * doi[d];
          dq[d] += ds * kj[d];
          dkj[d] += ds * qi[d];
        }
      }
      for (int64_t d = 0; d < hd; ++d) dq[d] *= scale;
      commit_span(dqkv, (b * T + i) * C3 + h * hd, hd, dq);
    }
    for (int64_t j = 0; j < T; ++j) {
      float* dkj = dk + j * hd;
      for (int64_t d = 0; d < hd; ++d) dkj[d] *= scale;
      commit_span(dqkv, (b * T + j) * C3 + s.C + h * hd, hd, dkj);
      commit_span(dqkv, (b * T + j) * C3 + 2 * s.C + h * hd, hd, dv + j * hd);
    }
  });
}

}  // namespace dstrain::cpu
