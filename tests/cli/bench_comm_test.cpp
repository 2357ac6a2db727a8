// `dstrain bench comm` and the library under it (cli/comm_bench.h): every op at every size with
// nccl-tests' bus factors, collectives that are checked (a broken one fails the run), the
// user's mistakes as one sentence and exit code 2, and NCCL on emulated GPUs where the build
// has them. No assertion on how fast anything is.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/comm_bench.h"
#include "comm/nccl_communicator.h"
#include "tests/common/cli_run.h"
#include "tests/common/run_binary.h"
#include "tests/common/temp_dir.h"
#include "train/devices.h"

namespace dstrain {
namespace {

using testing::CliResult;
using testing::expect_cli_user_error;
using testing::run_cli_args;

const std::vector<std::string> kOps = {"all_reduce", "reduce_scatter", "all_gather", "send_recv",
                                       "all_to_all"};

double nccl_tests_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "send_recv") return 1.0;
  return static_cast<double>(n - 1) / n;
}

// Every op at every size of `sizes`, in that order; the fields as nccl-tests defines them.
void expect_rows(const nlohmann::json& report, int ranks, const std::vector<int64_t>& sizes,
                 const std::string& dtype, int64_t dtype_bytes) {
  const nlohmann::json& rows = report.at("rows");
  ASSERT_EQ(rows.size(), kOps.size() * sizes.size()) << report.dump(2);
  size_t i = 0;
  for (const std::string& op : kOps) {
    for (int64_t size : sizes) {
      const nlohmann::json& row = rows[i++];
      SCOPED_TRACE(row.dump());
      EXPECT_EQ(row.at("op"), op);
      EXPECT_EQ(row.at("size").get<int64_t>(), size);
      EXPECT_EQ(row.at("count").get<int64_t>(), size / dtype_bytes);
      EXPECT_EQ(row.at("dtype"), dtype);
      EXPECT_EQ(row.at("ranks").get<int>(), ranks);
      const double time_us = row.at("time_us").get<double>();
      const double algbw = row.at("algbw_gbps").get<double>();
      EXPECT_GT(time_us, 0.0);
      EXPECT_NEAR(algbw, size / (time_us * 1e-6) / 1e9, 1e-9 * algbw);
      EXPECT_NEAR(row.at("busbw_gbps").get<double>(), algbw * nccl_tests_factor(op, ranks),
                  1e-9 * algbw);
    }
  }
}

nlohmann::json bench_json(const std::vector<std::string>& flags) {
  std::vector<std::string> args = {"bench", "comm", "--json"};
  args.insert(args.end(), flags.begin(), flags.end());
  const CliResult result = run_cli_args(args);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  return nlohmann::json::parse(result.out);
}

TEST(BenchCommCli, JsonOnTwoCpuRanksHasEveryOpAtEverySize) {
  const nlohmann::json report = bench_json(
      {"--device", "cpu", "--gpus", "2", "--sizes", "1K:16K", "--iters", "2", "--warmup", "1"});
  expect_rows(report, 2, {1024, 2048, 4096, 8192, 16384}, "fp32", 4);
  EXPECT_EQ(report.at("ranks"), 2);
  EXPECT_NE(report.at("communicator").get<std::string>().find("threads"), std::string::npos);
  // The planner costs no link for threads: it says so instead of a number.
  EXPECT_TRUE(report.at("assumed_link").at("busbw_gbps").is_null());
  EXPECT_NE(report.at("assumed_link").at("route").get<std::string>().find("GPUs only"),
            std::string::npos);
  for (const std::string& op : kOps) EXPECT_GT(report.at("peak_busbw_gbps").at(op), 0.0);
}

TEST(BenchCommCli, FourRanksInBf16UseTheNcclTestsFactors) {
  const nlohmann::json report = bench_json({"--device", "cpu", "--gpus", "4", "--sizes", "4K:8K",
                                            "--dtype", "bf16", "--iters", "1", "--warmup", "0"});
  expect_rows(report, 4, {4096, 8192}, "bf16", 2);
  // 2(n-1)/n = 1.5, (n-1)/n = 0.75, 1.
  const std::map<std::string, double> factors = {
      {"all_reduce", 1.5}, {"reduce_scatter", 0.75}, {"all_gather", 0.75}, {"send_recv", 1.0},
      {"all_to_all", 0.75}};
  for (const nlohmann::json& row : report.at("rows")) {
    EXPECT_DOUBLE_EQ(row.at("busbw_gbps").get<double>() / row.at("algbw_gbps").get<double>(),
                     factors.at(row.at("op")));
  }
}

