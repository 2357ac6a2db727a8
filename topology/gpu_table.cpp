#include "topology/gpu_table.h"

#include <cctype>

#include "core/check.h"

namespace dstrain {

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr double kGBps = 1e9;

// Memory: the datasheet's "GB" of GPU memory is binary (an RTX 4090's 24 GB is 24 GiB of
// GDDR6X; an H100's 80 GB reads 81559 MiB in nvidia-smi, 79.6 GiB, after the driver's
// reservation). The table gives the nominal capacity; the planner keeps its own headroom,
// and a probe's measured total replaces it.
//
// Peak tensor rates are dense (no 2:4 sparsity) with FP32 accumulation, the mode a trainer
// uses. GeForce parts run FP32-accumulate at half their FP16-accumulate rate; datacenter
// parts at the full rate. FP32 rates are the CUDA cores' (non-tensor), from the same documents:
// GA102 whitepaper 35.6 (RTX 3090), Ada whitepaper 82.6 (RTX 4090), RTX Blackwell whitepaper
// 104.8 (RTX 5090), A100 datasheet 19.5, H100 datasheet 67 (SXM) and 51 (PCIe), H200
// datasheet 67, L40S datasheet 91.6. dstrain's fp32 GEMMs (no TF32) and fp32 attention run there.
//
// Compute capabilities: CUDA C++ Programming Guide, "Compute Capabilities" table
// (8.0 A100, 8.6 GA10x, 8.9 Ada, 9.0 Hopper, 12.0 GeForce Blackwell).
//
// PCIe peer access: the stock driver disables peer-to-peer over PCIe on GeForce parts;
// `nvidia-smi topo -p2p rw` prints GNS ("GPU not supported") for a pair of RTX 5090s
// (noonghunna/club-3090 issue 1229), and RTX 4090 pairs report no peer access
// (NVIDIA/nccl-tests issue 117, NVIDIA/nccl issue 1127); it only appears with patched
// kernel modules (tinygrad/open-gpu-kernel-modules). RTX 3090s reach each other over an
// NVLink bridge (huggingface/accelerate issue 2328); over PCIe it depends on the driver
// version (NVIDIA/nccl issue 1127), so the table says no. Datacenter parts allow it, even
// across sockets (an L4 pair on a SYS path, NVIDIA/cuda-samples issue 284).
std::vector<KnownGpu> make_table() {
  std::vector<KnownGpu> table;
  {
    KnownGpu g;
    g.key = "rtx3090";
    g.name = "NVIDIA GeForce RTX 3090";
    g.aliases = {"rtx3090", "3090"};
    // NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix A (GeForce RTX 3090):
    // 82 SMs, 24 GB GDDR6X, peak FP16 and BF16 tensor TFLOPS with FP32 accumulate 71/142
    // (dense/sparse).
    g.memory_bytes = 24 * kGiB;
    g.sm_count = 82;
    g.cc_major = 8, g.cc_minor = 6;
    g.fp16_tflops = 71;
    g.bf16_tflops = 71;
    g.fp32_tflops = 35.6;
    // Same whitepaper, "Third-Generation NVLink": four x4 links, each 14.0625 GB/s in each
    // direction (56.25 GB/s per direction over the bridge; nvidia-smi shows NV4).
    g.nvlink_generation = 3;
    g.nvlinks_per_gpu = 4;
    g.nvlink_bytes_per_s = 14.0625 * kGBps;
    g.pcie_generation = 4;  // same whitepaper, "PCIe Gen 4"
    g.pcie_peer_access = false;
    g.consumer = true;
    table.push_back(g);
  }
  {
    KnownGpu g;
    g.key = "rtx4090";
    g.name = "NVIDIA GeForce RTX 4090";
    g.aliases = {"rtx4090", "4090"};
    // NVIDIA Ada GPU Architecture whitepaper v2.01, Appendix A (GeForce RTX 4090): 128 SMs,
    // 24 GB GDDR6X, peak FP16 and BF16 tensor TFLOPS with FP32 accumulate 165.2/330.4
    // (dense/sparse; FP16 accumulate is 330.3). No NVLink; PCIe Gen 4.
    g.memory_bytes = 24 * kGiB;
    g.sm_count = 128;
    g.cc_major = 8, g.cc_minor = 9;
    g.fp16_tflops = 165.2;
    g.bf16_tflops = 165.2;
    // The same whitepaper: peak FP8 tensor TFLOPS with FP32 accumulate 330.3/660.6.
    g.fp8_tflops = 330.3;
    g.fp32_tflops = 82.6;
    g.pcie_generation = 4;
    g.pcie_peer_access = false;
    g.consumer = true;
    table.push_back(g);
  }
  {
    KnownGpu g;
    g.key = "rtx5090";
    g.name = "NVIDIA GeForce RTX 5090";
    g.aliases = {"rtx5090", "5090"};
    // NVIDIA RTX Blackwell GPU Architecture whitepaper, Appendix A (GeForce RTX 5090):
    // 170 SMs, 32 GB GDDR7, peak FP16 and BF16 tensor TFLOPS with FP32 accumulate 209.5/419
    // (dense/sparse; FP16 accumulate 419/838). The same 209.5 is the spec column of
    // main-horse.github.io/posts/5090-mm-perf, which also shows deviceQuery's compute
    // capability 12.0 and torch.matmul bf16 reaching ~224 TFLOP/s. No NVLink; PCIe Gen 5.
    g.memory_bytes = 32 * kGiB;
    g.sm_count = 170;
    g.cc_major = 12, g.cc_minor = 0;
    g.fp16_tflops = 209.5;
    g.bf16_tflops = 209.5;
    // FP8 with FP32 accumulate: twice BF16's, as on every GPU with FP8 tensor cores.
    g.fp8_tflops = 419;
    g.fp32_tflops = 104.8;
    g.pcie_generation = 5;
    g.pcie_peer_access = false;
    g.consumer = true;
    table.push_back(g);
  }
  // NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4):
  // FP16 and BF16 tensor 312 TFLOPS dense (624 sparse), NVLink 600 GB/s, PCIe Gen4 64 GB/s;
  // A100 40GB: HBM2, A100 80GB: HBM2e. NVIDIA A100 Tensor Core GPU Architecture whitepaper:
  // 108 SMs; 12 third-generation NVLinks, 25 GB/s per link per direction (600 GB/s total).
  {
    KnownGpu g;
    g.key = "a100-40gb";
    g.name = "NVIDIA A100-SXM4-40GB";
    g.aliases = {"a10040gb", "a100sxm440gb", "a100sxm40gb", "a100pcie40gb", "a10040gbpcie"};
    g.memory_bytes = 40 * kGiB;
    g.sm_count = 108;
    g.cc_major = 8, g.cc_minor = 0;
    g.fp16_tflops = 312;
    g.bf16_tflops = 312;
    g.fp32_tflops = 19.5;
    g.nvlink_generation = 3;
    g.nvlinks_per_gpu = 12;
    g.nvlink_bytes_per_s = 25 * kGBps;
    g.pcie_generation = 4;
    g.pcie_peer_access = true;
    table.push_back(g);
  }
  {
    KnownGpu g;
    g.key = "a100-80gb";
    g.name = "NVIDIA A100-SXM4-80GB";
    g.aliases = {"a10080gb", "a100sxm480gb", "a100sxm80gb", "a100pcie80gb", "a10080gbpcie"};
    g.memory_bytes = 80 * kGiB;
    g.sm_count = 108;
    g.cc_major = 8, g.cc_minor = 0;
    g.fp16_tflops = 312;
    g.bf16_tflops = 312;
    g.fp32_tflops = 19.5;
    g.nvlink_generation = 3;
    g.nvlinks_per_gpu = 12;
    g.nvlink_bytes_per_s = 25 * kGBps;
    g.pcie_generation = 4;
    g.pcie_peer_access = true;
    table.push_back(g);
  }
  // NVIDIA H100 Tensor Core GPU datasheet: H100 SXM FP16/BF16 tensor 1,979 TFLOPS and H100
  // PCIe 1,513 TFLOPS, both "with sparsity" (dense is half: 989.4 and 756.5, as in the NVIDIA
  // H100 Tensor Core GPU Architecture whitepaper); 80 GB; NVLink 900 GB/s (SXM) and 600 GB/s
  // (PCIe, over NVLink bridges); PCIe Gen5 128 GB/s. Hopper whitepaper: 132 SMs (SXM5),
  // 114 SMs (PCIe); 18 fourth-generation NVLinks, 25 GB/s per link per direction.
  {
    KnownGpu g;
    g.key = "h100-sxm";
    g.name = "NVIDIA H100 80GB HBM3";
    g.aliases = {"h100", "h100sxm", "h100sxm5", "h10080gb", "h10080gbhbm3", "h100sxm80gb",
                 "h100sxm580gb"};
    g.memory_bytes = 80 * kGiB;
    g.sm_count = 132;
    g.cc_major = 9, g.cc_minor = 0;
    g.fp16_tflops = 989.4;
    g.bf16_tflops = 989.4;
    // H100 datasheet: FP8 tensor core 3,958 TFLOPS with sparsity: 1978.9 dense.
    g.fp8_tflops = 1978.9;
    g.fp32_tflops = 67;
    g.nvlink_generation = 4;
    g.nvlinks_per_gpu = 18;
    g.nvlink_bytes_per_s = 25 * kGBps;
    g.pcie_generation = 5;
    g.pcie_peer_access = true;
    table.push_back(g);
  }
  {
    KnownGpu g;
    g.key = "h100-pcie";
    g.name = "NVIDIA H100 PCIe";
    g.aliases = {"h100pcie", "h10080gbpcie", "h100pcie80gb"};
    g.memory_bytes = 80 * kGiB;
    g.sm_count = 114;
    g.cc_major = 9, g.cc_minor = 0;
    g.fp16_tflops = 756.5;
    g.bf16_tflops = 756.5;
    g.fp8_tflops = 1513;  // H100 datasheet (PCIe): 3,026 with sparsity
    g.fp32_tflops = 51;
    g.nvlink_generation = 4;
    g.nvlinks_per_gpu = 12;  // 600 GB/s total = 12 links x 25 GB/s x 2 directions
    g.nvlink_bytes_per_s = 25 * kGBps;
    g.pcie_generation = 5;
    g.pcie_peer_access = true;
    table.push_back(g);
  }
  {
    KnownGpu g;
    g.key = "h200";
    g.name = "NVIDIA H200";
    g.aliases = {"h200", "h200sxm", "h200sxm5", "h200141gb", "h200sxm141gb"};
    // NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 141 GB HBM3e, FP16/BF16 tensor
    // 1,979 TFLOPS with sparsity (989.4 dense: the H100 SXM5's GH100 configuration, 132
    // SMs), NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    g.memory_bytes = 141 * kGiB;
    g.sm_count = 132;
    g.cc_major = 9, g.cc_minor = 0;
    g.fp16_tflops = 989.4;
    g.bf16_tflops = 989.4;
    g.fp8_tflops = 1978.9;  // H200 datasheet: 3,958 with sparsity
    g.fp32_tflops = 67;
    g.nvlink_generation = 4;
    g.nvlinks_per_gpu = 18;
    g.nvlink_bytes_per_s = 25 * kGBps;
    g.pcie_generation = 5;
    g.pcie_peer_access = true;
    table.push_back(g);
  }
  {
    KnownGpu g;
    g.key = "l40s";
    g.name = "NVIDIA L40S";
    g.aliases = {"l40s", "l40s48gb"};
    // NVIDIA L40S datasheet: 48 GB GDDR6, FP16 and BF16 tensor 362.05 TFLOPS dense (733 with
    // sparsity), PCIe Gen4 x16 64 GB/s bidirectional, no NVLink; 142 third-generation RT
    // cores and 568 tensor cores = 142 SMs (one RT core, four tensor cores per Ada SM). The
    // same datasheet lists 181.05 for the L40: the L40S runs FP32 accumulate at full rate
    // (spec databases such as hmc-tech.com list ~366 TFLOPS "FP32 Accumulate" for it).
    g.memory_bytes = 48 * kGiB;
    g.sm_count = 142;
    g.cc_major = 8, g.cc_minor = 9;
    g.fp16_tflops = 362.05;
    g.bf16_tflops = 362.05;
    g.fp8_tflops = 733;  // L40S datasheet: 733 / 1,466 (sparse)
    g.fp32_tflops = 91.6;
    g.pcie_generation = 4;
    g.pcie_peer_access = true;
    table.push_back(g);
  }
  return table;
}

// Normalized names that match more than one entry: the user must say which.
struct Ambiguous {
  const char* alias;
  const char* choices;
};
constexpr Ambiguous kAmbiguous[] = {
    {"a100", "a100-40gb or a100-80gb"},
    {"a100sxm4", "a100-40gb or a100-80gb"},
    {"a100pcie", "a100-40gb or a100-80gb"},
};

}  // namespace

