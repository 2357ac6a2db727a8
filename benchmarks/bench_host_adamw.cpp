// bench_host_adamw: times the host AdamW of ZeRO-Offload (src/optim/host_adamw.h) at each ISA
// level and thread count on n = 64M fp32 elements, against the machine's memory bandwidth
// measured in the same run by a large copy at the same thread count, and prints a markdown
// table.
//
//   bench_host_adamw [--quick] [--threads N] [--n ELEMENTS]
//
// State bytes per element: read param, grad, m, v (16 B) and write param, m, v (12 B) = 28 B;
// with 16-bit grads and a 16-bit weight copy: read 4+2+4+4, write 4+4+4+2 = 28 B as well.
// Copy bandwidth counts read + write bytes (2 x the size copied); the ratio is AdamW's bytes/s
// over the copy's. A copy's destination lines are also read before they are written (write
// allocate), traffic it does not count, while AdamW writes only lines it has just read. So the
// table also gives an in-place a += b over the same buffers (read a, b; write a: 3 x the size of
// a), the access pattern of AdamW, as the memory bound AdamW can reach. Timings are the median of
// several runs after a warm-up; every run takes a real step on random, non-zero data.
// --quick uses n = 4M and a 64 MiB copy for a smoke run.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "optim/host_adamw.h"
#include "benchmarks/bench_main.h"

namespace dstrain {
namespace {

struct Options {
  bool quick = false;
  int max_threads = 0;  // 0: all of OpenMP's threads
  int64_t n = 0;        // 0: 64M (4M with --quick)
};

int64_t parse_count(const char* text, const char* flag) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  DSTRAIN_USER_CHECK(*end == '\0' && value > 0)
      << flag << " takes a positive count, not '" << text << "'";
  return value;
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      options.quick = true;
    } else if (arg == "--threads" && i + 1 < argc) {
      options.max_threads =
          static_cast<int>(std::min<int64_t>(parse_count(argv[++i], "--threads"), 4096));
    } else if (arg == "--n" && i + 1 < argc) {
      options.n = parse_count(argv[++i], "--n");
    } else {
      DSTRAIN_USER_ERROR() << "unknown argument '" << arg
                           << "'; usage: bench_host_adamw [--quick] [--threads N] [--n ELEMENTS]";
    }
  }
  return options;
}

// 64-byte aligned, uninitialised host memory (first touched by the fill, thread by thread).
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
std::unique_ptr<T[], FreeDeleter> allocate(int64_t count) {
  const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  DSTRAIN_CHECK(p != nullptr) << "out of memory allocating " << bytes << " bytes";
  return std::unique_ptr<T[], FreeDeleter>(static_cast<T*>(p));
}

// Mixed magnitudes 1e-6..1e3 with random signs (positive for v); no zeros.
void fill_random(float* data, int64_t n, uint64_t seed, bool positive) {
#pragma omp parallel
  {
    const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
    Rng rng(seed, static_cast<uint64_t>(id));
    for (int64_t i = n * id / team; i < n * (id + 1) / team; ++i) {
      const uint64_t r = rng.next_u64();
      // 10^(-6 + 9u) from the top 24 bits; the sign from the lowest bit.
      const float magnitude =
          static_cast<float>(std::pow(10.0, -6.0 + 9.0 * static_cast<double>(r >> 40) * 0x1p-24));
      data[i] = (positive || (r & 1u) == 0) ? magnitude : -magnitude;
    }
  }
}

double median_seconds(int reps, const std::function<void()>& body) {
  body();  // warm-up: page faults, thread pool start, caches
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    body();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Each thread copies its own contiguous slice, as host_adamw splits its range.
void parallel_copy(char* dst, const char* src, size_t bytes, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const size_t team = static_cast<size_t>(omp_get_num_threads());
    const size_t id = static_cast<size_t>(omp_get_thread_num());
    const size_t begin = bytes * id / team / 64 * 64;
    const size_t end = id + 1 == team ? bytes : bytes * (id + 1) / team / 64 * 64;
    std::memcpy(dst + begin, src + begin, end - begin);
  }
}

