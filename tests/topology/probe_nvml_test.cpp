// The probe against fake NVML machines: NVLink counting (direct links and NVSwitch links),
// PCIe paths from the common ancestor, peer access from the P2P status, older drivers that
// lack entry points, and an NVML that does not start. No driver or GPU needed.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"
#include "topology/nvml_api.h"
#include "topology/probe.h"

namespace dstrain {
namespace {

using testing::fixture_path;

constexpr int kRemoteTypeFails = -1;

struct FakeLink {
  int remote_type;         // nvml::kNvlinkDeviceType*, or kRemoteTypeFails
  std::string remote_bus;  // as NVML prints it: "00000000:3B:00.0"
};

struct FakeGpu {
  std::string name;
  std::string bus;  // as NVML prints it
  unsigned long long memory = 0;
  int cc_major = 0, cc_minor = 0;
  int numa = -1;  // -1: nvmlDeviceGetNumaNodeId not supported
  unsigned int pcie_generation = 4, pcie_width = 16;
  bool has_nvlink = true;
  std::vector<FakeLink> links;  // the active links
};

struct FakeMachine {
  std::vector<FakeGpu> gpus;
  std::vector<std::vector<int>> ancestor;  // nvmlGpuTopologyLevel_t per pair
  std::vector<std::vector<int>> p2p_read;  // nvmlGpuP2PStatus_t per pair
  nvml::Return init_result = nvml::kSuccess;
  int inits = 0, shutdowns = 0;
};

FakeMachine* machine = nullptr;

FakeGpu& gpu_of(nvml::Device device) { return *reinterpret_cast<FakeGpu*>(device); }
size_t index_of(nvml::Device device) {
  return static_cast<size_t>(&gpu_of(device) - machine->gpus.data());
}

void copy_text(char* out, unsigned int size, const std::string& text) {
  std::strncpy(out, text.c_str(), size - 1);
  out[size - 1] = '\0';
}

nvml::Api fake_api() {
  nvml::Api api{};
  api.init = [] {
    ++machine->inits;
    return machine->init_result;
  };
  api.shutdown = [] {
    ++machine->shutdowns;
    return nvml::kSuccess;
  };
  api.error_string = [](nvml::Return r) -> const char* {
    return r == nvml::kErrorDriverNotLoaded ? "Driver Not Loaded" : "Unknown Error";
  };
  api.driver_version = [](char* out, unsigned int size) {
    copy_text(out, size, "550.54.15");
    return nvml::kSuccess;
  };
  api.device_count = [](unsigned int* count) {
    *count = static_cast<unsigned int>(machine->gpus.size());
    return nvml::kSuccess;
  };
  api.handle_by_index = [](unsigned int i, nvml::Device* device) {
    *device = reinterpret_cast<nvml::Device>(&machine->gpus.at(i));
    return nvml::kSuccess;
  };
  api.name = [](nvml::Device d, char* out, unsigned int size) {
    copy_text(out, size, gpu_of(d).name);
    return nvml::kSuccess;
  };
  api.memory_info = [](nvml::Device d, nvml::Memory* memory) {
    memory->total = gpu_of(d).memory;
    return nvml::kSuccess;
  };
  api.pci_info = [](nvml::Device d, nvml::PciInfo* pci) {
    copy_text(pci->bus_id, sizeof(pci->bus_id), gpu_of(d).bus);
    return nvml::kSuccess;
  };
  api.compute_capability = [](nvml::Device d, int* major, int* minor) {
    *major = gpu_of(d).cc_major;
    *minor = gpu_of(d).cc_minor;
    return nvml::kSuccess;
  };
  api.numa_node_id = [](nvml::Device d, unsigned int* node) {
    if (gpu_of(d).numa < 0) return nvml::kErrorNotSupported;
    *node = static_cast<unsigned int>(gpu_of(d).numa);
    return nvml::kSuccess;
  };
  api.max_pcie_generation = [](nvml::Device d, unsigned int* value) {
    *value = gpu_of(d).pcie_generation;
    return nvml::kSuccess;
  };
  api.max_pcie_width = [](nvml::Device d, unsigned int* value) {
    *value = gpu_of(d).pcie_width;
    return nvml::kSuccess;
  };
  api.nvlink_state = [](nvml::Device d, unsigned int link, int* active) {
    if (!gpu_of(d).has_nvlink) return nvml::kErrorNotSupported;
    *active = link < gpu_of(d).links.size() ? nvml::kFeatureEnabled : 0;
    return nvml::kSuccess;
  };
  api.nvlink_remote_pci = [](nvml::Device d, unsigned int link, nvml::PciInfo* pci) {
    copy_text(pci->bus_id, sizeof(pci->bus_id), gpu_of(d).links.at(link).remote_bus);
    return nvml::kSuccess;
  };
  api.nvlink_remote_type = [](nvml::Device d, unsigned int link, int* type) {
    const int t = gpu_of(d).links.at(link).remote_type;
    if (t == kRemoteTypeFails) return nvml::kErrorNotSupported;
    *type = t;
    return nvml::kSuccess;
  };
  api.common_ancestor = [](nvml::Device a, nvml::Device b, int* level) {
    *level = machine->ancestor.at(index_of(a)).at(index_of(b));
    return nvml::kSuccess;
  };
  api.p2p_status = [](nvml::Device a, nvml::Device b, int caps, int* status) {
    EXPECT_EQ(caps, nvml::kP2pCapsIndexRead);
    *status = machine->p2p_read.at(index_of(a)).at(index_of(b));
    return nvml::kSuccess;
  };
  return api;
}

std::string nvml_bus(int bus) {
  char text[32];
  std::snprintf(text, sizeof(text), "00000000:%02X:00.0", bus);
  return text;
}

// `n` GPUs with the same name; ancestor and P2P matrices filled by `level(a, b)`, `p2p(a, b)`.
FakeMachine make_machine(int n, const std::string& name, int (*level)(int, int),
                         int (*p2p)(int, int)) {
  FakeMachine m;
  const int buses[] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};
  for (int i = 0; i < n; ++i) {
    FakeGpu g;
    g.name = name;
    g.bus = nvml_bus(buses[i]);
    m.gpus.push_back(g);
  }
  m.ancestor.assign(n, std::vector<int>(n, 0));
  m.p2p_read.assign(n, std::vector<int>(n, 0));
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      m.ancestor[a][b] = level(a, b);
      m.p2p_read[a][b] = p2p(a, b);
    }
  }
  return m;
}

