#include "topology/topology_json.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "test_util.h"
#include "topology/gpu_table.h"
#include "topology/nvidia_smi.h"

namespace dstrain {
namespace {

using nlohmann::json;
using testing::fixture_path;
using testing::read_fixture;
using testing::user_error_of;

const char* const kTopoFixtures[] = {
    "rtx4090-8gpu-pcie.txt",     "h100-8gpu-nvswitch.txt",        "a100-4gpu-spaces-nics.txt",
    "rtx4090-2gpu-ansi.txt",     "v100-8gpu-mlx5-cubemesh.txt",   "k80-4gpu-soc.txt",
    "a100-4gpu-mp.txt",          "gh200-4gpu-gpu-numa-id.txt",    "rtx3090-4gpu-nvlink-pairs.txt",
    "single-gpu.txt",            "rtx5070-2gpu-prompt.txt",       "h100-8gpu-nvswitch-4nic.txt",
};

// A topology with every field set, as a probe on a real machine would give.
NodeTopology full_topology() {
  NodeTopology t = make_topology(3);
  for (int i = 0; i < 3; ++i) {
    GpuInfo& g = t.gpus[i];
    g.name = "NVIDIA A100-SXM4-80GB";
    g.memory_bytes = 85899345920ull;
    g.sm_count = 108;
    g.cc_major = 8;
    g.cc_minor = 0;
    g.pci_bus_id = "0000:0" + std::to_string(i + 1) + ":00.0";
    g.numa_node = i == 2 ? 1 : 0;
    g.gpu_numa_id = -1;
    g.cpu_affinity = i == 2 ? "32-63" : "0-31";
    g.pcie_generation = 4;
    g.pcie_lanes = 16;
  }
  t.link(0, 1).kind = LinkKind::NVLink;
  t.link(0, 1).nvlinks = 12;
  t.link(0, 1).path = PciePath::PXB;
  t.link(0, 1).path_known = true;
  t.link(0, 1).peer_access = t.link(0, 1).peer_access_known = true;
  t.link(0, 2).path = PciePath::SYS;
  t.link(0, 2).path_known = true;
  t.link(0, 2).peer_access_known = true;  // measured: no
  t.link(1, 2).path = PciePath::NODE;
  t.link(1, 2).path_known = true;          // peer access unknown
  t.host_memory_bytes = 549755813888ull;
  t.numa_nodes = 2;
  t.source = "probe (CUDA runtime, NVML)";
  return t;
}

void expect_same(const NodeTopology& x, const NodeTopology& y) {
  ASSERT_EQ(x.gpu_count(), y.gpu_count());
  for (int i = 0; i < x.gpu_count(); ++i) {
    const GpuInfo &a = x.gpus[i], &b = y.gpus[i];
    EXPECT_EQ(a.index, b.index);
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.memory_bytes, b.memory_bytes);
    EXPECT_EQ(a.sm_count, b.sm_count);
    EXPECT_EQ(a.cc_major, b.cc_major);
    EXPECT_EQ(a.cc_minor, b.cc_minor);
    EXPECT_EQ(a.pci_bus_id, b.pci_bus_id);
    EXPECT_EQ(a.numa_node, b.numa_node);
    EXPECT_EQ(a.gpu_numa_id, b.gpu_numa_id);
    EXPECT_EQ(a.cpu_affinity, b.cpu_affinity);
    EXPECT_EQ(a.pcie_generation, b.pcie_generation);
    EXPECT_EQ(a.pcie_lanes, b.pcie_lanes);
  }
  ASSERT_EQ(x.links.size(), y.links.size());
  for (size_t k = 0; k < x.links.size(); ++k) {
    const Link &a = x.links[k], &b = y.links[k];
    EXPECT_EQ(a.a, b.a);
    EXPECT_EQ(a.b, b.b);
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.nvlinks, b.nvlinks);
    EXPECT_EQ(a.path_known, b.path_known);
    if (a.path_known) {
      EXPECT_EQ(a.path, b.path);
    }
    EXPECT_EQ(a.peer_access_known, b.peer_access_known);
    if (a.peer_access_known) {
      EXPECT_EQ(a.peer_access, b.peer_access);
    }
  }
  EXPECT_EQ(x.host_memory_bytes, y.host_memory_bytes);
  EXPECT_EQ(x.numa_nodes, y.numa_nodes);
  EXPECT_EQ(x.source, y.source);
  EXPECT_EQ(x.nics_known, y.nics_known);
  EXPECT_EQ(x.nics, y.nics);
}

