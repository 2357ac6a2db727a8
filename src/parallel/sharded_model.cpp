#include "parallel/sharded_model.h"

#include "core/trace.h"

#include "parallel/memory_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace dstrain {

// Where memory lives. The buffers a rank holds are either device memory (the device
// allocator's: the backend's ops work on it) or host memory (the host allocator's: offload
// state and staging; and on the CPU backend, everything). Host memory is written by the CPU
// (memset/memcpy); device memory only through the backend (fill_zero, copy, copy_bytes), so
// the same code runs on the CPU backend and on a GPU. On the CPU backend every buffer is host
// memory and every path below is the plain memset/memcpy it always was.

void ShardedModel::zero_buffer(const Buffer& buffer) {
  if (buffer.empty()) return;
  if (buffer.device().is_cpu()) {
    std::memset(buffer.data(), 0, buffer.bytes());
    return;
  }
  // Every buffer here holds 2- or 4-byte elements: view the bytes as 16-bit words.
  DSTRAIN_CHECK(buffer.bytes() % 2 == 0) << buffer.bytes() << " bytes";
  backend_.fill_zero(buffer.view(DType::F16, {static_cast<int64_t>(buffer.bytes() / 2)}), compute_);
}

void ShardedModel::copy_and_wait(void* dst, Device dst_device, const void* src,
                                 Device src_device, size_t bytes) const {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Either side on the device: the backend copies, and the host side is usable on return.
  backend_.copy_bytes(dst, src, bytes, compute_);
  backend_.synchronize(compute_);
}

void ShardedModel::store_from_host(Tensor dst, Tensor host_f32) {
  DSTRAIN_CHECK(host_f32.device.is_cpu() && host_f32.dtype == DType::F32 &&
                dst.numel() == host_f32.numel());
  if (dst.dtype == DType::F32) {
    copy_and_wait(dst.data, dst.device, host_f32.data, host_f32.device, dst.nbytes());
    return;
  }
  // Rounded on the host (the same RNE as the device's __float2half_rn / __float2bfloat16_rn
  // and the CPU backend's, core/dtype.h; a GPU's copy converts device memory only), written
  // where they live, or staged and copied up.
  DSTRAIN_CHECK(dst.dtype == DType::F16 || dst.dtype == DType::BF16) << dst.shape_str();
  std::vector<uint16_t> staging;
  uint16_t* rounded = static_cast<uint16_t*>(dst.data);
  if (!dst.device.is_cpu()) {
    staging.resize(static_cast<size_t>(dst.numel()));
    rounded = staging.data();
  }
  const float* values = host_f32.f32();
  const int64_t n = dst.numel();
// Elementwise: the same bits on any thread count; threads only where they pay.
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 20))
  for (int64_t i = 0; i < n; ++i) {
    rounded[i] = dst.dtype == DType::F16 ? fp32_to_fp16_bits(values[i])
                                         : fp32_to_bf16_bits(values[i]);
  }
  if (!staging.empty()) copy_and_wait(dst.data, dst.device, rounded, Device{}, dst.nbytes());
}

Tensor ShardedModel::on_host(Tensor part, int slot, int block) const {
  if (part.device.is_cpu() || part.numel() == 0) return part;
  Buffer& staging = part_staging_[slot][static_cast<size_t>(block)];
  if (staging.bytes() < part.nbytes()) {
    staging = host_.allocate(MemCategory::CommBuffers, part.nbytes());
  }
  Tensor host = staging.view(part.dtype, {part.numel()});
  copy_and_wait(host.data, host.device, part.data, part.device, part.nbytes());
  return host;
}

