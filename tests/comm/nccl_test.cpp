// The NCCL communicator (comm/nccl_communicator.h) on the GPUs of this machine: every
// collective against the contract's reference, host tensors staged through the device, splits,
// point to point, and a failing rank releasing the others. Skips without NCCL or a GPU.
#include "comm/nccl_communicator.h"
#include "comm/rendezvous.h"
#include "comm_test_util.h"

#ifdef DSTRAIN_WITH_NCCL
#include <cuda_runtime_api.h>

#include <algorithm>
#include <stdexcept>
#include <thread>
#endif

namespace dstrain::test {
namespace {

#ifdef DSTRAIN_WITH_NCCL

int usable_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

#define REQUIRE_CUDA_DEVICE()                                 \
  do {                                                        \
    if (usable_gpus() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// A device copy of a GuardedBuffer's elements on the current GPU; back() copies them back.
class DeviceCopy {
 public:
  DeviceCopy(GuardedBuffer& host, int device) : host_(host), device_(device) {
    EXPECT_EQ(cudaMalloc(&data_, std::max<size_t>(host.nbytes(), 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host.data(), host.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceCopy() { cudaFree(data_); }
  Tensor tensor() const {
    Tensor t(data_, host_.dtype(), {host_.count()}, Device{Device::Kind::CUDA, device_});
    return t;
  }
  void back() {
    EXPECT_EQ(cudaMemcpy(host_.data(), data_, host_.nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  GuardedBuffer& host_;
  int device_;
  void* data_ = nullptr;
};

int test_ranks() { return std::min(usable_gpus(), 4); }

TEST(Nccl, CollectivesMatchTheReference) {
  REQUIRE_CUDA_DEVICE();
  const int ranks = test_ranks();
  constexpr int64_t n = 1001;
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::I32}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<GuardedBuffer> reduced, gathered, inputs, broadcast;
    for (int r = 0; r < ranks; ++r) {
      reduced.emplace_back(dtype, n);
      reduced.back().fill(1, r);
      inputs.emplace_back(dtype, n);
      inputs.back().fill(2, r);
      gathered.emplace_back(dtype, n * ranks);
      broadcast.emplace_back(dtype, n);
      broadcast.back().fill(3, r);
    }
    GuardedBuffer expected_sum(dtype, n);
    std::vector<double> values(static_cast<size_t>(ranks));
    for (int64_t i = 0; i < n; ++i) {
      for (int r = 0; r < ranks; ++r) values[static_cast<size_t>(r)] = reduced[r].get(i);
      expected_sum.set(i, reference_reduce(dtype, ReduceOp::Sum, values));
    }
    ASSERT_TRUE(expected_sum.any_nonzero());
    const GuardedBuffer& root_values = broadcast[0];
    std::vector<double> root_copy(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) root_copy[static_cast<size_t>(i)] = root_values.get(i);
    run_nccl_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
      const int r = comm.rank();
      DeviceCopy red(reduced[r], r), gat(gathered[r], r), in(inputs[r], r), bro(broadcast[r], r);
      comm.all_reduce(red.tensor(), ReduceOp::Sum, nullptr);
      comm.all_gather(gat.tensor(), in.tensor(), nullptr);
      comm.broadcast(bro.tensor(), 0, nullptr);
      red.back();
      gat.back();
      bro.back();
    });
    // NCCL's order is not rank order: exact for I32, within a few roundings for floats.
    const double tolerance = dtype == DType::I32 ? 0.0 : dtype == DType::F32 ? 1e-6 : 2e-2;
    for (int r = 0; r < ranks; ++r) {
      EXPECT_TRUE(reduced[r].guards_intact());
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_NEAR(reduced[r].get(i), expected_sum.get(i),
                    tolerance * (1.0 + std::abs(expected_sum.get(i))))
            << "all_reduce rank " << r << " [" << i << "]";
        ASSERT_EQ(broadcast[r].get(i), root_copy[static_cast<size_t>(i)]) << "broadcast";
      }
      for (int s = 0; s < ranks; ++s) {
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(gathered[r].get(s * n + i), inputs[s].get(i)) << "all_gather";
        }
      }
      // Every rank holds the same bits (one result, copied to all).
      EXPECT_TRUE(reduced[r].same_bytes(reduced[0])) << "rank " << r;
    }
  }
}

TEST(Nccl, HostTensorsSplitsAndPointToPoint) {
  REQUIRE_CUDA_DEVICE();
  const int ranks = test_ranks();
  std::vector<float> maxima(static_cast<size_t>(ranks));
  std::vector<int32_t> received(static_cast<size_t>(ranks), -1);
  std::vector<int> split_sizes(static_cast<size_t>(ranks));
  run_nccl_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    const int r = comm.rank();
    float flag = static_cast<float>(r);  // host memory: staged through the device
    comm.all_reduce(Tensor(&flag, DType::F32, {1}), ReduceOp::Max, nullptr);
    maxima[static_cast<size_t>(r)] = flag;
    std::unique_ptr<Communicator> half = comm.split(r % 2, r);
    split_sizes[static_cast<size_t>(r)] = half->size();
    half->barrier();
    if (ranks > 1) {
      int32_t value = 100 + r;
      if (r == 0) comm.send(Tensor(&value, DType::I32, {1}), 1, nullptr);
      if (r == 1) {
        comm.recv(Tensor(&value, DType::I32, {1}), 0, nullptr);
        received[1] = value;
      }
    }
    comm.barrier();
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(maxima[static_cast<size_t>(r)], static_cast<float>(ranks - 1));
    EXPECT_EQ(split_sizes[static_cast<size_t>(r)], (ranks + 1 - r % 2) / 2);
  }
  if (ranks > 1) {
    EXPECT_EQ(received[1], 100);
  }
}

TEST(Nccl, ExchangeWithBothNeighboursAtOnce) {
  // Every rank sends to the next and the previous rank and receives from both in one exchange
  // (one NCCL group): device buffers one way round the ring, host buffers (staged through the
  // device) the other. With 2 ranks both neighbours are the same peer: one send and one receive.
  REQUIRE_CUDA_DEVICE();
  const int ranks = test_ranks();
  if (ranks < 2) GTEST_SKIP() << "needs 2 GPUs";
  constexpr int64_t n = 1001;
  std::vector<GuardedBuffer> forward, backward, from_previous, from_next;
  for (int r = 0; r < ranks; ++r) {
    forward.emplace_back(DType::BF16, n);
    forward.back().fill(4, r);
    backward.emplace_back(DType::I32, n);
    backward.back().fill(5, r);
    from_previous.emplace_back(DType::BF16, n);
    from_next.emplace_back(DType::I32, n);
  }
  run_nccl_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
    const int r = comm.rank(), next = (r + 1) % ranks, previous = (r + ranks - 1) % ranks;
    DeviceCopy sent(forward[r], r), received(from_previous[r], r);
    std::vector<P2POp> ops = {{P2POp::Kind::Send, sent.tensor(), next},
                              {P2POp::Kind::Recv, received.tensor(), previous}};
    if (ranks > 2) {
      ops.push_back({P2POp::Kind::Send, backward[r].tensor(), previous});
      ops.push_back({P2POp::Kind::Recv, from_next[r].tensor(), next});
    }
    comm.exchange(ops, nullptr);
    received.back();
  });
  for (int r = 0; r < ranks; ++r) {
    const int next = (r + 1) % ranks, previous = (r + ranks - 1) % ranks;
    ASSERT_TRUE(forward[previous].any_nonzero());
    EXPECT_TRUE(from_previous[r].same_bytes(forward[previous])) << "rank " << r;
    EXPECT_TRUE(from_previous[r].guards_intact()) << "rank " << r;
    if (ranks > 2) {
      EXPECT_TRUE(from_next[r].same_bytes(backward[next])) << "rank " << r;
      EXPECT_TRUE(from_next[r].guards_intact()) << "rank " << r;
    }
  }
}

// all_to_all with per-peer counts and zeros among them: device buffers (one NCCL group of sends
// and receives, the own part copied on the stream) and host buffers (staged through the device).
TEST(Nccl, AllToAllWithPerPeerCounts) {
  REQUIRE_CUDA_DEVICE();
  const int ranks = test_ranks();
  for (bool on_device : {true, false}) {
    AllToAllCase c(ranks, DType::BF16, 60);
    run_nccl_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
      const int r = comm.rank();
      if (!on_device) return c.run(comm);
      DeviceCopy in(c.inputs[r], r), out(c.outputs[r], r);
      comm.all_to_all(out.tensor(), c.recv_counts(r), in.tensor(), c.send_counts(r), nullptr);
      out.back();
    });
    c.expect_delivered(on_device ? "device buffers" : "host buffers");
  }
}

