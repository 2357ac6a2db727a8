// The order in which ShardedModel issues its collectives around the model's work: what makes
// communication overlap compute on a GPU (src/parallel/sharded_model.h, "Streams"). The CPU
// backend cannot time anything, so these tests check the structure: with ZeRO-3 the gather of
// the next block is issued while the current one is in hand (never between a release and the
// next acquire), and a block's reduction (reduce-scatter or all-reduce) waits for the next
// block's backward to be queued. That the results do not change is the equivalence tests' job.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/ops.h"
#include "model/gpt2.h"
#include "parallel/sharded_model.h"

namespace dstrain {
namespace {

// One rank's log: "A3" acquire_params(3), "P3" prefetch, "R3" release, "a3"/"r3" acquire and
// release of gradients, "G" an all-gather, "S" a reduce-scatter or an all-reduce.
using Log = std::vector<std::string>;

class LoggingCommunicator final : public Communicator {
 public:
  LoggingCommunicator(Communicator& inner, Log& log) : inner_(inner), log_(log) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void all_reduce(Tensor buffer, ReduceOp op, Stream stream) override {
    log_.push_back("S");  // a reduction, like a reduce-scatter
    inner_.all_reduce(buffer, op, stream);
  }
  void reduce_scatter(Tensor output, Tensor input, ReduceOp op, Stream stream) override {
    log_.push_back("S");
    inner_.reduce_scatter(output, input, op, stream);
  }
  void all_gather(Tensor output, Tensor input, Stream stream) override {
    log_.push_back("G");
    inner_.all_gather(output, input, stream);
  }
  void broadcast(Tensor buffer, int root, Stream stream) override {
    inner_.broadcast(buffer, root, stream);
  }
  void send(Tensor buffer, int peer, Stream stream) override { inner_.send(buffer, peer, stream); }
  void recv(Tensor buffer, int peer, Stream stream) override { inner_.recv(buffer, peer, stream); }
  void exchange(const std::vector<P2POp>& ops, Stream stream) override {
    inner_.exchange(ops, stream);
  }
  void barrier() override { inner_.barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_.split(color, key);
  }

 private:
  Communicator& inner_;
  Log& log_;
};

class LoggingProvider final : public ParamProvider {
 public:
  LoggingProvider(ParamProvider& inner, Log& log) : inner_(inner), log_(log) {}
  Tensor acquire_params(int block) override {
    log_.push_back("A" + std::to_string(block));
    return inner_.acquire_params(block);
  }
  void prefetch_params(int block) override {
    log_.push_back("P" + std::to_string(block));
    inner_.prefetch_params(block);
  }
  void release_params(int block) override {
    log_.push_back("R" + std::to_string(block));
    inner_.release_params(block);
  }
  Tensor acquire_grads(int block) override {
    log_.push_back("a" + std::to_string(block));
    return inner_.acquire_grads(block);
  }
  void release_grads(int block) override {
    log_.push_back("r" + std::to_string(block));
    inner_.release_grads(block);
  }

