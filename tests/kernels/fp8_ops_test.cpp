// The FP8 ops' CPU twin (kernels/ops.h: fp8_quantize, matmul_fp8) against references in double:
// the scale is the largest power of two that fits the amax (found in double), every element is
// the nearest FP8 value of x * s (core/fp8.h's conversion, itself checked against ml_dtypes and
// a search in double: tests/core/fp8_test.cpp), the transpose is the same bytes moved, a NaN
// gives scale 1; the GEMM is the double sum of the FP8 values' products, scaled, within fp32
// summation and the output's rounding, with a bias and accumulating. Shapes the ops refuse.
#include <cmath>
#include <limits>
#include <string>

#include "core/fp8.h"
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

constexpr DType kFp8[] = {DType::F8E4M3, DType::F8E5M2};

// 2^floor(log2(max / amax)), in double.
double scale_in_double(double amax, DType format) {
  const double max = fp8_layout(fp8_format(format)).max;
  return std::exp2(std::floor(std::log2(max / amax)));
}

float scale_inv_of(const HostTensor& scale_inv) { return static_cast<float>(scale_inv.get(0)); }

// Which copies an fp8_quantize call writes: out (R, C), out_t (C, R), or both.
enum Copies { kStraight = 1, kTransposed = 2, kBoth = 3 };

TEST(Fp8Quantize, EachElementIsTheNearestFp8ValueOfItsScaledInput) {
  Random rng(81);
  for (DType in_dtype : kFloatDTypes) {
    for (DType format : kFp8) {
      for (Copies copies : {kStraight, kTransposed, kBoth}) {
        const int64_t R = 37, C = 70;
        HostTensor inp(in_dtype, {R, C});
        const std::vector<double> x = inp.fill_random(rng, -3.0, 3.0);
        double amax = 0.0;
        for (double v : x) amax = std::max(amax, std::fabs(v));
        HostTensor out(format, {R, C}), out_t(format, {C, R}), scale_inv(DType::F32, {1});
        test_backend()->fp8_quantize(copies & kStraight ? out.t() : Tensor(),
                                     copies & kTransposed ? out_t.t() : Tensor(), scale_inv.t(),
                                     inp, Tensor(), nullptr);
        const double s = scale_in_double(amax, format);
        const std::string where = std::string(dtype_name(in_dtype)) + " -> " + dtype_name(format) +
                                  " copies " + std::to_string(copies);
        EXPECT_EQ(scale_inv_of(scale_inv), 1.0 / s) << where;
        for (bool transposed : {false, true}) {
          if (!(copies & (transposed ? kTransposed : kStraight))) continue;
          const auto* bits = static_cast<const uint8_t*>((transposed ? out_t : out).t().data);
          int64_t wrong = 0;
          double worst = 0.0;
          for (int64_t r = 0; r < R; ++r) {
            for (int64_t c = 0; c < C; ++c) {
              const double v = x[static_cast<size_t>(r * C + c)];
              const uint8_t got = bits[transposed ? c * R + r : r * C + c];
              if (got != fp32_to_fp8_bits(static_cast<float>(v * s), fp8_format(format), true)) {
                ++wrong;
              }
              // Within half an FP8 ulp of x: 2^-4 (E4M3) or 2^-3 (E5M2) of |x|, or half the
              // smallest subnormal (scaled back) near 0.
              const double back = fp8_bits_to_fp32(got, fp8_format(format)) / s;
              const double ulp = format == DType::F8E4M3 ? 0.125 : 0.25;
              const double tiny = std::ldexp(1.0, format == DType::F8E4M3 ? -10 : -17) / s;
              worst = std::max(worst, std::fabs(back - v) / (std::fabs(v) * ulp / 2 + tiny));
            }
          }
          EXPECT_EQ(wrong, 0) << where << (transposed ? " out_t" : " out");
          EXPECT_LE(worst, 1.0) << where;
        }
        EXPECT_TRUE(guards_intact({&out, &out_t, &scale_inv})) << where;
      }
    }
  }
}

