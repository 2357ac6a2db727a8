// Expert parallelism (--ep): the experts of a MoE layer split over `size` ranks of the
// data-parallel group, rank r holding experts [r E / size, (r + 1) E / size) whole
// (model/layout.h). Each rank routes its own tokens, sends each copy to the rank of its expert
// and gets the output back (all-to-alls over `comm`: the counts, then the rows, forward and
// backward; model/moe_mlp.h), as DeepSpeed's and Megatron's all-to-all token dispatchers do.
// Dropless: a rank may receive up to size * N * min(k, E / size) rows (every token of every
// peer choosing its experts), and its buffers are planned for that worst case.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"

namespace dstrain {

class MoeAuxLoss;  // model/moe_aux_loss.h

// How a rank's tokens were routed: per layer of the model (empty for a dense layer or one of
// another pipeline stage), the copies of its tokens each expert received, added up over the
// micro-batches (counted in backward, so recomputed forwards and evaluation do not count).
struct ExpertLoad {
  std::vector<std::vector<int64_t>> tokens;  // [layer][expert]: the copies each expert ran
  std::vector<int64_t> dropped;              // [layer]: copies a capacity factor dropped

  void add(int layer, const std::vector<int64_t>& counts) {
    if (tokens.size() <= static_cast<size_t>(layer)) tokens.resize(static_cast<size_t>(layer) + 1);
    std::vector<int64_t>& mine = tokens[static_cast<size_t>(layer)];
    if (mine.empty()) mine.assign(counts.size(), 0);
    for (size_t e = 0; e < counts.size(); ++e) mine[e] += counts[e];
  }
  void add_dropped(int layer, int64_t count) {
    if (dropped.size() <= static_cast<size_t>(layer)) dropped.resize(static_cast<size_t>(layer) + 1);
    dropped[static_cast<size_t>(layer)] += count;
  }
  void clear() {
    tokens.clear();
    dropped.clear();
  }
};

// Each MoE layer's router selection bias (DeepSeek-V3's e_score_correction_bias) in F32 on the
// host, by layer: the values of the fp32 master weights, which every rank keeps.
using SelectionBiases = std::vector<std::pair<int, std::vector<float>>>;

struct ExpertParallel {
  int size = 1;
  int rank = 0;
  Communicator* comm = nullptr;  // the expert group (rank() == rank): needed to run, not to plan
  ExpertLoad* load = nullptr;    // optional: the routing of the MoE layers' backward passes
  // The load-balancing loss (where the config asks for it): the MoE layers add their routing in
  // forward and take its gradient in backward. nullptr: none.
  MoeAuxLoss* aux = nullptr;
  // An expert capacity (Megatron's --moe-expert-capacity-factor): each expert keeps at most
  // ceil(factor x N k / E) of a micro-batch's N k token copies on each rank, the first in token
  // order; the others are dropped (they add nothing to their token's output). 0: dropless.
  double capacity_factor = 0;
  // The selection biases in F32, where the parameters are 16-bit: the routing reads them, not
  // their rounding to the parameters' dtype. nullptr: it reads the parameters.
  const SelectionBiases* selection_biases = nullptr;
  bool enabled() const { return size > 1; }
};

}  // namespace dstrain
