#include "comm/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <sstream>
#include <thread>

#include "core/check.h"

namespace dstrain {
namespace {

constexpr int kMaxNodes = 4096;  // the store serves at most this many connections
constexpr double kMaxLingerSeconds = 10;
// Node 0, finding a node started with another --nnodes, keeps its store accepting this long
// before it stops: nodes started with it are still connecting (their retries pause up to
// 250 ms) and then read its record and name the mismatch themselves.
constexpr double kMismatchLingerSeconds = 2;

// A setting's value and where it came from: a flag ("--master-port") or a variable
// ("MASTER_PORT"). Messages show it as the user wrote it.
struct Setting {
  std::string value;
  std::string source;

  std::string shown() const {
    const bool flag = source.rfind("--", 0) == 0;
    return source + (flag ? " '" : "='") + value + "'";
  }
};

// The flag if given, else the first of `variables` that is set and not empty.
std::optional<Setting> pick(const std::optional<std::string>& flag, const char* flag_name,
                            const EnvironmentLookup& environment,
                            std::initializer_list<const char*> variables) {
  if (flag) return Setting{*flag, flag_name};
  for (const char* variable : variables) {
    const std::optional<std::string> value = environment(variable);
    if (value && !value->empty()) return Setting{*value, variable};
  }
  return std::nullopt;
}

// `setting` as an integer in [low, high]; else a UserError saying what it should be.
int parse_int(const Setting& setting, int low, int high, const std::string& what) {
  const std::string& text = setting.value;
  int value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  DSTRAIN_USER_CHECK(error == std::errc() && end == text.data() + text.size() && value >= low &&
                     value <= high)
      << setting.shown() << " is not " << what << " from " << low << " to " << high << ".";
  return value;
}

double parse_timeout(const Setting& setting) {
  const std::string& text = setting.value;
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  DSTRAIN_USER_CHECK(error == std::errc() && end == text.data() + text.size() &&
                     std::isfinite(value) && value > 0)
      << setting.shown() << " is not a positive number of seconds.";
  return value;
}

int parse_node_rank(const std::optional<Setting>& rank, const std::optional<Setting>& nnodes,
                    int node_count) {
  if (!rank) {
    DSTRAIN_USER_CHECK(node_count == 1)
        << "--node-rank (or NODE_RANK) is required with " << node_count << " nodes: give each "
        << "node its number, 0 to " << node_count - 1 << ".";
    return 0;
  }
  const int value = parse_int(*rank, 0, kMaxNodes - 1, "a node rank");
  DSTRAIN_USER_CHECK(value < node_count)
      << rank->shown() << " is not below the node count"
      << (nnodes ? " " + nnodes->shown() : std::string(" (1 node by default)"))
      << ": number the nodes 0 to " << node_count - 1 << ".";
  return value;
}

std::string parse_master_addr(const std::optional<Setting>& addr, int node_count) {
  if (!addr) {
    DSTRAIN_USER_CHECK(node_count == 1)
        << "--master-addr (or MASTER_ADDR) is required with " << node_count
        << " nodes: give every node the address of node 0.";
    return "127.0.0.1";
  }
  DSTRAIN_USER_CHECK(!addr->value.empty())
      << addr->source << " is empty: give the address or host name of node 0.";
  return addr->value;
}

std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds << " s";
  return text.str();
}

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown-host";
  return name;
}

// What a node registers: "<nnodes> <pid> <host>".
std::string node_record(int nnodes) {
  return std::to_string(nnodes) + " " + std::to_string(::getpid()) + " " + this_host();
}

std::string ranks_text(const std::vector<int>& ranks, int nnodes) {
  std::string text = ranks.size() == 1 ? "node " : "nodes ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + " of " + std::to_string(nnodes);
}

std::vector<std::string> node_keys(const std::string& prefix, int nnodes) {
  std::vector<std::string> keys;
  for (int rank = 0; rank < nnodes; ++rank) keys.push_back(prefix + std::to_string(rank));
  return keys;
}

}  // namespace

EnvironmentLookup process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

