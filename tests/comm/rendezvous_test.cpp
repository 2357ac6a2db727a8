// The rendezvous (comm/rendezvous.h): options from flags and a fake environment (precedence and
// every bad value, each a UserError naming its flag or variable); "nodes" on threads over
// 127.0.0.1 joining in shuffled order, a missing node named at the timeout, broadcast and
// barrier; and real processes (this test binary spawned again, see SpawnedNode below) joining
// node 0 on loopback. Timeouts are short; no test asserts on wall-clock time.
#include "comm/rendezvous.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <latch>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "tests/comm/spawn_util.h"
#include "core/rng.h"

extern char** environ;

namespace dstrain::test {
namespace {

constexpr double kJoinTimeout = 3.0;   // for runs that must join: never fires unless broken
constexpr double kShortTimeout = 0.5;  // for the tests of a missing node

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\n  message: " << text << "\n  lacks:   " << part;
}

int free_port() { return TcpStoreServer(0, kJoinTimeout).port(); }

RendezvousOptions node_options(int port, int nnodes, int rank, double timeout) {
  return {.master_addr = "127.0.0.1",
          .master_port = port,
          .nnodes = nnodes,
          .node_rank = rank,
          .timeout_seconds = timeout};
}

// The UserError that f throws, checked to be one sentence (a user reads it as it is); "" and
// a failure when f throws none.
template <class F>
std::string user_sentence_of(F&& f) {
  std::string sentence;
  try {
    f();
    ADD_FAILURE() << "no dstrain::UserError was thrown";
  } catch (const UserError& e) {
    sentence = e.what();
  }
  EXPECT_EQ(sentence.find('\n'), std::string::npos) << sentence;
  EXPECT_TRUE(sentence.empty() || sentence.back() == '.') << "not a sentence: " << sentence;
  return sentence;
}

// The payload node 0 broadcasts in round `round`: binary, NULs included, 1 KiB.
std::string payload(int round) {
  std::string bytes(1024, '\0');
  uint64_t state = 1234 + static_cast<uint64_t>(round);
  for (char& byte : bytes) byte = static_cast<char>(splitmix64(state));
  return bytes;
}

// What every node of a healthy run does after join: two broadcast rounds under one key, then
// a barrier. Returns "" or what went wrong.
std::string broadcast_and_barrier(Rendezvous& rendezvous) {
  const bool root = rendezvous.options().node_rank == 0;
  for (int round = 0; round < 2; ++round) {
    const std::string got = rendezvous.broadcast_bytes("nccl-id", root ? payload(round) : "");
    if (got != payload(round)) return "broadcast round " + std::to_string(round) + " differs";
  }
  rendezvous.barrier("done");
  return "";
}

// Runs node(rank) on a thread per rank, started in `order` with `gap` between starts. Returns
// each rank's dstrain::Error message ("" when it returned).
std::vector<std::string> run_nodes(const std::vector<int>& order, std::chrono::milliseconds gap,
                                   int nnodes, const std::function<void(int rank)>& node) {
  std::vector<std::string> messages(static_cast<size_t>(nnodes));
  std::vector<std::thread> threads;
  for (const int rank : order) {
    threads.emplace_back([&, rank] {
      try {
        node(rank);
      } catch (const Error& e) {
        messages[static_cast<size_t>(rank)] = e.what();
      }
    });
    std::this_thread::sleep_for(gap);
  }
  for (std::thread& thread : threads) thread.join();
  return messages;
}

// ---- options --------------------------------------------------------------------------------

EnvironmentLookup fake_environment(std::map<std::string, std::string> variables) {
  return [variables](const std::string& name) -> std::optional<std::string> {
    const auto found = variables.find(name);
    if (found == variables.end()) return std::nullopt;
    return found->second;
  };
}

// The options as one line, for EXPECT_EQ to compare and print.
std::string options_text(const std::string& addr, int port, int nnodes, int rank, double timeout) {
  std::ostringstream text;
  text << addr << ":" << port << ", nnodes " << nnodes << ", node_rank " << rank << ", timeout "
       << timeout;
  return text.str();
}
std::string shown(const RendezvousOptions& o) {
  return options_text(o.master_addr, o.master_port, o.nnodes, o.node_rank, o.timeout_seconds);
}

// Every variable set, to values no flag in these tests uses.
const std::map<std::string, std::string> kEveryVariable = {{"MASTER_ADDR", "10.0.0.1"},
                                                           {"MASTER_PORT", "29600"},
                                                           {"NNODES", "4"},
                                                           {"WORLD_SIZE", "4"},
                                                           {"NODE_RANK", "3"},
                                                           {"GROUP_RANK", "3"},
                                                           {"RANK", "3"},
                                                           {"LOCAL_RANK", "0"},
                                                           {"LOCAL_WORLD_SIZE", "1"}};

TEST(RendezvousOptions, DefaultToOneNodeOnThisMachine) {
  EXPECT_EQ(shown(rendezvous_options({}, fake_environment({}))),
            options_text("127.0.0.1", 29500, 1, 0, 900));
}

TEST(RendezvousOptions, ComeFromTheEnvironment) {
  EXPECT_EQ(shown(rendezvous_options({}, fake_environment(kEveryVariable))),
            options_text("10.0.0.1", 29600, 4, 3, 900));
}

TEST(RendezvousOptions, FlagsWinOverTheEnvironment) {
  const RendezvousFlags flags{.master_addr = "node0.cluster",
                              .master_port = "1234",
                              .nnodes = "2",
                              .node_rank = "1",
                              .timeout_seconds = "7.5"};
  EXPECT_EQ(shown(rendezvous_options(flags, fake_environment(kEveryVariable))),
            options_text("node0.cluster", 1234, 2, 1, 7.5));
}

// dstrain is one process per node: torchrun's WORLD_SIZE counts nodes and RANK / GROUP_RANK
// name this node; variables that agree are fine, empty ones are unset.
TEST(RendezvousOptions, TorchrunVariablesCountNodesAndEmptyVariablesAreUnset) {
  const auto environment = [](std::map<std::string, std::string> variables) {
    variables.emplace("MASTER_ADDR", "h");
    return rendezvous_options({}, fake_environment(std::move(variables)));
  };
  EXPECT_EQ(environment({{"WORLD_SIZE", "3"}, {"NODE_RANK", "0"}}).nnodes, 3);
  EXPECT_EQ(environment({{"NNODES", "3"}, {"WORLD_SIZE", "3"}, {"NODE_RANK", "0"}}).nnodes, 3);
  EXPECT_EQ(environment({{"NNODES", ""}, {"WORLD_SIZE", "3"}, {"NODE_RANK", "0"}}).nnodes, 3);
  EXPECT_EQ(environment({{"NNODES", "2"}, {"NODE_RANK", "0"}, {"MASTER_PORT", ""}}).master_port,
            29500);
  // torchrun --nproc-per-node 1 sets RANK and GROUP_RANK to the node's number.
  const RendezvousOptions torchrun = environment(
      {{"WORLD_SIZE", "4"}, {"RANK", "2"}, {"GROUP_RANK", "2"}, {"LOCAL_RANK", "0"},
       {"LOCAL_WORLD_SIZE", "1"}});
  EXPECT_EQ(torchrun.nnodes, 4);
  EXPECT_EQ(torchrun.node_rank, 2);
  EXPECT_EQ(environment({{"WORLD_SIZE", "4"}, {"RANK", "1"}}).node_rank, 1);
}

struct BadCase {
  RendezvousFlags flags;
  std::map<std::string, std::string> environment;
  std::string message;  // a part of the UserError's sentence
};

RendezvousFlags port_flag(const std::string& port) {
  RendezvousFlags flags;
  flags.master_port = port;
  return flags;
}

RendezvousFlags two_node_flags(const std::string& rank) {
  RendezvousFlags flags;
  flags.nnodes = "2";
  flags.master_addr = "10.0.0.1";
  flags.node_rank = rank;
  return flags;
}

RendezvousFlags timeout_flag(const std::string& seconds) {
  RendezvousFlags flags;
  flags.timeout_seconds = seconds;
  return flags;
}

TEST(RendezvousOptions, EveryBadValueIsAUserErrorNamingItsSource) {
  const std::vector<BadCase> cases = {
      {port_flag("abc"), {}, "--master-port 'abc' is not a port number from 1 to 65535."},
      {port_flag("0"), {}, "--master-port '0' is not a port number from 1 to 65535."},
      {port_flag("65536"), {}, "--master-port '65536' is not a port number"},
      {port_flag("295OO"), {}, "--master-port '295OO' is not a port number"},
      {port_flag(""), {}, "--master-port '' is not a port number"},
      {{}, {{"MASTER_PORT", "-1"}}, "MASTER_PORT='-1' is not a port number from 1 to 65535."},
      {{}, {{"MASTER_PORT", " 29500"}}, "MASTER_PORT=' 29500' is not a port number"},
      {{}, {{"NNODES", "0"}}, "NNODES='0' is not a node count from 1 to 4096."},
      {{}, {{"WORLD_SIZE", "two"}}, "WORLD_SIZE='two' is not a node count"},
      {two_node_flags("-1"), {}, "--node-rank '-1' is not a node rank from 0 to 4095."},
      {two_node_flags("2"),
       {},
       "--node-rank '2' is not below the node count --nnodes '2': number the nodes 0 to 1."},
      {{},
       {{"NODE_RANK", "1"}},
       "NODE_RANK='1' is not below the node count (1 node by default): number the nodes 0 to 0."},
      {two_node_flags("x"), {}, "--node-rank 'x' is not a node rank"},
      {{},
       {{"NNODES", "3"}, {"MASTER_ADDR", "h"}},
       "--node-rank (or NODE_RANK) is required with 3 nodes: give each node its number, 0 to 2."},
      {{},
       {{"NNODES", "2"}, {"NODE_RANK", "1"}},
       "--master-addr (or MASTER_ADDR) is required with 2 nodes: give every node the address"},
      {[] {
         RendezvousFlags flags = two_node_flags("0");
         flags.master_addr = "";
         return flags;
       }(),
       {},
       "--master-addr is empty"},
      {timeout_flag("0"), {}, "--rendezvous-timeout '0' is not a positive number of seconds."},
      {timeout_flag("-3"), {}, "--rendezvous-timeout '-3' is not a positive number"},
      {timeout_flag("inf"), {}, "--rendezvous-timeout 'inf' is not a positive number"},
      {timeout_flag("nan"), {}, "--rendezvous-timeout 'nan' is not a positive number"},
      {timeout_flag("60s"), {}, "--rendezvous-timeout '60s' is not a positive number"},
      {{},
       {{"NNODES", "2"}, {"WORLD_SIZE", "3"}},
       "NNODES='2' and WORLD_SIZE='3' contradict each other: dstrain runs one process per node"},
      {{},
       {{"NNODES", "2"}, {"NODE_RANK", "1"}, {"RANK", "0"}, {"MASTER_ADDR", "h"}},
       "NODE_RANK='1' and RANK='0' contradict each other"},
      {{},
       {{"WORLD_SIZE", "16"}, {"LOCAL_WORLD_SIZE", "8"}},
       "LOCAL_WORLD_SIZE='8': the launcher started several processes on this node"},
      {{}, {{"LOCAL_RANK", "3"}}, "LOCAL_RANK='3': the launcher started several processes"},
      {{}, {{"LOCAL_WORLD_SIZE", "x"}}, "LOCAL_WORLD_SIZE='x' is not a process count"},
  };
  for (const BadCase& bad : cases) {
    EXPECT_TRUE(contains(
        user_sentence_of([&] { rendezvous_options(bad.flags, fake_environment(bad.environment)); }),
        bad.message));
  }
}

// ---- nodes on threads -----------------------------------------------------------------------

TEST(Rendezvous, ThreeNodesStartedInShuffledOrderJoinBroadcastAndMeet) {
  const int port = free_port();
  std::mutex mutex;
  std::vector<std::vector<RendezvousNode>> joined(3);
  const std::vector<std::string> messages =
      run_nodes({2, 0, 1}, std::chrono::milliseconds(150), 3, [&](int rank) {
        Rendezvous rendezvous(node_options(port, 3, rank, kJoinTimeout));
        std::vector<RendezvousNode> nodes = rendezvous.join();
        const std::string failure = broadcast_and_barrier(rendezvous);
        if (!failure.empty()) throw Error(failure);
        std::lock_guard<std::mutex> lock(mutex);
        joined[static_cast<size_t>(rank)] = std::move(nodes);
      });
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(messages[static_cast<size_t>(rank)], "") << "node " << rank;
    const std::vector<RendezvousNode>& nodes = joined[static_cast<size_t>(rank)];
    ASSERT_EQ(nodes.size(), 3u) << "node " << rank;
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(nodes[static_cast<size_t>(r)].rank, r);
      EXPECT_EQ(nodes[static_cast<size_t>(r)].pid, ::getpid());
      EXPECT_FALSE(nodes[static_cast<size_t>(r)].host.empty());
    }
  }
}

