// Embedding forward/backward against a float64 reference and finite differences; with positions
// (packed sequences), the wpe row of each token is its position.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

struct EmbeddingCase {
  int64_t B, T, C, Vp, maxT;
  DType dtype;
  std::vector<int32_t> positions = {};  // (B*T) of packed sequences; empty: t
  int64_t position(int64_t bt) const {
    return positions.empty() ? bt % T : positions[static_cast<size_t>(bt)];
  }
};


// out (B,T,C) = wte[tokens] + wpe[t], in double.
std::vector<double> embedding_reference(const std::vector<double>& tokens,
                                        const std::vector<double>& wte,
                                        const std::vector<double>& wpe, const EmbeddingCase& c) {
  std::vector<double> out(static_cast<size_t>(c.B * c.T * c.C));
  for (int64_t bt = 0; bt < c.B * c.T; ++bt) {
    const int64_t token = static_cast<int64_t>(tokens[bt]), t = c.position(bt);
    for (int64_t ch = 0; ch < c.C; ++ch) {
      out[bt * c.C + ch] = wte[token * c.C + ch] + wpe[t * c.C + ch];
    }
  }
  return out;
}

// Token ids from a small range, so that several positions share a token, plus the largest id.
HostTensor random_tokens(Random& rng, const EmbeddingCase& c) {
  HostTensor tokens(DType::I32, {c.B, c.T});
  for (int64_t i = 0; i < c.B * c.T; ++i) {
    tokens.i32()[i] = static_cast<int32_t>(rng.integer(std::max<int64_t>(c.Vp / 4, 2)));
  }
  tokens.i32()[c.B * c.T - 1] = static_cast<int32_t>(c.Vp - 1);
  return tokens;
}

void check_forward(const EmbeddingCase& c) {
  Random rng(11);
  HostTensor tokens = random_tokens(rng, c);
  HostTensor wte(c.dtype, {c.Vp, c.C}), wpe(c.dtype, {c.maxT, c.C});
  HostTensor out(c.dtype, {c.B, c.T, c.C});
  wte.fill_random(rng, -1.0, 1.0);
  wpe.fill_random(rng, -1.0, 1.0);
  out.fill_nan();
  const HostTensor positions = positions_tensor(c.B, c.T, c.positions);
  test_backend()->embedding_forward(out, tokens, positions_view(positions), wte, wpe, 0,
                                    wte.t().size(0), nullptr);
  const std::vector<double> ref =
      embedding_reference(tokens.values(), wte.values(), wpe.values(), c);
  EXPECT_TRUE(all_close(out.values(), ref, storage_tolerance(c.dtype)));
  EXPECT_TRUE(guards_intact({&out, &wte, &wpe, &tokens}));
}

void check_backward(const EmbeddingCase& c) {
  Random rng(12);
  HostTensor tokens = random_tokens(rng, c);
  HostTensor dout(c.dtype, {c.B, c.T, c.C});
  HostTensor dwte(c.dtype, {c.Vp, c.C}), dwpe(c.dtype, {c.maxT, c.C});
  const std::vector<double> r = dout.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dwte_before = dwte.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dwpe_before = dwpe.fill_random(rng, -1.0, 1.0);
  const HostTensor positions = positions_tensor(c.B, c.T, c.positions);
  test_backend()->embedding_backward(dwte, dwpe, dout, tokens, positions_view(positions), 0,
                                     dwte.t().size(0), nullptr);

  // L = sum(out * R) with R = dout; its gradients by central differences in double.
  const std::vector<double> token_ids = tokens.values();
  std::vector<double> wte0 = Random(13).vector(static_cast<size_t>(c.Vp * c.C), -1.0, 1.0);
  std::vector<double> wpe0 = Random(14).vector(static_cast<size_t>(c.maxT * c.C), -1.0, 1.0);
  const std::vector<double> grad_wte = numeric_gradient(
      [&](const std::vector<double>& w) {
        return dot(embedding_reference(token_ids, w, wpe0, c), r);
      },
      wte0);
  const std::vector<double> grad_wpe = numeric_gradient(
      [&](const std::vector<double>& w) {
        return dot(embedding_reference(token_ids, wte0, w, c), r);
      },
      wpe0);
  Tolerance tol = storage_tolerance(c.dtype);
  tol.atol = std::max(tol.atol, 1e-5);  // finite differences of fp32 results
  EXPECT_TRUE(all_close(dwte.values(), add(dwte_before, grad_wte), tol)) << "dwte";
  EXPECT_TRUE(all_close(dwpe.values(), add(dwpe_before, grad_wpe), tol)) << "dwpe";
  EXPECT_TRUE(guards_intact({&dwte, &dwpe, &dout, &tokens}));
}

