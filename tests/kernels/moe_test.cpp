// The mixture-of-experts ops' CPU twin (kernels/cpu/cpu_moe.cpp) against float64 references
// and central finite differences: routing (softmax and sigmoid scores, top-k with ties to the
// lower index, renormalized or not, scaled) and its backward; the dispatch into expert order
// (a stable counting sort, an expert with no token); gather; the weighted combine (dropped
// choices) and its backward; the grouped matmul (an expert with no rows) and its backward.
// Round and odd shapes, F32 and 16-bit storage. Tolerances: F32 forward {1e-6, 1e-5, 1e-11}
// (fp32 ulps through expf and sums); gradients against finite differences {2e-5, 2e-4, 1e-9};
// 16-bit outputs storage_tolerance.
#include <algorithm>
#include <numeric>

#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

constexpr Tolerance kF32{1e-6, 1e-5, 1e-11};
constexpr Tolerance kF32Gradient{2e-5, 2e-4, 1e-9};

Tolerance output_tolerance(DType dtype) {
  return dtype == DType::F32 ? kF32 : storage_tolerance(dtype);
}

// ---- routing -------------------------------------------------------------------------------

struct RouteCase {
  int64_t N;
  MoeRouting routing;
  DType dtype;  // of the logits (and of dlogits)
};

struct RouteReference {
  std::vector<double> scores, weights;  // (N, E), (N, k)
  std::vector<int> experts;             // (N, k)
};

// The experts a token may choose, best first (ties to the lower index): the selection scores
// (s + the selection bias) of the experts in its top_groups groups, ranked by the best (or the
// sum of the two best) selection score of each group, ties to the lower group.
std::vector<int> selection_order(const double* s, int64_t E, const MoeRouting& r) {
  std::vector<double> choice(s, s + E);
  if (!r.selection_bias.empty()) {
    for (int64_t e = 0; e < E; ++e) choice[e] += r.selection_bias.f32()[e];
  }
  const int64_t size = E / r.groups;
  std::vector<double> group(static_cast<size_t>(r.groups));
  for (int g = 0; g < r.groups; ++g) {
    std::vector<double> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
    std::sort(members.begin(), members.end(), std::greater<>());
    group[g] = members[0] + (r.group_score == GroupScore::TopTwoSum && size > 1 ? members[1] : 0.0);
  }
  std::vector<int> groups(static_cast<size_t>(r.groups));
  std::iota(groups.begin(), groups.end(), 0);
  std::stable_sort(groups.begin(), groups.end(), [&](int a, int b) { return group[a] > group[b]; });
  std::vector<int> order;
  for (int e = 0; e < E; ++e) {
    const auto chosen = groups.begin() + r.top_groups;
    if (std::find(groups.begin(), chosen, e / size) != chosen) order.push_back(e);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return choice[a] > choice[b]; });
  return order;
}

// The routing of `logits` in double. `fixed`: the selection to use instead of the top k (the
// finite differences keep it constant, as the op's backward does).
RouteReference route_reference(const std::vector<double>& logits, int64_t N, const MoeRouting& r,
                               const std::vector<int>* fixed = nullptr) {
  const int64_t E = r.experts;
  const int k = r.top_k;
  RouteReference ref;
  ref.scores.resize(static_cast<size_t>(N * E));
  for (int64_t n = 0; n < N; ++n) {
    const double* x = &logits[n * E];
    double* s = &ref.scores[n * E];
    const double max = *std::max_element(x, x + E);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = r.score == RouterScore::Sigmoid ? 1.0 / (1.0 + std::exp(-x[e])) : std::exp(x[e] - max);
      sum += s[e];
    }
    if (r.score == RouterScore::Softmax) {
      for (int64_t e = 0; e < E; ++e) s[e] /= sum;
    }
    std::vector<int> order = selection_order(s, E, r);
    double picked = 0.0;
    for (int j = 0; j < k; ++j) {
      const int e = fixed ? (*fixed)[n * k + j] : order[static_cast<size_t>(j)];
      ref.experts.push_back(e);
      picked += s[e];
    }
    for (int j = 0; j < k; ++j) {
      const double w = s[ref.experts[n * k + j]];
      ref.weights.push_back((r.norm_topk ? w / picked : w) * r.scale);
    }
  }
  return ref;
}

