// bench_cuda_ops: times every op of the CUDA backend at GPT-2 shapes (default 124M: B=8,
// T=1024, C=768, NH=12, Vp=50304) on random data and prints a table: the median of several
// runs after a warm-up (CUDA events on the legacy stream), with TFLOP/s for matmul and attention
// (FLOPs from the shape; causal attention counts half the square; backward as 2.5x forward, the
// flash-attention convention) and GB/s for memory-bound ops (the bytes the op must read and
// write at least, once each). Parameter gradients are in the working dtype, as in training.
// The MoE ops run at a DeepSeekMoE-16B layer's shape whatever the flags (moe_ops).
//
// Next to each rate, the peak the same run measures, as a percentage:
//   copy   a large device-to-device cudaMemcpyAsync (read + write bytes / time)
//   GEMM   a large square cublasGemmEx (2 n^3 FLOPs / time), fp32 accumulate, in bf16 and fp16
//          (and in fp32 for an fp32 run); the ops are compared with the run's dtype's GEMM.
//
//   bench_cuda_ops [--dtype fp32|fp16|bf16] [--quick] [--only NAME] [--batch B] [--seq-len T]
//                  [--channels C] [--heads NH] [--json FILE]
//
// Without a GPU it says so and exits 0: there is nothing to measure.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_main.h"
#include "core/allocator.h"
#include "core/check.h"
#include "kernels/cuda/cuda_allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/rope_table.h"

namespace dstrain {
namespace {

constexpr const char* kUsage =
    "usage: bench_cuda_ops [--dtype fp32|fp16|bf16] [--quick] [--only NAME] [--batch B] "
    "[--seq-len T] [--channels C] [--heads NH] [--json FILE]";

struct Options {
  DType dtype = DType::BF16;
  bool quick = false;
  std::string only;
  int64_t batch = 0, seq_len = 0;  // 0: 8 x 1024 (--quick: 2 x 256)
  int64_t channels = 768, heads = 12;
  std::string json;
};

int64_t parse_positive(const std::string& flag, const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  DSTRAIN_USER_CHECK(end != text && *end == '\0' && value > 0)
      << flag << " takes a positive integer, not '" << text << "'";
  return value;
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--quick") {
      options.quick = true;
    } else if (arg == "--only" && has_value) {
      options.only = argv[++i];
    } else if (arg == "--dtype" && has_value) {
      const std::string name = argv[++i];
      DSTRAIN_USER_CHECK(name == "fp32" || name == "fp16" || name == "bf16")
          << "--dtype takes fp32, fp16 or bf16, not '" << name << "'";
      options.dtype = parse_dtype(name);
    } else if (arg == "--batch" && has_value) {
      options.batch = parse_positive(arg, argv[++i]);
    } else if (arg == "--seq-len" && has_value) {
      options.seq_len = parse_positive(arg, argv[++i]);
    } else if (arg == "--channels" && has_value) {
      options.channels = parse_positive(arg, argv[++i]);
    } else if (arg == "--heads" && has_value) {
      options.heads = parse_positive(arg, argv[++i]);
    } else if (arg == "--json" && has_value) {
      options.json = argv[++i];
    } else {
      DSTRAIN_USER_ERROR() << "unknown argument '" << arg << "' (or a flag without its value); "
                           << kUsage;
    }
  }
  DSTRAIN_USER_CHECK(options.channels % options.heads == 0)
      << "--channels " << options.channels << " is not a multiple of --heads " << options.heads;
  return options;
}

// x[i] = lo + (hi - lo) * u(seed, i), u uniform in [0, 1) from a splitmix64 hash: random data
// made on the device, so a run does not spend its time drawing gigabytes on the host.
__global__ void fill_uniform_kernel(float* x, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    x[i] = lo + (hi - lo) * static_cast<float>(z >> 40) * 0x1p-24f;
  }
}

// Device tensors filled with uniform random values (never zeros), freed at the end.
class Workspace {
 public:
  explicit Workspace(Backend& backend) : backend_(backend), allocator_(make_cuda_allocator(0)) {}

