#include "topology/probe.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "topology/units.h"

namespace dstrain {
namespace {

using testing::fixture_path;
using testing::user_error_of;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Probe, Without_driver_returns_zero_gpus_and_says_so) {
  ProbeOptions options;
  options.nvml_library = "libnvidia-ml-missing-for-test.so.1";
  options.use_cuda_runtime = false;
  std::string report;
  NodeTopology t;
  ASSERT_NO_THROW(t = probe_local_topology(options, &report));
  EXPECT_EQ(t.gpu_count(), 0);
  EXPECT_TRUE(t.links.empty());
  EXPECT_TRUE(contains(report, "no NVIDIA driver (libnvidia-ml-missing-for-test.so.1 not found)"))
      << report;
  EXPECT_TRUE(contains(report, "no CUDA device")) << report;
  EXPECT_TRUE(contains(report, "0 GPUs")) << report;
  EXPECT_EQ(t.classify().kind, TopologyKind::NoGpus);
  EXPECT_NO_THROW(probe_local_topology(options, nullptr));
}

TEST(Probe, This_machine_never_throws) {
  std::string report;
  NodeTopology t;
  ASSERT_NO_THROW(t = probe_local_topology(&report));
  EXPECT_FALSE(report.empty());
  t.check_invariants();
  EXPECT_TRUE(contains(report, std::to_string(t.gpu_count()) + (t.gpu_count() == 1 ? " GPU" : " GPUs")))
      << report;
  if (contains(report, "no NVIDIA driver") && contains(report, "no CUDA device")) {
    EXPECT_EQ(t.gpu_count(), 0) << report;
  }
  std::printf("probe report: %s\n", report.c_str());
}

TEST(Probe, Host_memory_and_numa_nodes_from_proc_and_sys) {
  ProbeOptions options;
  options.nvml_library = "libnvidia-ml-missing-for-test.so.1";
  options.use_cuda_runtime = false;
  options.meminfo_path = fixture_path("meminfo-256g.txt");
  options.sysfs_root = fixture_path("sysfs");
  std::string report;
  const NodeTopology t = probe_local_topology(options, &report);
  EXPECT_EQ(t.host_memory_bytes, 263856456ull * 1024);
  EXPECT_EQ(t.numa_nodes, 2);  // node0, node1; "possible" is not a node
  EXPECT_TRUE(contains(report, "host memory 251.63 GiB")) << report;
  EXPECT_TRUE(contains(report, "2 NUMA nodes")) << report;
}

TEST(Probe, Missing_proc_and_sys_files_are_unknown) {
  EXPECT_EQ(read_host_memory_bytes("/nonexistent/meminfo"), 0u);
  EXPECT_EQ(count_numa_nodes("/nonexistent"), 0);
  ProbeOptions options;
  options.nvml_library = "libnvidia-ml-missing-for-test.so.1";
  options.use_cuda_runtime = false;
  options.meminfo_path = "/nonexistent/meminfo";
  options.sysfs_root = "/nonexistent";
  std::string report;
  const NodeTopology t = probe_local_topology(options, &report);
  EXPECT_GT(t.host_memory_bytes, 0u) << "falls back to sysconf";
  EXPECT_EQ(t.numa_nodes, 0);
  EXPECT_TRUE(contains(report, "NUMA nodes unknown")) << report;
}

TEST(Probe, Normalize_pci_bus_id) {
  EXPECT_EQ(normalize_pci_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("0000:3b:00.0"), "0000:3b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("3B:00.0"), "0000:3b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("0001:c1:1f.7"), "0001:c1:1f.7");
  EXPECT_EQ(normalize_pci_bus_id(""), "");
  EXPECT_EQ(normalize_pci_bus_id("GPU-1234"), "");
  EXPECT_EQ(normalize_pci_bus_id("0000:3b:00"), "");
  EXPECT_EQ(normalize_pci_bus_id("0000:3b:20.0"), "");  // device > 31
}

TEST(Units, Parse_size_accepts_binary_units_in_any_spelling) {
  EXPECT_EQ(parse_size("256G"), 256ull << 30);
  EXPECT_EQ(parse_size("256GB"), 256ull << 30);
  EXPECT_EQ(parse_size("256GiB"), 256ull << 30);
  EXPECT_EQ(parse_size("256 gib"), 256ull << 30);
  EXPECT_EQ(parse_size("512M"), 512ull << 20);
  EXPECT_EQ(parse_size("512mb"), 512ull << 20);
  EXPECT_EQ(parse_size("1T"), 1ull << 40);
  EXPECT_EQ(parse_size("2k"), 2048u);
  EXPECT_EQ(parse_size("1P"), 1ull << 50);
  EXPECT_EQ(parse_size("1.5G"), 3ull << 29);
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("4096B"), 4096u);
  EXPECT_EQ(parse_size("  64G  "), 64ull << 30);
  EXPECT_EQ(parse_size("0"), 0u);
}

TEST(Units, Parse_size_rejects_junk_with_one_sentence) {
  for (const char* junk : {"", "   ", "abc", "12X", "-5G", "1.G", ".5G", "G", "1e3", "12 G B",
                           "5GiBs", "1,5G", "0x10"}) {
    const std::string message = user_error_of([&] { parse_size(junk); });
    EXPECT_NE(message.find("is not a size"), std::string::npos) << "'" << junk << "': " << message;
  }
  EXPECT_NE(user_error_of([] { parse_size("99999P"); }).find("too large"), std::string::npos);
  EXPECT_NE(user_error_of([] { parse_size("1.5"); }).find("whole number of bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace dstrain
