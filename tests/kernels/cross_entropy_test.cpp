// Fused softmax + cross-entropy against log-softmax in double and finite differences.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct CrossEntropyCase {
  int64_t N, V, Vp;
  DType dtype;
};

HostTensor random_targets(Random& rng, const CrossEntropyCase& c) {
  HostTensor targets(DType::I32, {c.N});
  for (int64_t n = 0; n < c.N; ++n) targets.i32()[n] = static_cast<int32_t>(rng.integer(c.V));
  targets.i32()[0] = static_cast<int32_t>(c.V - 1);  // the last real column
  // Rows the loss does not count (chat data's prompt and padding): loss 0, gradient 0.
  for (int64_t n = 2; n < c.N; n += 3) targets.i32()[n] = kIgnoreTarget;
  return targets;
}

void check(const CrossEntropyCase& c, bool in_place, double logit_offset = 0.0) {
  Random rng(61);
  HostTensor logits(c.dtype, {c.N, c.Vp});
  std::vector<double> x = Random(62).vector(static_cast<size_t>(c.N * c.Vp), -4.0, 4.0);
  for (double& v : x) v += logit_offset;
  logits.set(x);
  x = logits.values();  // as stored
  HostTensor targets = random_targets(rng, c);
  HostTensor losses(DType::F32, {c.N}), dlogits(c.dtype, {c.N, c.Vp});
  HostTensor losses_only(DType::F32, {c.N});
  losses.fill_nan();
  losses_only.fill_nan();
  dlogits.fill_nan();
  const float dloss = 1.0f / static_cast<float>(c.N);
  // Losses alone first: logits are still intact when dlogits overwrites them in place.
  test_backend()->softmax_cross_entropy(losses_only, Tensor(), logits, targets,
                                        static_cast<int>(c.V), 0.0f, nullptr);
  Tensor dlogits_view = in_place ? logits.t() : dlogits.t();
  test_backend()->softmax_cross_entropy(losses, dlogits_view, logits, targets,
                                        static_cast<int>(c.V), dloss, nullptr);
  const HostTensor& grad_tensor = in_place ? logits : dlogits;

  std::vector<int64_t> t;
  for (double target : targets.values()) t.push_back(static_cast<int64_t>(target));
  const std::vector<double> ref = cross_entropy_reference(x, t, c.N, c.V, c.Vp);
  const Tolerance loss_tol{2e-6 * (1.0 + std::abs(logit_offset)), 1e-5, 1e-10};
  EXPECT_TRUE(all_close(losses.values(), ref, loss_tol)) << "losses";
  EXPECT_TRUE(bitwise_equal(losses, losses_only)) << "losses with and without dlogits";

  // d(dloss * sum(losses)) / dlogits by central differences over the real columns.
  const std::vector<double> grad = cross_entropy_numeric_gradient(x, t, c.N, c.V, c.Vp, dloss);
  const std::vector<double> got = grad_tensor.values();
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t j = c.V; j < c.Vp; ++j) {
      ASSERT_EQ(got[n * c.Vp + j], 0.0) << "padded column " << j << " of row " << n;
    }
  }
  Tolerance tol = storage_tolerance(c.dtype);
  tol.atol = c.dtype == DType::F32 ? 1e-7 : tol.atol * dloss;
  EXPECT_TRUE(all_close(got, grad, tol)) << "dlogits";
  EXPECT_TRUE(guards_intact({&losses, &dlogits, &logits, &targets}));
}

TEST(CrossEntropy, RoundShapeF32) { check({16, 50, 64, DType::F32}, false); }
TEST(CrossEntropy, OddShapeF32) { check({7, 37, 40, DType::F32}, false); }
TEST(CrossEntropy, OddShapeF16) { check({7, 37, 40, DType::F16}, false); }
TEST(CrossEntropy, OddShapeBF16) { check({7, 37, 40, DType::BF16}, false); }
TEST(CrossEntropy, InPlaceOddShapeF32) { check({7, 37, 40, DType::F32}, true); }
TEST(CrossEntropy, InPlaceOddShapeBF16) { check({7, 37, 40, DType::BF16}, true); }
// Max subtraction: exp(1000) would overflow.
TEST(CrossEntropy, LargeLogitsStableF32) { check({5, 37, 40, DType::F32}, false, 1000.0); }

TEST(CrossEntropy, TargetOutOfRangeThrows) {
  const int64_t N = 3, V = 5, Vp = 8;
  HostTensor logits(DType::F32, {N, Vp}), losses(DType::F32, {N}), targets(DType::I32, {N});
  Random rng(63);
  logits.fill_random(rng, -1.0, 1.0);
  // V and Vp - 1 are padded columns: not real targets.
  for (int32_t bad : {static_cast<int32_t>(V), static_cast<int32_t>(Vp - 1), -1}) {
    targets.set({0.0, 1.0, static_cast<double>(bad)});
    EXPECT_THROW(test_backend()->softmax_cross_entropy(losses, Tensor(), logits, targets,
                                                       static_cast<int>(V), 1.0f, nullptr),
                 UserError)
        << "target " << bad;
  }
  targets.set({0.0, 1.0, 2.0});
  EXPECT_THROW(test_backend()->softmax_cross_entropy(losses, Tensor(), logits, targets,
                                                     static_cast<int>(Vp + 1), 1.0f, nullptr),
               Error)
      << "vocab > Vp";
}

}  // namespace
}  // namespace dstrain::test
