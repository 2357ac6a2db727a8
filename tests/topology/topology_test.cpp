#include "topology/topology.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace dstrain {
namespace {

void set_nvlink(NodeTopology& t, int a, int b, int count) {
  t.link(a, b).kind = LinkKind::NVLink;
  t.link(a, b).nvlinks = count;
  t.link(a, b).peer_access = t.link(a, b).peer_access_known = true;
}

void set_peer(NodeTopology& t, bool value) {
  for (Link& l : t.links) {
    if (l.kind == LinkKind::PCIe) {
      l.peer_access = value;
      l.peer_access_known = true;
    }
  }
}

TEST(NodeTopology, Links_one_per_unordered_pair_in_order) {
  const NodeTopology t = make_topology(5);
  ASSERT_EQ(t.links.size(), 10u);
  size_t k = 0;
  for (int a = 0; a < 5; ++a) {
    for (int b = a + 1; b < 5; ++b, ++k) {
      EXPECT_EQ(link_position(5, a, b), k);
      EXPECT_EQ(&t.link(a, b), &t.links[k]);
      EXPECT_EQ(&t.link(b, a), &t.links[k]);
    }
  }
  t.check_invariants();
  EXPECT_TRUE(make_topology(0).links.empty());
  EXPECT_TRUE(make_topology(1).links.empty());
}

TEST(NodeTopology, Bad_pairs_are_internal_errors) {
  const NodeTopology t = make_topology(3);
  EXPECT_THROW(t.link(1, 1), Error);
  EXPECT_THROW(t.link(0, 3), Error);
  EXPECT_THROW(t.link(-1, 0), Error);
  NodeTopology broken = make_topology(3);
  broken.links[0].kind = LinkKind::NVLink;  // without a count
  EXPECT_THROW(broken.check_invariants(), Error);
}

TEST(NodeTopology, Islands_are_connected_components_including_singletons) {
  NodeTopology t = make_topology(6);
  set_nvlink(t, 4, 5, 2);
  set_nvlink(t, 1, 3, 4);
  set_nvlink(t, 3, 0, 4);
  EXPECT_EQ(t.nvlink_islands(), (std::vector<std::vector<int>>{{0, 1, 3}, {2}, {4, 5}}));
}

TEST(Classify, Each_kind) {
  EXPECT_EQ(make_topology(0).classify().kind, TopologyKind::NoGpus);
  EXPECT_EQ(make_topology(1).classify().kind, TopologyKind::SingleGpu);

  NodeTopology pcie = make_topology(4);
  EXPECT_EQ(pcie.classify().label(), "pcie+peer-unknown");
  set_peer(pcie, true);
  EXPECT_EQ(pcie.classify().label(), "pcie+peer");
  set_peer(pcie, false);
  EXPECT_EQ(pcie.classify().label(), "pcie+no-peer");
  pcie.link(0, 1).peer_access = true;
  EXPECT_EQ(pcie.classify().pcie_peer_access, PeerAccess::Some);

  NodeTopology island = make_topology(4);
  for (int a = 0; a < 4; ++a)
    for (int b = a + 1; b < 4; ++b) set_nvlink(island, a, b, 12);
  EXPECT_EQ(island.classify().label(), "nvlink-island");

  NodeTopology pairs = make_topology(4);
  set_nvlink(pairs, 0, 1, 4);
  set_nvlink(pairs, 2, 3, 4);
  set_peer(pairs, false);
  EXPECT_EQ(pairs.classify().label(), "nvlink-pairs+no-peer");

  NodeTopology partial = make_topology(3);
  set_nvlink(partial, 0, 1, 4);  // GPU 2 alone
  EXPECT_EQ(partial.classify().kind, TopologyKind::NVLinkPartial);
}

TEST(Classify, Numa_split_from_nodes_or_sys_paths) {
  NodeTopology t = make_topology(2);
  t.gpus[0].numa_node = 0;
  t.gpus[1].numa_node = 0;
  EXPECT_FALSE(t.classify().numa_split);
  t.gpus[1].numa_node = 1;
  EXPECT_TRUE(t.classify().numa_split);
  EXPECT_EQ(t.classify().gpu_numa_nodes, 2);
  t.gpus[1].numa_node = -1;
  EXPECT_FALSE(t.classify().numa_split);
  t.link(0, 1).path = PciePath::SYS;
  t.link(0, 1).path_known = true;
  EXPECT_TRUE(t.classify().numa_split);
  EXPECT_NE(t.classify().sentence().find("cross the link between CPU sockets"), std::string::npos);
}

TEST(Classify, Sentences) {
  EXPECT_EQ(make_topology(0).classify().sentence(), "No GPUs.");
  EXPECT_EQ(make_topology(1).classify().sentence(), "1 GPU.");
  NodeTopology pcie = make_topology(2);
  set_peer(pcie, true);
  EXPECT_EQ(pcie.classify().sentence(), "2 GPUs joined only by PCIe (no NVLink); peer access over PCIe.");
  NodeTopology partial = make_topology(3);
  set_nvlink(partial, 0, 1, 4);
  EXPECT_EQ(partial.classify().sentence(),
            "3 GPUs with NVLink between some pairs only, NVLink islands {0,1} {2}, PCIe elsewhere; "
            "peer access over PCIe unknown.");
}

TEST(Names, Pcie_paths_round_trip_and_soc_is_sys) {
  for (PciePath p : {PciePath::PIX, PciePath::PXB, PciePath::PHB, PciePath::NODE, PciePath::SYS}) {
    EXPECT_EQ(parse_pcie_path(pcie_path_name(p)), p);
  }
  EXPECT_EQ(parse_pcie_path("SOC"), PciePath::SYS);
  EXPECT_FALSE(parse_pcie_path("pix").has_value());
  EXPECT_FALSE(parse_pcie_path("NV4").has_value());
}

}  // namespace
}  // namespace dstrain
