// `dstrain bench comm`: the collectives of the communicator training would use, timed over
// doubling message sizes and printed as nccl-tests prints them (cli/comm_bench.h), next to the
// link the planner's cost model assumes for these ranks.
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/comm_bench.h"
#include "cli/commands.h"
#include "core/check.h"
#include "parallel/cost_model.h"
#include "parallel/machine.h"
#include "parallel/plan.h"
#include "topology/units.h"

namespace dstrain {

namespace po = boost::program_options;

namespace {

constexpr const char* kUsage =
    "Usage: dstrain bench comm [--gpus N] [--sizes MIN:MAX] "
    "[--ops all_reduce,reduce_scatter,all_gather,send_recv,all_to_all] [--dtype fp32|fp16|bf16] "
    "[--iters N] [--warmup N] [--device auto|cpu|cuda] [--json]\n";

struct BenchCommFlags {
  int gpus = 0;
  bool gpus_given = false;  // else all GPUs, or 2 CPU ranks
  std::string sizes = "1K:256M";
  std::string ops = "all_reduce,reduce_scatter,all_gather,send_recv,all_to_all";
  std::string dtype = "fp32";
  int iters = 20;
  int warmup = 5;
  std::string device = "auto";
};

po::options_description bench_comm_flags(BenchCommFlags& f) {
  po::options_description flags("dstrain bench comm");
  flags.add_options()
      ("gpus", po::value(&f.gpus)->value_name("N"), "ranks: GPUs (default: all of this machine's), or on the CPU backend threads (default 2)")
      ("sizes", po::value(&f.sizes)->default_value(f.sizes)->value_name("MIN:MAX"), "message sizes S in bytes, doubling from MIN to MAX (binary units: 1K = 1024)")
      ("ops", po::value(&f.ops)->default_value(f.ops)->value_name("LIST"), "the collectives to time, comma-separated")
      ("dtype", po::value(&f.dtype)->default_value(f.dtype), "fp32 | fp16 | bf16")
      ("iters", po::value(&f.iters)->default_value(f.iters)->value_name("N"), "timed iterations per row (the row's time is their median)")
      ("warmup", po::value(&f.warmup)->default_value(f.warmup)->value_name("N"), "untimed iterations before them")
      ("device", po::value(&f.device)->default_value(f.device), "auto | cpu | cuda: the backend, and with it the communicator (NCCL on GPUs, threads on the CPU)")
      ("json", "print a JSON document instead of the table")
      ("help,h", "this help");
  return flags;
}

int64_t parse_size_flag(const std::string& part, const std::string& text) {
  uint64_t size = 0;
  try {
    size = parse_size(part);
  } catch (const UserError&) {
    DSTRAIN_USER_ERROR() << "--sizes takes MIN:MAX, sizes in bytes with an optional binary unit "
                         << "such as 1K:256M, not '" << text << "'";
  }
  DSTRAIN_USER_CHECK(size > 0 && size <= (uint64_t{1} << 40))
      << "--sizes " << text << ": each size must be between 1 byte and 1T";
  return static_cast<int64_t>(size);
}

// "MIN:MAX" or one size. The smallest must give every rank one element of `dtype`.
std::vector<int64_t> parse_sizes(const std::string& text, DType dtype, int ranks) {
  const size_t colon = text.find(':');
  const int64_t min = parse_size_flag(text.substr(0, colon), text);
  const int64_t max =
      colon == std::string::npos ? min : parse_size_flag(text.substr(colon + 1), text);
  DSTRAIN_USER_CHECK(min <= max) << "--sizes " << text
                                 << ": the first size must not be larger than the second (MIN:MAX)";
  const int64_t smallest = static_cast<int64_t>(dtype_size(dtype)) * ranks;
  DSTRAIN_USER_CHECK(min >= smallest)
      << "--sizes " << text << ": " << min << " bytes is less than one " << precision_name(dtype)
      << " element per rank on " << ranks << " ranks (the smallest size is " << smallest << ")";
  return doubling_sizes(min, max);
}

std::vector<CommOp> parse_ops(const std::string& text) {
  std::vector<CommOp> ops;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) {
    if (item.empty()) continue;
    try {
      ops.push_back(parse_comm_op(item));
    } catch (const UserError& error) {
      DSTRAIN_USER_ERROR() << "--ops: " << error.what();
    }
  }
  DSTRAIN_USER_CHECK(!ops.empty()) << "--ops names no collective (all_reduce, reduce_scatter, "
                                      "all_gather, send_recv, all_to_all)";
  return ops;
}

DType parse_bench_dtype(const std::string& text) {
  DType dtype = DType::I32;
  try {
    dtype = parse_dtype(text);
  } catch (const UserError&) {
    // said below, naming the flag
  }
  DSTRAIN_USER_CHECK(dtype != DType::I32) << "--dtype takes fp32, fp16 or bf16, not '" << text
                                          << "'";
  return dtype;
}

// All of the request but the sizes, which depend on the ranks.
CommBenchRequest read_request(const BenchCommFlags& flags) {
  DSTRAIN_USER_CHECK(flags.iters >= 1) << "--iters takes a count of at least 1, not "
                                       << flags.iters;
  DSTRAIN_USER_CHECK(flags.warmup >= 0) << "--warmup takes a count of at least 0, not "
                                        << flags.warmup;
  CommBenchRequest request;
  request.ops = parse_ops(flags.ops);
  request.dtype = parse_bench_dtype(flags.dtype);
  request.iters = flags.iters;
  request.warmup = flags.warmup;
  return request;
}

// The ranks and their devices: --gpus, or all GPUs, or 2 CPU ranks. Training's choice of
// backend and communicator (choose_devices), except that ranks never share a GPU here.
RunDevices bench_devices(const BenchCommFlags& flags) {
  const int gpus = usable_cuda_devices();
  const bool may_use_gpus = (flags.device == "auto" || flags.device == "cuda") && gpus > 0;
  DSTRAIN_USER_CHECK(flags.gpus_given || !may_use_gpus || gpus >= 2)
      << "this machine has 1 GPU and a collective needs two ranks (--device cpu times threads "
         "as ranks)";
  const int ranks = flags.gpus_given ? flags.gpus : may_use_gpus ? gpus : 2;
  DSTRAIN_USER_CHECK(ranks >= 2) << "--gpus takes a count of at least 2 ranks (a collective "
                                 << "needs two), not " << ranks;
  const RunDevices devices = choose_devices(flags.device, ranks);
  DSTRAIN_USER_CHECK(!devices.cuda || devices.ranks <= devices.gpus)
      << "--gpus " << ranks << ": this machine has " << gpus << " GPU" << (gpus == 1 ? "" : "s")
      << " (--device cpu times " << ranks << " threads as ranks)";
  return devices;
}

std::string communicator_name(const RunDevices& devices) {
  if (!devices.cuda) return "local communicator (ranks are threads of this process; no GPU)";
  return devices.nccl ? "NCCL" : "local communicator through host copies";
}

// The ring bus bandwidth the cost model gives the collectives of these ranks (bytes/s), 0 when
// it plans no link for them; `text` says which link and why.
double assumed_busbw(const RunDevices& devices, std::string& text) {
  if (!devices.cuda) {
    text = "none: the planner costs plans for GPUs only; ranks on the CPU backend are threads "
           "sharing this machine's memory, and training runs the flags' plan there uncosted";
    return 0;
  }
  std::string report;
  const NodeTopology topology = load_machine(MachineSource{}, std::cin, &report);
  if (topology.gpu_count() < devices.ranks) {
    text = "none: the topology probe sees " + std::to_string(topology.gpu_count()) +
           " GPUs (" + report + ")";
    return 0;
  }
  std::vector<int> group;
  for (int gpu = 0; gpu < devices.ranks; ++gpu) group.push_back(gpu);
  std::string route;
  const double rate = ring_bandwidth(topology, group, group, &route);
  text = "ring over GPUs 0.." + std::to_string(devices.ranks - 1) + ", slowest hop " + route;
  return rate;
}

std::string fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  return text;
}

