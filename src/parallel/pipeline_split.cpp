#include "parallel/pipeline_split.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "core/check.h"
#include "parallel/model_flops.h"

namespace dstrain {

namespace {

// The quality of a split: its slowest stage, then the sum of squared stage costs (the most
// even). Exact ties (equal costs) compare equal.
struct SplitScore {
  double slowest = std::numeric_limits<double>::infinity();
  double squares = std::numeric_limits<double>::infinity();
};

bool same(double a, double b) {
  if (a == b) return true;
  if (std::isinf(a) || std::isinf(b)) return false;
  return std::abs(a - b) <= 1e-12 * std::max(std::abs(a), std::abs(b));
}

bool better(const SplitScore& a, const SplitScore& b) {
  if (!same(a.slowest, b.slowest)) return a.slowest < b.slowest;
  return !same(a.squares, b.squares) && a.squares < b.squares;
}

bool equal(const SplitScore& a, const SplitScore& b) {
  return same(a.slowest, b.slowest) && same(a.squares, b.squares);
}

SplitScore with_stage(double cost, const SplitScore& rest) {
  return SplitScore{std::max(cost, rest.slowest), cost * cost + rest.squares};
}

}  // namespace

std::vector<int64_t> balanced_pipeline_split(const ModelConfig& config, int pp, int64_t seq_len) {
  const int64_t L = config.n_layer;
  DSTRAIN_CHECK(pp >= 1 && pp <= L && seq_len >= 1) << "pp " << pp << " over " << L << " layers";
  const ModelFlops flops = model_flops(config, seq_len);
  // The embedding's lookup and its backward's scatter-add: about 2 C per token.
  const double embedding = 2.0 * static_cast<double>(config.n_embd);
  // Layers that differ (a dense layer among MoE layers) count their own FLOPs: prefix sums.
  const bool mixed = decoder_parts(config).mixed_layers();
  std::vector<double> before(static_cast<size_t>(L) + 1, 0.0);
  for (int64_t l = 0; mixed && l < L; ++l) {
    before[static_cast<size_t>(l) + 1] =
        before[static_cast<size_t>(l)] + layer_forward_flops(config, seq_len, l);
  }
  auto layers_cost = [&](int64_t first, int64_t layers) {
    return mixed ? before[static_cast<size_t>(first + layers)] - before[static_cast<size_t>(first)]
                 : static_cast<double>(layers) * flops.layer_forward;
  };
  auto cost = [&](int stage, int64_t first, int64_t layers) {
    return layers_cost(first, layers) + (stage == 0 ? embedding : 0.0) +
           (stage == pp - 1 ? flops.head_forward : 0.0);
  };
  // best[s][u]: the best score of stages s.. over the layers u.. (each stage at least one).
  std::vector<std::vector<SplitScore>> best(static_cast<size_t>(pp) + 1,
                                            std::vector<SplitScore>(static_cast<size_t>(L) + 1));
  best[static_cast<size_t>(pp)][static_cast<size_t>(L)] = SplitScore{0.0, 0.0};
  for (int s = pp - 1; s >= 0; --s) {
    for (int64_t u = s; u + (pp - s) <= L; ++u) {
      SplitScore& b = best[static_cast<size_t>(s)][static_cast<size_t>(u)];
      for (int64_t n = 1; u + n + (pp - s - 1) <= L; ++n) {
        const SplitScore candidate =
            with_stage(cost(s, u, n), best[static_cast<size_t>(s) + 1][static_cast<size_t>(u + n)]);
        if (better(candidate, b)) b = candidate;
      }
    }
  }
  // From the front, the fewest layers that keep the best score (early stages hold the most
  // micro-batches in flight).
  std::vector<int64_t> split;
  int64_t used = 0;
  for (int s = 0; s < pp; ++s) {
    const SplitScore& target = best[static_cast<size_t>(s)][static_cast<size_t>(used)];
    for (int64_t n = 1; used + n + (pp - s - 1) <= L; ++n) {
      if (equal(with_stage(cost(s, used, n),
                           best[static_cast<size_t>(s) + 1][static_cast<size_t>(used + n)]),
                target)) {
        split.push_back(n);
        used += n;
        break;
      }
    }
  }
  DSTRAIN_CHECK(static_cast<int>(split.size()) == pp && used == L) << pipeline_split_text(split);
  return split;
}

void check_pipeline_split(const ModelConfig& config, int pp, const std::vector<int64_t>& split) {
  int64_t total = 0;
  bool positive = true;
  for (int64_t n : split) {
    total += n;
    positive = positive && n >= 1;
  }
  DSTRAIN_USER_CHECK(static_cast<int>(split.size()) == pp && positive && total == config.n_layer)
      << "--pp-split " << pipeline_split_text(split) << " must give " << pp
      << " stages (--pp) at least one layer each, adding up to the model's " << config.n_layer
      << " layers";
}

std::string pipeline_split_text(const std::vector<int64_t>& split) {
  std::ostringstream text;
  for (size_t i = 0; i < split.size(); ++i) text << (i ? "," : "") << split[i];
  return text.str();
}

std::vector<int64_t> parse_pipeline_split(const std::string& text) {
  std::vector<int64_t> split;
  std::istringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DSTRAIN_USER_CHECK(used > 0 && used == part.size() && n >= 1 && n <= (int64_t{1} << 20))
        << "--pp-split takes layers per stage as positive numbers separated by commas (e.g. "
           "7,7,7,7), not '" << text << "'";
    split.push_back(n);
  }
  DSTRAIN_USER_CHECK(!split.empty() && !text.ends_with(","))
      << "--pp-split takes layers per stage separated by commas (e.g. 7,7,7,7), not '" << text << "'";
  return split;
}

std::vector<int64_t> pipeline_split(const ModelConfig& config, const Plan& plan) {
  if (!plan.pp_split.empty()) {
    check_pipeline_split(config, plan.pp, plan.pp_split);
    return plan.pp_split;
  }
  if (plan.pp == 1) return {config.n_layer};
  return balanced_pipeline_split(config, plan.pp, plan.seq_len);
}

StageRange stage_of_split(const std::vector<int64_t>& split, int stage) {
  DSTRAIN_CHECK(stage >= 0 && stage < static_cast<int>(split.size()))
      << "stage " << stage << " of " << split.size();
  StageRange range;
  for (int s = 0; s < stage; ++s) range.first_layer += split[static_cast<size_t>(s)];
  range.end_layer = range.first_layer + split[static_cast<size_t>(stage)];
  range.first = stage == 0;
  range.last = stage + 1 == static_cast<int>(split.size());
  return range;
}

StageRange pipeline_stage(const ModelConfig& config, const Plan& plan, int stage) {
  return stage_of_split(pipeline_split(config, plan), stage);
}

std::vector<int> pipeline_stage_blocks(const ParamLayout& layout, const StageRange& range) {
  std::vector<int> blocks;
  if (range.first || (range.last && layout.tied_embedding())) {
    blocks.push_back(ParamLayout::embedding_block());
  }
  for (int64_t l = range.first_layer; l < range.end_layer; ++l) {
    blocks.push_back(ParamLayout::layer_block(static_cast<int>(l)));
  }
  if (range.last) blocks.push_back(layout.final_block());
  for (int64_t l = range.first_layer; l < range.end_layer; ++l) {
    const int experts = layout.expert_block(static_cast<int>(l));
    if (experts >= 0) blocks.push_back(experts);
  }
  return blocks;
}

}  // namespace dstrain
