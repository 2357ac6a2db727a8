// CPU kernels: embedding, layernorm, GELU, residual, fused softmax + cross-entropy.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_math.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/positions.h"

namespace dstrain::cpu {

namespace {

constexpr float kLayernormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
// Columns per task of the column reductions (layernorm dweight/dbias).
constexpr int64_t kColumnBlock = 256;

void check_same_numel(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name) {
  DSTRAIN_CHECK(a.numel() == b.numel())
      << a_name << " " << a.shape_str() << " and " << b_name << " " << b.shape_str()
      << " must have the same number of elements";
}

// tokens (B,T) I32, every id in [0, vocab): a bad id is the data's fault, so say so plainly.
void check_tokens(const Tensor& tokens, int64_t B, int64_t T, int64_t vocab) {
  check_tensor_dtype(tokens, DType::I32, "tokens");
  DSTRAIN_CHECK(tokens.ndim == 2 && tokens.shape[0] == B && tokens.shape[1] == T)
      << "tokens " << tokens.shape_str() << " must be (" << B << ", " << T << ")";
  const int32_t* ids = static_cast<const int32_t*>(tokens.data);
  for (int64_t i = 0; i < B * T; ++i) {
    DSTRAIN_USER_CHECK(ids[i] >= 0 && ids[i] < vocab)
        << "token id " << ids[i] << " at (b=" << i / T << ", t=" << i % T
        << ") is outside the model's vocabulary [0, " << vocab
        << "): check that the data was tokenized for this model";
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// embedding

namespace {

// The rows of a (Vs, C) slice of the (vocab_rows, C) token table starting at vocab_begin.
struct VocabSlice {
  int64_t begin = 0, rows = 0;
  bool holds(int32_t id) const { return id >= begin && id < begin + rows; }
};

VocabSlice check_vocab_slice(const Tensor& table, const char* name, int64_t C,
                             int64_t vocab_begin, int64_t vocab_rows) {
  DSTRAIN_CHECK(table.ndim == 2 && table.shape[1] == C)
      << name << " " << table.shape_str() << " must be (Vs, " << C << ")";
  DSTRAIN_CHECK(vocab_begin >= 0 && vocab_begin + table.shape[0] <= vocab_rows)
      << name << " " << table.shape_str() << " from row " << vocab_begin
      << " is not inside a vocabulary of " << vocab_rows << " rows";
  return {vocab_begin, table.shape[0]};
}

void check_position_table(const Tensor& table, const char* name, int64_t T, int64_t C) {
  check_float_tensor(table, name);
  DSTRAIN_CHECK(table.ndim == 2 && table.shape[1] == C && table.shape[0] >= T)
      << name << " " << table.shape_str() << " must be (maxT >= " << T << ", " << C << ")";
}

}  // namespace

void embedding_forward(const CpuContext& ctx, Tensor out, Tensor tokens, Tensor positions,
                       Tensor wte, Tensor wpe, int64_t vocab_begin, int64_t vocab_rows) {
  check_float_tensor(out, "embedding out");
  check_float_tensor(wte, "wte");
  DSTRAIN_CHECK(out.ndim == 3) << "embedding out " << out.shape_str() << " must be (B, T, C)";
  const int64_t B = out.shape[0], T = out.shape[1], C = out.shape[2];
  const VocabSlice slice = check_vocab_slice(wte, "wte", C, vocab_begin, vocab_rows);
  const bool learned = !wpe.empty();  // LLaMA: no position table
  if (learned) check_position_table(wpe, "wpe", T, C);
  check_tokens(tokens, B, T, vocab_rows);
  const int32_t* ids = static_cast<const int32_t*>(tokens.data);
  const int32_t* position = checked_host_positions(positions, B, T, "embedding");

  ThreadScratch scratch(ctx, 3 * C);
  parallel_for(ctx, B * T, [&](int64_t bt, int thread) {
    float* buffers = scratch.get(thread);
    float* dst = output_span(out, bt * C, C, buffers + 2 * C);
    if (!slice.holds(ids[bt])) {
      std::fill(dst, dst + C, 0.0f);  // another slice's token
    } else {
      const float* token_row = load_span(wte, (ids[bt] - slice.begin) * C, C, buffers);
      if (learned) {
        const int64_t p = position_at(position, bt / T, bt % T, T);
        const float* position_row = load_span(wpe, p * C, C, buffers + C);
        for (int64_t c = 0; c < C; ++c) dst[c] = token_row[c] + position_row[c];
      } else {
        std::copy(token_row, token_row + C, dst);
      }
    }
    commit_span(out, bt * C, C, dst);
  });
}

namespace {

// The positions whose token lies in `slice`, grouped by token, (b, t) order kept inside a
// group: order[group_begin[g] .. group_begin[g + 1]) are group g's positions.
struct TokenGroups {
  std::vector<int64_t> order, group_begin;
};

TokenGroups group_by_token(const int32_t* ids, int64_t count, const VocabSlice& slice) {
  TokenGroups groups;
  for (int64_t i = 0; i < count; ++i) {
    if (slice.holds(ids[i])) groups.order.push_back(i);
  }
  std::stable_sort(groups.order.begin(), groups.order.end(),
                   [&](int64_t x, int64_t y) { return ids[x] < ids[y]; });
  const std::vector<int64_t>& order = groups.order;
  for (size_t i = 0; i < order.size(); ++i) {
    if (i == 0 || ids[order[i]] != ids[order[i - 1]])
      groups.group_begin.push_back(static_cast<int64_t>(i));
  }
  groups.group_begin.push_back(static_cast<int64_t>(order.size()));
  return groups;
}

// table (rows, C) += the rows of dout (count, C) summed per id (ids[i] in `slice`, as table row
// ids[i] - slice.begin): each group of rows sharing an id is one task that sums them in (b, t)
// order in fp32 and adds the sum once.
void scatter_rows(const CpuContext& ctx, const Tensor& table, const Tensor& dout,
                  const int32_t* ids, int64_t count, const VocabSlice& slice, int64_t C) {
  const TokenGroups groups = group_by_token(ids, count, slice);
  const std::vector<int64_t>& order = groups.order;
  const std::vector<int64_t>& group_begin = groups.group_begin;
  ThreadScratch scratch(ctx, 2 * C);
  parallel_for(ctx, static_cast<int64_t>(group_begin.size()) - 1, [&](int64_t group, int thread) {
    float* sum = scratch.get(thread);
    float* row_buffer = sum + C;
    std::fill(sum, sum + C, 0.0f);
    for (int64_t i = group_begin[group]; i < group_begin[group + 1]; ++i) {
      const float* row = load_span(dout, order[i] * C, C, row_buffer);
      for (int64_t c = 0; c < C; ++c) sum[c] += row[c];
    }
    accumulate_span(table, (ids[order[group_begin[group]]] - slice.begin) * C, C, sum);
  });
}

}  // namespace

void embedding_backward(const CpuContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout,
                        Tensor tokens, Tensor positions, int64_t vocab_begin, int64_t vocab_rows) {
  check_float_tensor(dwte, "dwte");
  check_float_tensor(dout, "embedding dout");
  DSTRAIN_CHECK(dout.ndim == 3) << "embedding dout " << dout.shape_str() << " must be (B, T, C)";
  const int64_t B = dout.shape[0], T = dout.shape[1], C = dout.shape[2];
  const VocabSlice slice = check_vocab_slice(dwte, "dwte", C, vocab_begin, vocab_rows);
  if (!dwpe.empty()) check_position_table(dwpe, "dwpe", T, C);
  check_tokens(tokens, B, T, vocab_rows);
  const int32_t* ids = static_cast<const int32_t*>(tokens.data);

  const int32_t* position = checked_host_positions(positions, B, T, "embedding");
  scatter_rows(ctx, dwte, dout, ids, B * T, slice, C);
  if (dwpe.empty()) return;
  if (position != nullptr) {  // packed: the rows sharing a position, in (b, t) order
    scatter_rows(ctx, dwpe, dout, position, B * T, VocabSlice{0, dwpe.shape[0]}, C);
    return;
  }
  // dwpe[t] += sum over b of dout[b, t], in b order.
  ThreadScratch scratch(ctx, 2 * C);
  parallel_for(ctx, T, [&](int64_t t, int thread) {
    float* sum = scratch.get(thread);
    float* row_buffer = sum + C;
    std::fill(sum, sum + C, 0.0f);
    for (int64_t b = 0; b < B; ++b) {
      const float* row = load_span(dout, (b * T + t) * C, C, row_buffer);
      for (int64_t c = 0; c < C; ++c) sum[c] += row[c];
    }
    accumulate_span(dwpe, t * C, C, sum);
  });
}

// ---------------------------------------------------------------------------------------------
// layernorm

void layernorm_forward(const CpuContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias) {
  check_float_tensor(out, "layernorm out");
  check_float_tensor(inp, "layernorm inp");
  check_float_tensor(weight, "layernorm weight");
  check_float_tensor(bias, "layernorm bias");
  check_tensor_dtype(mean, DType::F32, "layernorm mean");
  check_tensor_dtype(rstd, DType::F32, "layernorm rstd");
  const int64_t C = cols_of(inp), N = rows_of(inp);
  DSTRAIN_CHECK(C > 0) << "layernorm inp " << inp.shape_str();
  check_same_numel(out, "layernorm out", inp, "inp");
  DSTRAIN_CHECK(cols_of(out) == C) << "layernorm out " << out.shape_str();
  DSTRAIN_CHECK(mean.numel() == N && rstd.numel() == N)
      << "layernorm mean " << mean.shape_str() << " and rstd " << rstd.shape_str() << " must have "
      << N << " elements";
  DSTRAIN_CHECK(weight.numel() == C && bias.numel() == C)
      << "layernorm weight " << weight.shape_str() << " and bias " << bias.shape_str()
      << " must have " << C << " elements";

  const F32View w(ctx, weight), b(ctx, bias);
  float* mean_out = mean.f32();
  float* rstd_out = rstd.f32();
  ThreadScratch scratch(ctx, 2 * C);
  parallel_for(ctx, N, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const float* x = load_span(inp, n * C, C, buffers);
    float sum = 0.0f;
    for (int64_t c = 0; c < C; ++c) sum += x[c];
    const float m = sum / static_cast<float>(C);
    float squares = 0.0f;  // two-pass variance: no cancellation
    for (int64_t c = 0; c < C; ++c) {
      const float d = x[c] - m;
      squares += d * d;
    }
    const float s = 1.0f / std::sqrt(squares / static_cast<float>(C) + kLayernormEps);
    float* y = output_span(out, n * C, C, buffers + C);
    for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - m) * s * w.data()[c] + b.data()[c];
    commit_span(out, n * C, C, y);
    mean_out[n] = m;
    rstd_out[n] = s;
  });
}

void layernorm_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias,
                        Tensor dout, Tensor inp, Tensor weight, Tensor mean, Tensor rstd) {
  check_float_tensor(dinp, "layernorm dinp");
  check_float_tensor(dweight, "layernorm dweight");
  check_float_tensor(dbias, "layernorm dbias");
  check_float_tensor(dout, "layernorm dout");
  check_float_tensor(inp, "layernorm inp");
  check_float_tensor(weight, "layernorm weight");
  check_tensor_dtype(mean, DType::F32, "layernorm mean");
  check_tensor_dtype(rstd, DType::F32, "layernorm rstd");
  const int64_t C = cols_of(inp), N = rows_of(inp);
  DSTRAIN_CHECK(C > 0) << "layernorm inp " << inp.shape_str();
  check_same_numel(dinp, "layernorm dinp", inp, "inp");
  check_same_numel(dout, "layernorm dout", inp, "inp");
  DSTRAIN_CHECK(cols_of(dinp) == C && cols_of(dout) == C)
      << "layernorm dinp " << dinp.shape_str() << ", dout " << dout.shape_str();
  DSTRAIN_CHECK(mean.numel() == N && rstd.numel() == N)
      << "layernorm mean " << mean.shape_str() << " and rstd " << rstd.shape_str() << " must have "
      << N << " elements";
  DSTRAIN_CHECK(weight.numel() == C && dweight.numel() == C && dbias.numel() == C)
      << "layernorm weight " << weight.shape_str() << ", dweight " << dweight.shape_str()
      << ", dbias " << dbias.shape_str() << " must have " << C << " elements";

  const F32View w(ctx, weight);
  const float* mean_in = mean.f32();
  const float* rstd_in = rstd.f32();
  ThreadScratch scratch(ctx, 3 * C);
  // dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = w * dout.
  parallel_for(ctx, N, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const float* x = load_span(inp, n * C, C, buffers);
    const float* dy = load_span(dout, n * C, C, buffers + C);
    float* dx = buffers + 2 * C;
    const float m = mean_in[n], s = rstd_in[n];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      const float dnorm = w.data()[c] * dy[c];
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * norm;
    }
    const float dnorm_mean = dnorm_sum / static_cast<float>(C);
    const float dnorm_norm_mean = dnorm_norm_sum / static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      const float dnorm = w.data()[c] * dy[c];
      dx[c] = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
    accumulate_span(dinp, n * C, C, dx);
  });
  // dweight += sum_n norm * dout, dbias += sum_n dout: one task per column block, rows in order.
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
  ThreadScratch column_scratch(ctx, 4 * kColumnBlock);
  parallel_for(ctx, blocks, [&](int64_t block, int thread) {
    float* buffers = column_scratch.get(thread);
    const int64_t c0 = block * kColumnBlock, width = std::min(kColumnBlock, C - c0);
    float* dw = buffers;
    float* db = buffers + kColumnBlock;
    std::fill(dw, dw + width, 0.0f);
    std::fill(db, db + width, 0.0f);
    for (int64_t n = 0; n < N; ++n) {
      const float* x = load_span(inp, n * C + c0, width, buffers + 2 * kColumnBlock);
      const float* dy = load_span(dout, n * C + c0, width, buffers + 3 * kColumnBlock);
      const float m = mean_in[n], s = rstd_in[n];
      for (int64_t c = 0; c < width; ++c) {
        dw[c] += (x[c] - m) * s * dy[c];
        db[c] += dy[c];
      }
    }
    accumulate_span(dweight, c0, width, dw);
    accumulate_span(dbias, c0, width, db);
  });
}

