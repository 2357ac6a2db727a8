// ShardedModel with parameter offload (sharded_model.h, "Parameter offload"): the working
// parameters and gradients live in host memory, and each block comes to the device when it is
// needed. Every operation on the numbers is the one of the run without offload, on the same
// operands in the same order, so the bits are the same; what is here moves bytes.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/trace.h"
#include "parallel/sharded_model.h"

namespace dstrain {

// A transfer between host and device on the communication stream, traced with its bytes.
void ShardedModel::traced_copy(const char* name, int block, void* dst, const void* src,
                               size_t bytes) const {
  const Stream comm = comm_stream_.get();
  const TraceSpan span(TraceTrack::Communication, TraceKind::Communication, name, block, comm,
                       TraceArgs{static_cast<int64_t>(bytes), -1, "host"});
  backend_.copy_bytes(dst, src, bytes, comm);
}

void ShardedModel::bring_params(int block, Tensor full) {
  const Block& b = blocks_[block];
  const Stream comm = comm_stream_.get();
  const Tensor stored = params_padded(block);  // the padded block, or at stage 3 the shard
  const Tensor place = shard_params_ ? full.slice(b.rank * b.shard, {b.shard}) : full;
  traced_copy("offload parameters up, block", block, place.data, stored.data, stored.nbytes());
  if (shard_params_) b.comm->all_gather(full, place, comm);
}

void ShardedModel::send_gradients_down(int block, const Buffer& buffer, bool reduce) {
  const Block& b = blocks_[block];
  const Stream comm = comm_stream_.get();
  const Tensor full = flat(buffer, b.shard * b.world, dtype_);
  const Tensor sum = grads_padded(block);  // host: the padded block, or at stages 2-3 the shard
  Tensor down = full;
  if (shard_grads_) {
    // What the run without offload does in place on the device's shard: sum += reduced.
    const Tensor reduced = flat(reduced_, b.shard, dtype_);
    b.comm->reduce_scatter(reduced, full, ReduceOp::Sum, comm);
    down = flat(shard_sum_, b.shard, dtype_);
    if (grads_fresh_[static_cast<size_t>(block)]) {
      backend_.fill_zero(down, comm);
    } else {
      traced_copy("offload gradients up, block", block, down.data, sum.data, sum.nbytes());
    }
    backend_.accumulate(down, reduced, comm);
  } else if (reduce) {
    reduce_full(block, full);
    reduced_in_backward_[static_cast<size_t>(block)] = true;
  }
  traced_copy("offload gradients down, block", block, sum.data, down.data, sum.nbytes());
  grads_fresh_[static_cast<size_t>(block)] = false;
}

const Buffer& ShardedModel::device_staging(size_t bytes) const {
  // The full-block gradient buffers: the embedding's, or the largest other block's.
  for (const GradSlot& slot : grad_slots_) {
    if (slot.buffer.bytes() >= bytes) return slot.buffer;
  }
  DSTRAIN_CHECK(false) << "no device buffer holds " << bytes << " bytes";
  return grad_slots_[0].buffer;
}

void ShardedModel::reduce_offloaded(int block) {
  const Block& b = blocks_[block];
  const Stream comm = comm_stream_.get();
  const Tensor sum = grads_padded(block);
  const Tensor full = device_staging(sum.nbytes()).view(dtype_, {b.shard * b.world});
  if (grads_fresh_[static_cast<size_t>(block)]) {
    backend_.fill_zero(full, comm);
  } else {
    traced_copy("offload gradients up, block", block, full.data, sum.data, sum.nbytes());
  }
  reduce_full(block, full);
  traced_copy("offload gradients down, block", block, sum.data, full.data, sum.nbytes());
  grads_fresh_[static_cast<size_t>(block)] = false;
}

void ShardedModel::on_device_and_back(Tensor host, const std::function<void(Tensor)>& fn) {
  const Stream comm = comm_stream_.get();
  Tensor device = device_staging(host.nbytes()).view(host.dtype, {host.numel()});
  comm_waits_for_compute();
  traced_copy("offload gradients up", -1, device.data, host.data, host.nbytes());
  fn(device);
  traced_copy("offload gradients down", -1, host.data, device.data, host.nbytes());
  backend_.synchronize(comm);
}

GradientStats ShardedModel::offloaded_gradient_stats(const std::vector<GradientTensor>& buffers) {
  if (buffers.empty()) return GradientStats{};
  // The buffers are pieces of one block's range: bring the bytes they span up at once.
  auto* begin = static_cast<unsigned char*>(buffers[0].x.data);
  unsigned char* end = begin;
  for (const GradientTensor& b : buffers) {
    auto* data = static_cast<unsigned char*>(b.x.data);
    begin = std::min(begin, data);
    end = std::max(end, data + b.x.nbytes());
  }
  const auto bytes = static_cast<size_t>(end - begin);
  const Buffer& staging = device_staging(bytes);
  comm_waits_for_compute();
  traced_copy("offload gradients up", -1, staging.data(), begin, bytes);
  compute_waits_for_comm();
  std::vector<GradientTensor> on_device = buffers;
  for (GradientTensor& b : on_device) {
    b.x.data = static_cast<unsigned char*>(staging.data()) +
               (static_cast<unsigned char*>(b.x.data) - begin);
    b.x.device = staging.device();
  }
  return backend_.gradient_stats(on_device, compute_);  // waits for the compute stream
}

void ShardedModel::offloaded_params_device_step(const AdamWConfig& adam, double lr,
                                                int64_t adam_step, float grad_scale) {
  const TraceSpan span(TraceTrack::Compute, TraceKind::Optimizer, "adamw", -1, compute_);
  const AdamWStep step = adamw_step(adam, lr, adam_step, grad_scale);
  const Stream comm = comm_stream_.get();
  for (int block : held_) {
    Block& b = blocks_[block];
    const FlatRange range = optimizer_range(block);
    if (range.numel == 0) continue;
    const Tensor host_params = range_params(block), host_grads = range_grads(block);
    const Tensor params = flat(gather_slots_[0].buffer, range.numel, dtype_);
    const Tensor grads = device_staging(host_grads.nbytes()).view(dtype_, {range.numel});
    comm_waits_for_compute();  // the previous block's update is done with both buffers
    traced_copy("offload parameters up, block", block, params.data, host_params.data,
                host_params.nbytes());
    traced_copy("offload gradients up, block", block, grads.data, host_grads.data,
                host_grads.nbytes());
    compute_waits_for_comm();
    std::vector<AdamWTensors> buffers;
    const Tensor m = moment(0, block), v = moment(1, block);
    // fp32 parameters are their own master; else the device's master, rounded into params.
    const Tensor master_weights = b.master.empty() ? params : flat(b.master, range.numel);
    const Tensor copy = b.master.empty() ? Tensor() : params;
    append_adamw_buffers(layout_, tp_rank(), range, master_weights, grads, m, v, copy,
                         adam.weight_decay, buffers);
    backend_.adamw_multi(buffers, step, compute_);
    comm_waits_for_compute();
    traced_copy("offload parameters down, block", block, host_params.data, params.data,
                host_params.nbytes());
  }
  backend_.synchronize(comm);
}

void ShardedModel::offloaded_params_host_step(const AdamWConfig& adam, double lr, int64_t adam_step,
                                              float grad_scale) {
  // Everything is on the host (finish_reduction waited for the gradients): the update writes
  // the working parameters in place, as offload_step writes its staging before the upload.
  for (int block : held_) {
    const FlatRange range = optimizer_range(block);
    if (range.numel == 0) continue;
    const TraceSpan span(TraceTrack::HostOptimizer, TraceKind::Optimizer, "host adamw block",
                         block);
    const Tensor params = range_params(block);
    std::memset(params.data, 0, params.nbytes());  // the gaps between tensors stay zeros
    const Tensor m = moment(0, block), v = moment(1, block);
    host_adamw_update_range(layout_, tp_rank(), range, master(block), range_grads(block), m, v,
                            params, adam, lr, adam_step, grad_scale, sharding_.host_threads);
  }
}

void ShardedModel::gather_updated_params_offloaded() {
  const Stream comm = comm_stream_.get();
  comm_waits_for_compute();
  for (int block : held_) {
    const Block& b = blocks_[block];
    const Tensor host = params_padded(block);
    const Tensor full = flat(gather_slots_[0].buffer, b.shard * b.world, dtype_);
    const Tensor mine = host.slice(b.rank * b.shard, {b.shard});
    const Tensor place = full.slice(b.rank * b.shard, {b.shard});
    traced_copy("offload parameters up, block", block, place.data, mine.data, mine.nbytes());
    b.comm->all_gather(full, place, comm);
    traced_copy("offload parameters down, block", block, host.data, full.data, host.nbytes());
  }
  backend_.synchronize(comm);
}

}  // namespace dstrain
