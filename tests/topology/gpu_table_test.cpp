#include "topology/gpu_table.h"

#include <gtest/gtest.h>

#include <set>

#include "test_util.h"

namespace dstrain {
namespace {

using testing::user_error_of;

TEST(GpuTable, Lookup_is_case_insensitive_and_tolerant) {
  const std::pair<const char*, const char*> cases[] = {
      {"4090", "rtx4090"},
      {"rtx4090", "rtx4090"},
      {"RTX 4090", "rtx4090"},
      {"rtx-4090", "rtx4090"},
      {"NVIDIA GeForce RTX 4090", "rtx4090"},
      {"3090", "rtx3090"},
      {"NVIDIA GeForce RTX 3090", "rtx3090"},
      {"5090", "rtx5090"},
      {"h100", "h100-sxm"},
      {"H100", "h100-sxm"},
      {"h100-sxm", "h100-sxm"},
      {"H100 SXM5", "h100-sxm"},
      {"NVIDIA H100 80GB HBM3", "h100-sxm"},
      {"h100-pcie", "h100-pcie"},
      {"NVIDIA H100 PCIe", "h100-pcie"},
      {"a100-80gb", "a100-80gb"},
      {"A100 80GB", "a100-80gb"},
      {"NVIDIA A100-SXM4-80GB", "a100-80gb"},
      {"NVIDIA A100 80GB PCIe", "a100-80gb"},
      {"a100-40gb", "a100-40gb"},
      {"NVIDIA A100-SXM4-40GB", "a100-40gb"},
      {"NVIDIA A100-PCIE-40GB", "a100-40gb"},
      {"h200", "h200"},
      {"NVIDIA H200", "h200"},
      {"L40S", "l40s"},
      {"NVIDIA L40S", "l40s"},
  };
  for (const auto& [name, key] : cases) EXPECT_EQ(lookup_gpu(name).key, key) << name;
}

TEST(GpuTable, Unknown_name_lists_the_known_names) {
  const std::string message = user_error_of([] { lookup_gpu("rtx9999"); });
  EXPECT_NE(message.find("unknown GPU 'rtx9999'"), std::string::npos) << message;
  for (const KnownGpu& gpu : known_gpus()) {
    EXPECT_NE(message.find(gpu.key), std::string::npos) << gpu.key << " missing from: " << message;
  }
  EXPECT_EQ(find_known_gpu("NVIDIA H100 NVL"), nullptr);
  EXPECT_EQ(find_known_gpu(""), nullptr);
  EXPECT_FALSE(user_error_of([] { lookup_gpu(""); }).empty());
}

TEST(GpuTable, A100_without_memory_is_ambiguous) {
  const std::string message = user_error_of([] { lookup_gpu("A100"); });
  EXPECT_NE(message.find("ambiguous"), std::string::npos) << message;
  EXPECT_NE(message.find("a100-80gb"), std::string::npos) << message;
  EXPECT_EQ(find_known_gpu("a100"), nullptr);
}

TEST(GpuTable, Normalize) {
  EXPECT_EQ(normalize_gpu_name("NVIDIA GeForce RTX 4090"), "rtx4090");
  EXPECT_EQ(normalize_gpu_name("a100-80gb"), "a10080gb");
  EXPECT_EQ(normalize_gpu_name("Tesla V100-SXM2-16GB"), "v100sxm216gb");
  EXPECT_EQ(normalize_gpu_name("NVIDIA"), "nvidia");  // a bare prefix stays
}

TEST(GpuTable, Entries_are_complete_and_aliases_unique) {
  std::set<std::string> keys, aliases;
  for (const KnownGpu& gpu : known_gpus()) {
    EXPECT_TRUE(keys.insert(gpu.key).second) << gpu.key;
    EXPECT_EQ(find_known_gpu(gpu.key), &gpu) << "the key itself must match: " << gpu.key;
    EXPECT_EQ(find_known_gpu(gpu.name), &gpu) << "the driver's name must match: " << gpu.name;
    for (const std::string& alias : gpu.aliases) {
      EXPECT_EQ(normalize_gpu_name(alias), alias) << "aliases are stored normalized";
      EXPECT_TRUE(aliases.insert(alias).second) << "alias " << alias << " used twice";
    }
    EXPECT_GE(gpu.memory_bytes, 24ull << 30) << gpu.key;
    EXPECT_GT(gpu.sm_count, 0) << gpu.key;
    EXPECT_GE(gpu.cc_major, 8) << gpu.key;
    EXPECT_GT(gpu.fp16_tflops, 50) << gpu.key;
    EXPECT_GT(gpu.bf16_tflops, 50) << gpu.key;
    EXPECT_GE(gpu.pcie_generation, 4) << gpu.key;
    EXPECT_EQ(gpu.pcie_lanes, 16) << gpu.key;
    EXPECT_EQ(gpu.nvlink_generation > 0, gpu.nvlinks_per_gpu > 0) << gpu.key;
    EXPECT_EQ(gpu.nvlink_generation > 0, gpu.nvlink_bytes_per_s > 0) << gpu.key;
    // GeForce parts: no peer access over PCIe; datacenter parts: yes.
    EXPECT_EQ(gpu.consumer, !gpu.pcie_peer_access) << gpu.key;
  }
  EXPECT_GE(known_gpus().size(), 9u);
}

TEST(GpuTable, Values_from_the_datasheets) {
  const KnownGpu& rtx4090 = lookup_gpu("4090");
  EXPECT_EQ(rtx4090.memory_bytes, 24ull << 30);
  EXPECT_EQ(rtx4090.sm_count, 128);
  EXPECT_EQ(rtx4090.cc_major * 10 + rtx4090.cc_minor, 89);
  EXPECT_DOUBLE_EQ(rtx4090.fp16_tflops, 165.2);  // half the FP16-accumulate rate
  EXPECT_EQ(rtx4090.nvlink_generation, 0);
  EXPECT_FALSE(rtx4090.pcie_peer_access);

  const KnownGpu& rtx3090 = lookup_gpu("3090");
  EXPECT_DOUBLE_EQ(rtx3090.fp16_tflops, 71);
  EXPECT_EQ(rtx3090.nvlinks_per_gpu * rtx3090.nvlink_bytes_per_s, 56.25e9);  // per direction

  const KnownGpu& h100 = lookup_gpu("h100");
  EXPECT_EQ(h100.sm_count, 132);
  EXPECT_DOUBLE_EQ(h100.bf16_tflops, 989.4);
  EXPECT_DOUBLE_EQ(h100.nvlinks_per_gpu * h100.nvlink_bytes_per_s, 450e9);
  EXPECT_EQ(lookup_gpu("h100-pcie").sm_count, 114);

  const KnownGpu& a100 = lookup_gpu("a100-40gb");
  EXPECT_DOUBLE_EQ(a100.nvlinks_per_gpu * a100.nvlink_bytes_per_s, 300e9);
  EXPECT_DOUBLE_EQ(a100.fp16_tflops, 312);
  EXPECT_EQ(lookup_gpu("h200").memory_bytes, 141ull << 30);
  EXPECT_EQ(lookup_gpu("5090").cc_major, 12);
  EXPECT_DOUBLE_EQ(lookup_gpu("l40s").fp16_tflops, 362.05);
}

TEST(GpuTable, Apply_gpu_model_fills_only_what_is_unknown) {
  NodeTopology t = make_topology(3);
  t.gpus[1].name = "custom name";
  t.gpus[1].memory_bytes = 123;
  t.links[0].kind = LinkKind::NVLink;  // pair 0-1
  t.links[0].nvlinks = 4;
  t.links[1].peer_access_known = true;  // pair 0-2, measured yes
  t.links[1].peer_access = true;
  apply_gpu_model(t, lookup_gpu("3090"));
  EXPECT_EQ(t.gpus[0].name, "NVIDIA GeForce RTX 3090");
  EXPECT_EQ(t.gpus[0].memory_bytes, 24ull << 30);
  EXPECT_EQ(t.gpus[0].sm_count, 82);
  EXPECT_EQ(t.gpus[0].cc_minor, 6);
  EXPECT_EQ(t.gpus[0].pcie_generation, 4);
  EXPECT_EQ(t.gpus[1].name, "custom name");
  EXPECT_EQ(t.gpus[1].memory_bytes, 123u);
  EXPECT_TRUE(t.link(0, 1).peer_access);  // NVLink
  EXPECT_TRUE(t.link(0, 2).peer_access);  // kept
  EXPECT_TRUE(t.link(1, 2).peer_access_known);
  EXPECT_FALSE(t.link(1, 2).peer_access);  // GeForce over PCIe
}

TEST(GpuTable, Infer_unknown_peer_access_from_names) {
  NodeTopology t = make_topology(4);
  t.gpus[0].name = t.gpus[1].name = "NVIDIA H100 80GB HBM3";
  t.gpus[2].name = "NVIDIA GeForce RTX 4090";
  t.gpus[3].name = "some future GPU";
  infer_unknown_peer_access(t);
  EXPECT_TRUE(t.link(0, 1).peer_access_known);
  EXPECT_TRUE(t.link(0, 1).peer_access);
  EXPECT_TRUE(t.link(0, 2).peer_access_known);
  EXPECT_FALSE(t.link(0, 2).peer_access);
  EXPECT_FALSE(t.link(0, 3).peer_access_known);
}

}  // namespace
}  // namespace dstrain
