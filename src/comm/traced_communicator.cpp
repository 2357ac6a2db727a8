#include "comm/traced_communicator.h"

namespace dstrain {

namespace {

class TracedCommunicator final : public Communicator {
 public:
  TracedCommunicator(Communicator& inner, const char* group, TraceTrack track)
      : inner_(inner), group_(group), track_(track) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }

  void all_reduce(Tensor buffer, ReduceOp op, Stream stream) override {
    const TraceSpan span = this->span("all_reduce", buffer.nbytes(), stream);
    inner_.all_reduce(buffer, op, stream);
  }
  void reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream stream) override {
    const TraceSpan span = this->span("reduce_scatter", input.nbytes(), stream);
    inner_.reduce_scatter(output, input, op, stream);
  }
  void all_gather(Tensor output, Tensor input, Stream stream) override {
    const TraceSpan span = this->span("all_gather", output.nbytes(), stream);
    inner_.all_gather(output, input, stream);
  }
  void broadcast(Tensor buffer, int root, Stream stream) override {
    const TraceSpan span = this->span("broadcast", buffer.nbytes(), stream);
    inner_.broadcast(buffer, root, stream);
  }
  void send(Tensor buffer, int peer, Stream stream) override {
    const TraceSpan span = this->span("send", buffer.nbytes(), stream, peer);
    inner_.send(buffer, peer, stream);
  }
  void recv(Tensor buffer, int peer, Stream stream) override {
    const TraceSpan span = this->span("recv", buffer.nbytes(), stream, peer);
    inner_.recv(buffer, peer, stream);
  }
  void exchange(const std::vector<P2POp>& ops, Stream stream) override {
    int64_t bytes = 0;
    int sends = 0, recvs = 0;
    for (const P2POp& op : ops) {
      bytes += op.buffer.nbytes();
      (op.kind == P2POp::Kind::Send ? sends : recvs) += 1;
    }
    const char* name = sends > 0 && recvs > 0 ? "send/recv" : sends > 0 ? "send" : "recv";
    const int peer = ops.size() == 1 ? ops[0].peer : -1;
    const TraceSpan span = this->span(name, bytes, stream, peer);
    inner_.exchange(ops, stream);
  }
  void all_to_all(Tensor output, const std::vector<int64_t>& recv_counts, Tensor input,
                  const std::vector<int64_t>& send_counts, Stream stream) override {
    const TraceSpan span = this->span("all_to_all", input.nbytes(), stream);
    inner_.all_to_all(output, recv_counts, input, send_counts, stream);
  }
  void barrier() override {
    const TraceSpan span = this->span("barrier", -1, nullptr);
    inner_.barrier();
  }
  void annotate(const std::string& what) override { inner_.annotate(what); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_.split(color, key);
  }

 private:
  TraceSpan span(const char* name, int64_t bytes, Stream stream, int peer = -1) const {
    // On a GPU the stream says where the collective runs; on the CPU (no streams) the group.
    const Tracer* tracer = current_tracer();
    const TraceTrack track = tracer != nullptr ? tracer->track_of(stream, track_) : track_;
    const TraceKind kind =
        track_ == TraceTrack::Pipeline ? TraceKind::Pipeline : TraceKind::Communication;
    return TraceSpan(track, kind, name, -1, stream, TraceArgs{bytes, peer, group_});
  }

  Communicator& inner_;
  const char* group_;
  TraceTrack track_;
};

}  // namespace

std::unique_ptr<Communicator> make_traced_communicator(Communicator& inner, const char* group,
                                                       TraceTrack track) {
  return std::make_unique<TracedCommunicator>(inner, group, track);
}

}  // namespace dstrain