struct RouteTensors {
  HostTensor logits, scores, weights, experts;
  RouteTensors(const RouteCase& c)
      : logits(c.dtype, {c.N, c.routing.experts}),
        scores(DType::F32, {c.N, c.routing.experts}),
        weights(DType::F32, {c.N, c.routing.top_k}),
        experts(DType::I32, {c.N, c.routing.top_k}) {}
  void run() { test_backend()->moe_route(weights, experts, scores, logits, routing, nullptr); }
  MoeRouting routing;
};

std::vector<int> as_ints(const HostTensor& t) {
  return std::vector<int>(t.i32(), t.i32() + t.numel());
}

void check_route(const RouteCase& c) {
  Random rng(61);
  RouteTensors t(c);
  t.routing = c.routing;
  const std::vector<double> logits = t.logits.fill_random(rng, -3.0, 3.0);
  t.run();
  const RouteReference ref = route_reference(logits, c.N, c.routing);
  EXPECT_EQ(as_ints(t.experts), ref.experts);
  EXPECT_TRUE(all_close(t.scores.values(), ref.scores, kF32)) << "scores";
  EXPECT_TRUE(all_close(t.weights.values(), ref.weights, kF32)) << "weights";
  EXPECT_TRUE(guards_intact({&t.logits, &t.scores, &t.weights, &t.experts}));
}

const MoeRouting kMixtral{8, 2, RouterScore::Softmax, true, 1.0f};
const MoeRouting kQwenNoNorm{5, 3, RouterScore::Softmax, false, 1.0f};
const MoeRouting kSigmoidScaled{6, 2, RouterScore::Sigmoid, true, 2.5f};
const MoeRouting kEveryExpert{4, 4, RouterScore::Softmax, true, 1.0f};

TEST(MoeRoute, SoftmaxTop2RenormalizedRoundShapeF32) { check_route({16, kMixtral, DType::F32}); }
TEST(MoeRoute, SoftmaxTop3UnnormalizedOddShapeBF16) { check_route({7, kQwenNoNorm, DType::BF16}); }
TEST(MoeRoute, SigmoidScaledOddShapeF32) { check_route({9, kSigmoidScaled, DType::F32}); }
TEST(MoeRoute, TopKOfEveryExpertF16) { check_route({5, kEveryExpert, DType::F16}); }

// DeepSeek's routers: V2's group_limited_greedy (softmax, 4 groups of 4, the best 2 by their
// best expert, top 3, not renormalized, scaled) and V3's noaux_tc (sigmoid + a selection bias,
// 4 groups of 4, the best 2 by the sum of their two best, top 4, renormalized, scaled). The
// bias changes the choice but not the weights: without it the choices differ.
const MoeRouting kDeepSeekV2{16, 3, RouterScore::Softmax, false, 1.5f, 4, 2, GroupScore::Max};
MoeRouting deepseek_v3(Tensor bias) {
  return MoeRouting{16, 4, RouterScore::Sigmoid, true, 2.5f, 4, 2, GroupScore::TopTwoSum, bias};
}
TEST(MoeRoute, DeepSeekV2GroupLimitedF32) { check_route({33, kDeepSeekV2, DType::F32}); }
TEST(MoeRoute, DeepSeekV2GroupLimitedBF16) { check_route({7, kDeepSeekV2, DType::BF16}); }
TEST(MoeRoute, DeepSeekV3BiasedGroupsF32) {
  Random rng(63);
  HostTensor bias(DType::F32, {16});
  bias.fill_random(rng, -0.3, 0.3);
  check_route({33, deepseek_v3(bias), DType::F32});
  // The same logits without the bias choose other experts somewhere, with the same scores.
  RouteTensors a({33, deepseek_v3(bias), DType::F32}), b({33, deepseek_v3(Tensor()), DType::F32});
  a.routing = deepseek_v3(bias);
  b.routing = deepseek_v3(Tensor());
  Random same(64);
  a.logits.fill_random(same, -3.0, 3.0);
  b.logits = a.logits.clone();
  a.run();
  b.run();
  EXPECT_NE(as_ints(a.experts), as_ints(b.experts));
  EXPECT_EQ(a.scores.values(), b.scores.values());
}
// Only the chosen groups' experts: with every logit of groups 0 and 3 highest, V2's router
// takes its experts from those two groups alone.
TEST(MoeRoute, GroupLimitedChoosesWithinTheBestGroups) {
  RouteTensors t({1, kDeepSeekV2, DType::F32});
  t.routing = kDeepSeekV2;
  t.logits.set({3.0, 0.0, 0.0, 0.0, 2.9, 2.9, 2.9, 2.9, 0.0, 0.0, 0.0, 0.0, 2.95, 0.0, 0.0, 0.0});
  t.run();
  // Groups by their best: 0 (3.0), 3 (2.95), then 1 (2.9): experts 0, 12 and group 0's next.
  EXPECT_EQ(as_ints(t.experts), (std::vector<int>{0, 12, 1}));
}

