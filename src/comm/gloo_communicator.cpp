// The Gloo communicator (comm/gloo_communicator.h). DSTRAIN_WITH_GLOO: a build without Gloo
// compiles only the two stubs at the bottom.
#include "comm/gloo_communicator.h"

#include "core/check.h"

#ifdef DSTRAIN_WITH_GLOO

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <utility>
#include <vector>

#include "comm/local_reduce.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;
using comm_detail::reduce_in_order;

// Gloo's waits take milliseconds; "no timeout" is a year.
constexpr double kNoTimeoutSeconds = 365.0 * 24 * 3600;

double bounded_seconds(double timeout_seconds) {
  return std::isfinite(timeout_seconds) ? timeout_seconds : kNoTimeoutSeconds;
}

std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds << " s";
  return text.str();
}

// Slots (Gloo's tags) of the communicator's messages. Point-to-point messages share one slot:
// Gloo matches a pair's messages of one slot in order, which is the contract's per-pair order.
// Each collective gets slots of its own, numbered by the call, one per phase.
constexpr uint64_t kPointToPointSlot = 1;
constexpr uint64_t kCollectiveSlotBit = uint64_t{1} << 62;
constexpr int kPhasesPerCollective = 4;

// gloo::rendezvous::Store over this rank's store client, every key under "<prefix>/".
class PrefixedStore : public gloo::rendezvous::Store {
 public:
  PrefixedStore(TcpStoreClient& client, std::string prefix, double timeout_seconds)
      : client_(client), prefix_(std::move(prefix)), timeout_seconds_(timeout_seconds) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    client_.set(full_key(key), std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, std::chrono::milliseconds(0));
    const std::string value = client_.get(full_key(key));
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::milliseconds(0));
  }
  // The communicator's own timeout bounds the wait (Gloo passes its context's, the same).
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    std::vector<std::string> full_keys;
    for (const std::string& key : keys) full_keys.push_back(full_key(key));
    if (client_.wait_for(full_keys, bounded_seconds(timeout_seconds_))) return;
    std::string names;
    for (const std::string& key : full_keys) names += (names.empty() ? "'" : ", '") + key + "'";
    throw Error("the Gloo communicator '" + prefix_ + "' waited " + seconds_text(timeout_seconds_) +
                " for " + names + " in the store at " + client_.address() + ", which never came");
  }

 private:
  std::string full_key(const std::string& key) const { return prefix_ + "/" + key; }

  TcpStoreClient& client_;
  std::string prefix_;
  double timeout_seconds_;
};

std::string ranks_text(const std::vector<int>& ranks, int size) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + " of " + std::to_string(size);
}

// Every rank sets "<prefix>/joined/<rank>" and waits for the others': ranks that never come are
// named here, before Gloo's own exchange of addresses would wait for them with less to say.
void wait_for_every_rank(TcpStoreClient& store, const std::string& prefix, int rank, int size,
                         double timeout_seconds) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + "/joined/" + std::to_string(r));
  store.set(keys[static_cast<size_t>(rank)], "1");
  if (store.wait_for(keys, bounded_seconds(timeout_seconds))) return;
  const std::vector<bool> present = store.check(keys);
  std::vector<int> missing;
  for (int r = 0; r < size; ++r)
    if (!present[static_cast<size_t>(r)]) missing.push_back(r);
  if (missing.empty()) return;  // they arrived between the timeout and the check
  throw Error(ranks_text(missing, size) + " never joined the Gloo communicator '" + prefix +
              "' through the store at " + store.address() + " within " +
              seconds_text(timeout_seconds) + " (this is rank " + std::to_string(rank) + ")");
}

std::shared_ptr<gloo::rendezvous::Context> connect_context(
    TcpStoreClient& store, const std::string& prefix, int rank, int size, double timeout_seconds,
    std::shared_ptr<gloo::transport::Device>& device) {
  wait_for_every_rank(store, prefix, rank, size, timeout_seconds);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(std::chrono::milliseconds(
      static_cast<int64_t>(std::ceil(bounded_seconds(timeout_seconds) * 1000))));
  PrefixedStore prefixed(store, prefix + "/gloo", timeout_seconds);
  try {
    context->connectFullMesh(prefixed, device);
  } catch (const gloo::Exception& e) {
    throw Error("rank " + std::to_string(rank) + " of the Gloo communicator '" + prefix +
                "' could not connect to its peers: " + e.what());
  }
  return context;
}

