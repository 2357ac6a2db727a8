// CPU twins of the mixture-of-experts ops (semantics in kernels/ops.h, shape checks in
// kernels/moe_checks.h): routing and its backward, the dispatch into expert order, gather,
// combine and its backward, the grouped matmul. The index tensors' values are checked here,
// before any parallel region.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/moe_checks.h"

namespace dstrain::cpu {

namespace {

// scores[e] = softmax (or sigmoid) of x[e], in fp32.
void score_row(const float* x, int64_t E, RouterScore score, float* scores) {
  if (score == RouterScore::Sigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-x[e]));
    return;
  }
  float max = x[0];
  for (int64_t e = 1; e < E; ++e) max = std::max(max, x[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    scores[e] = std::exp(x[e] - max);
    sum += scores[e];
  }
  for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
}

// A group's rank score: its best selection score, or the sum of its two best.
float group_score(const float* choice, int64_t first, int64_t size, GroupScore kind) {
  float best = choice[first], second = -INFINITY;
  for (int64_t e = first + 1; e < first + size; ++e) {
    if (choice[e] > best) {
      second = best;
      best = choice[e];
    } else if (choice[e] > second) {
      second = choice[e];
    }
  }
  return kind == GroupScore::Max || size < 2 ? best : best + second;
}

// allowed[e] = 1: expert e is in one of the top_groups best groups (ties to the lower group),
// else 0.
void allowed_experts(const float* choice, const MoeRouting& r, float* group_scores,
                     float* allowed) {
  const int64_t size = r.experts / r.groups;
  for (int g = 0; g < r.groups; ++g) group_scores[g] = group_score(choice, g * size, size, r.group_score);
  for (int g = 0; g < r.groups; ++g) {
    int ahead = 0;  // the groups ranked before g
    for (int h = 0; h < r.groups; ++h) {
      ahead += group_scores[h] > group_scores[g] || (group_scores[h] == group_scores[g] && h < g);
    }
    for (int64_t e = g * size; e < (g + 1) * size; ++e) allowed[e] = ahead < r.top_groups ? 1.0f : 0.0f;
  }
}

// The k highest of choice[0, E) among the allowed, highest first, ties to the lower index.
void top_k(const float* choice, const float* allowed, int64_t E, int k, int32_t* experts) {
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = allowed[e] == 0.0f;
      for (int i = 0; i < j; ++i) taken = taken || experts[i] == e;
      if (!taken && (best < 0 || choice[e] > choice[best])) best = static_cast<int>(e);
    }
    experts[j] = best;
  }
}

// Every value of the I32 tensor `t` in [low, high), or a failed check naming it.
void check_indices(const Tensor& t, const char* name, int64_t low, int64_t high) {
  const int32_t* values = t.i32();
  for (int64_t i = 0; i < t.numel(); ++i) {
    DSTRAIN_CHECK(values[i] >= low && values[i] < high)
        << name << "[" << i << "] = " << values[i] << " is outside [" << low << ", " << high << ")";
  }
}

}  // namespace

void moe_route(const CpuContext& ctx, Tensor topk_weight, Tensor topk_expert, Tensor scores,
               Tensor logits, const MoeRouting& routing) {
  check_float_tensor(logits, "moe logits");
  const int64_t N = check_moe_route_shapes(topk_weight, topk_expert, scores, logits, routing);
  const int64_t E = routing.experts;
  const int k = routing.top_k;
  const float* bias = routing.selection_bias.empty() ? nullptr : routing.selection_bias.f32();
  // Per thread: the logits' copy, the selection scores, the group scores, the allowed flags.
  ThreadScratch scratch(ctx, 3 * E + routing.groups);
  parallel_for(ctx, N, [&](int64_t n, int thread) {
    float* x_copy = scratch.get(thread);
    float* choice = x_copy + E;
    float* group_scores = choice + E;
    float* allowed = group_scores + routing.groups;
    const float* x = load_span(logits, n * E, E, x_copy);
    float* s = scores.f32() + n * E;
    score_row(x, E, routing.score, s);
    for (int64_t e = 0; e < E; ++e) choice[e] = bias != nullptr ? s[e] + bias[e] : s[e];
    allowed_experts(choice, routing, group_scores, allowed);
    int32_t* experts = topk_expert.i32() + n * k;
    float* w = topk_weight.f32() + n * k;
    top_k(choice, allowed, E, k, experts);
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      w[j] = s[experts[j]];
      sum += w[j];
    }
    for (int j = 0; j < k; ++j) {
      if (routing.norm_topk) w[j] /= sum;
      w[j] *= routing.scale;
    }
  });
}

