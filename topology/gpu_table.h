// The GPUs dstrain knows by name: capacity, compute, and how they connect.
//
// Used when a source does not say (the text of `nvidia-smi topo -m` names no GPU model; a
// user plans for a machine they are not on: `--gpu 4090`). A probe's measured values always
// win over this table: it only fills what is unknown.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "topology/topology.h"

namespace dstrain {

struct KnownGpu {
  std::string key;                   // "rtx4090": the name error messages list
  std::string name;                  // "NVIDIA GeForce RTX 4090": as the driver reports it
  std::vector<std::string> aliases;  // normalized (see normalize_gpu_name) names that match
  uint64_t memory_bytes = 0;         // datasheet capacity, its "GB" read as GiB (see .cpp)
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  double fp16_tflops = 0;            // peak dense FP16 tensor TFLOP/s, FP32 accumulate
  double bf16_tflops = 0;            // peak dense BF16 tensor TFLOP/s, FP32 accumulate
  double fp8_tflops = 0;             // peak dense FP8 tensor TFLOP/s, FP32 accumulate (0: none)
  double fp32_tflops = 0;            // peak FP32 TFLOP/s on the CUDA cores (non-tensor)
  int nvlink_generation = 0;         // 0: no NVLink
  int nvlinks_per_gpu = 0;           // NVLinks a GPU has (bridge or NVSwitch)
  double nvlink_bytes_per_s = 0;     // one NVLink, one direction
  int pcie_generation = 0;
  int pcie_lanes = 16;
  bool pcie_peer_access = false;     // peer access over PCIe with the stock driver
  bool consumer = false;             // a GeForce part
};

// Every known GPU, in a fixed order.
const std::vector<KnownGpu>& known_gpus();
// "rtx3090, rtx4090, ...": the keys, for messages.
std::string known_gpu_names();

// Lower case, letters and digits only, leading "nvidia", "geforce", "tesla" removed:
// "NVIDIA GeForce RTX 4090" -> "rtx4090", "a100-80gb" -> "a10080gb".
std::string normalize_gpu_name(std::string_view name);

// A user-given name, case-insensitive and tolerant of spacing, dashes and vendor prefixes:
// "4090", "rtx4090", "NVIDIA GeForce RTX 4090", "h100", "h100-sxm", "a100-80gb".
// Throws UserError (listing the known names) when the name matches no GPU or more than one.
const KnownGpu& lookup_gpu(std::string_view name);
// The same match without throwing: nullptr when unknown or ambiguous. For names reported by
// a driver ("NVIDIA A100-SXM4-80GB").
const KnownGpu* find_known_gpu(std::string_view name);

// `--gpu NAME`: fills from `model` what the source left unknown (name, memory, SMs, compute
// capability, PCIe generation and width) on every GPU, and the peer access of every link
// whose peer access is unknown (NVLink pairs: yes; PCIe pairs: model.pcie_peer_access).
// Known values are kept.
void apply_gpu_model(NodeTopology& topology, const KnownGpu& model);

// Fills unknown peer access from the GPUs' own names where both are in the table (NVLink
// pairs: yes; PCIe pairs: both parts allow it). Leaves the rest unknown.
void infer_unknown_peer_access(NodeTopology& topology);

}  // namespace dstrain
