// The communicators of one rank under a Plan. Rank r of the world is tensor-parallel index
// r % tp, data-parallel index (r / tp) % dp and pipeline stage r / (tp * dp) (parallel/plan.h):
//
//   tensor the tp ranks of the same stage and data-parallel index (consecutive ranks, so one
//          NVLink island): the layers' split matrices and their collectives
//   data   the dp ranks of the same stage and tp index: ZeRO's sharding, gradient reduction
//   pipe   the pp ranks of the same data-parallel and tp index, group rank = stage: the
//          pipeline's activations and gradients, point to point
//   tied   pp > 1: the first and the last stage of the same data-parallel and tp index (group
//          rank 0 the first): the tied embedding/head's gradients (Megatron's embedding group)
//   expert ep > 1: the ep ranks of a data-parallel group with the same data_index / ep (consecutive
//          data-parallel indices), group rank = data_index % ep = the experts it holds: the
//          MoE layers' token exchange (all-to-all)
//   expert_data  the dp / ep ranks of a data-parallel group with the same data_index % ep (the
//          same experts): the experts' sharding and gradient reduction (== data at ep = 1)
//   all    the world: agreement on inf/NaN and the gradient norm, the loss, stop signals
//
// Made by splits of the world (collective: every rank calls make_rank_groups in the same order).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "parallel/plan.h"

namespace dstrain {

struct RankGroups {
  int stage = 0, data_index = 0, tensor_index = 0;
  int expert_index = 0;  // data_index % ep: which experts this rank holds
  Communicator* all = nullptr;
  Communicator* data = nullptr;    // == all with one stage and tp = 1
  Communicator* tensor = nullptr;  // nullptr with tp = 1
  Communicator* pipe = nullptr;    // nullptr with one stage
  Communicator* tied = nullptr;    // nullptr unless pp > 1 and this is the first or last stage
  Communicator* expert = nullptr;  // nullptr with ep = 1
  Communicator* expert_data = nullptr;  // == data with ep = 1
  std::unique_ptr<Communicator> owned_data, owned_tensor, owned_pipe, owned_tied;
  std::unique_ptr<Communicator> owned_expert, owned_expert_data;
};

// REQUIRES: world.size() == plan.world().
// tied_embedding: the model's LM head is its embedding (ParamLayout::tied_embedding), so a
// pipeline's first and last stages hold two copies of it, joined by the tied group.
RankGroups make_rank_groups(Communicator& world, const Plan& plan, bool tied_embedding = true);

// The world rank of (stage, data-parallel index, tp index) under `plan`.
int world_rank_of(const Plan& plan, int stage, int data_index, int tensor_index);

}  // namespace dstrain