void moe_route_backward(const CpuContext& ctx, Tensor dlogits, Tensor dtopk_weight, Tensor dscores,
                        Tensor scores, Tensor topk_expert, const MoeRouting& routing) {
  check_float_tensor(dlogits, "moe dlogits");
  const int64_t N = check_moe_route_shapes(dtopk_weight, topk_expert, scores, dlogits, routing);
  if (!dscores.empty()) {
    check_matrix(dscores, "moe dscores", N, routing.experts);
    check_tensor_dtype(dscores, DType::F32, "moe dscores");
  }
  const int64_t E = routing.experts;
  const int k = routing.top_k;
  check_indices(topk_expert, "moe topk_expert", 0, E);
  ThreadScratch scratch(ctx, 2 * E);
  parallel_for(ctx, N, [&](int64_t n, int thread) {
    float* ds = scratch.get(thread);  // dL/d(scores), (E)
    const float* s = scores.f32() + n * E;
    const int32_t* experts = topk_expert.i32() + n * k;
    const float* dw = dtopk_weight.f32() + n * k;
    for (int64_t e = 0; e < E; ++e) ds[e] = dscores.empty() ? 0.0f : dscores.f32()[n * E + e];
    // w_j = scale * s_j / S, S = the sum of the selected scores (or 1 without norm_topk).
    float sum = 0.0f, dot = 0.0f;
    for (int j = 0; j < k; ++j) sum += s[experts[j]];
    for (int j = 0; j < k; ++j) dot += dw[j] * s[experts[j]];
    for (int j = 0; j < k; ++j) {
      ds[experts[j]] +=
          routing.norm_topk ? routing.scale * (dw[j] - dot / sum) / sum : routing.scale * dw[j];
    }
    float* dx = output_span(dlogits, n * E, E, ds + E);
    if (routing.score == RouterScore::Sigmoid) {
      for (int64_t e = 0; e < E; ++e) dx[e] = ds[e] * s[e] * (1.0f - s[e]);
    } else {
      float weighted = 0.0f;
      for (int64_t e = 0; e < E; ++e) weighted += s[e] * ds[e];
      for (int64_t e = 0; e < E; ++e) dx[e] = s[e] * (ds[e] - weighted);
    }
    commit_span(dlogits, n * E, E, dx);
  });
}

void moe_dispatch(const CpuContext& ctx, Tensor expert_offsets, Tensor source_rows,
                  Tensor dest_rows, Tensor topk_expert, int experts) {
  (void)ctx;  // a counting sort: serial, O(N k + E)
  check_moe_dispatch_shapes(expert_offsets, source_rows, dest_rows, topk_expert, experts);
  check_indices(topk_expert, "moe topk_expert", 0, experts);
  const int64_t choices = topk_expert.numel(), k = topk_expert.size(1);
  const int32_t* expert = topk_expert.i32();
  int32_t* offsets = expert_offsets.i32();
  std::vector<int32_t> cursor(static_cast<size_t>(experts) + 1, 0);
  for (int64_t i = 0; i < choices; ++i) ++cursor[static_cast<size_t>(expert[i]) + 1];
  for (int e = 0; e < experts; ++e) cursor[e + 1] += cursor[e];
  std::copy(cursor.begin(), cursor.end(), offsets);
  for (int64_t i = 0; i < choices; ++i) {
    const int32_t row = cursor[static_cast<size_t>(expert[i])]++;
    source_rows.i32()[row] = static_cast<int32_t>(i / k);
    dest_rows.i32()[i] = row;
  }
}

void moe_gather(const CpuContext& ctx, Tensor out, Tensor inp, Tensor source_rows) {
  check_float_tensor(out, "moe gather out");
  check_float_tensor(inp, "moe gather inp");
  check_moe_gather_shapes(out, inp, source_rows);
  check_indices(source_rows, "moe source_rows", 0, inp.size(0));
  const int64_t C = inp.size(1);
  ThreadScratch scratch(ctx, C);
  parallel_for(ctx, out.size(0), [&](int64_t r, int thread) {
    const int64_t source = source_rows.i32()[r];
    commit_span(out, r * C, C, load_span(inp, source * C, C, scratch.get(thread)));
  });
}