 private:
  ParamProvider& inner_;
  Log& log_;
};

ModelConfig four_layers() {
  ModelConfig c;
  c.name = "four-layers";
  c.vocab_size = 53;
  c.n_positions = 16;
  c.n_embd = 16;
  c.n_layer = 4;
  c.n_head = 2;
  return c;
}

// One forward + backward on rank 0 of 2 ranks at `zero`; the log from the first forward on.
Log train_step_log(int zero) {
  const ModelConfig config = four_layers();
  Log log;
  run_local_ranks(2, 60.0, [&](Communicator& world) {
    Log mine;
    LoggingCommunicator comm(world, mine);
    std::unique_ptr<Backend> backend = make_cpu_backend(1);
    std::unique_ptr<Allocator> device = make_cpu_allocator(world.rank());
    std::unique_ptr<Allocator> host = make_cpu_allocator(world.rank());
    ShardingConfig sharding;
    sharding.zero = zero;
    ShardedModel state(config, sharding, comm, *backend, *device,
                       *host);
    std::vector<std::vector<float>> storage;
    std::vector<Tensor> blocks;
    for (int b = 0; b < state.num_blocks(); ++b) {
      storage.emplace_back(static_cast<size_t>(state.layout().block_numel(b)));
      blocks.push_back(Tensor(storage.back().data(), DType::F32, {state.layout().block_numel(b)}));
    }
    init_model_parameters(state.layout(), config, 7, blocks);
    state.set_full_params(blocks);
    Gpt2 model(config, *backend, *device, 2, 8, DType::F32, true, Recompute::None);
    std::vector<int32_t> tokens(16), targets(16);
    for (int i = 0; i < 16; ++i) {
      tokens[i] = (i * 7 + world.rank()) % 53;
      targets[i] = (i * 5 + 3) % 53;
    }
    const Tensor inputs(tokens.data(), DType::I32, {2, 8});
    const Tensor wanted(targets.data(), DType::I32, {2, 8});
    mine.clear();
    LoggingProvider provider(state, mine);
    state.begin_step();
    state.last_micro_batch();  // the step's only micro-batch: its head adds in the forward
    model.forward(provider, inputs, wanted, 1.0f / 32, nullptr);
    model.backward(provider, inputs, nullptr);
    if (world.rank() == 0) log = mine;
  });
  return log;
}

std::string joined(const Log& log) {
  std::string text;
  for (const std::string& entry : log) text += entry + " ";
  return text;
}

TEST(Overlap, Zero3GathersTheNextBlockWhileTheCurrentOneIsInHand) {
  const Log log = train_step_log(3);
  SCOPED_TRACE(joined(log));
  int gathers = 0, held = 0;
  bool any_acquired = false;
  for (size_t i = 0; i < log.size(); ++i) {
    const std::string& e = log[i];
    if (e == "G") {
      ++gathers;
      // Every gather but the very first (which nothing could prefetch) is issued while a block
      // is acquired: its work is queued and runs while the gather does.
      if (any_acquired) {
        EXPECT_EQ(held, 1) << "gather #" << gathers << " with no block in hand";
      }
    } else if (e[0] == 'A') {
      any_acquired = true;
      ++held;
      // An acquire finds its block gathered already: no gather inside it.
      if (gathers > 0) {
        EXPECT_FALSE(i + 1 < log.size() && log[i + 1] == "G") << "acquire at " << i;
      }
    } else if (e[0] == 'R') {
      --held;
    }
  }
  // 4 layers: forward gathers the embedding, 4 layers, ln_f and the embedding again for the
  // tied head (7); backward starts with the two blocks forward ended with, both still gathered
  // (the head's embedding and ln_f), and gathers the 4 layers (4).
  EXPECT_EQ(gathers, 11);
}

TEST(Overlap, ReductionOfABlockWaitsForTheNextBlocksBackwardToBeQueued) {
  // Stages 0-1 reduce during the last micro-batch's backward (last_micro_batch()), 2-3 during
  // every backward.
  for (int zero : {0, 1, 2, 3}) {
    const Log log = train_step_log(zero);
    SCOPED_TRACE("zero " + std::to_string(zero) + ": " + joined(log));
    // Per release of gradients, the reductions it issues: the previous block's (none for
    // the first), and for the embedding (the last) its own as well.
    std::vector<std::pair<std::string, int>> issued;
    for (const std::string& e : log) {
      if (e[0] == 'r') issued.push_back({e, 0});
      if (e == "S") {
        ASSERT_FALSE(issued.empty()) << "a reduction before any release of gradients";
        ++issued.back().second;
      }
    }
    // The head's backward (in the forward) releases ln_f (block 5), the backward layers 3..0
    // (blocks 4..1), then the embedding (0).
    ASSERT_EQ(issued.size(), 6u);
    EXPECT_EQ(issued[0].first, "r5");
    EXPECT_EQ(issued[0].second, 0) << "ln_f's reduction went before layer 3 was queued";
    for (size_t i = 1; i + 1 < issued.size(); ++i) EXPECT_EQ(issued[i].second, 1) << i;
    EXPECT_EQ(issued.back().first, "r0");
    EXPECT_EQ(issued.back().second, 2);
  }
}

}  // namespace
}  // namespace dstrain
