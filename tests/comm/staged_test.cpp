// The local communicator on device memory through host copies (comm/staged_communicator.h),
// tested without a GPU: "device" tensors here are host memory labelled cuda:0, and the copy
// function is a counted memcpy. The local communicator refuses any tensor not on the CPU, so
// a call that reaches it with a labelled tensor fails: passing proves every device tensor was
// staged. Results must be bit-identical to the same collectives on plain host buffers.
#include <atomic>
#include <cstring>
#include <memory>

#include "comm/staged_communicator.h"
#include "comm_test_util.h"

namespace dstrain::test {
namespace {

constexpr Device kFakeGpu{Device::Kind::CUDA, 0};

Tensor on_fake_gpu(GuardedBuffer& buffer) {
  Tensor t = buffer.tensor();
  t.device = kFakeGpu;
  return t;
}

struct CopyCounter {
  std::atomic<int> copies{0};
  CopyAndWait function() {
    return [this](void* dst, const void* src, size_t bytes, Stream) {
      std::memcpy(dst, src, bytes);
      ++copies;
    };
  }
};

// Every collective once, on `ranks` ranks: `staged` runs them through the wrapper on labelled
// buffers, else directly on host buffers. Returns each rank's buffers after the calls.
struct Outputs {
  std::vector<GuardedBuffer> reduced, scattered, gathered, gathered_in_place, broadcast, received,
      exchanged, exchanged_on_host, split_reduced;
};

Outputs run_all(int ranks, bool staged, CopyCounter* counter) {
  constexpr int64_t n = 37;  // odd: no size happens to align
  const DType dtype = DType::F32;
  Outputs out;
  std::vector<GuardedBuffer> scatter_inputs, gather_inputs;
  for (int r = 0; r < ranks; ++r) {
    out.reduced.emplace_back(dtype, n);
    out.reduced.back().fill(1, r);
    scatter_inputs.emplace_back(dtype, n * ranks);
    scatter_inputs.back().fill(2, r);
    out.scattered.emplace_back(dtype, n);
    gather_inputs.emplace_back(dtype, n);
    gather_inputs.back().fill(3, r);
    out.gathered.emplace_back(dtype, n * ranks);
    out.gathered_in_place.emplace_back(dtype, n * ranks);
    out.gathered_in_place.back().fill(4, r);
    out.broadcast.emplace_back(dtype, n);
    out.broadcast.back().fill(5, r);
    out.received.emplace_back(dtype, n);
    out.exchanged.emplace_back(dtype, n);
    out.exchanged_on_host.emplace_back(dtype, n);
    out.split_reduced.emplace_back(dtype, n);
    out.split_reduced.back().fill(6, r);
  }
  run_local_ranks(ranks, kNoTimeout, [&](Communicator& launched) {
    std::unique_ptr<Communicator> wrapper;
    if (staged) wrapper = make_staged_communicator(launched, counter->function());
    Communicator& comm = staged ? *wrapper : launched;
    const int r = comm.rank();
    auto t = [&](GuardedBuffer& b) { return staged ? on_fake_gpu(b) : b.tensor(); };
    comm.all_reduce(t(out.reduced[r]), ReduceOp::Sum, nullptr);
    comm.reduce_scatter(t(out.scattered[r]), t(scatter_inputs[r]), ReduceOp::Max, nullptr);
    comm.all_gather(t(out.gathered[r]), t(gather_inputs[r]), nullptr);
    Tensor in_place = t(out.gathered_in_place[r]);
    comm.all_gather(in_place, in_place.slice(n * r, {n}), nullptr);
    comm.broadcast(t(out.broadcast[r]), 1 % ranks, nullptr);
    if (ranks > 1) {
      // A ring: even ranks send first, odd ones receive first (sends block until received).
      const int next = (r + 1) % ranks, previous = (r + ranks - 1) % ranks;
      Tensor mine = t(out.reduced[r]), theirs = t(out.received[r]);
      if (r % 2 == 0) {
        comm.send(mine, next, nullptr);
        comm.recv(theirs, previous, nullptr);
      } else {
        comm.recv(theirs, previous, nullptr);
        comm.send(mine, next, nullptr);
      }
      // Both rings at once in one exchange per rank (3 or more ranks: next != previous): host
      // buffers forwards, device buffers backwards (only those are staged, each in the slot of
      // its operation).
      comm.exchange({P2POp{P2POp::Kind::Send, out.reduced[r].tensor(), next},
                     P2POp{P2POp::Kind::Recv, out.exchanged_on_host[r].tensor(), previous},
                     P2POp{P2POp::Kind::Recv, t(out.exchanged[r]), next},
                     P2POp{P2POp::Kind::Send, t(out.broadcast[r]), previous}},
                    nullptr);
    }
    std::unique_ptr<Communicator> half = comm.split(r % 2, -r);
    half->all_reduce(t(out.split_reduced[r]), ReduceOp::Sum, nullptr);
    comm.barrier();
  });
  return out;
}

void expect_same(const std::vector<GuardedBuffer>& got, const std::vector<GuardedBuffer>& want,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t r = 0; r < got.size(); ++r) {
    EXPECT_TRUE(got[r].guards_intact()) << what << " rank " << r;
    EXPECT_TRUE(want[r].any_nonzero()) << what << ": a test on zeros proves nothing";
    EXPECT_TRUE(got[r].same_bytes(want[r])) << what << " rank " << r;
  }
}

TEST(StagedCommunicator, DeviceTensorsGiveTheLocalCommunicatorsBits) {
  for (int ranks : {1, 3, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    CopyCounter counter;
    const Outputs direct = run_all(ranks, false, nullptr);
    const Outputs staged = run_all(ranks, true, &counter);
    expect_same(staged.reduced, direct.reduced, "all_reduce");
    expect_same(staged.scattered, direct.scattered, "reduce_scatter");
    expect_same(staged.gathered, direct.gathered, "all_gather");
    expect_same(staged.gathered_in_place, direct.gathered_in_place, "in-place all_gather");
    expect_same(staged.broadcast, direct.broadcast, "broadcast");
    if (ranks > 1) expect_same(staged.received, direct.received, "send/recv");
    if (ranks > 1) {
      expect_same(staged.exchanged, direct.exchanged, "exchange of device buffers");
      expect_same(staged.exchanged_on_host, direct.exchanged_on_host, "exchange of host buffers");
    }
    expect_same(staged.split_reduced, direct.split_reduced, "all_reduce on a split");
    EXPECT_GT(counter.copies.load(), 0);
  }
}

TEST(StagedCommunicator, OneRankMovesNoByteThroughTheHost) {
  // A single GPU without NCCL: all-reduce and broadcast are the identity, reduce-scatter and
  // all-gather one device copy each (the bit-level results are checked with 1 rank above).
  CopyCounter counter;
  GuardedBuffer grads(DType::F32, 37), scattered(DType::F32, 37), gathered(DType::F32, 37);
  grads.fill(1, 0);
  run_local_ranks(1, kNoTimeout, [&](Communicator& launched) {
    auto comm = make_staged_communicator(launched, counter.function());
    comm->all_reduce(on_fake_gpu(grads), ReduceOp::Sum, nullptr);
    comm->broadcast(on_fake_gpu(grads), 0, nullptr);
    EXPECT_EQ(counter.copies.load(), 0);
    comm->reduce_scatter(on_fake_gpu(scattered), on_fake_gpu(grads), ReduceOp::Sum, nullptr);
    comm->all_gather(on_fake_gpu(gathered), on_fake_gpu(scattered), nullptr);
    Tensor in_place = on_fake_gpu(gathered);
    comm->all_gather(in_place, in_place, nullptr);
  });
  EXPECT_EQ(counter.copies.load(), 2);
  EXPECT_TRUE(grads.any_nonzero());
  EXPECT_TRUE(gathered.same_bytes(grads));
  EXPECT_TRUE(gathered.guards_intact());
}

TEST(StagedCommunicator, HostTensorsPassThroughWithoutCopies) {
  CopyCounter counter;
  std::vector<GuardedBuffer> flags;
  for (int r = 0; r < 2; ++r) {
    flags.emplace_back(DType::F32, 1);
    flags.back().set(0, r + 1.0);
  }
  run_local_ranks(2, kNoTimeout, [&](Communicator& launched) {
    auto comm = make_staged_communicator(launched, counter.function());
    comm->all_reduce(flags[comm->rank()].tensor(), ReduceOp::Max, nullptr);
  });
  EXPECT_EQ(counter.copies.load(), 0);
  EXPECT_EQ(flags[0].get(0), 2.0);
  EXPECT_EQ(flags[1].get(0), 2.0);
}

TEST(StagedCommunicator, MismatchedCallsStillFailOnEveryRank) {
  CopyCounter counter;
  std::vector<GuardedBuffer> buffers;
  for (int r = 0; r < 2; ++r) buffers.emplace_back(DType::F32, 10 + r);
  EXPECT_THROW(run_local_ranks(2, kNoTimeout,
                               [&](Communicator& launched) {
                                 auto comm = make_staged_communicator(launched, counter.function());
                                 comm->all_reduce(on_fake_gpu(buffers[comm->rank()]), ReduceOp::Sum,
                                                  nullptr);
                               }),
               Error);
}

}  // namespace
}  // namespace dstrain::test
