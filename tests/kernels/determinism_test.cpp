// Every op gives bitwise-identical outputs with 1, 2 and 3 threads, at shapes with many tasks
// (tiles, chunks, column blocks, (b, head) pairs) so the threads really split the work.
#include <thread>

#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

using Outputs = std::vector<HostTensor>;

// Clones `initial` (outputs pre-filled: += outputs matter) for each thread count, runs `op`,
// and compares every output with the 1-thread run.
template <class Op>
void expect_thread_invariant(const Outputs& initial, Op op) {
  auto fresh = [&] {
    Outputs outputs;
    for (const HostTensor& t : initial) outputs.push_back(t.clone());
    return outputs;
  };
  Outputs reference = fresh();
  op(*make_cpu_backend(1), reference);
  for (int threads : {2, 3}) {
    Outputs outputs = fresh();
    op(*make_cpu_backend(threads), outputs);
    for (size_t i = 0; i < outputs.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(reference[i], outputs[i]))
          << "output #" << i << " with " << threads << " threads";
      EXPECT_TRUE(outputs[i].guard_intact());
    }
  }
}

HostTensor random_tensor(DType dtype, std::initializer_list<int64_t> dims, uint64_t seed,
                         double lo = -1.0, double hi = 1.0) {
  HostTensor t(dtype, dims);
  Random rng(seed);
  t.fill_random(rng, lo, hi);
  return t;
}

Outputs make_outputs(std::initializer_list<HostTensor*> tensors) {
  Outputs outputs;
  for (HostTensor* t : tensors) outputs.push_back(std::move(*t));
  return outputs;
}

TEST(Determinism, MatmulForwardAndBackward) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (bool out_by_in : {false, true}) {
      const int64_t N = 300, C = 1000, OC = 600;  // K = 1000: raw threaded OpenBLAS differs here
      HostTensor x = random_tensor(dtype, {N, C}, 1);
      HostTensor w =
          out_by_in ? random_tensor(dtype, {OC, C}, 2) : random_tensor(dtype, {C, OC}, 2);
      HostTensor bias = random_tensor(dtype, {OC}, 3);
      HostTensor dout = random_tensor(dtype, {N, OC}, 4);
      HostTensor out(dtype, {N, OC}), dinp(dtype, {N, C});
      HostTensor dweight =
          out_by_in ? random_tensor(dtype, {OC, C}, 5) : random_tensor(dtype, {C, OC}, 5);
      HostTensor dbias = random_tensor(dtype, {OC}, 6);
      expect_thread_invariant(
          make_outputs({&out, &dinp, &dweight, &dbias}), [&](Backend& backend, Outputs& o) {
            backend.matmul_forward(o[0], x, w, bias, out_by_in, nullptr);
            backend.matmul_backward(o[1], o[2], o[3], dout, x, w, out_by_in, nullptr);
          });
    }
  }
}

TEST(Determinism, AttentionForwardAndBackward) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    // Multi-head (KV = NH) and grouped-query (3 query heads per kv head).
    for (const int64_t KV : {3, 1}) {
      const int64_t B = 2, T = 65, NH = 3, hd = 10, C = NH * hd, W = (NH + 2 * KV) * hd;
      HostTensor qkv = random_tensor(dtype, {B, T, W}, 7, -2.0, 2.0);
      HostTensor dout = random_tensor(dtype, {B, T, C}, 8);
      HostTensor out(dtype, {B, T, C}), lse(DType::F32, {B, NH, T}), dqkv(dtype, {B, T, W});
      const int nh = static_cast<int>(NH), kv = static_cast<int>(KV);
      auto forward_and_backward = [&](Backend& backend, Outputs& o) {
        backend.attention_forward(o[0], o[1], qkv, nh, kv, nullptr);
        backend.attention_backward(o[2], dout, qkv, o[0], o[1], nh, kv, nullptr);
      };
      expect_thread_invariant(make_outputs({&out, &lse, &dqkv}), forward_and_backward);
    }
  }
}

