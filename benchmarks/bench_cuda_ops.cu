// bench_cuda_ops: times every op of the CUDA backend at GPT-2 124M shapes (B=8, T=1024, C=768,
// NH=12, Vp=50304) on random data and prints a table: the median of several runs after a
// warm-up (CUDA events on one stream), with TFLOP/s for matmul and attention (FLOPs from the
// shape; causal attention counts half the square; backward as 2.5x forward, the
// flash-attention convention) and GB/s for memory-bound ops (the bytes the op must read and
// write at least, once each). Next to them, the same run measures the peaks: a large
// device-to-device copy (GB/s) and a large cuBLAS GEMM in the chosen dtype (TFLOP/s).
//
//   bench_cuda_ops [--dtype fp32|fp16|bf16] [--quick] [--only NAME]
//
// Without a GPU it says so and exits 0: there is nothing to measure.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/check.h"
#include "kernels/cuda/cuda_allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/ops.h"

namespace dstrain {
namespace {

struct Options {
  DType dtype = DType::BF16;
  bool quick = false;
  std::string only;
};

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      options.quick = true;
    } else if (arg == "--only" && i + 1 < argc) {
      options.only = argv[++i];
    } else if (arg == "--dtype" && i + 1 < argc) {
      options.dtype = parse_dtype(argv[++i]);
      DSTRAIN_USER_CHECK(options.dtype != DType::I32) << "--dtype takes fp32, fp16 or bf16";
    } else {
      DSTRAIN_USER_ERROR() << "unknown argument '" << arg
                           << "'; usage: bench_cuda_ops [--dtype fp32|fp16|bf16] [--quick] "
                              "[--only NAME]";
    }
  }
  return options;
}

// Device tensors filled with uniform random values (never zeros), freed at the end.
class Workspace {
 public:
  explicit Workspace(Backend& backend) : backend_(backend), allocator_(make_cuda_allocator(0)) {}

  Tensor random(DType dtype, std::initializer_list<int64_t> dims, float lo = -1.0f,
                float hi = 1.0f) {
    Tensor t = allocate(dtype, dims);
    std::vector<float> values(static_cast<size_t>(t.numel()));
    std::uniform_real_distribution<float> uniform(lo, hi);
    for (float& v : values) v = uniform(engine_);
    Buffer staging = allocator_->allocate(MemCategory::Workspace, values.size() * sizeof(float));
    Tensor device_f32(staging.data(), DType::F32, {t.numel()}, t.device);
    backend_.copy_bytes(staging.data(), values.data(), values.size() * sizeof(float), nullptr);
    backend_.copy(t.reshape({t.numel()}), device_f32, nullptr);
    backend_.synchronize(nullptr);
    return t;
  }
  Tensor ids(std::initializer_list<int64_t> dims, int64_t vocab) {
    Tensor t = allocate(DType::I32, dims);
    std::vector<int32_t> values(static_cast<size_t>(t.numel()));
    for (int32_t& v : values) v = static_cast<int32_t>(engine_() % static_cast<uint64_t>(vocab));
    backend_.copy_bytes(t.data, values.data(), values.size() * sizeof(int32_t), nullptr);
    backend_.synchronize(nullptr);
    return t;
  }
  Tensor allocate(DType dtype, std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    buffers_.push_back(
        allocator_->allocate(MemCategory::Workspace, static_cast<size_t>(n) * dtype_size(dtype)));
    return buffers_.back().view(dtype, dims);
  }

 private:
  Backend& backend_;
  std::unique_ptr<Allocator> allocator_;
  std::vector<Buffer> buffers_;
  std::mt19937_64 engine_{1234};
};

