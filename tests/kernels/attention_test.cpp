// Causal self-attention forward/backward against a float64 reference and finite differences.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct AttentionCase {
  int64_t B, T, NH, hd;
  DType dtype;
  int64_t C() const { return NH * hd; }
};

struct AttentionResult {
  std::vector<double> out, lse;  // out (B,T,C), lse (B,NH,T)
};

AttentionResult attention_reference(const std::vector<double>& qkv, const AttentionCase& c) {
  const int64_t T = c.T, C = c.C(), hd = c.hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  AttentionResult r;
  r.out.assign(static_cast<size_t>(c.B * T * C), 0.0);
  r.lse.assign(static_cast<size_t>(c.B * c.NH * T), 0.0);
  std::vector<double> scores(static_cast<size_t>(T));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.NH; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * 3 * C + h * hd];
        double max_score = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const double* k = &qkv[(b * T + j) * 3 * C + C + h * hd];
          double s = 0.0;
          for (int64_t d = 0; d < hd; ++d) s += q[d] * k[d];
          scores[j] = s * scale;
          max_score = std::max(max_score, scores[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(scores[j] - max_score);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(scores[j] - max_score) / sum;
          const double* v = &qkv[(b * T + j) * 3 * C + 2 * C + h * hd];
          for (int64_t d = 0; d < hd; ++d) r.out[(b * T + i) * C + h * hd + d] += p * v[d];
        }
        r.lse[(b * c.NH + h) * T + i] = max_score + std::log(sum);
      }
    }
  }
  return r;
}

void check_forward(const AttentionCase& c) {
  Random rng(41);
  HostTensor qkv(c.dtype, {c.B, c.T, 3 * c.C()});
  HostTensor out(c.dtype, {c.B, c.T, c.C()}), lse(DType::F32, {c.B, c.NH, c.T});
  qkv.fill_random(rng, -1.5, 1.5);
  out.fill_nan();
  lse.fill_nan();
  test_backend()->attention_forward(out, lse, qkv, static_cast<int>(c.NH), nullptr);
  const AttentionResult ref = attention_reference(qkv.values(), c);
  Tolerance tol = storage_tolerance(c.dtype);
  if (c.dtype == DType::F32) tol = {2e-6, 1e-5, 1e-11};
  EXPECT_TRUE(all_close(out.values(), ref.out, tol)) << "out";
  EXPECT_TRUE(all_close(lse.values(), ref.lse, {1e-6, 1e-6, 1e-12})) << "lse";
  EXPECT_TRUE(guards_intact({&out, &lse, &qkv}));
}

void check_backward(const AttentionCase& c) {
  Random rng(42);
  HostTensor qkv(c.dtype, {c.B, c.T, 3 * c.C()});
  const std::vector<double> x = qkv.fill_random(rng, -1.5, 1.5);
  const AttentionResult saved = attention_reference(x, c);
  HostTensor out(c.dtype, {c.B, c.T, c.C()}), lse(DType::F32, {c.B, c.NH, c.T});
  out.set(saved.out);
  lse.set(saved.lse);
  HostTensor dout(c.dtype, {c.B, c.T, c.C()}), dqkv(c.dtype, {c.B, c.T, 3 * c.C()});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  dqkv.fill_nan();
  const HostTensor qkv_saved = qkv.clone(), out_saved = out.clone(), lse_saved = lse.clone(),
                   dout_saved = dout.clone();
  test_backend()->attention_backward(dqkv, dout, qkv, out, lse, static_cast<int>(c.NH), nullptr);
  const std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) { return dot(attention_reference(v, c).out, r); }, x);
  Tolerance tol = storage_tolerance(c.dtype);
  if (c.dtype == DType::F32) tol = {1e-5, 1e-4, 1e-9};
  EXPECT_TRUE(all_close(dqkv.values(), grad, tol)) << "dqkv";
  EXPECT_TRUE(guards_intact({&dqkv, &dout, &qkv, &out, &lse}));
  EXPECT_TRUE(bitwise_equal(qkv, qkv_saved) && bitwise_equal(out, out_saved) &&
              bitwise_equal(lse, lse_saved) && bitwise_equal(dout, dout_saved))
      << "inputs must be left unchanged";
}

TEST(Attention, ForwardRoundShapeF32) { check_forward({2, 8, 4, 8, DType::F32}); }
// Odd T and a head dimension that is not a power of two.
TEST(Attention, ForwardOddShapeF32) { check_forward({3, 7, 3, 5, DType::F32}); }
TEST(Attention, ForwardOddShapeF16) { check_forward({3, 7, 3, 5, DType::F16}); }
TEST(Attention, ForwardOddShapeBF16) { check_forward({3, 7, 3, 5, DType::BF16}); }
TEST(Attention, ForwardLongF32) { check_forward({1, 67, 2, 12, DType::F32}); }

TEST(Attention, BackwardRoundShapeF32) { check_backward({2, 8, 4, 8, DType::F32}); }
TEST(Attention, BackwardOddShapeF32) { check_backward({2, 7, 3, 5, DType::F32}); }
TEST(Attention, BackwardOddShapeF16) { check_backward({2, 7, 3, 5, DType::F16}); }
TEST(Attention, BackwardOddShapeBF16) { check_backward({2, 7, 3, 5, DType::BF16}); }
TEST(Attention, BackwardLongF32) { check_backward({1, 23, 2, 6, DType::F32}); }

TEST(Attention, ShapeMismatchThrows) {
  HostTensor qkv(DType::F32, {1, 4, 3 * 12}), out(DType::F32, {1, 4, 12});
  HostTensor lse(DType::F32, {1, 5, 4});
  // 12 channels are not divisible by 5 heads.
  EXPECT_THROW(test_backend()->attention_forward(out, lse, qkv, 5, nullptr), Error);
  HostTensor lse_wrong(DType::F32, {1, 3, 4});
  EXPECT_THROW(test_backend()->attention_forward(out, lse_wrong, qkv, 4, nullptr), Error);
  HostTensor lse_f16(DType::F16, {1, 4, 4});
  EXPECT_THROW(test_backend()->attention_forward(out, lse_f16, qkv, 4, nullptr), Error);
}

}  // namespace
}  // namespace dstrain::test