ShardedModel::ShardedModel(const ModelConfig& config, const ShardingConfig& sharding,
                           const StateGroups& groups, Backend& backend, Allocator& device,
                           Allocator& host, Stream compute)
    : config_(config),
      layout_(config, sharding.tp, sharding.ep, sharding.ep_rank),
      sharding_(sharding),
      comm_(*groups.data),
      expert_data_(groups.expert_data != nullptr ? *groups.expert_data : *groups.data),
      all_(groups.all != nullptr ? *groups.all : *groups.data),
      tied_(groups.tied),
      tensor_(groups.tensor),
      backend_(backend),
      world_(groups.data->size()),
      rank_(groups.data->rank()),
      dtype_(sharding.param_dtype),
      shard_optimizer_(sharding.zero >= 1),
      shard_grads_(sharding.zero >= 2),
      shard_params_(sharding.zero >= 3),
      offload_params_(sharding.offload_params),
      moment_dtype_(sharding.bf16_optimizer_states ? DType::BF16 : DType::F32),
      gathers_params_(shard_params_ || offload_params_),
      slot_grads_(shard_grads_ || offload_params_),
      tp_grad_parts_(std::any_of(layout_.params().begin(), layout_.params().end(),
                                 [&](const ParamSpec& spec) {
                                   return spec.tp_grad_parts(sharding.sequence_parallel);
                                 })),
      compute_(compute),
      comm_stream_(backend),
      compute_mark_(backend),
      comm_mark_(backend),
      params_written_(backend),
      host_(host) {
  held_ = sharding.blocks;
  DSTRAIN_USER_CHECK(sharding.zero >= 0 && sharding.zero <= 3)
      << "--zero must be 0, 1, 2 or 3, not " << sharding.zero;
  DSTRAIN_CHECK(dtype_ == DType::F32 || dtype_ == DType::F16 || dtype_ == DType::BF16);
  DSTRAIN_CHECK(sharding.tp == 1 || (tensor_ != nullptr && tensor_->size() == sharding.tp))
      << "tensor parallelism over " << sharding.tp << " ranks needs its group";
  // Every buffer is sized by the memory model's functions: the planner's prediction and
  // what this allocates are the same numbers by construction (parallel/memory_model.h).
  DSTRAIN_USER_CHECK(!sharding.bf16_optimizer_states || sharding.offload)
      << kBf16StatesNeedOffload;
  const ShardingSpec spec{sharding.zero,        world_, sharding.offload, dtype_,
                          sharding.offload_params, moment_dtype_};
  DSTRAIN_CHECK(sharding.ep == 1 || groups.expert_data != nullptr)
      << "expert parallelism over " << sharding.ep << " ranks needs its expert-data group";
  auto allocate = [&](const BufferSize& size) {
    if (size.numel == 0) return Buffer();
    return (size.host ? host : device).allocate(size.category, size.bytes());
  };
  if (held_.empty()) {
    for (int b = 0; b < layout_.num_blocks(); ++b) held_.push_back(b);
  }
  const bool holds_embedding =
      std::find(held_.begin(), held_.end(), ParamLayout::embedding_block()) != held_.end();
  DSTRAIN_CHECK(!sharding.tied_copy || (holds_embedding && tied_ != nullptr))
      << "the tied copy of the embedding needs the embedding block and the tied group";
  blocks_.resize(static_cast<size_t>(layout_.num_blocks()));
  std::vector<int64_t> block_numels;
  std::vector<int> block_worlds;
  int embedding_position = -1;
  for (int b : held_) {
    DSTRAIN_CHECK(b >= 0 && b < layout_.num_blocks() && !blocks_[static_cast<size_t>(b)].held)
        << "block " << b << " of " << layout_.num_blocks();
    if (b == ParamLayout::embedding_block())
      embedding_position = static_cast<int>(block_numels.size());
    Block& block = blocks_[static_cast<size_t>(b)];
    // The routed experts are sharded and reduced over the ranks holding the same experts.
    block.comm = layout_.expert_layer(b) >= 0 ? &expert_data_ : &comm_;
    block.world = block.comm->size();
    block.rank = block.comm->rank();
    ShardingSpec block_spec = spec;
    block_spec.world = block.world;
    const BlockStateSizes sizes = block_state_sizes(layout_.block_numel(b), block_spec);
    block.held = true;
    block.numel = sizes.numel;
    block.shard = sizes.shard;
    block.params = allocate(sizes.params);
    block.grads = allocate(sizes.grads);
    block.master = allocate(sizes.master);  // none when the fp32 params on the device are it
    block.exp_avg = allocate(sizes.exp_avg);
    block.exp_avg_sq = allocate(sizes.exp_avg_sq);
    for (Buffer* buffer : {&block.params, &block.grads, &block.master, &block.exp_avg,
                           &block.exp_avg_sq}) {
      zero_buffer(*buffer);
    }
    block_numels.push_back(block.numel);
    block_worlds.push_back(block.world);
  }
  for (std::vector<Buffer>& staging : part_staging_) staging.resize(blocks_.size());
  const RankStateBuffers buffers =
      rank_state_buffers(block_numels, block_worlds, embedding_position, spec);
  for (int s = 0; s < 2; ++s) {
    gather_slots_[s].buffer = allocate(buffers.gathered_params[s]);
    gather_slots_[s].gathered = OwnedEvent(backend);
    gather_slots_[s].released = OwnedEvent(backend);
  }
  grad_slots_[0].buffer = allocate(buffers.embedding_grads);
  grad_slots_[1].buffer = allocate(buffers.block_grads[0]);
  grad_slots_[2].buffer = allocate(buffers.block_grads[1]);
  for (GradSlot& slot : grad_slots_) {
    slot.filled = OwnedEvent(backend);
    slot.reduced = OwnedEvent(backend);
  }
  reduced_ = allocate(buffers.reduced_shard);
  shard_sum_ = allocate(buffers.shard_sum);
  grads_fresh_.assign(blocks_.size(), true);
  for (OwnedEvent& event : replicated_filled_) event = OwnedEvent(backend);
  replicated_event_of_.assign(blocks_.size(), 0);
  reduced_in_backward_.assign(blocks_.size(), false);
  for (int s = 0; s < 2; ++s) {
    host_grads_[s] = allocate(buffers.host_grad_staging[s]);
    host_params_[s] = allocate(buffers.host_param_staging[s]);
    down_[s] = OwnedEvent(backend);
    up_[s] = OwnedEvent(backend);
  }
}