// fp8_amax is max |x| (found in double), a NaN when one is there; fp8_quantize with that amax
// given is the same bytes and scale as finding it; a given amax is what sets the scale (twice
// the true one: half the scale).
TEST(Fp8Quantize, AGivenAmaxIsTheOneFp8AmaxFinds) {
  Random rng(83);
  for (DType in_dtype : kFloatDTypes) {
    HostTensor inp(in_dtype, {29, 48});
    const std::vector<double> x = inp.fill_random(rng, -7.0, 7.0);
    double want = 0.0;
    for (double v : x) want = std::max(want, std::fabs(v));
    HostTensor amax(DType::F32, {1});
    test_backend()->fp8_amax(amax, inp, nullptr);
    EXPECT_EQ(amax.get(0), want) << dtype_name(in_dtype);
    HostTensor found(DType::F8E4M3, {48, 29}), given(DType::F8E4M3, {48, 29});
    HostTensor found_inv(DType::F32, {1}), given_inv(DType::F32, {1});
    test_backend()->fp8_quantize(Tensor(), found, found_inv, inp, Tensor(), nullptr);
    test_backend()->fp8_quantize(Tensor(), given, given_inv, inp, amax, nullptr);
    EXPECT_TRUE(bitwise_equal(given, found)) << dtype_name(in_dtype);
    EXPECT_TRUE(bitwise_equal(given_inv, found_inv)) << dtype_name(in_dtype);
    amax.set(0, 2 * want);
    test_backend()->fp8_quantize(Tensor(), given, given_inv, inp, amax, nullptr);
    EXPECT_EQ(given_inv.get(0), 2 * found_inv.get(0)) << dtype_name(in_dtype);
    EXPECT_TRUE(guards_intact({&amax, &found, &given, &found_inv, &given_inv}));
  }
  HostTensor with_nan(DType::BF16, {3, 16}), amax(DType::F32, {1});
  with_nan.fill_random(rng, -1.0, 1.0);
  with_nan.set(20, std::nan(""));
  test_backend()->fp8_amax(amax, with_nan, nullptr);
  EXPECT_TRUE(std::isnan(amax.get(0)));
  HostTensor wide(DType::F32, {2});
  EXPECT_THROW(test_backend()->fp8_amax(wide, with_nan, nullptr), Error);
}

TEST(Fp8Quantize, RefusesNoCopyAndCopiesOfTwoFormats) {
  HostTensor inp(DType::F32, {4, 16}), scale_inv(DType::F32, {1});
  HostTensor e4m3(DType::F8E4M3, {4, 16}), e5m2_t(DType::F8E5M2, {16, 4});
  EXPECT_THROW(test_backend()->fp8_quantize(Tensor(), Tensor(), scale_inv, inp, Tensor(), nullptr),
               Error);
  EXPECT_THROW(test_backend()->fp8_quantize(e4m3, e5m2_t, scale_inv, inp, Tensor(), nullptr),
               Error);
  HostTensor wrong_t(DType::F8E5M2, {4, 16});
  EXPECT_THROW(test_backend()->fp8_quantize(Tensor(), wrong_t, scale_inv, inp, Tensor(), nullptr),
               Error);
}

TEST(Fp8Quantize, TheLargestMagnitudeLandsNearTheFormatsMaximum) {
  // amax exactly the format's largest value times a power of two: it maps onto that value.
  for (DType format : kFp8) {
    HostTensor inp(DType::F32, {2, 3});
    const double max = fp8_layout(fp8_format(format)).max;
    inp.set({0.5, -max / 8, 0.25, 1e-3, 3.0, -2.0});
    HostTensor out(format, {2, 3}), scale_inv(DType::F32, {1});
    test_backend()->fp8_quantize(out, Tensor(), scale_inv, inp, Tensor(), nullptr);
    EXPECT_EQ(scale_inv_of(scale_inv), 0.125f) << dtype_name(format);
    EXPECT_EQ(out.get(1), -max) << dtype_name(format);
  }
}

TEST(Fp8Quantize, ANaNGivesScaleOneAndStaysNaN) {
  Random rng(82);
  HostTensor inp(DType::BF16, {4, 8});
  inp.fill_random(rng, -100.0, 100.0);
  inp.set(13, std::nan(""));
  HostTensor out(DType::F8E4M3, {4, 8}), scale_inv(DType::F32, {1});
  test_backend()->fp8_quantize(out, Tensor(), scale_inv, inp, Tensor(), nullptr);
  EXPECT_EQ(scale_inv_of(scale_inv), 1.0f);
  EXPECT_TRUE(std::isnan(out.get(13)));
  EXPECT_EQ(out.get(0), load_f32(store_as<fp8e4m3_t>(static_cast<float>(inp.get(0)))));
}

