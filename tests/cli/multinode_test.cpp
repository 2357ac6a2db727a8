// Several nodes (train/cluster.h): dstrain processes started as users start them on each node
// (--nnodes 2 --node-rank R --master-addr --master-port), CPU ranks joined by Gloo over TCP.
// Gloo's collectives reduce in the local communicator's fixed order, so the stated tolerance
// against one process with the same world is zero: the same losses and checkpoint bits. (One
// process of N ranks against one rank is the equivalence tests' business, tests/train.)
// The failure tests run the nodes in two network namespaces joined by a veth pair (root and
// `ip netns`; skipped with the reason otherwise), and cut one off mid-run.
#include <gtest/gtest.h>

#include "tests/common/checkpoint_checks.h"
#include "tests/common/jsonl_log.h"
#include "tests/common/temp_dir.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/gloo_communicator.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

#define SKIP_WITHOUT_GLOO() \
  if (!dstrain::gloo_available()) GTEST_SKIP() << "this build has no Gloo (libgloo-dev, DSTRAIN_GLOO)"

// A port nobody listens on now (the system's choice for port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof address;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

// The step records' losses of a JSONL log.
std::vector<double> losses(const fs::path& log) { return dstrain::testing::step_losses(log); }

// A started dstrain: its pid and where its output goes.
struct Process {
  pid_t pid = -1;
  fs::path out, err;
};

class MultiNodeTest : public ::testing::Test {
 protected:
  dstrain::testing::TempDir temp_;
  const fs::path& dir_ = temp_.path();

