// Plan-independent checkpoints under tensor parallelism (train/checkpoint.h, weights_io.h):
// tp ranks, each also sharded over data-parallel ranks, write their slices in parallel into the
// same files, and the files are byte for byte the ones the whole (tp = 1) blocks give.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "core/rng.h"
#include "tests/common/temp_dir.h"
#include "train/checkpoint.h"

namespace dstrain {
namespace {

// An odd vocabulary (97, padded to 128: the last tp ranks' wte rows are padding) and C = 48,
// not a multiple of the 32-element alignment (gaps in every block), 4 heads: tp 2 and 4.
ModelConfig tp_config() {
  ModelConfig config;
  config.name = "checkpoint_tp";
  config.vocab_size = 97;
  config.n_positions = 13;
  config.n_embd = 48;
  config.n_layer = 2;
  config.n_head = 4;
  return config;
}

// Random non-zero values in every tensor element, wte's padded rows included (files must drop
// them whichever rank holds them); the alignment gaps stay zero.
void fill_random(const ParamLayout& layout, const HostBlocks& blocks, uint64_t seed) {
  Rng rng(seed);
  for (const ParamSpec& spec : layout.params()) {
    float* data = ParamLayout::view(spec, blocks.block(spec.block)).f32();
    for (int64_t i = 0; i < spec.numel(); ++i) {
      data[i] = static_cast<float>((0.25 + rng.uniform()) * (rng.below(2) ? 1.0 : -1.0));
    }
  }
}

bool same_bits(const HostBlocks& a, const HostBlocks& b) {
  for (size_t block = 0; block < a.tensors().size(); ++block) {
    const Tensor x = a.block(static_cast<int>(block)), y = b.block(static_cast<int>(block));
    if (x.numel() != y.numel() || std::memcmp(x.data, y.data, x.nbytes()) != 0) return false;
  }
  return true;
}

std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

const nlohmann::json kTrainerState = {{"seed", 5}, {"adam_step", 3}};

// The checkpoint the whole blocks give: one part holding everything (tp = 1, one rank).
std::string write_whole(const std::string& out, const ModelConfig& config,
                        const FullTrainingState& state) {
  CheckpointWriter writer(out, 3, config);
  CheckpointWriter::Part part;
  part.begin.assign(static_cast<size_t>(writer.layout().num_blocks()), 0);
  part.params = state.params.tensors();
  part.exp_avg = state.exp_avg.tensors();
  part.exp_avg_sq = state.exp_avg_sq.tensors();
  writer.write_part(part);
  return writer.finish(kTrainerState);
}

// One tp rank's blocks: the slices of the whole state.
struct TpRankState {
  TpRankState(const ParamLayout& full, const ParamLayout& local, int tp_rank,
              const FullTrainingState& whole)
      : params(local), exp_avg(local), exp_avg_sq(local) {
    slice_host_blocks(full, local, tp_rank, whole.params, params);
    slice_host_blocks(full, local, tp_rank, whole.exp_avg, exp_avg);
    slice_host_blocks(full, local, tp_rank, whole.exp_avg_sq, exp_avg_sq);
  }
  HostBlocks params, exp_avg, exp_avg_sq;
};

// Data-parallel rank `dp_rank` of 2's part of a tp rank's blocks: each block's flat range cut
// at 3/7 (through tensors and through the slices' runs), as ZeRO shards cut it.
CheckpointWriter::Part dp_part(const ParamLayout& local, int tp_rank, const TpRankState& state,
                               int dp_rank) {
  CheckpointWriter::Part part;
  part.layout = &local;
  part.tp_rank = tp_rank;
  part.replicated = tp_rank == 0;  // as the trainer does: replicated tensors from tp index 0
  for (int block = 0; block < local.num_blocks(); ++block) {
    const int64_t n = local.block_numel(block), cut = n * 3 / 7;
    const int64_t begin = dp_rank == 0 ? 0 : cut, count = dp_rank == 0 ? cut : n - cut;
    part.begin.push_back(begin);
    part.params.push_back(state.params.block(block).slice(begin, {count}));
    part.exp_avg.push_back(state.exp_avg.block(block).slice(begin, {count}));
    part.exp_avg_sq.push_back(state.exp_avg_sq.block(block).slice(begin, {count}));
  }
  return part;
}

// tp x 2 ranks writing their parts at once, each from its own thread.
std::string write_tp_dp(const std::string& out, const ModelConfig& config, int tp,
                        const FullTrainingState& whole) {
  const ParamLayout full(config), local(config, tp);
  std::vector<TpRankState> ranks;
  ranks.reserve(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) ranks.emplace_back(full, local, r, whole);
  CheckpointWriter writer(out, 3, config);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    for (int dp = 0; dp < 2; ++dp) {
      threads.emplace_back([&, r, dp] { writer.write_part(dp_part(local, r, ranks[r], dp)); });
    }
  }
  for (std::thread& thread : threads) thread.join();
  return writer.finish(kTrainerState);
}

class CheckpointTp : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointTp, TpTimesDp2PartsWriteTheTp1FilesByteForByte) {
  const int tp = GetParam();
  const ModelConfig config = tp_config();
  const ParamLayout full(config);
  FullTrainingState whole(full);
  fill_random(full, whole.params, 1);
  fill_random(full, whole.exp_avg, 2);
  fill_random(full, whole.exp_avg_sq, 3);
  const testing::TempDir dir;
  const std::filesystem::path expected = write_whole(dir.file("tp1"), config, whole);
  const std::filesystem::path got = write_tp_dp(dir.file("tp"), config, tp, whole);
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "config.json"}) {
    const std::string want = file_bytes(expected / name);
    ASSERT_FALSE(want.empty()) << name;
    EXPECT_TRUE(file_bytes(got / name) == want) << name << " written by tp " << tp << " x dp 2";
  }
  // And what loads back is the whole state but for wte's padded rows, which files never hold.
  FullTrainingState loaded(full);
  load_checkpoint(open_checkpoint(got.string()), loaded);
  const ParamSpec& wte = full.find("wte.weight");
  for (const HostBlocks* blocks : {&whole.params, &whole.exp_avg, &whole.exp_avg_sq}) {
    float* data = ParamLayout::view(wte, blocks->block(wte.block)).f32();
    std::fill(data + wte.file_numel(), data + wte.numel(), 0.0f);
  }
  EXPECT_TRUE(same_bits(loaded.params, whole.params));
  EXPECT_TRUE(same_bits(loaded.exp_avg, whole.exp_avg));
  EXPECT_TRUE(same_bits(loaded.exp_avg_sq, whole.exp_avg_sq));
}

