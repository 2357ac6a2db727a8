// CPU kernels: the vocabulary-parallel softmax + cross-entropy (the logits' columns split over
// the tensor-parallel ranks). Each rank reduces its columns to per-row statistics; from every
// rank's statistics each finishes the same losses and its own columns' gradient.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_ops.h"

namespace dstrain::cpu {

namespace {

// A (N, Vs) slice of the logits: columns [begin, begin + Vs) of the whole vocabulary, of which
// those below `vocab` are real.
struct LogitSlice {
  int64_t N = 0, Vs = 0, begin = 0;
  int64_t real = 0;  // real columns of the slice: [0, real)
};

LogitSlice check_logit_slice(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                             int vocab) {
  check_float_tensor(logits, "logits");
  check_tensor_dtype(targets, DType::I32, "targets");
  LogitSlice s{rows_of(logits), cols_of(logits), vocab_begin, 0};
  DSTRAIN_CHECK(vocab > 0 && vocab_begin >= 0)
      << "vocab " << vocab << " and vocab_begin " << vocab_begin << " must be positive";
  s.real = std::clamp(vocab - vocab_begin, int64_t{0}, s.Vs);
  DSTRAIN_CHECK(targets.numel() == s.N)
      << "targets " << targets.shape_str() << " must have the " << s.N << " rows of logits "
      << logits.shape_str();
  const int32_t* ids = static_cast<const int32_t*>(targets.data);
  for (int64_t n = 0; n < s.N; ++n) {
    DSTRAIN_USER_CHECK((ids[n] >= 0 && ids[n] < vocab) || ids[n] == kIgnoreTarget)
        << "target id " << ids[n] << " at row " << n << " is outside the vocabulary [0, " << vocab
        << "): check that the data was tokenized for this model";
  }
  return s;
}

}  // namespace

void cross_entropy_stats(const CpuContext& ctx, Tensor stats, Tensor logits, Tensor targets,
                         int64_t vocab_begin, int vocab) {
  const LogitSlice s = check_logit_slice(logits, targets, vocab_begin, vocab);
  check_tensor_dtype(stats, DType::F32, "stats");
  DSTRAIN_CHECK(stats.numel() == 3 * s.N)
      << "stats " << stats.shape_str() << " must be (" << s.N << ", 3)";
  const int32_t* ids = static_cast<const int32_t*>(targets.data);
  float* out = stats.f32();
  ThreadScratch scratch(ctx, s.Vs);
  parallel_for(ctx, s.N, [&](int64_t n, int thread) {
    const float* x = load_span(logits, n * s.Vs, s.Vs, scratch.get(thread));
    float max_logit = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < s.real; ++j) max_logit = std::max(max_logit, x[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < s.real; ++j) sum += std::exp(x[j] - max_logit);
    const int64_t target = ids[n] - s.begin;
    out[3 * n] = max_logit;
    out[3 * n + 1] = sum;
    out[3 * n + 2] = target >= 0 && target < s.real ? x[target] : 0.0f;
  });
}

namespace {

// One row's softmax over the whole vocabulary, from every slice's statistics.
struct RowSoftmax {
  float max_logit, sum, target_logit;
};

RowSoftmax combine_stats(const float* stats, int64_t P, int64_t N, int64_t n,
                         int64_t slice_of_target) {
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < P; ++p) max_logit = std::max(max_logit, stats[(p * N + n) * 3]);
  float sum = 0.0f;
  for (int64_t p = 0; p < P; ++p) {
    const float* row = stats + (p * N + n) * 3;
    if (row[1] != 0.0f) sum += row[1] * std::exp(row[0] - max_logit);  // skip empty slices
  }
  return {max_logit, sum, stats[(slice_of_target * N + n) * 3 + 2]};
}

}  // namespace

void cross_entropy_from_stats(const CpuContext& ctx, Tensor losses, Tensor dlogits, Tensor logits,
                              Tensor stats, Tensor targets, int64_t vocab_begin, int vocab,
                              float dloss) {
  const LogitSlice s = check_logit_slice(logits, targets, vocab_begin, vocab);
  check_tensor_dtype(losses, DType::F32, "losses");
  check_tensor_dtype(stats, DType::F32, "stats");
  DSTRAIN_CHECK(losses.numel() == s.N) << "losses " << losses.shape_str() << " must have " << s.N
                                       << " elements";
  const int64_t P = stats.numel() / std::max<int64_t>(3 * s.N, 1);
  DSTRAIN_CHECK(stats.numel() == P * s.N * 3 && P * s.Vs >= vocab && s.begin + s.Vs <= P * s.Vs)
      << "stats " << stats.shape_str() << " must be (P, " << s.N << ", 3) for " << P
      << " slices of " << s.Vs << " columns covering the vocabulary " << vocab;
  const bool with_grad = !dlogits.empty();
  if (with_grad) {
    check_float_tensor(dlogits, "dlogits");
    DSTRAIN_CHECK(dlogits.numel() == logits.numel() && cols_of(dlogits) == s.Vs)
        << "dlogits " << dlogits.shape_str() << " must be shaped like logits "
        << logits.shape_str();
    DSTRAIN_CHECK(dlogits.data != logits.data || dlogits.dtype == logits.dtype)
        << "dlogits may alias logits only with the same dtype";
  }
  const int32_t* ids = static_cast<const int32_t*>(targets.data);
  const float* all_stats = stats.f32();
  float* loss_out = losses.f32();
  ThreadScratch scratch(ctx, 2 * s.Vs);
  parallel_for(ctx, s.N, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    if (ids[n] == kIgnoreTarget) {
      loss_out[n] = 0.0f;
      if (with_grad) zero_span(dlogits, n * s.Vs, s.Vs, buffers + s.Vs);
      return;
    }
    const RowSoftmax row = combine_stats(all_stats, P, s.N, n, ids[n] / s.Vs);
    loss_out[n] = std::log(row.sum) - (row.target_logit - row.max_logit);
    if (!with_grad) return;
    const float* x = load_span(logits, n * s.Vs, s.Vs, buffers);
    float* dx = output_span(dlogits, n * s.Vs, s.Vs, buffers + s.Vs);
    const float inv_sum = 1.0f / row.sum;
    const int64_t target = ids[n] - s.begin;
    for (int64_t j = 0; j < s.real; ++j) {
      const float indicator = j == target ? 1.0f : 0.0f;
      dx[j] = (std::exp(x[j] - row.max_logit) * inv_sum - indicator) * dloss;
    }
    for (int64_t j = s.real; j < s.Vs; ++j) dx[j] = 0.0f;  // columns that do not exist
    commit_span(dlogits, n * s.Vs, s.Vs, dx);
  });
}

}  // namespace dstrain::cpu
