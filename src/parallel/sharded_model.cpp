#include "parallel/sharded_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace dstrain {

int64_t shard_numel(int64_t block_numel, int world) {
  DSTRAIN_CHECK(world >= 1 && block_numel >= 0);
  return (block_numel + world - 1) / world;
}

ShardedModel::ShardedModel(const ModelConfig& config, const ShardingConfig& sharding,
                           Communicator& comm, Backend& backend, Allocator& device,
                           Allocator& host)
    : config_(config),
      layout_(config),
      sharding_(sharding),
      comm_(comm),
      backend_(backend),
      world_(comm.size()),
      rank_(comm.rank()),
      dtype_(sharding.param_dtype),
      shard_optimizer_(sharding.zero >= 1),
      shard_grads_(sharding.zero >= 2),
      shard_params_(sharding.zero >= 3) {
  DSTRAIN_USER_CHECK(sharding.zero >= 0 && sharding.zero <= 3)
      << "--zero must be 0, 1, 2 or 3, not " << sharding.zero;
  DSTRAIN_CHECK(dtype_ == DType::F32 || dtype_ == DType::F16 || dtype_ == DType::BF16);
  const size_t width = dtype_size(dtype_), kF32 = sizeof(float);
  // The params are the master weights only when they are fp32 and on the device.
  const bool separate_master = dtype_ != DType::F32 || sharding.offload;
  Allocator& state_allocator = sharding.offload ? host : device;
  const MemCategory state_category =
      sharding.offload ? MemCategory::OptimizerStateHost : MemCategory::OptimizerState;
  const MemCategory master_category =
      sharding.offload ? MemCategory::OptimizerStateHost : MemCategory::MasterWeights;
  int64_t max_padded = 0, max_padded_layer = 0, max_shard = 0, max_optimizer = 0;
  for (int b = 0; b < layout_.num_blocks(); ++b) {
    Block block;
    block.numel = layout_.block_numel(b);
    block.shard = shard_numel(block.numel, world_);
    const int64_t padded = block.shard * world_;
    // Stage 0 updates the whole block: its optimizer range is the padded full buffer.
    const int64_t optimizer_count = shard_optimizer_ ? block.shard : padded;
    block.params = device.allocate(MemCategory::Parameters,
                                   (shard_params_ ? block.shard : padded) * width);
    block.grads = device.allocate(MemCategory::Gradients,
                                  (shard_grads_ ? block.shard : padded) * width);
    if (separate_master) {
      block.master = state_allocator.allocate(master_category, optimizer_count * kF32);
    }
    block.exp_avg = state_allocator.allocate(state_category, optimizer_count * kF32);
    block.exp_avg_sq = state_allocator.allocate(state_category, optimizer_count * kF32);
    for (Buffer* buffer : {&block.params, &block.grads, &block.master, &block.exp_avg,
                           &block.exp_avg_sq}) {
      if (!buffer->empty()) std::memset(buffer->data(), 0, buffer->bytes());
    }
    max_padded = std::max(max_padded, padded);
    if (b != ParamLayout::embedding_block()) max_padded_layer = std::max(max_padded_layer, padded);
    max_shard = std::max(max_shard, block.shard);
    max_optimizer = std::max(max_optimizer, optimizer_count);
    blocks_.push_back(std::move(block));
  }
  if (shard_params_) {
    for (Buffer& buffer : gathered_) {
      buffer = device.allocate(MemCategory::GatheredParams, max_padded * width);
    }
  }
  if (shard_grads_) {
    const int64_t embedding_padded = blocks_[0].shard * world_;
    block_grads_[0] = device.allocate(MemCategory::CommBuffers, embedding_padded * width);
    block_grads_[1] = device.allocate(MemCategory::CommBuffers, max_padded_layer * width);
  }
  if (shard_optimizer_) {
    // The shard a reduce-scatter delivers before it is added to (or copied into) the gradients.
    reduced_ = device.allocate(MemCategory::CommBuffers, max_shard * width);
  }
  if (sharding.offload) {
    host_grads_ = host.allocate(MemCategory::CommBuffers, max_optimizer * width);
    host_params_ = host.allocate(MemCategory::CommBuffers, max_optimizer * width);
  }
}

Tensor ShardedModel::flat(const Buffer& buffer, int64_t numel, DType dtype) const {
  return buffer.view(dtype, {numel});
}

Tensor ShardedModel::params_padded(int block) const {
  const Block& b = blocks_[block];
  return flat(b.params, shard_params_ ? b.shard : b.shard * world_, dtype_);
}

Tensor ShardedModel::grads_padded(int block) const {
  const Block& b = blocks_[block];
  return flat(b.grads, shard_grads_ ? b.shard : b.shard * world_, dtype_);
}

int64_t ShardedModel::shard_begin(int block) const {
  return std::min<int64_t>(rank_ * blocks_[block].shard, blocks_[block].numel);
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
  return master(block).slice(offset, {shard_count(block)});
}

