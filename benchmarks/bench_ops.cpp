// bench_ops: times every op of the CPU backend, forward and backward, at GPT-2 124M shapes
// (B=4, T=256, C=768, NH=12, V=50257 padded to Vp=50304; the mixture-of-experts ops with 8
// experts of width C, top 2, beside a dense GEMM of the same FLOPs) on random data, and prints
// a table: the median of several runs after a warm-up, with GFLOP/s for matmul and attention (FLOPs
// from the shape) and GB/s for the memory-bound ops (the bytes the op must read and write
// at least, once each).
//
//   bench_ops [--threads N] [--quick] [--dtype fp32|fp16|bf16] [--only NAME]
//
// --quick uses small shapes (B=2, T=64, C=256, NH=4, Vp=8192) for a smoke run; --only runs
// just the ops whose name contains NAME (e.g. "lm_head", "attention").
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/check.h"
#include "kernels/ops.h"
#include "kernels/rope_table.h"
#include "benchmarks/bench_main.h"

namespace dstrain {
namespace {

struct Options {
  int threads = 0;  // 0: all cores
  bool quick = false;
  DType dtype = DType::F32;
  std::string only;  // run only the ops whose name contains this
};

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      options.quick = true;
    } else if (arg == "--threads" && i + 1 < argc) {
      char* end = nullptr;
      const long threads = std::strtol(argv[++i], &end, 10);
      DSTRAIN_USER_CHECK(*end == '\0' && threads >= 0 && threads <= 4096)
          << "--threads takes a count >= 0 (0: all cores), not '" << argv[i] << "'";
      options.threads = static_cast<int>(threads);
    } else if (arg == "--only" && i + 1 < argc) {
      options.only = argv[++i];
    } else if (arg == "--dtype" && i + 1 < argc) {
      options.dtype = parse_dtype(argv[++i]);
      DSTRAIN_USER_CHECK(options.dtype != DType::I32) << "--dtype takes fp32, fp16 or bf16";
    } else {
      DSTRAIN_USER_ERROR() << "unknown argument '" << arg
                           << "'; usage: bench_ops [--threads N] [--quick] "
                              "[--dtype fp32|fp16|bf16] [--only NAME]";
    }
  }
  return options;
}

struct Shapes {
  int64_t B, T, C, NH, V, Vp, maxT;
  int64_t N() const { return B * T; }
};

// Allocates tensors through the CPU allocator and fills them with random values (never zeros).
class Workspace {
 public:
  explicit Workspace(Backend& backend) : backend_(backend), allocator_(make_cpu_allocator()) {}

  Tensor random(DType dtype, std::initializer_list<int64_t> dims, float lo = -1.0f,
                float hi = 1.0f) {
    Tensor t = allocate(dtype, dims);
    std::vector<float> values(static_cast<size_t>(t.numel()));
    for (float& v : values) v = lo + (hi - lo) * next_unit();
    Tensor host(values.data(), DType::F32, {t.numel()});
    backend_.copy(t.reshape({t.numel()}), host, nullptr);
    return t;
  }
  Tensor ids(std::initializer_list<int64_t> dims, int64_t vocab) {
    Tensor t = allocate(DType::I32, dims);
    int32_t* data = t.i32();
    for (int64_t i = 0; i < t.numel(); ++i) {
      data[i] = static_cast<int32_t>(next_unit() * static_cast<float>(vocab)) %
                static_cast<int32_t>(vocab);
    }
    return t;
  }
  Tensor allocate(DType dtype, std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    buffers_.push_back(
        allocator_->allocate(MemCategory::Workspace, static_cast<size_t>(n) * dtype_size(dtype)));
    return buffers_.back().view(dtype, dims);
  }
  void release() { buffers_.clear(); }

 private:
  float next_unit() {  // xorshift64*: fast enough for 40M values
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return static_cast<float>((state_ * 0x2545F4914F6CDD1DULL) >> 40) * 0x1p-24f;
  }

