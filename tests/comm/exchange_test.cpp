// Communicator::exchange on the local communicator: sends and receives as one group (torch's
// batch_isend_irecv). Neighbours sending to each other at once, rings, 1F1B pipeline stages in
// sub-groups, matching plain send/recv in per-pair order; mismatches, failing, absent and
// returned peers, and wrong arguments end in an Error naming the operation.
#include <functional>
#include <latch>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm_test_util.h"

namespace dstrain::test {
namespace {

P2POp send_to(Tensor buffer, int peer) { return P2POp{P2POp::Kind::Send, buffer, peer}; }
P2POp recv_from(Tensor buffer, int peer) { return P2POp{P2POp::Kind::Recv, buffer, peer}; }

// `count` elements per rank, each rank's filled from data set `seed`.
std::vector<GuardedBuffer> filled_per_rank(int ranks, DType dtype, int64_t count, uint64_t seed) {
  std::vector<GuardedBuffer> buffers;
  for (int r = 0; r < ranks; ++r) {
    buffers.emplace_back(dtype, count);
    buffers.back().fill(seed, r);
  }
  return buffers;
}
std::vector<GuardedBuffer> zeros_per_rank(int ranks, DType dtype, int64_t count) {
  return std::vector<GuardedBuffer>(static_cast<size_t>(ranks), GuardedBuffer(dtype, count));
}

// `got` holds exactly `want`'s elements, `want` is not all zeros, and no guard was written.
void expect_received(const GuardedBuffer& got, const GuardedBuffer& want, const std::string& what) {
  EXPECT_TRUE(want.count() == 0 || want.any_nonzero())
      << what << ": a test on zeros proves nothing";
  EXPECT_TRUE(got.same_bytes(want)) << what;
  EXPECT_TRUE(got.guards_intact()) << what;
}

::testing::AssertionResult mentions(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\n  message: " << text << "\n  lacks:   " << part;
}

// The dstrain::Error message each rank's function threw ("" for none), and what
// run_local_ranks threw (the root cause).
struct RunErrors {
  std::vector<std::string> of_rank;
  std::string of_run;
};
RunErrors run_collecting_errors(int ranks, double timeout,
                                const std::function<void(Communicator&)>& fn) {
  RunErrors errors;
  errors.of_rank.resize(static_cast<size_t>(ranks));
  try {
    run_local_ranks(ranks, timeout, [&](Communicator& comm) {
      try {
        fn(comm);
      } catch (const Error& e) {
        errors.of_rank[static_cast<size_t>(comm.rank())] = e.what();  // each rank its own slot
        throw;
      }
    });
    ADD_FAILURE() << "run_local_ranks did not throw";
  } catch (const std::exception& e) {
    errors.of_run = e.what();
  }
  return errors;
}

// ---- data ----

TEST(Exchange, NeighboursSendingToEachOtherAtOnceDoNotDeadlock) {
  // With blocking send, two ranks that both send first wait for each other forever.
  for (DType dtype : {DType::F32, DType::BF16, DType::I32}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100003}}) {
      const std::string what = std::string(dtype_name(dtype)) + " n " + std::to_string(n);
      std::vector<GuardedBuffer> sent = filled_per_rank(2, dtype, n, 1);
      std::vector<GuardedBuffer> received = zeros_per_rank(2, dtype, n);
      run_local_ranks(2, kNoTimeout, [&](Communicator& comm) {
        const int r = comm.rank(), peer = 1 - r;
        comm.exchange({send_to(sent[r].tensor(), peer), recv_from(received[r].tensor(), peer)},
                      nullptr);
      });
      const std::vector<GuardedBuffer> original = filled_per_rank(2, dtype, n, 1);
      for (int r = 0; r < 2; ++r) {
        expect_received(received[r], original[1 - r], what + " rank " + std::to_string(r));
        EXPECT_TRUE(sent[r].same_bytes(original[r])) << what << ": a send buffer was written";
      }
    }
  }
}

