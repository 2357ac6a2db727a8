#include "comm/local_world.h"

#include <sstream>

#include "comm/local_reduce.h"
#include "core/check.h"

namespace dstrain::comm_detail {

const char* call_name(CallKind kind) {
  switch (kind) {
    case CallKind::AllReduce: return "all_reduce";
    case CallKind::ReduceScatter: return "reduce_scatter";
    case CallKind::AllGather: return "all_gather";
    case CallKind::Broadcast: return "broadcast";
    case CallKind::Barrier: return "barrier";
    case CallKind::Split: return "split";
  }
  return "?";
}

ByteRange byte_range(const Tensor& tensor) {
  const char* begin = static_cast<const char*>(tensor.data);
  return ByteRange{begin, begin == nullptr ? begin : begin + tensor.nbytes()};
}

std::string describe_call(const CallSlot& slot) {
  std::ostringstream text;
  text << call_name(slot.kind);
  switch (slot.kind) {
    case CallKind::AllReduce:
    case CallKind::ReduceScatter:
      text << "(count " << slot.count << ", " << dtype_name(slot.dtype) << ", "
           << reduce_op_name(slot.op) << ")";
      break;
    case CallKind::AllGather:
      text << "(count " << slot.count << ", " << dtype_name(slot.dtype) << ")";
      break;
    case CallKind::Broadcast:
      text << "(count " << slot.count << ", " << dtype_name(slot.dtype) << ", root " << slot.root
           << ")";
      break;
    case CallKind::Barrier:
      break;
    case CallKind::Split:
      text << "(color " << slot.color << ", key " << slot.key << ")";
      break;
  }
  return text.str();
}

bool same_call(const CallSlot& a, const CallSlot& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case CallKind::AllReduce:
    case CallKind::ReduceScatter:
      return a.dtype == b.dtype && a.count == b.count && a.op == b.op;
    case CallKind::AllGather:
      return a.dtype == b.dtype && a.count == b.count;
    case CallKind::Broadcast:
      return a.dtype == b.dtype && a.count == b.count && a.root == b.root;
    case CallKind::Barrier:
    case CallKind::Split:
      return true;
  }
  return false;
}

Group::Group(int id_, std::string name_, std::vector<int> world_ranks_)
    : id(id_), name(std::move(name_)), world_ranks(std::move(world_ranks_)) {
  arrived_flags.assign(world_ranks.size(), 0);
  slots.resize(world_ranks.size());
}

std::string member_name(const Group& group, int group_rank) {
  std::string name = "rank " + std::to_string(group_rank);
  if (group.id != 0 && group_rank >= 0 && group_rank < group.size()) {
    name += " (world rank " + std::to_string(group.world_ranks[group_rank]) + ")";
  }
  return name;
}

World::World(int size_, double timeout_seconds_)
    : size(size_), timeout_seconds(timeout_seconds_), activity(static_cast<size_t>(size_)) {
  // Beyond ~30 years a deadline would overflow the clock: that is no timeout at all.
  if (!(timeout_seconds < 1e9)) {
    has_deadline_ = false;
  } else {
    timeout_ = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(timeout_seconds));
  }
}

Clock::time_point World::deadline_from_now() const {
  return has_deadline_ ? Clock::now() + timeout_ : Clock::time_point::max();
}

static std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

void World::record_failure(int world_rank, std::exception_ptr error) {
  if (aborted) return;  // a follow-on failure: the root cause is already known
  aborted = true;
  failed_rank = world_rank;
  failure_message = message_of(error);
  root_error = std::move(error);
  changed.notify_all();
}

void World::fail(int world_rank, const std::string& message) {
  if (aborted) throw_aborted(message);
  record_failure(world_rank, std::make_exception_ptr(Error(message)));
  throw Error(message);
}

void World::throw_aborted(const std::string& what) const {
  std::ostringstream text;
  text << what << " aborted: ";
  if (failed_rank >= 0) {
    text << "rank " << failed_rank << " failed: ";
  } else {
    text << "the launcher of the ranks failed: ";
  }
  text << failure_message;
  throw Error(text.str());
}

std::string World::describe_activity(int world_rank) const {
  const Activity& a = activity[static_cast<size_t>(world_rank)];
  std::string text = describe_call(a);
  if (!a.label.empty() && a.kind != Activity::Kind::Starting && a.kind != Activity::Kind::Finished) {
    text += ": " + a.label;
  }
  return text;
}

std::string World::describe_call(const Activity& a) {
  const auto on_group = [](const std::shared_ptr<const Group>& group) {
    return group ? " on group '" + group->name + "'" : std::string();
  };
  const auto peer = [](const Activity& a) {
    return a.group ? member_name(*a.group, a.peer) : "rank " + std::to_string(a.peer);
  };
  // A send or receive inside an exchange (Communicator::exchange) says so.
  const std::string in = std::string("is in ") +
                         (std::string(a.op) == "exchange" ? "an exchange, at " : "");
  switch (a.kind) {
    case Activity::Kind::Starting:
      return "has not started yet";
    case Activity::Kind::OwnCode:
      if (a.last_op == nullptr) return "is in its own code, before any collective";
      return "is in its own code since " + std::string(a.last_op) + " #" +
             std::to_string(a.last_index) + on_group(a.last_group);
    case Activity::Kind::Collective:
      return "is in " + std::string(a.op) + " #" + std::to_string(a.index) + on_group(a.group);
    case Activity::Kind::Send:
      return in + "send #" + std::to_string(a.index) + " to " + peer(a) + on_group(a.group);
    case Activity::Kind::Recv:
      return in + "recv #" + std::to_string(a.index) + " from " + peer(a) + on_group(a.group);
    case Activity::Kind::Finished:
      return "has returned from its function";
    case Activity::Kind::Failed:
      return "has failed";
  }
  return "?";
}

}  // namespace dstrain::comm_detail