namespace {

// The flag if given, else the variables of `variables` that are set: they must agree (one
// number, written in any of them); the first is the setting.
std::optional<Setting> pick_agreeing(const std::optional<std::string>& flag, const char* flag_name,
                                     const EnvironmentLookup& environment,
                                     std::initializer_list<const char*> variables, int low,
                                     int high, const std::string& what) {
  if (flag) return Setting{*flag, flag_name};
  std::optional<Setting> first;
  int first_value = 0;
  for (const char* variable : variables) {
    const std::optional<std::string> value = environment(variable);
    if (!value || value->empty()) continue;
    const Setting setting{*value, variable};
    const int number = parse_int(setting, low, high, what);
    if (!first) {
      first = setting;
      first_value = number;
      continue;
    }
    DSTRAIN_USER_CHECK(number == first_value)
        << first->shown() << " and " << setting.shown() << " contradict each other: dstrain "
        << "runs one process per node, so torchrun's WORLD_SIZE counts the nodes and RANK and "
        << "GROUP_RANK are the node's number; set them alike, or give --nnodes and --node-rank.";
  }
  return first;
}

// torchrun's LOCAL_WORLD_SIZE / LOCAL_RANK: dstrain is one process per node that starts a rank
// per GPU itself, so a launcher starting several processes on a node is a mistake to stop at.
void check_one_process_per_node(const EnvironmentLookup& environment) {
  for (const char* variable : {"LOCAL_WORLD_SIZE", "LOCAL_RANK"}) {
    const std::optional<std::string> value = environment(variable);
    if (!value || value->empty()) continue;
    const bool size = variable[6] == 'W';
    const int number = parse_int(Setting{*value, variable}, size ? 1 : 0, 1 << 20,
                                 size ? "a process count" : "a local rank");
    DSTRAIN_USER_CHECK(number == (size ? 1 : 0))
        << variable << "='" << *value << "': the launcher started several processes on this "
        << "node, but dstrain runs one process per node and starts one rank per GPU itself; "
        << "launch one per node (torchrun --nproc-per-node 1).";
  }
}

}  // namespace

RendezvousOptions rendezvous_options(const RendezvousFlags& flags,
                                     const EnvironmentLookup& environment) {
  check_one_process_per_node(environment);
  const std::optional<Setting> nnodes =
      pick_agreeing(flags.nnodes, "--nnodes", environment, {"NNODES", "WORLD_SIZE"}, 1, kMaxNodes,
                    "a node count");
  const std::optional<Setting> rank =
      pick_agreeing(flags.node_rank, "--node-rank", environment,
                    {"NODE_RANK", "GROUP_RANK", "RANK"}, 0, kMaxNodes - 1, "a node rank");
  const std::optional<Setting> addr =
      pick(flags.master_addr, "--master-addr", environment, {"MASTER_ADDR"});
  const std::optional<Setting> port =
      pick(flags.master_port, "--master-port", environment, {"MASTER_PORT"});
  RendezvousOptions options;
  options.nnodes = nnodes ? parse_int(*nnodes, 1, kMaxNodes, "a node count") : 1;
  options.node_rank = parse_node_rank(rank, nnodes, options.nnodes);
  options.master_addr = parse_master_addr(addr, options.nnodes);
  if (port) options.master_port = parse_int(*port, 1, 65535, "a port number");
  if (flags.timeout_seconds)
    options.timeout_seconds =
        parse_timeout(Setting{*flags.timeout_seconds, "--rendezvous-timeout"});
  return options;
}

Rendezvous::Rendezvous(RendezvousOptions options) : options_(std::move(options)) {
  DSTRAIN_CHECK(options_.nnodes >= 1 && options_.nnodes <= kMaxNodes) << options_.nnodes;
  DSTRAIN_CHECK(options_.node_rank >= 0 && options_.node_rank < options_.nnodes)
      << "node rank " << options_.node_rank << " of " << options_.nnodes;
  DSTRAIN_CHECK(options_.master_port >= (options_.node_rank == 0 ? 0 : 1) &&
                options_.master_port <= 65535)
      << "port " << options_.master_port;
  DSTRAIN_CHECK(options_.timeout_seconds > 0) << options_.timeout_seconds;
  if (options_.node_rank == 0)
    server_ = std::make_unique<TcpStoreServer>(options_.master_port, options_.timeout_seconds);
}

Rendezvous::~Rendezvous() {
  client_.reset();  // our own connection must not hold the linger up
  if (server_) server_->stop(std::min(options_.timeout_seconds, kMaxLingerSeconds));
}

void Rendezvous::stop_now() {
  client_.reset();
  if (server_) server_->stop(0);
}

int Rendezvous::server_port() const {
  DSTRAIN_CHECK(server_) << "only node 0 runs the rendezvous server";
  return server_->port();
}

std::string Rendezvous::address() const {
  const int port = server_ ? server_->port() : options_.master_port;
  return options_.master_addr + ":" + std::to_string(port);
}

TcpStoreClient& Rendezvous::client() {
  DSTRAIN_CHECK(client_) << "the rendezvous is used before join()";
  return *client_;
}

int Rendezvous::store_port() const { return server_ ? server_->port() : options_.master_port; }

std::string Rendezvous::local_address() { return client().local_address(); }

