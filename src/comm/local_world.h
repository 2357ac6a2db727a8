// The shared state of the local communicator (internal to src/comm/): one World per
// run_local_ranks, one Group per communicator (the world and every split of it), all guarded
// by the World's one mutex. Ranks only hold the mutex to publish, wait and look; the data
// moves outside it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/dtype.h"

namespace dstrain::comm_detail {

using Clock = std::chrono::steady_clock;

enum class CallKind : uint8_t { AllReduce, ReduceScatter, AllGather, Broadcast, Barrier, Split };
const char* call_name(CallKind kind);  // "all_reduce", ...

// [begin, end) of one rank's buffer; an empty range overlaps nothing.
struct ByteRange {
  const char* begin = nullptr;
  const char* end = nullptr;
  bool overlaps(const ByteRange& other) const {
    return begin < end && other.begin < other.end && begin < other.end && other.begin < end;
  }
};
ByteRange byte_range(const Tensor& tensor);

// What one rank brings to a collective: published in its Group slot, read by every member.
struct CallSlot {
  CallKind kind = CallKind::Barrier;
  DType dtype = DType::F32;
  int64_t count = 0;      // the per-rank element count n of the contract
  ReduceOp op = ReduceOp::Sum;
  int root = -1;          // broadcast
  int color = 0, key = 0; // split (may differ between ranks)
  const void* input = nullptr;
  void* output = nullptr;
  ByteRange reads, writes;  // what this rank's part reads and what others may write into
};
// "all_reduce(count 10, F32, sum)", "barrier", ...
std::string describe_call(const CallSlot& slot);
// Whether two ranks' calls are the same collective (color and key may differ).
bool same_call(const CallSlot& a, const CallSlot& b);

struct Group;

// What a rank is doing now, for the messages of timeouts and aborts.
struct Activity {
  enum class Kind : uint8_t { Starting, OwnCode, Collective, Send, Recv, Finished, Failed };
  Kind kind = Kind::Starting;
  const char* op = "";          // collective name (Collective)
  std::shared_ptr<const Group> group;
  uint64_t index = 0;           // call number on the group, or message number to the peer
  int peer = -1;                // group rank of the peer (Send, Recv)
  // The last operation that completed, for "in its own code since ...".
  const char* last_op = nullptr;
  std::shared_ptr<const Group> last_group;
  uint64_t last_index = 0;
  std::string label;  // Communicator::annotate's: what the rank's own code is doing
};

// One direction of point-to-point traffic (src -> dst within a group). send blocks until
// the message is Done, so at most one message is in a channel at a time.
struct Channel {
  enum class State : uint8_t { Empty, Posted, Taken, Done, Rejected };
  State state = State::Empty;
  const void* data = nullptr;
  DType dtype = DType::F32;
  int64_t count = 0;
  uint64_t index = 0;  // message number from src to dst, from 1
  std::string error;   // Rejected: why the receiver refused it
};

struct Group {
  Group(int id, std::string name, std::vector<int> world_ranks);
  int size() const { return static_cast<int>(world_ranks.size()); }

  const int id;                        // 0: the world
  const std::string name;              // "world", "world/split0[color 1]"
  const std::vector<int> world_ranks;  // by group rank

  // Everything below is guarded by World::mutex.
  // Rendezvous: a generation ends when every member has arrived (two per collective).
  uint64_t generation = 0;
  int arrived = 0;
  std::vector<char> arrived_flags;  // by group rank, in the current generation
  std::vector<CallSlot> slots;      // by group rank; stable from the first to the second phase
  // split: children being handed out, by color, until each of their members took one.
  struct PendingChild {
    std::shared_ptr<Group> group;
    int taken = 0;
  };
  std::map<int, PendingChild> split_children;
  std::map<std::pair<int, int>, Channel> channels;  // (src, dst) group ranks
};

class World {
 public:
  World(int size, double timeout_seconds);

  const int size;
  const double timeout_seconds;  // a wait in a collective longer than this fails the run

  std::mutex mutex;
  std::condition_variable changed;  // notified on every arrival, message and failure

  // Guarded by mutex.
  std::vector<Activity> activity;  // by world rank
  bool aborted = false;
  int failed_rank = -1;            // world rank of the root cause; -1: the launcher
  std::string failure_message;
  std::exception_ptr root_error;   // the first failure, rethrown by run_local_ranks
  int next_group_id = 1;

  // When a wait that starts now must give up; nullopt-like max() when there is no timeout.
  bool has_deadline() const { return has_deadline_; }
  Clock::time_point deadline_from_now() const;

  // REQUIRES: mutex held. Records `error` as the root cause unless there is one already,
  // and wakes every waiting rank.
  void record_failure(int world_rank, std::exception_ptr error);
  // REQUIRES: mutex held. A failure detected inside the communicator (timeout, a peer that
  // returned, ...): becomes the root cause and is thrown as dstrain::Error.
  [[noreturn]] void fail(int world_rank, const std::string& message);
  // REQUIRES: mutex held, aborted. Throws the follow-on Error of a rank released from `what`.
  [[noreturn]] void throw_aborted(const std::string& what) const;

  // REQUIRES: mutex held. "is in barrier #2 on group 'world'", "has returned from its
  // function", ...: completes "rank 3 ...".
  std::string describe_activity(int world_rank) const;
  // The call part of it (without the rank's annotate() label).
  static std::string describe_call(const Activity& activity);

 private:
  bool has_deadline_ = true;
  Clock::duration timeout_{};
};

// "rank 2" in the world, "rank 1 (world rank 5)" in a sub-group.
std::string member_name(const Group& group, int group_rank);

}  // namespace dstrain::comm_detail