// Equal scores: the lower expert first (torch.topk leaves the order of ties open; dstrain fixes
// it).
TEST(MoeRoute, TiesGoToTheLowerExpert) {
  RouteTensors t({2, kQwenNoNorm, DType::F32});
  t.routing = kQwenNoNorm;
  t.logits.set({0.5, 0.5, 0.5, 0.5, 0.5, -1.0, 2.0, -1.0, 2.0, 2.0});
  t.run();
  EXPECT_EQ(as_ints(t.experts), (std::vector<int>{0, 1, 2, 1, 3, 4}));
  EXPECT_EQ(t.weights.get(0), t.weights.get(2));
}

void check_route_backward(const RouteCase& c, bool with_dscores) {
  Random rng(62);
  const int64_t N = c.N, E = c.routing.experts, k = c.routing.top_k;
  RouteTensors t(c);
  t.routing = c.routing;
  const std::vector<double> logits = t.logits.fill_random(rng, -3.0, 3.0);
  t.run();
  HostTensor dweights(DType::F32, {N, k}), dscores(DType::F32, {N, E}), dlogits(c.dtype, {N, E});
  const std::vector<double> r = dweights.fill_random(rng, -1.0, 1.0);
  const std::vector<double> q = dscores.fill_random(rng, -1.0, 1.0);
  dlogits.fill_random(rng, -1.0, 1.0);  // overwritten
  test_backend()->moe_route_backward(dlogits, dweights, with_dscores ? dscores.t() : Tensor(),
                                     t.scores, t.experts, c.routing, nullptr);
  const std::vector<int> selected = as_ints(t.experts);
  const std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& x) {
        const RouteReference ref = route_reference(x, N, c.routing, &selected);
        return dot(ref.weights, r) + (with_dscores ? dot(ref.scores, q) : 0.0);
      },
      logits);
  EXPECT_TRUE(all_close(dlogits.values(), grad,
                        c.dtype == DType::F32 ? kF32Gradient : storage_tolerance(c.dtype)));
  EXPECT_TRUE(guards_intact({&dlogits, &dweights, &dscores}));
}

TEST(MoeRouteBackward, SoftmaxRenormalizedMatchesFiniteDifferences) {
  check_route_backward({16, kMixtral, DType::F32}, false);
}
TEST(MoeRouteBackward, SoftmaxWithAScoreLossMatchesFiniteDifferences) {
  check_route_backward({7, kQwenNoNorm, DType::F32}, true);
}
TEST(MoeRouteBackward, SigmoidScaledWithAScoreLossMatchesFiniteDifferences) {
  check_route_backward({9, kSigmoidScaled, DType::F32}, true);
}
TEST(MoeRouteBackward, DeepSeekV3BiasedGroupsMatchFiniteDifferences) {
  Random rng(65);
  HostTensor bias(DType::F32, {16});
  bias.fill_random(rng, -0.3, 0.3);
  check_route_backward({9, deepseek_v3(bias), DType::F32}, true);
}
TEST(MoeRouteBackward, EveryExpertBF16) {
  check_route_backward({5, kEveryExpert, DType::BF16}, true);
}