INSTANTIATE_TEST_SUITE_P(Tp, CheckpointTp, ::testing::Values(2, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// Slicing the whole blocks for every tp rank and inserting the slices back gives the whole
// blocks, bit for bit (padded rows included); the slices' alignment gaps stay zero.
TEST(CheckpointTpBlocks, SliceThenInsertEveryRankIsTheWholeBlocks_tp2_tp4) {
  const ModelConfig config = tp_config();
  const ParamLayout full(config);
  HostBlocks whole(full);
  fill_random(full, whole, 4);
  for (int tp : {2, 4}) {
    const ParamLayout local(config, tp);
    HostBlocks rebuilt(full);
    for (int r = 0; r < tp; ++r) {
      HostBlocks slice(local);
      slice_host_blocks(full, local, r, whole, slice);
      // Every element outside the tensors (the gaps) is still zero.
      for (int block = 0; block < local.num_blocks(); ++block) {
        std::vector<char> in_tensor(static_cast<size_t>(local.block_numel(block)), 0);
        for (int index : local.block_params(block)) {
          const ParamSpec& spec = local.params()[static_cast<size_t>(index)];
          std::fill_n(in_tensor.begin() + spec.offset, spec.numel(), 1);
        }
        const float* data = slice.block(block).f32();
        for (size_t i = 0; i < in_tensor.size(); ++i) {
          if (!in_tensor[i]) {
            ASSERT_EQ(data[i], 0.0f) << "tp " << tp << " block " << block;
          }
        }
      }
      if (r % 2 == 0) {
        insert_host_blocks(full, local, r, slice, rebuilt);
      } else {  // the per-block form, as rank 0 gathers the tp slices block by block
        for (int block = 0; block < local.num_blocks(); ++block) {
          insert_block_slice(full, local, r, block, slice, rebuilt);
        }
      }
    }
    EXPECT_TRUE(same_bits(rebuilt, whole)) << "tp " << tp;
  }
}

}  // namespace
}  // namespace dstrain