void ShardedModel::compute_waits_for_comm() {
  backend_.record_event(comm_mark_.get(), comm_stream_.get());
  backend_.wait_event(compute_, comm_mark_.get());
}

void ShardedModel::comm_waits_for_compute() {
  backend_.record_event(compute_mark_.get(), compute_);
  backend_.wait_event(comm_stream_.get(), compute_mark_.get());
}

Tensor ShardedModel::flat(const Buffer& buffer, int64_t numel, DType dtype) const {
  return buffer.view(dtype, {numel});
}

Tensor ShardedModel::params_padded(int block) const {
  const Block& b = blocks_[block];
  return flat(b.params, shard_params_ ? b.shard : b.shard * b.world, dtype_);
}

Tensor ShardedModel::grads_padded(int block) const {
  const Block& b = blocks_[block];
  return flat(b.grads, shard_grads_ ? b.shard : b.shard * b.world, dtype_);
}

int64_t ShardedModel::shard_begin(int block) const {
  const Block& b = blocks_[block];
  return std::min<int64_t>(b.rank * b.shard, b.numel);
}

int64_t ShardedModel::shard_count(int block) const {
  const Block& b = blocks_[block];
  return std::min<int64_t>(b.shard, b.numel - shard_begin(block));
}

FlatRange ShardedModel::optimizer_range(int block) const {
  if (!shard_optimizer_) return FlatRange{block, 0, blocks_[block].numel};
  return FlatRange{block, shard_begin(block), shard_count(block)};
}

Tensor ShardedModel::range_params(int block) const {
  const FlatRange range = optimizer_range(block);
  return shard_params_ ? params_padded(block).slice(0, {range.numel})
                       : params_padded(block).slice(range.begin, {range.numel});
}

Tensor ShardedModel::range_grads(int block) const {
  const FlatRange range = optimizer_range(block);
  return shard_grads_ ? grads_padded(block).slice(0, {range.numel})
                      : grads_padded(block).slice(range.begin, {range.numel});
}

Tensor ShardedModel::master(int block) const {
  const Block& b = blocks_[block];
  const FlatRange range = optimizer_range(block);
  if (b.master.empty()) return range_params(block);  // fp32 params on the device
  return flat(b.master, range.numel);
}

Tensor ShardedModel::master_part(int block) const {
  const int64_t offset = shard_optimizer_ ? 0 : shard_begin(block);
  return on_host(master(block).slice(offset, {shard_count(block)}), 0, block);
}

Tensor ShardedModel::moment(int which, int block) const {
  const Block& b = blocks_[block];
  return flat(which == 0 ? b.exp_avg : b.exp_avg_sq, optimizer_range(block).numel, moment_dtype_);
}

Tensor ShardedModel::moment_part(int which, int block) const {
  const int64_t offset = shard_optimizer_ ? 0 : shard_begin(block);
  return on_host(moment(which, block).slice(offset, {shard_count(block)}), 1 + which, block);
}

void ShardedModel::gather_into(int s, int block) {
  GatherSlot& slot = gather_slots_[s];
  const Block& b = blocks_[block];
  const Stream comm = comm_stream_.get();
  slot.block = -1;
  // Not before compute has finished with the block the buffer held, nor before the shards were
  // last written; but not after the work queued since (the block in hand): that is the overlap.
  backend_.wait_event(comm, slot.released.get());
  backend_.wait_event(comm, params_written_.get());
  const Tensor full = flat(slot.buffer, b.shard * b.world, dtype_);
  if (offload_params_) {
    bring_params(block, full);
  } else {
    b.comm->all_gather(full, params_padded(block), comm);
  }
  backend_.record_event(slot.gathered.get(), comm);
  slot.block = block;
}

Tensor ShardedModel::acquire_params(int block) {
  DSTRAIN_CHECK(holds(block)) << "block " << block << " is not held by this pipeline stage";
  const Block& b = blocks_[block];
  if (!gathers_params_) return params_padded(block).slice(0, {b.numel});
  int s = gather_slots_[0].block == block ? 0 : gather_slots_[1].block == block ? 1 : -1;
  if (s < 0) {
    // A free buffer, preferably one that holds no prefetched block.
    const bool free0 = !gather_slots_[0].in_use, free1 = !gather_slots_[1].in_use;
    DSTRAIN_CHECK(free0 || free1) << "block " << block << " acquired while two others are held";
    s = free0 && (!free1 || gather_slots_[0].block < 0) ? 0 : 1;
    gather_into(s, block);
  }
  GatherSlot& slot = gather_slots_[s];
  DSTRAIN_CHECK(!slot.in_use) << "block " << block << " acquired twice";
  slot.in_use = true;
  backend_.wait_event(compute_, slot.gathered.get());
  return flat(slot.buffer, b.shard * b.world, dtype_).slice(0, {b.numel});
}

void ShardedModel::prefetch_params(int block) {
  if (!gathers_params_ || gather_slots_[0].block == block || gather_slots_[1].block == block) {
    return;
  }
  for (int s = 0; s < 2; ++s) {
    if (!gather_slots_[s].in_use) return gather_into(s, block);
  }
}

