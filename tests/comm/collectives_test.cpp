// The collectives of the local communicator on 1..8 ranks, every dtype, odd sizes: results
// bit-identical to the contract's reference (rank-order fp32 accumulation, one rounding) on
// every rank, guard regions around every buffer untouched.
#include <atomic>
#include <tuple>

#include "comm_test_util.h"

namespace dstrain::test {
namespace {

// Compares a rank's result with the expected buffer bit for bit; on a mismatch names the
// first differing elements.
::testing::AssertionResult same_bits(const GuardedBuffer& got, const GuardedBuffer& want,
                                     const std::string& what) {
  if (!got.guards_intact()) return ::testing::AssertionFailure() << what << ": guard overwritten";
  if (got.same_bytes(want)) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure() << what << " differs:";
  int shown = 0;
  for (int64_t i = 0; i < want.count() && shown < 5; ++i) {
    const size_t size = dtype_size(want.dtype());
    if (std::memcmp(static_cast<const char*>(got.data()) + i * size,
                    static_cast<const char*>(want.data()) + i * size, size) != 0) {
      failure << " [" << i << "] got " << got.get(i) << " want " << want.get(i) << ";";
      ++shown;
    }
  }
  return failure;
}

// ---- all_reduce ----

using ReduceCase = std::tuple<DType, ReduceOp, int, int64_t>;  // dtype, op, ranks, n

class AllReduceTest : public ::testing::TestWithParam<ReduceCase> {};

TEST_P(AllReduceTest, MatchesRankOrderReferenceOnEveryRank) {
  const auto [dtype, op, ranks, n] = GetParam();
  const uint64_t seed = 11;
  std::vector<GuardedBuffer> buffers;
  for (int r = 0; r < ranks; ++r) {
    buffers.emplace_back(dtype, n);
    buffers.back().fill(seed, r);
  }
  GuardedBuffer expected(dtype, n);
  std::vector<double> values(static_cast<size_t>(ranks));
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 0; r < ranks; ++r) values[static_cast<size_t>(r)] = buffers[r].get(i);
    expected.set(i, reference_reduce(dtype, op, values));
  }
  ASSERT_TRUE(expected.any_nonzero()) << "a test on zeros proves nothing";

  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    comm.all_reduce(buffers[static_cast<size_t>(comm.rank())].tensor(), op, nullptr);
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(same_bits(buffers[r], expected, case_name(dtype, op, ranks, n) + " rank " +
                                                    std::to_string(r)));
  }
}

std::string reduce_case_name(const ::testing::TestParamInfo<ReduceCase>& info) {
  const auto [dtype, op, ranks, n] = info.param;
  return case_name(dtype, op, ranks, n);
}

// n: one element, an odd handful, a size crossing the kernel's 2048-element blocks and the
// ranks' chunk boundaries at an odd offset.
INSTANTIATE_TEST_SUITE_P(Small, AllReduceTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::F16, DType::BF16,
                                                              DType::I32),
                                            ::testing::Values(ReduceOp::Sum, ReduceOp::Max),
                                            ::testing::Range(1, 9),
                                            ::testing::Values<int64_t>(1, 7, 4099)),
                         reduce_case_name);
INSTANTIATE_TEST_SUITE_P(Large, AllReduceTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(ReduceOp::Sum),
                                            ::testing::Values(2, 3, 8),
                                            ::testing::Values<int64_t>(1000003)),
                         reduce_case_name);

TEST(AllReduce, EmptyBufferIsANoOp) {
  run_local_ranks(3, kNoTimeout, [](Communicator& comm) {
    comm.all_reduce(Tensor(nullptr, DType::F32, {0}), ReduceOp::Sum, nullptr);
  });
}

TEST(AllReduce, SumOrderIsRankOrder) {
  // ((1e8 + 1) - 1e8) + 1 = 1 in fp32 (1e8 + 1 rounds to 1e8); any other order gives 0 or 2.
  const float inputs[] = {1e8f, 1.0f, -1e8f, 1.0f};
  std::vector<float> results(4);
  run_local_ranks(4, kNoTimeout, [&](Communicator& comm) {
    float value = inputs[comm.rank()];
    comm.all_reduce(Tensor(&value, DType::F32, {1}), ReduceOp::Sum, nullptr);
    results[static_cast<size_t>(comm.rank())] = value;
  });
  for (float r : results) EXPECT_EQ(r, 1.0f);
}