TEST(Rendezvous, MissingNodesAreNamedAtTheTimeoutOnEveryNode) {
  const int port = free_port();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  std::vector<std::string> messages =
      run_nodes({0, 1, 3}, std::chrono::milliseconds(0), 4,
                [&](int rank) { Rendezvous(node_options(port, 4, rank, kShortTimeout)).join(); });
  for (const int rank : {0, 1, 3})
    EXPECT_TRUE(
        contains(messages[static_cast<size_t>(rank)],
                 "node 2 of 4 never joined the rendezvous at " + address + " within 0.5 s"));
  messages = run_nodes({1, 0}, std::chrono::milliseconds(0), 4, [&](int rank) {
    Rendezvous(node_options(port, 4, rank, kShortTimeout)).join();
  });
  EXPECT_TRUE(contains(messages[0], "nodes 2, 3 of 4 never joined the rendezvous at " + address));
}

TEST(Rendezvous, MissingNodesAreAUserError) {
  Rendezvous alone(node_options(0, 2, 0, kShortTimeout));
  EXPECT_TRUE(contains(user_sentence_of([&] { alone.join(); }), "node 1 of 2 never joined"));
}

TEST(Rendezvous, ABarrierNamesTheNodesThatDidNotReachIt) {
  const int port = free_port();
  const std::vector<std::string> messages =
      run_nodes({0, 1, 2}, std::chrono::milliseconds(0), 3, [&](int rank) {
        Rendezvous rendezvous(node_options(port, 3, rank, kShortTimeout));
        rendezvous.join();
        if (rank != 2) rendezvous.barrier("save");
      });
  for (const int rank : {0, 1})
    EXPECT_TRUE(contains(messages[static_cast<size_t>(rank)],
                         "node 2 of 3 did not reach barrier 'save' within 0.5 s"));
  EXPECT_EQ(messages[2], "");
}