// One posted transfer: its Gloo buffer and whom it goes to or comes from.
struct Transfer {
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  int peer = -1;
  bool is_send = true;
  std::string what;  // "send #2 to rank 1", for the messages
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(TcpStoreClient& store, std::string prefix, double timeout_seconds,
                   std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::rendezvous::Context> context)
      : store_(store),
        prefix_(std::move(prefix)),
        timeout_seconds_(timeout_seconds),
        device_(std::move(device)),
        context_(std::move(context)),
        sends_to_(static_cast<size_t>(context_->size), 0),
        receives_from_(static_cast<size_t>(context_->size), 0) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }

  void all_reduce(Tensor buffer, ReduceOp op, Stream) override {
    Call call = begin("all_reduce");
    check_buffer(buffer, call, "buffer");
    const int64_t n = buffer.numel();
    const size_t element = dtype_size(buffer.dtype);
    char* data = static_cast<char*>(buffer.data);
    // Chunk r of the buffer: rank r reduces it (phase 1) and sends it to all (phase 2).
    const auto chunk = [&](int r) {
      const int64_t begin = n * r / size(), end = n * (r + 1) / size();
      return Slice{data + static_cast<size_t>(begin) * element, end - begin};
    };
    const Slice mine = chunk(rank());
    reduce_own_slice(call, buffer.dtype, op, chunk, mine.data);
    std::vector<Transfer> transfers;
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      post_send(transfers, call, 1, peer, mine.data, static_cast<size_t>(mine.count) * element);
      post_recv(transfers, call, 1, peer, chunk(peer).data,
                static_cast<size_t>(chunk(peer).count) * element);
    }
    wait_all(transfers, call);
  }

  void reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream) override {
    Call call = begin("reduce_scatter");
    check_whole_and_part(call, input, "input", output, "output");
    DSTRAIN_CHECK(!overlaps(output, input)) << call.what << ": output and input overlap";
    const int64_t n = output.numel();
    char* data = static_cast<char*>(input.data);
    reduce_own_slice(
        call, input.dtype, op,
        [&](int r) {
          return Slice{data + static_cast<size_t>(r * n) * dtype_size(input.dtype), n};
        },
        output.data);
  }

  void all_gather(Tensor output, Tensor input, Stream) override {
    Call call = begin("all_gather");
    check_whole_and_part(call, output, "output", input, "input");
    const size_t bytes = input.nbytes();
    char* gathered = static_cast<char*>(output.data);
    char* own_slice = gathered + rank() * bytes;
    DSTRAIN_CHECK(input.data == own_slice || !overlaps(output, input))
        << call.what << ": input overlaps output other than as its own slice";
    if (bytes > 0 && input.data != own_slice) std::memcpy(own_slice, input.data, bytes);
    gather_slices(call, gathered, bytes);
  }

  void broadcast(Tensor buffer, int root, Stream) override {
    Call call = begin("broadcast");
    check_buffer(buffer, call, "buffer");
    DSTRAIN_CHECK(root >= 0 && root < size())
        << call.what << ": root " << root << " is not a rank of " << size();
    std::vector<Transfer> transfers;
    if (rank() == root) {
      for (int peer = 0; peer < size(); ++peer)
        if (peer != root) post_send(transfers, call, 0, peer, buffer.data, buffer.nbytes());
    } else {
      post_recv(transfers, call, 0, root, buffer.data, buffer.nbytes());
    }
    wait_all(transfers, call);
  }

  void send(Tensor buffer, int peer, Stream stream) override {
    exchange({P2POp{P2POp::Kind::Send, buffer, peer}}, stream);
  }
  void recv(Tensor buffer, int peer, Stream stream) override {
    exchange({P2POp{P2POp::Kind::Recv, buffer, peer}}, stream);
  }

  void exchange(const std::vector<P2POp>& ops, Stream) override {
    Call call = begin_point_to_point(
        ops.size() == 1 ? (ops[0].kind == P2POp::Kind::Send ? "send" : "recv") : "exchange");
    for (const P2POp& op : ops) {
      check_buffer(op.buffer, call,
                   op.kind == P2POp::Kind::Send ? "a send buffer" : "a receive buffer");
      DSTRAIN_CHECK(op.peer >= 0 && op.peer < size() && op.peer != rank())
          << call.what << ": peer " << op.peer << " is not another rank of " << size();
    }
    // Every send is posted first, then every receive: none waits for another to be taken.
    // Several to (or from) one peer share its pair and slot, which Gloo keeps in order.
    std::vector<Transfer> transfers;
    for (const P2POp& op : ops) {
      if (op.kind != P2POp::Kind::Send) continue;
      post(transfers, call, kPointToPointSlot, op.peer, op.buffer.data, op.buffer.nbytes(), true,
           "send #" + std::to_string(++sends_to_[static_cast<size_t>(op.peer)]) + " to rank " +
               std::to_string(op.peer));
    }
    for (const P2POp& op : ops) {
      if (op.kind != P2POp::Kind::Recv) continue;
      post(transfers, call, kPointToPointSlot, op.peer, op.buffer.data, op.buffer.nbytes(), false,
           "receive #" + std::to_string(++receives_from_[static_cast<size_t>(op.peer)]) +
               " from rank " + std::to_string(op.peer));
    }
    // Receives in the order given, then the sends.
    std::stable_partition(transfers.begin(), transfers.end(),
                          [](const Transfer& t) { return !t.is_send; });
    wait_all(transfers, call);
  }

  void barrier() override {
    Call call = begin("barrier");
    std::vector<int32_t> ranks(static_cast<size_t>(size()), -1);
    ranks[static_cast<size_t>(rank())] = rank();
    gather_slices(call, reinterpret_cast<char*>(ranks.data()), sizeof(int32_t));
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    Call call = begin("split");
    // Every rank's (color, key), gathered as in all_gather.
    std::vector<int32_t> colors_and_keys(2 * static_cast<size_t>(size()));
    colors_and_keys[2 * static_cast<size_t>(rank())] = color;
    colors_and_keys[2 * static_cast<size_t>(rank()) + 1] = key;
    gather_slices(call, reinterpret_cast<char*>(colors_and_keys.data()), 2 * sizeof(int32_t));
    const int split_number = splits_++;
    if (color < 0) return nullptr;
    std::vector<std::pair<int, int>> members;  // (key, old rank) of this color
    for (int r = 0; r < size(); ++r)
      if (colors_and_keys[2 * static_cast<size_t>(r)] == color)
        members.emplace_back(colors_and_keys[2 * static_cast<size_t>(r) + 1], r);
    std::sort(members.begin(), members.end());
    const int new_rank = static_cast<int>(
        std::find(members.begin(), members.end(), std::make_pair(key, rank())) - members.begin());
    const std::string prefix =
        prefix_ + "/split" + std::to_string(split_number) + "[color " + std::to_string(color) + "]";
    auto context = connect_context(store_, prefix, new_rank, static_cast<int>(members.size()),
                                   timeout_seconds_, device_);
    return std::make_unique<GlooCommunicator>(store_, prefix, timeout_seconds_, device_,
                                              std::move(context));
  }

 private:
  // One call: its name for messages and the first slot of its messages.
  struct Call {
    std::string what;  // "all_reduce #3 on group 'job/world'"
    uint64_t slot = 0;
    Clock::time_point deadline;
  };

  Call start(const std::string& what, uint64_t slot) {
    DSTRAIN_CHECK(broken_.empty())
        << what << ": the Gloo communicator is broken since an earlier failure (" << broken_ << ")";
    return Call{
        what, slot,
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(bounded_seconds(timeout_seconds_)))};
  }
  Call begin(const char* op) {
    const uint64_t index = ++collectives_;
    return start(std::string(op) + " #" + std::to_string(index) + " on group '" + prefix_ + "'",
                 kCollectiveSlotBit | (index * kPhasesPerCollective));
  }
  Call begin_point_to_point(const char* op) {
    return start(std::string(op) + " on group '" + prefix_ + "'", kPointToPointSlot);
  }

  void check_buffer(const Tensor& tensor, const Call& call, const char* name) const {
    DSTRAIN_CHECK(tensor.device.is_cpu())
        << call.what << ": the Gloo communicator moves CPU memory only; " << name << " is on "
        << tensor.device.str();
    DSTRAIN_CHECK(tensor.numel() == 0 || tensor.data != nullptr)
        << call.what << ": " << name << " " << tensor.shape_str() << " has no data";
  }

  void post(std::vector<Transfer>& transfers, const Call& call, uint64_t slot, int peer, void* data,
            size_t bytes, bool is_send, std::string what) {
    if (bytes == 0) return;  // both sides know the size: nothing to say
    Transfer transfer{nullptr, peer, is_send, std::move(what)};
    try {
      transfer.buffer = context_->createUnboundBuffer(data, bytes);
      if (is_send) {
        transfer.buffer->send(peer, slot);
      } else {
        transfer.buffer->recv(peer, slot);
      }
    } catch (const gloo::Exception& e) {
      fail(call, transfer, e.what());
    }
    transfers.push_back(std::move(transfer));
  }
  void post_send(std::vector<Transfer>& transfers, const Call& call, int phase, int peer,
                 void* data, size_t bytes) {
    post(transfers, call, call.slot + static_cast<uint64_t>(phase), peer, data, bytes, true,
         "its send to rank " + std::to_string(peer));
  }
  void post_recv(std::vector<Transfer>& transfers, const Call& call, int phase, int peer,
                 void* data, size_t bytes) {
    post(transfers, call, call.slot + static_cast<uint64_t>(phase), peer, data, bytes, false,
         "its receive from rank " + std::to_string(peer));
  }

  // `whole` holds size() times `part`'s elements, of the same dtype.
  void check_whole_and_part(const Call& call, const Tensor& whole, const char* whole_name,
                            const Tensor& part, const char* part_name) const {
    check_buffer(whole, call, whole_name);
    check_buffer(part, call, part_name);
    DSTRAIN_CHECK(whole.dtype == part.dtype && whole.numel() == part.numel() * size())
        << call.what << ": " << whole_name << " " << whole.shape_str() << " must hold size ("
        << size() << ") x " << part_name << " " << part.shape_str();
  }

  // `count` elements at `data`.
  struct Slice {
    char* data;
    int64_t count;
  };

  // The reduce-scatter step, on the call's first slot: slice_of(r) is this rank's part for rank
  // r; each peer gets its part, and this rank's part from every rank (its own in place) is
  // reduced in rank order into `output` (slice_of(rank()).count elements; it may be the very
  // memory of this rank's own part).
  void reduce_own_slice(const Call& call, DType dtype, ReduceOp op,
                        const std::function<Slice(int)>& slice_of, void* output) {
    const size_t element = dtype_size(dtype);
    const Slice mine = slice_of(rank());
    std::vector<std::vector<char>> received(static_cast<size_t>(size()));
    std::vector<Transfer> transfers;
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      const Slice theirs = slice_of(peer);
      post_send(transfers, call, 0, peer, theirs.data, static_cast<size_t>(theirs.count) * element);
      std::vector<char>& incoming = received[static_cast<size_t>(peer)];
      incoming.resize(static_cast<size_t>(mine.count) * element);
      post_recv(transfers, call, 0, peer, incoming.data(), incoming.size());
    }
    wait_all(transfers, call);
    std::vector<const void*> inputs;
    for (int r = 0; r < size(); ++r)
      inputs.push_back(r == rank() ? mine.data : received[static_cast<size_t>(r)].data());
    reduce_in_order(dtype, op, inputs, std::span<void* const>(&output, 1), mine.count);
  }

  // The all-gather of `bytes` per rank: rank r's slice at gathered + r * bytes, from rank r, on
  // the call's first slot. REQUIRES: this rank's own slice is in place.
  void gather_slices(const Call& call, char* gathered, size_t bytes) {
    char* own_slice = gathered + static_cast<size_t>(rank()) * bytes;
    std::vector<Transfer> transfers;
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      post_send(transfers, call, 0, peer, own_slice, bytes);
      post_recv(transfers, call, 0, peer, gathered + static_cast<size_t>(peer) * bytes, bytes);
    }
    wait_all(transfers, call);
  }

  // Waits for every transfer in order, each until the call's deadline.
  void wait_all(std::vector<Transfer>& transfers, const Call& call) {
    for (Transfer& transfer : transfers) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(call.deadline - Clock::now());
      const auto timeout = std::max(left, std::chrono::milliseconds(1));
      try {
        const bool done = transfer.is_send ? transfer.buffer->waitSend(timeout)
                                           : transfer.buffer->waitRecv(timeout);
        if (!done) fail(call, transfer, "it was aborted");
      } catch (const gloo::Exception& e) {
        const std::string message = e.what();
        const bool timed_out = Clock::now() >= call.deadline ||
                               message.find("Timed out") != std::string::npos;
        fail(call, transfer,
             timed_out ? "rank " + std::to_string(transfer.peer) + " did not come within " +
                             seconds_text(timeout_seconds_)
                       : "Gloo: " + message,
             !timed_out && message.find("Connection closed by peer") != std::string::npos);
      }
    }
  }

  [[noreturn]] void fail(const Call& call, const Transfer& transfer, const std::string& why,
                         bool peer_closed = false) {
    std::ostringstream text;
    text << call.what << " failed on rank " << rank() << " at " << transfer.what << ": " << why;
    broken_ = text.str();
    if (peer_closed) throw PeerClosedError(broken_);
    throw Error(broken_);
  }

  TcpStoreClient& store_;
  const std::string prefix_;
  const double timeout_seconds_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint64_t collectives_ = 0;             // collectives so far (each names its slots)
  int splits_ = 0;                       // splits so far (each names its key prefix)
  std::vector<uint64_t> sends_to_;       // messages sent, by peer
  std::vector<uint64_t> receives_from_;  // messages received, by peer
  std::string broken_;                   // the failure that broke the communicator, if any
};

}  // namespace