const std::vector<KnownGpu>& known_gpus() {
  static const std::vector<KnownGpu> table = make_table();
  return table;
}

std::string known_gpu_names() {
  std::string names;
  for (const KnownGpu& gpu : known_gpus()) {
    if (!names.empty()) names += ", ";
    names += gpu.key;
  }
  return names;
}

std::string normalize_gpu_name(std::string_view name) {
  std::string text;
  for (char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      text += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
  }
  for (bool stripped = true; stripped;) {
    stripped = false;
    for (std::string_view prefix : {"nvidia", "geforce", "tesla"}) {
      if (text.size() > prefix.size() && text.compare(0, prefix.size(), prefix) == 0) {
        text.erase(0, prefix.size());
        stripped = true;
      }
    }
  }
  return text;
}

const KnownGpu* find_known_gpu(std::string_view name) {
  const std::string normalized = normalize_gpu_name(name);
  if (normalized.empty()) return nullptr;
  for (const KnownGpu& gpu : known_gpus()) {
    for (const std::string& alias : gpu.aliases) {
      if (alias == normalized) return &gpu;
    }
  }
  return nullptr;
}

const KnownGpu& lookup_gpu(std::string_view name) {
  if (const KnownGpu* gpu = find_known_gpu(name)) return *gpu;
  const std::string normalized = normalize_gpu_name(name);
  for (const Ambiguous& a : kAmbiguous) {
    if (normalized == a.alias) {
      DSTRAIN_USER_ERROR() << "GPU name '" << name << "' is ambiguous: say " << a.choices << ".";
    }
  }
  DSTRAIN_USER_ERROR() << "unknown GPU '" << name << "'; known GPUs: " << known_gpu_names()
                       << ".";
}