void moe_combine(const CpuContext& ctx, Tensor out, Tensor inp, Tensor dest_rows, Tensor weight) {
  check_float_tensor(out, "moe combine out");
  check_float_tensor(inp, "moe combine inp");
  check_moe_combine_shapes(out, inp, dest_rows, weight);
  check_indices(dest_rows, "moe dest_rows", -1, inp.size(0));
  const int64_t C = inp.size(1), k = dest_rows.size(1);
  ThreadScratch scratch(ctx, 2 * C);
  parallel_for(ctx, out.size(0), [&](int64_t n, int thread) {
    float* row = scratch.get(thread);
    float* sum = output_span(out, n * C, C, row + C);
    std::fill(sum, sum + C, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = dest_rows.i32()[n * k + j];
      if (r < 0) continue;
      const float w = weight.empty() ? 1.0f : weight.f32()[n * k + j];
      const float* y = load_span(inp, r * C, C, row);
      for (int64_t c = 0; c < C; ++c) sum[c] += w * y[c];
    }
    commit_span(out, n * C, C, sum);
  });
}

void moe_combine_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                          Tensor inp, Tensor dest_rows, Tensor weight) {
  check_float_tensor(dinp, "moe combine dinp");
  check_float_tensor(dout, "moe combine dout");
  check_moe_combine_shapes(dout, dinp, dest_rows, weight);
  const int64_t M = dinp.size(0), C = dinp.size(1), k = dest_rows.size(1);
  check_indices(dest_rows, "moe dest_rows", -1, M);
  // Each row of dinp is exactly one choice's: written once, by that token's task.
  std::vector<int> hits(static_cast<size_t>(M), 0);
  for (int64_t i = 0; i < dest_rows.numel(); ++i) {
    if (dest_rows.i32()[i] >= 0) ++hits[static_cast<size_t>(dest_rows.i32()[i])];
  }
  for (int64_t r = 0; r < M; ++r) {
    DSTRAIN_CHECK(hits[static_cast<size_t>(r)] == 1)
        << "moe dest_rows names row " << r << " " << hits[static_cast<size_t>(r)]
        << " times: every row of dinp must be one choice's";
  }
  if (!dweight.empty()) {
    check_float_tensor(inp, "moe combine inp");
    check_moe_dweight_shapes(dweight, inp, dinp, dest_rows);
  }
  ThreadScratch scratch(ctx, 3 * C);
  parallel_for(ctx, dout.size(0), [&](int64_t n, int thread) {
    float* buffers = scratch.get(thread);
    const float* dy = load_span(dout, n * C, C, buffers);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = dest_rows.i32()[n * k + j];
      if (r < 0) {
        if (!dweight.empty()) dweight.f32()[n * k + j] = 0.0f;
        continue;
      }
      const float w = weight.empty() ? 1.0f : weight.f32()[n * k + j];
      float* dx = output_span(dinp, r * C, C, buffers + C);
      for (int64_t c = 0; c < C; ++c) dx[c] = w * dy[c];
      commit_span(dinp, r * C, C, dx);
      if (dweight.empty()) continue;
      const float* y = load_span(inp, r * C, C, buffers + 2 * C);
      float dot = 0.0f;
      for (int64_t c = 0; c < C; ++c) dot += dy[c] * y[c];
      dweight.f32()[n * k + j] = dot;
    }
  });
}

void grouped_matmul_forward(const CpuContext& ctx, Tensor out, Tensor inp, Tensor weight,
                            Tensor expert_offsets) {
  check_grouped_matmul_shapes(out, inp, weight, expert_offsets);
  check_expert_offsets(expert_offsets.i32(), expert_offsets.numel(), inp.size(0));
  const int32_t* offsets = expert_offsets.i32();
  for (int64_t e = 0; e < weight.size(0); ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    matmul_forward(ctx, row_range(out, offsets[e], offsets[e + 1]),
                   row_range(inp, offsets[e], offsets[e + 1]), expert_matrix(weight, e), Tensor(),
                   true);
  }
}

void grouped_matmul_backward(const CpuContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                             Tensor inp, Tensor weight, Tensor expert_offsets) {
  check_grouped_matmul_backward_shapes(dinp, dweight, dout, inp, weight, expert_offsets);
  check_expert_offsets(expert_offsets.i32(), expert_offsets.numel(), inp.size(0));
  const int32_t* offsets = expert_offsets.i32();
  for (int64_t e = 0; e < weight.size(0); ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    if (begin == end) continue;
    matmul_backward(ctx, dinp.empty() ? Tensor() : row_range(dinp, begin, end),
                    expert_matrix(dweight, e), Tensor(), row_range(dout, begin, end),
                    row_range(inp, begin, end), expert_matrix(weight, e), true);
  }
}

}  // namespace dstrain::cpu
