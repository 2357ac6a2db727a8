#include "train/replica_check.h"

#include <cstring>
#include <sstream>

#include "comm/gather_values.h"
#include "core/check.h"

namespace dstrain {

uint64_t fnv1a64(const unsigned char* bytes, size_t count) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < count; ++i) {
    hash ^= bytes[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

namespace {

std::vector<int> member_world_ranks(Communicator& comm, int world_rank) {
  const std::vector<uint64_t> all =
      all_gather_values(comm, std::vector<uint64_t>{static_cast<uint64_t>(world_rank)});
  return std::vector<int>(all.begin(), all.end());
}

std::string hex(uint64_t value) {
  std::ostringstream text;
  text << "0x" << std::hex << value;
  return text.str();
}

}  // namespace

ReplicaChecker::ReplicaChecker(const RankGroups& groups, int world_rank) {
  auto add = [&](const char* what, Communicator* comm, bool replicated, bool embedding,
                 bool dense = false, bool experts = false) {
    if (comm == nullptr || comm->size() < 2) return;
    groups_.push_back(Group{what, comm, member_world_ranks(*comm, world_rank), replicated,
                            embedding, dense, experts});
  };
  const bool ep = groups.expert != nullptr;
  add("the data-parallel replicas", groups.data, false, false, ep);
  add("the tensor-parallel ranks", groups.tensor, true, false);
  add("the tied embedding's copies (first and last pipeline stage)", groups.tied, false, true);
  if (ep) add("the replicas of each expert", groups.expert_data, false, false, false, true);
}

void ReplicaChecker::check(ShardedModel& state, const ParamLayout& layout, int64_t step) const {
  if (groups_.empty()) return;
  // Each held tensor's checksum (every rank of a data group gathers the same blocks in order).
  const std::vector<ParamSpec>& specs = layout.params();
  std::vector<uint64_t> sums(specs.size(), 0);
  const size_t element = dtype_size(state.sharding().param_dtype);
  for (int block = 0; block < state.num_blocks(); ++block) {
    if (!state.holds(block)) continue;
    const std::vector<unsigned char> bytes = state.working_params_bytes(block);
    for (int i : layout.block_params(block)) {
      const ParamSpec& spec = specs[static_cast<size_t>(i)];
      sums[static_cast<size_t>(i)] = fnv1a64(bytes.data() + spec.offset * element,
                                             static_cast<size_t>(spec.numel()) * element);
    }
  }
  for (const Group& group : groups_) {
    std::vector<int> tensors;
    for (size_t i = 0; i < specs.size(); ++i) {
      const ParamSpec& spec = specs[i];
      if (!state.holds(spec.block) || (group.replicated_only && spec.tp_dim >= 0) ||
          (group.embedding_only && spec.block != ParamLayout::embedding_block()) ||
          (group.dense_only && spec.expert) || (group.experts_only && !spec.expert)) {
        continue;
      }
      tensors.push_back(static_cast<int>(i));
    }
    std::vector<uint64_t> mine;
    for (int i : tensors) mine.push_back(sums[static_cast<size_t>(i)]);
    const std::vector<uint64_t> all = all_gather_values(*group.comm, mine);
    std::vector<std::string> differing;
    std::string first;
    for (size_t t = 0; t < tensors.size(); ++t) {
      std::ostringstream ranks;
      for (int member = 1; member < group.comm->size(); ++member) {
        const uint64_t theirs = all[static_cast<size_t>(member) * tensors.size() + t];
        if (theirs != all[t]) {
          ranks << (ranks.tellp() > 0 ? ", " : "") << group.world_ranks[static_cast<size_t>(member)]
                << " (" << hex(theirs) << ")";
        }
      }
      if (ranks.tellp() == 0) continue;
      const std::string& name = specs[static_cast<size_t>(tensors[t])].name;
      if (differing.empty()) {
        first = name + " differs between " + group.what + ": rank " +
                std::to_string(group.world_ranks[0]) + " holds checksum " + hex(all[t]) +
                ", rank " + ranks.str();
      }
      differing.push_back(name);
    }
    if (differing.empty()) continue;
    std::ostringstream message;
    message << "replica check after step " << step << ": " << first;
    if (differing.size() > 1) message << " (and " << differing.size() - 1 << " more tensors)";
    message << "; the run stops without saving this step";
    throw Error(message.str());
  }
}

}  // namespace dstrain