TEST(Exchange, RingOfFourPassesEveryBufferAllTheWayRound) {
  // Each round every rank sends what it holds to the next and takes the previous one's, in
  // one exchange (the operations listed receive-first in odd rounds: the order in the call does
  // not matter). After round k rank r holds rank (r - k)'s data; after 4 its own again.
  constexpr int ranks = 4;
  const std::vector<GuardedBuffer> original = filled_per_rank(ranks, DType::F32, 37, 2);
  std::vector<GuardedBuffer> held = filled_per_rank(ranks, DType::F32, 37, 2);
  std::vector<GuardedBuffer> incoming = zeros_per_rank(ranks, DType::F32, 37);
  std::vector<std::vector<int>> origin_by_round(ranks);
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    const int r = comm.rank(), next = (r + 1) % ranks, previous = (r + ranks - 1) % ranks;
    for (int round = 0; round < ranks; ++round) {
      const P2POp out = send_to(held[r].tensor(), next);
      const P2POp in = recv_from(incoming[r].tensor(), previous);
      comm.exchange(round % 2 == 0 ? std::vector<P2POp>{out, in} : std::vector<P2POp>{in, out},
                    nullptr);
      std::swap(held[r], incoming[r]);
      int origin = -1;
      for (int s = 0; s < ranks; ++s) {
        if (held[r].same_bytes(original[s])) origin = s;
      }
      origin_by_round[r].push_back(origin);
    }
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(origin_by_round[r], (std::vector<int>{(r + 3) % 4, (r + 2) % 4, (r + 1) % 4, r}))
        << "rank " << r;
    expect_received(held[r], original[r], "rank " + std::to_string(r) + " after the ring");
  }
}

TEST(Exchange, OneFOneBNeighboursInPipelineGroups) {
  // 8 ranks as two pipelines of 4 stages (sub-groups). 1F1B's steady state: every stage sends
  // its activation forward and receives the next stage's gradient, and receives the previous
  // stage's activation and sends it a gradient, all in one exchange (middle stages: 4 ops).
  constexpr int ranks = 8, stages = 4;
  const std::vector<GuardedBuffer> activation = filled_per_rank(ranks, DType::F32, 65, 3);
  const std::vector<GuardedBuffer> gradient = filled_per_rank(ranks, DType::BF16, 65, 4);
  std::vector<GuardedBuffer> sent_activation = activation, sent_gradient = gradient;
  std::vector<GuardedBuffer> got_activation = zeros_per_rank(ranks, DType::F32, 65);
  std::vector<GuardedBuffer> got_gradient = zeros_per_rank(ranks, DType::BF16, 65);
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& world) {
    const int r = world.rank();
    std::unique_ptr<Communicator> pipeline = world.split(r / stages, r);
    const int stage = pipeline->rank();
    std::vector<P2POp> ops;
    if (stage + 1 < stages) {
      ops.push_back(send_to(sent_activation[r].tensor(), stage + 1));
      ops.push_back(recv_from(got_gradient[r].tensor(), stage + 1));
    }
    if (stage > 0) {
      ops.push_back(recv_from(got_activation[r].tensor(), stage - 1));
      ops.push_back(send_to(sent_gradient[r].tensor(), stage - 1));
    }
    pipeline->exchange(ops, nullptr);
  });
  for (int r = 0; r < ranks; ++r) {
    const std::string what = "world rank " + std::to_string(r);
    if (r % stages > 0) expect_received(got_activation[r], activation[r - 1], what);
    if (r % stages + 1 < stages) expect_received(got_gradient[r], gradient[r + 1], what);
  }
}

