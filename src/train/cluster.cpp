#include "train/cluster.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "comm/gloo_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/check.h"

extern char** environ;

namespace dstrain {

namespace {

std::string ranks_text(int first, int count) {
  return count == 1 ? "rank " + std::to_string(first)
                    : "ranks " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

// The path to the first value that differs ({} when none), through nested objects.
std::vector<std::string> first_difference(const nlohmann::json& a, const nlohmann::json& b) {
  if (a == b) return {};
  if (!a.is_object() || !b.is_object()) return {""};
  std::vector<std::string> keys;
  for (const auto& [key, value] : a.items()) keys.push_back(key);
  for (const auto& [key, value] : b.items()) {
    if (!a.contains(key)) keys.push_back(key);
  }
  for (const std::string& key : keys) {
    if (!a.contains(key) || !b.contains(key)) return {key};
    std::vector<std::string> below = first_difference(a[key], b[key]);
    if (below.empty()) continue;
    below.insert(below.begin(), key);
    if (below.back().empty()) below.pop_back();
    return below;
  }
  return {};
}

// The value at `path` ("(unset)" when absent).
std::string shown(const nlohmann::json& settings, const std::vector<std::string>& path) {
  const nlohmann::json* value = &settings;
  for (const std::string& key : path) {
    if (!value->is_object() || !value->contains(key)) return "(unset)";
    value = &(*value)[key];
  }
  return value->dump();
}

// A setting's name for people: the flag of a run option ("--lr"), else the path ("plan.zero").
std::string setting_name(const std::vector<std::string>& path) {
  if (path.size() == 2 && path[0] == "options") return "--" + path[1];
  std::string name;
  for (const std::string& key : path) name += (name.empty() ? "" : ".") + key;
  return name;
}

}  // namespace

std::string communicator_environment() {
  std::vector<std::string> settings;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text(*entry);
    if (text.starts_with("NCCL_") || text.starts_with("GLOO_")) settings.push_back(text);
  }
  std::sort(settings.begin(), settings.end());
  std::string line;
  for (const std::string& setting : settings) line += (line.empty() ? "" : " ") + setting;
  return line;
}

Cluster::Cluster(const RendezvousOptions& options, std::ostream& out) : options_(options) {
  checkpoint_tag_ = std::to_string(::getpid());
  if (!multi_node()) return;
  out << "dstrain: node " << options_.node_rank << " of " << options_.nnodes
      << ": joining the rendezvous at " << options_.master_addr << ":" << options_.master_port
      << " (timeout " << options_.timeout_seconds << " s)\n";
  out.flush();
  rendezvous_ = std::make_unique<Rendezvous>(options_);
  nodes_ = rendezvous_->join();
  checkpoint_tag_ = std::to_string(nodes_[0].pid);
  out << "dstrain: every node joined:";
  for (const RendezvousNode& node : nodes_) {
    out << " node " << node.rank << " " << node.host << " (pid " << node.pid << ")"
        << (node.rank + 1 < options_.nnodes ? "," : "\n");
  }
  const std::string environment = communicator_environment();
  out << "dstrain: communicator environment: " << (environment.empty() ? "(none)" : environment)
      << "\n";
  out.flush();
}

Cluster::~Cluster() = default;

std::string Cluster::describe_node(int node, int local_ranks) const {
  std::string text = "node " + std::to_string(node) + " (";
  if (static_cast<size_t>(node) < nodes_.size()) text += nodes_[static_cast<size_t>(node)].host + ", ";
  return text + ranks_text(node * local_ranks, local_ranks) + ")";
}

std::string Cluster::where_ranks_are(int local_ranks) const {
  std::string text;
  for (int node = 0; node < options_.nnodes; ++node) {
    text += (node == 0 ? "" : ", ") + describe_node(node, local_ranks);
  }
  return text;
}

void Cluster::agree(const nlohmann::json& settings) {
  if (!multi_node()) return;
  const std::vector<std::string> all =
      rendezvous_->all_gather_bytes("settings/" + std::to_string(agreements_++), settings.dump());
  const nlohmann::json first = nlohmann::json::parse(all[0]);
  for (int node = 1; node < options_.nnodes; ++node) {
    const nlohmann::json theirs = nlohmann::json::parse(all[static_cast<size_t>(node)]);
    const std::vector<std::string> path = first_difference(first, theirs);
    DSTRAIN_USER_CHECK(path.empty())
        << "node " << node << " would run with " << setting_name(path) << " = "
        << shown(theirs, path) << ", node 0 with " << shown(first, path)
        << ": start every node with the same flags (and the same data and model files)";
  }
}

std::string Cluster::node_file(const std::string& path) const {
  if (options_.node_rank == 0) return path;
  const std::filesystem::path file(path);
  const std::string tag = ".node" + std::to_string(options_.node_rank);
  return (file.parent_path() / (file.stem().string() + tag + file.extension().string())).string();
}

void Cluster::launch(const RunDevices& devices, double timeout_seconds,
                     const std::function<void(Communicator&)>& fn) {
  if (!multi_node()) {
    launch_ranks(devices, timeout_seconds, fn);
    return;
  }
  DSTRAIN_CHECK(devices.first_rank == first_rank(devices.ranks))
      << "first rank " << devices.first_rank << " on node " << options_.node_rank;
  try {
    if (devices.cuda) {
      launch_nccl(devices, timeout_seconds, fn);
    } else {
      launch_gloo(devices, timeout_seconds, fn);
    }
  } catch (const UserError&) {
    rendezvous_->stop_now();
    throw;
  } catch (const std::exception& error) {
    rendezvous_->stop_now();  // nobody is waiting for a value from the store any more
    throw RunFailure("on " + describe_node(options_.node_rank, devices.ranks) + ": " +
                     error.what() + " [the ranks: " + where_ranks_are(devices.ranks) + "]");
  }
}

void Cluster::launch_gloo(const RunDevices& devices, double timeout_seconds,
                          const std::function<void(Communicator&)>& fn) {
  GlooRanks ranks;
  ranks.store_host = options_.master_addr;
  ranks.store_port = rendezvous_->store_port();
  ranks.prefix = "dstrain/world";
  ranks.first_rank = devices.first_rank;
  ranks.local_ranks = devices.ranks;
  ranks.world_size = devices.ranks * options_.nnodes;
  // Gloo's own variable picks the interface, as in PyTorch; else the address this node
  // reaches node 0 from, which the other nodes can reach it at.
  const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
  if (interface != nullptr && *interface != '\0') {
    ranks.network.interface = interface;
  } else {
    ranks.network.hostname = rendezvous_->local_address();
  }
  run_gloo_ranks(ranks, timeout_seconds, fn);
}

void Cluster::launch_nccl(const RunDevices& devices, double timeout_seconds,
                          const std::function<void(Communicator&)>& fn) {
  DSTRAIN_USER_CHECK(devices.nccl)
      << "a run on several nodes needs NCCL and one GPU per rank on every node (this node has "
      << devices.describe() << ")";
  NcclNodeRanks ranks;
  ranks.first_rank = devices.first_rank;
  ranks.local_ranks = devices.ranks;
  ranks.world_size = devices.ranks * options_.nnodes;
  ranks.unique_id = rendezvous_->broadcast_bytes(
      "nccl-unique-id", options_.node_rank == 0 ? nccl_unique_id() : std::string());
  run_nccl_node_ranks(ranks, timeout_seconds, fn);
}

}  // namespace dstrain
