// Collectives of the local communicator (ranks are threads of this process): all_reduce,
// reduce_scatter, all_gather and send_recv of 16M elements on 2, 4 and 8 ranks, timed and
// checked by cli/comm_bench.h (as `dstrain bench comm --device cpu`, which sweeps the sizes).
// Prints the median time and, as nccl-tests does, the algorithm bandwidth (S / t, S = bytes of
// the full buffer) and the bus bandwidth (algbw * 2(n-1)/n for all_reduce, * (n-1)/n for
// reduce_scatter and all_gather, * 1 for send_recv), next to one thread's memcpy bandwidth on
// this machine as the reference.
//
//   bench_comm [--elements N] [--iters N] [--dtype fp32|fp16|bf16] [--quick]
//
// --quick uses 1M elements for a smoke run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cli/comm_bench.h"
#include "core/check.h"
#include "core/dtype.h"
#include "benchmarks/bench_main.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int64_t elements = int64_t{16} << 20;
  int iters = 5;
  DType dtype = DType::F32;
};

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      options.elements = int64_t{1} << 20;
    } else if (arg == "--elements" && i + 1 < argc) {
      options.elements = std::atoll(argv[++i]);
      DSTRAIN_USER_CHECK(options.elements >= 8) << "--elements takes a count >= 8";
    } else if (arg == "--iters" && i + 1 < argc) {
      options.iters = std::atoi(argv[++i]);
      DSTRAIN_USER_CHECK(options.iters >= 1) << "--iters takes a count >= 1";
    } else if (arg == "--dtype" && i + 1 < argc) {
      options.dtype = parse_dtype(argv[++i]);
      DSTRAIN_USER_CHECK(options.dtype != DType::I32) << "--dtype takes fp32, fp16 or bf16";
    } else {
      DSTRAIN_USER_ERROR() << "unknown argument '" << arg
                           << "'; usage: bench_comm [--elements N] [--iters N] "
                              "[--dtype fp32|fp16|bf16] [--quick]";
    }
  }
  return options;
}

double memcpy_gbps(size_t bytes) {
  std::vector<unsigned char> src(bytes, 1), dst(bytes, 0);
  std::vector<double> seconds;
  for (int it = 0; it < 5; ++it) {
    const Clock::time_point start = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  if (dst[bytes / 2] != 1) std::abort();  // keep the copy
  return static_cast<double>(bytes) / seconds[2] / 1e9;
}

void run_benchmarks(const Options& options) {
  const size_t bytes = static_cast<size_t>(options.elements) * dtype_size(options.dtype);
  std::printf("bench_comm: local ranks (threads), %lld %s elements = %.1f MiB per buffer, "
              "median of %d\n",
              static_cast<long long>(options.elements), dtype_name(options.dtype),
              static_cast<double>(bytes) / (1 << 20), options.iters);
  std::printf("reference: one thread's memcpy of that buffer: %.2f GB/s\n\n",
              memcpy_gbps(bytes));
  std::printf("%-16s %6s %10s %12s %12s\n", "op", "ranks", "ms", "algbw GB/s", "busbw GB/s");
  for (CommOp op : all_comm_ops()) {
    for (int ranks : {2, 4, 8}) {
      CommBenchRequest request;
      request.ops = {op};
      request.sizes = {static_cast<int64_t>(bytes)};
      request.dtype = options.dtype;
      request.warmup = 1;
      request.iters = options.iters;
      const CommBenchRow row = run_comm_bench(choose_devices("cpu", ranks), request).at(0);
      std::printf("%-16s %6d %10.2f %12.2f %12.2f\n", comm_op_name(op), ranks, row.seconds * 1e3,
                  row.algbw / 1e9, row.busbw / 1e9);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace dstrain

int main(int argc, char** argv) {
  return dstrain::benchmark_main("bench_comm", [&] { dstrain::run_benchmarks(dstrain::parse_options(argc, argv)); });
}