TEST(Exchange, MatchesPlainSendAndRecvInBothDirections) {
  // Rank 0 exchanges; rank 1 answers with plain calls, receiving first or sending first.
  for (bool peer_sends_first : {false, true}) {
    std::vector<GuardedBuffer> sent = filled_per_rank(2, DType::F16, 101, 5);
    std::vector<GuardedBuffer> received = zeros_per_rank(2, DType::F16, 101);
    run_local_ranks(2, kNoTimeout, [&](Communicator& comm) {
      if (comm.rank() == 0) {
        comm.exchange({recv_from(received[0].tensor(), 1), send_to(sent[0].tensor(), 1)}, nullptr);
      } else if (peer_sends_first) {
        comm.send(sent[1].tensor(), 0, nullptr);
        comm.recv(received[1].tensor(), 0, nullptr);
      } else {
        comm.recv(received[1].tensor(), 0, nullptr);
        comm.send(sent[1].tensor(), 0, nullptr);
      }
    });
    const std::string what = peer_sends_first ? "peer sends first" : "peer receives first";
    expect_received(received[0], sent[1], what + ", rank 0");
    expect_received(received[1], sent[0], what + ", rank 1");
  }
}

TEST(Exchange, PerPairOrderHoldsAcrossMixedCalls) {
  // Numbered messages both ways through every mix of plain calls and exchanges: each pair's
  // messages arrive in the order sent, whatever call sent or received them.
  std::vector<int32_t> got_by_one, got_by_zero;
  run_local_ranks(2, kNoTimeout, [&](Communicator& comm) {
    int32_t m[5] = {100, 101, 102, 103, 104}, back[3] = {200, 201, 202};
    int32_t in[5] = {-1, -1, -1, -1, -1};
    auto t = [](int32_t& value) { return Tensor(&value, DType::I32, {1}); };
    if (comm.rank() == 0) {
      comm.send(t(m[0]), 1, nullptr);
      comm.exchange({send_to(t(m[1]), 1), recv_from(t(in[0]), 1)}, nullptr);
      comm.exchange({send_to(t(m[2]), 1)}, nullptr);
      comm.send(t(m[3]), 1, nullptr);
      comm.exchange({recv_from(t(in[1]), 1), send_to(t(m[4]), 1)}, nullptr);
      comm.recv(t(in[2]), 1, nullptr);
      got_by_zero.assign(in, in + 3);
    } else {
      comm.exchange({recv_from(t(in[0]), 0)}, nullptr);
      comm.recv(t(in[1]), 0, nullptr);
      comm.send(t(back[0]), 0, nullptr);
      comm.exchange({recv_from(t(in[2]), 0)}, nullptr);
      comm.recv(t(in[3]), 0, nullptr);
      comm.exchange({send_to(t(back[1]), 0), recv_from(t(in[4]), 0)}, nullptr);
      comm.exchange({send_to(t(back[2]), 0)}, nullptr);
      got_by_one.assign(in, in + 5);
    }
  });
  EXPECT_EQ(got_by_one, (std::vector<int32_t>{100, 101, 102, 103, 104}));
  EXPECT_EQ(got_by_zero, (std::vector<int32_t>{200, 201, 202}));
}

TEST(Exchange, SeveralMessagesToOnePeerInOneCallGoInOrder) {
  SeveralMessages got;
  run_local_ranks(2, kNoTimeout, [&](Communicator& comm) {
    exchange_several_messages(comm, got);
  });
  expect_several_messages_arrived(got);
}

TEST(Exchange, NoOperationsIsANoOp) {
  std::vector<int32_t> sums(3);
  run_local_ranks(3, kNoTimeout, [&](Communicator& comm) {
    comm.exchange({}, nullptr);
    int32_t value = comm.rank() + 1;
    comm.all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
    sums[comm.rank()] = value;
  });
  EXPECT_EQ(sums, (std::vector<int32_t>{6, 6, 6}));
}

// ---- errors ----

