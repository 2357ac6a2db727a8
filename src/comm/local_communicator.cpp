// The local communicator: ranks are threads of this process sharing one World.
//
// A collective is two rendezvous on the group (comm/local_world.h):
//   1. every rank publishes a CallSlot (its pointers and what it is calling) and waits until
//      all members have arrived; this is the only wait that times out or aborts;
//   2. with every slot in view, each rank checks that all ranks called the same thing, does
//      its share of the data movement reading the other ranks' buffers directly, then waits
//      for all members again, unconditionally: once everyone has passed (1) nobody may leave
//      before the others have stopped touching its buffers, and nothing between (1) and (2)
//      can block, so this wait always ends.
// Determinism: every output element is computed by exactly one rank, from the inputs in
// group-rank order, and that one result is copied to every rank that receives it.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "comm/communicator.h"
#include "comm/local_reduce.h"
#include "comm/local_world.h"
#include "comm/rank_threads.h"
#include "core/check.h"

namespace dstrain {

using comm_detail::Activity;
using comm_detail::byte_range;
using comm_detail::ByteRange;
using comm_detail::CallKind;
using comm_detail::CallSlot;
using comm_detail::Channel;
using comm_detail::Clock;
using comm_detail::Group;
using comm_detail::member_name;
using comm_detail::World;

namespace {

// Chunks of an all_reduce are multiples of this many elements (>= one 64-byte cache line for
// every dtype), so two ranks never write the same cache line of an output.
constexpr int64_t kChunkAlign = 32;

char* byte_offset(void* base, int64_t elements, DType dtype) {
  return static_cast<char*>(base) + static_cast<size_t>(elements) * dtype_size(dtype);
}
const char* byte_offset(const void* base, int64_t elements, DType dtype) {
  return static_cast<const char*>(base) + static_cast<size_t>(elements) * dtype_size(dtype);
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

// One message of this rank: a send, a recv, or one operation of an exchange (all three are
// run by LocalCommunicator::transfer).
struct Message {
  bool sending = true;
  Tensor buffer;
  int peer = -1;            // group rank
  uint64_t index = 0;       // number of the message on its (source, destination) pair, from 1
  std::string what;         // "send #2 from rank 0 to rank 1 on group 'world'"
  bool in_channel = false;  // a posted send not yet received: withdrawn if the call fails
  bool done = false;        // received (a send), or copied in (a receive)
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<World> world, std::shared_ptr<Group> group, int rank)
      : world_(std::move(world)),
        group_(std::move(group)),
        rank_(rank),
        world_rank_(group_->world_ranks[static_cast<size_t>(rank)]),
        sends_(static_cast<size_t>(group_->size()), 0),
        recvs_(static_cast<size_t>(group_->size()), 0) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  void all_reduce(Tensor buffer, ReduceOp op, Stream) override;
  void reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream) override;
  void all_gather(Tensor output, Tensor input, Stream) override;
  void broadcast(Tensor buffer, int root, Stream) override;
  void send(Tensor buffer, int peer, Stream) override;
  void recv(Tensor buffer, int peer, Stream) override;
  void exchange(const std::vector<P2POp>& ops, Stream) override;
  void barrier() override;
  void annotate(const std::string& what) override;
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  // Runs one collective: publish `slot`, rendezvous, check, compute(slots), rendezvous.
  template <class Compute>
  void collective(CallSlot slot, Compute&& compute);
  // REQUIRES: lock held. One rendezvous on the group; `abortable`: the first phase (may time
  // out or abort), otherwise the unconditional second phase.
  void arrive(std::unique_lock<std::mutex>& lock, bool abortable, const std::string& what);
  // REQUIRES: lock held. Throws when the world aborted, `peer` returned, or `deadline` passed.
  void check_waiting(const std::string& what, int peer, Clock::time_point deadline,
                     const std::string& peer_missing);
  // REQUIRES: lock held. Until the world changes or `deadline` passes.
  void wait_for_change(std::unique_lock<std::mutex>& lock, Clock::time_point deadline);
  // The operations of a send, recv or exchange (`op`, for messages): checked, then numbered.
  void check_ops(const std::vector<P2POp>& ops, const char* op) const;
  std::vector<Message> number_messages(const std::vector<P2POp>& ops, const char* op);
  // Moves every message of the call, each as soon as its channel lets it, until every send was
  // received and every receive copied in: one implementation for send, recv and exchange.
  // `op` and `index` name the call in this rank's activity, `what` in the error of a world
  // that aborted before it.
  void transfer(std::vector<Message>& messages, const char* op, uint64_t index,
                const std::string& what);
  // REQUIRES (the four below): lock held. They throw what send/recv throw on failure.
  // One step of messages[i] if its channel allows one now (posting a send, taking a receive,
  // finishing a received send); whether it moved.
  bool advance(std::unique_lock<std::mutex>& lock, std::vector<Message>& messages, size_t i);
  void post(Message& send);
  bool try_take(std::unique_lock<std::mutex>& lock, Message& recv);
  bool try_finish(Message& send);
  // After a failure: takes `send` back out of its channel (Empty again) unless it was received.
  void withdraw(std::unique_lock<std::mutex>& lock, Message& send);
  // The same call on every rank, and no rank writing into another rank's buffers.
  void validate(const std::vector<CallSlot>& slots, const std::string& what) const;
  void check_buffer(const Tensor& tensor, const char* op, const char* name) const;
  void set_activity(Activity::Kind kind, const char* op, uint64_t index, int peer);
  void end_activity(const char* op, uint64_t index);
  std::string call_label(const char* op, uint64_t index) const;

