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
      shard_optimizer_(sharding.zero >= 1),
      shard_grads_(sharding.zero >= 2),
      shard_params_(sharding.zero >= 3) {
  DSTRAIN_USER_CHECK(sharding.zero >= 0 && sharding.zero <= 3)
      << "--zero must be 0, 1, 2 or 3, not " << sharding.zero;
  constexpr size_t kF32 = sizeof(float);
  Allocator& state_allocator = sharding.offload ? host : device;
  const MemCategory state_category =
      sharding.offload ? MemCategory::OptimizerStateHost : MemCategory::OptimizerState;
  int64_t max_padded = 0, max_padded_layer = 0, max_shard = 0, max_optimizer = 0;
  for (int b = 0; b < layout_.num_blocks(); ++b) {
    Block block;
    block.numel = layout_.block_numel(b);
    block.shard = shard_numel(block.numel, world_);
    const int64_t padded = block.shard * world_;
    const int64_t optimizer_count = shard_optimizer_ ? block.shard : padded;
    block.params = device.allocate(MemCategory::Parameters,
                                   (shard_params_ ? block.shard : padded) * kF32);
    block.grads = device.allocate(MemCategory::Gradients,
                                  (shard_grads_ ? block.shard : padded) * kF32);
    if (sharding.offload) {
      block.master = host.allocate(MemCategory::OptimizerStateHost, optimizer_count * kF32);
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
      buffer = device.allocate(MemCategory::GatheredParams, max_padded * kF32);
    }
  }
  if (shard_grads_) {
    const int64_t embedding_padded = blocks_[0].shard * world_;
    block_grads_[0] = device.allocate(MemCategory::CommBuffers, embedding_padded * kF32);
    block_grads_[1] = device.allocate(MemCategory::CommBuffers, max_padded_layer * kF32);
  }
  if (shard_optimizer_) {
    // The shard a reduce-scatter delivers before it is added to (or copied into) the gradients.
    reduced_ = device.allocate(MemCategory::CommBuffers, max_shard * kF32);
  }
  if (sharding.offload) {
    host_grads_ = host.allocate(MemCategory::CommBuffers, max_optimizer * kF32);
  }
}