// Packed rows (sequences of 2, 4 and 1, then 7): positions restart, rows share them.
EmbeddingCase packed(DType dtype) {
  EmbeddingCase c{2, 7, 13, 37, 9, dtype};
  c.positions = {0, 1, 0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 6};
  return c;
}
TEST(Embedding, PackedForwardAndBackward) {
  for (DType dtype : kFloatDTypes) {
    check_forward(packed(dtype));
    check_backward(packed(dtype));
  }
}

TEST(Embedding, ForwardRoundShapeF32) { check_forward({2, 8, 32, 64, 16, DType::F32}); }
TEST(Embedding, ForwardOddShapeF32) { check_forward({3, 7, 13, 37, 9, DType::F32}); }
TEST(Embedding, ForwardOddShapeF16) { check_forward({3, 7, 13, 37, 9, DType::F16}); }
TEST(Embedding, ForwardOddShapeBF16) { check_forward({3, 7, 13, 37, 9, DType::BF16}); }

TEST(Embedding, BackwardRoundShapeF32) { check_backward({2, 8, 32, 64, 16, DType::F32}); }
TEST(Embedding, BackwardOddShapeF32) { check_backward({3, 7, 13, 37, 9, DType::F32}); }
TEST(Embedding, BackwardOddShapeF16) { check_backward({3, 7, 13, 37, 9, DType::F16}); }
TEST(Embedding, BackwardOddShapeBF16) { check_backward({3, 7, 13, 37, 9, DType::BF16}); }

// Vocabulary parallelism: the table cut into `slices` row slices. Each slice embeds only its
// tokens (zero rows elsewhere), so the slices' outputs sum to the whole table's bitwise; the
// backward scatters into each slice only its tokens' rows and gives every slice all of dwpe.
void check_vocab_slices(const EmbeddingCase& c, int64_t slices) {
  const int64_t Vs = c.Vp / slices, N = c.B * c.T;
  Random rng(16);
  HostTensor tokens(DType::I32, {c.B, c.T});
  for (int64_t i = 0; i < N; ++i) tokens.i32()[i] = static_cast<int32_t>(rng.integer(c.Vp));
  HostTensor wte(c.dtype, {c.Vp, c.C}), wpe(c.dtype, {c.maxT, c.C}), dout(c.dtype, {c.B, c.T, c.C});
  const std::vector<double> table = wte.fill_random(rng, -1.0, 1.0);
  wpe.fill_random(rng, -1.0, 1.0);
  dout.fill_random(rng, -1.0, 1.0);
  HostTensor whole_out(c.dtype, {c.B, c.T, c.C}), dwte(c.dtype, {c.Vp, c.C});
  HostTensor dwpe(c.dtype, {c.maxT, c.C});
  const std::vector<double> dwte_before = dwte.fill_random(rng, -1.0, 1.0);
  const std::vector<double> dwpe_before = dwpe.fill_random(rng, -1.0, 1.0);
  test_backend()->embedding_forward(whole_out, tokens, wte, wpe, 0, c.Vp, nullptr);
  test_backend()->embedding_backward(dwte, dwpe, dout, tokens, 0, c.Vp, nullptr);

  std::vector<double> sum(static_cast<size_t>(N * c.C), 0.0);
  for (int64_t s = 0; s < slices; ++s) {
    auto rows = [&](const std::vector<double>& v) {
      return std::vector<double>(v.begin() + s * Vs * c.C, v.begin() + (s + 1) * Vs * c.C);
    };
    HostTensor wte_slice(c.dtype, {Vs, c.C}), out(c.dtype, {c.B, c.T, c.C});
    HostTensor dwte_slice(c.dtype, {Vs, c.C}), dwpe_slice(c.dtype, {c.maxT, c.C});
    wte_slice.set(rows(table));
    dwte_slice.set(rows(dwte_before));
    dwpe_slice.set(dwpe_before);
    out.fill_nan();
    test_backend()->embedding_forward(out, tokens, wte_slice, wpe, s * Vs, c.Vp, nullptr);
    const std::vector<double> o = out.values();
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += o[i];
    test_backend()->embedding_backward(dwte_slice, dwpe_slice, dout, tokens, s * Vs, c.Vp,
                                       nullptr);
    EXPECT_EQ(dwte_slice.values(), rows(dwte.values())) << "dwte of slice " << s;
    EXPECT_EQ(dwpe_slice.values(), dwpe.values()) << "dwpe of slice " << s;
    EXPECT_TRUE(guards_intact({&out, &wte_slice, &dwte_slice, &dwpe_slice}));
  }
  EXPECT_EQ(sum, whole_out.values()) << "the sum of the slices' embeddings";
}

