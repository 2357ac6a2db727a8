#include "comm/staged_communicator.h"

#include <utility>
#include <vector>

#include "core/check.h"

namespace dstrain {
namespace {

bool on_device(const Tensor& t) { return !t.device.is_cpu(); }

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(Communicator& inner, std::unique_ptr<Communicator> owned, CopyAndWait copy)
      : inner_(inner), owned_(std::move(owned)), copy_(std::move(copy)) {
    DSTRAIN_CHECK(copy_) << "a staged communicator needs a copy function";
  }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }

  // One rank (a single GPU without NCCL): every collective is the identity, so no byte goes
  // through host memory -- a training step's gradient all-reduce would otherwise copy every
  // gradient down and up again.
  void all_reduce(Tensor buffer, ReduceOp op, Stream stream) override {
    if (size() == 1 && on_device(buffer)) return;
    if (!on_device(buffer)) return inner_.all_reduce(buffer, op, stream);
    Tensor host = host_twin(buffer, 0);
    transfer(host.data, buffer.data, buffer.nbytes(), stream);
    inner_.all_reduce(host, op, stream);
    transfer(buffer.data, host.data, buffer.nbytes(), stream);
  }

  void reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream stream) override {
    if (size() == 1 && on_device(output) && on_device(input))
      return copy_on_device(output, input, stream);
    Tensor host_input = input, host_output = output;
    if (on_device(input)) {
      host_input = host_twin(input, 0);
      transfer(host_input.data, input.data, input.nbytes(), stream);
    }
    if (on_device(output)) host_output = host_twin(output, 1);
    inner_.reduce_scatter(host_output, host_input, op, stream);
    if (on_device(output)) transfer(output.data, host_output.data, output.nbytes(), stream);
  }

  void all_gather(Tensor output, Tensor input, Stream stream) override {
    if (size() == 1 && on_device(output) && on_device(input))
      return copy_on_device(output, input, stream);
    const int64_t n = input.numel();
    const size_t slice_offset = static_cast<size_t>(n) * rank() * dtype_size(input.dtype);
    const bool in_place = n > 0 && input.device == output.device &&
                          input.data == static_cast<char*>(output.data) + slice_offset;
    Tensor host_input = input, host_output = output;
    if (on_device(output)) host_output = host_twin(output, 0);
    if (in_place && on_device(output)) {
      // Stay in place on the staged copy: only this rank's slice needs to go down.
      host_input = input;
      host_input.data = static_cast<char*>(host_output.data) + slice_offset;
      host_input.device = host_output.device;
      transfer(host_input.data, input.data, input.nbytes(), stream);
    } else if (on_device(input)) {
      host_input = host_twin(input, 1);
      transfer(host_input.data, input.data, input.nbytes(), stream);
    }
    inner_.all_gather(host_output, host_input, stream);
    if (on_device(output)) transfer(output.data, host_output.data, output.nbytes(), stream);
  }

  void broadcast(Tensor buffer, int root, Stream stream) override {
    if (size() == 1 && on_device(buffer)) return;
    if (!on_device(buffer)) return inner_.broadcast(buffer, root, stream);
    Tensor host = host_twin(buffer, 0);
    if (rank() == root) transfer(host.data, buffer.data, buffer.nbytes(), stream);
    inner_.broadcast(host, root, stream);
    if (rank() != root) transfer(buffer.data, host.data, buffer.nbytes(), stream);
  }

  void send(Tensor buffer, int peer, Stream stream) override {
    if (!on_device(buffer)) return inner_.send(buffer, peer, stream);
    Tensor host = host_twin(buffer, 0);
    transfer(host.data, buffer.data, buffer.nbytes(), stream);
    inner_.send(host, peer, stream);
  }

  void recv(Tensor buffer, int peer, Stream stream) override {
    if (!on_device(buffer)) return inner_.recv(buffer, peer, stream);
    Tensor host = host_twin(buffer, 0);
    inner_.recv(host, peer, stream);
    transfer(buffer.data, host.data, buffer.nbytes(), stream);
  }

  // Each device buffer gets its own staging slot: sends are copied down before the inner
  // exchange, receives copied back after it.
  void exchange(const std::vector<P2POp>& ops, Stream stream) override {
    std::vector<P2POp> host_ops = ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      const Tensor& buffer = ops[i].buffer;
      if (!on_device(buffer)) continue;
      host_ops[i].buffer = host_twin(buffer, i);
      if (ops[i].kind == P2POp::Kind::Send) {
        transfer(host_ops[i].buffer.data, buffer.data, buffer.nbytes(), stream);
      }
    }
    inner_.exchange(host_ops, stream);
    for (size_t i = 0; i < ops.size(); ++i) {
      const Tensor& buffer = ops[i].buffer;
      if (on_device(buffer) && ops[i].kind == P2POp::Kind::Recv) {
        transfer(buffer.data, host_ops[i].buffer.data, buffer.nbytes(), stream);
      }
    }
  }

  void barrier() override { inner_.barrier(); }

 protected:
  // all_to_all (the default, through this exchange): the own part stays on the device.
  void copy_own_part(Tensor dst, Tensor src, Stream stream) override {
    if (on_device(dst) && on_device(src)) return copy_on_device(dst, src, stream);
    if (!on_device(dst) && !on_device(src)) return Communicator::copy_own_part(dst, src, stream);
    transfer(dst.data, src.data, src.nbytes(), stream);
  }

 public:
  void annotate(const std::string& what) override { inner_.annotate(what); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    std::unique_ptr<Communicator> child = inner_.split(color, key);
    if (!child) return nullptr;
    Communicator& inner = *child;
    return std::make_unique<StagedCommunicator>(inner, std::move(child), copy_);
  }

 private:
  // output = input on the device (a one-rank reduce-scatter or all-gather).
  void copy_on_device(const Tensor& output, const Tensor& input, Stream stream) {
    DSTRAIN_CHECK(output.nbytes() == input.nbytes() && output.dtype == input.dtype)
        << "one-rank collective of " << input.shape_str() << " into " << output.shape_str();
    if (output.data != input.data) copy_(output.data, input.data, output.nbytes(), stream);
  }

  void transfer(void* dst, const void* src, size_t bytes, Stream stream) {
    if (bytes > 0) copy_(dst, src, bytes, stream);
  }

  // A host tensor of t's dtype and shape in staging slot `slot` (a collective needs at most an
  // input and an output, an exchange one per operation).
  Tensor host_twin(const Tensor& t, size_t slot) {
    if (staging_.size() <= slot) staging_.resize(slot + 1);
    std::vector<char>& bytes = staging_[slot];
    if (bytes.size() < t.nbytes()) bytes.resize(t.nbytes());
    Tensor host = t;
    host.data = bytes.data();
    host.device = Device{};
    return host;
  }

  Communicator& inner_;
  std::unique_ptr<Communicator> owned_;  // split children: the wrapper owns its inner
  CopyAndWait copy_;
  std::vector<std::vector<char>> staging_;  // by slot, each grown to the largest use, kept
};

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(Communicator& inner, CopyAndWait copy) {
  return std::make_unique<StagedCommunicator>(inner, nullptr, std::move(copy));
}

}  // namespace dstrain
