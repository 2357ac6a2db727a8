// Communicator::all_to_all on the local communicator: per-peer counts with zeros (a rank that
// sends nothing, a pair with nothing between them), every dtype, 1 to 5 ranks, after a split;
// counts that do not agree between peers and counts beyond a buffer are an Error.
#include <string>

#include "comm_test_util.h"

namespace dstrain::test {
namespace {

constexpr double kNoTimeout = 30.0;

TEST(AllToAll, EveryRankGetsWhatEachPeerSentItInPeerOrder) {
  for (int ranks : {1, 2, 3, 5}) {
    for (DType dtype : {DType::F32, DType::BF16, DType::I32}) {
      AllToAllCase c(ranks, dtype, 40 + static_cast<uint64_t>(ranks));
      run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) { c.run(comm); });
      c.expect_delivered(std::string(dtype_name(dtype)) + " on " + std::to_string(ranks) +
                         " ranks");
    }
  }
}

// Expert parallelism runs it on groups of the data-parallel ranks.
TEST(AllToAll, RunsOnTheGroupsOfASplit) {
  const int ranks = 4;
  AllToAllCase even(2, DType::F32, 50), odd(2, DType::F32, 51);
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    std::unique_ptr<Communicator> group = comm.split(comm.rank() % 2, comm.rank());
    (comm.rank() % 2 == 0 ? even : odd).run(*group);
  });
  even.expect_delivered("even ranks");
  odd.expect_delivered("odd ranks");
}

TEST(AllToAll, CountsThatDisagreeOrOverflowAreAnError) {
  // Rank 0 says it sends 3 elements to rank 1; rank 1 expects 2.
  EXPECT_THROW(run_local_ranks(2, 2.0,
                               [&](Communicator& comm) {
                                 GuardedBuffer in(DType::F32, 4), out(DType::F32, 4);
                                 in.fill(1, comm.rank());
                                 const std::vector<int64_t> send = comm.rank() == 0
                                                                       ? std::vector<int64_t>{1, 3}
                                                                       : std::vector<int64_t>{2, 1};
                                 const std::vector<int64_t> recv = comm.rank() == 0
                                                                       ? std::vector<int64_t>{1, 2}
                                                                       : std::vector<int64_t>{2, 1};
                                 comm.all_to_all(out.tensor(), recv, in.tensor(), send, nullptr);
                               }),
               Error);
  EXPECT_THROW(run_local_ranks(1, 2.0,
                               [&](Communicator& comm) {
                                 GuardedBuffer in(DType::F32, 2), out(DType::F32, 2);
                                 comm.all_to_all(out.tensor(), {3}, in.tensor(), {3}, nullptr);
                               }),
               Error);
  EXPECT_THROW(run_local_ranks(2, 2.0,
                               [&](Communicator& comm) {
                                 GuardedBuffer in(DType::F32, 2), out(DType::F32, 2);
                                 comm.all_to_all(out.tensor(), {1}, in.tensor(), {1}, nullptr);
                               }),
               Error);
}

}  // namespace
}  // namespace dstrain::test
