// The linear layers in FP8 (model/fp8_linear.h) on the CPU backend, against references computed
// here in double from the recipe itself: each operand scaled by the power of two that puts its
// amax at the format's largest value (core/fp8.h's fp8_scale_for_amax, checked against a search
// in double by tests/kernels/fp8_ops_test.cpp), rounded element by element to E4M3 (activations,
// weights) or E5M2 (gradients) by core/fp8.h's conversion (checked byte for byte against
// ml_dtypes by tests/core/fp8_test.cpp), multiplied and summed in double, and unscaled. Both
// weight layouts, with and without a bias, dW accumulated onto what it held. A linear that does
// not fit the FP8 GEMMs, or has no scratch, is the backend's matmul to the bit.
#include "model/fp8_linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/fp8.h"
#include "tests/kernels/kernel_test_util.h"

namespace dstrain {
namespace {

using test::bitwise_equal;
using test::HostTensor;
using test::Random;

// x as the FP8 recipe sees it: each element rounded to `format` after the tensor's scale, and
// unscaled again (exactly: the scale is a power of two).
std::vector<double> fp8_values(const std::vector<double>& x, Fp8Format format) {
  double amax = 0.0;
  for (double v : x) amax = std::max(amax, std::fabs(v));
  const float scale = fp8_scale_for_amax(static_cast<float>(amax), format);
  std::vector<double> out;
  for (double v : x) {
    const float scaled = static_cast<float>(v) * scale;
    out.push_back(fp8_bits_to_fp32(fp32_to_fp8_bits(scaled, format, true), format) /
                  static_cast<double>(scale));
  }
  return out;
}

struct Case {
  int64_t N, C, OC;
  bool out_by_in, bias;
};

// W[in][out] of the weight's values in either layout.
double weight_at(const std::vector<double>& w, const Case& c, int64_t in, int64_t out) {
  return c.out_by_in ? w[static_cast<size_t>(out * c.C + in)]
                     : w[static_cast<size_t>(in * c.OC + out)];
}

// |got - want| <= the bf16 output's rounding + fp32 summation of the rounded products.
void expect_close(const std::vector<double>& got, const std::vector<double>& want,
                  const std::vector<double>& magnitude, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = std::ldexp(std::fabs(want[i]), -8) + 1e-6 * magnitude[i] + 1e-6;
    if (std::fabs(got[i] - want[i]) > bound && bad++ == 0) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", the recipe's " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

struct LinearRun {
  Case c;
  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  HostTensor inp{DType::BF16, {c.N, c.C}}, dout{DType::BF16, {c.N, c.OC}};
  HostTensor weight{DType::BF16,
              c.out_by_in ? std::vector<int64_t>{c.OC, c.C} : std::vector<int64_t>{c.C, c.OC}};
  HostTensor bias{DType::BF16, {c.bias ? c.OC : 0}}, dbias{DType::F32, {c.bias ? c.OC : 0}};
  HostTensor out{DType::BF16, {c.N, c.OC}}, dinp{DType::BF16, {c.N, c.C}};
  HostTensor dweight{DType::F32, weight.shape()};
  HostTensor bytes{DType::F8E4M3, {fp8_scratch_bytes(c.N, c.C, c.OC, true)}}, scales{DType::F32, {2}};

  explicit LinearRun(Case cs, uint64_t seed) : c(cs) {
    Random rng(seed);
    inp.fill_random(rng, -3.0, 3.0);
    weight.fill_random(rng, -0.4, 0.4);
    dout.fill_random(rng, -1e-3, 1e-3);  // gradients are small: E5M2's range, not E4M3's
    bias.fill_random(rng, -1.0, 1.0);
    dbias.fill_random(rng, -1.0, 1.0);
    dweight.fill_random(rng, -1.0, 1.0);
  }
  Fp8Scratch scratch() { return {bytes.t(), scales.t()}; }
  void forward(const Fp8Scratch& fp8) {
    linear_forward(*backend, fp8, out.t(), inp.t(), weight.t(), c.bias ? bias.t() : Tensor(),
                   c.out_by_in, nullptr);
  }
  void backward(const Fp8Scratch& fp8) {
    linear_backward(*backend, fp8, dinp.t(), dweight.t(), c.bias ? dbias.t() : Tensor(), dout.t(),
                    inp.t(), weight.t(), c.out_by_in, nullptr);
  }
};

TEST(Fp8Linear, ForwardAndBackwardAreTheRecipesGemmsInDouble) {
  for (const Case& c : {Case{48, 32, 64, true, false}, Case{32, 64, 16, false, true},
                        Case{16, 48, 32, true, true}}) {
    const std::string where = std::to_string(c.N) + "x" + std::to_string(c.C) + "->" +
                              std::to_string(c.OC) + (c.out_by_in ? " (out, in)" : " (in, out)");
    LinearRun run(c, 11);
    const std::vector<double> dw0 = run.dweight.values(), db0 = run.dbias.values();
    run.forward(run.scratch());
    run.backward(run.scratch());

    const std::vector<double> x = fp8_values(run.inp.values(), Fp8Format::kE4M3);
    const std::vector<double> w = fp8_values(run.weight.values(), Fp8Format::kE4M3);
    const std::vector<double> g = fp8_values(run.dout.values(), Fp8Format::kE5M2);
    const std::vector<double> dy = run.dout.values(), b = run.bias.values();
    std::vector<double> out(c.N * c.OC), out_mag(out.size()), dinp(c.N * c.C),
        dinp_mag(dinp.size());
    std::vector<double> dw = dw0, dw_mag(dw.size()), db = db0;
    for (int64_t n = 0; n < c.N; ++n) {
      for (int64_t o = 0; o < c.OC; ++o) {
        double sum = c.bias ? b[o] : 0.0, mag = 0.0;
        for (int64_t i = 0; i < c.C; ++i) {
          sum += x[n * c.C + i] * weight_at(w, c, i, o);
          mag += std::fabs(x[n * c.C + i] * weight_at(w, c, i, o));
        }
        out[n * c.OC + o] = sum;
        out_mag[n * c.OC + o] = mag;
        if (c.bias) db[o] += dy[n * c.OC + o];
      }
      for (int64_t i = 0; i < c.C; ++i) {
        for (int64_t o = 0; o < c.OC; ++o) {
          dinp[n * c.C + i] += g[n * c.OC + o] * weight_at(w, c, i, o);
          dinp_mag[n * c.C + i] += std::fabs(g[n * c.OC + o] * weight_at(w, c, i, o));
          const size_t k = static_cast<size_t>(c.out_by_in ? o * c.C + i : i * c.OC + o);
          // wgrad's operands are the transposes, cast on their own: the same values.
          dw[k] += g[n * c.OC + o] * x[n * c.C + i];
          dw_mag[k] += std::fabs(g[n * c.OC + o] * x[n * c.C + i]);
        }
      }
    }
    expect_close(run.out.values(), out, out_mag, "out " + where);
    expect_close(run.dinp.values(), dinp, dinp_mag, "dinp " + where);
    // dW and dbias are F32: fp32 sums, no output rounding beyond it.
    std::vector<double> got_dw = run.dweight.values();
    for (size_t k = 0; k < dw.size(); ++k) {
      EXPECT_NEAR(got_dw[k], dw[k], 1e-6 * dw_mag[k] + 1e-6) << "dweight " << where << " " << k;
    }
    if (c.bias) {
      const std::vector<double> got_db = run.dbias.values();
      for (int64_t o = 0; o < c.OC; ++o) EXPECT_NEAR(got_db[o], db[o], 1e-5) << where;
    }

    // The same linear in bf16 is another result: FP8's rounding shows (the test can tell).
    LinearRun plain(c, 11);
    plain.forward({});
    double largest = 0.0;
    for (int64_t i = 0; i < c.N * c.OC; ++i) {
      largest = std::max(largest, std::fabs(plain.out.get(i) - run.out.get(i)));
    }
    EXPECT_GT(largest, 1e-2) << where;
  }
}

// Shapes matmul_fp8 cannot take (a side not a multiple of 16), or no scratch: the backend's own
// matmul, to the bit.
TEST(Fp8Linear, WhatDoesNotFitIsTheBackendsMatmul) {
  EXPECT_EQ(fp8_scratch_bytes(24, 32, 32, true), 0);
  EXPECT_EQ(fp8_scratch_bytes(32, 32, 32, false), (32 + 32) * 32);
  // forward (16 + 32) x 64 = 3072; backward dout twice, 2 x 16 x 32, then W^T or inp^T,
  // 64 x max(32, 16): 3072 too.
  EXPECT_EQ(fp8_scratch_bytes(16, 64, 32, true), 48 * 64);
  // forward (64 + 32) x 16 = 1536; backward 2 x 64 x 32 + 16 x max(32, 64) = 5120.
  EXPECT_EQ(fp8_scratch_bytes(64, 16, 32, true), 5120);
  for (const Case& c : {Case{24, 32, 32, true, true}, Case{32, 40, 32, false, false}}) {
    LinearRun fp8(c, 12), plain(c, 12);
    HostTensor bytes(DType::F8E4M3, {4096}), scales(DType::F32, {2});
    fp8.forward({bytes.t(), scales.t()});
    fp8.backward({bytes.t(), scales.t()});
    plain.backend->matmul_forward(plain.out.t(), plain.inp.t(), plain.weight.t(),
                                  c.bias ? plain.bias.t() : Tensor(), c.out_by_in, nullptr);
    plain.backend->matmul_backward(plain.dinp.t(), plain.dweight.t(),
                                   c.bias ? plain.dbias.t() : Tensor(), plain.dout.t(),
                                   plain.inp.t(), plain.weight.t(), c.out_by_in, nullptr);
    EXPECT_TRUE(bitwise_equal(fp8.out, plain.out)) << c.N << "x" << c.C;
    EXPECT_TRUE(bitwise_equal(fp8.dinp, plain.dinp)) << c.N << "x" << c.C;
    EXPECT_TRUE(bitwise_equal(fp8.dweight, plain.dweight)) << c.N << "x" << c.C;
    EXPECT_TRUE(bitwise_equal(fp8.dbias, plain.dbias)) << c.N << "x" << c.C;
  }
}

// Without dinp (a first layer's input needs no gradient), dout is cast into wgrad's layout
// alone: the same dweight and dbias to the bit, in the scratch the sizing gives.
TEST(Fp8Linear, BackwardWithoutDinpGivesTheSameWeightGradient) {
  for (const Case& c : {Case{48, 32, 64, true, true}, Case{64, 16, 32, false, false}}) {
    LinearRun both(c, 13), alone(c, 13);
    both.backward(both.scratch());
    linear_backward(*alone.backend, alone.scratch(), Tensor(), alone.dweight.t(),
                    c.bias ? alone.dbias.t() : Tensor(), alone.dout.t(), alone.inp.t(),
                    alone.weight.t(), c.out_by_in, nullptr);
    EXPECT_TRUE(bitwise_equal(alone.dweight, both.dweight)) << c.N << "x" << c.C << "->" << c.OC;
    EXPECT_TRUE(bitwise_equal(alone.dbias, both.dbias));
    LinearRun fresh(c, 13);
    EXPECT_FALSE(bitwise_equal(alone.dweight, fresh.dweight));  // it did accumulate
  }
}

// A cached weight (Fp8Scratch::w, wt, the decoder's weight cache): cast once into both layouts
// where it is stale, then read as it is: the same bits as casting at each use. Taken for fresh
// after the weight changed, it is the old weight's cast that the GEMMs read (the cache is what
// they use). A micro-batch whose tokens FP8 cannot take still casts a stale one (the stage
// counts the cache fresh after the layer ran).
TEST(Fp8Linear, ACachedWeightGivesTheSameBitsAndIsCastWhenStale) {
  for (const Case& c : {Case{48, 32, 64, true, true}, Case{32, 64, 16, false, false}}) {
    const std::string where = std::to_string(c.C) + "->" + std::to_string(c.OC);
    LinearRun plain(c, 14), cached(c, 14);
    plain.forward(plain.scratch());
    plain.backward(plain.scratch());
    HostTensor w(DType::F8E4M3, {c.OC, c.C}), wt(DType::F8E4M3, {c.C, c.OC}), s(DType::F32, {1});
    Fp8Scratch fp8 = cached.scratch();
    fp8.w = w.t();
    fp8.wt = wt.t();
    fp8.weight_scale_inv = s.t();
    cached.forward(fp8);  // stale: cast here
    fp8.weight_fresh = true;
    cached.backward(fp8);
    EXPECT_TRUE(bitwise_equal(cached.out, plain.out)) << where;
    EXPECT_TRUE(bitwise_equal(cached.dinp, plain.dinp)) << where;
    EXPECT_TRUE(bitwise_equal(cached.dweight, plain.dweight)) << where;

    const HostTensor out_before = cached.out.clone(), w_before = w.clone();
    Random rng(15);
    cached.weight.fill_random(rng, -0.4, 0.4);
    cached.forward(fp8);  // taken for fresh: the old cast
    EXPECT_TRUE(bitwise_equal(cached.out, out_before)) << where;
    fp8.weight_fresh = false;
    cached.forward(fp8);
    EXPECT_FALSE(bitwise_equal(cached.out, out_before)) << where;
    EXPECT_FALSE(bitwise_equal(w, w_before)) << where;

    // 24 tokens: the backend's matmul in bf16, and the stale cache cast all the same.
    Case ragged = c;
    ragged.N = 24;
    LinearRun small(ragged, 16);
    HostTensor w2(DType::F8E4M3, {c.OC, c.C}), wt2(DType::F8E4M3, {c.C, c.OC}), s2(DType::F32, {1});
    HostTensor bytes(DType::F8E4M3, {4096});  // scratch: the linear still does not fit
    Fp8Scratch fp8_small{bytes.t(), small.scales.t()};
    fp8_small.w = w2.t();
    fp8_small.wt = wt2.t();
    fp8_small.weight_scale_inv = s2.t();
    small.forward(fp8_small);
    HostTensor want_w(DType::F8E4M3, {c.OC, c.C}), want_wt(DType::F8E4M3, {c.C, c.OC}),
        want_s(DType::F32, {1});
    small.backend->fp8_quantize(c.out_by_in ? want_w.t() : want_wt.t(),
                                c.out_by_in ? want_wt.t() : want_w.t(), want_s.t(),
                                small.weight.t(), Tensor(), nullptr);
    EXPECT_TRUE(bitwise_equal(w2, want_w)) << where;
    EXPECT_TRUE(bitwise_equal(wt2, want_wt)) << where;
    EXPECT_TRUE(bitwise_equal(s2, want_s)) << where;
  }
}

// The input's amax kept from forward to backward (Fp8Scratch::input_amax): the same bits as
// finding it in both, and it holds max |inp| after forward.
TEST(Fp8Linear, AKeptInputAmaxGivesTheSameBits) {
  for (const Case& c : {Case{48, 32, 64, true, true}, Case{32, 64, 16, false, false}}) {
    LinearRun plain(c, 17), kept(c, 17);
    plain.forward(plain.scratch());
    plain.backward(plain.scratch());
    HostTensor amax(DType::F32, {1});
    Fp8Scratch fp8 = kept.scratch();
    fp8.input_amax = amax.t();
    kept.forward(fp8);
    double want = 0.0;
    for (double v : kept.inp.values()) want = std::max(want, std::fabs(v));
    EXPECT_EQ(amax.get(0), want);
    kept.backward(fp8);
    EXPECT_TRUE(bitwise_equal(kept.out, plain.out));
    EXPECT_TRUE(bitwise_equal(kept.dinp, plain.dinp));
    EXPECT_TRUE(bitwise_equal(kept.dweight, plain.dweight));
  }
}

}  // namespace
}  // namespace dstrain