// ---- dispatch ------------------------------------------------------------------------------

struct Dispatch {
  HostTensor offsets, source_rows, dest_rows;
  Dispatch(const HostTensor& experts, int E)
      : offsets(DType::I32, {E + 1}),
        source_rows(DType::I32, {experts.numel()}),
        dest_rows(DType::I32, experts.shape()) {
    test_backend()->moe_dispatch(offsets, source_rows, dest_rows, experts, E, nullptr);
  }
};

TEST(MoeDispatch, AHandExample) {
  HostTensor experts(DType::I32, {2, 2});
  experts.set({1, 0, 0, 2});
  const Dispatch d(experts, 3);
  EXPECT_EQ(as_ints(d.offsets), (std::vector<int>{0, 2, 3, 4}));
  EXPECT_EQ(as_ints(d.source_rows), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(as_ints(d.dest_rows), (std::vector<int>{2, 0, 1, 3}));
}

// Random choices where expert 4 gets no token: offsets are the counts' prefix sums, each
// expert's rows are its choices in (n, j) order, and source_rows inverts dest_rows.
TEST(MoeDispatch, IsAStableCountingSortWithAnEmptyExpert) {
  const int E = 6;
  const int64_t N = 13, k = 3;
  Random rng(63);
  HostTensor experts(DType::I32, {N, k});
  for (int64_t i = 0; i < N * k; ++i) {
    int e = static_cast<int>(rng.integer(E - 1));
    experts.i32()[i] = e >= 4 ? e + 1 : e;
  }
  const Dispatch d(experts, E);
  std::vector<int> expected_offsets(E + 1, 0);
  for (int64_t i = 0; i < N * k; ++i) ++expected_offsets[experts.i32()[i] + 1];
  std::partial_sum(expected_offsets.begin(), expected_offsets.end(), expected_offsets.begin());
  EXPECT_EQ(as_ints(d.offsets), expected_offsets);
  EXPECT_EQ(d.offsets.i32()[4], d.offsets.i32()[5]);
  std::vector<int> row_seen(static_cast<size_t>(N * k), 0);
  for (int e = 0; e < E; ++e) {
    int64_t previous = -1;
    for (int64_t i = 0; i < N * k; ++i) {
      if (experts.i32()[i] != e) continue;
      const int row = d.dest_rows.i32()[i];
      EXPECT_GE(row, expected_offsets[e]);
      EXPECT_LT(row, expected_offsets[e + 1]);
      EXPECT_GT(row, previous) << "rows of an expert follow (n, j)";
      previous = row;
      EXPECT_EQ(d.source_rows.i32()[row], i / k);
      ++row_seen[static_cast<size_t>(row)];
    }
  }
  EXPECT_TRUE(std::all_of(row_seen.begin(), row_seen.end(), [](int n) { return n == 1; }));
}

TEST(MoeDispatch, AnExpertOutOfRangeThrows) {
  HostTensor experts(DType::I32, {2, 1});
  experts.set({1, 3});
  EXPECT_THROW(Dispatch(experts, 3), Error);
}

// ---- gather and combine --------------------------------------------------------------------

TEST(MoeGather, CopiesEachRowFromItsSourceConvertingTheDType) {
  Random rng(64);
  HostTensor inp(DType::F32, {5, 7}), out(DType::BF16, {6, 7}), rows(DType::I32, {6});
  const std::vector<double> x = inp.fill_random(rng, -2.0, 2.0);
  rows.set({4, 0, 0, 2, 3, 4});
  test_backend()->moe_gather(out, inp, rows, nullptr);
  for (int64_t r = 0; r < 6; ++r) {
    for (int64_t c = 0; c < 7; ++c) {
      ASSERT_EQ(out.get(r * 7 + c), round_to(DType::BF16, x[rows.i32()[r] * 7 + c]));
    }
  }
  EXPECT_TRUE(guards_intact({&out, &inp}));
  rows.set({4, 0, 0, 2, 5, 4});
  EXPECT_THROW(test_backend()->moe_gather(out, inp, rows, nullptr), Error);
}

struct CombineCase {
  int64_t N, k, C;
  DType dtype;
  bool weighted;
};

// dest_rows for N tokens with k choices over M = N*k - dropped rows: a random permutation of
// the rows, with the choices in `dropped` set to -1.
HostTensor random_dest_rows(Random& rng, int64_t N, int64_t k,
                            const std::vector<int64_t>& dropped) {
  HostTensor dest(DType::I32, {N, k});
  std::vector<int32_t> rows(static_cast<size_t>(N * k - static_cast<int64_t>(dropped.size())));
  std::iota(rows.begin(), rows.end(), 0);
  for (size_t i = rows.size(); i > 1; --i) {
    std::swap(rows[i - 1], rows[static_cast<size_t>(rng.integer(static_cast<int64_t>(i)))]);
  }
  size_t next = 0;
  for (int64_t i = 0; i < N * k; ++i) {
    const bool drop = std::find(dropped.begin(), dropped.end(), i) != dropped.end();
    dest.i32()[i] = drop ? -1 : rows[next++];
  }
  return dest;
}

// out[n] = sum_j w[n, j] y[dest[n, j]], in double.
std::vector<double> combine_reference(const std::vector<double>& y, const std::vector<double>& w,
                                      const HostTensor& dest, int64_t C) {
  const int64_t N = dest.shape()[0], k = dest.shape()[1];
  std::vector<double> out(static_cast<size_t>(N * C), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = dest.i32()[n * k + j];
      if (r < 0) continue;
      const double weight = w.empty() ? 1.0 : w[n * k + j];
      for (int64_t c = 0; c < C; ++c) out[n * C + c] += weight * y[r * C + c];
    }
  }
  return out;
}