// ---------------------------------------------------------------------------------------------
// elementwise: GELU (tanh approximation), residual, accumulate

// out = f(a[, b]) elementwise over fixed chunks; f(y, x0, x1, count) fills y from the inputs.
// Inputs are loaded before the output is written, so out may alias an input.
template <class F>
static void elementwise(const CpuContext& ctx, const Tensor& out, const Tensor& a, const Tensor* b,
                        F&& f) {
  const int64_t n = out.numel();
  ThreadScratch scratch(ctx, 3 * kElementChunk);
  parallel_for(ctx, num_chunks(n), [&](int64_t chunk, int thread) {
    float* buffers = scratch.get(thread);
    const int64_t begin = chunk * kElementChunk, count = std::min(kElementChunk, n - begin);
    const float* x0 = load_span(a, begin, count, buffers);
    const float* x1 = b ? load_span(*b, begin, count, buffers + kElementChunk) : nullptr;
    float* y = output_span(out, begin, count, buffers + 2 * kElementChunk);
    f(y, x0, x1, count);
    commit_span(out, begin, count, y);
  });
}

void gelu_forward(const CpuContext& ctx, Tensor out, Tensor inp) {
  check_float_tensor(out, "gelu out");
  check_float_tensor(inp, "gelu inp");
  check_same_numel(out, "gelu out", inp, "inp");
  elementwise(ctx, out, inp, nullptr, [](float* y, const float* x, const float*, int64_t count) {
    // SIMD lanes: tanh_fast is arithmetic and selects, each lane's the scalar loop's bits.
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      const float cube = kGeluCubic * x[i] * x[i] * x[i];
      y[i] = 0.5f * x[i] * (1.0f + tanh_fast(kGeluScale * (x[i] + cube)));
    }
  });
}