void ShardedModel::release_params(int block) {
  if (!gathers_params_) return;
  for (GatherSlot& slot : gather_slots_) {
    if (slot.block == block && slot.in_use) {
      backend_.record_event(slot.released.get(), compute_);
      slot.in_use = false;
      return;
    }
  }
  DSTRAIN_CHECK(false) << "release of block " << block << ", which is not acquired";
}

ShardedModel::GradSlot& ShardedModel::grad_slot_of(int block) {
  for (GradSlot& slot : grad_slots_) {
    if (slot.owner == block && !slot.pending) return slot;
  }
  if (block == ParamLayout::embedding_block()) {
    if (grad_slots_[0].pending) flush_reductions();
    return grad_slots_[0];
  }
  for (int s = 1; s <= 2; ++s) {
    if (grad_slots_[s].owner < 0) return grad_slots_[s];
  }
  flush_reductions();  // the rotating buffers wait for their reduce-scatter: issue them
  for (int s = 1; s <= 2; ++s) {
    if (grad_slots_[s].owner < 0) return grad_slots_[s];
  }
  DSTRAIN_CHECK(false) << "block " << block << " wants a gradient buffer while two are held";
  return grad_slots_[1];
}

Tensor ShardedModel::acquire_grads(int block) {
  DSTRAIN_CHECK(holds(block)) << "block " << block << " is not held by this pipeline stage";
  const Block& b = blocks_[block];
  if (!slot_grads_) return grads_padded(block).slice(0, {b.numel});
  GradSlot& slot = grad_slot_of(block);
  Tensor full = flat(slot.buffer, b.shard * b.world, dtype_);
  if (slot.owner != block) {
    DSTRAIN_CHECK(slot.owner < 0) << "block " << block << " wants the gradient buffer block "
                                  << slot.owner << " still holds";
    // Zeroed once its last reduce-scatter has read it (or it went to the host).
    backend_.wait_event(compute_, slot.reduced.get());
    if (offload_params_ && !shard_grads_ && !grads_fresh_[static_cast<size_t>(block)]) {
      // Stages 0-1: backward adds to the step's sum so far, which comes back up.
      const Tensor sum = grads_padded(block);
      traced_copy("offload gradients up, block", block, full.data, sum.data, sum.nbytes());
      compute_waits_for_comm();
    } else {
      backend_.fill_zero(full, compute_);
    }
    slot.owner = block;
  }
  return full.slice(0, {b.numel});
}

void ShardedModel::last_micro_batch() {
  if (!shard_grads_) reduce_in_backward_ = true;
}

void ShardedModel::reduce_replicated(int block) {
  reduce_full(block, grads_padded(block));
  reduced_in_backward_[static_cast<size_t>(block)] = true;
}

void ShardedModel::reduce_full(int block, Tensor full) {
  const Block& b = blocks_[block];
  const Stream comm = comm_stream_.get();
  if (!shard_optimizer_) {
    b.comm->all_reduce(full, ReduceOp::Sum, comm);
  } else {
    Tensor reduced = flat(reduced_, b.shard, dtype_);
    b.comm->reduce_scatter(reduced, full, ReduceOp::Sum, comm);
    backend_.copy(full.slice(b.rank * b.shard, {b.shard}), reduced, comm);
  }
}

void ShardedModel::release_grads(int block) {
  if (!slot_grads_) {
    if (!reduce_in_backward_) return;
    // As at stages 2-3 below: the previous block's reduction goes now, this one's at the next
    // release (the embedding block, the last, at once).
    const int e = next_replicated_event_;
    next_replicated_event_ ^= 1;
    backend_.record_event(replicated_filled_[e].get(), compute_);
    replicated_event_of_[static_cast<size_t>(block)] = e;
    flush_reductions();
    replicated_pending_.push_back(block);
    if (block == ParamLayout::embedding_block()) flush_reductions();
    return;
  }
  GradSlot* released = nullptr;
  for (GradSlot& slot : grad_slots_) {
    if (slot.owner == block && !slot.pending) released = &slot;
  }
  DSTRAIN_CHECK(released != nullptr) << "release of the gradients of block " << block
                                     << ", which are not acquired";
  backend_.record_event(released->filled.get(), compute_);
  // The previous block's reduce-scatter goes now, while this block's backward (just queued)
  // computes; this block's waits for the next release. The embedding block is the last of a
  // backward: nothing comes to overlap with, so it goes at once.
  flush_reductions();
  released->pending = true;
  released->reduce = reduce_in_backward_;
  if (block == ParamLayout::embedding_block()) flush_reductions();
}

void ShardedModel::flush_reductions() {
  const Stream comm = comm_stream_.get();
  for (int block : replicated_pending_) {
    backend_.wait_event(comm, replicated_filled_[replicated_event_of_[block]].get());
    reduce_replicated(block);
  }
  replicated_pending_.clear();
  for (GradSlot& slot : grad_slots_) {
    if (!slot.pending) continue;
    const int block = slot.owner;
    const Block& b = blocks_[block];
    backend_.wait_event(comm, slot.filled.get());
    if (offload_params_) {
      send_gradients_down(block, slot.buffer, slot.reduce);
      backend_.record_event(slot.reduced.get(), comm);
    } else {
      Tensor reduced = flat(reduced_, b.shard, dtype_);
      b.comm->reduce_scatter(reduced, flat(slot.buffer, b.shard * b.world, dtype_),
                             ReduceOp::Sum, comm);
      backend_.record_event(slot.reduced.get(), comm);
      backend_.accumulate(grads_padded(block), reduced, comm);
    }
    slot.pending = false;
    slot.owner = -1;
  }
}

