#include "parallel/groups.h"

#include "core/check.h"

namespace dstrain {

int world_rank_of(const Plan& plan, int stage, int data_index, int tensor_index) {
  return (stage * plan.dp + data_index) * plan.tp + tensor_index;
}

RankGroups make_rank_groups(Communicator& world, const Plan& plan, bool tied_embedding) {
  DSTRAIN_CHECK(world.size() == plan.world()) << world.size() << " ranks for " << describe(plan);
  RankGroups groups;
  const int rank = world.rank(), tp = plan.tp;
  groups.tensor_index = rank % tp;
  groups.data_index = (rank / tp) % plan.dp;
  groups.stage = rank / (tp * plan.dp);
  groups.all = &world;
  if (plan.pp == 1 && tp == 1) {
    groups.data = &world;
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