TEST(Embedding, VocabularySlicesF32) { check_vocab_slices({3, 7, 13, 48, 9, DType::F32}, 3); }
TEST(Embedding, VocabularySlicesBF16) { check_vocab_slices({2, 8, 32, 64, 16, DType::BF16}, 4); }

TEST(Embedding, SliceOutsideTheVocabularyThrows) {
  HostTensor wte(DType::F32, {4, 2}), wpe(DType::F32, {3, 2}), out(DType::F32, {1, 3, 2});
  HostTensor tokens(DType::I32, {1, 3});
  for (int i = 0; i < 3; ++i) tokens.i32()[i] = i;
  EXPECT_THROW(test_backend()->embedding_forward(out, tokens, wte, wpe, 6, 8, nullptr), Error);
  EXPECT_THROW(test_backend()->embedding_forward(out, tokens, wte, wpe, -1, 8, nullptr), Error);
  // A token of the whole vocabulary outside this slice is not an error, one outside it is.
  tokens.i32()[2] = 7;
  EXPECT_NO_THROW(test_backend()->embedding_forward(out, tokens, wte, wpe, 0, 8, nullptr));
  tokens.i32()[2] = 8;
  EXPECT_THROW(test_backend()->embedding_forward(out, tokens, wte, wpe, 4, 8, nullptr), UserError);
}

TEST(Embedding, TokenOutOfRangeThrows) {
  const int64_t B = 2, T = 3, C = 4, Vp = 5;
  HostTensor wte(DType::F32, {Vp, C}), wpe(DType::F32, {T, C}), out(DType::F32, {B, T, C});
  HostTensor tokens(DType::I32, {B, T});
  Random rng(15);
  wte.fill_random(rng, -1.0, 1.0);
  wpe.fill_random(rng, -1.0, 1.0);
  for (int32_t bad : {static_cast<int32_t>(Vp), -1}) {
    for (int64_t i = 0; i < B * T; ++i) tokens.i32()[i] = static_cast<int32_t>(i % Vp);
    tokens.i32()[4] = bad;
    EXPECT_THROW(test_backend()->embedding_forward(out, tokens, wte, wpe, 0, wte.t().size(0), nullptr), UserError)
        << "token " << bad;
    EXPECT_THROW(test_backend()->embedding_backward(wte, wpe, out, tokens, 0, wte.t().size(0), nullptr), UserError)
        << "token " << bad;
  }
}

TEST(Embedding, ShapeMismatchThrows) {
  HostTensor wte(DType::F32, {5, 4}), wpe(DType::F32, {2, 4}), out(DType::F32, {1, 3, 4});
  HostTensor tokens(DType::I32, {1, 3});
  for (int i = 0; i < 3; ++i) tokens.i32()[i] = 0;
  // wpe has fewer rows (maxT = 2) than T = 3.
  EXPECT_THROW(test_backend()->embedding_forward(out, tokens, wte, wpe, 0, wte.t().size(0), nullptr), Error);
}

}  // namespace
}  // namespace dstrain::test