NodeTopology probe_fake(FakeMachine& m, const nvml::Api& api, std::string* report) {
  machine = &m;
  ProbeOptions options;
  options.nvml_api = &api;
  options.use_cuda_runtime = false;  // a CUDA build on a GPU machine must not mix in real GPUs
  options.sysfs_root = fixture_path("sysfs");
  options.meminfo_path = fixture_path("meminfo-256g.txt");
  NodeTopology t = probe_local_topology(options, report);
  machine = nullptr;
  return t;
}

int socket_of(int gpu) { return gpu < 4 ? 0 : 1; }

TEST(ProbeNvml, Hgx_h100_nvswitch_counts_switch_links_as_nv18) {
  FakeMachine m = make_machine(
      8, "NVIDIA H100 80GB HBM3",
      [](int a, int b) { return socket_of(a) == socket_of(b) ? nvml::kTopologyNode : nvml::kTopologySystem; },
      [](int, int) { return nvml::kP2pStatusOk; });
  for (size_t i = 0; i < m.gpus.size(); ++i) {
    FakeGpu& g = m.gpus[i];
    g.memory = 85520809984ull;  // 81559 MiB
    g.cc_major = 9;
    g.numa = socket_of(static_cast<int>(i));
    g.pcie_generation = 5;
    for (int l = 0; l < 18; ++l) g.links.push_back({nvml::kNvlinkDeviceTypeSwitch, nvml_bus(0xc1 + l % 4)});
  }
  const nvml::Api api = fake_api();
  std::string report;
  const NodeTopology t = probe_fake(m, api, &report);
  ASSERT_EQ(t.gpu_count(), 8);
  EXPECT_EQ(m.inits, 1);
  EXPECT_EQ(m.shutdowns, 1);
  EXPECT_NE(report.find("NVML: driver 550.54.15, 8 GPUs"), std::string::npos) << report;
  EXPECT_EQ(t.source, "probe (NVML)");
  EXPECT_EQ(t.gpus[0].name, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(t.gpus[0].memory_bytes, 85520809984ull);
  EXPECT_EQ(t.gpus[0].sm_count, 132);  // NVML has no SM count: from the table
  EXPECT_EQ(t.gpus[0].cc_major, 9);
  EXPECT_EQ(t.gpus[1].pci_bus_id, "0000:2a:00.0");
  EXPECT_EQ(t.gpus[5].numa_node, 1);
  EXPECT_EQ(t.gpus[5].pcie_generation, 5);
  for (const Link& l : t.links) {
    EXPECT_EQ(l.kind, LinkKind::NVLink);
    EXPECT_EQ(l.nvlinks, 18);
    EXPECT_TRUE(l.path_known);
    EXPECT_EQ(l.path, socket_of(l.a) == socket_of(l.b) ? PciePath::NODE : PciePath::SYS);
    EXPECT_TRUE(l.peer_access);
  }
  EXPECT_EQ(t.classify().label(), "nvlink-island+numa-split");
  EXPECT_EQ(t.host_memory_bytes, 263856456ull * 1024);
}

TEST(ProbeNvml, Older_driver_without_remote_type_takes_unknown_remotes_for_nvswitch) {
  FakeMachine m = make_machine(4, "NVIDIA A100-SXM4-80GB",
                               [](int, int) { return nvml::kTopologyMultiple; },
                               [](int, int) { return nvml::kP2pStatusOk; });
  for (FakeGpu& g : m.gpus) {
    for (int l = 0; l < 12; ++l) g.links.push_back({kRemoteTypeFails, nvml_bus(0xe0 + l % 6)});
  }
  m.gpus[3].bus = nvml_bus(0x07);  // NVML gives no NUMA node: read from sysfs (fixture: 1)
  nvml::Api api = fake_api();
  api.numa_node_id = nullptr;  // a driver before nvmlDeviceGetNumaNodeId
  const NodeTopology t = probe_fake(m, api, nullptr);
  ASSERT_EQ(t.gpu_count(), 4);
  for (const Link& l : t.links) {
    EXPECT_EQ(l.nvlinks, 12);
    EXPECT_EQ(l.path, PciePath::PXB);
  }
  EXPECT_EQ(t.gpus[3].numa_node, 1);
  EXPECT_EQ(t.gpus[0].numa_node, -1);
  EXPECT_EQ(t.gpus[0].sm_count, 108);
}

TEST(ProbeNvml, Rtx3090_bridged_pairs_count_direct_links) {
  FakeMachine m = make_machine(
      4, "NVIDIA GeForce RTX 3090", [](int, int) { return nvml::kTopologyHostBridge; },
      [](int a, int b) { return a / 2 == b / 2 ? nvml::kP2pStatusOk : nvml::kP2pStatusGpuNotSupported; });
  for (int i = 0; i < 4; ++i) {
    const int partner = i ^ 1;
    for (int l = 0; l < 4; ++l) m.gpus[i].links.push_back({nvml::kNvlinkDeviceTypeGpu, m.gpus[partner].bus});
    m.gpus[i].numa = 0;
  }
  const nvml::Api api = fake_api();
  const NodeTopology t = probe_fake(m, api, nullptr);
  EXPECT_EQ(t.link(0, 1).nvlinks, 4);
  EXPECT_EQ(t.link(2, 3).nvlinks, 4);
  EXPECT_EQ(t.link(0, 2).kind, LinkKind::PCIe);
  EXPECT_EQ(t.link(0, 2).path, PciePath::PHB);
  EXPECT_TRUE(t.link(0, 2).peer_access_known);
  EXPECT_FALSE(t.link(0, 2).peer_access);  // GNS
  EXPECT_EQ(t.classify().label(), "nvlink-pairs+no-peer");
}

TEST(ProbeNvml, Rtx4090_box_without_nvlink_or_p2p_status_uses_the_table) {
  FakeMachine m = make_machine(
      8, "NVIDIA GeForce RTX 4090",
      [](int a, int b) { return socket_of(a) == socket_of(b) ? nvml::kTopologySingle : nvml::kTopologySystem; },
      [](int, int) { return nvml::kP2pStatusOk; });
  for (size_t i = 0; i < m.gpus.size(); ++i) {
    m.gpus[i].has_nvlink = false;
    m.gpus[i].numa = socket_of(static_cast<int>(i));
  }
  nvml::Api api = fake_api();
  api.p2p_status = nullptr;
  const NodeTopology t = probe_fake(m, api, nullptr);
  EXPECT_EQ(t.link(0, 1).path, PciePath::PIX);
  EXPECT_EQ(t.link(3, 4).path, PciePath::SYS);
  EXPECT_TRUE(t.link(0, 1).peer_access_known);
  EXPECT_FALSE(t.link(0, 1).peer_access);  // GeForce, from the table
  EXPECT_EQ(t.classify().label(), "pcie+no-peer+numa-split");
}

TEST(ProbeNvml, Nvml_that_does_not_start_gives_zero_gpus) {
  FakeMachine m = make_machine(2, "NVIDIA H200", [](int, int) { return 0; }, [](int, int) { return 0; });
  m.init_result = nvml::kErrorDriverNotLoaded;
  const nvml::Api api = fake_api();
  std::string report;
  const NodeTopology t = probe_fake(m, api, &report);
  EXPECT_EQ(t.gpu_count(), 0);
  EXPECT_NE(report.find("NVML did not start (nvmlInit: Driver Not Loaded)"), std::string::npos)
      << report;
  EXPECT_EQ(m.shutdowns, 0);
}

TEST(ProbeNvml, Missing_required_entry_point) {
  FakeMachine m = make_machine(1, "NVIDIA H200", [](int, int) { return 0; }, [](int, int) { return 0; });
  nvml::Api api = fake_api();
  api.device_count = nullptr;
  std::string report;
  EXPECT_EQ(probe_fake(m, api, &report).gpu_count(), 0);
  EXPECT_NE(report.find("driver too old"), std::string::npos) << report;
  EXPECT_EQ(m.inits, 0);
}

}  // namespace
}  // namespace dstrain
