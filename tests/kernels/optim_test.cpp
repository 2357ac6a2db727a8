// AdamW, sum_squares, scale and has_inf_or_nan against float64 references.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct AdamWCase {
  AdamWStep step;  // step.step is overwritten per iteration
  DType grad_dtype = DType::F32;
  DType copy_dtype = DType::F16;  // param_copy's dtype; F32 here means "no param_copy"
  int steps = 5;
  int64_t n = 10007;  // two element chunks, the second partial
};

// torch.optim.AdamW's update in double: decay, moments, bias-corrected step.
void adamw_reference(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
                     const std::vector<double>& grad, const AdamWStep& s) {
  const double beta1 = s.beta1, beta2 = s.beta2, lr = s.lr;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(s.step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(s.step));
  for (size_t i = 0; i < p.size(); ++i) {
    const double g = grad[i] * static_cast<double>(s.grad_scale);
    p[i] *= 1.0 - lr * static_cast<double>(s.weight_decay);
    m[i] = beta1 * m[i] + (1.0 - beta1) * g;
    v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
    const double denom = std::sqrt(v[i]) / std::sqrt(bias_correction2) + s.eps;
    p[i] -= lr / bias_correction1 * m[i] / denom;
  }
}

void check_adamw(AdamWCase c) {
  Random rng(71);
  HostTensor param(DType::F32, {c.n}), m(DType::F32, {c.n}), v(DType::F32, {c.n});
  HostTensor grad(c.grad_dtype, {c.n});
  HostTensor param_copy(c.copy_dtype, {c.n});
  const bool with_copy = c.copy_dtype != DType::F32;
  std::vector<double> p_ref = param.fill_random(rng, -1.0, 1.0);
  std::vector<double> m_ref(static_cast<size_t>(c.n), 0.0), v_ref(static_cast<size_t>(c.n), 0.0);
  m.set(m_ref);
  v.set(v_ref);
  for (int step = 1; step <= c.steps; ++step) {
    // Gradients change sign between steps, and a few are exactly zero.
    std::vector<double> g = grad.fill_random(rng, -2.0, 2.0);
    if (step == 2) {
      grad.set(0, 0.0);
      g[0] = 0.0;
    }
    param_copy.fill_nan();
    c.step.step = step;
    test_backend()->adamw(param, grad, m, v, with_copy ? param_copy.t() : Tensor(), c.step,
                          nullptr);
    adamw_reference(p_ref, m_ref, v_ref, g, c.step);
    ASSERT_TRUE(all_close(param.values(), p_ref, {2e-6, 2e-6, 1e-12})) << "param, step " << step;
    ASSERT_TRUE(all_close(m.values(), m_ref, {1e-6, 1e-5, 1e-12})) << "m, step " << step;
    ASSERT_TRUE(all_close(v.values(), v_ref, {1e-6, 1e-5, 1e-12})) << "v, step " << step;
    if (with_copy) {
      // Exactly the updated fp32 param rounded (RNE) to the copy's dtype.
      for (int64_t i = 0; i < c.n; ++i) {
        ASSERT_EQ(param_copy.get(i), round_to(c.copy_dtype, param.get(i))) << "index " << i;
      }
    }
    ASSERT_TRUE(guards_intact({&param, &m, &v, &grad, &param_copy}));
  }
}

TEST(AdamW, MatchesPyTorchFormulaNoWeightDecay) {
  AdamWCase c;
  c.step.lr = 1e-2f;
  c.copy_dtype = DType::F32;
  check_adamw(c);
}

TEST(AdamW, MatchesPyTorchFormulaWeightDecayAndGradScale) {
  AdamWCase c;
  c.step.lr = 3e-3f;
  c.step.beta2 = 0.999f;
  c.step.weight_decay = 0.1f;
  c.step.grad_scale = 0.5f;
  c.copy_dtype = DType::F32;
  check_adamw(c);
}