TEST(Determinism, LayernormForwardAndBackward) {
  for (DType dtype : {DType::F32, DType::F16}) {
    const int64_t N = 300, C = 600;  // three column blocks in dweight/dbias
    HostTensor inp = random_tensor(dtype, {N, C}, 9, 1.0, 3.0);
    HostTensor weight = random_tensor(dtype, {C}, 10), bias = random_tensor(dtype, {C}, 11);
    HostTensor dout = random_tensor(dtype, {N, C}, 12);
    HostTensor out(dtype, {N, C}), mean(DType::F32, {N}), rstd(DType::F32, {N});
    HostTensor dinp = random_tensor(dtype, {N, C}, 13), dweight = random_tensor(dtype, {C}, 14),
               dbias = random_tensor(dtype, {C}, 15);
    expect_thread_invariant(
        make_outputs({&out, &mean, &rstd, &dinp, &dweight, &dbias}),
        [&](Backend& backend, Outputs& o) {
          backend.layernorm_forward(o[0], o[1], o[2], inp, weight, bias, nullptr);
          backend.layernorm_backward(o[3], o[4], o[5], dout, inp, weight, o[1], o[2], nullptr);
        });
  }
}

TEST(Determinism, RmsnormForwardAndBackward) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const int64_t N = 300, C = 600;  // three column blocks in dweight
    HostTensor inp = random_tensor(dtype, {N, C}, 31, -2.0, 2.0);
    HostTensor weight = random_tensor(dtype, {C}, 32), dout = random_tensor(dtype, {N, C}, 33);
    HostTensor out(dtype, {N, C}), rstd(DType::F32, {N});
    HostTensor dinp = random_tensor(dtype, {N, C}, 34), dweight = random_tensor(dtype, {C}, 35);
    expect_thread_invariant(make_outputs({&out, &rstd, &dinp, &dweight}),
                            [&](Backend& backend, Outputs& o) {
                              backend.rmsnorm_forward(o[0], o[1], inp, weight, 1e-5f, nullptr);
                              backend.rmsnorm_backward(o[2], o[3], dout, inp, weight, o[1],
                                                       nullptr);
                            });
  }
}

TEST(Determinism, SwigluForwardAndBackward) {
  const int64_t N = 64, I = 1000;  // rows of 2I = 2000 elements, 64 row tasks
  HostTensor inp = random_tensor(DType::BF16, {N, 2 * I}, 36, -4.0, 4.0);
  HostTensor dout = random_tensor(DType::BF16, {N, I}, 37);
  HostTensor out(DType::BF16, {N, I}), dinp(DType::BF16, {N, 2 * I});
  expect_thread_invariant(make_outputs({&out, &dinp}), [&](Backend& backend, Outputs& o) {
    backend.swiglu_forward(o[0], inp, Tensor(), nullptr);
    backend.swiglu_backward(o[1], dout, inp, Tensor(), nullptr);
  });
}