void ShardedModel::begin_step() {
  if (offload_params_) {
    // The host's sums are read as zeros until a block's first gradients go down.
    grads_fresh_.assign(blocks_.size(), true);
    return;
  }
  for (int block : held_) backend_.fill_zero(grads_padded(block), compute_);
}

std::vector<unsigned char> ShardedModel::working_params_bytes(int block) {
  const Tensor params = acquire_params(block);
  std::vector<unsigned char> bytes(params.nbytes());
  copy_and_wait(bytes.data(), Device{}, params.data, params.device, bytes.size());
  release_params(block);
  return bytes;
}

bool ShardedModel::flip_param_bit(int block, int64_t element) {
  if (!holds(block)) return false;
  int64_t index = element;
  if (shard_params_) {
    index -= shard_begin(block);
    if (index < 0 || index >= shard_count(block)) return false;
  }
  const Tensor stored = params_padded(block).slice(index, {1});
  unsigned char bytes[4] = {};
  copy_and_wait(bytes, Device{}, stored.data, stored.device, stored.nbytes());
  bytes[0] ^= 1;  // the lowest bit of the mantissa (little-endian)
  copy_and_wait(stored.data, stored.device, bytes, Device{}, stored.nbytes());
  params_changed();  // a copy brought up before holds the old bit
  return true;
}

void ShardedModel::inject_inf_gradient() { inject_inf_ = true; }

void ShardedModel::write_injected_inf() {
  // In this rank's own range of the reduced gradients, the part finish_step checks. Not
  // before: the reduction is collective and this rank alone is being tested.
  inject_inf_ = false;
  int block = -1;
  for (int b : held_) {
    if (block < 0 && b != ParamLayout::embedding_block() && b != layout_.final_block()) block = b;
  }
  DSTRAIN_CHECK(block >= 0) << "no layer block held";
  Tensor grads = grads_padded(block).slice(shard_grads_ ? 0 : shard_begin(block), {1});
  // +inf in the gradients' own dtype, written as bytes (a GPU's copy converts device memory
  // only): fp32 0x7f800000, fp16 0x7c00, bf16 0x7f80.
  const float inf32 = INFINITY;
  const uint16_t inf16 = grads.dtype == DType::F16 ? fp32_to_fp16_bits(inf32)
                                                   : fp32_to_bf16_bits(inf32);
  const void* inf = grads.dtype == DType::F32 ? static_cast<const void*>(&inf32) : &inf16;
  copy_and_wait(grads.data, grads.device, inf, Device{}, grads.nbytes());
}

// Stages 0 and 1 reduce once per step (what last_micro_batch() did not have reduced during
// backward); 2 and 3 did it block by block during backward: the last of those may still be
// queued. On return the compute stream sees every reduced gradient.
void ShardedModel::finish_reduction() {
  flush_reductions();
  if (!shard_grads_) {
    comm_waits_for_compute();
    for (int block : held_) {
      if (reduced_in_backward_[static_cast<size_t>(block)]) continue;
      if (offload_params_) {
        reduce_offloaded(block);
      } else {
        reduce_replicated(block);
      }
    }
    std::fill(reduced_in_backward_.begin(), reduced_in_backward_.end(), false);
    reduce_in_backward_ = false;
  }
  if (offload_params_) {
    // The host reads the sums from here on; a block that had no gradient this step has zeros.
    backend_.synchronize(comm_stream_.get());
    for (int block : held_) {
      if (grads_fresh_[static_cast<size_t>(block)]) zero_buffer(blocks_[block].grads);
    }
    grads_fresh_.assign(blocks_.size(), false);
  }
  compute_waits_for_comm();
}

// Pipelines: the first stage's embedding and the last stage's tied head are two copies of
// wte. Each copy's optimizer range gets the sum of both gradients (first stage's first, the
// fixed order of the communicator), so both take the same step and stay bitwise equal
// (Megatron's embedding group).
void ShardedModel::sum_tied_gradients() {
  const int block = ParamLayout::embedding_block();
  if (tied_ == nullptr || !holds(block)) return;
  const Stream comm = comm_stream_.get();
  if (offload_params_) {
    on_device_and_back(range_grads(block),
                       [&](Tensor grads) { tied_->all_reduce(grads, ReduceOp::Sum, comm); });
    return;
  }
  comm_waits_for_compute();
  tied_->all_reduce(range_grads(block), ReduceOp::Sum, comm);
  compute_waits_for_comm();
}

