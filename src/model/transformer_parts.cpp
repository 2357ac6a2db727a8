#include "model/transformer_parts.h"

#include <vector>

#include "core/check.h"

namespace dstrain {

Tensor sequence_parallel_rows(const TensorParallel& tp, Tensor full, int64_t rows, int64_t C) {
  if (!tp.enabled() || !tp.sequence_parallel) return Tensor();
  return prefix(full, {rows, C});
}

Tensor row_parallel_matmul(Backend& backend, const Fp8Scratch& fp8, const TensorParallel& tp,
                           Tensor scratch, Tensor stream_part, Tensor inp, Tensor weight,
                           Tensor bias, bool weight_out_by_in, Stream stream) {
  if (!tp.enabled()) {
    linear_forward(backend, fp8, scratch, inp, weight, bias, weight_out_by_in, stream);
    return scratch;
  }
  linear_forward(backend, fp8, scratch, inp, weight, Tensor(), weight_out_by_in, stream);
  Tensor out = exit_region_forward(tp, scratch, stream_part, stream);
  if (!bias.empty()) backend.add_bias(out, bias, stream);
  return out;
}

void vocab_parallel_cross_entropy(const HeadRun& run, const TensorParallel& tp, Tensor logits,
                                  Tensor losses, Tensor stats, Tensor all_stats,
                                  int64_t vocab_begin, int64_t vocab) {
  const int64_t N = run.b * run.t;
  Tensor dlogits = run.dloss != 0.0f ? logits : Tensor();
  Tensor targets = run.targets.reshape({N});
  const int v = static_cast<int>(vocab);
  if (!tp.enabled()) {
    run.backend.softmax_cross_entropy(losses, dlogits, logits, targets, v, run.dloss, run.stream);
    return;
  }
  stats = prefix(stats, {N, 3});
  all_stats = all_stats.slice(0, {tp.size, N, 3});
  run.backend.cross_entropy_stats(stats, logits, targets, vocab_begin, v, run.stream);
  all_gather_parts(tp, all_stats, stats, run.stream);
  run.backend.cross_entropy_from_stats(losses, dlogits, logits, all_stats, targets, vocab_begin, v,
                                       run.dloss, run.stream);
}

double mean_loss(const HeadRun& run, Tensor losses, int64_t N) {
  std::vector<float> host_losses(static_cast<size_t>(N));
  run.backend.copy_bytes(host_losses.data(), losses.data, N * sizeof(float), run.stream);
  run.backend.synchronize(run.stream);
  double sum = 0.0;
  for (float loss : host_losses) sum += loss;
  return sum / static_cast<double>(N);
}

}  // namespace dstrain