void gelu_backward(const CpuContext& ctx, Tensor dinp, Tensor dout, Tensor inp) {
  check_float_tensor(dinp, "gelu dinp");
  check_float_tensor(dout, "gelu dout");
  check_float_tensor(inp, "gelu inp");
  check_same_numel(dinp, "gelu dinp", inp, "inp");
  check_same_numel(dout, "gelu dout", inp, "inp");
  elementwise(ctx, dinp, inp, &dout, [](float* dx, const float* x, const float* dy, int64_t count) {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      const float cube = kGeluCubic * x[i] * x[i] * x[i];
      const float tanh_out = tanh_fast(kGeluScale * (x[i] + cube));
      // sech^2 as 1 - tanh^2: no cosh overflow for large |x|.
      const float sech2 = 1.0f - tanh_out * tanh_out;
      const float local_grad =
          0.5f * (1.0f + tanh_out) +
          x[i] * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x[i] * x[i]);
      dx[i] = local_grad * dy[i];
    }
  });
}

void residual_forward(const CpuContext& ctx, Tensor out, Tensor a, Tensor b) {
  check_float_tensor(out, "residual out");
  check_float_tensor(a, "residual a");
  check_float_tensor(b, "residual b");
  check_same_numel(out, "residual out", a, "a");
  check_same_numel(out, "residual out", b, "b");
  elementwise(ctx, out, a, &b, [](float* y, const float* x0, const float* x1, int64_t count) {
    for (int64_t i = 0; i < count; ++i) y[i] = x0[i] + x1[i];
  });
}

