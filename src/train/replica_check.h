// --check-replicas N: every N steps the ranks that must hold identical weights compare a checksum
// of each tensor (FNV-1a over its bytes, as the model computes with them):
//   data    the data-parallel replicas of a stage (under ZeRO-3: the blocks as gathered)
//   tensor  the tensor-parallel ranks, for the tensors every one of them holds whole (norms,
//           the biases after a row-parallel matrix)
//   tied    the first and the last pipeline stage's copies of the tied embedding/head
// A difference stops the run (dstrain::Error on every rank of the group) naming the tensor, the
// step and the ranks that differ, before anything of that step is saved.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/layout.h"
#include "parallel/groups.h"
#include "parallel/sharded_model.h"

namespace dstrain {

// FNV-1a, 64 bits.
uint64_t fnv1a64(const unsigned char* bytes, size_t count);

class ReplicaChecker {
 public:
  // Collective over `world`'s groups in `groups`: learns their members' world ranks.
  ReplicaChecker(const RankGroups& groups, int world_rank);
  // Collective over every group (and, under ZeRO-3, the data group's gathers). step: 1-based,
  // the step just taken. Throws Error on a difference.
  void check(ShardedModel& state, const ParamLayout& layout, int64_t step) const;

 private:
  struct Group {
    const char* what;  // "the data-parallel replicas"
    Communicator* comm = nullptr;
    std::vector<int> world_ranks;  // by group rank
    bool replicated_only = false;  // tensor group: tensors with tp_dim < 0
    bool embedding_only = false;   // tied group: the embedding block
    // Expert parallelism: the data group compares the dense tensors only (each ep rank holds
    // other experts), the expert-data group the routed experts only.
    bool dense_only = false, experts_only = false;
  };
  std::vector<Group> groups_;
};

}  // namespace dstrain
