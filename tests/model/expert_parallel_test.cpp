// The mixture-of-experts MLP under expert parallelism (model/moe_mlp.h, model/expert_parallel.h)
// on CPU ranks: ep ranks with N tokens each, every rank holding E / ep experts, against one rank
// with all ep N tokens and all E experts. The outputs and input gradients of each rank's tokens,
// the gradients of each rank's experts and the sum of the ranks' router gradients equal the
// one rank's -- whatever the routing: random, every token choosing the first rank's experts (the
// others receive nothing), or every token staying on its own rank (nothing crosses).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "model/moe_mlp.h"

namespace dstrain {
namespace {

// Host storage of F32 / I32 tensors, zeroed.
class Storage {
 public:
  Tensor make(DType dtype, std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    buffers_.emplace_back(static_cast<size_t>(std::max<int64_t>(n, 1)), 0u);
    return Tensor(buffers_.back().data(), dtype, dims);
  }

 private:
  std::vector<std::vector<uint32_t>> buffers_;
};

// The activations and workspace of one MoE MLP pass of shape s (F32), as the decoder plans them.
struct Buffers {
  Storage storage;
  MoeActivations a;
  MoeWorkspace ws;
  explicit Buffers(const MoeShape& s) {
    Storage& m = storage;
    a.scores = m.make(DType::F32, {s.N, s.E});
    a.topk_weight = m.make(DType::F32, {s.N, s.k});
    a.topk_expert = m.make(DType::I32, {s.N, s.k});
    a.offsets = m.make(DType::I32, {s.E + 1});
    a.source_rows = m.make(DType::I32, {s.M});
    a.dest_rows = m.make(DType::I32, {s.N, s.k});
    a.inp = m.make(DType::F32, {s.R, s.C});
    a.up = m.make(DType::F32, {s.R, 2 * s.I});
    a.act = m.make(DType::F32, {s.R, s.I});
    a.out = m.make(DType::F32, {s.M, s.C});
    a.recv_counts = m.make(DType::I32, {s.ep * s.El});
    a.local_offsets = m.make(DType::I32, {s.El + 1});
    ws.logits = m.make(DType::F32, {s.N, s.E});
    ws.dout_rows = m.make(DType::F32, {s.M, s.C});
    ws.dinp_rows = m.make(DType::F32, {s.M, s.C});
    ws.dtopk_weight = m.make(DType::F32, {s.N, s.k});
    ws.dup = m.make(DType::F32, {s.R, 2 * s.I});
    ws.dact = m.make(DType::F32, {s.R, s.I});
    ws.dx_router = m.make(DType::F32, {s.N, s.C});
    ws.send_rows = m.make(DType::F32, {s.M, s.C});
    ws.exchange[0] = m.make(DType::F32, {s.R, s.C});
    ws.exchange[1] = m.make(DType::F32, {s.R, s.C});
    ws.to_expert_order = m.make(DType::I32, {s.R});
    ws.to_peer_order = m.make(DType::I32, {s.R});
    ws.send_counts = m.make(DType::I32, {s.E});
  }
};

constexpr int64_t kExperts = 4, kTopK = 2, kWidth = 6, kChannels = 8, kTokens = 5;

MlpPart mlp_part() {
  MlpPart mlp;
  mlp.kind = MlpKind::MoE;
  mlp.width = kWidth;
  mlp.experts = kExperts;
  mlp.top_k = kTopK;
  mlp.norm_topk = true;
  return mlp;
}

// The whole problem: tokens x (ep N, C), dL/d(out), the router (E, C) and all experts' weights.
struct Problem {
  std::vector<float> x, dout, router, up, down;
};

enum class Routing { Random, AllToTheFirstRank, EachToItsOwnRank };

Problem make_problem(int ep, Routing routing, uint64_t seed) {
  Rng rng(seed);
  auto fill = [&](std::vector<float>& v, size_t n, double scale) {
    v.resize(n);
    for (float& f : v) f = static_cast<float>(scale * rng.normal());
  };
  const int64_t N = ep * kTokens, El = kExperts / ep;
  Problem p;
  fill(p.x, static_cast<size_t>(N * kChannels), 1.0);
  fill(p.dout, static_cast<size_t>(N * kChannels), 1.0);
  fill(p.router, static_cast<size_t>(kExperts * kChannels), 0.3);
  fill(p.up, static_cast<size_t>(kExperts * 2 * kWidth * kChannels), 0.3);
  fill(p.down, static_cast<size_t>(kExperts * kChannels * kWidth), 0.3);
  if (routing == Routing::Random) return p;
  // Channel 0 is positive and large; channel 1 says which rank a token belongs to. The
  // experts' router rows read them: the first rank's experts (or each token's own rank's)
  // get a logit far above the others'.
  for (int64_t t = 0; t < N; ++t) {
    p.x[static_cast<size_t>(t * kChannels)] = 4.0f + static_cast<float>(rng.uniform());
    p.x[static_cast<size_t>(t * kChannels + 1)] = t / kTokens == 0 ? 4.0f : -4.0f;
  }
  for (int64_t e = 0; e < kExperts; ++e) {
    const bool first_rank = e / El == 0;
    float* row = &p.router[static_cast<size_t>(e * kChannels)];
    if (routing == Routing::AllToTheFirstRank) {
      row[0] = first_rank ? 3.0f : -3.0f;
      row[1] = 0.0f;
    } else {
      row[0] = 0.0f;
      row[1] = first_rank ? 3.0f : -3.0f;  // ep = 2: rank 0's tokens +, rank 1's -
    }
  }
  return p;
}

// The pass's results on one rank: its tokens' out and dx, its experts' and its router's
// gradients.
struct Result {
  std::vector<float> out, dx, dup, ddown, drouter;
  // The routing and each copy's expert output (one rank: all experts), and the copies dropped.
  std::vector<int32_t> offsets, dest;
  std::vector<float> weights, rows;
  int64_t dropped = 0;
};

// Forward and backward of `tokens` rows of x starting at token `first`, with experts
// [first_expert, first_expert + local) of the problem.
Result run_pass(Backend& backend, const Problem& p, const ExpertParallel& ep, int64_t first,
                int64_t tokens) {
  const MlpPart mlp = mlp_part();
  const MoeShape s = moe_shape(mlp, tokens, kChannels, ep.size);
  const int64_t first_expert = ep.rank * s.El;
  Buffers b(s);
  Storage m;
  const int64_t C = kChannels, I = kWidth;
  auto copy_in = [&](const std::vector<float>& from, int64_t offset, Tensor to) {
    std::copy_n(from.begin() + offset, to.numel(), to.f32());
    return to;
  };
  Tensor x = copy_in(p.x, first * C, m.make(DType::F32, {tokens, C}));
  Tensor dout = copy_in(p.dout, first * C, m.make(DType::F32, {tokens, C}));
  MoeWeights w, g;
  w.router = copy_in(p.router, 0, m.make(DType::F32, {kExperts, C}));
  w.up = copy_in(p.up, first_expert * 2 * I * C, m.make(DType::F32, {s.El, 2 * I, C}));
  w.down = copy_in(p.down, first_expert * C * I, m.make(DType::F32, {s.El, C, I}));
  g.router = m.make(DType::F32, {kExperts, C});
  g.up = m.make(DType::F32, {s.El, 2 * I, C});
  g.down = m.make(DType::F32, {s.El, C, I});
  Tensor out = m.make(DType::F32, {tokens, C}), dx = m.make(DType::F32, {tokens, C});
  const int64_t dropped = moe_mlp_forward(backend, mlp, ep, w, b.a, b.ws, x, out, nullptr);
  Result r;
  auto values = [](Tensor t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); };
  auto indices = [](Tensor t) {
    return std::vector<int32_t>(static_cast<const int32_t*>(t.data),
                                static_cast<const int32_t*>(t.data) + t.numel());
  };
  r.offsets = indices(b.a.offsets);
  r.dest = indices(b.a.dest_rows);
  r.weights = values(b.a.topk_weight);
  r.rows = values(b.a.out);
  r.dropped = dropped;
  moe_mlp_backward(backend, mlp, ep, w, g, b.a, b.ws, x, dout, dx, nullptr);
  r.out = values(out);
  r.dx = values(dx);
  r.dup = values(g.up);
  r.ddown = values(g.down);
  r.drouter = values(g.router);
  return r;
}

void expect_near(const std::vector<float>& got, const float* want, size_t n,
                 const std::string& what) {
  ASSERT_GE(got.size(), n) << what;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::abs(want[i]))) << what << "[" << i << "]";
  }
}

