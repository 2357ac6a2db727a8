// The inter-node link: the --inter-node-bandwidth text, the NICs of `nvidia-smi topo -m`, and the
// cluster made of both (topology/cluster.h).
#include "topology/cluster.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "topology/nvidia_smi.h"

namespace dstrain {
namespace {

using testing::read_fixture;
using testing::user_error_of;

// The assumptions cluster.cpp states: an RDMA NIC carries 200 Gbit/s at 90%, a node without
// one 25 Gbit/s Ethernet at 80%.
constexpr double kRdmaNicBytesPerS = 200e9 / 8 * 0.9;
constexpr double kEthernetBytesPerS = 25e9 / 8 * 0.8;

TEST(InterNodeBandwidth, ParsesBytesAndBitsWithDecimalPrefixes) {
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("25GB/s"), 25e9);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("25 GBps"), 25e9);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("25GB"), 25e9);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("1.5TB/s"), 1.5e12);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("200Gbit/s"), 25e9);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("200Gb/s"), 25e9);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("400 Gbps"), 50e9);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("100G"), 12.5e9);   // a bare prefix: bits
  EXPECT_DOUBLE_EQ(parse_network_bandwidth(" 100g "), 12.5e9);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("800Mbit/s"), 1e8);
  EXPECT_DOUBLE_EQ(parse_network_bandwidth("10gbit"), 1.25e9);
}

