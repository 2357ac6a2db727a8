// Fresh parameters drawn in parallel (model/init.cpp) equal one sequential loop over each
// tensor's stream, for any number of threads, including the rare redrawn first uniform.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "model/architecture.h"

namespace dstrain {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

std::vector<float> sequential_normals(Rng rng, int64_t n, double stddev) {
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = static_cast<float>(rng.normal() * stddev);
  return out;
}

std::vector<float> parallel_normals(const Rng& rng, int64_t n, double stddev, int threads) {
  std::vector<float> out(static_cast<size_t>(n), -1.0f);
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  fill_normal(out.data(), n, rng, stddev);
  omp_set_num_threads(before);
  return out;
}

// x such that x ^ (x >> shift) == y.
uint64_t undo_xorshift(uint64_t y, int shift) {
  uint64_t x = y;
  for (int i = 0; i < 64 / shift + 1; ++i) x = y ^ (x >> shift);
  return x;
}

uint64_t inverse_odd(uint64_t c) {  // Newton's iteration for c^-1 mod 2^64
  uint64_t inv = c;
  for (int i = 0; i < 6; ++i) inv *= 2 - c * inv;
  return inv;
}

// The state splitmix64 must hold after its increment to return `out`.
uint64_t splitmix_preimage(uint64_t out) {
  uint64_t z = undo_xorshift(out, 31);
  z *= inverse_odd(0x94d049bb133111ebull);
  z = undo_xorshift(z, 27);
  z *= inverse_odd(0xbf58476d1ce4e5b9ull);
  return undo_xorshift(z, 30);
}

TEST(InitParameters, SkipAdvancesTheStreamAsDrawsDo) {
  Rng a(11, 3), b(11, 3);
  for (int i = 0; i < 1001; ++i) a.next_u64();
  b.skip(1001);
  EXPECT_EQ(a.state(), b.state());
  EXPECT_EQ(a.next_u64(), b.next_u64());
}

TEST(InitParameters, ParallelNormalsEqualTheSequentialLoop) {
  const Rng rng(1337, hash_name("model.layers.0.mlp.up_proj.weight"));
  // Around the 65536-value chunks: shorter than one, exactly one, one more, several and a tail.
  for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{65535}, int64_t{65536}, int64_t{65537},
                          int64_t{3 * 65536 + 17}}) {
    const std::vector<float> expected = sequential_normals(rng, n, 0.02);
    for (const int threads : {1, 3, 4}) {
      EXPECT_EQ(parallel_normals(rng, n, 0.02, threads), expected)
          << n << " values on " << threads << " threads";
    }
  }
}

TEST(InitParameters, ARedrawnFirstUniformGivesTheSequentialValues) {
  // A stream whose value k (in the second chunk) draws a first uniform of exactly 0, which
  // normal() redraws: every value after it is one draw later than the chunks assume.
  const int64_t k = 70000, n = 3 * 65536;
  const uint64_t zero_draw = 5;  // >> 11 is 0: uniform() returns 0
  Rng rng(0);
  rng.set_state(splitmix_preimage(zero_draw) - (2 * static_cast<uint64_t>(k) + 1) * kGolden);
  Rng probe = rng;
  probe.skip(2 * static_cast<uint64_t>(k));
  ASSERT_EQ(probe.next_u64(), zero_draw) << "the crafted stream misses its target";
  const std::vector<float> expected = sequential_normals(rng, n, 1.0);
  // Past k the sequential values differ from the ones two draws a value would give.
  Rng shifted = rng;
  shifted.skip(2 * static_cast<uint64_t>(k + 1));
  const double skipped_value = Rng::box_muller(shifted.uniform(), shifted.uniform());
  ASSERT_NE(expected[k + 1], static_cast<float>(skipped_value));
  for (const int threads : {1, 4}) {
    EXPECT_EQ(parallel_normals(rng, n, 1.0, threads), expected) << threads << " threads";
  }
}

}  // namespace
}  // namespace dstrain