TEST(Nccl, AFailingRankReleasesTheOthers) {
  REQUIRE_CUDA_DEVICE();
  const int ranks = test_ranks();
  if (ranks < 2) GTEST_SKIP() << "needs 2 GPUs";
  try {
    run_nccl_ranks(ranks, kNoTimeout, [&](Communicator& comm) {
      if (comm.rank() == 1) throw std::runtime_error("rank 1 gives up");
      float value = 1.0f;
      comm.all_reduce(Tensor(&value, DType::F32, {1}), ReduceOp::Sum, nullptr);
    });
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 gives up"), std::string::npos) << e.what();
  }
}

// Two "nodes" (threads of this process, each with its own rendezvous client, as dstrain's
// processes have) of 2 ranks: node 0 makes the ncclUniqueId, the rendezvous hands it to node 1,
// and the 4 ranks form one world (ranks 0-1 on GPUs 0-1, ranks 2-3 on GPUs 2-3) whose
// all_reduce and all_gather see every rank. (The emulator's NCCL lives in one process: two
// processes cannot join it; on a GPU machine the same code runs across processes.)
TEST(Nccl, TwoNodesJoinOneWorldThroughTheRendezvous) {
  REQUIRE_CUDA_DEVICE();
  if (usable_gpus() < 4) GTEST_SKIP() << "needs 4 GPUs";
  RendezvousOptions options;
  options.master_addr = "127.0.0.1";
  options.master_port = 0;  // node 0: a free port
  options.nnodes = 2;
  options.timeout_seconds = 60;
  Rendezvous node0(options);
  options.master_port = node0.server_port();
  options.node_rank = 1;
  Rendezvous node1(options);
  std::vector<float> sums(4, -1), gathered(16, -1);
  std::vector<int> devices(4, -1);  // by world rank: the GPU the rank runs on
  const auto run_node = [&](Rendezvous& rendezvous, int node) {
    rendezvous.join();
    NcclNodeRanks ranks;
    ranks.first_rank = 2 * node;
    ranks.local_ranks = 2;
    ranks.world_size = 4;
    ranks.first_device = 2 * node;
    ranks.unique_id = rendezvous.broadcast_bytes("nccl", node == 0 ? nccl_unique_id() : "");
    run_nccl_node_ranks(ranks, 60, [&](Communicator& comm) {
      const int r = comm.rank();
      EXPECT_EQ(cudaGetDevice(&devices[static_cast<size_t>(r)]), cudaSuccess);
      float value = 1.5f + static_cast<float>(r);  // host memory: staged through the device
      comm.all_reduce(Tensor(&value, DType::F32, {1}), ReduceOp::Sum, nullptr);
      sums[static_cast<size_t>(r)] = value;
      std::vector<float> mine(4, static_cast<float>(10 * r)), all(16);
      comm.all_gather(Tensor(all.data(), DType::F32, {16}), Tensor(mine.data(), DType::F32, {4}),
                      nullptr);
      if (r == 3) gathered = all;
    });
  };
  std::thread second([&] { run_node(node1, 1); });
  run_node(node0, 0);
  second.join();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(devices[static_cast<size_t>(r)], r) << "rank r on GPU first_device + local";
    EXPECT_EQ(sums[static_cast<size_t>(r)], 1.5f + 2.5f + 3.5f + 4.5f) << "rank " << r;
  }
  for (int i = 0; i < 16; ++i) EXPECT_EQ(gathered[static_cast<size_t>(i)], 10.0f * (i / 4)) << i;
}

#else  // no NCCL in this build

TEST(Nccl, CollectivesMatchTheReference) {
  EXPECT_FALSE(nccl_available());
  GTEST_SKIP() << "no CUDA device (this build has no NCCL)";
}

#endif

}  // namespace
}  // namespace dstrain::test
