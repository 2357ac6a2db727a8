#include "parallel/groups.h"

#include "core/check.h"

namespace dstrain {

int world_rank_of(const Plan& plan, int stage, int data_index, int tensor_index) {
  return (stage * plan.dp + data_index) * plan.tp + tensor_index;
}

namespace {

// The expert and expert-data groups (ep > 1), split off the world after the others.
void split_expert_groups(Communicator& world, const Plan& plan, RankGroups& groups) {
  groups.expert_data = groups.data;
  if (plan.ep == 1) return;
  const int ep = plan.ep, lanes = plan.dp / ep;
  const int column = groups.stage * plan.tp + groups.tensor_index;  // one data-parallel group
  const int d = groups.data_index;
  groups.owned_expert = world.split(column * lanes + d / ep, d % ep);
  groups.owned_expert_data = world.split(column * ep + d % ep, d / ep);
  groups.expert = groups.owned_expert.get();
  groups.expert_data = groups.owned_expert_data.get();
  DSTRAIN_CHECK(groups.expert->size() == ep && groups.expert->rank() == d % ep &&
                groups.expert_data->size() == lanes && groups.expert_data->rank() == d / ep)
      << "the expert groups of rank " << world.rank() << " under " << describe(plan);
}

}  // namespace

RankGroups make_rank_groups(Communicator& world, const Plan& plan, bool tied_embedding) {
  DSTRAIN_CHECK(world.size() == plan.world()) << world.size() << " ranks for " << describe(plan);
  RankGroups groups;
  const int rank = world.rank(), tp = plan.tp;
  groups.tensor_index = rank % tp;
  groups.data_index = (rank / tp) % plan.dp;
  groups.stage = rank / (tp * plan.dp);
  groups.all = &world;
  DSTRAIN_CHECK(plan.ep >= 1 && plan.dp % plan.ep == 0) << "ep " << plan.ep << " of dp " << plan.dp;
  groups.expert_index = groups.data_index % plan.ep;
  if (plan.pp == 1 && tp == 1) {
    groups.data = &world;
    split_expert_groups(world, plan, groups);
    return groups;
  }
  // Colors: what the members of a group share; keys: their order in it.
  const int lane = groups.data_index * tp + groups.tensor_index;  // the same in every stage
  groups.owned_data = world.split(groups.stage * tp + groups.tensor_index, groups.data_index);
  groups.data = groups.owned_data.get();
  if (tp > 1) {
    groups.owned_tensor = world.split(rank / tp, groups.tensor_index);
    groups.tensor = groups.owned_tensor.get();
  }
  if (plan.pp > 1) {
    groups.owned_pipe = world.split(lane, groups.stage);
    const bool end_stage = groups.stage == 0 || groups.stage == plan.pp - 1;
    if (tied_embedding) groups.owned_tied = world.split(end_stage ? lane : -1, groups.stage);
    groups.pipe = groups.owned_pipe.get();
    groups.tied = groups.owned_tied.get();
  }
  split_expert_groups(world, plan, groups);
  DSTRAIN_CHECK(groups.data->size() == plan.dp && groups.data->rank() == groups.data_index &&
                (tp == 1 || (groups.tensor->size() == tp &&
                             groups.tensor->rank() == groups.tensor_index)) &&
                (plan.pp == 1 || (groups.pipe->size() == plan.pp &&
                                  groups.pipe->rank() == groups.stage)) &&
                (groups.tied == nullptr ||
                 (groups.tied->size() == 2 && groups.tied->rank() == (groups.stage == 0 ? 0 : 1))))
      << "the groups of rank " << rank << " under " << describe(plan);
  return groups;
}

}  // namespace dstrain