TEST(InterNodeBandwidth, BadTextIsOneSentenceNamingTheFlag) {
  for (const char* text : {"", "fast", "25", "25 GB/min", "-5GB/s", "0G", "GB/s", "1.2.3G",
                           "25XB/s", ".5G", "5.G", "25Gbytes"}) {
    SCOPED_TRACE(text);
    const std::string message = user_error_of([&] { parse_network_bandwidth(text); });
    EXPECT_NE(message.find("--inter-node-bandwidth '"), std::string::npos) << message;
    EXPECT_NE(message.find("such as 25GB/s (bytes), 200Gbit/s or 100G (bits)"), std::string::npos)
        << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(InterNodeLink, NicNamesComeFromTheNicLegend) {
  // NIC0..NIC3 columns and rows, named by the "NIC Legend:" block (not in order: NIC1 is mlx5_3).
  const NodeTopology h100 = parse_nvidia_smi_topo(read_fixture("h100-8gpu-nvswitch-4nic.txt"));
  EXPECT_EQ(h100.gpu_count(), 8);
  EXPECT_TRUE(h100.nics_known);
  EXPECT_EQ(h100.nics, (std::vector<std::string>{"mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5"}));
  const NodeTopology a100 = parse_nvidia_smi_topo(read_fixture("a100-4gpu-spaces-nics.txt"));
  EXPECT_EQ(a100.nics, (std::vector<std::string>{"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"}));
  // Older drivers name the columns themselves; no legend.
  const NodeTopology v100 = parse_nvidia_smi_topo(read_fixture("v100-8gpu-mlx5-cubemesh.txt"));
  EXPECT_EQ(v100.nics, (std::vector<std::string>{"mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"}));
  // One bonded ConnectX port (RoCE over the bond).
  const NodeTopology rtx4090 = parse_nvidia_smi_topo(read_fixture("rtx4090-8gpu-pcie.txt"));
  EXPECT_EQ(rtx4090.nics, std::vector<std::string>{"mlx5_bond_0"});
  // A matrix without NIC columns: known to have none.
  const NodeTopology no_nics = parse_nvidia_smi_topo(read_fixture("h100-8gpu-nvswitch.txt"));
  EXPECT_TRUE(no_nics.nics_known);
  EXPECT_TRUE(no_nics.nics.empty());
  // A probe or a hand-made topology does not list NICs.
  EXPECT_FALSE(make_topology(2).nics_known);
}

TEST(InterNodeLink, RdmaNicNames) {
  for (const char* name : {"mlx5_0", "mlx5_bond_0", "mlx4_1", "ibp12s0", "bnxt_re0", "irdma1",
                           "qedr0", "hfi1_0", "efa_0"}) {
    EXPECT_TRUE(is_rdma_nic(name)) << name;
  }
  for (const char* name : {"eth0", "ens1f0", "enp65s0f1", "eno1", "rxe0", "NIC0", ""}) {
    EXPECT_FALSE(is_rdma_nic(name)) << name;
  }
}

TEST(InterNodeLink, FromTheNicsNvidiaSmiLists) {
  const NodeTopology h100 = parse_nvidia_smi_topo(read_fixture("h100-8gpu-nvswitch-4nic.txt"));
  const ClusterShape ib = make_cluster_shape(4, "", h100);
  EXPECT_EQ(ib.nnodes, 4);
  EXPECT_EQ(ib.inter_node_kind, NetworkKind::Rdma);
  EXPECT_DOUBLE_EQ(ib.inter_node_bytes_per_s, 4 * kRdmaNicBytesPerS);  // the node's 4 NICs
  EXPECT_NE(ib.inter_node_source.find("4 InfiniBand/RoCE NICs (mlx5_0, mlx5_3, mlx5_4, mlx5_5)"),
            std::string::npos)
      << ib.inter_node_source;

  const ClusterShape bond =
      make_cluster_shape(2, "", parse_nvidia_smi_topo(read_fixture("rtx4090-8gpu-pcie.txt")));
  EXPECT_EQ(bond.inter_node_kind, NetworkKind::Rdma);
  EXPECT_DOUBLE_EQ(bond.inter_node_bytes_per_s, kRdmaNicBytesPerS);
  EXPECT_NE(bond.inter_node_source.find("1 InfiniBand/RoCE NIC (mlx5_bond_0)"), std::string::npos)
      << bond.inter_node_source;

  const NodeTopology no_nics = parse_nvidia_smi_topo(read_fixture("h100-8gpu-nvswitch.txt"));
  const ClusterShape ethernet = make_cluster_shape(2, "", no_nics);
  EXPECT_EQ(ethernet.inter_node_kind, NetworkKind::Ethernet);
  EXPECT_DOUBLE_EQ(ethernet.inter_node_bytes_per_s, kEthernetBytesPerS);
  EXPECT_NE(ethernet.inter_node_source.find("no InfiniBand/RoCE NIC in nvidia-smi topo -m"),
            std::string::npos)
      << ethernet.inter_node_source;

  NodeTopology ethernet_names = no_nics;
  ethernet_names.nics = {"ens1f0", "ens1f1"};
  const ClusterShape named = make_cluster_shape(2, "", ethernet_names);
  EXPECT_EQ(named.inter_node_kind, NetworkKind::Ethernet);
  EXPECT_DOUBLE_EQ(named.inter_node_bytes_per_s, kEthernetBytesPerS);
  EXPECT_NE(named.inter_node_source.find("only Ethernet NICs (ens1f0, ens1f1)"), std::string::npos);

  // No NIC list at all (a probed machine): the stated default, and how to give the real rate.
  const ClusterShape unknown = make_cluster_shape(2, "", make_topology(8));
  EXPECT_DOUBLE_EQ(unknown.inter_node_bytes_per_s, kEthernetBytesPerS);
  EXPECT_NE(unknown.inter_node_source.find("not known"), std::string::npos);
  EXPECT_NE(unknown.inter_node_source.find("--inter-node-bandwidth"), std::string::npos);
}

TEST(InterNodeLink, TheFlagWinsAndTheNicsStillSayTheKind) {
  const NodeTopology h100 = parse_nvidia_smi_topo(read_fixture("h100-8gpu-nvswitch-4nic.txt"));
  const ClusterShape given = make_cluster_shape(2, "400Gbit/s", h100);
  EXPECT_DOUBLE_EQ(given.inter_node_bytes_per_s, 50e9);
  EXPECT_EQ(given.inter_node_kind, NetworkKind::Rdma);
  EXPECT_EQ(given.inter_node_source, "--inter-node-bandwidth 400Gbit/s");
  EXPECT_EQ(make_cluster_shape(2, "10GB/s", make_topology(8)).inter_node_kind,
            NetworkKind::Unknown);
  const std::string text = describe_cluster(given, 8);
  EXPECT_NE(text.find("2 nodes x 8 GPUs joined by InfiniBand/RoCE, 50 GB/s per node each way"),
            std::string::npos)
      << text;
}

TEST(InterNodeLink, OneNodeUsesNoLinkButChecksTheFlag) {
  const ClusterShape one = make_cluster_shape(1, "", make_topology(8));
  EXPECT_FALSE(one.multi_node());
  EXPECT_EQ(one.inter_node_bytes_per_s, 0);
  EXPECT_EQ(make_cluster_shape(1, "100G", make_topology(8)).inter_node_bytes_per_s, 0);
  EXPECT_NE(user_error_of([] { make_cluster_shape(1, "lots", make_topology(8)); })
                .find("--inter-node-bandwidth 'lots'"),
            std::string::npos);
}

TEST(InterNodeLink, BadNodeCountsAreOneSentence) {
  for (int nnodes : {0, -3, kMaxNodes + 1}) {
    const std::string message = user_error_of([&] { make_cluster_shape(nnodes, "", make_topology(8)); });
    EXPECT_NE(message.find("--nnodes must be between 1 and 65536, not " + std::to_string(nnodes)),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace dstrain
