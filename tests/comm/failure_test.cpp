// Failure handling of the local communicator: a throwing rank stops every rank (across
// groups) and its own exception comes out of run_local_ranks; a rank that never arrives
// ends the run at the timeout with a message naming it and what it is doing; a rank that has
// returned is noticed at once; mismatched calls are an Error, never corrupted memory.
// No test here asserts on time: the timeouts fire because a rank is held back on a latch
// that only the failing ranks release.
#include <latch>
#include <mutex>
#include <stdexcept>

#include "comm_test_util.h"

namespace dstrain::test {
namespace {

// EXPECT_THAT(text, HasSubstr(part)) without gmock (tests link gtest only).
struct HasSubstr {
  std::string part;
  explicit HasSubstr(std::string p) : part(std::move(p)) {}
};
::testing::AssertionResult contains(const std::string& text, const HasSubstr& wanted) {
  if (text.find(wanted.part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\n  message: " << text << "\n  lacks:   " << wanted.part;
}
#define EXPECT_THAT(text, wanted) EXPECT_TRUE(contains((text), (wanted)))

// Error messages the ranks saw, by rank, written from the rank threads.
class Messages {
 public:
  explicit Messages(int ranks) : messages_(static_cast<size_t>(ranks)) {}
  // Runs f; records the message of a dstrain::Error it throws, then rethrows it.
  template <class F>
  void record(int rank, F&& f) {
    try {
      f();
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mutex_);
      messages_[static_cast<size_t>(rank)] = e.what();
      throw;
    }
  }
  std::string operator[](int rank) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return messages_[static_cast<size_t>(rank)];
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
};

// Runs the ranks and returns the message of the dstrain::Error run_local_ranks throws.
template <class F>
std::string run_expecting_error(int ranks, double timeout, F&& fn) {
  try {
    run_local_ranks(ranks, timeout, fn);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "run_local_ranks did not throw dstrain::Error";
  return "";
}

// ---- a rank that throws ----

TEST(RankFailure, UserErrorComesOutAsUserErrorAndReleasesTheOthers) {
  Messages seen(4);
  try {
    run_local_ranks(4, kNoTimeout, [&](Communicator& comm) {
      if (comm.rank() == 2) throw UserError("the model does not fit; use --zero 3");
      float value = 1.0f;
      seen.record(comm.rank(), [&] {
        comm.all_reduce(Tensor(&value, DType::F32, {1}), ReduceOp::Sum, nullptr);
      });
    });
    FAIL() << "no exception";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "the model does not fit; use --zero 3");
  }
  for (int r : {0, 1, 3}) {
    EXPECT_THAT(seen[r], HasSubstr("all_reduce #1 on group 'world'")) << "rank " << r;
    EXPECT_THAT(seen[r], HasSubstr("rank 2 failed: the model does not fit")) << "rank " << r;
  }
}

TEST(RankFailure, ExceptionTypeIsKept) {
  EXPECT_THROW(run_local_ranks(3, kNoTimeout,
                               [](Communicator& comm) {
                                 if (comm.rank() == 1) throw std::invalid_argument("bad");
                                 comm.barrier();
                               }),
               std::invalid_argument);
  EXPECT_THROW(run_local_ranks(2, kNoTimeout,
                               [](Communicator& comm) {
                                 if (comm.rank() == 0) throw 42;
                                 comm.barrier();
                               }),
               int);
}

TEST(RankFailure, CheckFailureNamesTheRank) {
  const std::string message = run_expecting_error(3, kNoTimeout, [](Communicator& comm) {
    DSTRAIN_CHECK(comm.rank() != 1) << "rank one is broken";
    comm.barrier();
  });
  EXPECT_THAT(message, HasSubstr("[rank 1]"));
  EXPECT_THAT(message, HasSubstr("rank one is broken"));
}

TEST(RankFailure, CrossesGroups) {
  // Rank 3 fails; rank 1 waits for it in the odd group, ranks 0 and 2 in a world barrier.
  Messages seen(4);
  const std::string message = run_expecting_error(4, kNoTimeout, [&](Communicator& world) {
    auto parity = world.split(world.rank() % 2, 0);
    if (world.rank() == 3) {
      throw UserError("rank three gave up");
    }
    seen.record(world.rank(), [&] {
      if (world.rank() == 1) {
        parity->barrier();
      } else {
        world.barrier();
      }
    });
  });
  EXPECT_EQ(message, "rank three gave up");
  EXPECT_THAT(seen[1], HasSubstr("barrier #1 on group 'world/split0[color 1]'"));
  for (int r : {0, 1, 2}) EXPECT_THAT(seen[r], HasSubstr("rank 3 failed")) << "rank " << r;
}

TEST(RankFailure, MidwayThroughMixedTrafficReleasesEveryone) {
  // A 2 x 4 grid doing tp / dp / world collectives and pipeline sends; rank 5 fails in
  // round 17. Every other rank must come out with an Error naming rank 5, whatever it was in.
  Messages seen(8);
  const std::string message = run_expecting_error(8, kNoTimeout, [&](Communicator& world) {
    const int r = world.rank();
    auto tp = world.split(r / 4, r);
    auto dp = world.split(r % 4, r);
    seen.record(r, [&] {
      for (int round = 0; round < 40; ++round) {
        if (r == 5 && round == 17) throw Error("rank five broke in round 17");
        float x = 1.0f;
        tp->all_reduce(Tensor(&x, DType::F32, {1}), ReduceOp::Sum, nullptr);
        if (tp->rank() > 0) tp->recv(Tensor(&x, DType::F32, {1}), tp->rank() - 1, nullptr);
        if (tp->rank() < 3) tp->send(Tensor(&x, DType::F32, {1}), tp->rank() + 1, nullptr);
        dp->barrier();
        world.all_reduce(Tensor(&x, DType::F32, {1}), ReduceOp::Max, nullptr);
      }
    });
  });
  EXPECT_EQ(message, "rank five broke in round 17");
  for (int r = 0; r < 8; ++r) {
    if (r == 5) continue;
    EXPECT_THAT(seen[r], HasSubstr("rank 5 failed: rank five broke")) << "rank " << r;
  }
}

TEST(RankFailure, EveryRankThrowingStillGivesOneOfTheirErrors) {
  try {
    run_local_ranks(8, kNoTimeout, [](Communicator& comm) {
      comm.barrier();
      throw std::runtime_error("rank " + std::to_string(comm.rank()) + " exploded");
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("exploded"));
  }
}

TEST(RankFailure, TheNextRunIsUnaffected) {
  EXPECT_THROW(run_local_ranks(2, kNoTimeout,
                               [](Communicator& comm) {
                                 if (comm.rank() == 0) throw std::runtime_error("x");
                                 comm.barrier();
                               }),
               std::runtime_error);
  std::vector<int32_t> sums(2);
  run_local_ranks(2, kNoTimeout, [&](Communicator& comm) {
    int32_t value = 1;
    comm.all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
    sums[comm.rank()] = value;
  });
  EXPECT_EQ(sums, (std::vector<int32_t>{2, 2}));
}

// ---- a rank that never arrives ----

TEST(Timeout, NamesTheMissingRankAndWhatItIsDoing) {
  // Rank 3 stays in its own code until every other rank has given up.
  std::latch others_failed(3);
  Messages seen(4);
  const std::string message = run_expecting_error(4, kShortTimeout, [&](Communicator& comm) {
    if (comm.rank() == 3) {
      others_failed.wait();
      seen.record(3, [&] { comm.barrier(); });
      return;
    }
    float value = 1.0f;
    try {
      comm.all_reduce(Tensor(&value, DType::F32, {1}), ReduceOp::Sum, nullptr);
    } catch (...) {
      others_failed.count_down();
      throw;
    }
  });
  EXPECT_THAT(message, HasSubstr("all_reduce #1 on group 'world' timed out"));
  EXPECT_THAT(message, HasSubstr("waited 0.25 s"));
  EXPECT_THAT(message,
              HasSubstr("rank 3 never joined (it is in its own code, before any collective)"));
  // The late rank is stopped at its next collective.
  EXPECT_THAT(seen[3], HasSubstr("barrier #1 on group 'world' aborted"));
}

TEST(Timeout, MissingRankStuckInAnotherGroup) {
  // Ranks 0-2 wait in a world all_reduce for rank 3; rank 3 waits in the odd group's barrier
  // for rank 1. Whichever side times out first, the message names both operations.
  const std::string message = run_expecting_error(4, kShortTimeout, [&](Communicator& world) {
    auto parity = world.split(world.rank() % 2, 0);
    if (world.rank() == 3) {
      parity->barrier();
    } else {
      float value = 1.0f;
      world.all_reduce(Tensor(&value, DType::F32, {1}), ReduceOp::Sum, nullptr);
    }
  });
  EXPECT_THAT(message, HasSubstr("timed out"));
  EXPECT_THAT(message, HasSubstr("all_reduce #2 on group 'world'"));
  EXPECT_THAT(message, HasSubstr("barrier #1 on group 'world/split0[color 1]'"));
}

TEST(Timeout, ListsEveryMissingRank) {
  std::latch released(1);
  const std::string message = run_expecting_error(5, kShortTimeout, [&](Communicator& comm) {
    if (comm.rank() >= 3) {
      released.wait();
      return;
    }
    try {
      comm.barrier();
    } catch (...) {
      if (comm.rank() == 0) released.count_down();
      throw;
    }
  });
  EXPECT_THAT(message, HasSubstr("barrier #1 on group 'world' timed out"));
  EXPECT_THAT(message, HasSubstr("rank 3 never joined"));
  EXPECT_THAT(message, HasSubstr("rank 4 never joined"));
}

TEST(Timeout, SendNobodyReceives) {
  std::latch sender_failed(1);
  const std::string message = run_expecting_error(2, kShortTimeout, [&](Communicator& comm) {
    int32_t value = 5;
    if (comm.rank() == 1) {
      sender_failed.wait();
      return;
    }
    try {
      comm.send(Tensor(&value, DType::I32, {1}), 1, nullptr);
    } catch (...) {
      sender_failed.count_down();
      throw;
    }
  });
  EXPECT_THAT(message, HasSubstr("send #1 from rank 0 to rank 1 on group 'world' timed out"));
  EXPECT_THAT(message, HasSubstr("rank 1 never received it (it is in its own code"));
}

TEST(Timeout, RecvNobodySends) {
  std::latch receiver_failed(1);
  const std::string message = run_expecting_error(3, kShortTimeout, [&](Communicator& comm) {
    int32_t value = 0;
    if (comm.rank() == 0) {
      receiver_failed.wait();
      return;
    }
    if (comm.rank() == 1) return;
    try {
      comm.recv(Tensor(&value, DType::I32, {1}), 0, nullptr);
    } catch (...) {
      receiver_failed.count_down();
      throw;
    }
  });
  EXPECT_THAT(message, HasSubstr("recv #1 by rank 2 from rank 0 on group 'world' timed out"));
  EXPECT_THAT(message, HasSubstr("rank 0 never sent it"));
}

// ---- a rank that has returned ----

TEST(FinishedRank, CollectiveFailsWithoutWaitingForTheTimeout) {
  // The timeout is long: the run ends because rank 2 returned, not because time ran out.
  const std::string message = run_expecting_error(3, kNoTimeout, [](Communicator& comm) {
    if (comm.rank() == 2) return;
    comm.barrier();
  });
  EXPECT_THAT(message, HasSubstr("barrier #1 on group 'world' cannot complete"));
  EXPECT_THAT(message, HasSubstr("rank 2 never joined (it has returned from its function)"));
}

TEST(FinishedRank, RecvFromARankThatReturned) {
  const std::string message = run_expecting_error(2, kNoTimeout, [](Communicator& comm) {
    if (comm.rank() == 0) return;
    int32_t value = 0;
    comm.recv(Tensor(&value, DType::I32, {1}), 0, nullptr);
  });
  EXPECT_THAT(message, HasSubstr("recv #1 by rank 1 from rank 0"));
  EXPECT_THAT(message, HasSubstr("rank 0 returned from its function and never sent it"));
}

TEST(FinishedRank, SubGroupMemberNamesItsWorldRank) {
  const std::string message = run_expecting_error(4, kNoTimeout, [](Communicator& world) {
    auto parity = world.split(world.rank() % 2, 0);
    if (world.rank() == 3) return;
    if (world.rank() == 1) parity->barrier();
  });
  EXPECT_THAT(message, HasSubstr("barrier #1 on group 'world/split0[color 1]' cannot complete"));
  EXPECT_THAT(message, HasSubstr("rank 1 (world rank 3) never joined"));
}

// ---- mismatched calls ----

// Every rank calls call(comm, buffer) on its own guarded buffer; returns the run's error.
template <class Call>
std::string mismatch_error(int ranks, Call&& call, std::vector<GuardedBuffer>* buffers) {
  for (int r = 0; r < ranks; ++r) buffers->emplace_back(DType::F32, 64);
  return run_expecting_error(ranks, kNoTimeout, [&](Communicator& comm) {
    call(comm, (*buffers)[static_cast<size_t>(comm.rank())]);
  });
}

TEST(Mismatch, AllReduceSizes) {
  std::vector<GuardedBuffer> buffers;
  const std::string message = mismatch_error(
      3,
      [](Communicator& comm, GuardedBuffer& buffer) {
        const int64_t n = comm.rank() == 1 ? 12 : 10;
        comm.all_reduce(buffer.slice(0, n), ReduceOp::Sum, nullptr);
      },
      &buffers);
  EXPECT_THAT(message, HasSubstr("mismatched collectives at all_reduce #1 on group 'world'"));
  EXPECT_THAT(message, HasSubstr("rank 0 called all_reduce(count 10, F32, sum)"));
  EXPECT_THAT(message, HasSubstr("rank 1 called all_reduce(count 12, F32, sum)"));
  for (const GuardedBuffer& buffer : buffers) {
    EXPECT_TRUE(buffer.guards_intact());
    EXPECT_FALSE(buffer.any_nonzero()) << "a mismatched call must not touch the data";
  }
}

TEST(Mismatch, OpsDtypesRootsAndKinds) {
  std::vector<GuardedBuffer> b1, b2, b3, b4, b5;
  EXPECT_THAT(mismatch_error(
                  2,
                  [](Communicator& comm, GuardedBuffer& buffer) {
                    comm.all_reduce(buffer.tensor(),
                                    comm.rank() == 0 ? ReduceOp::Sum : ReduceOp::Max, nullptr);
                  },
                  &b1),
              HasSubstr("rank 1 called all_reduce(count 64, F32, max)"));
  EXPECT_THAT(mismatch_error(
                  2,
                  [](Communicator& comm, GuardedBuffer& buffer) {
                    const Tensor t = buffer.tensor();
                    comm.all_reduce(comm.rank() == 0 ? t : Tensor(t.data, DType::I32, {64}),
                                    ReduceOp::Sum, nullptr);
                  },
                  &b2),
              HasSubstr("rank 1 called all_reduce(count 64, I32, sum)"));
  EXPECT_THAT(mismatch_error(
                  3,
                  [](Communicator& comm, GuardedBuffer& buffer) {
                    comm.broadcast(buffer.tensor(), comm.rank() == 2 ? 1 : 0, nullptr);
                  },
                  &b3),
              HasSubstr("rank 2 called broadcast(count 64, F32, root 1)"));
  EXPECT_THAT(mismatch_error(
                  3,
                  [](Communicator& comm, GuardedBuffer& buffer) {
                    if (comm.rank() == 1) {
                      comm.barrier();
                    } else {
                      comm.all_reduce(buffer.tensor(), ReduceOp::Sum, nullptr);
                    }
                  },
                  &b4),
              HasSubstr("rank 1 called barrier"));
  EXPECT_THAT(mismatch_error(
                  2,
                  [](Communicator& comm, GuardedBuffer& buffer) {
                    const int64_t n = comm.rank() == 0 ? 8 : 4;
                    GuardedBuffer out(DType::F32, 2 * n);
                    comm.all_gather(out.tensor(), buffer.slice(0, n), nullptr);
                  },
                  &b5),
              HasSubstr("rank 1 called all_gather(count 4, F32)"));
}

TEST(Mismatch, SendRecvSizes) {
  Messages seen(2);
  const std::string message = run_expecting_error(2, kNoTimeout, [&](Communicator& comm) {
    std::vector<float> data(10, 1.0f);
    seen.record(comm.rank(), [&] {
      if (comm.rank() == 0) {
        comm.send(Tensor(data.data(), DType::F32, {10}), 1, nullptr);
      } else {
        comm.recv(Tensor(data.data(), DType::F32, {8}), 0, nullptr);
      }
    });
  });
  EXPECT_THAT(message, HasSubstr("mismatched send/recv"));
  EXPECT_THAT(message, HasSubstr("expects 8 F32 elements, but the sender sent 10 F32"));
  EXPECT_EQ(seen[0], seen[1]) << "both sides get the same error";
}

TEST(Mismatch, SharedBufferAcrossRanksIsRejected) {
  std::vector<float> shared(16, 1.0f);
  const std::string message = run_expecting_error(2, kNoTimeout, [&](Communicator& comm) {
    comm.all_reduce(Tensor(shared.data(), DType::F32, {16}), ReduceOp::Sum, nullptr);
  });
  EXPECT_THAT(message, HasSubstr("overlap"));
  EXPECT_EQ(shared[0], 1.0f);
}

// ---- wrong arguments on one rank ----

TEST(Arguments, LocalChecks) {
  auto error_of = [](const std::function<void(Communicator&)>& call) {
    return run_expecting_error(2, kNoTimeout, [&](Communicator& comm) {
      if (comm.rank() == 0) call(comm);
      comm.barrier();
    });
  };
  std::vector<float> a(16), b(16);
  EXPECT_THAT(error_of([&](Communicator& comm) {
                comm.reduce_scatter(Tensor(a.data(), DType::F32, {3}),
                                    Tensor(b.data(), DType::F32, {7}), ReduceOp::Sum, nullptr);
              }),
              HasSubstr("reduce_scatter: input (7) F32 must hold size (2) * output (3) F32"));
  EXPECT_THAT(error_of([&](Communicator& comm) {
                comm.reduce_scatter(Tensor(a.data(), DType::F32, {4}),
                                    Tensor(a.data() + 2, DType::F32, {8}), ReduceOp::Sum,
                                    nullptr);
              }),
              HasSubstr("must not overlap"));
  EXPECT_THAT(error_of([&](Communicator& comm) {
                comm.all_gather(Tensor(a.data(), DType::F32, {8}),
                                Tensor(a.data() + 1, DType::F32, {4}), nullptr);
              }),
              HasSubstr("all_gather: input must be output's own slice"));
  EXPECT_THAT(error_of([&](Communicator& comm) {
                comm.broadcast(Tensor(a.data(), DType::F32, {4}), 2, nullptr);
              }),
              HasSubstr("broadcast: root 2 is not a rank"));
  EXPECT_THAT(error_of([&](Communicator& comm) {
                comm.send(Tensor(a.data(), DType::F32, {4}), 0, nullptr);
              }),
              HasSubstr("send: peer 0 is not another rank"));
  EXPECT_THAT(error_of([&](Communicator& comm) {
                comm.all_reduce(Tensor(a.data(), DType::F32, {4}, Device{Device::Kind::CUDA, 0}),
                                ReduceOp::Sum, nullptr);
              }),
              HasSubstr("CPU memory only; buffer is on cuda:0"));
}

TEST(Arguments, RunLocalRanksRejectsBadCounts) {
  EXPECT_THROW(run_local_ranks(0, kNoTimeout, [](Communicator&) {}), UserError);
  EXPECT_THROW(run_local_ranks(2, 0.0, [](Communicator&) {}), UserError);
  EXPECT_THROW(run_local_ranks(2, NAN, [](Communicator&) {}), UserError);
}

TEST(Arguments, InfiniteTimeoutMeansNone) {
  std::vector<int32_t> sums(3);
  run_local_ranks(3, INFINITY, [&](Communicator& comm) {
    int32_t value = comm.rank();
    comm.all_reduce(Tensor(&value, DType::I32, {1}), ReduceOp::Sum, nullptr);
    sums[comm.rank()] = value;
  });
  EXPECT_EQ(sums, (std::vector<int32_t>{3, 3, 3}));
  // A returned rank is still noticed without a timeout.
  EXPECT_THAT(run_expecting_error(2, INFINITY,
                                  [](Communicator& comm) {
                                    if (comm.rank() == 0) comm.barrier();
                                  }),
              HasSubstr("rank 1 never joined (it has returned from its function)"));
}

}  // namespace
}  // namespace dstrain::test