void expect_matches_one_rank(int ep, Routing routing, uint64_t seed) {
  const Problem p = make_problem(ep, routing, seed);
  std::unique_ptr<Backend> one = make_cpu_backend(1);
  const Result whole = run_pass(*one, p, ExpertParallel{}, 0, ep * kTokens);
  std::vector<Result> ranks(static_cast<size_t>(ep));
  run_local_ranks(ep, 30.0, [&](Communicator& comm) {
    std::unique_ptr<Backend> backend = make_cpu_backend(1);
    ranks[static_cast<size_t>(comm.rank())] = run_pass(
        *backend, p, ExpertParallel{ep, comm.rank(), &comm}, comm.rank() * kTokens, kTokens);
  });
  const size_t rows = static_cast<size_t>(kTokens * kChannels);
  const size_t local = static_cast<size_t>(kExperts / ep);
  std::vector<float> router(whole.drouter.size(), 0.0f);
  for (int r = 0; r < ep; ++r) {
    const Result& mine = ranks[static_cast<size_t>(r)];
    const std::string rank = "rank " + std::to_string(r) + " ";
    expect_near(mine.out, whole.out.data() + r * rows, rows, rank + "out");
    expect_near(mine.dx, whole.dx.data() + r * rows, rows, rank + "dx");
    const size_t up = local * 2 * kWidth * kChannels, down = local * kChannels * kWidth;
    expect_near(mine.dup, whole.dup.data() + r * up, up, rank + "experts' up gradient");
    expect_near(mine.ddown, whole.ddown.data() + r * down, down, rank + "experts' down gradient");
    for (size_t i = 0; i < router.size(); ++i) router[i] += mine.drouter[i];
  }
  expect_near(router, whole.drouter.data(), router.size(), "router gradient summed over ranks");
}