std::map<CommOp, const CommBenchRow*> peak_rows(const std::vector<CommBenchRow>& rows) {
  std::map<CommOp, const CommBenchRow*> peaks;
  for (const CommBenchRow& row : rows) {
    const CommBenchRow*& peak = peaks[row.op];
    if (peak == nullptr || row.busbw > peak->busbw) peak = &row;
  }
  return peaks;
}

struct BenchReport {
  RunDevices devices;
  CommBenchRequest request;
  std::vector<CommBenchRow> rows;
  double assumed_busbw = 0;  // bytes/s; 0: none
  std::string assumed_text;
};

std::string assumed_line(const BenchReport& report) {
  if (report.assumed_busbw <= 0) return "# the planner's link: " + report.assumed_text + "\n";
  return "# the planner's link: busbw " + fixed(report.assumed_busbw / 1e9, 2) + " GB/s (" +
         report.assumed_text + ")\n";
}

void print_table(const BenchReport& report, std::ostream& out) {
  const CommBenchRequest& request = report.request;
  // describe() names NCCL or the host copies on CUDA; on the CPU the communicator is implied.
  out << "# dstrain bench comm: " << report.devices.ranks << " ranks, "
      << report.devices.describe()
      << (report.devices.cuda ? "" : ", " + communicator_name(report.devices)) << "\n"
      << "# time: median of " << request.iters << " iterations (after " << request.warmup
      << " warm-up) of the slowest rank, barrier to completion; send_recv: a ring (rank r sends "
         "to r+1, receives from r-1); all_to_all: size / n to each peer\n"
      << "# algbw = size / time; busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (reduce_scatter, "
         "all_gather, all_to_all), 1 (send_recv)\n"
      << assumed_line(report) << "#\n";
  char line[160];
  std::snprintf(line, sizeof line, "%-16s %12s %12s %6s %12s %12s %12s\n", "# op", "size (B)",
                "count", "dtype", "time (us)", "algbw (GB/s)", "busbw (GB/s)");
  out << line;
  for (const CommBenchRow& row : report.rows) {
    std::snprintf(line, sizeof line, "%-16s %12lld %12lld %6s %12.1f %12.3f %12.3f\n",
                  comm_op_name(row.op), static_cast<long long>(row.bytes),
                  static_cast<long long>(row.count), precision_name(row.dtype), row.seconds * 1e6,
                  row.algbw / 1e9, row.busbw / 1e9);
    out << line;
  }
  out << "#\n# peak busbw:";
  const char* separator = " ";
  for (const auto& [op, row] : peak_rows(report.rows)) {
    out << separator << comm_op_name(op) << " " << fixed(row->busbw / 1e9, 3) << " GB/s (at "
        << row->bytes << " B)";
    separator = ", ";
  }
  out << "\n" << assumed_line(report);
}

