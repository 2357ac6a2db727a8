// Sub-groups (split by color and key: even/odd, the 2x4 dp x tp grid, nested, opting out)
// and point-to-point send/recv (pairs, chains, sub-groups, ordering).
#include "comm_test_util.h"

namespace dstrain::test {
namespace {

// all_gather of each member's world rank: which world rank holds each group rank.
std::vector<int32_t> gather_world_ranks(Communicator& group, int world_rank) {
  int32_t mine = world_rank;
  std::vector<int32_t> all(static_cast<size_t>(group.size()));
  group.all_gather(Tensor(all.data(), DType::I32, {group.size()}),
                   Tensor(&mine, DType::I32, {1}), nullptr);
  return all;
}

TEST(Split, EvenAndOddRanks) {
  for (int ranks = 1; ranks <= 8; ++ranks) {
    std::vector<std::vector<int32_t>> members(static_cast<size_t>(ranks));
    std::vector<int> group_ranks(static_cast<size_t>(ranks)), group_sizes(members.size());
    std::vector<int32_t> sums(members.size());
    run_local_ranks(ranks, kNoTimeout, [&](Communicator& world) {
      const int r = world.rank();
      std::unique_ptr<Communicator> parity = world.split(r % 2, r);
      ASSERT_NE(parity, nullptr);
      group_ranks[r] = parity->rank();
      group_sizes[r] = parity->size();
      members[r] = gather_world_ranks(*parity, r);
      int32_t value = r + 1;
      parity->all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
      sums[r] = value;
    });
    for (int r = 0; r < ranks; ++r) {
      std::vector<int32_t> want;
      int32_t sum = 0;
      for (int s = r % 2; s < ranks; s += 2) {
        want.push_back(s);
        sum += s + 1;
      }
      EXPECT_EQ(group_ranks[r], r / 2) << ranks << " ranks, rank " << r;
      EXPECT_EQ(group_sizes[r], static_cast<int>(want.size()));
      EXPECT_EQ(members[r], want);
      EXPECT_EQ(sums[r], sum);
    }
  }
}

TEST(Split, GridRowsAndColumnsAsTpAndDpGroups) {
  // 8 ranks as 2 (dp) x 4 (tp): tp groups are rows of consecutive ranks, dp groups columns.
  const int dp = 2, tp = 4;
  std::vector<std::vector<int32_t>> row_members(dp * tp), column_members(dp * tp);
  std::vector<int32_t> totals(dp * tp);
  std::vector<std::vector<float>> column_sums(dp * tp);
  run_local_ranks(dp * tp, kNoTimeout, [&](Communicator& world) {
    const int r = world.rank();
    auto tp_group = world.split(/*color=*/r / tp, /*key=*/r);
    auto dp_group = world.split(/*color=*/r % tp, /*key=*/r);
    EXPECT_EQ(tp_group->size(), tp);
    EXPECT_EQ(tp_group->rank(), r % tp);
    EXPECT_EQ(dp_group->size(), dp);
    EXPECT_EQ(dp_group->rank(), r / tp);
    row_members[r] = gather_world_ranks(*tp_group, r);
    column_members[r] = gather_world_ranks(*dp_group, r);
    // A row sum then a column sum is the world sum (exact in int32).
    int32_t value = 10 * r + 3;
    tp_group->all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
    dp_group->all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
    totals[r] = value;
    // Float data reduced over the column in dp-rank order.
    GuardedBuffer gradient(DType::F32, 777);
    gradient.fill(9, r);
    dp_group->all_reduce(gradient.tensor(), ReduceOp::Sum, nullptr);
    column_sums[r].resize(777);
    for (int64_t i = 0; i < 777; ++i) column_sums[r][i] = static_cast<float>(gradient.get(i));
  });
  int32_t total = 0;
  for (int r = 0; r < dp * tp; ++r) total += 10 * r + 3;
  for (int r = 0; r < dp * tp; ++r) {
    const int row = r / tp, column = r % tp;
    EXPECT_EQ(row_members[r], (std::vector<int32_t>{row * tp, row * tp + 1, row * tp + 2,
                                                    row * tp + 3}));
    EXPECT_EQ(column_members[r], (std::vector<int32_t>{column, column + tp}));
    EXPECT_EQ(totals[r], total);
    for (int64_t i = 0; i < 777; ++i) {
      const double want = reference_reduce(
          DType::F32, ReduceOp::Sum,
          {test_value(DType::F32, 9, column, i), test_value(DType::F32, 9, column + tp, i)});
      ASSERT_EQ(column_sums[r][i], want) << "rank " << r << " element " << i;
    }
  }
}

TEST(Split, KeyOrdersTheNewRanksAndTheReduction) {
  // key = -rank reverses the order. The order-sensitive sum ((1e8 + 1) - 1e8) + 1 = 1 holds
  // only when the reduction runs in the new rank order (world order would give 0).
  const float by_new_rank[] = {1e8f, 1.0f, -1e8f, 1.0f};
  std::vector<std::vector<int32_t>> members(4);
  std::vector<float> results(4);
  run_local_ranks(4, kNoTimeout, [&](Communicator& world) {
    const int r = world.rank();
    auto reversed = world.split(0, -r);
    EXPECT_EQ(reversed->rank(), 3 - r);
    members[r] = gather_world_ranks(*reversed, r);
    float value = by_new_rank[reversed->rank()];
    reversed->all_reduce(Tensor(&value, DType::F32, {1}), ReduceOp::Sum, nullptr);
    results[r] = value;
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(members[r], (std::vector<int32_t>{3, 2, 1, 0}));
    EXPECT_EQ(results[r], 1.0f);
  }
}

TEST(Split, EqualKeysKeepTheOldOrder) {
  std::vector<int> new_ranks(6);
  run_local_ranks(6, kNoTimeout, [&](Communicator& world) {
    // Ranks 0, 2, 4 share key 1, ranks 1, 3, 5 key 0: order 1, 3, 5, 0, 2, 4.
    auto group = world.split(0, world.rank() % 2 == 0 ? 1 : 0);
    new_ranks[world.rank()] = group->rank();
  });
  EXPECT_EQ(new_ranks, (std::vector<int>{3, 0, 4, 1, 5, 2}));
}

TEST(Split, NegativeColorJoinsNoGroup) {
  std::vector<int> got_group(5, -1), sizes(5, 0);
  run_local_ranks(5, kNoTimeout, [&](Communicator& world) {
    const int r = world.rank();
    auto group = world.split(r == 2 ? -1 : 7, 0);
    got_group[r] = group != nullptr;
    if (group) {
      sizes[r] = group->size();
      group->barrier();
    }
  });
  EXPECT_EQ(got_group, (std::vector<int>{1, 1, 0, 1, 1}));
  EXPECT_EQ(sizes, (std::vector<int>{4, 4, 0, 4, 4}));
}

TEST(Split, NestedSplitsAndRepeatedSplits) {
  std::vector<int32_t> sums(8);
  run_local_ranks(8, kNoTimeout, [&](Communicator& world) {
    const int r = world.rank();
    auto half = world.split(r / 4, r);       // {0..3}, {4..7}
    auto quarter = half->split(half->rank() / 2, 0);  // pairs
    EXPECT_EQ(quarter->size(), 2);
    int32_t value = r;
    quarter->all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
    sums[r] = value;
    // The same split again gives a new, independent group.
    for (int i = 0; i < 10; ++i) {
      auto again = world.split(r % 2, r);
      again->barrier();
    }
  });
  for (int r = 0; r < 8; ++r) EXPECT_EQ(sums[r], (r / 2) * 2 + (r / 2) * 2 + 1) << "rank " << r;
}

TEST(Split, GroupsInterleaveWithoutDeadlock) {
  // Mixed traffic like a training step: tp all_reduce, dp reduce_scatter / all_gather, world
  // max; many rounds.
  const int dp = 2, tp = 4, rounds = 30;
  std::vector<int> wrong(dp * tp, 0);
  run_local_ranks(dp * tp, kNoTimeout, [&](Communicator& world) {
    const int r = world.rank();
    auto tp_group = world.split(r / tp, r);
    auto dp_group = world.split(r % tp, r);
    std::vector<int32_t> grad(dp * 3), shard(3), params(dp * 3);
    for (int round = 0; round < rounds; ++round) {
      int32_t activation = r + round;
      tp_group->all_reduce(Tensor(&activation, DType::I32, {1}), ReduceOp::Sum, nullptr);
      int32_t want = 0;
      for (int s = (r / tp) * tp; s < (r / tp + 1) * tp; ++s) want += s + round;
      if (activation != want) ++wrong[r];
      for (int i = 0; i < dp * 3; ++i) grad[i] = i + r;
      dp_group->reduce_scatter(Tensor(shard.data(), DType::I32, {3}),
                               Tensor(grad.data(), DType::I32, {dp * 3}), ReduceOp::Sum, nullptr);
      dp_group->all_gather(Tensor(params.data(), DType::I32, {dp * 3}),
                           Tensor(shard.data(), DType::I32, {3}), nullptr);
      for (int i = 0; i < dp * 3; ++i) {
        if (params[i] != 2 * i + (r % tp) + (r % tp + tp)) ++wrong[r];
      }
      int32_t flag = (round == r) ? 1 : 0;
      world.all_reduce(Tensor(&flag, DType::I32, {1}), ReduceOp::Max, nullptr);
      if (flag != (round < dp * tp ? 1 : 0)) ++wrong[r];
    }
  });
  for (int r = 0; r < dp * tp; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r;
}

// ---- send / recv ----

TEST(SendRecv, PairAtOddSizes) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100003}}) {
    GuardedBuffer sent(DType::BF16, n), received(DType::BF16, n);
    sent.fill(3, 0);
    run_local_ranks(2, kNoTimeout, [&](Communicator& comm) {
      if (comm.rank() == 0) {
        comm.send(sent.tensor(), 1, nullptr);
      } else {
        comm.recv(received.tensor(), 0, nullptr);
      }
    });
    EXPECT_TRUE(received.same_bytes(sent)) << "n " << n;
    EXPECT_TRUE(received.guards_intact()) << "n " << n;
  }
}