bool gloo_available() { return true; }

std::unique_ptr<Communicator> make_gloo_communicator(TcpStoreClient& store,
                                                     const std::string& prefix, int rank, int size,
                                                     double timeout_seconds,
                                                     const GlooNetwork& network) {
  DSTRAIN_CHECK(size >= 1 && rank >= 0 && rank < size)
      << "make_gloo_communicator: rank " << rank << " of " << size;
  DSTRAIN_CHECK(timeout_seconds > 0) << "make_gloo_communicator: timeout " << timeout_seconds;
  gloo::transport::tcp::attr attr;
  if (network.interface.empty()) {
    attr.hostname = network.hostname;
  } else {
    attr.iface = network.interface;
  }
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const gloo::Exception& e) {
    throw UserError("Gloo cannot listen on " +
                    (network.interface.empty() ? "host '" + network.hostname + "'"
                                               : "interface '" + network.interface + "'") +
                    " (" + e.what() + "): give an address or interface of this machine.");
  }
  auto context = connect_context(store, prefix, rank, size, timeout_seconds, device);
  return std::make_unique<GlooCommunicator>(store, prefix, timeout_seconds, std::move(device),
                                            std::move(context));
}

}  // namespace dstrain

#else  // no Gloo

namespace dstrain {

bool gloo_available() { return false; }

std::unique_ptr<Communicator> make_gloo_communicator(TcpStoreClient&, const std::string&, int, int,
                                                     double, const GlooNetwork&) {
  throw UserError(
      "this build has no Gloo: install libgloo-dev (scripts/install-deps.sh) and build again "
      "with -DDSTRAIN_GLOO=AUTO or ON.");
}

}  // namespace dstrain

#endif