TEST(AllReduce, Fp16SumIsRoundedOnce) {
  // 1 + 3 * 2^-11 rounded once is 1 + 2^-9 (a tie between 1 + 2^-10 and 1 + 2^-9: even);
  // rounding after every add would stay at 1 (each 1 + 2^-11 ties back to 1).
  std::vector<uint16_t> results(4);
  run_local_ranks(4, kNoTimeout, [&](Communicator& comm) {
    uint16_t bits = fp32_to_fp16_bits(comm.rank() == 0 ? 1.0f : 0x1p-11f);
    comm.all_reduce(Tensor(&bits, DType::F16, {1}), ReduceOp::Sum, nullptr);
    results[static_cast<size_t>(comm.rank())] = bits;
  });
  for (uint16_t r : results) EXPECT_EQ(r, 0x3c02) << "got " << fp16_bits_to_fp32(r);
}

TEST(AllReduce, Bf16SumIsRoundedOnce) {
  // bf16 keeps 8 significant bits: 1 + 3 * 2^-8 rounded once is 1 + 2^-6 (tie to even).
  std::vector<uint16_t> results(4);
  run_local_ranks(4, kNoTimeout, [&](Communicator& comm) {
    uint16_t bits = fp32_to_bf16_bits(comm.rank() == 0 ? 1.0f : 0x1p-8f);
    comm.all_reduce(Tensor(&bits, DType::BF16, {1}), ReduceOp::Sum, nullptr);
    results[static_cast<size_t>(comm.rank())] = bits;
  });
  for (uint16_t r : results) EXPECT_EQ(bf16_bits_to_fp32(r), 1.0f + 0x1p-6f);
}

TEST(AllReduce, MaxPropagatesNanAndHandlesNegatives) {
  std::vector<std::vector<float>> results(3);
  run_local_ranks(3, kNoTimeout, [&](Communicator& comm) {
    const int r = comm.rank();
    // element 0: all negative; element 1: a NaN on rank 1; element 2: inf on rank 2.
    std::vector<float> values = {-5.0f + r, r == 1 ? NAN : 1.0f, r == 2 ? INFINITY : -1.0f};
    comm.all_reduce(Tensor(values.data(), DType::F32, {3}), ReduceOp::Max, nullptr);
    results[static_cast<size_t>(r)] = values;
  });
  for (const auto& values : results) {
    EXPECT_EQ(values[0], -3.0f);
    EXPECT_TRUE(std::isnan(values[1]));
    EXPECT_EQ(values[2], INFINITY);
  }
}

TEST(AllReduce, Int32SumWrapsAround) {
  std::vector<int32_t> results(2);
  run_local_ranks(2, kNoTimeout, [&](Communicator& comm) {
    int32_t value = 2147483647;
    comm.all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
    results[static_cast<size_t>(comm.rank())] = value;
  });
  for (int32_t r : results) EXPECT_EQ(r, -2);
}

TEST(AllReduce, RepeatedInPlaceCallsStayExact) {
  // Many back-to-back in-place calls: a rank leaving a collective early, or writing before
  // the others read, would show up as a wrong element in some iteration.
  const int ranks = 8;
  const int64_t n = 10007;
  const int iterations = 40;
  std::vector<int64_t> wrong(ranks, 0);
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    const int r = comm.rank();
    GuardedBuffer buffer(DType::F32, n);
    std::vector<double> values(ranks);
    for (int it = 0; it < iterations; ++it) {
      buffer.fill(100 + it, r);
      comm.all_reduce(buffer.tensor(), ReduceOp::Sum, nullptr);
      for (int64_t i = 0; i < n; i += 97) {
        for (int s = 0; s < ranks; ++s) values[s] = test_value(DType::F32, 100 + it, s, i);
        if (buffer.get(i) != reference_reduce(DType::F32, ReduceOp::Sum, values)) ++wrong[r];
      }
      if (!buffer.guards_intact()) ++wrong[r];
    }
  });
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r;
}

