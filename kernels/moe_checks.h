// Shape checks of the mixture-of-experts ops (kernels/ops.h), written once for every backend.
// They look at shapes, dtypes of the index tensors and scalar arguments; the values of index
// tensors (experts in range, offsets nondecreasing) are the CPU twin's to check, where the
// host sees them. Throw dstrain::Error.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace dstrain {

// (rows, cols) of a 2-D tensor, or a failed check naming it.
inline void check_matrix(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  DSTRAIN_CHECK(t.ndim == 2 && t.size(0) == rows && t.size(1) == cols)
      << name << " " << t.shape_str() << " must be (" << rows << ", " << cols << ")";
}

inline void check_index_tensor(const Tensor& t, const char* name) {
  DSTRAIN_CHECK(!t.empty() && t.dtype == DType::I32) << name << " must be a non-empty I32 tensor";
}

// moe_route / moe_route_backward: logits and scores (N, E), the top-k tensors (N, k).
// Returns N.
inline int64_t check_moe_route_shapes(const Tensor& topk_weight, const Tensor& topk_expert,
                                      const Tensor& scores, const Tensor& logits,
                                      const MoeRouting& routing) {
  DSTRAIN_CHECK(routing.experts >= 1 && routing.top_k >= 1 && routing.top_k <= routing.experts)
      << "moe routing: top_k " << routing.top_k << " of " << routing.experts << " experts";
  DSTRAIN_CHECK(logits.ndim == 2 && logits.size(1) == routing.experts)
      << "moe logits " << logits.shape_str() << " must be (N, " << routing.experts << ")";
  const int64_t N = logits.size(0);
  check_matrix(scores, "moe scores", N, routing.experts);
  DSTRAIN_CHECK(scores.dtype == DType::F32) << "moe scores must be F32";
  check_matrix(topk_weight, "moe topk_weight", N, routing.top_k);
  DSTRAIN_CHECK(topk_weight.dtype == DType::F32) << "moe topk_weight must be F32";
  check_matrix(topk_expert, "moe topk_expert", N, routing.top_k);
  check_index_tensor(topk_expert, "moe topk_expert");
  const int groups = routing.groups;
  DSTRAIN_CHECK(groups >= 1 && groups <= 64 && routing.experts % groups == 0 &&
                routing.top_groups >= 1 &&
                routing.top_groups <= groups &&
                routing.top_k <= routing.top_groups * (routing.experts / groups))
      << "moe routing: " << routing.experts << " experts in " << groups << " groups, top "
      << routing.top_groups << " groups, top_k " << routing.top_k;
  const Tensor& bias = routing.selection_bias;
  DSTRAIN_CHECK(bias.empty() || (bias.dtype == DType::F32 && bias.numel() == routing.experts))
      << "moe selection_bias " << bias.shape_str() << " must be (" << routing.experts
      << ") F32 or empty";
  return N;
}

// moe_dispatch: topk_expert (N, k), expert_offsets (E+1), source_rows (N*k), dest_rows (N, k).
inline void check_moe_dispatch_shapes(const Tensor& expert_offsets, const Tensor& source_rows,
                                      const Tensor& dest_rows, const Tensor& topk_expert,
                                      int experts) {
  check_index_tensor(topk_expert, "moe topk_expert");
  check_index_tensor(expert_offsets, "moe expert_offsets");
  check_index_tensor(source_rows, "moe source_rows");
  check_index_tensor(dest_rows, "moe dest_rows");
  DSTRAIN_CHECK(topk_expert.ndim == 2 && experts >= 1)
      << "moe topk_expert " << topk_expert.shape_str() << " must be (N, k), with experts "
      << experts << " >= 1";
  DSTRAIN_CHECK(expert_offsets.numel() == experts + 1)
      << "moe expert_offsets " << expert_offsets.shape_str() << " must have " << experts + 1
      << " elements";
  DSTRAIN_CHECK(source_rows.numel() == topk_expert.numel())
      << "moe source_rows " << source_rows.shape_str() << " must have " << topk_expert.numel()
      << " elements";
  check_matrix(dest_rows, "moe dest_rows", topk_expert.size(0), topk_expert.size(1));
}

// moe_gather: out (M, C), inp (N, C), source_rows (M).
inline void check_moe_gather_shapes(const Tensor& out, const Tensor& inp,
                                    const Tensor& source_rows) {
  check_index_tensor(source_rows, "moe source_rows");
  DSTRAIN_CHECK(out.ndim == 2 && inp.ndim == 2 && out.size(1) == inp.size(1))
      << "moe gather out " << out.shape_str() << " and inp " << inp.shape_str()
      << " must be (M, C) and (N, C)";
  DSTRAIN_CHECK(source_rows.numel() == out.size(0)) << "moe source_rows " << source_rows.shape_str()
                                                    << " must have " << out.size(0) << " elements";
}