  Tensor random(DType dtype, std::initializer_list<int64_t> dims, float lo = -1.0f,
                float hi = 1.0f) {
    Tensor t = allocate(dtype, dims);
    Buffer staging = allocator_->allocate(MemCategory::Workspace,
                                          static_cast<size_t>(t.numel()) * sizeof(float));
    Tensor device_f32(staging.data(), DType::F32, {t.numel()}, t.device);
    fill_uniform_kernel<<<1024, 256>>>(static_cast<float*>(staging.data()), t.numel(), ++seed_, lo,
                                       hi);
    CUDA_CHECK_LAUNCH();
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
  uint64_t seed_ = 1234;
};

// f with the norms' rows above C elements in blocks of 8 warps, forward and backward
// (set_cuda_norm_block_rows_above: 0 for every row, 2048 for one warp wherever it fits), the
// defaults restored after each call.
std::function<void()> norm_rows_above(int64_t C, std::function<void()> f) {
  return [C, f = std::move(f)] {
    set_cuda_norm_block_rows_above(C);
    f();
    set_cuda_norm_block_rows_above(-1);
  };
}

// f with 32 rows per warp in the tensor-core attention (set_cuda_attention_warp_rows): the
// forward at head dims 64 and 128, the backward at 64; elsewhere the same kernels as without.
// The default 16 restored after each call.
std::function<void()> attention_warp_rows_32(std::function<void()> f) {
  return [f = std::move(f)] {
    set_cuda_attention_warp_rows(32);
    f();
    set_cuda_attention_warp_rows(16);
  };
}

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

// "bf16", "fp16", "fp32": the names of the flags.
const char* flag_name(DType dtype) {
  switch (dtype) {
    case DType::F16:
      return "fp16";
    case DType::BF16:
      return "bf16";
    default:
      return "fp32";
  }
}

// TFLOP/s of an n x n x n cublasGemmEx (C = A B, fp32 accumulate) on random operands.
double gemm_peak_tflops(Workspace& ws, cublasHandle_t cublas, DType dtype, int64_t n, int warmup,
                        int runs) {
  Tensor a = ws.random(dtype, {n, n}), b = ws.random(dtype, {n, n}), c = ws.allocate(dtype, {n, n});
  const float alpha = 1.0f, beta = 0.0f;
  const int dim = static_cast<int>(n);
  const cudaDataType_t type = cuda::cuda_data_type(dtype);
  const double ms = time_ms(
      [&] {
        CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &alpha, a.data,
                                  type, dim, b.data, type, dim, &beta, c.data, type, dim,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      },
      warmup, runs);
  return 2.0 * static_cast<double>(n) * n * n / (ms * 1e-3) / 1e12;
}

struct Op {
  std::string name;
  double bytes, flops;  // one of them: > 0
  std::function<void()> f;
};

// The MoE ops at the shape of a DeepSeekMoE-16B layer (C 2048, 64 routed experts of width 1408,
// top 6) over the run's N tokens, router logits uniform in [-3, 3] (about N k / 64 rows an
// expert), and one dense GEMM of the grouped matmul's rows and FLOPs beside it: what grouping by
// expert costs (the CUDA grouped matmul reads the offsets to the host, then runs one cuBLAS GEMM
// per expert). Bytes as bench_ops.cpp counts them.
std::vector<Op> moe_ops(Workspace& ws, Backend& be, DType dt, int64_t N) {
  constexpr int64_t C = 2048, E = 64, k = 6, I = 1408;
  const int64_t M = N * k;
  const double es = static_cast<double>(dtype_size(dt)), n = static_cast<double>(N);
  const double m = static_cast<double>(M);
  const MoeRouting routing{static_cast<int>(E), static_cast<int>(k), RouterScore::Softmax, false,
                           1.0f};
  Tensor logits = ws.random(dt, {N, E}, -3.0f, 3.0f), dlogits = ws.allocate(dt, {N, E});
  Tensor scores = ws.allocate(DType::F32, {N, E}), weights = ws.allocate(DType::F32, {N, k});
  Tensor dweights = ws.random(DType::F32, {N, k});
  Tensor experts = ws.allocate(DType::I32, {N, k}), offsets = ws.allocate(DType::I32, {E + 1});
  Tensor source = ws.allocate(DType::I32, {M}), dest = ws.allocate(DType::I32, {N, k});
  Tensor x = ws.random(dt, {N, C}), rows = ws.random(dt, {M, C}), out = ws.allocate(dt, {N, C});
  Tensor w_up = ws.random(dt, {E, 2 * I, C}, -0.05f, 0.05f), up = ws.allocate(dt, {M, 2 * I});
  Tensor dw_up = ws.random(dt, {E, 2 * I, C}), drows = ws.allocate(dt, {M, C});
  Tensor dup = ws.random(dt, {M, 2 * I}), dense_w = ws.random(dt, {2 * I, C}, -0.05f, 0.05f);
  Tensor dense_dw = ws.random(dt, {2 * I, C});
  be.moe_route(weights, experts, scores, logits, routing, nullptr);
  be.moe_dispatch(offsets, source, dest, experts, static_cast<int>(E), nullptr);
  be.synchronize(nullptr);
  Backend* b = &be;
  const double flops = 2.0 * m * C * 2 * I;  // the experts' gate and up projections
  return {
      {"moe_route (64 experts, top 6)", es * n * E + 4.0 * n * E + 8.0 * n * k, 0,
       [=] { b->moe_route(weights, experts, scores, logits, routing, nullptr); }},
      {"moe_route_backward", es * n * E + 4.0 * n * E + 8.0 * n * k, 0,
       [=] {
         b->moe_route_backward(dlogits, dweights, Tensor(), scores, experts, routing, nullptr);
       }},
      {"moe_dispatch", 4.0 * 3 * n * k, 0,
       [=] { b->moe_dispatch(offsets, source, dest, experts, static_cast<int>(E), nullptr); }},
      {"moe_gather (C 2048, x6)", es * 2.0 * m * C, 0,
       [=] { b->moe_gather(rows, x, source, nullptr); }},
      {"moe_combine (C 2048, x6)", es * (m + n) * C, 0,
       [=] { b->moe_combine(out, rows, dest, weights, nullptr); }},
      {"moe_combine_backward", es * (n + 2.0 * m) * C, 0,
       [=] { b->moe_combine_backward(drows, Tensor(), out, rows, dest, weights, nullptr); }},
      {"moe grouped_matmul_forward (64 x 2816x2048)", 0, flops,
       [=] { b->grouped_matmul_forward(up, rows, w_up, offsets, nullptr); }},
      {"moe grouped_matmul_backward", 0, 2.0 * flops,
       [=] { b->grouped_matmul_backward(drows, dw_up, dup, rows, w_up, offsets, nullptr); }},
      {"moe dense matmul_forward (same FLOPs)", 0, flops,
       [=] { b->matmul_forward(up, rows, dense_w, Tensor(), true, nullptr); }},
      {"moe dense matmul_backward (same FLOPs)", 0, 2.0 * flops,
       [=] { b->matmul_backward(drows, dense_dw, Tensor(), dup, rows, dense_w, true, nullptr); }},
  };
}

// The FP8 ops (--precision fp8's groundwork) at a LLaMA MLP's shape (C 2048 -> 8192) over the
// run's N tokens: the casts of the activations and of the weights (transposed into the
// K-contiguous form), of an output gradient into both its layouts, the FP8 GEMM with bf16 output,
// and the same GEMM in the run's dtype beside it. The FP8 GEMM needs sm_89 or later: elsewhere, or
// where cuBLASLt refuses it, it is left out.
std::vector<Op> fp8_ops(Workspace& ws, Backend& be, DType dt, int64_t N) {
  constexpr int64_t C = 2048, OC = 8192;
  const double n = static_cast<double>(N), es = static_cast<double>(dtype_size(dt));
  Tensor x = ws.random(dt, {N, C}), w = ws.random(dt, {C, OC}, -0.05f, 0.05f);
  Tensor w_out_by_in = ws.random(dt, {OC, C}, -0.05f, 0.05f);
  Tensor xq = ws.allocate(DType::F8E4M3, {N, C}), wq = ws.allocate(DType::F8E4M3, {OC, C});
  Tensor x_inv = ws.allocate(DType::F32, {1}), w_inv = ws.allocate(DType::F32, {1});
  Tensor out = ws.allocate(DType::BF16, {N, OC}), out_dt = ws.allocate(dt, {N, OC});
  Tensor dy = ws.random(dt, {N, OC}, -1e-3f, 1e-3f), g_inv = ws.allocate(DType::F32, {1});
  Tensor gq = ws.allocate(DType::F8E5M2, {N, OC}), gqt = ws.allocate(DType::F8E5M2, {OC, N});
  be.fp8_quantize(xq, Tensor(), x_inv, x, Tensor(), nullptr);
  be.fp8_quantize(Tensor(), wq, w_inv, w, Tensor(), nullptr);
  be.synchronize(nullptr);
  Backend* b = &be;
  const double flops = 2.0 * n * C * OC;
  std::vector<Op> ops = {
      {"fp8_quantize x (C 2048)", es * n * C + n * C, 0,
       [=] { b->fp8_quantize(xq, Tensor(), x_inv, x, Tensor(), nullptr); }},
      {"fp8_quantize w^T (2048x8192)", es * C * OC + 1.0 * C * OC, 0,
       [=] { b->fp8_quantize(Tensor(), wq, w_inv, w, Tensor(), nullptr); }},
      {"fp8_quantize dout both layouts (8192 wide)", es * n * OC + 2.0 * n * OC, 0,
       [=] { b->fp8_quantize(gq, gqt, g_inv, dy, Tensor(), nullptr); }},
      {"matmul_forward (2048->8192)", 0, flops,
       [=] { b->matmul_forward(out_dt, x, w_out_by_in, Tensor(), true, nullptr); }},
  };
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major * 10 + prop.minor < 89) return ops;
  try {  // once untimed: a GEMM cuBLASLt refuses is said, and the other ops still run
    be.matmul_fp8(out, xq, x_inv, wq, w_inv, Tensor(), false, nullptr);
    be.synchronize(nullptr);
  } catch (const Error& error) {
    std::printf("matmul_fp8 left out: %s\n", error.what());
    return ops;
  }
  ops.push_back({"matmul_fp8 e4m3 (2048->8192)", 0, flops,
                 [=] { b->matmul_fp8(out, xq, x_inv, wq, w_inv, Tensor(), false, nullptr); }});
  return ops;
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
  const int64_t B = options.batch ? options.batch : (options.quick ? 2 : 8);
  const int64_t T = options.seq_len ? options.seq_len : (options.quick ? 256 : 1024);
  const int64_t C = options.channels, NH = options.heads, V = 50257, Vp = 50304, N = B * T;
  const int warmup = 2, runs = options.quick ? 3 : 10;
  Workspace ws(be);
  std::printf("device: %s\nshapes: B=%ld T=%ld C=%ld NH=%ld Vp=%ld, dtype %s\n\n",
              be.name().c_str(), static_cast<long>(B), static_cast<long>(T), static_cast<long>(C),
              static_cast<long>(NH), static_cast<long>(Vp), dtype_name(dt));