  // Starts `dstrain args` (inside network namespace `netns` when given), output to
  // dir_/<name>.out and .err.
  Process start(const std::string& name, const std::vector<std::string>& args,
                const std::string& netns = "") {
    Process process{-1, dir_ / (name + ".out"), dir_ / (name + ".err")};
    std::vector<std::string> words;
    if (!netns.empty()) words = {"/usr/sbin/ip", "netns", "exec", netns};
    words.push_back(DSTRAIN_BINARY);
    words.insert(words.end(), args.begin(), args.end());
    process.pid = ::fork();
    if (process.pid == 0) {
      (void)!std::freopen(process.out.c_str(), "w", stdout);
      (void)!std::freopen(process.err.c_str(), "w", stderr);
      std::vector<char*> argv;
      for (std::string& word : words) argv.push_back(word.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    return process;
  }

  // The exit code, waiting at most `seconds` (then killed: -1).
  static int wait_exit(const Process& process, double seconds) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    int status = 0;
    while (::waitpid(process.pid, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        ::kill(process.pid, SIGKILL);
        ::waitpid(process.pid, &status, 0);
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  // Two nodes of `gpus` CPU ranks each, node 0 at 127.0.0.1; returns both exit codes.
  std::pair<int, int> run_two_nodes(const std::vector<std::string>& args) {
    const std::vector<std::string> both = with_nodes(args, "127.0.0.1", free_port());
    // Node 1 first: nodes may start in any order.
    const Process node1 = start("node1", with_rank(both, 1));
    const Process node0 = start("node0", with_rank(both, 0));
    const int code0 = wait_exit(node0, 300), code1 = wait_exit(node1, 300);
    return {code0, code1};
  }

  static std::vector<std::string> with_nodes(std::vector<std::string> args,
                                             const std::string& master, int port,
                                             const std::string& join_seconds = "60") {
    args.insert(args.end(), {"--nnodes", "2", "--master-addr", master, "--master-port",
                             std::to_string(port), "--rendezvous-timeout", join_seconds});
    return args;
  }
  static std::vector<std::string> with_rank(std::vector<std::string> args, int rank) {
    args.insert(args.end(), {"--node-rank", std::to_string(rank)});
    return args;
  }

  std::string output(const std::string& name) const {
    return read_file(dir_ / (name + ".out")) + read_file(dir_ / (name + ".err"));
  }

  // Run dir_/<name> ended where 6 uninterrupted steps of one process with `plan` end: the same
  // losses and checkpoint bytes.
  void expect_same_as_one_process(const std::string& name, const std::vector<std::string>& plan);

  // The checkpoint's weights and moments of runs a and b are the same bytes.
  void expect_same_checkpoint(const fs::path& a, const fs::path& b) const {
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
      const std::string bytes = read_file(a / file);
      EXPECT_GT(bytes.size(), 1000u) << a / file;
      EXPECT_TRUE(bytes == read_file(b / file)) << file << " differs: " << a << " vs " << b;
    }
  }
};

// The run both ways: `steps` steps of the tiny model, a checkpoint and a log in dir/<name>.
std::vector<std::string> tiny_run(const fs::path& dir, const std::string& name,
                                  std::vector<std::string> plan, const std::string& steps = "6",
                                  const std::string& comm_timeout = "60") {
  std::vector<std::string> args = {"--device", "cpu", "--steps", steps, "--batch", "4",
                                   "--seq-len", "32", "--eval-every", "3", "--sample", "0",
                                   "--threads", "2", "--comm-timeout", comm_timeout,
                                   "--out", (dir / name).string(),
                                   "--log", (dir / (name + ".jsonl")).string()};
  args.insert(args.end(), plan.begin(), plan.end());
  return args;
}

void expect_same_run(const fs::path& dir, const std::string& a, const std::string& b) {
  const std::vector<double> la = losses(dir / (a + ".jsonl")), lb = losses(dir / (b + ".jsonl"));
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb) << "the losses of " << a << " and " << b;
  EXPECT_LT(la.back(), la.front()) << "the model learns";
}

// Resumes run dir/<name> to step 6 on the CPU, its checkpoints and log where they were.
std::vector<std::string> resume_to_six(const fs::path& dir, const std::string& name,
                                       std::vector<std::string> plan) {
  std::vector<std::string> args = {"--resume", (dir / name).string(), "--steps", "6",
                                   "--device", "cpu", "--threads", "2",
                                   "--out", (dir / name).string(),
                                   "--log", (dir / (name + ".jsonl")).string()};
  args.insert(args.end(), plan.begin(), plan.end());
  return args;
}

void MultiNodeTest::expect_same_as_one_process(const std::string& name,
                                               const std::vector<std::string>& plan) {
  const Process single = start("single", tiny_run(dir_, "single", plan));
  ASSERT_EQ(wait_exit(single, 300), 0) << output("single");
  expect_same_run(dir_, name, "single");
  expect_same_checkpoint(dir_ / name / "step-000006", dir_ / "single" / "step-000006");
}

TEST_F(MultiNodeTest, TwoNodesOfTwoRanksEqualOneProcessOfFourZero3) {
  SKIP_WITHOUT_GLOO();
  const auto [code0, code1] =
      run_two_nodes(tiny_run(dir_, "nodes", {"--gpus", "2", "--zero", "3"}));
  ASSERT_EQ(code0, 0) << output("node0");
  ASSERT_EQ(code1, 0) << output("node1");
  EXPECT_NE(output("node0").find("every node joined: node 0"), std::string::npos);
  EXPECT_NE(output("node0").find("dp 4"), std::string::npos) << "4 ranks in all";
  EXPECT_NE(output("node1").find("node 1 ("), std::string::npos) << output("node1");
  expect_same_as_one_process("nodes", {"--gpus", "4", "--zero", "3"});
  // Node 1 left no staging directory behind, and only node 0 wrote the log.
  for (const auto& entry : fs::directory_iterator(dir_ / "nodes")) {
    EXPECT_FALSE(entry.path().filename().string().starts_with(".tmp")) << entry.path();
  }
}

TEST_F(MultiNodeTest, APipelineAcrossTwoNodesEqualsOneProcess) {
  SKIP_WITHOUT_GLOO();
  // pp 2 x dp 2: stage 0 is ranks 0-1 (node 0), stage 1 ranks 2-3 (node 1): every activation
  // and gradient between the stages crosses the nodes.
  const std::vector<std::string> plan = {"--gpus", "2", "--pp", "2", "--grad-accum", "2"};
  const auto [code0, code1] = run_two_nodes(tiny_run(dir_, "nodes", plan));
  ASSERT_EQ(code0, 0) << output("node0");
  ASSERT_EQ(code1, 0) << output("node1");
  EXPECT_NE(output("node0").find("dp 2 x tp 1 x pp 2"), std::string::npos) << output("node0");
  expect_same_as_one_process("nodes", {"--gpus", "4", "--pp", "2", "--grad-accum", "2"});
}

TEST_F(MultiNodeTest, ACheckpointOfTwoNodesResumesOnOneProcess) {
  SKIP_WITHOUT_GLOO();
  // Two nodes train 3 steps; one process of 4 ranks resumes to 6 and must end where the
  // uninterrupted run ends.
  const auto [code0, code1] =
      run_two_nodes(tiny_run(dir_, "nodes", {"--gpus", "2", "--zero", "3"}, "3"));
  ASSERT_EQ(code0, 0) << output("node0");
  ASSERT_EQ(code1, 0) << output("node1");
  ASSERT_TRUE(fs::is_directory(dir_ / "nodes" / "step-000003"));
  // No --gpus: the checkpoint remembers the world's 4 ranks.
  const Process resumed = start("resumed", resume_to_six(dir_, "nodes", {}));
  ASSERT_EQ(wait_exit(resumed, 300), 0) << output("resumed");
  expect_same_as_one_process("nodes", {"--gpus", "4", "--zero", "3"});
}

TEST_F(MultiNodeTest, AOneProcessCheckpointResumesOnTwoNodes) {
  SKIP_WITHOUT_GLOO();
  // 1 process of 4 ranks trains 3 steps; 2 nodes of 2 ranks (--gpus per node) resume to 6.
  const Process first =
      start("first", tiny_run(dir_, "resumed", {"--gpus", "4", "--zero", "3"}, "3"));
  ASSERT_EQ(wait_exit(first, 300), 0) << output("first");
  const auto [code0, code1] = run_two_nodes(resume_to_six(dir_, "resumed", {"--gpus", "2"}));
  ASSERT_EQ(code0, 0) << output("node0");
  ASSERT_EQ(code1, 0) << output("node1");
  expect_same_as_one_process("resumed", {"--gpus", "4", "--zero", "3"});
}

// With a machine to plan for, the planner plans for the cluster (topology/cluster.h) and every
// node runs that plan: the one `dstrain plan --nnodes 2` prints for the same flags.
TEST_F(MultiNodeTest, APlannedRunAcrossNodesRunsThePlanOfDstrainPlan) {
  SKIP_WITHOUT_GLOO();
  const std::string topology =
      std::string(DSTRAIN_SOURCE_DIR) + "/tests/topology/fixtures/rtx4090-2gpu-ansi.txt";
  const std::vector<std::string> machine = {"--topology", topology, "--gpu", "rtx4090",
                                            "--model", "tiny", "--seq-len", "32",
                                            "--global-batch-tokens", "256",
                                            "--inter-node-bandwidth", "10Gbit/s"};
  std::vector<std::string> args = {"--device", "cpu", "--steps", "3", "--eval-every", "0",
                                   "--sample", "0", "--threads", "2"};
  args.insert(args.end(), machine.begin(), machine.end());
  const auto [code0, code1] = run_two_nodes(args);
  ASSERT_EQ(code0, 0) << output("node0");
  ASSERT_EQ(code1, 0) << output("node1");
  std::vector<std::string> plan_args = {"plan", "--nnodes", "2"};
  plan_args.insert(plan_args.end(), machine.begin(), machine.end());
  const Process planner = start("plan", plan_args);
  ASSERT_EQ(wait_exit(planner, 60), 0) << output("plan");
  const std::string planned = output("plan");
  const size_t at = planned.find("\nplan: ");
  ASSERT_NE(at, std::string::npos) << planned;
  const std::string plan = planned.substr(at + 7, planned.find('\n', at + 1) - at - 7);
  EXPECT_NE(planned.find("cluster: 2 nodes x 2 GPUs"), std::string::npos) << planned;
  for (const char* node : {"node0", "node1"}) {
    EXPECT_NE(output(node).find("cluster: 2 nodes x 2 GPUs"), std::string::npos) << output(node);
    EXPECT_NE(output(node).find("plan for 4 x NVIDIA GeForce RTX 4090 (24.00 GiB): " + plan),
              std::string::npos)
        << "the plan printed by dstrain plan: " << plan << "\n" << output(node);
  }
  EXPECT_NE(output("node0").find("done: 3 steps"), std::string::npos) << output("node0");
}

TEST_F(MultiNodeTest, NodesStartedWithOtherSettingsRefuseToRun) {
  SKIP_WITHOUT_GLOO();
  const std::vector<std::string> both =
      with_nodes(tiny_run(dir_, "nodes", {"--gpus", "2"}), "127.0.0.1", free_port());
  std::vector<std::string> other = with_rank(both, 1);
  other.insert(other.end(), {"--lr", "0.001"});
  const Process node1 = start("node1", other);
  const Process node0 = start("node0", with_rank(both, 0));
  EXPECT_EQ(wait_exit(node0, 120), 2) << output("node0");
  EXPECT_EQ(wait_exit(node1, 120), 2) << output("node1");
  for (const char* node : {"node0", "node1"}) {
    EXPECT_NE(output(node).find("node 1 would run with --lr = 0.001, node 0 with 0.003"),
              std::string::npos)
        << output(node);
    EXPECT_NE(output(node).find("start every node with the same flags"), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(dir_ / "nodes" / "step-000006"));
}

TEST_F(MultiNodeTest, ANodeThatNeverComesIsNamed) {
  SKIP_WITHOUT_GLOO();
  const std::vector<std::string> args = with_rank(
      with_nodes(tiny_run(dir_, "nodes", {"--gpus", "2"}), "127.0.0.1", free_port(), "2"), 0);
  const auto begin = Clock::now();
  const Process node0 = start("node0", args);
  EXPECT_EQ(wait_exit(node0, 60), 2) << output("node0");
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - begin).count(), 30.0);
  EXPECT_NE(output("node0").find("node 1 of 2 never joined the rendezvous"), std::string::npos)
      << output("node0");
}

TEST_F(MultiNodeTest, SigtermOnOneNodeStopsEveryNodeWithACheckpoint) {
  SKIP_WITHOUT_GLOO();
  const std::vector<std::string> args =
      tiny_run(dir_, "nodes", {"--gpus", "2", "--zero", "3"}, "100000");  // until the signal
  const std::vector<std::string> both = with_nodes(args, "127.0.0.1", free_port());
  const Process node0 = start("node0", with_rank(both, 0));
  const Process node1 = start("node1", with_rank(both, 1));
  // Signal node 1 once node 0 has logged 3 steps.
  for (int i = 0; i < 1200 && losses(dir_ / "nodes.jsonl").size() < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(losses(dir_ / "nodes.jsonl").size(), 3u) << output("node0");
  ::kill(node1.pid, SIGTERM);
  EXPECT_EQ(wait_exit(node1, 120), 128 + SIGTERM) << output("node1");
  EXPECT_EQ(wait_exit(node0, 120), 128 + SIGTERM) << output("node0");
  EXPECT_NE(output("node0").find("interrupted (SIGTERM)"), std::string::npos) << output("node0");
  // The checkpoint is whole: it resumes.
  const int64_t saved = static_cast<int64_t>(losses(dir_ / "nodes.jsonl").size());
  const Process resumed = start("resumed", {"--resume", (dir_ / "nodes").string(), "--steps",
                                            std::to_string(saved + 1), "--device", "cpu",
                                            "--threads", "2"});
  EXPECT_EQ(wait_exit(resumed, 300), 0) << output("resumed");
}

// SIGKILL on one node at random moments (either node; during start-up, a step or a save): the
// other notices and exits (no hang), every checkpoint on the shared --out reads back whole, and
// both nodes restarted with --resume go on until the run ends. Its checkpoints and losses are
// then one process's of the same world, to the bit.
TEST_F(MultiNodeTest, OneNodeKilledAtRandomMomentsEveryResumeIsBitIdentical) {
  SKIP_WITHOUT_GLOO();
  constexpr int kKills = 4;
  const std::vector<std::string> every_step = {"--save-every", "1", "--quiet"};
  std::vector<std::string> plan = {"--gpus", "4", "--zero", "3"};
  plan.insert(plan.end(), every_step.begin(), every_step.end());
  const auto started = Clock::now();
  const Process single = start("single", tiny_run(dir_, "single", plan, "6", "20"));
  ASSERT_EQ(wait_exit(single, 300), 0) << output("single");
  // Two processes meeting: more than one's time, roughly.
  const double whole_run = 1.5 * std::chrono::duration<double>(Clock::now() - started).count();
  plan = {"--gpus", "2", "--zero", "3"};
  plan.insert(plan.end(), every_step.begin(), every_step.end());
  std::mt19937 rng(20261127);
  std::uniform_real_distribution<double> fraction(0.0, 1.0);
  const fs::path run = dir_ / "nodes";
  int kills = 0;
  for (int round = 0; round < 6 && kills < kKills; ++round) {
    fs::remove_all(run);
    for (int attempt = 0;; ++attempt) {
      ASSERT_LT(attempt, 40) << "the run never reached its end";
      const std::vector<std::string> steps = dstrain::testing::step_directories(run);
      if (!steps.empty() && steps.back() == "step-000006") break;
      std::vector<std::string> args = tiny_run(dir_, "nodes", plan, "6", "20");
      args.push_back("--overwrite");
      if (!steps.empty()) args = resume_to_six(dir_, "nodes", {"--gpus", "2", "--quiet"});
      // A node killed before the other joined: the other gives up at the rendezvous timeout.
      const std::vector<std::string> both = with_nodes(args, "127.0.0.1", free_port(), "10");
      const std::array<Process, 2> nodes = {start("node0", with_rank(both, 0)),
                                            start("node1", with_rank(both, 1))};
      const size_t victim = rng() % 2;
      if (kills < kKills) {
        const double left = static_cast<double>(7 - steps.size()) / 7;
        std::this_thread::sleep_for(
            std::chrono::duration<double>(fraction(rng) * left * whole_run));
        ::kill(nodes[victim].pid, SIGKILL);
      }
      const std::array<int, 2> codes = {wait_exit(nodes[0], 300), wait_exit(nodes[1], 300)};
      ASSERT_NE(codes[0], -1) << "node 0 hung\n" << output("node0");
      ASSERT_NE(codes[1], -1) << "node 1 hung\n" << output("node1");
      if (codes[0] == 0 && codes[1] == 0) break;
      ASSERT_EQ(codes[victim], 128 + SIGKILL) << output(victim == 0 ? "node0" : "node1");
      ++kills;
      dstrain::testing::expect_whole_checkpoints(run, "after kill " + std::to_string(kills));
    }
    dstrain::testing::expect_same_checkpoints_and_losses(
        run, dir_ / "nodes.jsonl", dir_ / "single", dir_ / "single.jsonl", 6);
    for (const fs::directory_entry& entry : fs::directory_iterator(run)) {
      EXPECT_FALSE(entry.path().filename().string().starts_with(".tmp-")) << entry.path();
    }
  }
  EXPECT_GE(kills, kKills);
}

// Two network namespaces joined by a veth pair: two "machines" with their own addresses.
class NetworkNamespaces {
 public:
  NetworkNamespaces() {
    const std::string tag = std::to_string(::getpid() % 100000);
    a_ = "dsa" + tag;
    b_ = "dsb" + tag;
    const std::string va = "va" + tag, vb = "vb" + tag;
    ok_ = sh("ip netns add " + a_) && sh("ip netns add " + b_) &&
          sh("ip link add " + va + " netns " + a_ + " type veth peer name " + vb + " netns " + b_) &&
          sh("ip -n " + a_ + " addr add 10.231.0.1/24 dev " + va) &&
          sh("ip -n " + b_ + " addr add 10.231.0.2/24 dev " + vb) &&
          sh("ip -n " + a_ + " link set " + va + " up") && sh("ip -n " + b_ + " link set " + vb + " up") &&
          sh("ip -n " + a_ + " link set lo up") && sh("ip -n " + b_ + " link set lo up");
    link_b_ = vb;
  }
  ~NetworkNamespaces() {
    sh("ip netns del " + a_);
    sh("ip netns del " + b_);
  }
  bool ok() const { return ok_; }
  const std::string& a() const { return a_; }
  const std::string& b() const { return b_; }
  // Takes machine b off the network: its packets go nowhere, no connection is reset.
  bool cut_b() const { return sh("ip -n " + b_ + " link set " + link_b_ + " down"); }

 private:
  static bool sh(const std::string& command) {
    return std::system((command + " >/dev/null 2>&1").c_str()) == 0;
  }
  std::string a_, b_, link_b_;
  bool ok_ = false;
};

TEST_F(MultiNodeTest, ANodeCutOffTheNetworkStopsEveryNodeWithinTheTimeout) {
  SKIP_WITHOUT_GLOO();
  NetworkNamespaces machines;
  if (!machines.ok()) GTEST_SKIP() << "cannot make network namespaces (needs root and `ip netns`)";
  const std::vector<std::string> args =
      tiny_run(dir_, "nodes", {"--gpus", "2", "--zero", "3"}, "100000", "8");
  // The namespaces are fresh: any port is free there.
  const std::vector<std::string> both = with_nodes(args, "10.231.0.1", 29500);
  const Process node0 = start("node0", with_rank(both, 0), machines.a());
  const Process node1 = start("node1", with_rank(both, 1), machines.b());
  for (int i = 0; i < 1200 && losses(dir_ / "nodes.jsonl").size() < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(losses(dir_ / "nodes.jsonl").size(), 3u) << output("node0") << output("node1");
  ASSERT_TRUE(machines.cut_b());
  const auto cut = Clock::now();
  const int code0 = wait_exit(node0, 120), code1 = wait_exit(node1, 120);
  const double seconds = std::chrono::duration<double>(Clock::now() - cut).count();
  EXPECT_NE(code0, 0) << output("node0");
  EXPECT_NE(code1, 0) << output("node1");
  EXPECT_NE(code0, -1) << "node 0 hung";
  EXPECT_NE(code1, -1) << "node 1 hung";
  // One timeout to notice (node 0 does not wait for node 1 to hang up after a failure).
  EXPECT_LT(seconds, 8 + 10) << output("node0");
  for (const char* node : {"node0", "node1"}) {
    const std::string text = output(node);
    EXPECT_NE(text.find("did not come within 8 s"), std::string::npos) << text;
    EXPECT_NE(text.find("[the ranks: node 0 ("), std::string::npos) << text;
    EXPECT_NE(text.find("dstrain: error: on node "), std::string::npos) << text;
  }
  EXPECT_NE(output("node1").find("every node joined"), std::string::npos) << output("node1");
  EXPECT_NE(output("node0").find("on node 0 ("), std::string::npos) << output("node0");
  EXPECT_NE(output("node1").find("on node 1 ("), std::string::npos) << output("node1");
}

}  // namespace
