#include "topology/format.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "topology/gpu_table.h"
#include "topology/nvidia_smi.h"

namespace dstrain {
namespace {

using testing::read_fixture;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(FormatTopology, Rtx4090_box) {
  NodeTopology t = parse_nvidia_smi_topo(read_fixture("rtx4090-8gpu-pcie.txt"));
  apply_gpu_model(t, lookup_gpu("4090"));
  const std::string text = format_topology_table(t);
  EXPECT_TRUE(contains(text, "8 GPUs, host memory unknown, 2 NUMA nodes (source: nvidia-smi topo -m)"))
      << text;
  EXPECT_TRUE(contains(text, "NVIDIA GeForce RTX 4090  24.00 GiB  128  8.9")) << text;
  EXPECT_TRUE(contains(text, "GPU0  X     PIX*  PIX*  PIX*  SYS*  SYS*  SYS*  SYS*")) << text;
  EXPECT_TRUE(contains(text, "* = no peer access")) << text;
  EXPECT_TRUE(contains(text, "8 GPUs joined only by PCIe (no NVLink); no peer access over PCIe; "
                             "GPUs split across 2 NUMA nodes."))
      << text;
  EXPECT_EQ(text.find(" \n"), std::string::npos) << "trailing space in:\n" << text;
  std::printf("%s", text.c_str());
}

TEST(FormatTopology, H100_box_and_unknown_peer_access) {
  const std::string text = format_topology_table(parse_nvidia_smi_topo(read_fixture("h100-8gpu-nvswitch.txt")));
  EXPECT_TRUE(contains(text, "NV18  NV18")) << text;
  EXPECT_TRUE(contains(text, "0    ?     ?       ?    ?   0     ?")) << text;
  EXPECT_TRUE(contains(text, "8 GPUs in one NVLink island {0,1,2,3,4,5,6,7} (every pair joined by NVLink)"))
      << text;
  const std::string pairs =
      format_topology_table(parse_nvidia_smi_topo(read_fixture("rtx3090-4gpu-nvlink-pairs.txt")));
  EXPECT_TRUE(contains(pairs, "NV4   PHB?")) << pairs;
  EXPECT_TRUE(contains(pairs, "4 GPUs in 2 NVLink-bridged pairs {0,1} {2,3}, PCIe between the pairs; "
                              "peer access over PCIe unknown."))
      << pairs;
}

TEST(FormatTopology, No_gpus_and_one_gpu) {
  const std::string none = format_topology_table(make_topology(0));
  EXPECT_TRUE(contains(none, "0 GPUs")) << none;
  EXPECT_TRUE(contains(none, "No GPUs.")) << none;
  const std::string one = format_topology_table(parse_nvidia_smi_topo(read_fixture("single-gpu.txt")));
  EXPECT_TRUE(contains(one, "1 GPU, host memory unknown, 1 NUMA node")) << one;
  EXPECT_FALSE(contains(one, "GPU0  X")) << "no matrix for one GPU:\n" << one;
}

TEST(FormatTopology, Link_cells) {
  Link link;
  EXPECT_EQ(format_link_cell(link), "PCIe?");
  link.path_known = true;
  link.path = PciePath::NODE;
  link.peer_access_known = true;
  link.peer_access = true;
  EXPECT_EQ(format_link_cell(link), "NODE");
  link.peer_access = false;
  EXPECT_EQ(format_link_cell(link), "NODE*");
  link.kind = LinkKind::NVLink;
  link.nvlinks = 12;
  link.peer_access = true;
  EXPECT_EQ(format_link_cell(link), "NV12");
}

}  // namespace
}  // namespace dstrain
