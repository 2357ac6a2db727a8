// A cluster: `nnodes` identical nodes (each a NodeTopology) joined by an inter-node link.
//
// The link is one number per node and direction, bytes/s: what the node's network carries
// between nodes when every NIC is used (NCCL spreads its rings over all of them). Where it comes
// from, first found wins:
//   1. --inter-node-bandwidth RATE (parse_network_bandwidth), taken as it is: give the line rate,
//      or better the bus bandwidth nccl-tests measures between two nodes;
//   2. the NICs `nvidia-smi topo -m` lists (NodeTopology::nics): RDMA devices (mlx5_0, ...:
//      InfiniBand or RoCE) at an assumed rate each, summed; none, or only Ethernet interface
//      names: one Ethernet link at an assumed rate;
//   3. otherwise (a probed or saved machine without NIC names) the Ethernet assumption.
// The rates assumed and why: cluster.cpp. The plan report says which source gave the number.
//
// Ranks: rank = node_rank x gpus_per_node + local_rank (the launcher's order, torchrun's too).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "topology/topology.h"

namespace dstrain {

// The flag that gives the link, without dashes, for every command that plans across nodes.
inline constexpr const char kInterNodeBandwidthFlag[] = "inter-node-bandwidth";
// What its --help says.
inline constexpr const char kInterNodeBandwidthHelp[] =
    "bandwidth between nodes, per node and direction: 25GB/s (bytes), 200Gbit/s or 100G (bits); "
    "default: from the NICs nvidia-smi topo -m lists";

enum class NetworkKind : uint8_t {
  Unknown,   // given as a number, NICs unknown
  Rdma,      // InfiniBand or RoCE (RDMA devices: NCCL's IB transport)
  Ethernet,  // TCP sockets (NCCL's socket transport)
};
// "InfiniBand/RoCE", "Ethernet", "unknown".
const char* network_kind_name(NetworkKind kind);

struct ClusterShape {
  int nnodes = 1;
  double inter_node_bytes_per_s = 0;  // per node, one direction; 0 with one node
  NetworkKind inter_node_kind = NetworkKind::Unknown;
  std::string inter_node_source;      // where the number came from, for people; "" with one node

  bool multi_node() const { return nnodes > 1; }
};

// The flag's text as bytes/s: topology/units.h's parse_rate ("25GB/s" bytes, "200Gbit/s" or
// "100G" bits, decimal prefixes). Throws UserError with one sentence naming
// --inter-node-bandwidth on anything else.
double parse_network_bandwidth(std::string_view text);

// Whether a name `nvidia-smi topo -m` gives a NIC is an RDMA device (InfiniBand/RoCE: mlx4_*,
// mlx5_* incl. bonds, ibp*, bnxt_re*, irdma*, qedr*, hfi1_*, efa_*), not an Ethernet interface
// (eth0, ens1f0, ...) or soft RoCE (rxe*).
bool is_rdma_nic(std::string_view name);

// The cluster of `nnodes` nodes like `node`. `inter_node_bandwidth`: the flag's text, "" when
// not given. With one node the link is not used (but a given rate is still checked).
// Throws UserError on nnodes < 1 or > kMaxNodes, and on a bad rate.
inline constexpr int kMaxNodes = 65536;
ClusterShape make_cluster_shape(int nnodes, std::string_view inter_node_bandwidth,
                                const NodeTopology& node);

// "4 nodes x 8 GPUs joined by InfiniBand/RoCE, 90 GB/s per node each way (from ...)".
std::string describe_cluster(const ClusterShape& cluster, int gpus_per_node);

}  // namespace dstrain