Tensor ShardedModel::moment_part(int which, int block) const {
  const Block& b = blocks_[block];
  const FlatRange range = optimizer_range(block);
  const int64_t offset = shard_optimizer_ ? 0 : shard_begin(block);
  return flat(which == 0 ? b.exp_avg : b.exp_avg_sq, range.numel).slice(offset, {shard_count(block)});
}

Tensor ShardedModel::acquire_params(int block) {
  const Block& b = blocks_[block];
  if (!shard_params_) return params_padded(block).slice(0, {b.numel});
  const int slot = next_gather_slot_;
  next_gather_slot_ ^= 1;
  Tensor gathered = flat(gathered_[slot], b.shard * world_, dtype_);
  comm_.all_gather(gathered, params_padded(block), nullptr);
  gathered_block_[slot] = block;
  return gathered.slice(0, {b.numel});
}

void ShardedModel::release_params(int block) {}

Tensor ShardedModel::acquire_grads(int block) {
  const Block& b = blocks_[block];
  if (!shard_grads_) return grads_padded(block).slice(0, {b.numel});
  const int slot = block == ParamLayout::embedding_block() ? 0 : 1;
  Tensor full = flat(block_grads_[slot], b.shard * world_, dtype_);
  if (block_grads_owner_[slot] != block) {
    DSTRAIN_CHECK(block_grads_owner_[slot] < 0)
        << "block " << block << " wants the gradient buffer block "
        << block_grads_owner_[slot] << " still holds";
    backend_.fill_zero(full, nullptr);
    block_grads_owner_[slot] = block;
  }
  return full.slice(0, {b.numel});
}

void ShardedModel::release_grads(int block) {
  if (!shard_grads_) return;
  const int slot = block == ParamLayout::embedding_block() ? 0 : 1;
  DSTRAIN_CHECK(block_grads_owner_[slot] == block);
  const Block& b = blocks_[block];
  Tensor reduced = flat(reduced_, b.shard, dtype_);
  comm_.reduce_scatter(reduced, flat(block_grads_[slot], b.shard * world_, dtype_),
                       ReduceOp::Sum, nullptr);
  backend_.accumulate(grads_padded(block), reduced, nullptr);
  block_grads_owner_[slot] = -1;
}

void ShardedModel::begin_step() {
  for (int block = 0; block < num_blocks(); ++block) {
    backend_.fill_zero(grads_padded(block), nullptr);
  }
}

void ShardedModel::inject_inf_gradient() {
  Tensor grads = grads_padded(ParamLayout::layer_block(0));
  const float inf = INFINITY;
  backend_.copy(grads.slice(0, {1}), Tensor(const_cast<float*>(&inf), DType::F32, {1}), nullptr);
}

StepStats ShardedModel::finish_step(const AdamWConfig& adam, double lr, int64_t adam_step,
                                    double loss_scale) {
  // 1. Finish the gradient reduction (stages 0 and 1 reduce once per step; 2 and 3 did it
  // block by block during backward).
  if (!shard_grads_) {
    for (int block = 0; block < num_blocks(); ++block) {
      const Block& b = blocks_[block];
      Tensor full = grads_padded(block);
      if (!shard_optimizer_) {
        comm_.all_reduce(full, ReduceOp::Sum, nullptr);
      } else {
        Tensor reduced = flat(reduced_, b.shard, dtype_);
        comm_.reduce_scatter(reduced, full, ReduceOp::Sum, nullptr);
        backend_.copy(full.slice(rank_ * b.shard, {b.shard}), reduced, nullptr);
      }
    }
  }

  // 2. Every rank looks at its own shard of every block (at stage 0 the reduced gradients are
  // the same everywhere, so each takes its shard's range): inf/NaN anywhere, agreed by all
  // ranks with a max, and the sum of squares for the global norm.
  float found_inf = 0.0f;
  double squares = 0.0;
  for (int block = 0; block < num_blocks(); ++block) {
    const int64_t begin = shard_begin(block), count = shard_count(block);
    if (count == 0) continue;
    Tensor grads = shard_grads_ ? grads_padded(block).slice(0, {count})
                                : grads_padded(block).slice(begin, {count});
    if (backend_.has_inf_or_nan(grads, nullptr)) found_inf = 1.0f;
    squares += backend_.sum_squares(grads, nullptr);
  }
  StepStats stats;
  if (world_ > 1) {
    comm_.all_reduce(Tensor(&found_inf, DType::F32, {1}), ReduceOp::Max, nullptr);
  }
  stats.found_inf = found_inf != 0.0f;
  if (stats.found_inf) return stats;  // skipped: no rank updates anything
  if (world_ > 1) {
    float partial = static_cast<float>(squares);
    comm_.all_reduce(Tensor(&partial, DType::F32, {1}), ReduceOp::Sum, nullptr);
    squares = partial;
  }
  stats.grad_norm = std::sqrt(squares) / loss_scale;
  stats.clip = clip_coefficient(stats.grad_norm, adam.grad_clip);
  const float grad_scale = static_cast<float>(stats.clip / loss_scale);

  // 3. AdamW on this rank's range: on the device, or (offload) on the host with the
  // gradients streamed down and the updated weights streamed back up.
  for (int block = 0; block < num_blocks(); ++block) {
    Block& b = blocks_[block];
    const FlatRange range = optimizer_range(block);
    if (range.numel == 0) continue;
    Tensor grads = range_grads(block);
    Tensor m = flat(b.exp_avg, range.numel), v = flat(b.exp_avg_sq, range.numel);
    Tensor device_params = range_params(block);
    if (sharding_.offload) {
      Tensor staged_grads = flat(host_grads_, range.numel, dtype_);
      Tensor staged_params = flat(host_params_, range.numel, dtype_);
      backend_.copy_bytes(staged_grads.data, grads.data, grads.nbytes(), nullptr);
      // The update writes only the tensors' elements: the gaps between them (alignment,
      // padded vocabulary rows) must go up as the zeros they are.
      std::memset(staged_params.data, 0, staged_params.nbytes());
      host_adamw_update_range(layout_, range, master(block), staged_grads, m, v, staged_params,
                              adam, lr, adam_step, grad_scale, sharding_.host_threads);
      backend_.copy_bytes(device_params.data, staged_params.data, staged_params.nbytes(), nullptr);
    } else {
      Tensor copy = b.master.empty() ? Tensor() : device_params;
      adamw_update_range(backend_, layout_, range, master(block), grads, m, v, copy, adam, lr,
                         adam_step, grad_scale, nullptr);
    }
  }
  // 4. Stages 1 and 2 hold full parameters: gather the updated shards.
  if (shard_optimizer_ && !shard_params_) {
    for (int block = 0; block < num_blocks(); ++block) {
      Tensor full = params_padded(block);
      const int64_t shard = blocks_[block].shard;
      comm_.all_gather(full, full.slice(rank_ * shard, {shard}), nullptr);
    }
  }
  return stats;
}