TEST(AdamW, BF16GradF16ParamCopy) {
  AdamWCase c;
  c.step.lr = 1e-2f;
  c.step.weight_decay = 0.1f;
  c.grad_dtype = DType::BF16;
  c.copy_dtype = DType::F16;
  check_adamw(c);
}

TEST(AdamW, F16GradBF16ParamCopy) {
  AdamWCase c;
  c.step.lr = 1e-2f;
  c.step.grad_scale = 0.25f;
  c.grad_dtype = DType::F16;
  c.copy_dtype = DType::BF16;
  check_adamw(c);
}

// beta1 < 0.5 takes ATen lerp's other branch (weight 1 - beta1 >= 0.5).
TEST(AdamW, SmallBeta1) {
  AdamWCase c;
  c.step.lr = 1e-2f;
  c.step.beta1 = 0.3f;
  c.copy_dtype = DType::F32;
  check_adamw(c);
}

TEST(AdamW, BadArgumentsThrow) {
  HostTensor param(DType::F32, {8}), grad(DType::F32, {8}), m(DType::F32, {8}), v(DType::F32, {7});
  AdamWStep step;
  EXPECT_THROW(test_backend()->adamw(param, grad, m, v, Tensor(), step, nullptr), Error);
  HostTensor v8(DType::F32, {8}), param_bf16(DType::BF16, {8});
  EXPECT_THROW(test_backend()->adamw(param_bf16, grad, m, v8, Tensor(), step, nullptr), Error)
      << "master weights must be F32";
  step.step = 0;
  EXPECT_THROW(test_backend()->adamw(param, grad, m, v8, Tensor(), step, nullptr), Error)
      << "step is 1-based";
}

void check_sum_squares(int64_t n, DType dtype) {
  Random rng(72);
  HostTensor x(dtype, {n});
  const std::vector<double> values = x.fill_random(rng, -3.0, 3.0);
  double ref = 0.0;
  for (double value : values) ref += value * value;
  const double got = test_backend()->sum_squares(x, nullptr);
  ASSERT_GT(ref, 0.0);
  EXPECT_NEAR(got, ref, 1e-12 * ref);
}

TEST(SumSquares, MultiChunkF32) { check_sum_squares(100003, DType::F32); }
TEST(SumSquares, OddShapeF32) { check_sum_squares(13, DType::F32); }
TEST(SumSquares, MultiChunkF16) { check_sum_squares(30001, DType::F16); }
TEST(SumSquares, MultiChunkBF16) { check_sum_squares(30001, DType::BF16); }

void check_scale(DType dtype) {
  Random rng(73);
  HostTensor x(dtype, {3, 7, 13});
  const std::vector<double> before = x.fill_random(rng, -1.0, 1.0);
  test_backend()->scale(x, 0.37f, nullptr);
  std::vector<double> ref(before.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = before[i] * static_cast<double>(0.37f);
  EXPECT_TRUE(all_close(x.values(), ref, storage_tolerance(dtype)));
  EXPECT_TRUE(guards_intact({&x}));
}

TEST(Scale, OddShapeF32) { check_scale(DType::F32); }
TEST(Scale, OddShapeF16) { check_scale(DType::F16); }
TEST(Scale, OddShapeBF16) { check_scale(DType::BF16); }

TEST(HasInfOrNan, FindsEachKindAnywhere) {
  for (DType dtype : kFloatDTypes) {
    HostTensor x(dtype, {20001});
    Random rng(74);
    x.fill_random(rng, -65000.0, 65000.0);
    EXPECT_FALSE(test_backend()->has_inf_or_nan(x, nullptr)) << dtype_name(dtype);
    for (int64_t index : {int64_t{0}, int64_t{9000}, int64_t{20000}}) {
      for (double bad : {double{INFINITY}, -double{INFINITY}, std::nan("")}) {
        HostTensor y = x.clone();
        y.set(index, bad);
        EXPECT_TRUE(test_backend()->has_inf_or_nan(y, nullptr))
            << dtype_name(dtype) << " " << bad << " at " << index;
      }
    }
  }
}

}  // namespace
}  // namespace dstrain::test