std::vector<RendezvousNode> Rendezvous::join() {
  DSTRAIN_CHECK(!client_) << "join() runs once";
  const auto start = std::chrono::steady_clock::now();
  const int port = server_ ? server_->port() : options_.master_port;
  client_ = std::make_unique<TcpStoreClient>(options_.master_addr, port, options_.timeout_seconds);
  const std::string me = "node/" + std::to_string(options_.node_rank);
  DSTRAIN_USER_CHECK(client().add(me + "/arrivals", 1) == 1)
      << "two nodes were started with node rank " << options_.node_rank << " (this one is "
      << this_host() << ", pid " << ::getpid() << "): give each node its own --node-rank, 0 to "
      << options_.nnodes - 1 << ".";
  client().set(me, node_record(options_.nnodes));
  const auto remaining = [&] {
    const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - start;
    return options_.timeout_seconds - spent.count();
  };
  const std::vector<std::string> keys = node_keys("node/", options_.nnodes);
  std::vector<RendezvousNode> nodes(static_cast<size_t>(options_.nnodes));
  // Node 0 registers as soon as its store is up: another --nnodes shows in its record at once,
  // before waiting for nodes that would never come.
  if (options_.node_rank != 0) {
    wait_for_nodes({keys[0]}, remaining(), true, "join");
    read_node(0, nodes[0]);
  }
  wait_for_nodes(keys, remaining(), true, "join");
  for (int rank = 0; rank < options_.nnodes; ++rank) {
    read_node(rank, nodes[static_cast<size_t>(rank)]);
  }
  return nodes;
}

void Rendezvous::read_node(int rank, RendezvousNode& node) {
  std::istringstream record(client().get("node/" + std::to_string(rank)));
  int nnodes = 0;
  node.rank = rank;
  record >> nnodes >> node.pid >> node.host;
  if (nnodes == options_.nnodes) return;
  if (server_) {
    std::this_thread::sleep_for(std::chrono::duration<double>(
        std::min(kMismatchLingerSeconds, std::max(options_.timeout_seconds, 0.0))));
  }
  DSTRAIN_USER_CHECK(false) << "node " << rank << " was started with --nnodes " << nnodes
                            << " and node " << options_.node_rank << " with --nnodes "
                            << options_.nnodes << ": give every node the same --nnodes (NNODES).";
}

void Rendezvous::wait_for_nodes(const std::vector<std::string>& keys, double seconds, bool joining,
                                const std::string& what) {
  if (client().wait_for(keys, std::max(seconds, 0.0))) return;
  const std::vector<bool> present = client().check(keys);
  std::vector<int> missing;
  for (size_t rank = 0; rank < keys.size(); ++rank)
    if (!present[rank]) missing.push_back(static_cast<int>(rank));
  if (missing.empty()) return;  // they arrived between the timeout and the check
  const std::string nodes = ranks_text(missing, options_.nnodes);
  const std::string within = " within " + seconds_text(options_.timeout_seconds);
  DSTRAIN_USER_CHECK(!joining)
      << nodes << " never joined the rendezvous at " << address() << within
      << ": start them with the same --master-addr and --master-port, or allow more time.";
  throw Error(nodes + " did not reach " + what + within + " (rendezvous at " + address() +
              ", this is node " + std::to_string(options_.node_rank) + ")");
}

std::string Rendezvous::next_round(const std::string& kind, const std::string& name) {
  const std::string base = kind + "/" + name;
  return base + "/" + std::to_string(rounds_[base]++);
}

std::string Rendezvous::broadcast_bytes(const std::string& key, const std::string& bytes) {
  const std::string round = next_round("broadcast", key);
  if (options_.node_rank == 0) {
    client().set(round, bytes);
    return bytes;
  }
  if (!client().wait_for({round}, options_.timeout_seconds))
    throw Error("node 0 did not broadcast '" + key + "' within " +
                seconds_text(options_.timeout_seconds) + " (rendezvous at " + address() +
                ", this is node " + std::to_string(options_.node_rank) + ")");
  return client().get(round);
}

std::vector<std::string> Rendezvous::all_gather_bytes(const std::string& key,
                                                       const std::string& bytes) {
  const std::string round = next_round("gather", key) + "/";
  client().set(round + std::to_string(options_.node_rank), bytes);
  const std::vector<std::string> keys = node_keys(round, options_.nnodes);
  wait_for_nodes(keys, options_.timeout_seconds, false, "the gather of '" + key + "'");
  std::vector<std::string> values;
  for (const std::string& node_key : keys) values.push_back(client().get(node_key));
  return values;
}

void Rendezvous::barrier(const std::string& name) {
  const std::string round = next_round("barrier", name) + "/";
  client().set(round + std::to_string(options_.node_rank), "");
  wait_for_nodes(node_keys(round, options_.nnodes), options_.timeout_seconds, false,
                 "barrier '" + name + "'");
}

}  // namespace dstrain