TEST(TopologyJson, Round_trip_every_fixture) {
  for (const char* name : kTopoFixtures) {
    SCOPED_TRACE(name);
    const NodeTopology parsed = parse_nvidia_smi_topo(read_fixture(name));
    const json written = to_json(parsed);
    const NodeTopology read = topology_from_json(written);
    expect_same(parsed, read);
    EXPECT_EQ(to_json(read), written);
    // Through text as well.
    EXPECT_EQ(to_json(topology_from_json(json::parse(written.dump(2)))), written);
  }
}

TEST(TopologyJson, Round_trip_all_fields) {
  const NodeTopology t = full_topology();
  expect_same(t, topology_from_json(to_json(t)));
}

TEST(TopologyJson, Schema_of_the_4090_box) {
  NodeTopology t = parse_nvidia_smi_topo(read_fixture("rtx4090-8gpu-pcie.txt"));
  apply_gpu_model(t, lookup_gpu("4090"));
  t.host_memory_bytes = 256ull << 30;
  const json j = to_json(t);
  ASSERT_EQ(j["gpus"].size(), 8u);
  const json& gpu0 = j["gpus"][0];
  EXPECT_EQ(gpu0["index"], 0);
  EXPECT_EQ(gpu0["name"], "NVIDIA GeForce RTX 4090");
  EXPECT_EQ(gpu0["memory_bytes"], 25769803776ull);
  EXPECT_EQ(gpu0["sm_count"], 128);
  EXPECT_EQ(gpu0["compute_capability"], "8.9");
  EXPECT_EQ(gpu0["numa_node"], 0);
  EXPECT_FALSE(gpu0.contains("pci_bus_id"));  // unknown: left out
  ASSERT_EQ(j["links"].size(), 28u);
  EXPECT_EQ(j["links"][0], json::parse(R"({"a":0,"b":1,"kind":"pcie","path":"PIX","peer_access":false})"));
  EXPECT_EQ(j["links"][3], json::parse(R"({"a":0,"b":4,"kind":"pcie","path":"SYS","peer_access":false})"));
  EXPECT_EQ(j["islands"].size(), 8u);
  EXPECT_EQ(j["host_memory_bytes"], 256ull << 30);
  EXPECT_EQ(j["numa_nodes"], 2);
  EXPECT_EQ(j["classification"], "pcie+no-peer+numa-split");
  EXPECT_EQ(j["source"], "nvidia-smi topo -m");
}

TEST(TopologyJson, Schema_of_the_h100_box) {
  const json j = to_json(parse_nvidia_smi_topo(read_fixture("h100-8gpu-nvswitch.txt")));
  EXPECT_EQ(j["links"][0], json::parse(R"({"a":0,"b":1,"kind":"nvlink","nvlinks":18})"));
  EXPECT_EQ(j["islands"], json::parse("[[0,1,2,3,4,5,6,7]]"));
  EXPECT_EQ(j["classification"], "nvlink-island+numa-split");
}

TEST(TopologyJson, Zero_and_one_gpu_need_no_links) {
  EXPECT_EQ(topology_from_json(json::parse(R"({"gpus": []})")).gpu_count(), 0);
  const NodeTopology one = topology_from_json(json::parse(R"({"gpus": [{"index": 0}]})"));
  EXPECT_EQ(one.gpu_count(), 1);
  EXPECT_EQ(one.gpus[0].numa_node, -1);
}

TEST(TopologyJson, Reversed_pairs_and_any_gpu_order_are_accepted) {
  const NodeTopology t = topology_from_json(json::parse(R"({
      "gpus": [{"index": 1, "name": "b"}, {"index": 0, "name": "a"}],
      "links": [{"a": 1, "b": 0, "kind": "NVLink", "nvlinks": 4}]})"));
  EXPECT_EQ(t.gpus[0].name, "a");
  EXPECT_EQ(t.link(0, 1).nvlinks, 4);
  EXPECT_TRUE(t.link(0, 1).peer_access);
}

