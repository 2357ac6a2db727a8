// The vocabulary-parallel softmax + cross-entropy (cross_entropy_stats, then
// cross_entropy_from_stats) over P slices of the logits' columns, against log-softmax in
// double and finite differences of the whole vocabulary.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct SliceCase {
  int64_t N, P, Vs, V;  // rows, slices, columns per slice, real columns (V <= P * Vs)
  DType dtype;
};

int64_t whole_columns(const SliceCase& c) { return c.P * c.Vs; }

// Columns [p*Vs, (p+1)*Vs) of the whole (N, W) values.
std::vector<double> slice_columns(const std::vector<double>& whole, const SliceCase& c, int64_t p) {
  std::vector<double> out;
  for (int64_t n = 0; n < c.N; ++n) {
    const auto row = whole.begin() + n * whole_columns(c) + p * c.Vs;
    out.insert(out.end(), row, row + c.Vs);
  }
  return out;
}

struct SlicedRun {
  std::vector<std::vector<double>> losses;  // per slice: every slice computes all N losses
  std::vector<double> dlogits;              // (N, W), the slices' gradients side by side
};

// Runs both halves on every slice (the all-gather of the statistics is a copy here).
SlicedRun run_slices(const std::vector<double>& x, const HostTensor& targets, const SliceCase& c,
                     float dloss, bool in_place) {
  const int vocab = static_cast<int>(c.V);
  std::vector<HostTensor> logits;
  HostTensor all_stats(DType::F32, {c.P, c.N, 3});
  all_stats.fill_nan();
  for (int64_t p = 0; p < c.P; ++p) {
    logits.emplace_back(c.dtype, std::vector<int64_t>{c.N, c.Vs});
    logits.back().set(slice_columns(x, c, p));
    Tensor stats = all_stats.t().slice(p * c.N * 3, {c.N, 3});
    test_backend()->cross_entropy_stats(stats, logits.back(), targets, p * c.Vs, vocab, nullptr);
  }
  SlicedRun run;
  run.dlogits.assign(static_cast<size_t>(c.N * whole_columns(c)), 0.0);
  for (int64_t p = 0; p < c.P; ++p) {
    HostTensor losses(DType::F32, {c.N}), dlogits(c.dtype, {c.N, c.Vs});
    losses.fill_nan();
    dlogits.fill_nan();
    HostTensor& grad = in_place ? logits[static_cast<size_t>(p)] : dlogits;
    test_backend()->cross_entropy_from_stats(losses, grad, logits[static_cast<size_t>(p)],
                                             all_stats, targets, p * c.Vs, vocab, dloss, nullptr);
    run.losses.push_back(losses.values());
    const std::vector<double> g = grad.values();
    for (int64_t n = 0; n < c.N; ++n) {
      std::copy(g.begin() + n * c.Vs, g.begin() + (n + 1) * c.Vs,
                run.dlogits.begin() + n * whole_columns(c) + p * c.Vs);
    }
    EXPECT_TRUE(guards_intact({&losses, &dlogits, &all_stats, &targets}));
  }
  return run;
}