void apply_gpu_model(NodeTopology& topology, const KnownGpu& model) {
  for (GpuInfo& gpu : topology.gpus) {
    if (gpu.name.empty()) gpu.name = model.name;
    if (gpu.memory_bytes == 0) gpu.memory_bytes = model.memory_bytes;
    if (gpu.sm_count == 0) gpu.sm_count = model.sm_count;
    if (gpu.cc_major == 0) {
      gpu.cc_major = model.cc_major;
      gpu.cc_minor = model.cc_minor;
    }
    if (gpu.pcie_generation == 0) gpu.pcie_generation = model.pcie_generation;
    if (gpu.pcie_lanes == 0) gpu.pcie_lanes = model.pcie_lanes;
  }
  for (Link& link : topology.links) {
    if (link.peer_access_known) continue;
    link.peer_access = link.kind == LinkKind::NVLink || model.pcie_peer_access;
    link.peer_access_known = true;
  }
}

void infer_unknown_peer_access(NodeTopology& topology) {
  for (Link& link : topology.links) {
    if (link.peer_access_known) continue;
    if (link.kind == LinkKind::NVLink) {
      link.peer_access = true;
      link.peer_access_known = true;
      continue;
    }
    const KnownGpu* a = find_known_gpu(topology.gpus[static_cast<size_t>(link.a)].name);
    const KnownGpu* b = find_known_gpu(topology.gpus[static_cast<size_t>(link.b)].name);
    if (a == nullptr || b == nullptr) continue;
    // Different models: peer access needs both to allow it, and even then it is not certain.
    if (a != b && !(a->pcie_peer_access && b->pcie_peer_access)) {
      link.peer_access = false;
      link.peer_access_known = true;
    } else if (a == b) {
      link.peer_access = a->pcie_peer_access;
      link.peer_access_known = true;
    }
  }
}

}  // namespace dstrain