TEST(ExpertParallel, RandomRoutingMatchesOneRank) {
  for (int ep : {2, 4}) {
    for (uint64_t seed : {1u, 2u, 3u}) {
      SCOPED_TRACE("ep " + std::to_string(ep) + ", seed " + std::to_string(seed));
      expect_matches_one_rank(ep, Routing::Random, seed);
    }
  }
}

// Every token picks the first rank's experts: the other ranks' experts receive no row, their
// gradients are zero, and the first rank gets every token's copies.
TEST(ExpertParallel, RanksWhoseExpertsReceiveNothingMatchOneRank) {
  expect_matches_one_rank(2, Routing::AllToTheFirstRank, 4);
  expect_matches_one_rank(4, Routing::AllToTheFirstRank, 5);
  const Problem p = make_problem(2, Routing::AllToTheFirstRank, 6);
  std::vector<float> last_up;
  run_local_ranks(2, 30.0, [&](Communicator& comm) {
    std::unique_ptr<Backend> backend = make_cpu_backend(1);
    const Result r = run_pass(*backend, p, ExpertParallel{2, comm.rank(), &comm},
                              comm.rank() * kTokens, kTokens);
    if (comm.rank() == 1) last_up = r.dup;
  });
  ASSERT_FALSE(last_up.empty());
  for (float g : last_up) ASSERT_EQ(g, 0.0f) << "an expert without rows got a gradient";
}