// Median milliseconds of `runs` calls of f after `warmup` calls, by events on the legacy stream.
double time_ms(const std::function<void()>& f, int warmup, int runs) {
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    CUDA_CHECK(cudaEventRecord(start, nullptr));
    f();
    CUDA_CHECK(cudaEventRecord(stop, nullptr));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Row {
  std::string name;
  double ms;
  double bytes;  // 0: compute-bound op
  double flops;  // 0: memory-bound op
};

void print_row(const Row& row, double peak_gbs, double peak_tflops) {
  if (row.flops > 0) {
    const double tflops = row.flops / (row.ms * 1e-3) / 1e12;
    std::printf("%-34s %10.3f %12.1f TFLOP/s %6.1f%% of GEMM peak\n", row.name.c_str(), row.ms,
                tflops, 100.0 * tflops / peak_tflops);
  } else {
    const double gbs = row.bytes / (row.ms * 1e-3) / 1e9;
    std::printf("%-34s %10.3f %12.1f GB/s    %6.1f%% of copy peak\n", row.name.c_str(), row.ms, gbs,
                100.0 * gbs / peak_gbs);
  }
}

int run(const Options& options) {
  const int devices = cuda_device_count();
  if (devices == 0) {
    std::printf(
        "bench_cuda_ops: no CUDA device (no GPU or no driver on this machine); nothing to "
        "measure\n");
    return 0;
  }
  auto backend = make_cuda_backend(0);
  Backend& be = *backend;
  const DType dt = options.dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  const int64_t B = options.quick ? 2 : 8, T = options.quick ? 256 : 1024, C = 768, NH = 12,
                V = 50257, Vp = 50304, N = B * T;
  const int warmup = 2, runs = options.quick ? 3 : 10;
  Workspace ws(be);
  std::printf("device: %s\nshapes: B=%ld T=%ld C=%ld NH=%ld Vp=%ld, dtype %s\n\n",
              be.name().c_str(), static_cast<long>(B), static_cast<long>(T), static_cast<long>(C),
              static_cast<long>(NH), static_cast<long>(Vp), dtype_name(dt));

  // ---- peaks, measured in this run ----
  const int64_t copy_bytes = options.quick ? (int64_t{256} << 20) : (int64_t{2} << 30);
  Tensor copy_src = ws.allocate(DType::F32, {copy_bytes / 4});
  Tensor copy_dst = ws.allocate(DType::F32, {copy_bytes / 4});
  be.fill_zero(copy_src, nullptr);
  const double copy_ms = time_ms(
      [&] { be.copy_bytes(copy_dst.data, copy_src.data, copy_bytes, nullptr); }, warmup, runs);
  const double peak_gbs = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e-3) / 1e9;
  const int64_t G = options.quick ? 2048 : 8192;
  Tensor ga = ws.random(dt, {G, G}), gb = ws.random(dt, {G, G}), gc = ws.allocate(dt, {G, G});
  const double gemm_ms =
      time_ms([&] { be.matmul_forward(gc, ga, gb, Tensor(), false, nullptr); }, warmup, runs);
  const double peak_tflops = 2.0 * G * G * G / (gemm_ms * 1e-3) / 1e12;
  std::printf("peak copy  (%ld MiB device to device): %8.1f GB/s (read + write)\n",
              static_cast<long>(copy_bytes >> 20), peak_gbs);
  std::printf("peak GEMM  (%ld^3 %s, cuBLAS):        %8.1f TFLOP/s\n\n", static_cast<long>(G),
              dtype_name(dt), peak_tflops);

  // ---- the ops ----
  Tensor tokens = ws.ids({B, T}, V), targets = ws.ids({B, T}, V);
  Tensor wte = ws.random(dt, {Vp, C}), wpe = ws.random(dt, {T, C});
  Tensor x = ws.random(dt, {B, T, C}), dx = ws.random(dt, {B, T, C}),
         y = ws.allocate(dt, {B, T, C});
  Tensor ln_w = ws.random(dt, {C}), ln_b = ws.random(dt, {C});
  Tensor mean = ws.allocate(DType::F32, {N}), rstd = ws.allocate(DType::F32, {N});
  Tensor dwte = ws.random(DType::F32, {Vp, C}), dwpe = ws.random(DType::F32, {T, C});
  Tensor dln_w = ws.random(DType::F32, {C}), dln_b = ws.random(DType::F32, {C});
  Tensor qkv = ws.random(dt, {B, T, 3 * C}), dqkv = ws.random(dt, {B, T, 3 * C});
  Tensor w_qkv = ws.random(dt, {C, 3 * C}), b_qkv = ws.random(dt, {3 * C});
  Tensor dw_qkv = ws.random(DType::F32, {C, 3 * C}), db_qkv = ws.random(DType::F32, {3 * C});
  Tensor fc = ws.random(dt, {B, T, 4 * C}, -3.0f, 3.0f), dfc = ws.allocate(dt, {B, T, 4 * C});
  Tensor att = ws.allocate(dt, {B, T, C}), lse = ws.allocate(DType::F32, {B, NH, T});
  Tensor logits = ws.random(dt, {N, Vp}, -4.0f, 4.0f), losses = ws.allocate(DType::F32, {N});
  const int64_t P = 124'000'000 / (options.quick ? 10 : 1);
  Tensor param = ws.random(DType::F32, {P}), grad = ws.random(dt, {P}),
         m = ws.random(DType::F32, {P});
  Tensor v = ws.random(DType::F32, {P}, 0.0f, 1.0f), param_copy = ws.allocate(dt, {P});
  be.layernorm_forward(y, mean, rstd, x, ln_w, ln_b, nullptr);
  be.attention_forward(att, lse, qkv, static_cast<int>(NH), nullptr);
  be.synchronize(nullptr);
  AdamWStep step;
  step.lr = 1e-4f;
  step.weight_decay = 0.1f;

  const double act = static_cast<double>(N * C * es);
  const double attention_flops = 4.0 * B * NH * static_cast<double>(T) * T * (C / NH) * 0.5;
  struct Op {
    std::string name;
    double bytes, flops;
    std::function<void()> f;
  };
  const std::vector<Op> ops = {
      {"embedding_forward", 3 * act, 0,
       [&] { be.embedding_forward(y, tokens, wte, wpe, nullptr); }},
      {"embedding_backward", act + 2.0 * N * C * 4, 0,
       [&] { be.embedding_backward(dwte, dwpe, dx, tokens, nullptr); }},
      {"layernorm_forward", 2 * act + 8.0 * N, 0,
       [&] { be.layernorm_forward(y, mean, rstd, x, ln_w, ln_b, nullptr); }},
      {"layernorm_backward", 4 * act + 8.0 * N, 0,
       [&] { be.layernorm_backward(y, dln_w, dln_b, dx, x, ln_w, mean, rstd, nullptr); }},
      {"matmul_forward qkv (C->3C)", 0, 2.0 * N * C * 3 * C,
       [&] { be.matmul_forward(qkv, x, w_qkv, b_qkv, false, nullptr); }},
      {"matmul_backward qkv", 0, 4.0 * N * C * 3 * C,
       [&] { be.matmul_backward(y, dw_qkv, db_qkv, dqkv, x, w_qkv, false, nullptr); }},
      {"matmul_forward lm_head (C->Vp)", 0, 2.0 * N * C * Vp,
       [&] { be.matmul_forward(logits, x, wte, Tensor(), true, nullptr); }},
      {"attention_forward", 0, attention_flops,
       [&] { be.attention_forward(att, lse, qkv, static_cast<int>(NH), nullptr); }},
      {"attention_backward", 0, 2.5 * attention_flops,
       [&] { be.attention_backward(dqkv, dx, qkv, att, lse, static_cast<int>(NH), nullptr); }},
      {"gelu_forward (4C)", 8 * act, 0, [&] { be.gelu_forward(dfc, fc, nullptr); }},
      {"gelu_backward (4C)", 12 * act, 0, [&] { be.gelu_backward(dfc, dfc, fc, nullptr); }},
      {"residual_forward", 3 * act, 0, [&] { be.residual_forward(y, x, dx, nullptr); }},
      {"softmax_cross_entropy (in place)", 2.0 * N * Vp * es + 8.0 * N, 0,
       [&] {
         be.softmax_cross_entropy(losses, logits, logits, targets, static_cast<int>(V), 1.0f / N,
                                  nullptr);
       }},
      {"adamw (124M params)", P * (24.0 + 2.0 * es), 0,
       [&] { be.adamw(param, grad, m, v, param_copy, step, nullptr); }},
      {"sum_squares (124M)", static_cast<double>(P * es), 0,
       [&] { (void)be.sum_squares(grad, nullptr); }},
  };
  std::printf("%-34s %10s %20s\n", "op", "ms", "achieved");
  for (const Op& op : ops) {
    if (!options.only.empty() && op.name.find(options.only) == std::string::npos) continue;
    print_row({op.name, time_ms(op.f, warmup, runs), op.bytes, op.flops}, peak_gbs, peak_tflops);
  }
  be.synchronize(nullptr);
  return 0;
}

}  // namespace
}  // namespace dstrain

int main(int argc, char** argv) {
  try {
    return dstrain::run(dstrain::parse_options(argc, argv));
  } catch (const dstrain::UserError& e) {
    std::fprintf(stderr, "bench_cuda_ops: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_ops: internal error: %s\n", e.what());
    return 1;
  }
}