TEST(BenchCommCli, TableNamesTheCommunicatorTheRowsAndThePlannersLink) {
  const CliResult result =
      run_cli_args({"bench", "comm", "--device", "cpu", "--sizes", "2K", "--ops",
                    "send_recv,all_reduce", "--iters", "1", "--warmup", "0"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const std::string& text = result.out;
  EXPECT_NE(text.find("2 ranks, the CPU backend, local communicator"), std::string::npos) << text;
  EXPECT_NE(text.find("busbw (GB/s)"), std::string::npos) << text;
  EXPECT_NE(text.find("the planner's link: none"), std::string::npos) << text;
  EXPECT_NE(text.find("peak busbw: all_reduce"), std::string::npos) << text;
  // The rows in the order of --ops: send_recv first.
  const size_t send_recv = text.find("\nsend_recv "), all_reduce = text.find("\nall_reduce ");
  ASSERT_NE(send_recv, std::string::npos) << text;
  ASSERT_NE(all_reduce, std::string::npos) << text;
  EXPECT_LT(send_recv, all_reduce);
  EXPECT_NE(text.find("2048"), std::string::npos) << text;
}

TEST(BenchCommCli, MistakesAreOneSentenceAndExitTwo) {
  expect_cli_user_error({"bench"}, "the one it has is comm");
  expect_cli_user_error({"bench", "nccl"}, "no benchmark 'nccl': the one it has is comm");
  const std::vector<std::string> cpu = {"bench", "comm", "--device", "cpu"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = cpu;
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  expect_cli_user_error(with({"--sizes", "4K:1K"}), "--sizes 4K:1K: the first size must not be");
  expect_cli_user_error(with({"--sizes", "1X"}), "--sizes takes MIN:MAX");
  expect_cli_user_error(with({"--sizes", "1K:2Q"}), "not '1K:2Q'");
  expect_cli_user_error(with({"--sizes", "4:1K"}),
                        "4 bytes is less than one fp32 element per rank");
  expect_cli_user_error(with({"--gpus", "0"}), "--gpus takes a count of at least 2 ranks");
  expect_cli_user_error(with({"--gpus", "1"}), "not 1");
  expect_cli_user_error(with({"--ops", "all_reduce,foo"}), "unknown collective 'foo'");
  expect_cli_user_error(with({"--ops", ","}), "--ops names no collective");
  expect_cli_user_error(with({"--dtype", "int32"}), "--dtype takes fp32, fp16 or bf16");
  expect_cli_user_error(with({"--dtype", "fp8"}), "--dtype takes fp32, fp16 or bf16, not 'fp8'");
  expect_cli_user_error(with({"--iters", "0"}), "--iters takes a count of at least 1");
  expect_cli_user_error(with({"--warmup", "-1"}), "--warmup takes a count of at least 0");
  expect_cli_user_error(with({"--frobnicate"}), "unknown flag --frobnicate");
  expect_cli_user_error({"bench", "comm", "--device", "tpu"}, "--device must be auto, cpu or cuda");
}

TEST(BenchCommCli, MoreGpusThanTheMachineHasIsRefused) {
  const int gpus = usable_cuda_devices();
  const std::string asked = std::to_string(std::max(gpus + 1, 2));
  std::string fragment = "--gpus " + asked + ": this machine has " + std::to_string(gpus) + " GPU";
  if (!cuda_backend_built()) fragment = "built without the CUDA backend";
  else if (gpus == 0) fragment = "no CUDA device is usable";
  expect_cli_user_error({"bench", "comm", "--device", "cuda", "--gpus", asked}, fragment);
  // The default --gpus is all GPUs: one is not enough for a collective.
  if (gpus == 1) {
    expect_cli_user_error({"bench", "comm"}, "this machine has 1 GPU and a collective needs two");
  }
}

TEST(BenchCommCli, HelpListsTheFlags) {
  const CliResult result = run_cli_args({"bench", "comm", "--help"});
  EXPECT_EQ(result.exit_code, 0);
  for (const char* flag : {"--gpus", "--sizes", "--ops", "--dtype", "--iters", "--warmup",
                           "--device", "--json"}) {
    EXPECT_NE(result.out.find(flag), std::string::npos) << flag;
  }
}

// NCCL on two emulated GPUs (DSTRAIN_CUDA=EMULATOR), through the binary so that the emulator
// starts with two devices; on a real CUDA build, two GPUs of this machine.
TEST(BenchCommCli, NcclOnTwoGpus) {
  if (!cuda_backend_built() || !nccl_available()) {
    GTEST_SKIP() << "this build has no CUDA backend with NCCL (DSTRAIN_CUDA=EMULATOR has one)";
  }
  testing::TempDir temp;
  const testing::BinaryResult result = testing::run_binary(
      std::string("DSTRAIN_CUDA_EMU_DEVICES=2 ") + DSTRAIN_BINARY,
      "bench comm --device cuda --gpus 2 --sizes 1K:4K --iters 2 --warmup 1 --json", temp.path());
  if (result.err.find("this machine has") != std::string::npos ||
      result.err.find("no CUDA device is usable") != std::string::npos) {
    GTEST_SKIP() << "fewer than 2 GPUs here: " << result.err;
  }
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const nlohmann::json report = nlohmann::json::parse(result.out);
  EXPECT_EQ(report.at("communicator"), "NCCL");
  expect_rows(report, 2, {1024, 2048, 4096}, "fp32", 4);
  // Two GPUs the probe sees: the planner's ring over them has a bandwidth.
  EXPECT_GT(report.at("assumed_link").at("busbw_gbps").get<double>(), 0.0) << report.dump(2);
}

// The library: each timed collective's result is checked, so a broken one fails the benchmark.
class DoNothingAllReduce final : public Communicator {
 public:
  explicit DoNothingAllReduce(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void all_reduce(Tensor, ReduceOp, Stream) override {}  // broken: leaves the rank's own values
  void reduce_scatter(Tensor o, Tensor i, ReduceOp op, Stream s) override {
    inner_.reduce_scatter(o, i, op, s);
  }
  void all_gather(Tensor o, Tensor i, Stream s) override { inner_.all_gather(o, i, s); }
  void broadcast(Tensor b, int root, Stream s) override { inner_.broadcast(b, root, s); }
  void send(Tensor b, int peer, Stream s) override { inner_.send(b, peer, s); }
  void recv(Tensor b, int peer, Stream s) override { inner_.recv(b, peer, s); }
  void exchange(const std::vector<P2POp>& ops, Stream s) override { inner_.exchange(ops, s); }
  void barrier() override { inner_.barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_.split(color, key);
  }

 private:
  Communicator& inner_;
};

CommBenchRequest small_request(std::vector<CommOp> ops, DType dtype) {
  CommBenchRequest request;
  request.ops = std::move(ops);
  request.sizes = {96, 4096};
  request.dtype = dtype;
  request.warmup = 0;
  request.iters = 1;
  request.timeout_seconds = 60;
  return request;
}

TEST(CommBench, ABrokenAllReduceFailsTheBenchmark) {
  try {
    run_local_ranks(2, 60, [](Communicator& comm) {
      DoNothingAllReduce broken(comm);
      auto backend = make_cpu_backend(1);
      auto memory = make_cpu_allocator(comm.rank());
      time_collectives_on_rank({broken, *backend, *memory, nullptr},
                               small_request({CommOp::AllReduce}, DType::F32));
    });
    FAIL() << "a do-nothing all_reduce was timed without complaint";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("all_reduce of 24 F32 elements on 2 ranks gave a "
                                             "wrong result"),
              std::string::npos)
        << error.what();
  }
}

// Every collective on an odd rank count and in every dtype: the checks pass, and the counts are
// rounded down to a multiple of the ranks where the op splits the buffer.
TEST(CommBench, EveryCollectiveIsRightOnThreeRanksInEveryDtype) {
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::vector<CommBenchRow> rows =
        run_comm_bench(choose_devices("cpu", 3), small_request(all_comm_ops(), dtype));
    ASSERT_EQ(rows.size(), 10u);
    const int64_t size = static_cast<int64_t>(dtype_size(dtype));
    for (const CommBenchRow& row : rows) {
      const bool splits = row.op == CommOp::ReduceScatter || row.op == CommOp::AllGather ||
                          row.op == CommOp::AllToAll;
      EXPECT_EQ(row.count * size, row.bytes);
      EXPECT_EQ(row.ranks, 3);
      if (splits) {
        EXPECT_EQ(row.count % 3, 0) << comm_op_name(row.op);
      }
      EXPECT_GT(row.seconds, 0.0);
      EXPECT_DOUBLE_EQ(row.busbw, row.algbw * bus_factor(row.op, 3));
    }
    // 4096 bytes: fp32 1024 elements, rounded to 1023 for reduce_scatter.
    EXPECT_EQ(rows[3].count, 4096 / size / 3 * 3);
    EXPECT_EQ(rows[1].count, 4096 / size);
  }
}

TEST(CommBench, SizesDoubleAndBusFactorsAreNcclTests) {
  EXPECT_EQ(doubling_sizes(1024, 16384), (std::vector<int64_t>{1024, 2048, 4096, 8192, 16384}));
  EXPECT_EQ(doubling_sizes(3072, 12288), (std::vector<int64_t>{3072, 6144, 12288}));
  EXPECT_EQ(doubling_sizes(1024, 3000), (std::vector<int64_t>{1024, 2048}));
  EXPECT_EQ(doubling_sizes(5, 5), (std::vector<int64_t>{5}));
  EXPECT_EQ(comm_bench_count(CommOp::ReduceScatter, 1024, DType::F32, 3), 255);
  EXPECT_EQ(comm_bench_count(CommOp::AllReduce, 1024, DType::F32, 3), 256);
  EXPECT_DOUBLE_EQ(bus_factor(CommOp::AllReduce, 8), 1.75);
  EXPECT_DOUBLE_EQ(bus_factor(CommOp::AllGather, 8), 0.875);
  EXPECT_DOUBLE_EQ(bus_factor(CommOp::SendRecv, 8), 1.0);
  EXPECT_EQ(parse_comm_op("reduce_scatter"), CommOp::ReduceScatter);
  EXPECT_THROW(parse_comm_op("allreduce"), UserError);
}

}  // namespace
}  // namespace dstrain
