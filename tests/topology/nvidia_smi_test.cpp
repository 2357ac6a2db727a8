#include "topology/nvidia_smi.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "topology/gpu_table.h"
#include "topology/topology_json.h"

namespace dstrain {
namespace {

using testing::read_fixture;
using testing::user_error_of;

NodeTopology parse_fixture(const std::string& name) {
  return parse_nvidia_smi_topo(read_fixture(name));
}

// --- the two real outputs -----------------------------------------------------------------

TEST(NvidiaSmiTopo, Real_Rtx4090_8gpu_pcie_tabs_nic_numa) {
  const NodeTopology t = parse_fixture("rtx4090-8gpu-pcie.txt");
  ASSERT_EQ(t.gpu_count(), 8);  // NIC0 is a column and a row, never a GPU
  EXPECT_EQ(t.links.size(), 28u);
  EXPECT_EQ(t.source, "nvidia-smi topo -m");
  for (int a = 0; a < 8; ++a) {
    for (int b = a + 1; b < 8; ++b) {
      const Link& l = t.link(a, b);
      EXPECT_EQ(l.kind, LinkKind::PCIe);
      EXPECT_TRUE(l.path_known);
      const bool same_socket = (a < 4) == (b < 4);
      EXPECT_EQ(l.path, same_socket ? PciePath::PIX : PciePath::SYS) << a << "-" << b;
      EXPECT_FALSE(l.peer_access_known) << "the matrix does not say";
    }
  }
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(t.gpus[i].numa_node, i < 4 ? 0 : 1);
    EXPECT_EQ(t.gpus[i].cpu_affinity, i < 4 ? "0-35,72-107" : "36-71,108-143");
    EXPECT_EQ(t.gpus[i].gpu_numa_id, -1);  // N/A
    EXPECT_TRUE(t.gpus[i].name.empty());
  }
  EXPECT_EQ(t.numa_nodes, 2);
  EXPECT_EQ(t.host_memory_bytes, 0u);
  t.check_invariants();
}

TEST(NvidiaSmiTopo, Real_Rtx4090_classification_with_model_is_pcie_no_peer_numa_split) {
  NodeTopology t = parse_fixture("rtx4090-8gpu-pcie.txt");
  EXPECT_EQ(t.classify().label(), "pcie+peer-unknown+numa-split");
  apply_gpu_model(t, lookup_gpu("4090"));
  const Classification c = t.classify();
  EXPECT_EQ(c.kind, TopologyKind::PCIeOnly);
  EXPECT_EQ(c.pcie_peer_access, PeerAccess::None);
  EXPECT_TRUE(c.numa_split);
  EXPECT_EQ(c.gpu_numa_nodes, 2);
  EXPECT_EQ(c.label(), "pcie+no-peer+numa-split");
  EXPECT_EQ(c.islands.size(), 8u);  // every GPU alone
}

TEST(NvidiaSmiTopo, Real_H100_8gpu_nvswitch_spaces_all_nv18) {
  const NodeTopology t = parse_fixture("h100-8gpu-nvswitch.txt");
  ASSERT_EQ(t.gpu_count(), 8);
  for (const Link& l : t.links) {
    EXPECT_EQ(l.kind, LinkKind::NVLink);
    EXPECT_EQ(l.nvlinks, 18);
    EXPECT_FALSE(l.path_known);  // -m prints NV# instead of the PCIe path
    EXPECT_TRUE(l.peer_access_known);
    EXPECT_TRUE(l.peer_access);
  }
  EXPECT_EQ(t.gpus[3].numa_node, 0);
  EXPECT_EQ(t.gpus[4].numa_node, 1);
  EXPECT_EQ(t.gpus[7].cpu_affinity, "52-103,156-207");
  const Classification c = t.classify();
  EXPECT_EQ(c.kind, TopologyKind::NVLinkIsland);
  ASSERT_EQ(c.islands.size(), 1u);
  EXPECT_EQ(c.islands[0], (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(c.pcie_peer_access, PeerAccess::NotApplicable);
  EXPECT_EQ(c.label(), "nvlink-island+numa-split");
}

// --- hand-made variants -------------------------------------------------------------------

TEST(NvidiaSmiTopo, Spaces_nic_columns_and_rows_nic_legend) {
  const NodeTopology t = parse_fixture("a100-4gpu-spaces-nics.txt");
  ASSERT_EQ(t.gpu_count(), 4);
  for (const Link& l : t.links) EXPECT_EQ(l.nvlinks, 12);
  EXPECT_EQ(t.gpus[0].numa_node, 3);
  EXPECT_EQ(t.gpus[2].numa_node, 7);
  EXPECT_EQ(t.gpus[2].cpu_affinity, "112-127,240-255");
  EXPECT_EQ(t.gpus[3].gpu_numa_id, -1);
  EXPECT_EQ(t.numa_nodes, 2);
  EXPECT_EQ(t.classify().label(), "nvlink-island+numa-split");
}

TEST(NvidiaSmiTopo, Ansi_colour_codes_around_header) {
  const std::string text = read_fixture("rtx4090-2gpu-ansi.txt");
  ASSERT_NE(text.find('\x1b'), std::string::npos) << "fixture must hold real escape bytes";
  const NodeTopology t = parse_nvidia_smi_topo(text);
  ASSERT_EQ(t.gpu_count(), 2);
  EXPECT_EQ(t.link(0, 1).path, PciePath::PHB);
  EXPECT_EQ(t.gpus[1].numa_node, 0);
  EXPECT_EQ(t.gpus[1].cpu_affinity, "0-31");
  EXPECT_EQ(t.classify().label(), "pcie+peer-unknown");
}

TEST(NvidiaSmiTopo, Ansi_codes_that_lost_their_escape_byte) {
  std::string text = read_fixture("rtx4090-2gpu-ansi.txt");
  std::string stripped;
  for (char c : text) {
    if (c != '\x1b') stripped += c;  // "[4mGPU0 ... GPU NUMA ID[0m"
  }
  const NodeTopology t = parse_nvidia_smi_topo(stripped);
  ASSERT_EQ(t.gpu_count(), 2);
  EXPECT_EQ(t.gpus[0].numa_node, 0);
}

TEST(NvidiaSmiTopo, Older_driver_mlx5_columns_cube_mesh) {
  const NodeTopology t = parse_fixture("v100-8gpu-mlx5-cubemesh.txt");
  ASSERT_EQ(t.gpu_count(), 8);  // mlx5_0..3 rows are not GPUs
  EXPECT_EQ(t.link(0, 1).nvlinks, 1);
  EXPECT_EQ(t.link(0, 3).nvlinks, 2);
  EXPECT_EQ(t.link(4, 7).nvlinks, 2);
  EXPECT_EQ(t.link(0, 5).kind, LinkKind::PCIe);
  EXPECT_EQ(t.link(0, 5).path, PciePath::SYS);
  EXPECT_EQ(t.gpus[5].cpu_affinity, "20-39,60-79");
  EXPECT_EQ(t.gpus[5].numa_node, -1);  // no NUMA Affinity column
  EXPECT_EQ(t.numa_nodes, 0);
  const Classification c = t.classify();
  EXPECT_EQ(c.kind, TopologyKind::NVLinkPartial);  // connected, but not every pair linked
  ASSERT_EQ(c.islands.size(), 1u);
  EXPECT_EQ(c.islands[0].size(), 8u);
  EXPECT_TRUE(c.numa_split);  // SYS paths
  EXPECT_EQ(c.label(), "nvlink-partial+peer-unknown+numa-split");
}

TEST(NvidiaSmiTopo, Older_driver_SOC_is_SYS) {
  const NodeTopology t = parse_fixture("k80-4gpu-soc.txt");
  ASSERT_EQ(t.gpu_count(), 4);
  EXPECT_EQ(t.link(0, 1).path, PciePath::PIX);
  EXPECT_EQ(t.link(0, 2).path, PciePath::SYS);
  EXPECT_EQ(t.link(1, 3).path, PciePath::SYS);
  EXPECT_NE(t.source.find("SOC"), std::string::npos);
  EXPECT_EQ(t.gpus[2].cpu_affinity, "12-23,36-47");
  const Classification c = t.classify();
  EXPECT_TRUE(c.numa_split);
  EXPECT_EQ(c.gpu_numa_nodes, 0);
  EXPECT_EQ(c.label(), "pcie+peer-unknown+numa-split");
}

TEST(NvidiaSmiTopo, Mp_view_without_nvlinks) {
  const NodeTopology t = parse_fixture("a100-4gpu-mp.txt");
  ASSERT_EQ(t.gpu_count(), 4);
  EXPECT_EQ(t.link(0, 1).path, PciePath::PXB);
  EXPECT_EQ(t.link(1, 2).path, PciePath::SYS);
  EXPECT_NE(t.source.find("-mp"), std::string::npos) << t.source;
  EXPECT_EQ(t.gpus[3].numa_node, 1);
  EXPECT_EQ(t.classify().kind, TopologyKind::PCIeOnly);
}

TEST(NvidiaSmiTopo, Gpu_numa_id_column_with_values) {
  const NodeTopology t = parse_fixture("gh200-4gpu-gpu-numa-id.txt");
  ASSERT_EQ(t.gpu_count(), 4);
  const int expected_ids[] = {4, 12, 20, 28};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(t.gpus[i].numa_node, i);
    EXPECT_EQ(t.gpus[i].gpu_numa_id, expected_ids[i]);
  }
  EXPECT_EQ(t.link(1, 3).nvlinks, 6);
  EXPECT_EQ(t.numa_nodes, 4);
  EXPECT_EQ(t.classify().label(), "nvlink-island+numa-split");
}

TEST(NvidiaSmiTopo, Rtx3090_nvlink_bridged_pairs) {
  NodeTopology t = parse_fixture("rtx3090-4gpu-nvlink-pairs.txt");
  ASSERT_EQ(t.gpu_count(), 4);
  EXPECT_EQ(t.link(0, 1).nvlinks, 4);
  EXPECT_EQ(t.link(2, 3).nvlinks, 4);
  EXPECT_EQ(t.link(1, 2).kind, LinkKind::PCIe);
  EXPECT_EQ(t.link(1, 2).path, PciePath::PHB);
  Classification c = t.classify();
  EXPECT_EQ(c.kind, TopologyKind::NVLinkPairs);
  EXPECT_EQ(c.islands, (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(c.label(), "nvlink-pairs+peer-unknown");
  apply_gpu_model(t, lookup_gpu("rtx3090"));
  EXPECT_TRUE(t.link(0, 1).peer_access);   // over the bridge
  EXPECT_FALSE(t.link(0, 2).peer_access);  // GeForce: not over PCIe
  EXPECT_EQ(t.classify().label(), "nvlink-pairs+no-peer");
}

TEST(NvidiaSmiTopo, Single_gpu) {
  const NodeTopology t = parse_fixture("single-gpu.txt");
  ASSERT_EQ(t.gpu_count(), 1);
  EXPECT_TRUE(t.links.empty());
  EXPECT_EQ(t.gpus[0].numa_node, 0);
  EXPECT_EQ(t.gpus[0].cpu_affinity, "0-15");
  EXPECT_EQ(t.classify().kind, TopologyKind::SingleGpu);
  EXPECT_EQ(t.classify().label(), "single-gpu");
}

TEST(NvidiaSmiTopo, Header_after_a_shell_prompt_partial_legend) {
  const NodeTopology t = parse_fixture("rtx5070-2gpu-prompt.txt");
  ASSERT_EQ(t.gpu_count(), 2);
  EXPECT_EQ(t.link(0, 1).path, PciePath::PHB);
  EXPECT_EQ(t.gpus[1].numa_node, 0);
  EXPECT_EQ(t.gpus[1].cpu_affinity, "0-23");
}

TEST(NvidiaSmiTopo, Tabs_spaces_and_crlf_give_the_same_topology) {
  const std::string tabs = read_fixture("rtx4090-8gpu-pcie.txt");
  std::string spaces, crlf;
  for (char c : tabs) {
    spaces += c == '\t' ? std::string("    ") : std::string(1, c);
    crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
  }
  const nlohmann::json expected = to_json(parse_nvidia_smi_topo(tabs));
  EXPECT_EQ(to_json(parse_nvidia_smi_topo(spaces)), expected);
  EXPECT_EQ(to_json(parse_nvidia_smi_topo(crlf)), expected);
}

// --- -p2p ----------------------------------------------------------------------------------

TEST(NvidiaSmiP2p, Gns_means_no_peer_access) {
  NodeTopology t = parse_fixture("rtx4090-2gpu-ansi.txt");
  apply_nvidia_smi_p2p(t, read_fixture("p2p-2gpu-gns.txt"));
  EXPECT_TRUE(t.link(0, 1).peer_access_known);
  EXPECT_FALSE(t.link(0, 1).peer_access);
  EXPECT_EQ(t.classify().label(), "pcie+no-peer");
}

TEST(NvidiaSmiP2p, Ok_and_unknown) {
  NodeTopology t = parse_fixture("a100-4gpu-mp.txt");
  apply_nvidia_smi_p2p(t, read_fixture("p2p-4gpu-ok.txt"));
  EXPECT_TRUE(t.link(0, 1).peer_access);
  EXPECT_TRUE(t.link(1, 3).peer_access);
  EXPECT_FALSE(t.link(2, 3).peer_access_known);  // U
  EXPECT_EQ(t.classify().pcie_peer_access, PeerAccess::Unknown);
  t.link(2, 3).peer_access_known = true;
  t.link(2, 3).peer_access = true;
  EXPECT_EQ(t.classify().label(), "pcie+peer+numa-split");
}

TEST(NvidiaSmiP2p, Gpu_count_mismatch_is_a_user_error) {
  NodeTopology t = parse_fixture("a100-4gpu-mp.txt");
  const std::string message =
      user_error_of([&] { apply_nvidia_smi_p2p(t, read_fixture("p2p-2gpu-gns.txt")); });
  EXPECT_NE(message.find("2 GPUs but the topology has 4"), std::string::npos) << message;
}

// --- garbage -------------------------------------------------------------------------------

void expect_parse_error(const std::string& text, const std::string& expected_part) {
  const std::string message = user_error_of([&] { parse_nvidia_smi_topo(text); });
  EXPECT_NE(message.find(expected_part), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << "one sentence, one line: " << message;
}

TEST(NvidiaSmiTopoErrors, Empty_and_garbage_have_no_gpu_rows) {
  expect_parse_error("", "no GPU rows found in the nvidia-smi topo output");
  expect_parse_error("hello world\nthis is not a topology\n", "no GPU rows found");
  expect_parse_error("\tGPU0\tGPU1\tCPU Affinity\n", "no GPU rows found");  // header only
  expect_parse_error("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
                     "no GPU rows found");
}

TEST(NvidiaSmiTopoErrors, Short_row) {
  expect_parse_error(read_fixture("bad-short-row.txt"), "row GPU3 has 2 cells, expected 4");
}

TEST(NvidiaSmiTopoErrors, Missing_row) {
  expect_parse_error("\tGPU0\tGPU1\tGPU2\nGPU0\t X \tPIX\tPIX\nGPU1\tPIX\t X \tPIX\n",
                     "names 3 GPUs but row GPU2 is missing");
}

TEST(NvidiaSmiTopoErrors, Row_without_a_column) {
  expect_parse_error("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\t X \nGPU2\tPIX\tPIX\t X \n",
                     "row GPU2 has no column in the nvidia-smi topo header, which names 2 GPUs");
}

TEST(NvidiaSmiTopoErrors, Repeated_row) {
  expect_parse_error("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU0\t X \tPIX\nGPU1\tPIX\t X \n",
                     "row GPU0 appears twice");
}

TEST(NvidiaSmiTopoErrors, Unknown_cell) {
  expect_parse_error("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n",
                     "cell 'FOO' in row GPU0, column GPU1 is not a link type");
  expect_parse_error("\tGPU0\tGPU1\nGPU0\t X \tNV0\nGPU1\tNV0\t X \n", "cell 'NV0'");
}

TEST(NvidiaSmiTopoErrors, Self_cell_not_X) {
  expect_parse_error("\tGPU0\tGPU1\nGPU0\tPIX\tPIX\nGPU1\tPIX\t X \n", "in its own column GPU0");
}

TEST(NvidiaSmiTopoErrors, Not_symmetric) {
  expect_parse_error("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tPIX\t X \n", "not symmetric");
}

TEST(NvidiaSmiTopoErrors, Gpu_columns_out_of_order) {
  expect_parse_error("\tGPU0\tGPU2\nGPU0\t X \tPIX\nGPU2\tPIX\t X \n", "GPU columns must be");
}

}  // namespace
}  // namespace dstrain
