#include "model/tensor_parallel.h"

#include <chrono>

#include "core/check.h"

namespace dstrain {

int64_t TensorParallel::stream_rows(int64_t n) const {
  if (!sequence_parallel || size == 1) return n;
  DSTRAIN_CHECK(n % size == 0) << n << " token rows over " << size
                               << " sequence-parallel ranks";
  return n / size;
}

namespace {

Communicator& group(const TensorParallel& tp) {
  DSTRAIN_CHECK(tp.comm != nullptr && tp.comm->size() == tp.size && tp.comm->rank() == tp.rank)
      << "tensor parallelism over " << tp.size << " ranks needs its group";
  return *tp.comm;
}

void check_rows(const TensorParallel& tp, Tensor part, Tensor full) {
  DSTRAIN_CHECK(part.numel() * tp.size == full.numel() && part.dtype == full.dtype)
      << part.shape_str() << " is not 1/" << tp.size << " of " << full.shape_str();
}

// Runs one collective on the group, counted in tp.stats: `share` of an all-reduce of `whole`.
template <class Collective>
void run_counted(const TensorParallel& tp, const Tensor& whole, double share, Collective&& run) {
  const auto start = std::chrono::steady_clock::now();
  run(group(tp));
  if (tp.stats == nullptr) return;
  tp.stats->collectives += 1;
  tp.stats->all_reduce_bytes += share * static_cast<double>(whole.nbytes());
  tp.stats->seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void all_gather_counted(const TensorParallel& tp, Tensor full, Tensor part, Stream stream) {
  check_rows(tp, part, full);
  run_counted(tp, full, 0.5, [&](Communicator& comm) { comm.all_gather(full, part, stream); });
}

}  // namespace

Tensor enter_region_forward(const TensorParallel& tp, Tensor part, Tensor full, Stream stream) {
  if (!tp.enabled() || !tp.sequence_parallel) return part;
  all_gather_counted(tp, full, part, stream);
  return full;
}

Tensor enter_region_backward(const TensorParallel& tp, Tensor full_grad, Tensor part_grad,
                             Stream stream) {
  if (!tp.enabled()) return full_grad;
  if (!tp.sequence_parallel) {
    run_counted(tp, full_grad, 1.0,
                [&](Communicator& comm) { comm.all_reduce(full_grad, ReduceOp::Sum, stream); });
    return full_grad;
  }
  check_rows(tp, part_grad, full_grad);
  run_counted(tp, full_grad, 0.5, [&](Communicator& comm) {
    comm.reduce_scatter(part_grad, full_grad, ReduceOp::Sum, stream);
  });
  return part_grad;
}

Tensor exit_region_forward(const TensorParallel& tp, Tensor full, Tensor part, Stream stream) {
  return enter_region_backward(tp, full, part, stream);  // the same collective
}

Tensor exit_region_backward(const TensorParallel& tp, Tensor part_grad, Tensor full_grad,
                            Stream stream) {
  return enter_region_forward(tp, part_grad, full_grad, stream);  // the same collective
}

void all_gather_parts(const TensorParallel& tp, Tensor full, Tensor part, Stream stream) {
  if (!tp.enabled()) return;
  all_gather_counted(tp, full, part, stream);
}

}  // namespace dstrain