TEST(ExchangeMismatch, CountAgainstAPlainRecvIsTheSameErrorOnBothSides) {
  std::vector<GuardedBuffer> buffers = filled_per_rank(2, DType::F32, 10, 6);
  const RunErrors errors = run_collecting_errors(2, kNoTimeout, [&](Communicator& comm) {
    if (comm.rank() == 0) {
      comm.exchange({send_to(buffers[0].tensor(), 1)}, nullptr);
    } else {
      comm.recv(buffers[1].slice(0, 8), 0, nullptr);
    }
  });
  EXPECT_TRUE(mentions(errors.of_rank[0],
                       "mismatched send/recv: recv #1 by rank 1 from rank 0 "
                       "on group 'world' expects 8 F32 elements, but the "
                       "sender sent 10 F32"));
  EXPECT_EQ(errors.of_rank[0], errors.of_rank[1]);
  EXPECT_TRUE(buffers[1].same_bytes(filled_per_rank(2, DType::F32, 10, 6)[1]))
      << "a rejected message must not be copied";
}

TEST(ExchangeMismatch, DtypeInsideTwoWayExchangesFailsBothSides) {
  // Rank 1 takes rank 0's F32 message as I32. Rank 0 gets the rejection itself, or (when
  // rank 1 withdrew its own send first) is released by rank 1's failure: either way the
  // message names the mismatched receive.
  std::vector<GuardedBuffer> sent = filled_per_rank(2, DType::F32, 10, 7);
  std::vector<GuardedBuffer> received = zeros_per_rank(2, DType::F32, 10);
  const RunErrors errors = run_collecting_errors(2, kNoTimeout, [&](Communicator& comm) {
    const int r = comm.rank(), peer = 1 - r;
    Tensor into = received[r].tensor();
    if (r == 1) into.dtype = DType::I32;
    comm.exchange({send_to(sent[r].tensor(), peer), recv_from(into, peer)}, nullptr);
  });
  const std::string mismatch =
      "mismatched send/recv: recv #1 by rank 1 from rank 0 on group 'world' expects 10 I32 "
      "elements, but the sender sent 10 F32";
  EXPECT_TRUE(mentions(errors.of_rank[0], mismatch));
  EXPECT_TRUE(mentions(errors.of_rank[1], mismatch));
  EXPECT_TRUE(mentions(errors.of_run, mismatch));
  EXPECT_FALSE(received[1].any_nonzero()) << "a rejected message must not be copied";
}

TEST(ExchangeFailure, APeerThatThrowsReleasesTheRanksWaitingInExchanges) {
  // A ring of 4 where rank 2 gives up: rank 1's send and rank 3's receive can never complete,
  // and rank 0 gets stuck in its second round.
  const RunErrors errors = run_collecting_errors(4, kNoTimeout, [&](Communicator& comm) {
    const int r = comm.rank();
    if (r == 2) throw std::runtime_error("rank two gave up");
    float mine = static_cast<float>(r), theirs = 0.0f;
    for (int round = 0; round < 3; ++round) {
      comm.exchange({send_to(Tensor(&mine, DType::F32, {1}), (r + 1) % 4),
                     recv_from(Tensor(&theirs, DType::F32, {1}), (r + 3) % 4)},
                    nullptr);
    }
  });
  EXPECT_EQ(errors.of_run, "rank two gave up");
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(mentions(errors.of_rank[r], "aborted: rank 2 failed: rank two gave up"))
        << "rank " << r;
  }
}