TEST(SendRecv, MessagesArriveInOrder) {
  std::vector<int32_t> got;
  run_local_ranks(3, kNoTimeout, [&](Communicator& comm) {
    // Rank 0 sends 20 numbered messages to rank 2; rank 1 stays out of it.
    for (int32_t i = 0; i < 20; ++i) {
      int32_t message = i;
      if (comm.rank() == 0) comm.send(Tensor(&message, DType::I32, {1}), 2, nullptr);
      if (comm.rank() == 2) {
        comm.recv(Tensor(&message, DType::I32, {1}), 0, nullptr);
        got.push_back(message);
      }
    }
  });
  std::vector<int32_t> want(20);
  for (int32_t i = 0; i < 20; ++i) want[i] = i;
  EXPECT_EQ(got, want);
}

TEST(SendRecv, PipelineChainAndBack) {
  // Forward along the pipeline (rank r adds r), then the result back to rank 0: 1F1B's shape.
  for (int ranks = 2; ranks <= 8; ++ranks) {
    std::vector<float> results(static_cast<size_t>(ranks));
    run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
      const int r = comm.rank(), last = comm.size() - 1;
      std::vector<float> activation(5, 0.0f);
      Tensor t(activation.data(), DType::F32, {5});
      if (r > 0) comm.recv(t, r - 1, nullptr);
      for (float& a : activation) a += static_cast<float>(r);
      if (r < last) comm.send(t, r + 1, nullptr);
      if (r == last) comm.send(t, 0, nullptr);
      if (r == 0) comm.recv(t, last, nullptr);
      results[r] = activation[4];
    });
    EXPECT_EQ(results[0], ranks * (ranks - 1) / 2) << ranks << " ranks";
  }
}

TEST(SendRecv, ExchangeBetweenNeighboursInASubGroup) {
  // Odd world ranks form a group; inside it, pairs (0,1), (2,3) exchange by group rank.
  std::vector<int32_t> got(8, -1);
  run_local_ranks(8, kNoTimeout, [&](Communicator& world) {
    auto odd = world.split(world.rank() % 2 == 1 ? 0 : -1, 0);
    if (!odd) return;
    const int partner = odd->rank() ^ 1;
    int32_t mine = world.rank(), theirs = -1;
    if (odd->rank() % 2 == 0) {
      odd->send(Tensor(&mine, DType::I32, {1}), partner, nullptr);
      odd->recv(Tensor(&theirs, DType::I32, {1}), partner, nullptr);
    } else {
      odd->recv(Tensor(&theirs, DType::I32, {1}), partner, nullptr);
      odd->send(Tensor(&mine, DType::I32, {1}), partner, nullptr);
    }
    got[world.rank()] = theirs;
  });
  EXPECT_EQ(got, (std::vector<int32_t>{-1, 3, -1, 1, -1, 7, -1, 5}));
}

}  // namespace
}  // namespace dstrain::test