template <typename Fn>
void ShardedModel::for_each_param_in(const FlatRange& range, Fn fn) const {
  const int64_t end = range.begin + range.numel;
  for (int index : layout_.block_params(range.block)) {
    const ParamSpec& spec = layout_.params()[static_cast<size_t>(index)];
    const int64_t first = std::max(range.begin, spec.offset);
    const int64_t last = std::min(end, spec.offset + spec.numel());
    if (first < last) fn(first - range.begin, last - first, spec);
  }
}

// Sequence parallelism: each tp rank's gradient of a layernorm covers its own token rows; latent
// attention's latent path: each rank's covers its own heads. The sum over the tp group (in its
// fixed order) is the gradient, the same on every tp rank.
void ShardedModel::sum_tp_partial_gradients() {
  if (tensor_ == nullptr || !tp_grad_parts_) return;
  const bool sp = sharding_.sequence_parallel;
  const Stream comm = comm_stream_.get();
  comm_waits_for_compute();
  for (int block : held_) {
    const FlatRange range = optimizer_range(block);
    auto sum_partial_grads = [&](Tensor grads) {
      for_each_param_in(range, [&](int64_t offset, int64_t count, const ParamSpec& spec) {
        if (spec.tp_grad_parts(sp)) {
          tensor_->all_reduce(grads.slice(offset, {count}), ReduceOp::Sum, comm);
        }
      });
    };
    if (offload_params_) {
      on_device_and_back(range_grads(block), sum_partial_grads);
    } else {
      sum_partial_grads(range_grads(block));
    }
  }
  compute_waits_for_comm();
}

void ShardedModel::append_gradient_check(const FlatRange& part, Tensor grads,
                                         std::vector<GradientTensor>& buffers) const {
  if (tensor_ == nullptr || tensor_->rank() == 0) {
    buffers.push_back({grads, true});
    return;
  }
  // A replicated parameter's gradient is the same on every tp rank: counted on index 0.
  buffers.push_back({grads, false});
  for_each_param_in(part, [&](int64_t offset, int64_t count, const ParamSpec& spec) {
    if (spec.tp_dim >= 0) buffers.push_back({grads.slice(offset, {count}), true});
  });
}

// Every rank looks at its own part of every block it holds (at stage 0 the reduced gradients
// are the same on every data-parallel rank, so each takes its shard's range; the tied copy is
// counted on the first stage only, replicated parameters on tp index 0 only): inf/NaN
// anywhere, agreed by all ranks with a max, and the sum of squares for the global norm. All
// blocks in one check, one wait for the device.
StepStats ShardedModel::agree_on_gradients(const AdamWConfig& adam, double loss_scale) {
  const TraceSpan span(TraceTrack::Compute, TraceKind::Optimizer, "gradient check and norm", -1,
                       compute_);
  const Stream comm = comm_stream_.get();
  std::vector<GradientTensor> buffers;
  std::vector<size_t> block_end;  // the blocks' buffers end here, in held_ order
  GradientStats checked;          // with parameter offload, block by block
  for (int block : held_) {
    const int64_t begin = shard_begin(block), count = shard_count(block);
    if (count == 0 || is_tied_copy(block)) continue;
    Tensor grads = shard_grads_ ? grads_padded(block).slice(0, {count})
                                : grads_padded(block).slice(begin, {count});
    const size_t first = buffers.size();
    append_gradient_check(FlatRange{block, begin, count}, grads, buffers);
    block_end.push_back(buffers.size());
    if (offload_params_) {
      const GradientStats part = offloaded_gradient_stats(
          std::vector<GradientTensor>(buffers.begin() + static_cast<std::ptrdiff_t>(first),
                                      buffers.end()));
      checked.found_inf = checked.found_inf || part.found_inf;
      checked.squares.insert(checked.squares.end(), part.squares.begin(), part.squares.end());
    }
  }
  if (!offload_params_) checked = backend_.gradient_stats(buffers, compute_);
  float found_inf = checked.found_inf ? 1.0f : 0.0f;
  double squares = 0.0;  // block by block, each block's pieces first: a fixed order
  for (size_t block = 0, i = 0; block < block_end.size(); ++block) {
    double block_squares = 0.0;
    for (; i < block_end[block]; ++i) block_squares += checked.squares[i];
    squares += block_squares;
  }
  StepStats stats;
  if (all_.size() > 1) all_.all_reduce(Tensor(&found_inf, DType::F32, {1}), ReduceOp::Max, comm);
  stats.found_inf = found_inf != 0.0f;
  if (stats.found_inf) return stats;  // skipped: no rank updates anything
  if (all_.size() > 1) {
    float partial = static_cast<float>(squares);
    all_.all_reduce(Tensor(&partial, DType::F32, {1}), ReduceOp::Sum, comm);
    squares = partial;
  }
  stats.grad_norm = std::sqrt(squares) / loss_scale;
  stats.clip = clip_coefficient(stats.grad_norm, adam.grad_clip);
  return stats;
}

