// The step records' expert load: for each mixture-of-experts layer,
// the fewest and the most token copies any expert ran over the step's micro-batches and every
// data-parallel rank, against the mean (what it ran spread evenly over the experts), and the
// copies an expert capacity dropped.
// A balanced router keeps max / mean near 1; a collapsed one sends most copies to a few experts.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "comm/communicator.h"
#include "model/expert_parallel.h"

namespace dstrain {

struct LayerLoad {
  int layer = 0;
  int64_t min = 0, max = 0;
  double mean = 0;
  int64_t dropped = 0;  // copies an expert capacity dropped (--moe-expert-capacity-factor)
};

// Every rank's `mine` summed over the world (only tp index 0's counted: tp ranks route the same
// tokens), as every rank gets it: [layer][expert] the copies each expert ran, then at [layer][E]
// the copies dropped; layers = the model's, experts = E. Collective.
using SummedExpertLoad = std::vector<std::vector<double>>;
SummedExpertLoad sum_expert_load(Communicator& world, const ExpertLoad& mine, bool counted,
                                 int layers, int64_t experts);
// The step records' view of it: the MoE layers' fewest, most and mean copies and the dropped.
std::vector<LayerLoad> layer_loads(const SummedExpertLoad& summed);

// DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias moves by
// rate x sign(mean - its load), the mean over the layer's experts (Megatron's
// get_updated_expert_bias); an expert at the mean keeps its bias. In float, as the fp32 master
// weights hold it.
void update_selection_bias(std::vector<float>& bias, const std::vector<double>& load, double rate);

// [{"layer": l, "min": ..., "max": ..., "mean": ..., "dropped": ...}, ...]
nlohmann::json expert_load_json(const std::vector<LayerLoad>& load);

}  // namespace dstrain