TEST(ExchangeFailure, APeerThatNeverComesTimesOut) {
  // Rank 1 stays in its own code until rank 0 has given up; rank 0 waits in the receive of
  // its exchange (its send is withdrawn).
  for (bool with_recv : {true, false}) {
    std::latch gave_up(1);
    const RunErrors errors = run_collecting_errors(2, kShortTimeout, [&](Communicator& comm) {
      int32_t mine = 5, theirs = 0;
      if (comm.rank() == 1) {
        gave_up.wait();
        return;
      }
      std::vector<P2POp> ops = {send_to(Tensor(&mine, DType::I32, {1}), 1)};
      if (with_recv) ops.push_back(recv_from(Tensor(&theirs, DType::I32, {1}), 1));
      try {
        comm.exchange(ops, nullptr);
      } catch (...) {
        gave_up.count_down();
        throw;
      }
    });
    if (with_recv) {
      EXPECT_TRUE(mentions(errors.of_run,
                           "recv #1 by rank 0 from rank 1 on group 'world' timed "
                           "out: rank 0 waited 0.25 s, but rank 1 never sent it "
                           "(it is in its own code, before any collective)"));
    } else {
      EXPECT_TRUE(mentions(errors.of_run,
                           "send #1 from rank 0 to rank 1 on group 'world' timed "
                           "out: rank 0 waited 0.25 s, but rank 1 never received "
                           "it"));
    }
  }
}

TEST(ExchangeFailure, AfterAnExchangeARankIsInItsOwnCodeSinceIt) {
  std::latch gave_up(1);
  const RunErrors errors = run_collecting_errors(2, kShortTimeout, [&](Communicator& comm) {
    int32_t value = 9;
    const Tensor t(&value, DType::I32, {1});
    if (comm.rank() == 1) {
      comm.exchange({recv_from(t, 0)}, nullptr);
      gave_up.wait();
      return;
    }
    comm.exchange({send_to(t, 1)}, nullptr);
    try {
      comm.recv(t, 1, nullptr);
    } catch (...) {
      gave_up.count_down();
      throw;
    }
  });
  EXPECT_TRUE(mentions(errors.of_run, "recv #1 by rank 0 from rank 1 on group 'world' timed out"));
  EXPECT_TRUE(
      mentions(errors.of_run, "(it is in its own code since exchange #1 on group 'world')"));
}

TEST(ExchangeFailure, APeerThatReturnedFailsAtOnce) {
  // The timeout is long: the exchange ends because rank 1 returned, not because time ran out.
  const RunErrors errors = run_collecting_errors(2, kNoTimeout, [](Communicator& comm) {
    if (comm.rank() == 1) return;
    int32_t mine = 1, theirs = 0;
    comm.exchange({recv_from(Tensor(&theirs, DType::I32, {1}), 1),
                   send_to(Tensor(&mine, DType::I32, {1}), 1)},
                  nullptr);
  });
  EXPECT_TRUE(mentions(errors.of_run,
                       "recv #1 by rank 0 from rank 1 on group 'world' cannot "
                       "complete: rank 1 returned from its function and never "
                       "sent it"));
}

TEST(ExchangeArguments, RejectedBeforeAnythingIsSent) {
  // Rank 0 makes the bad call, rank 1 waits in a barrier and is released by its failure.
  std::vector<float> a(16, 1.0f), b(16, 1.0f);
  auto error_of = [&](const std::vector<P2POp>& ops) {
    return run_collecting_errors(2, kNoTimeout,
                                 [&](Communicator& comm) {
                                   if (comm.rank() == 0) comm.exchange(ops, nullptr);
                                   comm.barrier();
                                 })
        .of_run;
  };
  const Tensor a4(a.data(), DType::F32, {4}), b4(b.data(), DType::F32, {4});
  EXPECT_TRUE(mentions(error_of({send_to(a4, 0)}), "exchange: peer 0 is not another rank"));
  EXPECT_TRUE(mentions(error_of({recv_from(a4, 2)}), "exchange: peer 2 is not another rank"));
  EXPECT_TRUE(
      mentions(error_of({send_to(a4, 1), recv_from(Tensor(a.data() + 2, DType::F32, {4}), 1)}),
               "exchange: the receive buffer of operation 1 overlaps the buffer of "
               "operation 0"));
  EXPECT_TRUE(mentions(
      error_of({send_to(Tensor(a.data(), DType::F32, {4}, Device{Device::Kind::CUDA, 0}), 1)}),
      "exchange: the local communicator moves CPU memory only; buffer is on cuda:0"));
}

}  // namespace
}  // namespace dstrain::test
