// CPU causal self-attention, flash-attention style: no T x T matrix is stored. Forward keeps
// one score row per query and saves the row's log-sum-exp; backward recomputes each
// probability row from q, k and that log-sum-exp.
//
// Grouped-query attention: query head h reads kv head h / (NH/KV); KV == NH is multi-head.
// Forward: one task per (b, query head): it loads the q head and its kv head's k, v (T, hd)
// into fp32 scratch (k and v also transposed, so a whole score row is one vectorizable loop),
// walks the query rows in order and writes only that head's columns. Backward: one task per
// (b, kv head), walking its query heads in ascending order, so the dK/dV sums over the group's
// heads and query rows run in one fp32 accumulator in a fixed order (with KV == NH exactly the
// multi-head order). With positions (packed sequences), query i sees keys [i - pos(i), i]: the
// loops start there. All reductions run inside a task, so the result does not depend on the
// thread count. `omp simd` marks only loops whose iterations are independent: vectorizing them
// does not change a bit.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/positions.h"
#include "kernels/qkv_checks.h"

namespace dstrain::cpu {

namespace {

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

void check_attention_dtypes(const Tensor& qkv, const Tensor& out, const Tensor& lse) {
  check_float_tensor(qkv, "attention qkv");
  check_float_tensor(out, "attention out");
  check_tensor_dtype(lse, DType::F32, "attention lse");
}

}  // namespace

void attention_forward(const CpuContext& ctx, Tensor out, Tensor lse, Tensor qkv,
                       Tensor positions, int n_head, int n_kv_head) {
  check_attention_dtypes(qkv, out, lse);
  const QkvShape s = check_attention_shapes(qkv, out, lse, n_head, n_kv_head);
  const int32_t* position = checked_host_positions(positions, s.B, s.T, "attention");
  const int64_t T = s.T, hd = s.hd, width = s.width(), C = s.q_width();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* lse_out = lse.f32();
  // Per thread: k^T (hd, T), v (T, hd); one score row (T); q and out rows (hd).
  ThreadScratch scratch(ctx, 2 * T * hd + T + 2 * hd);
  parallel_for(ctx, s.B * s.NH, [&](int64_t task, int thread) {
    const int64_t b = task / s.NH, h = task % s.NH, kv_head = h / s.group();
    float* k_t = scratch.get(thread);
    float* v = k_t + T * hd;
    float* scores = v + T * hd;
    float* q = scores + T;
    float* o = q + hd;
    load_head(qkv, b, T, width, s.k_column(kv_head), hd, v);  // k rows, staged in v's space
    transpose(v, T, hd, k_t);
    load_head(qkv, b, T, width, s.v_column(kv_head), hd, v);
    for (int64_t i = 0; i < T; ++i) {
      load_span_into(qkv, (b * T + i) * width + h * hd, hd, q);
      const int64_t first = i - position_at(position, b, i, T);  // of its sequence
      scaled_scores(q, k_t + first, T, hd, i + 1 - first, scale, scores + first);
      float max_score = -INFINITY;
      for (int64_t j = first; j <= i; ++j) max_score = std::max(max_score, scores[j]);
      float sum = 0.0f;
      std::fill(o, o + hd, 0.0f);
      for (int64_t j = first; j <= i; ++j) {
        const float p = std::exp(scores[j] - max_score);
        sum += p;
        const float* vj = v + j * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) o[d] += p * vj[d];
      }
      const float inv_sum = 1.0f / sum;
      for (int64_t d = 0; d < hd; ++d) o[d] *= inv_sum;
      commit_span(out, (b * T + i) * C + h * hd, hd, o);
      lse_out[(b * s.NH + h) * T + i] = max_score + std::log(sum);
    }
  });
}