TEST(Rendezvous, ABroadcastThatNeverComesNamesItsKey) {
  const int port = free_port();
  std::latch node1_done(1);  // node 0 keeps the store up meanwhile: node 1 must time out
  const std::vector<std::string> messages =
      run_nodes({0, 1}, std::chrono::milliseconds(0), 2, [&](int rank) {
        Rendezvous rendezvous(node_options(port, 2, rank, kShortTimeout));
        rendezvous.join();
        if (rank == 0) return node1_done.wait();
        try {
          rendezvous.broadcast_bytes("gloo-addresses", "");
        } catch (const Error&) {
          node1_done.count_down();
          throw;
        }
        node1_done.count_down();
      });
  EXPECT_EQ(messages[0], "");
  EXPECT_TRUE(contains(messages[1], "node 0 did not broadcast 'gloo-addresses' within 0.5 s"));
}

TEST(Rendezvous, TwoNodesWithOneRankAreAUserError) {
  Rendezvous node0(node_options(0, 2, 0, kJoinTimeout));
  const int port = node0.server_port();
  std::thread first([&] { Rendezvous(node_options(port, 2, 1, kJoinTimeout)).join(); });
  node0.join();
  first.join();
  EXPECT_TRUE(
      contains(user_sentence_of([&] { Rendezvous(node_options(port, 2, 1, kJoinTimeout)).join(); }),
               "two nodes were started with node rank 1"));
}