  Backend& backend_;
  std::unique_ptr<Allocator> allocator_;
  std::vector<Buffer> buffers_;
  uint64_t state_ = 0x9E3779B97F4A7C15ULL;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One warm-up, then at least 3 runs and until 0.3 s have passed (at most 25); the median.
double median_ms(const std::function<void()>& op) {
  op();
  std::vector<double> times;
  const auto begin = std::chrono::steady_clock::now();
  while (times.size() < 3 || (seconds_since(begin) < 0.3 && times.size() < 25)) {
    const auto start = std::chrono::steady_clock::now();
    op();
    times.push_back(seconds_since(start) * 1e3);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

enum class Rate { Flops, Bytes };

// Times one op and prints its row, unless --only leaves it out.
struct Reporter {
  std::string only;

  void operator()(const char* op, const std::string& shape, const std::function<void()>& run,
                  Rate rate, double amount) const {
    if (!only.empty() && std::string(op).find(only) == std::string::npos) return;
    const double ms = median_ms(run);
    const double per_second = amount / (ms * 1e-3) / 1e9;
    std::printf("%-24s %-34s %10.3f %9.1f %s\n", op, shape.c_str(), ms, per_second,
                rate == Rate::Flops ? "GFLOP/s" : "GB/s");
    std::fflush(stdout);
  }
};

std::string shape_of(std::initializer_list<int64_t> dims) {
  std::string s = "(";
  for (int64_t d : dims) s += (s.size() > 1 ? "," : "") + std::to_string(d);
  return s + ")";
}

void run_benchmarks(const Options& options) {
  const Shapes s = options.quick ? Shapes{2, 64, 256, 4, 8000, 8192, 64}
                                 : Shapes{4, 256, 768, 12, 50257, 50304, 1024};
  auto backend = make_cpu_backend(options.threads);
  const DType dt = options.dtype;
  const double es = static_cast<double>(dtype_size(dt));  // bytes per stored element
  const int64_t B = s.B, T = s.T, C = s.C, N = s.N(), Vp = s.Vp;
  std::printf("bench_ops: %s, storage %s, B=%lld T=%lld C=%lld NH=%lld Vp=%lld\n",
              backend->name().c_str(), dtype_name(dt), static_cast<long long>(B),
              static_cast<long long>(T), static_cast<long long>(C), static_cast<long long>(s.NH),
              static_cast<long long>(Vp));
  std::printf("%-24s %-34s %10s %17s\n", "op", "shape", "ms", "rate");
  Workspace ws(*backend);
  const Reporter report{options.only};

  // ---- embedding ----
  {
    Tensor tokens = ws.ids({B, T}, s.V);
    Tensor wte = ws.random(dt, {Vp, C}), wpe = ws.random(dt, {s.maxT, C});
    Tensor out = ws.allocate(dt, {B, T, C});
    Tensor dwte = ws.random(dt, {Vp, C}), dwpe = ws.random(dt, {s.maxT, C});
    const std::string shape = shape_of({B, T, C});
    report(
        "embedding_fwd", shape, [&] { backend->embedding_forward(out, tokens, wte, wpe, 0, wte.size(0), nullptr); },
        Rate::Bytes, es * (N * C * 2.0 + T * C));
    report(
        "embedding_bwd", shape,
        [&] { backend->embedding_backward(dwte, dwpe, out, tokens, 0, dwte.size(0), nullptr); }, Rate::Bytes,
        es * (N * C * 3.0 + 2.0 * T * C));
    ws.release();
  }
  // ---- layernorm ----
  {
    Tensor inp = ws.random(dt, {N, C}, 1.0f, 3.0f), weight = ws.random(dt, {C}),
           bias = ws.random(dt, {C});
    Tensor out = ws.allocate(dt, {N, C}), mean = ws.allocate(DType::F32, {N}),
           rstd = ws.allocate(DType::F32, {N});
    Tensor dout = ws.random(dt, {N, C}), dinp = ws.random(dt, {N, C}), dweight = ws.random(dt, {C}),
           dbias = ws.random(dt, {C});
    const std::string shape = shape_of({N, C});
    report(
        "layernorm_fwd", shape,
        [&] { backend->layernorm_forward(out, mean, rstd, inp, weight, bias, nullptr); },
        Rate::Bytes, es * 2.0 * N * C + 8.0 * N);
    backend->layernorm_forward(out, mean, rstd, inp, weight, bias, nullptr);
    report(
        "layernorm_bwd", shape,
        [&] {
          backend->layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, nullptr);
        },
        Rate::Bytes, es * 4.0 * N * C + 8.0 * N);
    ws.release();
  }
  // ---- RMSNorm, SwiGLU (LLaMA) at GPT-2's widths: C, and I = 4C (the GELU MLP's width) ----
  {
    Tensor inp = ws.random(dt, {N, C}), weight = ws.random(dt, {C});
    Tensor out = ws.allocate(dt, {N, C}), rstd = ws.allocate(DType::F32, {N});
    Tensor dout = ws.random(dt, {N, C}), dinp = ws.random(dt, {N, C}), dweight = ws.random(dt, {C});
    const std::string shape = shape_of({N, C});
    report(
        "rmsnorm_fwd", shape,
        [&] { backend->rmsnorm_forward(out, rstd, inp, weight, 1e-5f, nullptr); }, Rate::Bytes,
        es * 2.0 * N * C + 4.0 * N);
    backend->rmsnorm_forward(out, rstd, inp, weight, 1e-5f, nullptr);
    report(
        "rmsnorm_bwd", shape,
        [&] { backend->rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, nullptr); },
        Rate::Bytes, es * 4.0 * N * C + 4.0 * N);
    ws.release();
  }
  {
    const int64_t I = 4 * C;
    Tensor inp = ws.random(dt, {N, 2 * I}, -4.0f, 4.0f), dout = ws.random(dt, {N, I});
    Tensor out = ws.allocate(dt, {N, I}), dinp = ws.allocate(dt, {N, 2 * I});
    const std::string shape = shape_of({N, 2 * I});
    // Forward reads [gate | up] and writes out; backward also reads dout and writes both halves.
    report(
        "swiglu_fwd", shape, [&] { backend->swiglu_forward(out, inp, Tensor(), nullptr); },
        Rate::Bytes, es * 3.0 * N * I);
    report(
        "swiglu_bwd", shape, [&] { backend->swiglu_backward(dinp, dout, inp, Tensor(), nullptr); },
        Rate::Bytes, es * 5.0 * N * I);
    ws.release();
  }
  // ---- matmuls of a block and the LM head ----
  struct MatmulCase {
    const char* name;
    int64_t in, out;
    bool bias, out_by_in;
  };
  const MatmulCase matmuls[] = {{"qkv", C, 3 * C, true, false},
                                {"attn_proj", C, C, true, false},
                                {"fc", C, 4 * C, true, false},
                                {"fc_proj", 4 * C, C, true, false},
                                {"lm_head", C, Vp, false, true}};
  for (const MatmulCase& m : matmuls) {
    Tensor inp = ws.random(dt, {N, m.in}), dout = ws.random(dt, {N, m.out});
    Tensor weight = m.out_by_in ? ws.random(dt, {m.out, m.in}) : ws.random(dt, {m.in, m.out});
    Tensor dweight = m.out_by_in ? ws.random(dt, {m.out, m.in}) : ws.random(dt, {m.in, m.out});
    Tensor bias = m.bias ? ws.random(dt, {m.out}) : Tensor();
    Tensor dbias = m.bias ? ws.random(dt, {m.out}) : Tensor();
    Tensor out = ws.allocate(dt, {N, m.out}), dinp = ws.allocate(dt, {N, m.in});
    const double flops = 2.0 * N * m.in * m.out;
    const std::string shape = shape_of({N, m.in}) + "x" + shape_of({m.in, m.out});
    report((std::string("matmul_fwd ") + m.name).c_str(), shape,
           [&] { backend->matmul_forward(out, inp, weight, bias, m.out_by_in, nullptr); },
           Rate::Flops, flops);
    report((std::string("matmul_bwd ") + m.name).c_str(), shape,
           [&] {
             backend->matmul_backward(dinp, dweight, dbias, dout, inp, weight, m.out_by_in,
                                      nullptr);
           },
           Rate::Flops, 2.0 * flops);
    ws.release();
  }
  // ---- attention ----
  {
    const int64_t hd = C / s.NH;
    Tensor qkv = ws.random(dt, {B, T, 3 * C}), dout = ws.random(dt, {B, T, C});
    Tensor out = ws.allocate(dt, {B, T, C}), lse = ws.allocate(DType::F32, {B, s.NH, T});
    Tensor dqkv = ws.allocate(dt, {B, T, 3 * C});
    // Causal: T(T+1)/2 (query, key) pairs per head; forward 2 matmuls (QK^T, PV) of 2*hd
    // flops per pair, backward 5 (QK^T again, dV, dP, dQ, dK).
    const double pairs = static_cast<double>(B * s.NH) * T * (T + 1) / 2.0;
    const std::string shape = shape_of({B, T, 3 * C}) + " NH=" + std::to_string(s.NH);
    const int nh = static_cast<int>(s.NH);
    report(
        "attention_fwd", shape,
        [&] { backend->attention_forward(out, lse, qkv, nh, nh, nullptr); }, Rate::Flops,
        pairs * 4.0 * hd);
    report(
        "attention_bwd", shape,
        [&] { backend->attention_backward(dqkv, dout, qkv, out, lse, nh, nh, nullptr); },
        Rate::Flops, pairs * 10.0 * hd);
    ws.release();
  }
  // ---- rotary position embedding, in place on the q and k heads (KV = NH: GPT-2's shape) ----
  {
    const int64_t hd = C / s.NH;
    Tensor qkv = ws.random(dt, {B, T, 3 * C});
    Tensor freqs = ws.allocate(DType::F32, {T, hd / 2, 2});
    fill_rope_table(freqs.f32(), T, rope_inv_freq(hd, 10000.0));
    const std::string shape = shape_of({B, T, 3 * C}) + " NH=KV=" + std::to_string(s.NH);
    const int nh = static_cast<int>(s.NH);
    // Reads and writes the 2C q and k columns of each row once; the table once.
    const double bytes = es * 2.0 * N * 2 * C + 4.0 * T * hd;
    report(
        "rope_fwd", shape, [&] { backend->rope_forward(qkv, freqs, nh, nh, nullptr); },
        Rate::Bytes, bytes);
    report(
        "rope_bwd", shape, [&] { backend->rope_backward(qkv, freqs, nh, nh, nullptr); },
        Rate::Bytes, bytes);
    ws.release();
  }
  // ---- GELU, residual ----
  {
    Tensor inp = ws.random(dt, {N, 4 * C}, -4.0f, 4.0f), dout = ws.random(dt, {N, 4 * C});
    Tensor out = ws.allocate(dt, {N, 4 * C}), dinp = ws.allocate(dt, {N, 4 * C});
    const std::string shape = shape_of({N, 4 * C});
    report(
        "gelu_fwd", shape, [&] { backend->gelu_forward(out, inp, nullptr); }, Rate::Bytes,
        es * 2.0 * N * 4 * C);
    report(
        "gelu_bwd", shape, [&] { backend->gelu_backward(dinp, dout, inp, nullptr); }, Rate::Bytes,
        es * 3.0 * N * 4 * C);
    ws.release();
    Tensor a = ws.random(dt, {N, C}), b = ws.random(dt, {N, C}), sum = ws.allocate(dt, {N, C});
    report(
        "residual_fwd", shape_of({N, C}), [&] { backend->residual_forward(sum, a, b, nullptr); },
        Rate::Bytes, es * 3.0 * N * C);
    report(
        "accumulate", shape_of({N, C}), [&] { backend->accumulate(a, b, nullptr); }, Rate::Bytes,
        es * 3.0 * N * C);
    ws.release();
  }
  // ---- softmax + cross-entropy ----
  {
    Tensor logits = ws.random(dt, {N, Vp}, -5.0f, 5.0f), dlogits = ws.allocate(dt, {N, Vp});
    Tensor targets = ws.ids({N}, s.V), losses = ws.allocate(DType::F32, {N});
    const int vocab = static_cast<int>(s.V);
    const std::string shape = shape_of({N, Vp}) + " V=" + std::to_string(s.V);
    report(
        "xent_fwd", shape,
        [&] {
          backend->softmax_cross_entropy(losses, Tensor(), logits, targets, vocab, 0.0f, nullptr);
        },
        Rate::Bytes, es * N * Vp);
    report(
        "xent_fwd_bwd", shape,
        [&] {
          backend->softmax_cross_entropy(losses, dlogits, logits, targets, vocab,
                                         1.0f / static_cast<float>(N), nullptr);
        },
        Rate::Bytes, es * 2.0 * N * Vp);
    ws.release();
  }
  // ---- mixture of experts: 8 experts of width C, top 2 (M = 2N rows in expert order) ----
  {
    const int64_t E = 8, k = 2, I = C, M = N * k;
    const MoeRouting routing{static_cast<int>(E), static_cast<int>(k), RouterScore::Softmax,
                             true, 1.0f};
    Tensor logits = ws.random(dt, {N, E}, -3.0f, 3.0f), dlogits = ws.allocate(dt, {N, E});
    Tensor scores = ws.allocate(DType::F32, {N, E}), weights = ws.allocate(DType::F32, {N, k});
    Tensor experts = ws.allocate(DType::I32, {N, k}), offsets = ws.allocate(DType::I32, {E + 1});
    Tensor source = ws.allocate(DType::I32, {M}), dest = ws.allocate(DType::I32, {N, k});
    Tensor x = ws.random(dt, {N, C}), rows = ws.allocate(dt, {M, C}), out = ws.allocate(dt, {N, C});
    Tensor w_up = ws.random(dt, {E, 2 * I, C}), up = ws.allocate(dt, {M, 2 * I});
    Tensor dw_up = ws.random(dt, {E, 2 * I, C}), drows = ws.allocate(dt, {M, C});
    Tensor dup = ws.random(dt, {M, 2 * I}), dweights = ws.allocate(DType::F32, {N, k});
    Tensor dense_w = ws.random(dt, {2 * I, C});
    backend->moe_route(weights, experts, scores, logits, routing, nullptr);
    backend->moe_dispatch(offsets, source, dest, experts, static_cast<int>(E), nullptr);
    const std::string routed = shape_of({N, E}) + " top " + std::to_string(k);
    report("moe_route", routed,
           [&] { backend->moe_route(weights, experts, scores, logits, routing, nullptr); },
           Rate::Bytes, es * N * E + 4.0 * N * E + 8.0 * N * k);
    report("moe_route_bwd", routed,
           [&] {
             backend->moe_route_backward(dlogits, weights, Tensor(), scores, experts, routing,
                                         nullptr);
           },
           Rate::Bytes, es * N * E + 4.0 * N * E + 8.0 * N * k);
    report("moe_dispatch", routed,
           [&] {
             backend->moe_dispatch(offsets, source, dest, experts, static_cast<int>(E), nullptr);
           },
           Rate::Bytes, 4.0 * 3 * N * k);
    const std::string copies = shape_of({N, C}) + " x" + std::to_string(k);
    report("moe_gather", copies, [&] { backend->moe_gather(rows, x, source, nullptr); },
           Rate::Bytes, es * 2.0 * M * C);
    report("moe_combine", copies, [&] { backend->moe_combine(out, rows, dest, weights, nullptr); },
           Rate::Bytes, es * (M + N) * C);
    report("moe_combine_bwd", copies,
           [&] {
             backend->moe_combine_backward(drows, dweights, out, rows, dest, weights, nullptr);
           },
           Rate::Bytes, es * (N + 2.0 * M) * C);
    // The experts' up projection, and one dense GEMM of the same rows and FLOPs.
    const double flops = 2.0 * M * C * 2 * I;
    const std::string grouped = shape_of({M, C}) + "x" + std::to_string(E) + shape_of({2 * I, C});
    report("grouped_matmul_fwd", grouped,
           [&] { backend->grouped_matmul_forward(up, rows, w_up, offsets, nullptr); }, Rate::Flops,
           flops);
    report("grouped_matmul_bwd", grouped,
           [&] { backend->grouped_matmul_backward(drows, dw_up, dup, rows, w_up, offsets, nullptr); },
           Rate::Flops, 2.0 * flops);
    report("matmul_fwd same flops", shape_of({M, C}) + "x" + shape_of({2 * I, C}),
           [&] { backend->matmul_forward(up, rows, dense_w, Tensor(), true, nullptr); },
           Rate::Flops, flops);
    ws.release();
  }
  // ---- optimizer and friends, over one block's worth of parameters (12 C^2) ----
  {
    const int64_t n = 12 * C * C;
    Tensor param = ws.random(DType::F32, {n}), m = ws.random(DType::F32, {n}, 0.0f, 0.01f);
    Tensor v = ws.random(DType::F32, {n}, 0.0f, 0.01f), grad = ws.random(dt, {n});
    Tensor param_copy = dt == DType::F32 ? Tensor() : ws.allocate(dt, {n});
    AdamWStep step;
    step.lr = 1e-4f;
    step.weight_decay = 0.1f;
    step.step = 10;
    const std::string shape = "n=" + std::to_string(n);
    report(
        "adamw", shape, [&] { backend->adamw(param, grad, m, v, param_copy, step, nullptr); },
        Rate::Bytes, n * (24.0 + es + (param_copy.empty() ? 0.0 : es)));
    volatile double sink = 0.0;
    report(
        "sum_squares", shape, [&] { sink = sink + backend->sum_squares(grad, nullptr); },
        Rate::Bytes, es * n);
    report(
        "scale", shape, [&] { backend->scale(grad, 1.0f, nullptr); }, Rate::Bytes, es * 2.0 * n);
    volatile bool found = false;
    report(
        "has_inf_or_nan", shape, [&] { found = backend->has_inf_or_nan(grad, nullptr); },
        Rate::Bytes, es * n);
    Tensor copy_dst = ws.allocate(dt == DType::BF16 ? DType::F16 : DType::BF16, {n});
    report(
        "copy (convert)", shape + " " + dtype_name(dt) + "->" + dtype_name(copy_dst.dtype),
        [&] { backend->copy(copy_dst, grad, nullptr); }, Rate::Bytes, (es + 2.0) * n);
    ws.release();
  }
}

}  // namespace
}  // namespace dstrain

int main(int argc, char** argv) {
  return dstrain::benchmark_main("bench_ops", [&] { dstrain::run_benchmarks(dstrain::parse_options(argc, argv)); });
}