void check(const SliceCase& c, bool in_place, double logit_offset = 0.0) {
  const int64_t W = whole_columns(c);
  // Round the logits to the storage dtype once: the reference sees the stored values.
  HostTensor whole(c.dtype, {c.N, W});
  std::vector<double> x = Random(71).vector(static_cast<size_t>(c.N * W), -4.0, 4.0);
  for (double& v : x) v += logit_offset;
  whole.set(x);
  x = whole.values();
  Random rng(72);
  HostTensor targets(DType::I32, {c.N});
  std::vector<int64_t> t(static_cast<size_t>(c.N));
  for (int64_t n = 0; n < c.N; ++n) t[n] = rng.integer(c.V);
  t[0] = c.V - 1;  // the last real column
  t[1] = 0;
  for (int64_t n = 2; n < c.N; n += 3) t[n] = kIgnoreTarget;  // not counted: loss 0, gradient 0
  for (int64_t n = 0; n < c.N; ++n) targets.i32()[n] = static_cast<int32_t>(t[n]);
  const float dloss = 1.0f / static_cast<float>(c.N);

  const SlicedRun run = run_slices(x, targets, c, dloss, in_place);
  for (int64_t p = 1; p < c.P; ++p) {
    EXPECT_EQ(run.losses[static_cast<size_t>(p)], run.losses[0]) << "slice " << p << "'s losses";
  }
  const Tolerance loss_tol{2e-6 * (1.0 + std::abs(logit_offset)), 1e-5, 1e-10};
  EXPECT_TRUE(all_close(run.losses[0], cross_entropy_reference(x, t, c.N, c.V, W), loss_tol))
      << "losses";

  const std::vector<double> grad = cross_entropy_numeric_gradient(x, t, c.N, c.V, W, dloss);
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t j = c.V; j < W; ++j) {
      ASSERT_EQ(run.dlogits[n * W + j], 0.0) << "column " << j << " of row " << n;
    }
  }
  Tolerance tol = storage_tolerance(c.dtype);
  tol.atol = c.dtype == DType::F32 ? 1e-7 : tol.atol * dloss;
  EXPECT_TRUE(all_close(run.dlogits, grad, tol)) << "dlogits";
}

// 97 real columns over 3 slices of 40: the last slice has 17 real columns.
TEST(VocabParallelCrossEntropy, ThreeSlicesF32) { check({9, 3, 40, 97, DType::F32}, false); }
TEST(VocabParallelCrossEntropy, ThreeSlicesBF16) { check({9, 3, 40, 97, DType::BF16}, false); }
TEST(VocabParallelCrossEntropy, ThreeSlicesF16InPlace) { check({9, 3, 40, 97, DType::F16}, true); }
// 70 real columns over 4 slices of 32: slice 2 has 6 real columns, slice 3 none.
TEST(VocabParallelCrossEntropy, SliceWithoutRealColumnsF32) {
  check({6, 4, 32, 70, DType::F32}, true);
}
TEST(VocabParallelCrossEntropy, OneSliceIsTheWholeVocabulary) {
  check({5, 1, 40, 37, DType::F32}, false);
}
// The global max is subtracted: exp(1000) would overflow.
TEST(VocabParallelCrossEntropy, LargeLogitsStableF32) {
  check({5, 2, 24, 45, DType::F32}, false, 1000.0);
}

TEST(VocabParallelCrossEntropy, TargetOutOfRangeThrows) {
  const int64_t N = 3, Vs = 8;
  HostTensor logits(DType::F32, {N, Vs}), stats(DType::F32, {2, N, 3}), targets(DType::I32, {N});
  HostTensor losses(DType::F32, {N});
  Random rng(73);
  logits.fill_random(rng, -1.0, 1.0);
  stats.fill_random(rng, 0.5, 1.0);
  for (int32_t bad : {13, 15, -1}) {  // vocab 13 of 16 columns
    targets.set({0.0, 9.0, static_cast<double>(bad)});
    EXPECT_THROW(test_backend()->cross_entropy_stats(stats.t().slice(0, {N, 3}), logits, targets, 0,
                                                     13, nullptr),
                 UserError)
        << "target " << bad;
    EXPECT_THROW(test_backend()->cross_entropy_from_stats(losses, Tensor(), logits, stats, targets,
                                                          Vs, 13, 1.0f, nullptr),
                 UserError)
        << "target " << bad;
  }
  targets.set({0.0, 9.0, 12.0});
  // Two slices of 8 columns cannot hold a vocabulary of 17.
  EXPECT_THROW(test_backend()->cross_entropy_from_stats(losses, Tensor(), logits, stats, targets,
                                                        Vs, 17, 1.0f, nullptr),
               Error);
}

}  // namespace
}  // namespace dstrain::test