// moe_combine: out (N, C), inp (M, C), dest_rows (N, k), weight (N, k) F32 or empty.
inline void check_moe_combine_shapes(const Tensor& out, const Tensor& inp, const Tensor& dest_rows,
                                     const Tensor& weight) {
  check_index_tensor(dest_rows, "moe dest_rows");
  DSTRAIN_CHECK(out.ndim == 2 && inp.ndim == 2 && out.size(1) == inp.size(1))
      << "moe combine out " << out.shape_str() << " and inp " << inp.shape_str()
      << " must be (N, C) and (M, C)";
  DSTRAIN_CHECK(dest_rows.ndim == 2 && dest_rows.size(0) == out.size(0))
      << "moe dest_rows " << dest_rows.shape_str() << " must be (" << out.size(0) << ", k)";
  if (!weight.empty()) {
    check_matrix(weight, "moe weight", dest_rows.size(0), dest_rows.size(1));
    DSTRAIN_CHECK(weight.dtype == DType::F32) << "moe weight must be F32";
  }
}

// expert_offsets' values (E+1 of them, read on the host): nondecreasing from 0 to at most M.
inline void check_expert_offsets(const int32_t* offsets, int64_t count, int64_t M) {
  DSTRAIN_CHECK(offsets[0] == 0 && offsets[count - 1] <= M)
      << "expert_offsets run from " << offsets[0] << " to " << offsets[count - 1]
      << ", not from 0 to at most the " << M << " rows";
  for (int64_t e = 0; e + 1 < count; ++e) {
    DSTRAIN_CHECK(offsets[e] <= offsets[e + 1])
        << "expert_offsets must be nondecreasing: [" << e << "] = " << offsets[e] << " > [" << e + 1
        << "] = " << offsets[e + 1];
  }
}

// Rows [begin, end) of a (rows, cols) tensor, and expert e's (OC, C) matrix of (E, OC, C).
inline Tensor row_range(const Tensor& t, int64_t begin, int64_t end) {
  const int64_t cols = t.size(1);
  return t.slice(begin * cols, {end - begin, cols});
}
inline Tensor expert_matrix(const Tensor& weight, int64_t e) {
  const int64_t OC = weight.size(1), C = weight.size(2);
  return weight.slice(e * OC * C, {OC, C});
}

// grouped_matmul: out (M, OC), inp (M, C), weight (E, OC, C), expert_offsets (E+1).
inline void check_grouped_matmul_shapes(const Tensor& out, const Tensor& inp, const Tensor& weight,
                                        const Tensor& expert_offsets) {
  check_index_tensor(expert_offsets, "grouped matmul expert_offsets");
  DSTRAIN_CHECK(weight.ndim == 3 && inp.ndim == 2 && out.ndim == 2)
      << "grouped matmul weight " << weight.shape_str() << ", inp " << inp.shape_str() << ", out "
      << out.shape_str() << " must be (E, OC, C), (M, C), (M, OC)";
  DSTRAIN_CHECK(inp.size(1) == weight.size(2) && out.size(1) == weight.size(1) &&
                out.size(0) == inp.size(0))
      << "grouped matmul: inp " << inp.shape_str() << " @ weight " << weight.shape_str()
      << "^T does not give out " << out.shape_str();
  DSTRAIN_CHECK(expert_offsets.numel() == weight.size(0) + 1)
      << "grouped matmul expert_offsets " << expert_offsets.shape_str() << " must have "
      << weight.size(0) + 1 << " elements";
}

// grouped_matmul_backward: the forward's shapes with dout as out, dinp like inp (or empty),
// dweight like weight.
inline void check_grouped_matmul_backward_shapes(const Tensor& dinp, const Tensor& dweight,
                                                 const Tensor& dout, const Tensor& inp,
                                                 const Tensor& weight,
                                                 const Tensor& expert_offsets) {
  check_grouped_matmul_shapes(dout, inp, weight, expert_offsets);
  DSTRAIN_CHECK(dinp.empty() ||
                (dinp.ndim == 2 && dinp.size(0) == inp.size(0) && dinp.size(1) == inp.size(1)))
      << "grouped matmul dinp " << dinp.shape_str() << " must match inp " << inp.shape_str();
  DSTRAIN_CHECK(dweight.ndim == 3 && dweight.size(0) == weight.size(0) &&
                dweight.size(1) == weight.size(1) && dweight.size(2) == weight.size(2))
      << "grouped matmul dweight " << dweight.shape_str() << " must match weight "
      << weight.shape_str();
}

// moe_combine_backward's dweight (N, k) F32 and the inp it needs (M, C), like dinp.
inline void check_moe_dweight_shapes(const Tensor& dweight, const Tensor& inp, const Tensor& dinp,
                                     const Tensor& dest_rows) {
  DSTRAIN_CHECK(inp.ndim == 2 && inp.size(0) == dinp.size(0) && inp.size(1) == dinp.size(1))
      << "moe combine inp " << inp.shape_str() << " must match dinp " << dinp.shape_str();
  check_matrix(dweight, "moe dweight", dest_rows.size(0), dest_rows.size(1));
  DSTRAIN_CHECK(dweight.dtype == DType::F32) << "moe dweight must be F32";
}

}  // namespace dstrain