// a += b, each thread on its own contiguous slice; simd so the loop is not what limits it.
void parallel_add_in_place(float* a, const float* b, int64_t n, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

void run(const Options& options) {
  const int64_t n =
      options.n > 0 ? options.n : (options.quick ? int64_t{4} << 20 : int64_t{64} << 20);
  const size_t copy_bytes = options.quick ? size_t{64} << 20 : size_t{1} << 30;
  const int max_threads = options.max_threads > 0 ? options.max_threads : omp_get_max_threads();
  const int reps = options.quick ? 3 : 5;
  std::vector<int> thread_counts;
  for (int t = 1; t < max_threads; t *= 2) thread_counts.push_back(t);
  thread_counts.push_back(max_threads);

  auto param = allocate<float>(n), grad = allocate<float>(n), m = allocate<float>(n),
       v = allocate<float>(n);
  auto grad_16 = allocate<uint16_t>(n), copy_16 = allocate<uint16_t>(n);
  fill_random(param.get(), n, 1, false);
  fill_random(grad.get(), n, 2, false);
  fill_random(m.get(), n, 3, false);
  fill_random(v.get(), n, 4, true);
  std::memset(copy_16.get(), 0, static_cast<size_t>(n) * 2);
  auto copy_src = allocate<char>(static_cast<int64_t>(copy_bytes));
  auto copy_dst = allocate<char>(static_cast<int64_t>(copy_bytes));
  std::memset(copy_src.get(), 1, copy_bytes);
  std::memset(copy_dst.get(), 0, copy_bytes);
  // The in-place add reuses the copy buffers as two float arrays of half the size each.
  const int64_t add_n = static_cast<int64_t>(copy_bytes / 2 / sizeof(float));
  float* add_a = reinterpret_cast<float*>(copy_dst.get());
  float* add_b = reinterpret_cast<float*>(copy_src.get());

  std::printf(
      "host AdamW on %s: %d threads, n = %lld (%.2f GB of state per step), dispatch "
      "picks %s\n\n",
      cpu_model().c_str(), max_threads, static_cast<long long>(n), 28.0 * n / 1e9,
      host_adamw_isa());

  std::vector<double> copy_rate(static_cast<size_t>(max_threads) + 1, 0.0);
  std::vector<double> add_rate(static_cast<size_t>(max_threads) + 1, 0.0);
  for (int t : thread_counts) {
    const double copy_s =
        median_seconds(reps, [&] { parallel_copy(copy_dst.get(), copy_src.get(), copy_bytes, t); });
    copy_rate[t] = 2.0 * copy_bytes / copy_s;
    std::fill(add_a, add_a + add_n, 0.5f);
    std::fill(add_b, add_b + add_n, 1.0f);
    const double add_s =
        median_seconds(reps, [&] { parallel_add_in_place(add_a, add_b, add_n, t); });
    add_rate[t] = 3.0 * add_n * sizeof(float) / add_s;
  }

  AdamWStep step;
  step.lr = 1e-4f;
  step.weight_decay = 0.1f;
  step.grad_scale = 0.9f;
  step.step = 10;
  std::printf(
      "memcpy: %.0f MiB, read + write bytes; in-place a += b: two %.0f MiB arrays; both "
      "at the row's thread count.\n\n",
      copy_bytes / 1048576.0, copy_bytes / 2 / 1048576.0);
  std::printf(
      "| level | threads | grad -> copy | ms / step | state GB/s | memcpy GB/s | ratio | "
      "a += b GB/s | ratio |\n");
  std::printf("|---|---:|---|---:|---:|---:|---:|---:|---:|\n");
  auto row = [&](const char* level, int threads, const char* formats, double seconds) {
    const double rate = 28.0 * n / seconds;
    std::printf("| %s | %d | %s | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", level, threads,
                formats, seconds * 1e3, rate / 1e9, copy_rate[threads] / 1e9,
                rate / copy_rate[threads], add_rate[threads] / 1e9, rate / add_rate[threads]);
    std::fflush(stdout);
  };
  for (HostAdamWIsa isa : {HostAdamWIsa::Scalar, HostAdamWIsa::Avx2, HostAdamWIsa::Avx512}) {
    if (!host_adamw_isa_supported(isa)) {
      std::printf("| %s | - | - | not supported by this CPU | | | | | |\n",
                  host_adamw_isa_name(isa));
      continue;
    }
    for (int t : thread_counts) {
      const double s = median_seconds(reps, [&] {
        host_adamw_with(isa, param.get(), grad.get(), DType::F32, m.get(), v.get(), nullptr,
                        DType::F16, n, step, t);
        ++step.step;
      });
      row(host_adamw_isa_name(isa), t, "f32 -> none", s);
    }
  }
  // The offload path's formats: 16-bit grads down, 16-bit weights up, on the level Auto picks.
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int64_t i = 0; i < n; ++i) {
      grad_16[i] = dtype == DType::BF16 ? fp32_to_bf16_bits(grad[i]) : fp32_to_fp16_bits(grad[i]);
    }
    const std::string formats = std::string(dtype_name(dtype)) + " -> " + dtype_name(dtype);
    const double s = median_seconds(reps, [&] {
      host_adamw(param.get(), grad_16.get(), dtype, m.get(), v.get(), copy_16.get(), dtype, n, step,
                 max_threads);
      ++step.step;
    });
    row(host_adamw_isa(), max_threads, formats.c_str(), s);
  }
  // For context: the CPU backend's Backend::adamw (the bitwise reference) on the same data.
  auto backend = make_cpu_backend(max_threads);
  const double s = median_seconds(options.quick ? 1 : 2, [&] {
    backend->adamw(Tensor(param.get(), DType::F32, {n}), Tensor(grad.get(), DType::F32, {n}),
                   Tensor(m.get(), DType::F32, {n}), Tensor(v.get(), DType::F32, {n}), Tensor(),
                   step, nullptr);
    ++step.step;
  });
  row("cpu backend (reference)", max_threads, "f32 -> none", s);
}

}  // namespace
}  // namespace dstrain

int main(int argc, char** argv) {
  return dstrain::benchmark_main("bench_host_adamw", [&] { dstrain::run(dstrain::parse_options(argc, argv)); });
}
