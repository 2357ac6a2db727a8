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
// tokens), as every rank gets it; layers = the model's, experts = E. Collective.
std::vector<LayerLoad> gather_expert_load(Communicator& world, const ExpertLoad& mine, bool counted,
                                          int layers, int64_t experts);

// [{"layer": l, "min": ..., "max": ..., "mean": ..., "dropped": ...}, ...]
nlohmann::json expert_load_json(const std::vector<LayerLoad>& load);

}  // namespace dstrain