  // ---- peaks, measured in this run ----
  const int64_t copy_bytes = options.quick ? (int64_t{256} << 20) : (int64_t{2} << 30);
  Tensor copy_src = ws.random(DType::F32, {copy_bytes / 4});
  Tensor copy_dst = ws.allocate(DType::F32, {copy_bytes / 4});
  const double copy_ms = time_ms(
      [&] {
        CUDA_CHECK(cudaMemcpyAsync(copy_dst.data, copy_src.data, static_cast<size_t>(copy_bytes),
                                   cudaMemcpyDeviceToDevice, nullptr));
      },
      warmup, runs);
  const double peak_gbs = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e-3) / 1e9;
  const int64_t G = options.quick ? 2048 : 8192;
  cublasHandle_t cublas;
  CUBLAS_CHECK(cublasCreate(&cublas));
  std::vector<DType> gemm_dtypes = {DType::BF16, DType::F16};
  if (dt == DType::F32) gemm_dtypes.push_back(DType::F32);
  nlohmann::json peaks{{"copy_bytes", copy_bytes}, {"copy_gb_per_s", peak_gbs}, {"gemm_n", G}};
  double peak_tflops = 0;
  std::printf("peak copy  (%ld MiB device to device, cudaMemcpyAsync): %8.1f GB/s (read + write)\n",
              static_cast<long>(copy_bytes >> 20), peak_gbs);
  for (DType gemm_dtype : gemm_dtypes) {
    const double tflops = gemm_peak_tflops(ws, cublas, gemm_dtype, G, warmup, runs);
    if (gemm_dtype == dt) peak_tflops = tflops;
    peaks[std::string("gemm_tflops_") + flag_name(gemm_dtype)] = tflops;
    std::printf("peak GEMM  (%ld^3 %s, cublasGemmEx, fp32 accumulate):   %8.1f TFLOP/s%s\n",
                static_cast<long>(G), dtype_name(gemm_dtype), tflops,
                gemm_dtype == dt ? "  <- the ops' reference" : "");
  }
  CUBLAS_CHECK(cublasDestroy(cublas));
  std::printf("\n");

  // ---- the ops ----
  Tensor tokens = ws.ids({B, T}, V), targets = ws.ids({B, T}, V);
  Tensor wte = ws.random(dt, {Vp, C}), wpe = ws.random(dt, {T, C});
  Tensor x = ws.random(dt, {B, T, C}), dx = ws.random(dt, {B, T, C}),
         y = ws.allocate(dt, {B, T, C});
  Tensor ln_w = ws.random(dt, {C}), ln_b = ws.random(dt, {C});
  Tensor mean = ws.allocate(DType::F32, {N}), rstd = ws.allocate(DType::F32, {N});
  // Parameter gradients in the working dtype: what ShardedModel hands the backward.
  Tensor dwte = ws.random(dt, {Vp, C}), dwpe = ws.random(dt, {T, C});
  Tensor dln_w = ws.random(dt, {C}), dln_b = ws.random(dt, {C});
  Tensor qkv = ws.random(dt, {B, T, 3 * C}), dqkv = ws.random(dt, {B, T, 3 * C});
  Tensor w_qkv = ws.random(dt, {C, 3 * C}), b_qkv = ws.random(dt, {3 * C});
  Tensor dw_qkv = ws.random(dt, {C, 3 * C}), db_qkv = ws.random(dt, {3 * C});
  Tensor w_proj = ws.random(dt, {C, C}), b_proj = ws.random(dt, {C});
  Tensor dw_proj = ws.random(dt, {C, C}), db_proj = ws.random(dt, {C});
  Tensor w_fc = ws.random(dt, {C, 4 * C}), b_fc = ws.random(dt, {4 * C});
  Tensor dw_fc = ws.random(dt, {C, 4 * C}), db_fc = ws.random(dt, {4 * C});
  Tensor w_fcp = ws.random(dt, {4 * C, C}), b_fcp = ws.random(dt, {C});
  Tensor dw_fcp = ws.random(dt, {4 * C, C}), db_fcp = ws.random(dt, {C});
  Tensor fc = ws.random(dt, {B, T, 4 * C}, -3.0f, 3.0f), dfc = ws.random(dt, {B, T, 4 * C});
  Tensor fc_out = ws.allocate(dt, {B, T, 4 * C}), fc_gelu = ws.allocate(dt, {B, T, 4 * C});
  // LLaMA's MLP at GPT-2's width, I = 4C: [gate | up] (B,T,2I) from one stacked GEMM.
  Tensor gate_up = ws.random(dt, {B, T, 8 * C}, -4.0f, 4.0f);
  Tensor dgate_up = ws.allocate(dt, {B, T, 8 * C});
  Tensor att = ws.allocate(dt, {B, T, C}), lse = ws.allocate(DType::F32, {B, NH, T});
  Tensor logits = ws.random(dt, {N, Vp}, -4.0f, 4.0f), losses = ws.allocate(DType::F32, {N});
  // Vocabulary-parallel cross-entropy at tp 2: this rank's (N, Vp / 2) half of the logits.
  Tensor half_logits = logits.slice(0, {N, Vp / 2});
  Tensor stats = ws.allocate(DType::F32, {2, N, 3});
  const int64_t P = 124'000'000 / (options.quick ? 10 : 1);
  Tensor param = ws.random(DType::F32, {P}), grad = ws.random(dt, {P}),
         m = ws.random(DType::F32, {P});
  Tensor v = ws.random(DType::F32, {P}, 0.0f, 1.0f), param_copy = ws.allocate(dt, {P});
  be.layernorm_forward(y, mean, rstd, x, ln_w, ln_b, nullptr);
  be.attention_forward(att, lse, qkv, static_cast<int>(NH), static_cast<int>(NH), nullptr);
  // The rotary table (T, hd/2, 2) for hd = C / NH, rope_theta 10000, built on the host once.
  Tensor freqs = ws.allocate(DType::F32, {T, C / NH / 2, 2});
  const std::vector<float> rope_host = rope_table(T, C / NH, 10000.0);
  be.copy_bytes(freqs.data, rope_host.data(), rope_host.size() * sizeof(float), nullptr);
  be.synchronize(nullptr);
  AdamWStep step;
  step.lr = 1e-4f;
  step.weight_decay = 0.1f;

  // The same 124M parameters as the ~150 tensors of a GPT-2 124M step, for the multi-tensor ops
  // (one launch over all of them; the per-step loop over blocks made one call per tensor). The
  // pieces start at multiples of 8 elements, as GPT-2's tensors (sizes multiples of 8) lie in
  // the training's buffers: with P * i / 150 only 24 of them were 16-byte aligned, so the row
  // of 2026-11-26 (H200, 49% of the copy peak) timed mostly the element-by-element path.
  constexpr int kPieces = 150;
  const auto boundary = [&](int i) { return i == kPieces ? P : P * i / kPieces / 8 * 8; };
  std::vector<AdamWTensors> adam_pieces;
  std::vector<GradientTensor> grad_pieces;
  for (int i = 0; i < kPieces; ++i) {
    const int64_t begin = boundary(i), count = boundary(i + 1) - begin;
    const auto piece = [&](const Tensor& t) { return t.slice(begin, {count}); };
    adam_pieces.push_back(
        {piece(param), piece(grad), piece(m), piece(v), piece(param_copy), i % 2 ? 0.1f : 0.0f});
    grad_pieces.push_back({piece(grad), true});
  }
  Tensor residual = ws.allocate(dt, {B, T, C});

  const double act = static_cast<double>(N * C * es);
  const int nh = static_cast<int>(NH);  // multi-head: n_kv_head = n_head
  const double attention_flops = 4.0 * B * NH * static_cast<double>(T) * T * (C / NH) * 0.5;
  const double nd = static_cast<double>(N), cd = static_cast<double>(C);
  std::vector<Op> ops = {
      {"embedding_forward", 3 * act, 0,
       [&] { be.embedding_forward(y, tokens, wte, wpe, 0, Vp, nullptr); }},
      {"embedding_backward", act + 2.0 * N * C * es, 0,
       [&] { be.embedding_backward(dwte, dwpe, dx, tokens, 0, Vp, nullptr); }},
      {"layernorm_forward", 2 * act + 8.0 * N, 0,
       [&] { be.layernorm_forward(y, mean, rstd, x, ln_w, ln_b, nullptr); }},
      {"layernorm_backward", 4 * act + 8.0 * N, 0,
       [&] { be.layernorm_backward(y, dln_w, dln_b, dx, x, ln_w, mean, rstd, nullptr); }},
      {"rmsnorm_forward", 2 * act + 4.0 * N, 0,
       [&] { be.rmsnorm_forward(y, rstd, x, ln_w, 1e-5f, nullptr); }},
      // Fused: reads a and b, writes the residual and the normalized rows.
      {"residual_layernorm_forward", 4 * act + 8.0 * N, 0,
       [&] { be.residual_layernorm_forward(residual, y, mean, rstd, x, dx, ln_w, ln_b, nullptr); }},
      {"residual_rmsnorm_forward", 4 * act + 4.0 * N, 0,
       [&] { be.residual_rmsnorm_forward(residual, y, rstd, x, dx, ln_w, 1e-5f, nullptr); }},
      {"rmsnorm_backward", 4 * act + 4.0 * N, 0,
       [&] { be.rmsnorm_backward(y, dln_w, dx, x, ln_w, rstd, nullptr); }},
      // The same norms with every row in a block of 8 warps (the form of C > 2048), and the
      // backwards with every row of C <= 2048 in one warp (the default only up to 1024): against
      // the rows above, to choose the bounds between the two forms.
      {"layernorm_forward (8 warps per row)", 2 * act + 8.0 * N, 0,
       norm_rows_above(0, [&] { be.layernorm_forward(y, mean, rstd, x, ln_w, ln_b, nullptr); })},
      {"layernorm_backward (8 warps per row)", 4 * act + 8.0 * N, 0,
       norm_rows_above(
           0, [&] { be.layernorm_backward(y, dln_w, dln_b, dx, x, ln_w, mean, rstd, nullptr); })},
      {"layernorm_backward (one warp per row)", 4 * act + 8.0 * N, 0,
       norm_rows_above(
           2048,
           [&] { be.layernorm_backward(y, dln_w, dln_b, dx, x, ln_w, mean, rstd, nullptr); })},
      {"rmsnorm_forward (8 warps per row)", 2 * act + 4.0 * N, 0,
       norm_rows_above(0, [&] { be.rmsnorm_forward(y, rstd, x, ln_w, 1e-5f, nullptr); })},
      {"rmsnorm_backward (8 warps per row)", 4 * act + 4.0 * N, 0,
       norm_rows_above(0, [&] { be.rmsnorm_backward(y, dln_w, dx, x, ln_w, rstd, nullptr); })},
      {"rmsnorm_backward (one warp per row)", 4 * act + 4.0 * N, 0,
       norm_rows_above(2048, [&] { be.rmsnorm_backward(y, dln_w, dx, x, ln_w, rstd, nullptr); })},
      {"matmul_forward qkv (C->3C)", 0, 2.0 * nd * cd * 3 * cd,
       [&] { be.matmul_forward(qkv, x, w_qkv, b_qkv, false, nullptr); }},
      {"matmul_backward qkv", 0, 4.0 * nd * cd * 3 * cd,
       [&] { be.matmul_backward(y, dw_qkv, db_qkv, dqkv, x, w_qkv, false, nullptr); }},
      {"matmul_forward attn_proj (C->C)", 0, 2.0 * nd * cd * cd,
       [&] { be.matmul_forward(y, att, w_proj, b_proj, false, nullptr); }},
      {"matmul_backward attn_proj", 0, 4.0 * nd * cd * cd,
       [&] { be.matmul_backward(dx, dw_proj, db_proj, y, att, w_proj, false, nullptr); }},
      {"matmul_forward fc (C->4C)", 0, 2.0 * nd * cd * 4 * cd,
       [&] { be.matmul_forward(fc_out, x, w_fc, b_fc, false, nullptr); }},
      // The GEMM's FLOPs only: compare with matmul_forward fc + gelu_forward.
      {"matmul_gelu_forward fc (C->4C)", 0, 2.0 * nd * cd * 4 * cd,
       [&] { be.matmul_gelu_forward(fc_gelu, fc_out, x, w_fc, b_fc, nullptr); }},
      {"matmul_backward fc", 0, 4.0 * nd * cd * 4 * cd,
       [&] { be.matmul_backward(dx, dw_fc, db_fc, dfc, x, w_fc, false, nullptr); }},
      {"matmul_forward fc_proj (4C->C)", 0, 2.0 * nd * 4 * cd * cd,
       [&] { be.matmul_forward(y, fc, w_fcp, b_fcp, false, nullptr); }},
      {"matmul_backward fc_proj", 0, 4.0 * nd * 4 * cd * cd,
       [&] { be.matmul_backward(dfc, dw_fcp, db_fcp, dx, fc, w_fcp, false, nullptr); }},
      {"matmul_forward lm_head (C->Vp)", 0, 2.0 * nd * cd * Vp,
       [&] { be.matmul_forward(logits, x, wte, Tensor(), true, nullptr); }},
      {"matmul_backward lm_head", 0, 4.0 * nd * cd * Vp,
       [&] { be.matmul_backward(y, dwte, Tensor(), logits, x, wte, true, nullptr); }},
      {"attention_forward", 0, attention_flops,
       [&] { be.attention_forward(att, lse, qkv, nh, nh, nullptr); }},
      {"attention_forward (32 rows per warp)", 0, attention_flops,
       attention_warp_rows_32([&] { be.attention_forward(att, lse, qkv, nh, nh, nullptr); })},
      {"attention_backward", 0, 2.5 * attention_flops,
       [&] { be.attention_backward(dqkv, dx, qkv, att, lse, nh, nh, nullptr); }},
      {"attention_backward (32 rows per warp)", 0, 2.5 * attention_flops,
       attention_warp_rows_32(
           [&] { be.attention_backward(dqkv, dx, qkv, att, lse, nh, nh, nullptr); })},
      // In place on the q and k heads (2C of each 3C row), read and written once; the table once.
      {"rope_forward (q, k heads)", 4 * act + 4.0 * rope_host.size(), 0,
       [&] { be.rope_forward(qkv, freqs, nh, nh, nullptr); }},
      {"rope_backward (q, k heads)", 4 * act + 4.0 * rope_host.size(), 0,
       [&] { be.rope_backward(dqkv, freqs, nh, nh, nullptr); }},
      {"gelu_forward (4C)", 8 * act, 0, [&] { be.gelu_forward(fc_out, fc, nullptr); }},
      {"gelu_backward (4C)", 12 * act, 0, [&] { be.gelu_backward(fc_out, dfc, fc, nullptr); }},
      // The same with the fc bias's column sums in its pass (the bytes of the GELU alone: the
      // partials are 1/128 of a row per row).
      {"gelu_backward_bias (4C)", 12 * act, 0,
       [&] { be.gelu_backward_bias(fc_out, db_fc, dfc, fc, nullptr); }},
      // Reads [gate | up] (2I = 8C), writes I = 4C; backward also reads dout, writes 2I.
      {"swiglu_forward (I = 4C)", 12 * act, 0,
       [&] { be.swiglu_forward(fc_out, gate_up, Tensor(), nullptr); }},
      {"swiglu_backward (I = 4C)", 20 * act, 0,
       [&] { be.swiglu_backward(dgate_up, dfc, gate_up, Tensor(), nullptr); }},
      {"residual_forward", 3 * act, 0, [&] { be.residual_forward(y, x, dx, nullptr); }},
      {"accumulate", 3 * act, 0, [&] { be.accumulate(y, x, nullptr); }},
      {"add_bias", 2 * act, 0, [&] { be.add_bias(y, ln_b, nullptr); }},
      {"softmax_cross_entropy (in place)", 2.0 * N * Vp * es + 8.0 * N, 0,
       [&] {
         be.softmax_cross_entropy(losses, logits, logits, targets, static_cast<int>(V), 1.0f / N,
                                  nullptr);
       }},
      {"cross_entropy_stats (tp 2: Vp / 2 columns)", 1.0 * N * Vp / 2 * es + 16.0 * N, 0,
       [&] {
         be.cross_entropy_stats(stats.slice(0, {N, 3}), half_logits, targets, 0,
                                static_cast<int>(V), nullptr);
       }},
      {"cross_entropy_from_stats (tp 2, in place)", 2.0 * N * Vp / 2 * es + 32.0 * N, 0,
       [&] {
         be.cross_entropy_from_stats(losses, half_logits, half_logits, stats, targets, 0,
                                     static_cast<int>(V), 1.0f / N, nullptr);
       }},
      {"adamw (124M params)", P * (24.0 + 2.0 * es), 0,
       [&] { be.adamw(param, grad, m, v, param_copy, step, nullptr); }},
      {"sum_squares (124M)", static_cast<double>(P * es), 0,
       [&] { (void)be.sum_squares(grad, nullptr); }},
      {"has_inf_or_nan (124M)", static_cast<double>(P * es), 0,
       [&] { (void)be.has_inf_or_nan(grad, nullptr); }},
      {"adamw_multi (124M in 150 buffers)", P * (24.0 + 2.0 * es), 0,
       [&] { be.adamw_multi(adam_pieces, step, nullptr); }},
      {"gradient_stats (124M in 150 buffers)", static_cast<double>(P * es), 0,
       [&] { (void)be.gradient_stats(grad_pieces, nullptr); }},
  };
  for (Op& op : moe_ops(ws, be, dt, N)) ops.push_back(std::move(op));
  for (Op& op : fp8_ops(ws, be, dt, N)) ops.push_back(std::move(op));
  std::printf("%-34s %10s %20s %24s\n", "op", "ms", "achieved", "of the measured peak");
  nlohmann::json rows = nlohmann::json::array();
  for (const Op& op : ops) {
    if (!options.only.empty() && op.name.find(options.only) == std::string::npos) continue;
    const double ms = time_ms(op.f, warmup, runs);
    nlohmann::json row{{"op", op.name}, {"ms", ms}};
    if (op.flops > 0) {
      const double tflops = op.flops / (ms * 1e-3) / 1e12;
      std::printf("%-34s %10.3f %12.1f TFLOP/s %6.1f%% of GEMM peak\n", op.name.c_str(), ms, tflops,
                  100.0 * tflops / peak_tflops);
      row["tflops"] = tflops;
      row["fraction_of_peak"] = tflops / peak_tflops;
    } else {
      const double gbs = op.bytes / (ms * 1e-3) / 1e9;
      std::printf("%-34s %10.3f %12.1f GB/s    %6.1f%% of copy peak\n", op.name.c_str(), ms, gbs,
                  100.0 * gbs / peak_gbs);
      row["gb_per_s"] = gbs;
      row["fraction_of_peak"] = gbs / peak_gbs;
    }
    std::fflush(stdout);
    rows.push_back(row);
  }
  be.synchronize(nullptr);
  std::printf(
      "\nms: median of %d runs after %d warm-up runs (CUDA events). GB/s: the bytes an op must "
      "read and write at least, once each; TFLOP/s: 2 per multiply-add, causal attention half "
      "the square, its backward 2.5x forward.\n",
      runs, warmup);
  if (!options.json.empty()) {
    const nlohmann::json out{{"program", "bench_cuda_ops"},
                             {"device", be.name()},
                             {"dtype", flag_name(dt)},
                             {"shape", {{"B", B}, {"T", T}, {"C", C}, {"NH", NH}, {"Vp", Vp}}},
                             {"peaks", peaks},
                             {"ops", rows}};
    std::ofstream file(options.json);
    file << out.dump(2) << "\n";
    DSTRAIN_USER_CHECK(file.good()) << "cannot write --json " << options.json;
  }
  return 0;
}

}  // namespace
}  // namespace dstrain

int main(int argc, char** argv) {
  return dstrain::benchmark_main("bench_cuda_ops",
                                 [&] { dstrain::run(dstrain::parse_options(argc, argv)); });
}