void ShardedModel::set_full_params(const std::vector<Tensor>& full_blocks) {
  DSTRAIN_CHECK(static_cast<int>(full_blocks.size()) == num_blocks());
  for (int block = 0; block < num_blocks(); ++block) {
    const Block& b = blocks_[block];
    Tensor full = full_blocks[block];
    DSTRAIN_CHECK(full.numel() == b.numel && full.dtype == DType::F32);
    const int64_t begin = shard_begin(block), count = shard_count(block);
    if (shard_params_) {
      backend_.copy(params_padded(block).slice(0, {count}), full.slice(begin, {count}), nullptr);
    } else {
      backend_.copy(params_padded(block).slice(0, {b.numel}), full, nullptr);
    }
    if (!b.master.empty()) {
      const FlatRange range = optimizer_range(block);
      std::memcpy(b.master.data(), full.f32() + range.begin, range.numel * sizeof(float));
    }
  }
}

namespace {
// Gathers every rank's `count` F32 elements at `local` into full[0, numel) (shards of `shard`).
void gather_shards(Communicator& comm, const float* local, int64_t count, int64_t shard,
                   int64_t numel, float* full) {
  std::vector<float> mine(static_cast<size_t>(shard), 0.0f);
  std::memcpy(mine.data(), local, count * sizeof(float));
  std::vector<float> all(static_cast<size_t>(shard * comm.size()));
  comm.all_gather(Tensor(all.data(), DType::F32, {shard * comm.size()}),
                  Tensor(mine.data(), DType::F32, {shard}), nullptr);
  std::memcpy(full, all.data(), numel * sizeof(float));
}
}  // namespace

void ShardedModel::get_full_params(const std::vector<Tensor>& full_blocks) {
  for (int block = 0; block < num_blocks(); ++block) {
    const Block& b = blocks_[block];
    if (shard_optimizer_) {
      gather_shards(comm_, master(block).f32(), shard_count(block), b.shard, b.numel,
                    full_blocks[block].f32());
    } else {
      std::memcpy(full_blocks[block].f32(), master(block).f32(), b.numel * sizeof(float));
    }
  }
}

void ShardedModel::set_full_moments(int which, const std::vector<Tensor>& full_blocks) {
  for (int block = 0; block < num_blocks(); ++block) {
    Block& b = blocks_[block];
    const FlatRange range = optimizer_range(block);
    Buffer& moment = which == 0 ? b.exp_avg : b.exp_avg_sq;
    std::memcpy(moment.data(), full_blocks[block].f32() + range.begin, range.numel * sizeof(float));
  }
}

void ShardedModel::get_full_moments(int which, const std::vector<Tensor>& full_blocks) {
  for (int block = 0; block < num_blocks(); ++block) {
    const Block& b = blocks_[block];
    const Buffer& moment = which == 0 ? b.exp_avg : b.exp_avg_sq;
    if (shard_optimizer_) {
      gather_shards(comm_, static_cast<const float*>(moment.data()), shard_count(block),
                    b.shard, b.numel, full_blocks[block].f32());
    } else {
      std::memcpy(full_blocks[block].f32(), moment.data(), b.numel * sizeof(float));
    }
  }
}

}  // namespace dstrain