void check_combine(const CombineCase& c) {
  Random rng(65);
  // Token 1 loses every choice; token 2 one of them.
  std::vector<int64_t> dropped = {2 * c.k};
  for (int64_t j = 0; j < c.k; ++j) dropped.push_back(1 * c.k + j);
  const HostTensor dest = random_dest_rows(rng, c.N, c.k, dropped);
  const int64_t M = c.N * c.k - static_cast<int64_t>(dropped.size());
  HostTensor y(c.dtype, {M, c.C}), w(DType::F32, {c.N, c.k}), out(c.dtype, {c.N, c.C});
  const std::vector<double> yv = y.fill_random(rng, -2.0, 2.0);
  const std::vector<double> wv = c.weighted ? w.fill_random(rng, 0.0, 1.0) : std::vector<double>();
  out.fill_nan();
  test_backend()->moe_combine(out, y, dest, c.weighted ? w.t() : Tensor(), nullptr);
  EXPECT_TRUE(
      all_close(out.values(), combine_reference(yv, wv, dest, c.C), output_tolerance(c.dtype)));
  for (int64_t ch = 0; ch < c.C; ++ch) EXPECT_EQ(out.get(1 * c.C + ch), 0.0) << "all dropped";
  EXPECT_TRUE(guards_intact({&out, &y, &w}));

  // Backward against finite differences of sum(out * r) in y and w.
  HostTensor dout(c.dtype, {c.N, c.C}), dy(c.dtype, {M, c.C}), dw(DType::F32, {c.N, c.k});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  dy.fill_nan();
  dw.fill_nan();
  test_backend()->moe_combine_backward(dy, c.weighted ? dw.t() : Tensor(), dout, y, dest,
                                       c.weighted ? w.t() : Tensor(), nullptr);
  const Tolerance tol = c.dtype == DType::F32 ? kF32Gradient : storage_tolerance(c.dtype);
  const std::vector<double> dy_ref = numeric_gradient(
      [&](const std::vector<double>& x) { return dot(combine_reference(x, wv, dest, c.C), r); },
      yv);
  EXPECT_TRUE(all_close(dy.values(), dy_ref, tol)) << "dinp";
  if (c.weighted) {
    const std::vector<double> dw_ref = numeric_gradient(
        [&](const std::vector<double>& x) { return dot(combine_reference(yv, x, dest, c.C), r); },
        wv);
    // dweight sums C products in fp32 from 16-bit inputs: fp32 rounding, not the storage's.
    EXPECT_TRUE(all_close(dw.values(), dw_ref, kF32Gradient)) << "dweight";
    EXPECT_EQ(dw.get(1 * c.k), 0.0) << "a dropped choice has no weight gradient";
  }
  EXPECT_TRUE(guards_intact({&dy, &dw, &dout}));
}

