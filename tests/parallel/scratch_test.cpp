#include <gtest/gtest.h>
#include <iostream>
#include <sstream>
#include "parallel/machine.h"
#include "parallel/planner.h"
#include "model/config.h"
namespace dstrain {
void show(const char* fixture, const char* gpu, const char* host, const char* model, int gpus = 0) {
  MachineSource s;
  s.nvidia_smi_file = std::string(DSTRAIN_SOURCE_DIR) + "/tests/topology/fixtures/" + fixture;
  s.gpu = gpu; s.host_memory = host;
  std::istringstream in;
  NodeTopology t = load_machine(s, in, nullptr);
  PlanRequest q; q.gpus = gpus;
  ModelConfig c = load_model_config(model);
  try {
    PlanResult r = choose_plan(c, t, q);
    std::cout << "=== " << fixture << " " << model << " cands " << r.candidates << "\n  BEST " << describe(r.best.plan)
              << " mem " << format_bytes(r.best.memory.device_total()) << " host " << format_bytes(r.best.host_bytes) << " step " << r.best.cost.step_seconds
              << " tok/s " << r.best.cost.tokens_per_second << " comp " << r.best.cost.compute_seconds << " bub " << r.best.cost.bubble_seconds
              << " dp " << r.best.cost.dp_comm_seconds << " tp " << r.best.cost.tp_comm_seconds << " pp " << r.best.cost.pp_comm_seconds << " off " << r.best.cost.offload_seconds << " opt " << r.best.cost.optimizer_seconds << " eff " << r.best.cost.efficiency << "\n";
    for (auto& a : r.alternatives) std::cout << "    " << describe(a.plan) << " | " << format_bytes(a.memory.device_total()) << " | " << a.cost.step_seconds << " | " << a.verdict << "\n";
    for (auto& e : r.excluded) std::cout << "    X " << e << "\n";
  } catch (const UserError& e) { std::cout << "=== " << fixture << " " << model << " ERROR " << e.what() << "\n"; }
}
TEST(Scratch, Show) {
  show("rtx4090-8gpu-pcie.txt", "rtx4090", "256G", "gpt2-124m");
  show("rtx4090-8gpu-pcie.txt", "rtx4090", "256G", "gpt2-1.5b");
  show("rtx4090-8gpu-pcie.txt", "rtx4090", "256G", "6b");
  show("rtx4090-8gpu-pcie.txt", "rtx4090", "256G", "13b");
  show("h100-8gpu-nvswitch.txt", "h100-sxm", "2T", "6b");
  show("h100-8gpu-nvswitch.txt", "h100-sxm", "2T", "13b");
  show("rtx3090-4gpu-nvlink-pairs.txt", "rtx3090", "128G", "gpt2-1.5b");
  show("rtx3090-4gpu-nvlink-pairs.txt", "rtx3090", "128G", "6b");
  show("rtx4090-2gpu-ansi.txt", "rtx4090", "128G", "6b");
  show("rtx4090-2gpu-ansi.txt", "rtx4090", "64G", "13b");
}
}
