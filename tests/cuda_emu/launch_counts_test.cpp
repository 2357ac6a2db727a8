// Launches and host waits of the CUDA backend's fused and multi-tensor ops, counted by the
// emulator (emu::this_thread_counters): the multi-tensor gradient check is two launches and one
// wait for any number of buffers, where the ops buffer by buffer wait once each; the
// multi-tensor AdamW is one launch and no wait; the residual add fused into a norm is one
// launch where the two ops are two; the GELU backward with its bias gradient two where three;
// the tensor-core attention backward two (dQ with delta, then dK/dV); and the attention's
// blocks follow set_cuda_attention_warp_rows; the norms' row forms follow their bounds.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda_emu/emu_runtime.h"

namespace dstrain {
namespace {

constexpr int kBuffers = 40;
constexpr int64_t kElements = 1000;  // per buffer; the buffers lie kElements + 3 apart

// kBuffers x (kElements + 3) random floats in emulated device memory.
struct DeviceArena {
  float* data = nullptr;
  DeviceArena() {
    std::vector<float> host(kBuffers * (kElements + 3));
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (float& x : host) x = uniform(rng);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data), host.size() * sizeof(float)),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~DeviceArena() { cudaFree(data); }
  Tensor buffer(int i) const {
    return Tensor(data + i * (kElements + 3), DType::F32, {kElements},
                  Device{Device::Kind::CUDA, 0});
  }
};

// The launches and host waits since `before`.
emu::HostCounters since(const emu::HostCounters& before) {
  const emu::HostCounters& now = emu::this_thread_counters();
  emu::HostCounters delta;
  delta.kernel_launches = now.kernel_launches - before.kernel_launches;
  delta.host_waits = now.host_waits - before.host_waits;
  return delta;
}

TEST(EmulatedHostWaits, GradientStatsWaitsOnceForAnyNumberOfBuffers) {
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  const Stream stream = backend->create_stream();
  DeviceArena arena;
  std::vector<GradientTensor> buffers;
  for (int i = 0; i < kBuffers; ++i) buffers.push_back({arena.buffer(i), i % 4 != 3});
  backend->gradient_stats(buffers, stream);  // the first call allocates its pinned readback

  const emu::HostCounters before = emu::this_thread_counters();
  const GradientStats stats = backend->gradient_stats(buffers, stream);
  const emu::HostCounters multi = since(before);
  EXPECT_EQ(multi.kernel_launches, 2u) << "the partials of every buffer, then their sums";
  EXPECT_EQ(multi.host_waits, 1u);

  const emu::HostCounters before_alone = emu::this_thread_counters();
  for (int i = 0; i < kBuffers; ++i) {
    if (!buffers[i].count_squares) continue;
    EXPECT_EQ(stats.squares[i], backend->sum_squares(buffers[i].x, stream)) << "buffer " << i;
    EXPECT_GT(stats.squares[i], 0.0);
  }
  EXPECT_EQ(since(before_alone).host_waits, static_cast<uint64_t>(kBuffers - kBuffers / 4))
      << "one wait per buffer checked alone";
  backend->destroy_stream(stream);
}

TEST(EmulatedHostWaits, AdamWMultiIsOneLaunchAndNoWait) {
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  const Stream stream = backend->create_stream();
  DeviceArena param, grad, m, v;
  std::vector<AdamWTensors> buffers;
  for (int i = 0; i < kBuffers; ++i) {
    buffers.push_back(
        {param.buffer(i), grad.buffer(i), m.buffer(i), v.buffer(i), Tensor(), i % 2 ? 0.1f : 0.0f});
  }
  backend->synchronize(stream);
  const emu::HostCounters before = emu::this_thread_counters();
  AdamWStep step;
  step.lr = 1e-3f;
  backend->adamw_multi(buffers, step, stream);
  const emu::HostCounters queued = since(before);
  EXPECT_EQ(queued.kernel_launches, 1u);
  EXPECT_EQ(queued.host_waits, 0u);
  backend->synchronize(stream);
  EXPECT_EQ(since(before).host_waits, 1u) << "synchronize waits once";
  backend->destroy_stream(stream);
}

// Rows of 64 channels in bf16: the register-held form, so the fused op is one kernel.
TEST(EmulatedLaunchCounts, ResidualFusedIntoTheNormIsOneLaunch) {
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  constexpr int64_t kRows = 4, kC = 64;
  void* memory = nullptr;
  ASSERT_EQ(cudaMalloc(&memory, 6 * kRows * kC * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaMemset(memory, 0, 6 * kRows * kC * sizeof(uint16_t)), cudaSuccess);
  const auto rows = [&](int i) {
    return Tensor(static_cast<uint16_t*>(memory) + i * kRows * kC, DType::BF16, {kRows, kC},
                  Device{Device::Kind::CUDA, 0});
  };
  const Tensor weight = rows(5).slice(0, {kC}), bias = rows(5).slice(kC, {kC});
  float* stats = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&stats), 2 * kRows * sizeof(float)), cudaSuccess);
  const Device gpu{Device::Kind::CUDA, 0};
  const Tensor mean(stats, DType::F32, {kRows}, gpu), rstd(stats + kRows, DType::F32, {kRows}, gpu);
  backend->synchronize(nullptr);

  emu::HostCounters before = emu::this_thread_counters();
  backend->residual_layernorm_forward(rows(0), rows(1), mean, rstd, rows(2), rows(3), weight, bias,
                                      nullptr);
  EXPECT_EQ(since(before).kernel_launches, 1u) << "layernorm";
  before = emu::this_thread_counters();
  backend->residual_rmsnorm_forward(rows(0), rows(1), rstd, rows(2), rows(3), weight, 1e-5f,
                                    nullptr);
  EXPECT_EQ(since(before).kernel_launches, 1u) << "RMSNorm";
  before = emu::this_thread_counters();
  backend->residual_forward(rows(0), rows(2), rows(3), nullptr);
  backend->rmsnorm_forward(rows(1), rstd, rows(0), weight, 1e-5f, nullptr);
  EXPECT_EQ(since(before).kernel_launches, 2u) << "the two ops";
  backend->synchronize(nullptr);
  cudaFree(stats);
  cudaFree(memory);
}