// Routing, dispatch, combine and the grouped matmul of 300 tokens over 16 experts (top 4),
// through every output of each op.
TEST(Determinism, MixtureOfExpertsOps) {
  const int64_t N = 300, E = 16, k = 4, C = 96, OC = 64;
  const MoeRouting routing{static_cast<int>(E), static_cast<int>(k), RouterScore::Softmax, true,
                           1.0f};
  HostTensor logits = random_tensor(DType::BF16, {N, E}, 38, -3.0, 3.0);
  HostTensor x = random_tensor(DType::BF16, {N, C}, 39);
  HostTensor w = random_tensor(DType::BF16, {E, OC, C}, 40);
  HostTensor dout = random_tensor(DType::BF16, {N * k, OC}, 41);
  HostTensor dcombined = random_tensor(DType::BF16, {N, C}, 42);
  HostTensor weights(DType::F32, {N, k}), experts(DType::I32, {N, k}), scores(DType::F32, {N, E});
  HostTensor offsets(DType::I32, {E + 1}), source(DType::I32, {N * k}), dest(DType::I32, {N, k});
  HostTensor rows(DType::BF16, {N * k, C}), out(DType::BF16, {N * k, OC});
  HostTensor drows(DType::BF16, {N * k, C}), dw = random_tensor(DType::F32, {E, OC, C}, 43);
  HostTensor combined(DType::BF16, {N, C}), dlogits(DType::BF16, {N, E});
  HostTensor dweights(DType::F32, {N, k});
  expect_thread_invariant(
      make_outputs({&weights, &experts, &scores, &offsets, &source, &dest, &rows, &out, &drows,
                    &dw, &combined, &dweights, &dlogits}),
      [&](Backend& backend, Outputs& o) {
        backend.moe_route(o[0], o[1], o[2], logits, routing, nullptr);
        backend.moe_dispatch(o[3], o[4], o[5], o[1], static_cast<int>(E), nullptr);
        backend.moe_gather(o[6], x, o[4], nullptr);
        backend.grouped_matmul_forward(o[7], o[6], w, o[3], nullptr);
        backend.grouped_matmul_backward(o[8], o[9], dout, o[6], w, o[3], nullptr);
        backend.moe_combine(o[10], o[8], o[5], o[0], nullptr);
        backend.moe_combine_backward(o[8], o[11], dcombined, o[6], o[5], o[0], nullptr);
        backend.moe_route_backward(o[12], o[11], Tensor(), o[2], o[1], routing, nullptr);
      });
}

TEST(Determinism, EmbeddingForwardAndBackward) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const int64_t B = 4, T = 64, C = 300, Vp = 50, maxT = 70;
    HostTensor tokens(DType::I32, {B, T});
    Random rng(16);
    // Few distinct tokens: many positions add into the same dwte row.
    for (int64_t i = 0; i < B * T; ++i) tokens.i32()[i] = static_cast<int32_t>(rng.integer(Vp));
    HostTensor wte = random_tensor(dtype, {Vp, C}, 17), wpe = random_tensor(dtype, {maxT, C}, 18);
    HostTensor dout = random_tensor(dtype, {B, T, C}, 19);
    HostTensor out(dtype, {B, T, C});
    HostTensor dwte = random_tensor(dtype, {Vp, C}, 20), dwpe = random_tensor(dtype, {maxT, C}, 21);
    expect_thread_invariant(make_outputs({&out, &dwte, &dwpe}), [&](Backend& backend, Outputs& o) {
      backend.embedding_forward(o[0], tokens, wte, wpe, 0, wte.t().size(0), nullptr);
      backend.embedding_backward(o[1], o[2], dout, tokens, 0, o[1].t().size(0), nullptr);
    });
  }
}

TEST(Determinism, CrossEntropy) {
  const int64_t N = 64, V = 1000, Vp = 1024;
  HostTensor logits = random_tensor(DType::BF16, {N, Vp}, 22, -5.0, 5.0);
  HostTensor targets(DType::I32, {N});
  Random rng(23);
  for (int64_t n = 0; n < N; ++n) targets.i32()[n] = static_cast<int32_t>(rng.integer(V));
  HostTensor losses(DType::F32, {N}), dlogits(DType::BF16, {N, Vp});
  expect_thread_invariant(make_outputs({&losses, &dlogits}), [&](Backend& backend, Outputs& o) {
    backend.softmax_cross_entropy(o[0], o[1], logits, targets, static_cast<int>(V), 1.0f / N,
                                  nullptr);
  });
}

TEST(Determinism, ElementwiseOps) {
  const int64_t n = 100003;
  HostTensor x = random_tensor(DType::BF16, {n}, 24, -4.0, 4.0);
  HostTensor y = random_tensor(DType::F32, {n}, 25);
  HostTensor gelu_out(DType::BF16, {n}), gelu_grad(DType::F32, {n}), sum(DType::F16, {n});
  HostTensor acc = random_tensor(DType::F32, {n}, 26), scaled = random_tensor(DType::BF16, {n}, 27);
  expect_thread_invariant(make_outputs({&gelu_out, &gelu_grad, &sum, &acc, &scaled}),
                          [&](Backend& backend, Outputs& o) {
                            backend.gelu_forward(o[0], x, nullptr);
                            backend.gelu_backward(o[1], y, x, nullptr);
                            backend.residual_forward(o[2], x, y, nullptr);
                            backend.accumulate(o[3], x, nullptr);
                            backend.scale(o[4], 0.3f, nullptr);
                          });
}

