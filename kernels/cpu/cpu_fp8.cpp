// CPU twin of the FP8 cast (kernels/ops.h: fp8_quantize): the tensor's amax (a maximum: the
// same whatever the order of the threads' partial maxima), its power-of-two scale, and each
// element cast by core/fp8.h's conversion with satfinite, row by row, into out and/or (moved)
// into out_t.
#include <cmath>
#include <vector>

#include "core/fp8.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/fp8_checks.h"

namespace dstrain::cpu {

namespace {

constexpr int64_t kRowsPerTask = 64;

// max |x| over the (rows, cols) tensor `t`; NaN when any element is NaN.
float amax_of(const CpuContext& ctx, const Tensor& t, int64_t rows, int64_t cols) {
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<float> partial(static_cast<size_t>(tasks), 0.0f);
  ThreadScratch scratch(ctx, cols);
  parallel_for(ctx, tasks, [&](int64_t task, int thread) {
    float amax = 0.0f;
    const int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (int64_t r = task * kRowsPerTask; r < end; ++r) {
      const float* row = load_span(t, r * cols, cols, scratch.get(thread));
      for (int64_t c = 0; c < cols; ++c) {
        const float magnitude = std::fabs(row[c]);
        amax = std::isnan(magnitude) || !(magnitude <= amax) ? magnitude : amax;
        if (std::isnan(amax)) break;
      }
      if (std::isnan(amax)) break;
    }
    partial[static_cast<size_t>(task)] = amax;
  });
  float amax = 0.0f;
  for (const float p : partial) amax = std::isnan(p) || p > amax ? p : amax;
  return amax;
}

}  // namespace

void fp8_amax(const CpuContext& ctx, Tensor amax, Tensor inp) {
  check_fp8_amax(amax, inp);
  const RowShape s = row_shape(inp);
  *amax.f32() = amax_of(ctx, inp, s.rows, s.cols);
}

void fp8_quantize(const CpuContext& ctx, Tensor out, Tensor out_t, Tensor scale_inv, Tensor inp,
                  Tensor amax) {
  const RowShape s = check_fp8_quantize(out, out_t, scale_inv, inp, amax);
  const Fp8Format format = fp8_format(out.empty() ? out_t.dtype : out.dtype);
  const float found = amax.empty() ? amax_of(ctx, inp, s.rows, s.cols) : *amax.f32();
  const float scale = fp8_scale_for_amax(found, format);
  auto* straight = static_cast<uint8_t*>(out.data);
  auto* transposed = static_cast<uint8_t*>(out_t.data);
  // A task's rows cast into a scratch block first (or straight into out), then the block's
  // columns stored into out_t, kRowsPerTask contiguous bytes of an out_t row at a time.
  ThreadScratch scratch(ctx, s.cols);
  // (Allocated before the parallel region, as ThreadScratch is: nothing throws inside it.)
  const int64_t block_bytes = straight == nullptr ? kRowsPerTask * s.cols : 0;
  std::vector<uint8_t> blocks(static_cast<size_t>(block_bytes * ctx.num_threads));
  const int64_t tasks = (s.rows + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(ctx, tasks, [&](int64_t task, int thread) {
    const int64_t begin = task * kRowsPerTask, end = std::min(s.rows, begin + kRowsPerTask);
    uint8_t* block =
        straight != nullptr ? straight + begin * s.cols : blocks.data() + block_bytes * thread;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = load_span(inp, r * s.cols, s.cols, scratch.get(thread));
      uint8_t* cast = block + (r - begin) * s.cols;
      for (int64_t c = 0; c < s.cols; ++c) cast[c] = fp32_to_fp8_bits(row[c] * scale, format, true);
    }
    if (transposed == nullptr) return;
    for (int64_t c = 0; c < s.cols; ++c) {
      for (int64_t r = begin; r < end; ++r) {
        transposed[c * s.rows + r] = block[(r - begin) * s.cols + c];
      }
    }
  });
  *static_cast<float*>(scale_inv.data) = 1.0f / scale;
}

}  // namespace dstrain::cpu