TEST(MoeCombine, WeightedRoundShapeF32) { check_combine({8, 2, 32, DType::F32, true}); }
TEST(MoeCombine, WeightedOddShapeBF16) { check_combine({5, 3, 13, DType::BF16, true}); }
TEST(MoeCombine, UnweightedIsTheGathersBackwardF16) { check_combine({6, 2, 9, DType::F16, false}); }

TEST(MoeCombine, ARowNamedTwiceInTheBackwardThrows) {
  HostTensor dest(DType::I32, {2, 1}), dout(DType::F32, {2, 3}), dinp(DType::F32, {2, 3});
  dest.set({1, 1});
  EXPECT_THROW(
      test_backend()->moe_combine_backward(dinp, Tensor(), dout, Tensor(), dest, Tensor(), nullptr),
      Error);
}

// ---- grouped matmul ------------------------------------------------------------------------

struct GroupedCase {
  std::vector<int> rows_per_expert;  // one of them 0
  int64_t C, OC, spare_rows;         // spare_rows: past offsets[E], left untouched
  DType dtype;
};

HostTensor offsets_of(const std::vector<int>& rows) {
  HostTensor offsets(DType::I32, {static_cast<int64_t>(rows.size()) + 1});
  offsets.i32()[0] = 0;
  for (size_t e = 0; e < rows.size(); ++e) offsets.i32()[e + 1] = offsets.i32()[e] + rows[e];
  return offsets;
}

// out rows of expert e = inp rows @ W_e^T, in double; rows past the last expert's stay `keep`.
std::vector<double> grouped_reference(const std::vector<double>& x, const std::vector<double>& w,
                                      const HostTensor& offsets, int64_t C, int64_t OC,
                                      std::vector<double> out) {
  const int64_t E = offsets.numel() - 1;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t m = offsets.i32()[e]; m < offsets.i32()[e + 1]; ++m) {
      for (int64_t o = 0; o < OC; ++o) {
        double sum = 0.0;
        for (int64_t c = 0; c < C; ++c) sum += x[m * C + c] * w[(e * OC + o) * C + c];
        out[m * OC + o] = sum;
      }
    }
  }
  return out;
}

