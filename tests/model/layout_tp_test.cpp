// The parameter layout under tensor parallelism (model/layout.h): tp = 1 is today's layout,
// bit for bit; each tp rank's slices are Megatron's splits, checked against index arithmetic
// written here; the slices of all tp ranks are the whole tensor; unsupported tp values are
// one clear sentence.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/layout.h"

namespace dstrain {
namespace {

// An odd vocabulary (97, padded to 128) and C = 64 with 4 heads: splits over 2 and 4 ranks.
ModelConfig split_config() {
  ModelConfig config;
  config.name = "layout_tp";
  config.vocab_size = 97;
  config.n_positions = 40;
  config.n_embd = 64;
  config.n_layer = 2;
  config.n_head = 4;
  return config;
}

// C = 48 is not a multiple of the 32-element alignment: gaps between tensors.
ModelConfig gapped_config() {
  ModelConfig config = split_config();
  config.n_embd = 48;
  config.n_positions = 13;
  return config;
}

// Random values that are never zero: a slice copied from the wrong place or not at all shows.
std::vector<float> random_nonzero(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) {
    v = static_cast<float>((0.5 + rng.uniform()) * (rng.below(2) ? 1.0 : -1.0));
  }
  return values;
}

std::string layer_name(const std::string& name) {
  return name.starts_with("h.") ? name.substr(name.find('.', 2) + 1) : name;
}

// Megatron's splits for GPT-2, by name: {tp_dim, tp_parts, tp_partial_grad}.
struct ExpectedSplit {
  int dim, parts;
  bool partial_grad;
};
const std::map<std::string, ExpectedSplit>& expected_splits() {
  static const std::map<std::string, ExpectedSplit> splits = {
      {"wte.weight", {0, 1, false}},          {"wpe.weight", {-1, 1, false}},
      {"ln_1.weight", {-1, 1, true}},         {"ln_1.bias", {-1, 1, true}},
      {"attn.c_attn.weight", {1, 3, false}},  {"attn.c_attn.bias", {0, 3, false}},
      {"attn.c_proj.weight", {0, 1, false}},  {"attn.c_proj.bias", {-1, 1, false}},
      {"ln_2.weight", {-1, 1, true}},         {"ln_2.bias", {-1, 1, true}},
      {"mlp.c_fc.weight", {1, 1, false}},     {"mlp.c_fc.bias", {0, 1, false}},
      {"mlp.c_proj.weight", {0, 1, false}},   {"mlp.c_proj.bias", {-1, 1, false}},
      {"ln_f.weight", {-1, 1, true}},         {"ln_f.bias", {-1, 1, true}}};
  return splits;
}

TEST(LayoutTp, Tp1IsTodaysLayoutBitForBit) {
  for (const ModelConfig& config : {split_config(), gapped_config()}) {
    const ParamLayout today(config), tp1(config, 1);
    EXPECT_EQ(tp1.tp(), 1);
    ASSERT_EQ(tp1.num_blocks(), today.num_blocks());
    for (int b = 0; b < today.num_blocks(); ++b) {
      EXPECT_EQ(tp1.block_numel(b), today.block_numel(b));
      EXPECT_EQ(tp1.block_params(b), today.block_params(b));
    }
    ASSERT_EQ(tp1.params().size(), today.params().size());
    for (size_t p = 0; p < today.params().size(); ++p) {
      const ParamSpec &a = tp1.params()[p], &b = today.params()[p];
      EXPECT_EQ(a.name, b.name);
      EXPECT_EQ(a.block, b.block);
      EXPECT_EQ(a.offset, b.offset) << a.name;
      EXPECT_EQ(a.shape, b.shape) << a.name;
      EXPECT_EQ(a.full_shape, a.shape) << a.name;
      EXPECT_EQ(a.file_shape, b.file_shape) << a.name;
      EXPECT_EQ(a.slice_file_numel(0), a.file_numel()) << a.name;
    }
  }
}

// Today's layout written out independently: tensors in order, each starting on a multiple of
// 32 elements.
TEST(LayoutTp, Tp1OffsetsAreTheAlignedRunningSum) {
  const ModelConfig config = gapped_config();
  const int64_t C = config.n_embd, V = config.vocab_size, Vp = 128, T = config.n_positions;
  const std::vector<std::vector<std::vector<int64_t>>> blocks = {
      {{Vp, C}, {T, C}},
      {{C}, {C}, {C, 3 * C}, {3 * C}, {C, C}, {C}, {C}, {C}, {C, 4 * C}, {4 * C}, {4 * C, C}, {C}},
      {{C}, {C}, {C, 3 * C}, {3 * C}, {C, C}, {C}, {C}, {C}, {C, 4 * C}, {4 * C}, {4 * C, C}, {C}},
      {{C}, {C}}};
  const ParamLayout layout(config, 1);
  ASSERT_EQ(layout.num_blocks(), 4);
  for (int b = 0; b < 4; ++b) {
    int64_t cursor = 0;
    ASSERT_EQ(layout.block_params(b).size(), blocks[b].size());
    for (size_t i = 0; i < blocks[b].size(); ++i) {
      const ParamSpec& spec = layout.params()[static_cast<size_t>(layout.block_params(b)[i])];
      EXPECT_EQ(spec.offset, cursor) << spec.name;
      EXPECT_EQ(spec.shape, blocks[b][i]) << spec.name;
      int64_t n = 1;
      for (int64_t d : blocks[b][i]) n *= d;
      cursor += (n + 31) / 32 * 32;
    }
    EXPECT_EQ(layout.block_numel(b), cursor) << "block " << b;
  }
  EXPECT_EQ(layout.find("wte.weight").file_shape, (std::vector<int64_t>{V, C}));
}

TEST(LayoutTp, SplitsAreMegatronsAndSizesAddUp) {
  const ModelConfig config = split_config();
  const ParamLayout full(config);
  for (int tp : {1, 2, 4}) {
    const ParamLayout local(config, tp);
    EXPECT_EQ(local.tp(), tp);
    ASSERT_EQ(local.params().size(), full.params().size());
    for (size_t p = 0; p < full.params().size(); ++p) {
      const ParamSpec &slice = local.params()[p], &whole = full.params()[p];
      const ExpectedSplit& expected = expected_splits().at(layer_name(slice.name));
      EXPECT_EQ(slice.tp_dim, expected.dim) << slice.name;
      EXPECT_EQ(slice.tp_parts, expected.parts) << slice.name;
      EXPECT_EQ(slice.tp_partial_grad, expected.partial_grad) << slice.name;
      EXPECT_EQ(slice.full_shape, whole.shape) << slice.name;
      EXPECT_EQ(slice.file_shape, whole.file_shape) << slice.name;
      EXPECT_EQ(slice.weight_decay, whole.weight_decay) << slice.name;
      EXPECT_EQ(slice.offset % 32, 0) << slice.name;
      if (expected.dim < 0) {
        EXPECT_EQ(slice.shape, whole.shape) << slice.name;
      } else {
        EXPECT_EQ(tp * slice.numel(), whole.numel()) << slice.name;
        std::vector<int64_t> shape = whole.shape;
        shape[static_cast<size_t>(expected.dim)] /= tp;
        EXPECT_EQ(slice.shape, shape) << slice.name;
      }
    }
  }
}

// The numbers the memory model relies on (C = 128: every split part a multiple of 32).
TEST(LayoutTp, BlockSizesOfTheSplits) {
  ModelConfig config = split_config();
  config.n_embd = 128;
  config.n_positions = 48;
  const ParamLayout full(config);
  const int layer = ParamLayout::layer_block(0);
  // The replicated part of a layer: ln_1, ln_2 (weight, bias) and the projections' biases.
  EXPECT_EQ(2 * ParamLayout(config, 2).block_numel(layer) - full.block_numel(layer), 6 * 128);
  EXPECT_EQ(4 * ParamLayout(config, 4).block_numel(layer) - full.block_numel(layer),
            3 * 6 * 128);
  EXPECT_EQ(ParamLayout(config, 4).block_numel(0), 32 * 128 + 48 * 128);  // wte rows + wpe
  EXPECT_EQ(ParamLayout(config, 4).block_numel(full.final_block()),
            full.block_numel(full.final_block()));
}

// Every tp rank's slice, extracted from a random tensor into a buffer with a guard region
// after it, then all of them inserted into a fresh tensor: the original, bit for bit.
TEST(LayoutTp, SlicesOfAllRanksReconstructEveryTensor_tp2_tp4) {
  const ModelConfig config = split_config();
  constexpr int64_t kGuard = 37;
  constexpr float kSentinel = 12345.0f;
  for (int tp : {2, 4}) {
    const ParamLayout local(config, tp);
    for (const ParamSpec& spec : local.params()) {
      const std::vector<float> whole = random_nonzero(spec.full_numel(), 7 + spec.offset);
      std::vector<float> rebuilt(whole.size(), 0.0f);
      for (int r = 0; r < tp; ++r) {
        std::vector<float> slice(static_cast<size_t>(spec.numel() + kGuard), kSentinel);
        extract_tp_slice(spec, r, whole.data(), slice.data());
        for (int64_t g = 0; g < kGuard; ++g) {
          ASSERT_EQ(slice[static_cast<size_t>(spec.numel() + g)], kSentinel) << spec.name;
        }
        if (spec.tp_dim < 0) {
          EXPECT_EQ(std::memcmp(slice.data(), whole.data(), whole.size() * sizeof(float)), 0)
              << spec.name << ": a replicated tensor is whole on every rank";
        }
        insert_tp_slice(spec, r, slice.data(), rebuilt.data());
      }
      EXPECT_EQ(std::memcmp(rebuilt.data(), whole.data(), whole.size() * sizeof(float)), 0)
          << spec.name << " tp " << tp;
    }
  }
}

// Local (i, j) of rank r, by index arithmetic written here for each split.
int64_t expected_full_index(const ParamSpec& spec, int tp, int r, int64_t local) {
  const std::string name = layer_name(spec.name);
  const int64_t cols = spec.shape.size() == 2 ? spec.shape[1] : spec.shape[0];
  const int64_t full_cols = spec.full_shape.size() == 2 ? spec.full_shape[1] : spec.full_shape[0];
  const int64_t i = spec.shape.size() == 2 ? local / cols : 0, j = local % cols;
  if (name == "attn.c_attn.weight" || name == "attn.c_attn.bias") {
    const int64_t C = full_cols / 3, piece = C / tp;  // the columns of NH/tp heads
    const int64_t group = j / piece, within = j % piece;  // q, k or v
    return i * full_cols + group * C + r * piece + within;
  }
  if (name == "mlp.c_fc.weight") return i * full_cols + r * cols + j;
  if (name == "mlp.c_fc.bias") return r * cols + j;
  if (spec.tp_dim == 0) return (r * spec.shape[0] + i) * cols + j;  // rows: wte, c_proj
  return local;                                                      // replicated
}

TEST(LayoutTp, QkvColumnsAndRowSplitsMatchIndexArithmetic) {
  const ModelConfig config = split_config();
  for (int tp : {2, 4}) {
    const ParamLayout local(config, tp);
    for (const ParamSpec& spec : local.params()) {
      // The whole tensor holds its own row-major index: a slice element names its origin.
      std::vector<float> whole(static_cast<size_t>(spec.full_numel()));
      for (size_t k = 0; k < whole.size(); ++k) whole[k] = static_cast<float>(k);
      ASSERT_LT(whole.size(), size_t{1} << 24) << "indices must be exact in fp32";
      for (int r = 0; r < tp; ++r) {
        std::vector<float> slice(static_cast<size_t>(spec.numel()));
        extract_tp_slice(spec, r, whole.data(), slice.data());
        for (int64_t k = 0; k < spec.numel(); ++k) {
          ASSERT_EQ(static_cast<int64_t>(slice[static_cast<size_t>(k)]),
                    expected_full_index(spec, tp, r, k))
              << spec.name << " tp " << tp << " rank " << r << " local " << k;
        }
      }
    }
    // Head h's q, k and v columns (h * head_dim + [0, head_dim) in each third) are on rank
    // h / (NH / tp): rank 1's first local q column is head NH/tp's first.
    const ParamSpec& qkv = local.find("h.1.attn.c_attn.weight");
    const int64_t C = config.n_embd, head_dim = C / config.n_head;
    const int64_t first_head = config.n_head / tp;
    EXPECT_EQ(expected_full_index(qkv, tp, 1, 0), first_head * head_dim);
    EXPECT_EQ(expected_full_index(qkv, tp, 1, C / tp), C + first_head * head_dim);  // k
  }
}

// for_each_tp_run over any sub-range gives the same mapping as over the whole slice, in
// increasing order, covering the range exactly.
TEST(LayoutTp, RunsOfAnySubRangeAgreeWithTheWholeSlice) {
  const ModelConfig config = split_config();
  Rng rng(11);
  for (int tp : {1, 2, 4}) {
    const ParamLayout local(config, tp);
    for (const ParamSpec& spec : local.params()) {
      for (int r = 0; r < tp; ++r) {
        std::vector<int64_t> full_of(static_cast<size_t>(spec.numel()), -1);
        for_each_tp_run(spec, r, 0, spec.numel(), [&](int64_t l, int64_t f, int64_t count) {
          for (int64_t k = 0; k < count; ++k) full_of[static_cast<size_t>(l + k)] = f + k;
        });
        for (int trial = 0; trial < 5; ++trial) {
          int64_t first = static_cast<int64_t>(rng.below(static_cast<uint64_t>(spec.numel())));
          int64_t last = static_cast<int64_t>(rng.below(static_cast<uint64_t>(spec.numel() + 1)));
          if (first > last) std::swap(first, last);
          int64_t next = first;
          for_each_tp_run(spec, r, first, last, [&](int64_t l, int64_t f, int64_t count) {
            ASSERT_EQ(l, next) << spec.name;
            ASSERT_GT(count, 0);
            for (int64_t k = 0; k < count; ++k) {
              ASSERT_EQ(full_of[static_cast<size_t>(l + k)], f + k) << spec.name;
            }
            next = l + count;
          });
          EXPECT_EQ(next, last) << spec.name;
        }
      }
    }
  }
}

// wte's padded vocabulary rows (97 real of 128) lie at the end of the last ranks' slices.
TEST(LayoutTp, SliceFileNumelStopsAtTheRealVocabulary) {
  const ModelConfig config = split_config();
  const int64_t C = config.n_embd;
  EXPECT_EQ(ParamLayout(config, 1).find("wte.weight").slice_file_numel(0), 97 * C);
  const ParamSpec wte2 = ParamLayout(config, 2).find("wte.weight");
  EXPECT_EQ(wte2.slice_file_numel(0), 64 * C);
  EXPECT_EQ(wte2.slice_file_numel(1), 33 * C);
  const ParamSpec wte4 = ParamLayout(config, 4).find("wte.weight");
  for (int r = 0; r < 3; ++r) EXPECT_EQ(wte4.slice_file_numel(r), 32 * C);
  EXPECT_EQ(wte4.slice_file_numel(3), 1 * C);
  const ParamSpec qkv = ParamLayout(config, 4).find("h.0.attn.c_attn.weight");
  EXPECT_EQ(qkv.slice_file_numel(3), qkv.numel());
}

void expect_unsupported(const ModelConfig& config, int tp, const std::string& sentence) {
  EXPECT_EQ(tp_unsupported_reason(config, tp), sentence);
  try {
    ParamLayout layout(config, tp);
    FAIL() << "no error for tp " << tp;
  } catch (const UserError& error) {
    EXPECT_NE(std::string(error.what()).find(sentence), std::string::npos) << error.what();
  }
}

TEST(LayoutTp, UnsupportedTpIsAUserErrorNamingTheNumbers) {
  const ModelConfig config = split_config();
  for (int tp : {1, 2, 4}) EXPECT_EQ(tp_unsupported_reason(config, tp), "") << tp;
  expect_unsupported(config, 3, "tensor parallelism over 3 ranks needs n_head (4) divisible by 3");
  expect_unsupported(config, 0, "tensor parallelism needs at least 1 rank, not 0");
  // A validated config.json has n_embd % n_head == 0, which makes 4C divide whenever n_head
  // does; a hand-made config (or a future architecture) may not.
  ModelConfig narrow = config;
  narrow.n_head = 8;
  narrow.n_embd = 9;
  expect_unsupported(narrow, 8,
                     "tensor parallelism over 8 ranks needs the MLP width 4 * n_embd (36) "
                     "divisible by 8");
  // 97 pads to 128: no split over 256 ranks (n_head and n_embd 256 would allow it).
  ModelConfig wide = config;
  wide.n_head = 256;
  wide.n_embd = 256;
  expect_unsupported(wide, 256,
                     "tensor parallelism over 256 ranks needs the padded vocabulary (128) "
                     "divisible by 256 (vocab_size 97 padded to a multiple of 64)");
}

}  // namespace
}  // namespace dstrain