StepStats ShardedModel::finish_step(const AdamWConfig& adam, double lr, int64_t adam_step,
                                    double loss_scale) {
  finish_reduction();
  if (inject_inf_) write_injected_inf();
  sum_tied_gradients();
  sum_tp_partial_gradients();
  const StepStats stats = agree_on_gradients(adam, loss_scale);
  if (stats.found_inf) return stats;
  const float grad_scale = static_cast<float>(stats.clip / loss_scale);

  // AdamW on this rank's range: on the device, or (offload) on the host.
  if (sharding_.offload) {
    if (offload_params_) {
      offloaded_params_host_step(adam, lr, adam_step, grad_scale);
    } else {
      offload_step(adam, lr, adam_step, grad_scale);
    }
  } else if (offload_params_) {
    offloaded_params_device_step(adam, lr, adam_step, grad_scale);
  } else {
    device_step(adam, lr, adam_step, grad_scale);
  }
  // Stages 1 and 2 hold full parameters: gather the updated shards.
  if (shard_optimizer_ && !shard_params_) {
    if (offload_params_) {
      gather_updated_params_offloaded();
    } else {
      gather_updated_params();
    }
  }
  params_changed();
  return stats;
}

void ShardedModel::device_step(const AdamWConfig& adam, double lr, int64_t adam_step,
                               float grad_scale) {
  // Every block's range in one multi-tensor update.
  const TraceSpan span(TraceTrack::Compute, TraceKind::Optimizer, "adamw", -1, compute_);
  std::vector<AdamWTensors> buffers;
  for (int block : held_) {
    Block& b = blocks_[block];
    const FlatRange range = optimizer_range(block);
    if (range.numel == 0) continue;
    Tensor m = moment(0, block), v = moment(1, block);
    Tensor copy = b.master.empty() ? Tensor() : range_params(block);
    append_adamw_buffers(layout_, tp_rank(), range, master(block), range_grads(block), m, v, copy,
                         adam.weight_decay, buffers);
  }
  backend_.adamw_multi(buffers, adamw_step(adam, lr, adam_step, grad_scale), compute_);
}

void ShardedModel::gather_updated_params() {
  comm_waits_for_compute();
  for (int block : held_) {
    Tensor full = params_padded(block);
    const Block& b = blocks_[block];
    b.comm->all_gather(full, full.slice(b.rank * b.shard, {b.shard}), comm_stream_.get());
  }
}

void ShardedModel::params_changed() {
  ++params_version_;
  compute_waits_for_comm();
  backend_.record_event(params_written_.get(), compute_);
  for (GatherSlot& slot : gather_slots_) slot.block = -1;  // what they hold is stale
}

void ShardedModel::offload_step(const AdamWConfig& adam, double lr, int64_t adam_step,
                                float grad_scale) {
  // A pipeline over the blocks with a range, two staging buffers each way: block k+1's
  // gradients go down while the host updates block k, and block k's weights go up while the
  // host updates block k+1.
  const Stream comm = comm_stream_.get();
  std::vector<int> order;
  for (int block : held_) {
    if (optimizer_range(block).numel > 0) order.push_back(block);
  }
  auto go_down = [&](size_t i) {
    const int block = order[i];
    Tensor grads = range_grads(block);
    Tensor staged = flat(host_grads_[i % 2], grads.numel(), dtype_);
    traced_copy("offload gradients down, block", block, staged.data, grads.data, grads.nbytes());
    backend_.record_event(down_[i % 2].get(), comm);
  };
  comm_waits_for_compute();
  if (!order.empty()) go_down(0);
  for (size_t i = 0; i < order.size(); ++i) {
    const int block = order[i];
    const FlatRange range = optimizer_range(block);
    // Staging i+1 % 2 held block i-1's gradients, which the host has finished with.
    if (i + 1 < order.size()) go_down(i + 1);
    Tensor staged_grads = flat(host_grads_[i % 2], range.numel, dtype_);
    Tensor staged_params = flat(host_params_[i % 2], range.numel, dtype_);
    backend_.synchronize_event(down_[i % 2].get());  // block i's gradients have landed
    backend_.synchronize_event(up_[i % 2].get());    // block i-2's weights have left
    // The update writes only the tensors' elements: the gaps between them (alignment,
    // padded vocabulary rows) must go up as the zeros they are.
    {
      const TraceSpan span(TraceTrack::HostOptimizer, TraceKind::Optimizer, "host adamw block",
                           block);
      std::memset(staged_params.data, 0, staged_params.nbytes());
      Tensor m = moment(0, block), v = moment(1, block);
      host_adamw_update_range(layout_, tp_rank(), range, master(block), staged_grads, m, v,
                              staged_params, adam, lr, adam_step, grad_scale,
                              sharding_.host_threads);
    }
    Tensor device_params = range_params(block);
    traced_copy("offload weights up, block", block, device_params.data, staged_params.data,
                staged_params.nbytes());
    backend_.record_event(up_[i % 2].get(), comm);
  }
}