// An expert capacity keeps each expert's first ceil(f x M / E) copies in token order. Against the
// dropless pass: each token's output is the sum over its kept choices of weight x that copy's
// expert output (float64 here), the dropped count is what the experts had beyond capacity, and
// a capacity no expert reaches changes no bit.
TEST(ExpertParallel, ACapacityDropsEachExpertsLateCopies) {
  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  const int64_t N = 2 * kTokens, M = N * kTopK;
  for (uint64_t seed : {11u, 12u, 13u}) {
    const Problem p = make_problem(2, Routing::Random, seed);
    const Result dropless = run_pass(*backend, p, ExpertParallel{}, 0, N);
    ExpertParallel capped;
    capped.capacity_factor = 0.5;
    const Result dropped = run_pass(*backend, p, capped, 0, N);
    const int64_t capacity = (M / 2 + kExperts - 1) / kExperts;  // ceil(0.5 M / E)
    int64_t expected_drops = 0;
    for (int64_t e = 0; e < kExperts; ++e) {
      expected_drops +=
          std::max<int64_t>(0, dropless.offsets[e + 1] - dropless.offsets[e] - capacity);
    }
    EXPECT_EQ(dropped.dropped, expected_drops) << "seed " << seed;
    EXPECT_GT(dropped.dropped, 0) << "seed " << seed;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < kChannels; ++c) {
        double want = 0;
        for (int64_t j = 0; j < kTopK; ++j) {
          const int32_t row = dropless.dest[static_cast<size_t>(n * kTopK + j)];
          int64_t e = 0;
          while (dropless.offsets[static_cast<size_t>(e + 1)] <= row) ++e;
          if (row - dropless.offsets[static_cast<size_t>(e)] >= capacity) continue;
          want += static_cast<double>(dropless.weights[static_cast<size_t>(n * kTopK + j)]) *
                  dropless.rows[static_cast<size_t>(row * kChannels + c)];
        }
        ASSERT_NEAR(dropped.out[static_cast<size_t>(n * kChannels + c)], want, 1e-5)
            << "seed " << seed << ", token " << n;
      }
    }
    ExpertParallel roomy;
    roomy.capacity_factor = static_cast<double>(kExperts);  // capacity M: nothing dropped
    const Result same = run_pass(*backend, p, roomy, 0, N);
    EXPECT_EQ(same.dropped, 0);
    EXPECT_EQ(same.out, dropless.out);
    EXPECT_EQ(same.dx, dropless.dx);
    EXPECT_EQ(same.dup, dropless.dup);
    EXPECT_EQ(same.drouter, dropless.drouter);
  }
}

// Under expert parallelism each rank's capacity is its own copies': a rank's outputs and input
// gradients equal one rank's with the same capacity over that rank's tokens alone.
TEST(ExpertParallel, ACapacityUnderExpertParallelismIsEachRanksOwn) {
  const Problem p = make_problem(2, Routing::Random, 21);
  std::unique_ptr<Backend> one = make_cpu_backend(1);
  ExpertParallel capped;
  capped.capacity_factor = 0.75;
  std::vector<Result> alone, ranks(2);
  for (int r = 0; r < 2; ++r) alone.push_back(run_pass(*one, p, capped, r * kTokens, kTokens));
  run_local_ranks(2, 30.0, [&](Communicator& comm) {
    std::unique_ptr<Backend> backend = make_cpu_backend(1);
    ExpertParallel ep{2, comm.rank(), &comm};
    ep.capacity_factor = 0.75;
    ranks[static_cast<size_t>(comm.rank())] =
        run_pass(*backend, p, ep, comm.rank() * kTokens, kTokens);
  });
  for (int r = 0; r < 2; ++r) {
    const size_t n = static_cast<size_t>(kTokens * kChannels);
    EXPECT_EQ(ranks[r].dropped, alone[r].dropped) << "rank " << r;
    expect_near(ranks[r].out, alone[r].out.data(), n, "rank " + std::to_string(r) + " out");
    expect_near(ranks[r].dx, alone[r].dx.data(), n, "rank " + std::to_string(r) + " dx");
  }
}

// Every token picks its own rank's experts: nothing crosses between the ranks.
TEST(ExpertParallel, TokensThatStayOnTheirRankMatchOneRank) {
  expect_matches_one_rank(2, Routing::EachToItsOwnRank, 7);
}

}  // namespace
}  // namespace dstrain