TEST(Rendezvous, NodesStartedWithDifferentNnodesAreAUserError) {
  const int port = free_port();
  const std::vector<std::string> messages =
      run_nodes({0, 1, 2}, std::chrono::milliseconds(0), 3, [&](int rank) {
        Rendezvous(node_options(port, rank == 0 ? 2 : 3, rank, kJoinTimeout)).join();
      });
  EXPECT_TRUE(
      contains(messages[0], "node 1 was started with --nnodes 3 and node 0 with --nnodes 2"));
  EXPECT_TRUE(
      contains(messages[1], "node 0 was started with --nnodes 2 and node 1 with --nnodes 3"));
  EXPECT_TRUE(
      contains(messages[2], "node 0 was started with --nnodes 2 and node 2 with --nnodes 3"));
}

TEST(Rendezvous, APortInUseOnNodeZeroIsNamed) {
  TcpStoreServer squatter(0, kJoinTimeout);
  EXPECT_TRUE(contains(
      user_sentence_of([&] { Rendezvous(node_options(squatter.port(), 2, 0, kJoinTimeout)); }),
      "port " + std::to_string(squatter.port()) + " is already in use"));
}

// ---- real processes -------------------------------------------------------------------------

// The test binary spawned with these variables runs one node (before main: see below) and
// exits 0 when it joined, received both broadcasts and passed the barrier.
constexpr const char* kNodeVariable = "DSTRAIN_RENDEZVOUS_TEST_NODE";
constexpr const char* kPortVariable = "DSTRAIN_RENDEZVOUS_TEST_PORT";
constexpr int kProcessNodes = 3;