  std::shared_ptr<World> world_;
  std::shared_ptr<Group> group_;
  const int rank_;        // in the group
  const int world_rank_;
  uint64_t calls_ = 0;    // collectives called on this group, the current one included
  uint64_t exchanges_ = 0;  // exchanges called on this group, the current one included
  int splits_ = 0;
  std::vector<uint64_t> sends_, recvs_;  // messages to / from each group rank
};

std::string LocalCommunicator::call_label(const char* op, uint64_t index) const {
  return std::string(op) + " #" + std::to_string(index) + " on group '" + group_->name + "'";
}

void LocalCommunicator::set_activity(Activity::Kind kind, const char* op, uint64_t index,
                                     int peer) {
  Activity& a = world_->activity[static_cast<size_t>(world_rank_)];
  a.kind = kind;
  a.op = op;
  a.group = group_;
  a.index = index;
  a.peer = peer;
}

void LocalCommunicator::annotate(const std::string& what) {
  std::lock_guard<std::mutex> lock(world_->mutex);
  world_->activity[static_cast<size_t>(world_rank_)].label = what;
}

void LocalCommunicator::end_activity(const char* op, uint64_t index) {
  Activity& a = world_->activity[static_cast<size_t>(world_rank_)];
  a.kind = Activity::Kind::OwnCode;
  a.last_op = op;
  a.last_group = group_;
  a.last_index = index;
  a.group.reset();
}

void LocalCommunicator::check_buffer(const Tensor& tensor, const char* op,
                                     const char* name) const {
  DSTRAIN_CHECK(tensor.device.is_cpu())
      << op << ": the local communicator moves CPU memory only; " << name << " is on "
      << tensor.device.str();
  DSTRAIN_CHECK(tensor.numel() == 0 || tensor.data != nullptr)
      << op << ": " << name << " " << tensor.shape_str() << " has no data";
}

void LocalCommunicator::check_waiting(const std::string& what, int peer,
                                      Clock::time_point deadline,
                                      const std::string& peer_missing) {
  World& world = *world_;
  if (world.aborted) world.throw_aborted(what);
  const int peer_world_rank = group_->world_ranks[static_cast<size_t>(peer)];
  if (world.activity[static_cast<size_t>(peer_world_rank)].kind == Activity::Kind::Finished) {
    world.fail(world_rank_, what + " cannot complete: " + member_name(*group_, peer) +
                                " returned from its function and never " + peer_missing);
  }
  if (Clock::now() >= deadline) {
    std::ostringstream text;
    text << what << " timed out: " << member_name(*group_, rank_) << " waited "
         << world.timeout_seconds << " s, but " << member_name(*group_, peer) << " never "
         << peer_missing << " (it " << world.describe_activity(peer_world_rank) << ")";
    world.fail(world_rank_, text.str());
  }
}

void LocalCommunicator::wait_for_change(std::unique_lock<std::mutex>& lock,
                                        Clock::time_point deadline) {
  if (world_->has_deadline()) {
    world_->changed.wait_until(lock, deadline);
  } else {
    world_->changed.wait(lock);
  }
}

void LocalCommunicator::arrive(std::unique_lock<std::mutex>& lock, bool abortable,
                               const std::string& what) {
  World& world = *world_;
  Group& group = *group_;
  const uint64_t generation = group.generation;
  group.arrived_flags[static_cast<size_t>(rank_)] = 1;
  if (++group.arrived == group.size()) {
    group.arrived = 0;
    std::fill(group.arrived_flags.begin(), group.arrived_flags.end(), 0);
    ++group.generation;
    world.changed.notify_all();
    return;
  }
  if (!abortable) {
    world.changed.wait(lock, [&] { return group.generation != generation; });
    return;
  }
  const Clock::time_point deadline = world.deadline_from_now();
  while (group.generation == generation) {
    std::vector<int> missing;
    for (int r = 0; r < group.size(); ++r) {
      if (!group.arrived_flags[static_cast<size_t>(r)]) missing.push_back(r);
    }
    const bool finished_peer = std::any_of(missing.begin(), missing.end(), [&](int r) {
      return world.activity[static_cast<size_t>(group.world_ranks[static_cast<size_t>(r)])]
                 .kind == Activity::Kind::Finished;
    });
    const bool timed_out = Clock::now() >= deadline;
    if (world.aborted || finished_peer || timed_out) {
      // Leave the rendezvous: it can never complete now, and nobody must count us in.
      group.arrived_flags[static_cast<size_t>(rank_)] = 0;
      --group.arrived;
      if (world.aborted) world.throw_aborted(what);
      std::ostringstream text;
      text << what;
      if (finished_peer) {
        text << " cannot complete:";
      } else {
        text << " timed out: " << member_name(group, rank_) << " waited "
             << world.timeout_seconds << " s, but";
      }
      for (size_t i = 0; i < missing.size(); ++i) {
        const int r = missing[i];
        text << (i ? ";" : "") << " " << member_name(group, r) << " never joined (it "
             << world.describe_activity(group.world_ranks[static_cast<size_t>(r)]) << ")";
      }
      world.fail(world_rank_, text.str());
    }
    wait_for_change(lock, deadline);
  }
}

void LocalCommunicator::validate(const std::vector<CallSlot>& slots,
                                 const std::string& what) const {
  // Every rank runs the same checks on the same slots, so all throw the same error or none.
  std::ostringstream mismatch;
  for (int r = 1; r < group_->size(); ++r) {
    if (!comm_detail::same_call(slots[0], slots[static_cast<size_t>(r)])) {
      if (mismatch.tellp() == 0) {
        mismatch << "mismatched collectives at " << what << ": " << member_name(*group_, 0)
                 << " called " << describe_call(slots[0]);
      }
      mismatch << ", but " << member_name(*group_, r) << " called "
               << describe_call(slots[static_cast<size_t>(r)]);
    }
  }
  if (mismatch.tellp() != 0) throw Error(mismatch.str());
  for (int r = 0; r < group_->size(); ++r) {
    const ByteRange& writes = slots[static_cast<size_t>(r)].writes;
    for (int s = 0; s < group_->size(); ++s) {
      if (s == r) continue;
      const CallSlot& other = slots[static_cast<size_t>(s)];
      if (writes.overlaps(other.writes) || writes.overlaps(other.reads)) {
        throw Error(what + ": the buffers of " + member_name(*group_, r) + " and " +
                    member_name(*group_, s) +
                    " overlap; every rank needs its own memory (ranks are threads here)");
      }
    }
  }
}

template <class Compute>
void LocalCommunicator::collective(CallSlot slot, Compute&& compute) {
  World& world = *world_;
  Group& group = *group_;
  const char* op = call_name(slot.kind);
  const uint64_t index = ++calls_;
  const std::string what = call_label(op, index);
  std::unique_lock<std::mutex> lock(world.mutex);
  if (world.aborted) world.throw_aborted(what);
  set_activity(Activity::Kind::Collective, op, index, -1);
  group.slots[static_cast<size_t>(rank_)] = slot;
  arrive(lock, /*abortable=*/true, what);
  lock.unlock();
  // The slots stay as they are until every member has passed the second phase.
  std::exception_ptr error;
  try {
    validate(group.slots, what);
    compute(group.slots);
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  arrive(lock, /*abortable=*/false, what);
  end_activity(op, index);
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

void LocalCommunicator::all_reduce(Tensor buffer, ReduceOp op, Stream) {
  check_buffer(buffer, "all_reduce", "buffer");
  CallSlot slot;
  slot.kind = CallKind::AllReduce;
  slot.dtype = buffer.dtype;
  slot.count = buffer.numel();
  slot.op = op;
  slot.input = buffer.data;
  slot.output = buffer.data;
  slot.reads = slot.writes = byte_range(buffer);
  collective(slot, [&](const std::vector<CallSlot>& slots) {
    // This rank reduces its own chunk of the elements over all ranks and writes the result
    // into every rank's buffer; no other rank reads or writes that chunk, so in place is safe.
    const int64_t n = slot.count;
    const int ranks = size();
    int64_t per_rank = (n + ranks - 1) / ranks;
    per_rank = (per_rank + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    const int64_t begin = std::min(n, per_rank * rank_);
    const int64_t end = std::min(n, begin + per_rank);
    if (begin >= end) return;
    std::vector<const void*> inputs(static_cast<size_t>(ranks));
    std::vector<void*> outputs(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      inputs[static_cast<size_t>(r)] = byte_offset(slots[static_cast<size_t>(r)].input, begin,
                                                   slot.dtype);
      outputs[static_cast<size_t>(r)] = byte_offset(slots[static_cast<size_t>(r)].output, begin,
                                                    slot.dtype);
    }
    comm_detail::reduce_in_order(slot.dtype, op, inputs, outputs, end - begin);
  });
}

void LocalCommunicator::reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream) {
  check_buffer(output, "reduce_scatter", "output");
  check_buffer(input, "reduce_scatter", "input");
  const int64_t n = output.numel();
  DSTRAIN_CHECK(input.dtype == output.dtype)
      << "reduce_scatter: input " << input.shape_str() << " and output " << output.shape_str()
      << " differ in dtype";
  DSTRAIN_CHECK(input.numel() == n * size())
      << "reduce_scatter: input " << input.shape_str() << " must hold size (" << size()
      << ") * output " << output.shape_str() << " elements";
  DSTRAIN_CHECK(!byte_range(output).overlaps(byte_range(input)))
      << "reduce_scatter: output and input must not overlap";
  CallSlot slot;
  slot.kind = CallKind::ReduceScatter;
  slot.dtype = output.dtype;
  slot.count = n;
  slot.op = op;
  slot.input = input.data;
  slot.output = output.data;
  slot.reads = byte_range(input);
  slot.writes = byte_range(output);
  collective(slot, [&](const std::vector<CallSlot>& slots) {
    const int ranks = size();
    std::vector<const void*> inputs(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      inputs[static_cast<size_t>(r)] =
          byte_offset(slots[static_cast<size_t>(r)].input, n * rank_, slot.dtype);
    }
    void* const outputs[] = {output.data};
    comm_detail::reduce_in_order(slot.dtype, op, inputs, outputs, n);
  });
}

void LocalCommunicator::all_gather(Tensor output, Tensor input, Stream) {
  check_buffer(output, "all_gather", "output");
  check_buffer(input, "all_gather", "input");
  const int64_t n = input.numel();
  DSTRAIN_CHECK(input.dtype == output.dtype)
      << "all_gather: input " << input.shape_str() << " and output " << output.shape_str()
      << " differ in dtype";
  DSTRAIN_CHECK(output.numel() == n * size())
      << "all_gather: output " << output.shape_str() << " must hold size (" << size()
      << ") * input " << input.shape_str() << " elements";
  const bool in_place = n > 0 && input.data == byte_offset(output.data, n * rank_, input.dtype);
  DSTRAIN_CHECK(in_place || !byte_range(output).overlaps(byte_range(input)))
      << "all_gather: input must be output's own slice [rank * n, (rank + 1) * n) or not "
         "overlap output";
  CallSlot slot;
  slot.kind = CallKind::AllGather;
  slot.dtype = input.dtype;
  slot.count = n;
  slot.input = input.data;
  slot.output = output.data;
  slot.reads = byte_range(input);
  slot.writes = byte_range(output);
  if (in_place) slot.reads = ByteRange{};  // inside its own writes; others only read it
  collective(slot, [&](const std::vector<CallSlot>& slots) {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(slot.dtype);
    for (int r = 0; r < size(); ++r) {
      // In place, this rank's own slice is already there (src == dst: skipped).
      copy_bytes(byte_offset(output.data, n * r, slot.dtype),
                 slots[static_cast<size_t>(r)].input, bytes);
    }
  });
}

void LocalCommunicator::broadcast(Tensor buffer, int root, Stream) {
  check_buffer(buffer, "broadcast", "buffer");
  DSTRAIN_CHECK(root >= 0 && root < size())
      << "broadcast: root " << root << " is not a rank of a group of " << size();
  CallSlot slot;
  slot.kind = CallKind::Broadcast;
  slot.dtype = buffer.dtype;
  slot.count = buffer.numel();
  slot.root = root;
  slot.input = buffer.data;
  slot.output = buffer.data;
  if (rank_ == root) {
    slot.reads = byte_range(buffer);
  } else {
    slot.writes = byte_range(buffer);
  }
  collective(slot, [&](const std::vector<CallSlot>& slots) {
    if (rank_ == root) return;
    copy_bytes(buffer.data, slots[static_cast<size_t>(root)].input, buffer.nbytes());
  });
}

void LocalCommunicator::barrier() {
  CallSlot slot;
  slot.kind = CallKind::Barrier;
  collective(slot, [](const std::vector<CallSlot>&) {});
}

std::unique_ptr<Communicator> LocalCommunicator::split(int color, int key) {
  CallSlot slot;
  slot.kind = CallKind::Split;
  slot.color = color;
  slot.key = key;
  const int split_number = splits_++;
  std::unique_ptr<Communicator> child;
  collective(slot, [&](const std::vector<CallSlot>& slots) {
    if (color < 0) return;
    // Members of my color, ordered by (key, old rank): a stable sort keeps the old order.
    std::vector<int> members;
    for (int r = 0; r < size(); ++r) {
      if (slots[static_cast<size_t>(r)].color == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return slots[static_cast<size_t>(a)].key < slots[static_cast<size_t>(b)].key;
    });
    const int new_rank = static_cast<int>(
        std::find(members.begin(), members.end(), rank_) - members.begin());
    std::shared_ptr<Group> child_group;
    {
      // The first member to get here creates the group; the last one to take it clears the
      // entry, before anyone can leave this split (the second phase waits for all).
      std::lock_guard<std::mutex> lock(world_->mutex);
      Group::PendingChild& pending = group_->split_children[color];
      if (!pending.group) {
        std::vector<int> world_ranks;
        for (int r : members) world_ranks.push_back(group_->world_ranks[static_cast<size_t>(r)]);
        pending.group = std::make_shared<Group>(
            world_->next_group_id++,
            group_->name + "/split" + std::to_string(split_number) + "[color " +
                std::to_string(color) + "]",
            std::move(world_ranks));
      }
      child_group = pending.group;
      if (++pending.taken == child_group->size()) group_->split_children.erase(color);
    }
    child = std::make_unique<LocalCommunicator>(world_, std::move(child_group), new_rank);
  });
  return child;
}

// ---- point to point ----
//
// A message travels through the channel of its (source, destination) pair: the sender posts
// a pointer to its buffer, the receiver copies out of it, and the sender leaves only once the
// copy is Done (or Rejected), so the buffer outlives every read and a channel holds at most
// one message. send, recv and exchange are all transfer(). Several messages of one call to (or
// from) one peer go in order: the next is posted (taken) once the one before it was received.
// A call never waits on one message while another can move, so two neighbours exchanging
// messages both ways cannot deadlock.

void LocalCommunicator::check_ops(const std::vector<P2POp>& ops, const char* op) const {
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& o = ops[i];
    const bool sending = o.kind == P2POp::Kind::Send;
    check_buffer(o.buffer, op, "buffer");
    DSTRAIN_CHECK(o.peer >= 0 && o.peer < size() && o.peer != rank_)
        << op << ": peer " << o.peer << " is not another rank of a group of " << size();
    for (size_t j = 0; j < ops.size() && !sending; ++j) {
      // The peer reads a send buffer while this rank writes its receive buffers.
      DSTRAIN_CHECK(j == i || !byte_range(o.buffer).overlaps(byte_range(ops[j].buffer)))
          << op << ": the receive buffer of operation " << i << " overlaps the buffer of "
          << "operation " << j;
    }
  }
}

std::vector<Message> LocalCommunicator::number_messages(const std::vector<P2POp>& ops,
                                                        const char* op) {
  // Numbered only once every operation passed its checks: a rejected call sends nothing.
  check_ops(ops, op);
  std::vector<Message> messages(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    Message& m = messages[i];
    m.sending = ops[i].kind == P2POp::Kind::Send;
    m.buffer = ops[i].buffer;
    m.peer = ops[i].peer;
    m.index = ++(m.sending ? sends_ : recvs_)[static_cast<size_t>(m.peer)];
    m.what = (m.sending ? "send #" : "recv #") + std::to_string(m.index) +
             (m.sending ? " from " : " by ") + member_name(*group_, rank_) +
             (m.sending ? " to " : " from ") + member_name(*group_, m.peer) + " on group '" +
             group_->name + "'";
  }
  return messages;
}

void LocalCommunicator::transfer(std::vector<Message>& messages, const char* op, uint64_t index,
                                 const std::string& what) {
  World& world = *world_;
  std::unique_lock<std::mutex> lock(world.mutex);
  if (world.aborted) world.throw_aborted(what);
  try {
    // One deadline for the whole call: the timeout bounds how long the rank waits in it.
    const Clock::time_point deadline = world.deadline_from_now();
    while (true) {
      bool moved = false;
      for (size_t i = 0; i < messages.size(); ++i) moved = advance(lock, messages, i) || moved;
      if (moved) world.changed.notify_all();
      // What the call waits for: a receive first (the peer has not sent), else a send.
      auto waiting = std::find_if(messages.begin(), messages.end(),
                                  [](const Message& m) { return !m.done && !m.sending; });
      if (waiting == messages.end()) {
        waiting = std::find_if(messages.begin(), messages.end(),
                               [](const Message& m) { return !m.done; });
      }
      if (waiting == messages.end()) break;
      if (moved) continue;
      const Message& m = *waiting;
      set_activity(m.sending ? Activity::Kind::Send : Activity::Kind::Recv, op, m.index, m.peer);
      if (m.sending && group_->channels[{rank_, m.peer}].state == Channel::State::Taken) {
        world.changed.wait(lock);  // the receiver is copying: that always ends
        continue;
      }
      check_waiting(m.what, m.peer, deadline, m.sending ? "received it" : "sent it");
      wait_for_change(lock, deadline);
    }
  } catch (...) {
    for (Message& m : messages) withdraw(lock, m);
    end_activity(op, index);
    throw;
  }
  end_activity(op, index);
}

bool LocalCommunicator::advance(std::unique_lock<std::mutex>& lock,
                                std::vector<Message>& messages, size_t i) {
  Message& m = messages[i];
  if (m.done) return false;
  // A channel holds one message: an earlier message of this call on it goes first.
  for (size_t j = 0; j < i; ++j) {
    const Message& earlier = messages[j];
    if (!earlier.done && earlier.sending == m.sending && earlier.peer == m.peer) return false;
  }
  if (!m.sending) return try_take(lock, m);
  if (m.in_channel) return try_finish(m);
  post(m);
  return true;
}

void LocalCommunicator::post(Message& send) {
  Channel& channel = group_->channels[{rank_, send.peer}];
  DSTRAIN_CHECK(channel.state == Channel::State::Empty) << send.what << ": channel busy";
  channel.state = Channel::State::Posted;
  channel.data = send.buffer.data;
  channel.dtype = send.buffer.dtype;
  channel.count = send.buffer.numel();
  channel.index = send.index;
  send.in_channel = true;
}

bool LocalCommunicator::try_take(std::unique_lock<std::mutex>& lock, Message& recv) {
  World& world = *world_;
  Channel& channel = group_->channels[{recv.peer, rank_}];
  if (channel.state != Channel::State::Posted) return false;
  DSTRAIN_CHECK(channel.index == recv.index)
      << recv.what << ": got message #" << channel.index << " instead";
  const Tensor& buffer = recv.buffer;
  if (channel.dtype != buffer.dtype || channel.count != buffer.numel()) {
    std::ostringstream text;
    text << "mismatched send/recv: " << recv.what << " expects " << buffer.numel() << " "
         << dtype_name(buffer.dtype) << " elements, but the sender sent " << channel.count
         << " " << dtype_name(channel.dtype);
    channel.state = Channel::State::Rejected;
    channel.error = text.str();
    world.changed.notify_all();
    throw Error(text.str());
  }
  // The sender stays in its call until Done, so its buffer lives while we copy without the
  // lock.
  channel.state = Channel::State::Taken;
  const void* source = channel.data;
  lock.unlock();
  copy_bytes(buffer.data, source, buffer.nbytes());
  lock.lock();
  channel.state = Channel::State::Done;
  recv.done = true;
  return true;
}

bool LocalCommunicator::try_finish(Message& send) {
  Channel& channel = group_->channels[{rank_, send.peer}];
  if (channel.state == Channel::State::Posted || channel.state == Channel::State::Taken) {
    return false;
  }
  const bool rejected = channel.state == Channel::State::Rejected;
  const std::string error = channel.error;
  channel = Channel{};
  send.in_channel = false;
  send.done = true;
  if (rejected) throw Error(error);
  return true;
}

void LocalCommunicator::withdraw(std::unique_lock<std::mutex>& lock, Message& send) {
  if (!send.in_channel) return;
  Channel& channel = group_->channels[{rank_, send.peer}];
  // A receiver copying out of the buffer finishes first: the caller may free it on return.
  world_->changed.wait(lock, [&] { return channel.state != Channel::State::Taken; });
  // Posted: nobody will read the buffer now; Done or Rejected: the receiver is finished with it.
  channel = Channel{};
  send.in_channel = false;
}

void LocalCommunicator::send(Tensor buffer, int peer, Stream) {
  std::vector<Message> messages =
      number_messages({P2POp{P2POp::Kind::Send, buffer, peer}}, "send");
  transfer(messages, "send", messages[0].index, messages[0].what);
}

void LocalCommunicator::recv(Tensor buffer, int peer, Stream) {
  std::vector<Message> messages =
      number_messages({P2POp{P2POp::Kind::Recv, buffer, peer}}, "recv");
  transfer(messages, "recv", messages[0].index, messages[0].what);
}

void LocalCommunicator::exchange(const std::vector<P2POp>& ops, Stream) {
  std::vector<Message> messages = number_messages(ops, "exchange");
  const uint64_t index = ++exchanges_;
  transfer(messages, "exchange", index, call_label("exchange", index));
}

void run_rank(const std::shared_ptr<World>& world, const std::shared_ptr<Group>& group,
              int rank, const std::function<void(Communicator&)>& fn) {
  thread_error_context().rank = rank;
  {
    std::lock_guard<std::mutex> lock(world->mutex);
    world->activity[static_cast<size_t>(rank)].kind = Activity::Kind::OwnCode;
  }
  try {
    LocalCommunicator communicator(world, group, rank);
    fn(communicator);
    std::lock_guard<std::mutex> lock(world->mutex);
    world->activity[static_cast<size_t>(rank)].kind = Activity::Kind::Finished;
    world->changed.notify_all();  // a rank waiting for this one can fail now, not at timeout
  } catch (...) {
    std::lock_guard<std::mutex> lock(world->mutex);
    world->activity[static_cast<size_t>(rank)].kind = Activity::Kind::Failed;
    world->record_failure(rank, std::current_exception());
  }
}

}  // namespace

void run_local_ranks(int world_size, double timeout_seconds,
                     const std::function<void(Communicator&)>& fn) {
  DSTRAIN_USER_CHECK(world_size >= 1)
      << "the number of local ranks must be at least 1 (got " << world_size << ")";
  DSTRAIN_USER_CHECK(timeout_seconds > 0)
      << "the collective timeout must be positive (got " << timeout_seconds << " s)";
  auto world = std::make_shared<World>(world_size, timeout_seconds);
  std::vector<int> world_ranks(static_cast<size_t>(world_size));
  std::iota(world_ranks.begin(), world_ranks.end(), 0);
  auto group = std::make_shared<Group>(0, "world", std::move(world_ranks));
  comm_detail::run_rank_threads(
      world_size, [&](int rank) { run_rank(world, group, rank, fn); },
      [&](std::exception_ptr error) {
        // Could not start every rank: release the started ones before they are joined.
        std::lock_guard<std::mutex> lock(world->mutex);
        world->record_failure(-1, std::move(error));
      });
  if (world->root_error) std::rethrow_exception(world->root_error);
}

}  // namespace dstrain
