// The step records' expert load (issue: MoE step records): for each mixture-of-experts layer,
// the fewest and the most token copies any expert received over the step's micro-batches and
// every data-parallel rank, against the mean (k tokens' worth spread evenly over the experts).
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
};

// Every rank's `mine` summed over the world (only tp index 0's counted: tp ranks route the same
// tokens), as every rank gets it; layers = the model's, experts = E. Collective.
std::vector<LayerLoad> gather_expert_load(Communicator& world, const ExpertLoad& mine, bool counted,
                                          int layers, int64_t experts);

// [{"layer": l, "min": ..., "max": ..., "mean": ...}, ...]
nlohmann::json expert_load_json(const std::vector<LayerLoad>& load);

}  // namespace dstrain