namespace {

// One task's fp32 scratch of the backward, carved from ThreadScratch (floats(T, hd) floats).
struct BackwardScratch {
  static int64_t floats(int64_t T, int64_t hd) { return 9 * T * hd + 2 * T + hd; }
  BackwardScratch(float* base, int64_t T, int64_t hd)
      : q(base),
        k(q + T * hd),
        k_t(k + T * hd),
        v_t(k_t + T * hd),
        o(v_t + T * hd),
        dout_head(o + T * hd),
        dk(dout_head + T * hd),
        dv(dk + T * hd),
        staging(dv + T * hd),
        scores(staging + T * hd),
        dp(scores + T),
        dq(dp + T) {}
  float* q;          // (T, hd) of the current query head
  float* k;          // (T, hd) of the kv head
  float* k_t;        // (hd, T)
  float* v_t;        // (hd, T)
  float* o;          // (T, hd) of the current query head
  float* dout_head;  // (T, hd) of the current query head
  float* dk;         // (T, hd), accumulated over the group's heads and query rows
  float* dv;         // (T, hd), accumulated over the group's heads and query rows
  float* staging;    // (T, hd)
  float* scores;     // (T): q_i . k_j * scale, then P_ij
  float* dp;         // (T): dO_i . v_j, then dS_ij
  float* dq;         // (hd)
};

// One query head h of batch row b: writes its dq columns and adds its share of dk (unscaled)
// and dv into the task's accumulators, query rows in order.
void backward_query_head(const QkvShape& s, const Tensor& dqkv, const Tensor& dout,
                         const Tensor& qkv, const Tensor& out, const float* lse,
                         const int32_t* position, int64_t b, int64_t h, float scale,
                         BackwardScratch& w) {
  const int64_t T = s.T, hd = s.hd, width = s.width(), C = s.q_width();
  load_head(qkv, b, T, width, h * hd, hd, w.q);
  load_head(out, b, T, C, h * hd, hd, w.o);
  load_head(dout, b, T, C, h * hd, hd, w.dout_head);
  const float* row_lse = lse + (b * s.NH + h) * T;
  for (int64_t i = 0; i < T; ++i) {
    const float* qi = w.q + i * hd;
    const float* doi = w.dout_head + i * hd;
    // D_i = dO_i . O_i = sum_j P_ij dP_ij
    const float delta = dot(doi, w.o + i * hd, hd);
    const int64_t first = i - position_at(position, b, i, T);  // of its sequence
    scaled_scores(qi, w.k_t + first, T, hd, i + 1 - first, scale, w.scores + first);
    scaled_scores(doi, w.v_t + first, T, hd, i + 1 - first, 1.0f, w.dp + first);
    for (int64_t j = first; j <= i; ++j) {
      w.scores[j] = std::exp(w.scores[j] - row_lse[i]);  // P_ij
      w.dp[j] = w.scores[j] * (w.dp[j] - delta);         // dS_ij
    }
    std::fill(w.dq, w.dq + hd, 0.0f);
    for (int64_t j = first; j <= i; ++j) {
      const float p = w.scores[j], ds = w.dp[j];
      const float* kj = w.k + j * hd;
      float* dvj = w.dv + j * hd;
      float* dkj = w.dk + j * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) {
        dvj[d] += p * doi[d];
        w.dq[d] += ds * kj[d];
        dkj[d] += ds * qi[d];
      }
    }
    for (int64_t d = 0; d < hd; ++d) w.dq[d] *= scale;
    commit_span(dqkv, (b * T + i) * width + h * hd, hd, w.dq);
  }
}

}  // namespace

void attention_backward(const CpuContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                        Tensor lse, Tensor positions, int n_head, int n_kv_head) {
  check_attention_dtypes(qkv, out, lse);
  check_float_tensor(dqkv, "attention dqkv");
  check_float_tensor(dout, "attention dout");
  const QkvShape s = check_attention_backward_shapes(dqkv, dout, qkv, out, lse, n_head, n_kv_head);
  const int32_t* position = checked_host_positions(positions, s.B, s.T, "attention");
  const int64_t T = s.T, hd = s.hd, width = s.width();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  ThreadScratch scratch(ctx, BackwardScratch::floats(T, hd));
  parallel_for(ctx, s.B * s.KV, [&](int64_t task, int thread) {
    const int64_t b = task / s.KV, kv_head = task % s.KV;
    BackwardScratch w(scratch.get(thread), T, hd);
    load_head(qkv, b, T, width, s.k_column(kv_head), hd, w.k);
    transpose(w.k, T, hd, w.k_t);
    load_head(qkv, b, T, width, s.v_column(kv_head), hd, w.staging);
    transpose(w.staging, T, hd, w.v_t);
    std::fill(w.dk, w.dk + 2 * T * hd, 0.0f);  // dk and dv
    for (int64_t h = kv_head * s.group(); h < (kv_head + 1) * s.group(); ++h) {
      backward_query_head(s, dqkv, dout, qkv, out, lse.f32(), position, b, h, scale, w);
    }
    for (int64_t j = 0; j < T; ++j) {
      float* dkj = w.dk + j * hd;
      for (int64_t d = 0; d < hd; ++d) dkj[d] *= scale;
      commit_span(dqkv, (b * T + j) * width + s.k_column(kv_head), hd, dkj);
      commit_span(dqkv, (b * T + j) * width + s.v_column(kv_head), hd, w.dv + j * hd);
    }
  });
}

}  // namespace dstrain::cpu