nlohmann::json to_json(const BenchReport& report) {
  nlohmann::json rows = nlohmann::json::array();
  for (const CommBenchRow& row : report.rows) {
    rows.push_back({{"op", comm_op_name(row.op)}, {"size", row.bytes}, {"count", row.count},
                    {"dtype", precision_name(row.dtype)}, {"ranks", row.ranks},
                    {"time_us", row.seconds * 1e6}, {"algbw_gbps", row.algbw / 1e9},
                    {"busbw_gbps", row.busbw / 1e9}});
  }
  nlohmann::json peaks = nlohmann::json::object();
  for (const auto& [op, row] : peak_rows(report.rows)) peaks[comm_op_name(op)] = row->busbw / 1e9;
  nlohmann::json link = {{"busbw_gbps", nullptr}, {"route", report.assumed_text}};
  if (report.assumed_busbw > 0) link["busbw_gbps"] = report.assumed_busbw / 1e9;
  return {{"backend", report.devices.describe()},
          {"communicator", communicator_name(report.devices)},
          {"ranks", report.devices.ranks},
          {"warmup", report.request.warmup},
          {"iters", report.request.iters},
          {"time", "median over iters of the slowest rank's time, barrier to completion"},
          {"send_recv", "ring: rank r sends to r+1 and receives from r-1"},
          {"all_to_all", "size / ranks elements to each peer"},
          {"rows", rows},
          {"peak_busbw_gbps", peaks},
          {"assumed_link", link}};
}

int run_bench_comm(const std::vector<std::string>& args, std::ostream& out) {
  BenchCommFlags flags;
  const po::options_description description = bench_comm_flags(flags);
  const po::variables_map values = parse_command_flags(args, description);
  flags.gpus_given = values.count("gpus") > 0;
  if (values.count("help")) {
    out << kUsage
        << "Times the collectives of the communicator training would use (NCCL on GPUs, threads "
           "on the CPU backend) over doubling sizes, as nccl-tests does, and prints the bus "
           "bandwidth the planner assumes for these ranks next to the measured one.\n\n"
        << description << "\n";
    return 0;
  }
  BenchReport report;
  report.request = read_request(flags);
  report.devices = bench_devices(flags);
  report.request.sizes = parse_sizes(flags.sizes, report.request.dtype, report.devices.ranks);
  report.assumed_busbw = assumed_busbw(report.devices, report.assumed_text);
  report.rows = run_comm_bench(report.devices, report.request);
  if (values.count("json")) {
    out << to_json(report).dump(2) << "\n";
  } else {
    print_table(report, out);
  }
  return 0;
}

}  // namespace

int run_bench_command(const std::vector<std::string>& args, std::ostream& out) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    out << "Usage: dstrain bench comm [flags]   time the collectives (dstrain bench comm --help)\n";
    return 0;
  }
  DSTRAIN_USER_CHECK(!args.empty() && args[0] == "comm")
      << (args.empty() ? std::string("dstrain bench needs the benchmark to run")
                       : "dstrain bench has no benchmark '" + args[0] + "'")
      << ": the one it has is comm (dstrain bench comm --help)";
  return run_bench_comm(std::vector<std::string>(args.begin() + 1, args.end()), out);
}

}  // namespace dstrain
