// The communicators of one rank under a Plan (tensor parallelism excepted, which does not
// run yet). Rank r of the world is data-parallel index r % dp of pipeline stage r / dp
// (parallel/plan.h, with tp = 1):
//
//   data   the dp ranks of the same stage: ZeRO's sharding, gradient reduction
//   pipe   the pp ranks of the same data-parallel index, group rank = stage: the pipeline's
//          activations and gradients, point to point
//   tied   pp > 1: the first and the last stage of the same data-parallel index (group rank
//          0 the first): the tied embedding/head's gradients (Megatron's embedding group)
//   all    the world: agreement on inf/NaN and the gradient norm, the loss, stop signals
//
// Made by splits of the world (collective: every rank calls make_rank_groups in the same order).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "parallel/plan.h"

namespace dstrain {

struct RankGroups {
  int stage = 0, data_index = 0;
  Communicator* all = nullptr;
  Communicator* data = nullptr;  // == all with one stage
  Communicator* pipe = nullptr;  // nullptr with one stage
  Communicator* tied = nullptr;  // nullptr unless pp > 1 and this is the first or last stage
  std::unique_ptr<Communicator> owned_data, owned_pipe, owned_tied;
};

// REQUIRES: world.size() == plan.world(), plan.tp == 1.
RankGroups make_rank_groups(Communicator& world, const Plan& plan);

}  // namespace dstrain