void add_bias(const CpuContext& ctx, Tensor x, Tensor bias) {
  check_float_tensor(x, "add_bias x");
  check_float_tensor(bias, "add_bias bias");
  const int64_t OC = cols_of(x), N = rows_of(x);
  DSTRAIN_CHECK(bias.numel() == OC)
      << "bias " << bias.shape_str() << " must have the " << OC << " columns of x " << x.shape_str();
  std::vector<float> bias_f32(static_cast<size_t>(OC));
  load_span_into(bias, 0, OC, bias_f32.data());
  ThreadScratch scratch(ctx, OC);
  parallel_for(ctx, N, [&](int64_t n, int thread) {
    float* buffer = scratch.get(thread);
    float* row = output_span(x, n * OC, OC, buffer);  // x itself when F32
    if (row == buffer) load_span_into(x, n * OC, OC, buffer);
    for (int64_t c = 0; c < OC; ++c) row[c] += bias_f32[static_cast<size_t>(c)];
    commit_span(x, n * OC, OC, row);
  });
}

void accumulate(const CpuContext& ctx, Tensor dst, Tensor src) {
  check_float_tensor(dst, "accumulate dst");
  check_float_tensor(src, "accumulate src");
  check_same_numel(dst, "accumulate dst", src, "src");
  elementwise(ctx, dst, dst, &src, [](float* y, const float* x0, const float* x1, int64_t count) {
    for (int64_t i = 0; i < count; ++i) y[i] = x0[i] + x1[i];
  });
}