struct GemmCase {
  int64_t M, N, K;
  DType a, b, out;
  bool bias, accumulate;
};

TEST(Fp8Matmul, IsTheScaledSumOfTheFp8ProductsInDouble) {
  const std::vector<GemmCase> cases = {
      {5, 16, 32, DType::F8E4M3, DType::F8E4M3, DType::F32, false, false},
      {33, 48, 64, DType::F8E4M3, DType::F8E5M2, DType::BF16, true, false},
      {7, 32, 16, DType::F8E5M2, DType::F8E4M3, DType::F16, false, true},
      {300, 272, 48, DType::F8E4M3, DType::F8E4M3, DType::BF16, true, false},  // several tiles
  };
  Random rng(83);
  for (const GemmCase& g : cases) {
    HostTensor a(g.a, {g.M, g.K}), b(g.b, {g.N, g.K});
    const std::vector<double> av = a.fill_random(rng, -448.0, 448.0);
    const std::vector<double> bv = b.fill_random(rng, -448.0, 448.0);
    HostTensor a_scale_inv(DType::F32, {1}), b_scale_inv(DType::F32, {1});
    a_scale_inv.set({0.0078125});  // 2^-7
    b_scale_inv.set({4.0});
    HostTensor bias(g.out, {g.bias ? g.N : 0});
    const std::vector<double> biasv = bias.fill_random(rng, -1.0, 1.0);
    HostTensor out(g.out, {g.M, g.N});
    const std::vector<double> before = out.fill_random(rng, -2.0, 2.0);
    test_backend()->matmul_fp8(out, a, a_scale_inv, b, b_scale_inv, bias, g.accumulate, nullptr);
    std::vector<double> ref(static_cast<size_t>(g.M * g.N));
    for (int64_t m = 0; m < g.M; ++m) {
      for (int64_t n = 0; n < g.N; ++n) {
        double sum = 0.0;
        for (int64_t k = 0; k < g.K; ++k) sum += av[m * g.K + k] * bv[n * g.K + k];
        double value = sum * 0.0078125 * 4.0;
        if (g.bias) value += biasv[n];
        if (g.accumulate) value += before[m * g.N + n];
        ref[m * g.N + n] = value;
      }
    }
    // fp32 sums of K products of up to 448^2 (exact each) and the output's rounding.
    Tolerance tol = storage_tolerance(g.out);
    tol.atol = std::max(tol.atol, 448.0 * 448.0 * 0.03125 * g.K * 1e-7);
    EXPECT_TRUE(all_close(out.values(), ref, tol))
        << g.M << "x" << g.N << "x" << g.K << " " << dtype_name(g.a) << " x " << dtype_name(g.b);
    EXPECT_TRUE(guards_intact({&out, &a, &b})) << g.M;
  }
}

TEST(Fp8Matmul, RefusesWhatTheFp8TensorCoresCannotTake) {
  const auto run = [](DType a_dtype, DType b_dtype, int64_t N, int64_t K) {
    HostTensor a(a_dtype, {4, K}), b(b_dtype, {N, K}), out(DType::BF16, {4, N});
    HostTensor a_scale_inv(DType::F32, {1}), b_scale_inv(DType::F32, {1});
    test_backend()->matmul_fp8(out, a, a_scale_inv, b, b_scale_inv, Tensor(), false, nullptr);
  };
  EXPECT_THROW(run(DType::F8E5M2, DType::F8E5M2, 16, 16), Error);
  EXPECT_THROW(run(DType::F8E4M3, DType::F8E4M3, 16, 24), Error);  // K not a multiple of 16
  EXPECT_THROW(run(DType::F8E4M3, DType::F8E4M3, 8, 16), Error);   // N
  EXPECT_THROW(run(DType::BF16, DType::F8E4M3, 16, 16), Error);
  EXPECT_NO_THROW(run(DType::F8E4M3, DType::F8E5M2, 16, 32));
}

}  // namespace
}  // namespace dstrain::test