void ShardedModel::set_full_params(const std::vector<Tensor>& full_blocks) {
  DSTRAIN_CHECK(static_cast<int>(full_blocks.size()) == num_blocks());
  backend_.synchronize(comm_stream_.get());  // no gather still reads what is overwritten
  for (int block : held_) {
    const Block& b = blocks_[block];
    Tensor full = full_blocks[block];
    DSTRAIN_CHECK(full.numel() == b.numel && full.dtype == DType::F32);
    const int64_t begin = shard_begin(block), count = shard_count(block);
    if (shard_params_) {
      store_from_host(params_padded(block).slice(0, {count}), full.slice(begin, {count}));
    } else {
      store_from_host(params_padded(block).slice(0, {b.numel}), full);
    }
    if (!b.master.empty()) {
      const FlatRange range = optimizer_range(block);
      copy_and_wait(b.master.data(), b.master.device(), full.f32() + range.begin, full.device,
                    range.numel * sizeof(float));
    }
  }
  params_changed();
}

void ShardedModel::set_param_values(const ParamSpec& spec, const std::vector<float>& values) {
  DSTRAIN_CHECK(holds(spec.block) && static_cast<int64_t>(values.size()) == spec.numel())
      << spec.name << ": " << values.size() << " values";
  backend_.synchronize(comm_stream_.get());  // no gather still reads what is overwritten
  const int block = spec.block;
  const Block& b = blocks_[block];
  const Tensor source(const_cast<float*>(values.data()), DType::F32, {spec.numel()});
  // write(at, part): the tensor's elements within the block's [begin, begin + count), at `at`
  // from `begin`.
  const auto within = [&](int64_t begin, int64_t count, const auto& write) {
    const int64_t first = std::max(begin, spec.offset);
    const int64_t last = std::min(begin + count, spec.offset + spec.numel());
    if (first < last) write(first - begin, source.slice(first - spec.offset, {last - first}));
  };
  const auto store_params = [&](int64_t at, Tensor part) {
    store_from_host(params_padded(block).slice(at, {part.numel()}), part);
  };
  if (shard_params_) {
    within(shard_begin(block), shard_count(block), store_params);
  } else {
    within(0, b.numel, store_params);
  }
  if (!b.master.empty()) {
    const FlatRange range = optimizer_range(block);
    within(range.begin, range.numel, [&](int64_t at, Tensor part) {
      copy_and_wait(static_cast<char*>(b.master.data()) + at * sizeof(float), b.master.device(),
                    part.data, part.device, static_cast<size_t>(part.nbytes()));
    });
  }
  params_changed();
}

void ShardedModel::gather_to_host(Tensor local, int block, Tensor full) const {
  const Block& b = blocks_[block];
  DSTRAIN_CHECK(full.device.is_cpu() && full.dtype == DType::F32 && full.numel() >= b.numel);
  if (!shard_optimizer_) {
    copy_and_wait(full.data, full.device, local.data, local.device, b.numel * sizeof(float));
    return;
  }
  // Every rank's shard_count F32 elements, gathered through host memory (shards of b.shard,
  // the last padded with zeros).
  std::vector<float> mine(static_cast<size_t>(b.shard), 0.0f);
  copy_and_wait(mine.data(), Device{}, local.data, local.device,
                shard_count(block) * sizeof(float));
  std::vector<float> all(static_cast<size_t>(b.shard * b.world));
  b.comm->all_gather(Tensor(all.data(), DType::F32, {b.shard * b.world}),
                     Tensor(mine.data(), DType::F32, {b.shard}), nullptr);
  std::memcpy(full.data, all.data(), b.numel * sizeof(float));
}

void ShardedModel::get_full_param_block(int block, const Tensor& full) {
  DSTRAIN_CHECK(std::find(held_.begin(), held_.end(), block) != held_.end())
      << "block " << block << " is not held by this rank";
  gather_to_host(master(block), block, full);
}

void ShardedModel::set_full_moments(int which, const std::vector<Tensor>& full_blocks) {
  for (int block : held_) {
    const FlatRange range = optimizer_range(block);
    const Tensor stored = moment(which, block);
    const Tensor full = full_blocks[block];
    if (moment_dtype_ == DType::BF16) {  // on the host: rounded as the host's AdamW stores them
      auto* bits = static_cast<uint16_t*>(stored.data);
#pragma omp parallel for schedule(static) if (range.numel > (int64_t{1} << 20))
      for (int64_t i = 0; i < range.numel; ++i) {
        bits[i] = fp32_to_bf16_bits(full.f32()[range.begin + i]);
      }
      continue;
    }
    copy_and_wait(stored.data, stored.device, full.f32() + range.begin, full.device,
                  range.numel * sizeof(float));
  }
}

void ShardedModel::get_full_moments(int which, const std::vector<Tensor>& full_blocks) {
  for (int block : held_) {
    const Tensor stored = moment(which, block);
    if (moment_dtype_ == DType::F32) {
      gather_to_host(stored, block, full_blocks[block]);
      continue;
    }
    // bf16 moments live on the host (they need offload): widened, exactly.
    std::vector<float> wide(static_cast<size_t>(stored.numel()));
    const auto* bits = static_cast<const uint16_t*>(stored.data);
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = bf16_bits_to_fp32(bits[i]);
    gather_to_host(Tensor(wide.data(), DType::F32, {stored.numel()}), block, full_blocks[block]);
  }
}

}  // namespace dstrain