// ---- reduce_scatter ----

class ReduceScatterTest : public ::testing::TestWithParam<ReduceCase> {};

TEST_P(ReduceScatterTest, EachRankGetsItsReducedSlice) {
  const auto [dtype, op, ranks, n] = GetParam();  // n per rank
  const uint64_t seed = 23;
  std::vector<GuardedBuffer> inputs, outputs;
  for (int r = 0; r < ranks; ++r) {
    inputs.emplace_back(dtype, n * ranks);
    inputs.back().fill(seed, r);
    outputs.emplace_back(dtype, n);
  }
  std::vector<GuardedBuffer> expected;
  std::vector<double> values(static_cast<size_t>(ranks));
  bool nonzero = false;
  for (int r = 0; r < ranks; ++r) {
    expected.emplace_back(dtype, n);
    for (int64_t i = 0; i < n; ++i) {
      for (int s = 0; s < ranks; ++s) values[static_cast<size_t>(s)] = inputs[s].get(r * n + i);
      expected[r].set(i, reference_reduce(dtype, op, values));
    }
    nonzero = nonzero || expected[r].any_nonzero();
  }
  ASSERT_TRUE(nonzero);
  std::vector<GuardedBuffer> inputs_before;
  for (int r = 0; r < ranks; ++r) inputs_before.push_back(inputs[r]);

  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    const size_t r = static_cast<size_t>(comm.rank());
    comm.reduce_scatter(outputs[r].tensor(), inputs[r].tensor(), op, nullptr);
  });
  for (int r = 0; r < ranks; ++r) {
    const std::string what = case_name(dtype, op, ranks, n) + " rank " + std::to_string(r);
    EXPECT_TRUE(same_bits(outputs[r], expected[r], what));
    EXPECT_TRUE(same_bits(inputs[r], inputs_before[r], what + " input (must stay unchanged)"));
  }
}

INSTANTIATE_TEST_SUITE_P(Small, ReduceScatterTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::F16, DType::BF16,
                                                              DType::I32),
                                            ::testing::Values(ReduceOp::Sum, ReduceOp::Max),
                                            ::testing::Range(1, 9),
                                            ::testing::Values<int64_t>(1, 7, 2053)),
                         reduce_case_name);
INSTANTIATE_TEST_SUITE_P(Large, ReduceScatterTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::F16),
                                            ::testing::Values(ReduceOp::Sum),
                                            ::testing::Values(2, 3, 8),
                                            ::testing::Values<int64_t>(125003)),
                         reduce_case_name);

// ---- all_gather ----

using GatherCase = std::tuple<DType, int, int64_t, bool>;  // dtype, ranks, n, in place

class AllGatherTest : public ::testing::TestWithParam<GatherCase> {};

TEST_P(AllGatherTest, EveryRankGetsTheConcatenation) {
  const auto [dtype, ranks, n, in_place] = GetParam();  // n per rank
  const uint64_t seed = 37;
  std::vector<GuardedBuffer> inputs, outputs;
  GuardedBuffer expected(dtype, n * ranks);
  for (int r = 0; r < ranks; ++r) {
    inputs.emplace_back(dtype, n);
    inputs.back().fill(seed, r);
    outputs.emplace_back(dtype, n * ranks);
    for (int64_t i = 0; i < n; ++i) expected.set(r * n + i, inputs[r].get(i));
    // In place, the input is the rank's own slice of its output.
    if (in_place) {
      std::memcpy(static_cast<char*>(outputs[r].data()) + r * inputs[r].nbytes(), inputs[r].data(),
                  inputs[r].nbytes());
    }
  }
  ASSERT_TRUE(expected.any_nonzero());
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    const size_t r = static_cast<size_t>(comm.rank());
    const Tensor input = in_place ? outputs[r].slice(comm.rank() * n, n) : inputs[r].tensor();
    comm.all_gather(outputs[r].tensor(), input, nullptr);
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(same_bits(outputs[r], expected,
                          std::string(dtype_name(dtype)) + " " + std::to_string(ranks) +
                              " ranks n " + std::to_string(n) + " rank " + std::to_string(r)));
  }
}

