// AdamW over a model's flat parameter blocks (or a rank's shard of them), with weight decay
// applied per parameter tensor (matrices and embeddings decay; biases and norms do not), and
// clipping by the global gradient norm.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/ops.h"
#include "model/layout.h"

namespace dstrain {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // max global L2 norm; 0 disables clipping
};

// One contiguous range [begin, begin + numel) of a block's flat buffer that this optimizer
// updates: the whole block on one rank, a shard of it under ZeRO.
struct FlatRange {
  int block = 0;
  int64_t begin = 0;
  int64_t numel = 0;
};

// The multiplier PyTorch's clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6)).
float clip_coefficient(double grad_norm, double max_norm);

// Calls fn(local_offset, count, weight_decay) for each piece of `range` that lies inside one
// parameter tensor's file rows (padded vocabulary rows and alignment gaps are skipped), with
// that tensor's weight decay (matrices and embeddings decay; biases and norms do not).
// `layout` is tp rank `tp_rank`'s (ParamLayout(config, tp); 0 at tp = 1): which of its wte
// rows are padding depends on the rank.
void for_each_decay_piece(const ParamLayout& layout, int tp_rank, const FlatRange& range,
                          double weight_decay,
                          const std::function<void(int64_t, int64_t, float)>& fn);

// The step's scalars for Backend::adamw / adamw_multi (the weight decay is per buffer).
AdamWStep adamw_step(const AdamWConfig& config, double lr, int64_t step, float grad_scale);

// Appends the pieces of param[range] .. (as adamw_update_range splits them, each with its
// tensor's weight decay) to `buffers`, for one Backend::adamw_multi over many blocks.
void append_adamw_buffers(const ParamLayout& layout, int tp_rank, const FlatRange& range,
                          Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
                          double weight_decay, std::vector<AdamWTensors>& buffers);

// Updates param[range] with grad[range] (views of exactly that range: param/m/v F32, grad any
// float dtype), splitting the range at parameter boundaries so each piece gets its tensor's
// weight decay. param_copy (optional, same range) receives the rounded low-precision weights.
void adamw_update_range(Backend& backend, const ParamLayout& layout, int tp_rank,
                        const FlatRange& range, Tensor param, Tensor grad, Tensor m, Tensor v,
                        Tensor param_copy, const AdamWConfig& config, double lr, int64_t step, float grad_scale,
                        Stream stream);

// The same on the host (ZeRO-Offload), with the vectorized multi-threaded host AdamW
// (optim/host_adamw.h), bitwise equal to the CPU backend's. param F32; m, v F32, or both BF16
// (bf16 optimizer states: host_adamw_moments); grad F32, F16 or BF16; param_copy (optional)
// F32, F16 or BF16. All host memory.
void host_adamw_update_range(const ParamLayout& layout, int tp_rank, const FlatRange& range,
                             Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
                             const AdamWConfig& config, double lr, int64_t step,
                             float grad_scale, int num_threads);

}  // namespace dstrain
