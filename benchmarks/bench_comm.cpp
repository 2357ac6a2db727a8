// Collectives of the local communicator (ranks are threads of this process): all_reduce,
// reduce_scatter and all_gather of 16M elements on 2, 4 and 8 ranks. Prints a table of the
// median time and, as nccl-tests does, the algorithm bandwidth (S / t, S = bytes of the
// full buffer: the all_reduce buffer, the reduce_scatter input, the all_gather output) and
// the bus bandwidth (algbw * 2(n-1)/n for all_reduce, * (n-1)/n for the others), next to one
// thread's memcpy bandwidth on this machine as the reference.
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

#include "comm/communicator.h"
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

enum class Op { AllReduce, ReduceScatter, AllGather };

const char* op_name(Op op) {
  switch (op) {
    case Op::AllReduce: return "all_reduce";
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllGather: return "all_gather";
  }
  return "?";
}

double bus_factor(Op op, int ranks) {
  const double n = ranks;
  return op == Op::AllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
}

// Non-zero data (never time on zeros): small values so sums stay finite in fp16.
void fill(std::vector<unsigned char>& bytes, DType dtype, int rank) {
  const size_t size = dtype_size(dtype);
  const size_t count = bytes.size() / size;
  for (size_t i = 0; i < count; ++i) {
    const float value = static_cast<float>((i * 7 + static_cast<size_t>(rank) * 13) % 17) * 0.01f;
    if (dtype == DType::F32) {
      std::memcpy(&bytes[i * size], &value, 4);
    } else {
      const uint16_t bits =
          dtype == DType::F16 ? fp32_to_fp16_bits(value) : fp32_to_bf16_bits(value);
      std::memcpy(&bytes[i * size], &bits, 2);
    }
  }
}

// Median seconds of one collective over `iters` timed runs after one warm-up, as rank 0 sees
// it between two barriers (so the slowest rank is included).
double time_collective(Op op, int ranks, const Options& options) {
  const int64_t per_rank = options.elements / ranks;
  const int64_t full = per_rank * ranks;  // the elements the op moves, divisible by ranks
  std::vector<double> seconds;
  run_local_ranks(ranks, 600.0, [&](Communicator& comm) {
    const size_t size = dtype_size(options.dtype);
    // Each rank allocates and first-touches its own buffers, as a rank of a trainer would.
    const int64_t input_count = op == Op::AllGather ? per_rank : full;
    const int64_t output_count = op == Op::ReduceScatter ? per_rank : full;
    std::vector<unsigned char> input(static_cast<size_t>(input_count) * size);
    std::vector<unsigned char> output(
        op == Op::AllReduce ? 0 : static_cast<size_t>(output_count) * size, 0);
    fill(input, options.dtype, comm.rank());
    const Tensor in(input.data(), options.dtype, {input_count});
    const Tensor out(output.data(), options.dtype, {output_count});
    for (int it = -1; it < options.iters; ++it) {
      // all_reduce works in place: refill so the values stay the same size every run.
      if (op == Op::AllReduce) fill(input, options.dtype, comm.rank());
      comm.barrier();
      const Clock::time_point start = Clock::now();
      switch (op) {
        case Op::AllReduce: comm.all_reduce(in, ReduceOp::Sum, nullptr); break;
        case Op::ReduceScatter: comm.reduce_scatter(out, in, ReduceOp::Sum, nullptr); break;
        case Op::AllGather: comm.all_gather(out, in, nullptr); break;
      }
      comm.barrier();
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (comm.rank() == 0 && it >= 0) seconds.push_back(elapsed);
    }
  });
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
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
  for (Op op : {Op::AllReduce, Op::ReduceScatter, Op::AllGather}) {
    for (int ranks : {2, 4, 8}) {
      const double seconds = time_collective(op, ranks, options);
      const double moved = static_cast<double>((options.elements / ranks) * ranks) *
                           static_cast<double>(dtype_size(options.dtype));
      const double algbw = moved / seconds / 1e9;
      std::printf("%-16s %6d %10.2f %12.2f %12.2f\n", op_name(op), ranks, seconds * 1e3, algbw,
                  algbw * bus_factor(op, ranks));
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace dstrain

int main(int argc, char** argv) {
  return dstrain::benchmark_main("bench_comm", [&] { dstrain::run_benchmarks(dstrain::parse_options(argc, argv)); });
}