TEST(Determinism, AdamWAndSumSquares) {
  const int64_t n = 50001;
  HostTensor grad = random_tensor(DType::BF16, {n}, 28);
  HostTensor param = random_tensor(DType::F32, {n}, 29), m(DType::F32, {n}), v(DType::F32, {n});
  HostTensor copy(DType::BF16, {n});
  for (int64_t i = 0; i < n; ++i) {
    m.set(i, 0.0);
    v.set(i, 0.0);
  }
  AdamWStep step;
  step.lr = 1e-3f;
  step.weight_decay = 0.1f;
  step.grad_scale = 0.7f;
  expect_thread_invariant(make_outputs({&param, &m, &v, &copy}), [&](Backend& backend, Outputs& o) {
    for (int64_t s = 1; s <= 3; ++s) {
      step.step = s;
      backend.adamw(o[0], grad, o[1], o[2], o[3], step, nullptr);
    }
  });

  // Magnitudes rising from 1e-3 to 1e3 along the buffer: a different grouping of the chunk
  // sums (say, one partial per thread) changes the last bits.
  const int64_t big_n = 1000003;
  HostTensor big(DType::F32, {big_n});
  Random big_rng(30);
  for (int64_t i = 0; i < big_n; ++i) {
    big.set(i, big_rng.uniform(-1.0, 1.0) * std::pow(10.0, static_cast<double>(i * 7 / big_n) - 3));
  }
  const double one = make_cpu_backend(1)->sum_squares(big, nullptr);
  for (int threads : {2, 3}) {
    const double many = make_cpu_backend(threads)->sum_squares(big, nullptr);
    EXPECT_EQ(std::memcmp(&one, &many, sizeof(double)), 0)
        << one << " vs " << many << " with " << threads << " threads";
  }
  EXPECT_EQ(make_cpu_backend(1)->has_inf_or_nan(big, nullptr),
            make_cpu_backend(2)->has_inf_or_nan(big, nullptr));
}

// Simulated ranks are threads of one process, each with its own backend: concurrent calls
// (OpenBLAS included) must give the same bits as calls made one at a time.
TEST(Determinism, ConcurrentBackendsOnRankThreads) {
  const int64_t N = 300, C = 500, OC = 400;
  HostTensor x = random_tensor(DType::F32, {N, C}, 31), w = random_tensor(DType::F32, {C, OC}, 32);
  HostTensor dout = random_tensor(DType::F32, {N, OC}, 33);
  auto run = [&](HostTensor& out, HostTensor& dinp, HostTensor& dweight) {
    auto backend = make_cpu_backend(2);
    for (int repeat = 0; repeat < 3; ++repeat) {
      backend->matmul_forward(out, x, w, Tensor(), false, nullptr);
      backend->matmul_backward(dinp, dweight, Tensor(), dout, x, w, false, nullptr);
    }
  };
  const int kRanks = 3;
  std::vector<HostTensor> outs, dinps, dweights;
  for (int r = 0; r <= kRanks; ++r) {
    outs.emplace_back(DType::F32, std::vector<int64_t>{N, OC});
    dinps.emplace_back(DType::F32, std::vector<int64_t>{N, C});
    dweights.push_back(random_tensor(DType::F32, {C, OC}, 34));
  }
  run(outs[kRanks], dinps[kRanks], dweights[kRanks]);  // alone, as the reference
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] { run(outs[r], dinps[r], dweights[r]); });
  }
  for (std::thread& rank : ranks) rank.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(bitwise_equal(outs[r], outs[kRanks])) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(dinps[r], dinps[kRanks])) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(dweights[r], dweights[kRanks])) << "rank " << r;
  }
}

}  // namespace
}  // namespace dstrain::test