int run_spawned_node(int rank, int port) {
  try {
    Rendezvous rendezvous(node_options(port, kProcessNodes, rank, kJoinTimeout));
    rendezvous.join();
    const std::string failure = broadcast_and_barrier(rendezvous);
    if (failure.empty()) return 0;
    std::cerr << "node " << rank << ": " << failure << "\n";
  } catch (const std::exception& e) {
    std::cerr << "node " << rank << ": " << e.what() << "\n";
  }
  return 1;
}

// Runs at static initialization, before gtest's main: a spawned node never reaches gtest.
[[maybe_unused]] const bool kSpawnedNodeRan = [] {
  const char* rank = std::getenv(kNodeVariable);
  const char* port = std::getenv(kPortVariable);
  if (rank == nullptr || port == nullptr) return false;
  std::cerr.flush();
  std::_Exit(run_spawned_node(std::atoi(rank), std::atoi(port)));
}();

pid_t spawn_node(int rank, int port) {
  return spawn_this_binary({std::string(kNodeVariable) + "=" + std::to_string(rank),
                            std::string(kPortVariable) + "=" + std::to_string(port)});
}

TEST(RendezvousProcesses, ThreeProcessesJoinOnLoopbackInAnyOrder) {
  const int port = free_port();
  // The other nodes start first: they retry until node 0, this process, is up.
  std::vector<pid_t> children = {spawn_node(2, port), spawn_node(1, port)};
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::vector<RendezvousNode> nodes;
  try {
    Rendezvous rendezvous(node_options(port, kProcessNodes, 0, kJoinTimeout));
    nodes = rendezvous.join();
    EXPECT_EQ(broadcast_and_barrier(rendezvous), "");
  } catch (const Error& e) {
    ADD_FAILURE() << "node 0: " << e.what();
  }
  EXPECT_EQ(wait_for_exit(children[0], 2 * kJoinTimeout), 0) << "node 2";
  EXPECT_EQ(wait_for_exit(children[1], 2 * kJoinTimeout), 0) << "node 1";
  ASSERT_EQ(nodes.size(), 3u);
  EXPECT_EQ(nodes[0].pid, ::getpid());
  EXPECT_EQ(nodes[1].pid, children[1]);
  EXPECT_EQ(nodes[2].pid, children[0]);
}

}  // namespace
}  // namespace dstrain::test