void expect_json_error(const std::string& text, const std::string& expected_part) {
  const json j = json::parse(text);
  const std::string message = user_error_of([&] { topology_from_json(j); });
  EXPECT_NE(message.find(expected_part), std::string::npos) << "for " << text << "\ngot: " << message;
}

constexpr const char* kTwoGpus = R"("gpus": [{"index": 0}, {"index": 1}])";

TEST(TopologyJson, Bad_json_is_a_user_error) {
  expect_json_error("[]", "must be an object");
  expect_json_error("{}", "no \"gpus\" array");
  expect_json_error(R"({"gpus": 3})", "no \"gpus\" array");
  expect_json_error(R"({"gpus": [{"name": "x"}]})", "gpus[0] has no \"index\"");
  expect_json_error(R"({"gpus": [{"index": 0}, {"index": 0}]})", "GPU index 0 appears twice");
  expect_json_error(R"({"gpus": [{"index": 5}]})", "has index 5 but there are only 1 GPUs");
  expect_json_error(R"({"gpus": [{"index": 0, "sm_count": "many"}]})", "sm_count must be an integer");
  expect_json_error(R"({"gpus": [{"index": 0, "compute_capability": "eight"}]})",
                    "compute_capability is 'eight'");
  expect_json_error(R"({"gpus": [{"index": 0, "memory_bytes": -1}]})", "memory_bytes must be");
  expect_json_error(std::string("{") + kTwoGpus + "}", "no \"links\" array");
  expect_json_error(std::string("{") + kTwoGpus + R"(, "links": [{"a": 0, "b": 9, "kind": "pcie"}]})",
                    "refers to GPU 9, but there are 2 GPUs");
  expect_json_error(std::string("{") + kTwoGpus + R"(, "links": [{"a": 1, "b": 1, "kind": "pcie"}]})",
                    "links GPU 1 to itself");
  expect_json_error(std::string("{") + kTwoGpus +
                        R"(, "links": [{"a": 0, "b": 1, "kind": "pcie"}, {"a": 1, "b": 0, "kind": "pcie"}]})",
                    "GPU pair 0-1 has more than one link");
  expect_json_error(std::string("{") + kTwoGpus + R"(, "links": []})", "no link for GPU pair 0-1");
  expect_json_error(std::string("{") + kTwoGpus + R"(, "links": [{"a": 0, "b": 1, "kind": "ethernet"}]})",
                    "has kind 'ethernet'; expected \"nvlink\" or \"pcie\"");
  expect_json_error(std::string("{") + kTwoGpus + R"(, "links": [{"a": 0, "b": 1}]})", "has kind ''");
  expect_json_error(std::string("{") + kTwoGpus + R"(, "links": [{"a": 0, "b": 1, "kind": "nvlink"}]})",
                    "without a positive \"nvlinks\"");
  expect_json_error(std::string("{") + kTwoGpus +
                        R"(, "links": [{"a": 0, "b": 1, "kind": "pcie", "path": "QPI"}]})",
                    "has path 'QPI'");
  expect_json_error(std::string("{") + kTwoGpus +
                        R"(, "links": [{"a": 0, "b": 1, "kind": "pcie", "peer_access": "yes"}]})",
                    "peer_access must be true or false");
  expect_json_error(std::string("{") + kTwoGpus + R"(, "links": [{"a": 0, "kind": "pcie"}]})",
                    "needs GPU indices \"a\" and \"b\"");
}

TEST(TopologyJson, Load_topology_file_reads_json_and_nvidia_smi_text) {
  const NodeTopology from_text = load_topology_file(fixture_path("h100-8gpu-nvswitch.txt"));
  EXPECT_EQ(from_text.gpu_count(), 8);

  char path[] = "/tmp/dstrain_topology_test_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream out(path);
    out << to_json(full_topology()).dump(2);
  }
  expect_same(load_topology_file(path), full_topology());
  {
    std::ofstream out(path);
    out << "{\"gpus\": [";
  }
  EXPECT_NE(user_error_of([&] { load_topology_file(path); }).find("is not valid JSON"),
            std::string::npos);
  std::remove(path);
  EXPECT_NE(user_error_of([&] { load_topology_file("/nonexistent/topology.json"); })
                .find("/nonexistent/topology.json"),
            std::string::npos);
}

}  // namespace
}  // namespace dstrain
