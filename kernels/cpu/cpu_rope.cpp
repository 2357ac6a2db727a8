// CPU rotary position embedding (rotate-half), in place on the q and k heads of a qkv buffer.
// The q and k heads of one position are contiguous ((NH+KV)*hd elements at the row's start),
// so one task per position loads them as one fp32 span, rotates every head, and stores the span
// once: each element is rounded exactly once, and no element is shared between tasks.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/positions.h"
#include "kernels/qkv_checks.h"

namespace dstrain::cpu {

void rope(const CpuContext& ctx, Tensor qkv, Tensor freqs, Tensor positions, int n_head,
          int n_kv_head, bool transposed) {
  check_float_tensor(qkv, "rope qkv");
  check_tensor_dtype(freqs, DType::F32, "rope freqs");
  const QkvShape s = check_rope_shapes(qkv, freqs, n_head, n_kv_head);
  const int32_t* position = checked_host_positions(positions, s.B, s.T, "rope");
  const int64_t half = s.hd / 2, rotated = (s.NH + s.KV) * s.hd;  // the q and k heads of a row
  const float* table = freqs.f32();
  const float sin_sign = transposed ? -1.0f : 1.0f;
  ThreadScratch scratch(ctx, rotated);
  parallel_for(ctx, s.B * s.T, [&](int64_t row, int thread) {
    const int64_t offset = row * s.width();
    float* x = output_span(qkv, offset, rotated, scratch.get(thread));
    if (qkv.dtype != DType::F32) load_span_into(qkv, offset, rotated, x);
    const float* cos_sin = table + position_at(position, row / s.T, row % s.T, s.T) * half * 2;
    for (int64_t head = 0; head < s.NH + s.KV; ++head) {
      rotate_half_pairs(x + head * s.hd, cos_sin, half, sin_sign);
    }
    commit_span(qkv, offset, rotated, x);
  });
}

}  // namespace dstrain::cpu
