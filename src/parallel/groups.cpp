#include "parallel/groups.h"

#include "core/check.h"

namespace dstrain {

RankGroups make_rank_groups(Communicator& world, const Plan& plan) {
  DSTRAIN_CHECK(world.size() == plan.world() && plan.tp == 1)
      << world.size() << " ranks for " << describe(plan);
  RankGroups groups;
  const int rank = world.rank();
  groups.stage = rank / plan.dp;
  groups.data_index = rank % plan.dp;
  groups.all = &world;
  if (plan.pp == 1) {
    groups.data = &world;
    return groups;
  }
  groups.owned_data = world.split(groups.stage, groups.data_index);
  groups.owned_pipe = world.split(groups.data_index, groups.stage);
  const bool end_stage = groups.stage == 0 || groups.stage == plan.pp - 1;
  groups.owned_tied = world.split(end_stage ? groups.data_index : -1, groups.stage);
  groups.data = groups.owned_data.get();
  groups.pipe = groups.owned_pipe.get();
  groups.tied = groups.owned_tied.get();
  DSTRAIN_CHECK(groups.data->size() == plan.dp && groups.pipe->size() == plan.pp &&
                groups.pipe->rank() == groups.stage &&
                (groups.tied == nullptr || (groups.tied->size() == 2 &&
                                            groups.tied->rank() == (groups.stage == 0 ? 0 : 1))))
      << "the groups of rank " << rank << " under " << describe(plan);
  return groups;
}

}  // namespace dstrain