Tensor ShardedModel::flat(const Buffer& buffer, int64_t numel) const {
  return buffer.view(DType::F32, {numel});
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

Tensor ShardedModel::params_full(int block) const {
  DSTRAIN_CHECK(!shard_params_);
  return flat(blocks_[block].params, blocks_[block].numel);
}

Tensor ShardedModel::acquire_params(int block) {
  const Block& b = blocks_[block];
  if (!shard_params_) return params_full(block);
  const int slot = next_gather_slot_;
  next_gather_slot_ ^= 1;
  Tensor gathered = flat(gathered_[slot], b.shard * world_);
  comm_.all_gather(gathered, flat(b.params, b.shard), nullptr);
  gathered_block_[slot] = block;
  return gathered.slice(0, {b.numel});
}

void ShardedModel::release_params(int block) {}

Tensor ShardedModel::acquire_grads(int block) {
  const Block& b = blocks_[block];
  if (!shard_grads_) return flat(b.grads, b.numel);
  const int slot = block == ParamLayout::embedding_block() ? 0 : 1;
  Tensor full = flat(block_grads_[slot], b.shard * world_);
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
  Tensor reduced = flat(reduced_, b.shard);
  comm_.reduce_scatter(reduced, flat(block_grads_[slot], b.shard * world_), ReduceOp::Sum,
                       nullptr);
  backend_.accumulate(flat(b.grads, b.shard), reduced, nullptr);
  block_grads_owner_[slot] = -1;
}

void ShardedModel::begin_step() {
  for (Block& block : blocks_) {
    backend_.fill_zero(block.grads.view(DType::F32, {int64_t(block.grads.bytes() / 4)}), nullptr);
  }
}

StepStats ShardedModel::finish_step(const AdamWConfig& adam, double lr, int64_t step) {
  // 1. Finish the gradient reduction (stages 0 and 1 reduce once per step).
  for (int block = 0; block < num_blocks(); ++block) {
    Block& b = blocks_[block];
    if (shard_grads_) continue;  // reduced block by block during backward
    Tensor full = flat(b.grads, b.shard * world_);
    if (!shard_optimizer_) {
      comm_.all_reduce(full, ReduceOp::Sum, nullptr);
    } else {
      Tensor reduced = flat(reduced_, b.shard);
      comm_.reduce_scatter(reduced, full, ReduceOp::Sum, nullptr);
      backend_.copy(full.slice(rank_ * b.shard, {b.shard}), reduced, nullptr);
    }
  }
  // The gradient of this rank's optimizer range, per block.
  auto range_grads = [&](int block) {
    const Block& b = blocks_[block];
    const FlatRange range = optimizer_range(block);
    if (shard_grads_) return flat(b.grads, b.shard).slice(0, {range.numel});
    return flat(b.grads, b.shard * world_).slice(range.begin, {range.numel});
  };

  // 2. The global norm: every rank sums the squares of its own shard of every block (at
  // stage 0 the full gradients are identical everywhere, so each takes its shard's range).
  double squares = 0.0;
  for (int block = 0; block < num_blocks(); ++block) {
    const Block& b = blocks_[block];
    const int64_t begin = shard_begin(block), count = shard_count(block);
    if (count == 0) continue;
    Tensor grads = shard_grads_ ? flat(b.grads, b.shard).slice(0, {count})
                                : flat(b.grads, b.shard * world_).slice(begin, {count});
    squares += backend_.sum_squares(grads, nullptr);
  }
  if (world_ > 1) {
    float partial = static_cast<float>(squares);
    comm_.all_reduce(Tensor(&partial, DType::F32, {1}), ReduceOp::Sum, nullptr);
    squares = partial;
  }
  StepStats stats;
  stats.grad_norm = std::sqrt(squares);
  stats.clip = clip_coefficient(stats.grad_norm, adam.grad_clip);

  // 3. AdamW on this rank's range, on the device or (offload) on the host.
  for (int block = 0; block < num_blocks(); ++block) {
    Block& b = blocks_[block];
    const FlatRange range = optimizer_range(block);
    if (range.numel == 0) continue;
    Tensor grads = range_grads(block);
    Tensor m = flat(b.exp_avg, range.numel), v = flat(b.exp_avg_sq, range.numel);
    Tensor device_params =
        shard_params_ ? flat(b.params, b.shard).slice(0, {range.numel})
                      : flat(b.params, b.shard * world_).slice(range.begin, {range.numel});
    if (sharding_.offload) {
      Tensor staged = flat(host_grads_, range.numel);
      backend_.copy_bytes(staged.data, grads.data, grads.nbytes(), nullptr);  // down
      Tensor master = flat(b.master, range.numel);
      adamw_update_range(backend_, layout_, range, master, staged, m, v, Tensor(), adam, lr,
                         step, stats.clip, nullptr);
      backend_.copy_bytes(device_params.data, master.data, master.nbytes(), nullptr);  // up
    } else {
      adamw_update_range(backend_, layout_, range, device_params, grads, m, v, Tensor(), adam,
                         lr, step, stats.clip, nullptr);
    }
  }
  // 4. Stages 1 and 2 hold full parameters: gather the updated shards.
  if (shard_optimizer_ && !shard_params_) {
    for (int block = 0; block < num_blocks(); ++block) {
      Block& b = blocks_[block];
      Tensor full = flat(b.params, b.shard * world_);
      comm_.all_gather(full, full.slice(rank_ * b.shard, {b.shard}), nullptr);
    }
  }
  return stats;
}

void ShardedModel::set_full_params(const std::vector<Tensor>& full_blocks) {
  DSTRAIN_CHECK(static_cast<int>(full_blocks.size()) == num_blocks());
  for (int block = 0; block < num_blocks(); ++block) {
    Block& b = blocks_[block];
    const float* full = full_blocks[block].f32();
    DSTRAIN_CHECK(full_blocks[block].numel() == b.numel);
    const int64_t begin = shard_begin(block), count = shard_count(block);
    if (shard_params_) {
      std::memcpy(b.params.data(), full + begin, count * sizeof(float));
    } else {
      std::memcpy(b.params.data(), full, b.numel * sizeof(float));
    }
    if (sharding_.offload) {
      const FlatRange range = optimizer_range(block);
      std::memcpy(b.master.data(), full + range.begin, range.numel * sizeof(float));
    }
  }
}

namespace {
// Gathers every rank's `count` elements at `local` into full[0, numel) (shards of `shard`).
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
    if (shard_params_) {
      gather_shards(comm_, static_cast<const float*>(b.params.data()), shard_count(block),
                    b.shard, b.numel, full_blocks[block].f32());
    } else {
      std::memcpy(full_blocks[block].f32(), b.params.data(), b.numel * sizeof(float));
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