void check_grouped(const GroupedCase& c) {
  Random rng(66);
  const HostTensor offsets = offsets_of(c.rows_per_expert);
  const int64_t E = static_cast<int64_t>(c.rows_per_expert.size());
  const int64_t M = offsets.i32()[E] + c.spare_rows;
  HostTensor x(c.dtype, {M, c.C}), w(c.dtype, {E, c.OC, c.C}), out(c.dtype, {M, c.OC});
  const std::vector<double> xv = x.fill_random(rng, -1.0, 1.0), wv = w.fill_random(rng, -1.0, 1.0);
  const std::vector<double> before = out.fill_random(rng, -1.0, 1.0);
  Backend& backend = *test_backend();
  backend.grouped_matmul_forward(out, x, w, offsets, nullptr);
  EXPECT_TRUE(all_close(out.values(), grouped_reference(xv, wv, offsets, c.C, c.OC, before),
                        output_tolerance(c.dtype)));
  // Bitwise matmul_forward on each expert's rows.
  HostTensor each(c.dtype, {M, c.OC});
  each.set(before);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = offsets.i32()[e], end = offsets.i32()[e + 1];
    if (b == end) continue;
    backend.matmul_forward(each.t().slice(b * c.OC, {end - b, c.OC}),
                           x.t().slice(b * c.C, {end - b, c.C}),
                           w.t().slice(e * c.OC * c.C, {c.OC, c.C}), Tensor(), true, nullptr);
  }
  EXPECT_TRUE(bitwise_equal(out, each));

  // Backward: dinp and dweight (accumulated onto random values) against finite differences of
  // sum(out * r); the empty expert's dweight stays as it was.
  HostTensor dout(c.dtype, {M, c.OC}), dx(c.dtype, {M, c.C}), dw(DType::F32, {E, c.OC, c.C});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dx_before = dx.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dw_before = dw.fill_random(rng, -1.0, 1.0);
  backend.grouped_matmul_backward(dx, dw, dout, x, w, offsets, nullptr);
  const std::vector<double> zeros(static_cast<size_t>(M * c.OC), 0.0);
  const auto loss = [&](const std::vector<double>& xs, const std::vector<double>& ws) {
    return dot(grouped_reference(xs, ws, offsets, c.C, c.OC, zeros), r);
  };
  std::vector<double> dx_ref =
      numeric_gradient([&](const std::vector<double>& v) { return loss(v, wv); }, xv);
  for (int64_t i = offsets.i32()[E] * c.C; i < M * c.C; ++i) dx_ref[i] = dx_before[i];
  std::vector<double> dw_ref =
      numeric_gradient([&](const std::vector<double>& v) { return loss(xv, v); }, wv);
  for (size_t i = 0; i < dw_ref.size(); ++i) dw_ref[i] += dw_before[i];
  const Tolerance tol = c.dtype == DType::F32 ? kF32Gradient : storage_tolerance(c.dtype);
  EXPECT_TRUE(all_close(dx.values(), dx_ref, tol)) << "dinp";
  EXPECT_TRUE(all_close(dw.values(), dw_ref, kF32Gradient)) << "dweight";
  for (int64_t e = 0; e < E; ++e) {
    if (c.rows_per_expert[static_cast<size_t>(e)] != 0) continue;
    for (int64_t i = e * c.OC * c.C; i < (e + 1) * c.OC * c.C; ++i) {
      ASSERT_EQ(dw.get(i), round_to(DType::F32, dw_before[i])) << "expert " << e << " has no rows";
    }
  }
  EXPECT_TRUE(guards_intact({&out, &x, &w, &dout, &dx, &dw}));
}

TEST(GroupedMatmul, RoundShapeF32WithAnEmptyExpert) {
  check_grouped({{4, 0, 8, 4}, 16, 8, 0, DType::F32});
}
TEST(GroupedMatmul, OddShapeBF16WithSpareRows) { check_grouped({{3, 5, 0}, 7, 5, 2, DType::BF16}); }
TEST(GroupedMatmul, OddShapeF16) { check_grouped({{1, 2, 3}, 9, 11, 1, DType::F16}); }

TEST(GroupedMatmul, OffsetsPastTheRowsThrow) {
  HostTensor x(DType::F32, {3, 4}), w(DType::F32, {2, 5, 4}), out(DType::F32, {3, 5});
  HostTensor offsets(DType::I32, {3});
  offsets.set({0, 2, 4});
  EXPECT_THROW(test_backend()->grouped_matmul_forward(out, x, w, offsets, nullptr), Error);
  offsets.set({0, 2, 1});
  EXPECT_THROW(test_backend()->grouped_matmul_forward(out, x, w, offsets, nullptr), Error);
}

}  // namespace
}  // namespace dstrain::test