// The GELU backward with the fc bias's gradient: one kernel for dinp and the partial column
// sums, one adding the partials; the two ops are the GELU, the partials and their sum.
TEST(EmulatedLaunchCounts, GeluBackwardBiasIsTwoLaunchesWhereTheTwoOpsAreThree) {
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  constexpr int64_t kRows = 4, kC = 64;
  const size_t bytes = (3 * kRows * kC + 8) * sizeof(uint16_t) + kC * sizeof(float);
  void* memory = nullptr;
  ASSERT_EQ(cudaMalloc(&memory, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(memory, 0, bytes), cudaSuccess);
  const Device gpu{Device::Kind::CUDA, 0};
  const auto rows = [&](int i, int64_t offset) {
    return Tensor(static_cast<uint16_t*>(memory) + i * kRows * kC + offset, DType::BF16,
                  {kRows, kC}, gpu);
  };
  const Tensor dbias(static_cast<uint16_t*>(memory) + 3 * kRows * kC + 8, DType::F32, {kC}, gpu);
  backend->synchronize(nullptr);

  emu::HostCounters before = emu::this_thread_counters();
  backend->gelu_backward_bias(rows(0, 0), dbias, rows(1, 0), rows(2, 0), nullptr);
  EXPECT_EQ(since(before).kernel_launches, 2u) << "fused";
  before = emu::this_thread_counters();
  backend->gelu_backward_bias(rows(0, 1), dbias, rows(1, 1), rows(2, 1), nullptr);
  EXPECT_EQ(since(before).kernel_launches, 3u) << "misaligned rows: the two ops";
  backend->synchronize(nullptr);
  cudaFree(memory);
}

// One head of bf16 attention in emulated device memory (zeros: only launches are looked at):
// qkv and dqkv (1, T, 3 hd), out and dout (1, T, hd), lse (1, 1, T).
struct OneHead {
  int64_t T, hd;
  void* memory = nullptr;
  Tensor qkv, dqkv, out, dout, lse;
  OneHead(int64_t T_, int64_t hd_) : T(T_), hd(hd_) {
    const int64_t elements = 8 * T * hd;
    const size_t bytes = elements * sizeof(uint16_t) + T * sizeof(float);
    EXPECT_EQ(cudaMalloc(&memory, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(memory, 0, bytes), cudaSuccess);
    const Device gpu{Device::Kind::CUDA, 0};
    auto* base = static_cast<uint16_t*>(memory);
    qkv = Tensor(base, DType::BF16, {1, T, 3 * hd}, gpu);
    dqkv = Tensor(base + 3 * T * hd, DType::BF16, {1, T, 3 * hd}, gpu);
    out = Tensor(base + 6 * T * hd, DType::BF16, {1, T, hd}, gpu);
    dout = Tensor(base + 7 * T * hd, DType::BF16, {1, T, hd}, gpu);
    lse = Tensor(base + elements, DType::F32, {1, 1, T}, gpu);
  }
  ~OneHead() { cudaFree(memory); }
};

// The bf16 attention backward at hd 64 (the tensor-core kernels): the dQ kernel computes delta =
// rowsum(dO O) from the dO rows it loads anyway, so no kernel of its own reads dO and O for it.
TEST(EmulatedLaunchCounts, TensorCoreAttentionBackwardIsTwoLaunches) {
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  OneHead head(20, 64);
  backend->synchronize(nullptr);
  const emu::HostCounters before = emu::this_thread_counters();
  backend->attention_backward(head.dqkv, head.dout, head.qkv, head.out, head.lse, 1, 1, nullptr);
  EXPECT_EQ(since(before).kernel_launches, 2u);
  backend->synchronize(nullptr);
}

// The x extent of each grid `op` launches (emu::HostCounters::record_grids).
template <class Op>
std::vector<unsigned> grid_x(Op&& op) {
  emu::HostCounters& counters = emu::this_thread_counters();
  counters.grids.clear();
  counters.record_grids = true;
  op();
  counters.record_grids = false;
  std::vector<unsigned> x;
  for (const dim3& grid : counters.grids) x.push_back(grid.x);
  return x;
}

// set_cuda_attention_warp_rows(32) reaches the kernels: the query blocks of the forward (grid.x
// = ceil(T / block rows)) grow from 64 to 128 rows at hd 64 and 128 and stay 64 at hd 192 and
// 256; those of the backward's dQ kernel (its first launch) and the key blocks of its dK/dV
// kernel (the second) from 64 to 128 rows at hd 64 only (hd 192 and 256: 32-key blocks). At hd 64 both forms give
// the same bits (tests/kernels_cuda), so only this tells them apart.
TEST(EmulatedLaunchCounts, AttentionWarpRowsSetTheBlocks) {
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  constexpr int64_t kT = 300;  // 5 blocks of 64 rows, 3 of 128, 10 of 32
  for (int64_t hd : {64, 128, 192, 256}) {
    OneHead head(kT, hd);
    for (int rows : {16, 32}) {
      set_cuda_attention_warp_rows(rows);
      const bool wide_forward = rows == 32 && hd <= 128, wide_backward = rows == 32 && hd == 64;
      const auto forward =
          grid_x([&] { backend->attention_forward(head.out, head.lse, head.qkv, 1, 1, nullptr); });
      EXPECT_EQ(forward, std::vector<unsigned>{wide_forward ? 3u : 5u})
          << "hd " << hd << ", " << rows << " rows per warp";
      const auto backward = grid_x([&] {
        backend->attention_backward(head.dqkv, head.dout, head.qkv, head.out, head.lse, 1, 1,
                                    nullptr);
      });
      const unsigned query_blocks = wide_backward ? 3u : 5u;
      const unsigned key_blocks = hd >= 192 ? 10u : wide_backward ? 3u : 5u;
      EXPECT_EQ(backward, (std::vector<unsigned>{query_blocks, key_blocks}))
          << "hd " << hd << ", " << rows << " rows per warp";
    }
    set_cuda_attention_warp_rows(16);
    backend->synchronize(nullptr);
  }
}

// The norms' rows in bf16 (zeros: only launches are looked at): the forward holds a row of up to
// 2048 channels in one warp (8 rows per block of 256 threads), the backward only up to 1024 and
// wider rows in a block of 8 warps (one row per block); set_cuda_norm_block_rows_above moves both
// bounds and -1 restores them. The dinp kernel is the backward's first launch.
TEST(EmulatedLaunchCounts, NormBackwardTakesEightWarpsAbove1024Channels) {
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  constexpr int64_t kRows = 16, kMaxC = 2048;
  void* memory = nullptr;
  const size_t bytes =
      (3 * kRows * kMaxC + kMaxC) * sizeof(uint16_t) + (2 * kRows + 2 * kMaxC) * sizeof(float);
  ASSERT_EQ(cudaMalloc(&memory, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(memory, 0, bytes), cudaSuccess);
  const Device gpu{Device::Kind::CUDA, 0};
  auto* base = static_cast<uint16_t*>(memory);
  auto* stats = reinterpret_cast<float*>(base + 3 * kRows * kMaxC + kMaxC);
  const Tensor mean(stats, DType::F32, {kRows}, gpu), rstd(stats + kRows, DType::F32, {kRows}, gpu);
  for (const int64_t C : {int64_t{1024}, int64_t{1032}, int64_t{1600}, kMaxC}) {
    const auto rows = [&](int i) {
      return Tensor(base + i * kRows * kMaxC, DType::BF16, {kRows, C}, gpu);
    };
    const Tensor weight(base + 3 * kRows * kMaxC, DType::BF16, {C}, gpu);
    const Tensor dweight(stats + 2 * kRows, DType::F32, {C}, gpu);
    const Tensor dbias(stats + 2 * kRows + kMaxC, DType::F32, {C}, gpu);
    for (const int64_t bound : {int64_t{-1}, int64_t{0}, kMaxC}) {
      set_cuda_norm_block_rows_above(bound);
      const bool wide_forward = bound == 0;
      const bool wide_backward = bound == 0 || (bound < 0 && C > 1024);
      const unsigned forward_blocks = wide_forward ? kRows : kRows / 8;
      const unsigned backward_blocks = wide_backward ? kRows : kRows / 8;
      const std::string where = "C " + std::to_string(C) + ", bound " + std::to_string(bound);
      EXPECT_EQ(grid_x([&] {
                  backend->layernorm_forward(rows(0), mean, rstd, rows(1), weight, weight, nullptr);
                }).front(),
                forward_blocks)
          << "layernorm forward, " << where;
      EXPECT_EQ(grid_x([&] {
                  backend->rmsnorm_forward(rows(0), rstd, rows(1), weight, 1e-5f, nullptr);
                }).front(),
                forward_blocks)
          << "RMSNorm forward, " << where;
      EXPECT_EQ(grid_x([&] {
                  backend->layernorm_backward(rows(0), dweight, dbias, rows(1), rows(2), weight,
                                              mean, rstd, nullptr);
                }).front(),
                backward_blocks)
          << "layernorm backward, " << where;
      EXPECT_EQ(grid_x([&] {
                  backend->rmsnorm_backward(rows(0), dweight, rows(1), rows(2), weight, rstd,
                                            nullptr);
                }).front(),
                backward_blocks)
          << "RMSNorm backward, " << where;
    }
  }
  set_cuda_norm_block_rows_above(-1);
  backend->synchronize(nullptr);
  cudaFree(memory);
}

}  // namespace
}  // namespace dstrain
