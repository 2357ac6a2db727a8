#include "cli/comm_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "core/check.h"

namespace dstrain {

namespace {

using Clock = std::chrono::steady_clock;

// One row as one rank sees it: `count` elements in the full buffer, `part` = count / ranks.
struct RowShape {
  CommOp op = CommOp::AllReduce;
  DType dtype = DType::F32;
  int64_t count = 0;
  int64_t part = 0;
  int rank = 0;
  int ranks = 0;
  int previous() const { return (rank + ranks - 1) % ranks; }
  int next() const { return (rank + 1) % ranks; }
};

// Element `index` of rank `rank`'s data: a multiple of 1/8 in [1/8, 17/8], never zero. Exact in
// fp16 and bf16; a sum over up to 15 ranks (at most 255/8) is exact in bf16 too.
float pattern_value(int64_t index, int rank) {
  return static_cast<float>((index * 7 + int64_t{rank} * 13) % 17 + 1) * 0.125f;
}

int64_t input_count(const RowShape& shape) {
  return shape.op == CommOp::AllGather ? shape.part : shape.count;
}
int64_t result_count(const RowShape& shape) {
  return shape.op == CommOp::ReduceScatter ? shape.part : shape.count;
}

// What element i of this rank's input holds. all_gather: the rank's slice of the full buffer.
float input_value(const RowShape& shape, int64_t i) {
  if (shape.op == CommOp::AllGather) return pattern_value(shape.rank * shape.part + i, shape.rank);
  return pattern_value(i, shape.rank);
}

float sum_over_ranks(int64_t index, int ranks) {
  float sum = 0;
  for (int q = 0; q < ranks; ++q) sum += pattern_value(index, q);
  return sum;
}

// What element i of this rank's result must hold.
float expected_value(const RowShape& shape, int64_t i) {
  switch (shape.op) {
    case CommOp::AllReduce: return sum_over_ranks(i, shape.ranks);
    case CommOp::ReduceScatter: return sum_over_ranks(shape.rank * shape.part + i, shape.ranks);
    case CommOp::AllGather: return pattern_value(i, static_cast<int>(i / shape.part));
    case CommOp::SendRecv: return pattern_value(i, shape.previous());
    case CommOp::AllToAll:  // part j of peer p's input: element rank * part + j
      return pattern_value(shape.rank * shape.part + i % shape.part, static_cast<int>(i / shape.part));
  }
  return 0;
}

void store_element(std::vector<unsigned char>& bytes, DType dtype, int64_t i, float value) {
  const size_t size = dtype_size(dtype);
  if (dtype == DType::F32) {
    std::memcpy(&bytes[static_cast<size_t>(i) * size], &value, 4);
    return;
  }
  const uint16_t bits = dtype == DType::F16 ? fp32_to_fp16_bits(value) : fp32_to_bf16_bits(value);
  std::memcpy(&bytes[static_cast<size_t>(i) * size], &bits, 2);
}

float load_element(const std::vector<unsigned char>& bytes, DType dtype, int64_t i) {
  const size_t size = dtype_size(dtype);
  if (dtype == DType::F32) {
    float value;
    std::memcpy(&value, &bytes[static_cast<size_t>(i) * size], 4);
    return value;
  }
  uint16_t bits;
  std::memcpy(&bits, &bytes[static_cast<size_t>(i) * size], 2);
  return dtype == DType::F16 ? fp16_bits_to_fp32(bits) : bf16_bits_to_fp32(bits);
}

// A row's device buffers. all_reduce: `input` is the in-place buffer and `source` the copy it
// is restored from; the others: `input` and `output`.
struct RowBuffers {
  Buffer input_memory, output_memory, source_memory;
  Tensor input, output, source;
  const Tensor& result(CommOp op) const { return op == CommOp::AllReduce ? input : output; }
};

Tensor allocate(const CommBenchRank& rank, Buffer& memory, DType dtype, int64_t count) {
  memory = rank.memory.allocate(MemCategory::CommBuffers,
                                static_cast<size_t>(count) * dtype_size(dtype));
  return memory.view(dtype, {count});
}

RowBuffers make_row_buffers(const CommBenchRank& rank, const RowShape& shape) {
  RowBuffers buffers;
  buffers.input = allocate(rank, buffers.input_memory, shape.dtype, input_count(shape));
  std::vector<unsigned char> host(buffers.input.nbytes());
  for (int64_t i = 0; i < buffers.input.numel(); ++i) {
    store_element(host, shape.dtype, i, input_value(shape, i));
  }
  rank.backend.copy_bytes(buffers.input.data, host.data(), host.size(), rank.stream);
  if (shape.op == CommOp::AllReduce) {
    buffers.source = allocate(rank, buffers.source_memory, shape.dtype, shape.count);
    rank.backend.copy(buffers.source, buffers.input, rank.stream);
  } else {
    buffers.output = allocate(rank, buffers.output_memory, shape.dtype, result_count(shape));
    rank.backend.fill_zero(buffers.output, rank.stream);
  }
  rank.backend.synchronize(rank.stream);
  return buffers;
}

void run_collective(const CommBenchRank& rank, const RowShape& shape, const RowBuffers& buffers) {
  Communicator& comm = rank.comm;
  switch (shape.op) {
    case CommOp::AllReduce:
      comm.all_reduce(buffers.input, ReduceOp::Sum, rank.stream);
      break;
    case CommOp::ReduceScatter:
      comm.reduce_scatter(buffers.output, buffers.input, ReduceOp::Sum, rank.stream);
      break;
    case CommOp::AllGather:
      comm.all_gather(buffers.output, buffers.input, rank.stream);
      break;
    case CommOp::SendRecv:
      comm.exchange({{P2POp::Kind::Send, buffers.input, shape.next()},
                     {P2POp::Kind::Recv, buffers.output, shape.previous()}},
                    rank.stream);
      break;
    case CommOp::AllToAll: {
      const std::vector<int64_t> parts(static_cast<size_t>(shape.ranks), shape.part);
      comm.all_to_all(buffers.output, parts, buffers.input, parts, rank.stream);
      break;
    }
  }
}

// Each element of the rank's result against the value the collective must produce. 16-bit sums
// are exact for up to 15 ranks; beyond that allow one rounding per rank.
void check_result(const CommBenchRank& rank, const RowShape& shape, const Tensor& result) {
  std::vector<unsigned char> host(result.nbytes());
  rank.backend.copy_bytes(host.data(), result.data, host.size(), rank.stream);
  rank.backend.synchronize(rank.stream);
  const double rtol = shape.dtype == DType::F32    ? 0.0
                      : shape.dtype == DType::BF16 ? shape.ranks * 0x1p-8
                                                   : shape.ranks * 0x1p-11;
  for (int64_t i = 0; i < result.numel(); ++i) {
    const float got = load_element(host, shape.dtype, i);
    const float want = expected_value(shape, i);
    DSTRAIN_CHECK(std::fabs(static_cast<double>(got) - want) <= rtol * want)
        << comm_op_name(shape.op) << " of " << shape.count << " " << dtype_name(shape.dtype)
        << " elements on " << shape.ranks << " ranks gave a wrong result on rank " << shape.rank
        << ": element " << i << " is " << got << " where it must be " << want
        << "; the timing of a broken collective means nothing";
  }
}

// This rank's seconds for each timed iteration of one row, then the check of its result.
std::vector<double> time_row(const CommBenchRank& rank, const RowShape& shape,
                             const CommBenchRequest& request) {
  const RowBuffers buffers = make_row_buffers(rank, shape);
  std::vector<double> seconds;
  for (int iteration = -request.warmup; iteration < request.iters; ++iteration) {
    if (shape.op == CommOp::AllReduce) {  // in place: the same values every iteration
      rank.backend.copy(buffers.input, buffers.source, rank.stream);
      rank.backend.synchronize(rank.stream);
    }
    rank.comm.barrier();
    const Clock::time_point start = Clock::now();
    run_collective(rank, shape, buffers);
    rank.backend.synchronize(rank.stream);
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (iteration >= 0) seconds.push_back(elapsed);
  }
  check_result(rank, shape, buffers.result(shape.op));
  return seconds;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::AllReduce: return "all_reduce";
    case CommOp::ReduceScatter: return "reduce_scatter";
    case CommOp::AllGather: return "all_gather";
    case CommOp::SendRecv: return "send_recv";
    case CommOp::AllToAll: return "all_to_all";
  }
  return "?";
}

const std::vector<CommOp>& all_comm_ops() {
  static const std::vector<CommOp> ops = {CommOp::AllReduce, CommOp::ReduceScatter,
                                          CommOp::AllGather, CommOp::SendRecv,
                                          CommOp::AllToAll};
  return ops;
}

CommOp parse_comm_op(const std::string& name) {
  std::string choices;
  for (CommOp op : all_comm_ops()) {
    if (name == comm_op_name(op)) return op;
    choices += (choices.empty() ? "" : ", ") + std::string(comm_op_name(op));
  }
  DSTRAIN_USER_ERROR() << "unknown collective '" << name << "' (choose from " << choices << ")";
  return CommOp::AllReduce;
}

double bus_factor(CommOp op, int ranks) {
  DSTRAIN_CHECK(ranks >= 1) << ranks << " ranks";
  const double n = ranks;
  switch (op) {
    case CommOp::AllReduce: return 2.0 * (n - 1) / n;
    case CommOp::ReduceScatter:
    case CommOp::AllGather:
    case CommOp::AllToAll: return (n - 1) / n;
    case CommOp::SendRecv: return 1.0;
  }
  return 1.0;
}

int64_t comm_bench_count(CommOp op, int64_t bytes, DType dtype, int ranks) {
  const int64_t count = bytes / static_cast<int64_t>(dtype_size(dtype));
  // A collective over n ranks needs n parts; nccl-tests rounds down the same way.
  if (op == CommOp::ReduceScatter || op == CommOp::AllGather || op == CommOp::AllToAll) {
    return count / ranks * ranks;
  }
  return count;
}

std::vector<int64_t> doubling_sizes(int64_t min, int64_t max) {
  DSTRAIN_CHECK(0 < min && min <= max) << "sizes " << min << " to " << max;
  std::vector<int64_t> sizes;
  for (int64_t size = min; size <= max; size *= 2) {
    sizes.push_back(size);
    if (size > max / 2) break;  // the next doubling would pass max (or overflow)
  }
  return sizes;
}

std::vector<std::vector<double>> time_collectives_on_rank(const CommBenchRank& rank,
                                                          const CommBenchRequest& request) {
  DSTRAIN_CHECK(rank.comm.size() >= 2) << "timing collectives needs 2 ranks or more";
  std::vector<std::vector<double>> seconds;
  for (CommOp op : request.ops) {
    for (int64_t bytes : request.sizes) {
      RowShape shape{op, request.dtype, 0, 0, rank.comm.rank(), rank.comm.size()};
      shape.count = comm_bench_count(op, bytes, request.dtype, shape.ranks);
      shape.part = shape.count / shape.ranks;
      DSTRAIN_CHECK(shape.part > 0) << bytes << " bytes is less than one element per rank";
      seconds.push_back(time_row(rank, shape, request));
    }
  }
  return seconds;
}

std::vector<CommBenchRow> summarize_comm_bench(
    const CommBenchRequest& request, const std::vector<std::vector<std::vector<double>>>& seconds) {
  const int ranks = static_cast<int>(seconds.size());
  std::vector<CommBenchRow> rows;
  size_t row_index = 0;
  for (CommOp op : request.ops) {
    for (int64_t bytes : request.sizes) {
      CommBenchRow row{op, 0, comm_bench_count(op, bytes, request.dtype, ranks), request.dtype,
                       ranks};
      row.bytes = row.count * static_cast<int64_t>(dtype_size(request.dtype));
      std::vector<double> slowest(static_cast<size_t>(request.iters), 0.0);
      for (const std::vector<std::vector<double>>& of_rank : seconds) {
        const std::vector<double>& times = of_rank.at(row_index);
        for (size_t it = 0; it < slowest.size(); ++it) {
          slowest[it] = std::max(slowest[it], times.at(it));
        }
      }
      row.seconds = median(slowest);
      row.algbw = static_cast<double>(row.bytes) / row.seconds;
      row.busbw = row.algbw * bus_factor(op, ranks);
      rows.push_back(row);
      ++row_index;
    }
  }
  return rows;
}

std::vector<CommBenchRow> run_comm_bench(const RunDevices& devices,
                                         const CommBenchRequest& request) {
  std::vector<std::vector<std::vector<double>>> seconds(static_cast<size_t>(devices.ranks));
  launch_ranks(devices, request.timeout_seconds, [&](Communicator& launched) {
    RankDevices rank = make_rank_devices(devices, launched, /*cpu_threads=*/1);
    const CommBenchRank bench{*rank.comm, *rank.backend, *rank.device, rank.compute.get()};
    seconds[static_cast<size_t>(launched.rank())] = time_collectives_on_rank(bench, request);
  });
  return summarize_comm_bench(request, seconds);
}

}  // namespace dstrain