std::string gather_case_name(const ::testing::TestParamInfo<GatherCase>& info) {
  const auto [dtype, ranks, n, in_place] = info.param;
  return std::string(dtype_name(dtype)) + "_" + std::to_string(ranks) + "ranks_n" +
         std::to_string(n) + (in_place ? "_in_place" : "");
}

INSTANTIATE_TEST_SUITE_P(Small, AllGatherTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::F16, DType::I32),
                                            ::testing::Range(1, 9),
                                            ::testing::Values<int64_t>(1, 7, 2053),
                                            ::testing::Bool()),
                         gather_case_name);
INSTANTIATE_TEST_SUITE_P(Large, AllGatherTest,
                         ::testing::Combine(::testing::Values(DType::BF16),
                                            ::testing::Values(2, 3, 8),
                                            ::testing::Values<int64_t>(125003),
                                            ::testing::Bool()),
                         gather_case_name);

TEST(AllGather, ReduceScatterThenAllGatherEqualsAllReduce) {
  // The ZeRO pattern: reduce-scatter the gradient, all-gather the shards. Same bits as one
  // all_reduce, since both reduce each element in rank order and round once.
  const int ranks = 4;
  const int64_t n = 1001;  // per rank
  std::vector<int> equal(ranks, 0);
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    GuardedBuffer gradient(DType::BF16, n * ranks), shard(DType::BF16, n),
        gathered(DType::BF16, n * ranks);
    gradient.fill(5, comm.rank());
    GuardedBuffer reduced = gradient;
    comm.reduce_scatter(shard.tensor(), gradient.tensor(), ReduceOp::Sum, nullptr);
    comm.all_gather(gathered.tensor(), shard.tensor(), nullptr);
    comm.all_reduce(reduced.tensor(), ReduceOp::Sum, nullptr);
    equal[static_cast<size_t>(comm.rank())] = gathered.same_bytes(reduced) && reduced.any_nonzero();
  });
  for (int r = 0; r < ranks; ++r) EXPECT_TRUE(equal[r]) << "rank " << r;
}

// ---- broadcast ----

class BroadcastTest : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(BroadcastTest, EveryRootReachesEveryRank) {
  const auto [ranks, n] = GetParam();
  std::vector<int64_t> wrong(static_cast<size_t>(ranks), 0);
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    GuardedBuffer buffer(DType::F16, n), expected(DType::F16, n);
    for (int root = 0; root < comm.size(); ++root) {
      buffer.fill(50 + root, comm.rank());  // every rank has different data before
      expected.fill(50 + root, root);
      comm.broadcast(buffer.tensor(), root, nullptr);
      if (!buffer.same_bytes(expected) || !buffer.guards_intact()) ++wrong[comm.rank()];
    }
  });
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(All, BroadcastTest,
                         ::testing::Combine(::testing::Range(1, 9),
                                            ::testing::Values<int64_t>(1, 7, 100003)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- barrier ----

TEST(Barrier, NobodyPassesBeforeEveryoneArrived) {
  for (int ranks = 1; ranks <= 8; ++ranks) {
    std::atomic<int> arrived{0};
    std::vector<int> wrong(static_cast<size_t>(ranks), 0);
    const int rounds = 50;
    run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
      for (int round = 1; round <= rounds; ++round) {
        arrived.fetch_add(1);
        comm.barrier();
        if (arrived.load() < round * ranks) ++wrong[static_cast<size_t>(comm.rank())];
        comm.barrier();  // nobody starts the next round before everyone checked this one
      }
    });
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(wrong[r], 0) << ranks << " ranks, rank " << r;
  }
}

TEST(RunLocalRanks, EachThreadKnowsItsRank) {
  std::vector<int> context_ranks(5, -1), comm_ranks(5, -1), sizes(5, 0);
  run_local_ranks(5, kNoTimeout, [&](Communicator& comm) {
    context_ranks[comm.rank()] = thread_error_context().rank;
    comm_ranks[comm.rank()] = comm.rank();
    sizes[comm.rank()] = comm.size();
  });
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(context_ranks[r], r);
    EXPECT_EQ(comm_ranks[r], r);
    EXPECT_EQ(sizes[r], 5);
  }
}

}  // namespace
}  // namespace dstrain::test
