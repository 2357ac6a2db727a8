#include "topology/bandwidth.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "topology/gpu_table.h"
#include "topology/nvidia_smi.h"

namespace dstrain {
namespace {

using testing::read_fixture;

NodeTopology fixture_with_model(const std::string& name, const std::string& gpu) {
  NodeTopology t = parse_nvidia_smi_topo(read_fixture(name));
  apply_gpu_model(t, lookup_gpu(gpu));
  return t;
}

TEST(Bandwidth, Pcie_rates_by_generation) {
  EXPECT_NEAR(pcie_theoretical_bytes_per_s(3, 16), 15.75e9, 0.01e9);
  EXPECT_NEAR(pcie_theoretical_bytes_per_s(4, 16), 31.5e9, 0.01e9);
  EXPECT_NEAR(pcie_theoretical_bytes_per_s(5, 16), 63.0e9, 0.02e9);
  EXPECT_NEAR(pcie_achievable_bytes_per_s(4, 16), 25.2e9, 0.05e9);  // ~25 GB/s of 32
  EXPECT_NEAR(pcie_achievable_bytes_per_s(5, 16), 50.4e9, 0.1e9);   // ~50 GB/s
  EXPECT_NEAR(pcie_achievable_bytes_per_s(4, 8), pcie_achievable_bytes_per_s(4, 16) / 2, 1);
  EXPECT_THROW(pcie_theoretical_bytes_per_s(9, 16), Error);
}

TEST(Bandwidth, H100_nvswitch_pair_is_18_nvlinks) {
  const NodeTopology t = fixture_with_model("h100-8gpu-nvswitch.txt", "h100-sxm");
  const PathBandwidth bw = gpu_to_gpu_bandwidth(t, 0, 7);
  EXPECT_DOUBLE_EQ(bw.bytes_per_s, 18 * 25e9 * 0.8);  // 360 GB/s of 450
  EXPECT_EQ(bw.route, "18 NVLinks");
  EXPECT_NEAR(gpu_to_host_bandwidth(t, 3).bytes_per_s, 50.4e9, 0.1e9);  // PCIe gen5
}

TEST(Bandwidth, Rtx4090_box_stages_through_host_and_crosses_sockets) {
  const NodeTopology t = fixture_with_model("rtx4090-8gpu-pcie.txt", "4090");
  const PathBandwidth pix = gpu_to_gpu_bandwidth(t, 0, 1);
  const PathBandwidth sys = gpu_to_gpu_bandwidth(t, 0, 4);
  EXPECT_NEAR(pix.bytes_per_s, 25.2e9 * 0.5, 0.05e9);
  EXPECT_NEAR(sys.bytes_per_s, 25.2e9 * 0.5 * 0.8, 0.05e9);
  EXPECT_EQ(pix.route, "PCIe gen4 x16 staged through host memory");
  EXPECT_EQ(sys.route, "PCIe gen4 x16 staged through host memory across CPU sockets");
  EXPECT_NEAR(gpu_to_host_bandwidth(t, 0).bytes_per_s, 25.2e9, 0.05e9);
}

TEST(Bandwidth, Peer_access_doubles_pcie) {
  NodeTopology t = fixture_with_model("rtx4090-8gpu-pcie.txt", "4090");
  const double staged = gpu_to_gpu_bandwidth(t, 0, 1).bytes_per_s;
  t.link(0, 1).peer_access = true;
  const PathBandwidth peer = gpu_to_gpu_bandwidth(t, 0, 1);
  EXPECT_DOUBLE_EQ(peer.bytes_per_s, 2 * staged);
  EXPECT_EQ(peer.route, "PCIe gen4 x16 peer-to-peer");
}

TEST(Bandwidth, Rtx3090_bridge_uses_ga102_link_rate) {
  const NodeTopology t = fixture_with_model("rtx3090-4gpu-nvlink-pairs.txt", "3090");
  EXPECT_DOUBLE_EQ(gpu_to_gpu_bandwidth(t, 0, 1).bytes_per_s, 4 * 14.0625e9 * 0.8);  // 45 GB/s
  EXPECT_NEAR(gpu_to_gpu_bandwidth(t, 1, 2).bytes_per_s, 25.2e9 * 0.5, 0.05e9);
}

TEST(Bandwidth, Unknown_gpus_use_defaults_and_probe_values_win) {
  NodeTopology t = make_topology(2);
  EXPECT_EQ(effective_pcie_generation(t.gpus[0]), 4);
  EXPECT_EQ(effective_pcie_lanes(t.gpus[0]), 16);
  EXPECT_DOUBLE_EQ(nvlink_link_bytes_per_s(t.gpus[0]), 25e9);
  t.gpus[0].cc_major = 8;
  t.gpus[0].cc_minor = 6;  // an unnamed GA10x
  EXPECT_DOUBLE_EQ(nvlink_link_bytes_per_s(t.gpus[0]), 14.0625e9);
  t.gpus[1].pcie_generation = 3;  // a probe saw a gen3 slot
  t.gpus[1].pcie_lanes = 8;
  EXPECT_EQ(gpu_to_gpu_bandwidth(t, 0, 1).route, "PCIe gen3 x8 staged through host memory");
  EXPECT_NEAR(gpu_to_host_bandwidth(t, 1).bytes_per_s, 0.8 * 7.877e9, 0.01e9);
}

TEST(Bandwidth, Nvlink_beats_peer_pcie_beats_staged_beats_cross_socket_staged) {
  NodeTopology t = make_topology(4);
  t.link(0, 1).kind = LinkKind::NVLink;
  t.link(0, 1).nvlinks = 1;
  t.link(0, 2).peer_access = t.link(0, 2).peer_access_known = true;
  t.link(0, 3).path = PciePath::SYS;
  t.link(0, 3).path_known = true;
  const double nvlink = gpu_to_gpu_bandwidth(t, 0, 1).bytes_per_s;
  const double peer = gpu_to_gpu_bandwidth(t, 0, 2).bytes_per_s;
  const double staged = gpu_to_gpu_bandwidth(t, 1, 2).bytes_per_s;
  const double cross = gpu_to_gpu_bandwidth(t, 0, 3).bytes_per_s;
  EXPECT_GT(peer, staged);
  EXPECT_GT(staged, cross);
  EXPECT_GT(nvlink, 0);
  EXPECT_GT(t.link(0, 1).nvlinks * 18 * 25e9 * 0.8, peer);
}

}  // namespace
}  // namespace dstrain