// ---------------------------------------------------------------------------------------------
// fused softmax + cross-entropy

void softmax_cross_entropy(const CpuContext& ctx, Tensor losses, Tensor dlogits, Tensor logits,
                           Tensor targets, int vocab, float dloss) {
  check_float_tensor(logits, "logits");
  check_tensor_dtype(losses, DType::F32, "losses");
  check_tensor_dtype(targets, DType::I32, "targets");
  const int64_t Vp = cols_of(logits), N = rows_of(logits), V = vocab;
  DSTRAIN_CHECK(V > 0 && V <= Vp) << "vocab " << V << " must be in [1, " << Vp << "] for logits "
                                  << logits.shape_str();
  DSTRAIN_CHECK(losses.numel() == N && targets.numel() == N)
      << "losses " << losses.shape_str() << " and targets " << targets.shape_str() << " must have "
      << N << " elements (logits " << logits.shape_str() << ")";
  const bool with_grad = !dlogits.empty();
  if (with_grad) {
    check_float_tensor(dlogits, "dlogits");
    check_same_numel(dlogits, "dlogits", logits, "logits");
    DSTRAIN_CHECK(cols_of(dlogits) == Vp) << "dlogits " << dlogits.shape_str();
    // In place (dlogits over logits) works: each element is read before it is written.
    DSTRAIN_CHECK(dlogits.data != logits.data || dlogits.dtype == logits.dtype)
        << "dlogits may alias logits only with the same dtype";
  }
  const int32_t* target_ids = static_cast<const int32_t*>(targets.data);
  for (int64_t n = 0; n < N; ++n) {
    DSTRAIN_USER_CHECK((target_ids[n] >= 0 && target_ids[n] < V) || target_ids[n] == kIgnoreTarget)
        << "target id " << target_ids[n] << " at row " << n << " is outside the vocabulary [0, "
        << V << "): check that the data was tokenized for this model";
  }

  float* loss_out = losses.f32();
  ThreadScratch scratch(ctx, 2 * Vp);
  parallel_for(ctx, N, [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const int64_t target = target_ids[n];
    if (target == kIgnoreTarget) {
      loss_out[n] = 0.0f;
      if (with_grad) zero_span(dlogits, n * Vp, Vp, buffers + Vp);
      return;
    }
    const float* x = load_span(logits, n * Vp, Vp, buffers);
    float max_logit = x[0];
    for (int64_t j = 1; j < V; ++j) max_logit = std::max(max_logit, x[j]);
    const float target_logit = x[target];
    float sum = 0.0f;
    if (!with_grad) {
      for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - max_logit);
    } else {
      // Keep the exponentials in the output row: no second exp pass.
      float* dx = output_span(dlogits, n * Vp, Vp, buffers + Vp);
      for (int64_t j = 0; j < V; ++j) {
        dx[j] = std::exp(x[j] - max_logit);
        sum += dx[j];
      }
      const float inv_sum = 1.0f / sum;
      for (int64_t j = 0; j < V; ++j) {
        const float indicator = j == target ? 1.0f : 0.0f;
        dx[j] = (dx[j] * inv_sum - indicator) * dloss;
      }
      for (int64_t j = V; j < Vp; ++j) dx[j] = 0.0f;  // padded columns do not exist
      commit_span(dlogits, n * Vp, Vp, dx);
    }
    // log(sum) - (x_t - max): no large max added and subtracted again.
    loss_out[n] = std::log(sum) - (target_logit - max_logit);
  });
}

}  // namespace dstrain::cpu
