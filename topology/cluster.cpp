#include "topology/cluster.h"

#include <sstream>

#include "core/check.h"
#include "topology/units.h"

namespace dstrain {

namespace {

// ASSUMPTION: an RDMA NIC of unknown speed carries 200 Gbit/s: ConnectX-6 HDR InfiniBand or
// 200 GbE RoCE, the NIC of A100-class servers (DGX A100: 8 x 200 Gbit/s for compute);
// ConnectX-7 (H100 servers) runs 400, older EDR 100. Give --inter-node-bandwidth for others.
constexpr double kRdmaNicBitsPerS = 200e9;
// ASSUMPTION: NCCL's IB transport reaches ~90% of the line rate between two nodes (nccl-tests'
// all_reduce bus bandwidth on HDR is ~22-24 GB/s of 25).
constexpr double kRdmaEfficiency = 0.9;
// ASSUMPTION: a node without an RDMA NIC talks over one 25 GbE link (common server NICs; older
// racks have 10, newer 100), through TCP sockets at ~80% of it.
constexpr double kEthernetBitsPerS = 25e9;
constexpr double kEthernetEfficiency = 0.8;

const char* const kRdmaPrefixes[] = {"mlx4_", "mlx5_", "ibp", "bnxt_re", "irdma",
                                     "qedr",  "hfi1_", "efa_"};

std::string gbit_text(double bits_per_s) {
  std::ostringstream text;
  text << bits_per_s / 1e9 << " Gbit/s";
  return text.str();
}

std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

// The link read from the NICs the node's description lists (or not).
void link_from_nics(const NodeTopology& node, ClusterShape& cluster) {
  std::vector<std::string> rdma;
  for (const std::string& name : node.nics) {
    if (is_rdma_nic(name)) rdma.push_back(name);
  }
  std::ostringstream source;
  if (!rdma.empty()) {
    cluster.inter_node_kind = NetworkKind::Rdma;
    cluster.inter_node_bytes_per_s =
        static_cast<double>(rdma.size()) * kRdmaNicBitsPerS / 8 * kRdmaEfficiency;
    source << rdma.size() << " InfiniBand/RoCE NIC" << (rdma.size() > 1 ? "s" : "") << " ("
           << joined(rdma) << ") in nvidia-smi topo -m, assumed " << gbit_text(kRdmaNicBitsPerS)
           << " each at " << kRdmaEfficiency * 100 << "%";
  } else {
    cluster.inter_node_kind = NetworkKind::Ethernet;
    cluster.inter_node_bytes_per_s = kEthernetBitsPerS / 8 * kEthernetEfficiency;
    if (!node.nics_known) {
      source << "not known (no NIC list: the machine was not described by nvidia-smi topo -m)";
    } else if (node.nics.empty()) {
      source << "no InfiniBand/RoCE NIC in nvidia-smi topo -m";
    } else {
      source << "only Ethernet NICs (" << joined(node.nics) << ") in nvidia-smi topo -m";
    }
    source << ": assumed " << gbit_text(kEthernetBitsPerS) << " Ethernet at "
           << kEthernetEfficiency * 100 << "%; give the real rate with --"
           << kInterNodeBandwidthFlag;
  }
  cluster.inter_node_source = source.str();
}

}  // namespace

const char* network_kind_name(NetworkKind kind) {
  switch (kind) {
    case NetworkKind::Rdma: return "InfiniBand/RoCE";
    case NetworkKind::Ethernet: return "Ethernet";
    case NetworkKind::Unknown: break;
  }
  return "unknown";
}

double parse_network_bandwidth(std::string_view text) {
  return parse_rate(text, "--" + std::string(kInterNodeBandwidthFlag));
}

bool is_rdma_nic(std::string_view name) {
  for (const char* prefix : kRdmaPrefixes) {
    if (name.substr(0, std::string_view(prefix).size()) == prefix) return true;
  }
  return false;
}

ClusterShape make_cluster_shape(int nnodes, std::string_view inter_node_bandwidth,
                                const NodeTopology& node) {
  DSTRAIN_USER_CHECK(nnodes >= 1 && nnodes <= kMaxNodes)
      << "--nnodes must be between 1 and " << kMaxNodes << ", not " << nnodes;
  ClusterShape cluster;
  cluster.nnodes = nnodes;
  const std::string given(inter_node_bandwidth);
  const bool blank = given.find_first_not_of(" \t") == std::string::npos;
  const double given_rate = blank ? 0 : parse_network_bandwidth(given);
  if (nnodes == 1) return cluster;
  if (given_rate > 0) {
    cluster.inter_node_bytes_per_s = given_rate;
    ClusterShape detected;
    if (node.nics_known) link_from_nics(node, detected);
    cluster.inter_node_kind = detected.inter_node_kind;
    cluster.inter_node_source = "--" + std::string(kInterNodeBandwidthFlag) + " " + given;
    return cluster;
  }
  link_from_nics(node, cluster);
  return cluster;
}

std::string describe_cluster(const ClusterShape& cluster, int gpus_per_node) {
  std::ostringstream text;
  text.precision(3);
  text << cluster.nnodes << " nodes x " << gpus_per_node << " GPUs";
  if (!cluster.multi_node()) return text.str();
  text << " joined by ";
  if (cluster.inter_node_kind != NetworkKind::Unknown) {
    text << network_kind_name(cluster.inter_node_kind) << ", ";
  }
  text << cluster.inter_node_bytes_per_s / 1e9 << " GB/s per node each way (from "
       << cluster.inter_node_source << ")";
  return text.str();
}

}  // namespace dstrain
