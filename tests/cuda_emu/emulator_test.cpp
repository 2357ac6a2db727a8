// The CUDA emulator itself (kernels/cuda_emu/): the semantics the CUDA kernel tests rely on when
// they run without a GPU -- thread and block indices, shared memory per block, barriers, warp
// shuffles and votes, parameters copied per thread, launch limits -- and the errors it reports
// for kernels a GPU would hang on or answer with garbage.
#include <gtest/gtest.h>

#include <algorithm>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "kernels/cuda_emu/emu_device.h"

namespace {

// ---- kernels under test ----

// out[b] = sum of in[b * n .. b * n + n) through static shared memory and a tree over warps.
__global__ void block_sum_kernel(const float* in, float* out, int n) {
  __shared__ float warp_sums[32];
  float value = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) value += in[blockIdx.x * n + i];
  for (int offset = 16; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
  __syncthreads();
  if (threadIdx.x < 32) {
    float total = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1)
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (threadIdx.x == 0) out[blockIdx.x] = total;
  }
}

// Every shuffle flavour, one warp: out[4 * lane + k].
__global__ void shuffle_kernel(int* out) {
  const int lane = threadIdx.x;
  const int value = 100 + lane;
  out[4 * lane + 0] = __shfl_sync(0xffffffffu, value, 7);
  out[4 * lane + 1] = __shfl_xor_sync(0xffffffffu, value, 3);
  out[4 * lane + 2] = __shfl_down_sync(0xffffffffu, value, 2, 16);
  out[4 * lane + 3] = __shfl_up_sync(0xffffffffu, value, 1, 8);
}

__global__ void vote_kernel(unsigned* out) {
  const int lane = threadIdx.x % 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == 0);
  const int any = __any_sync(0xffffffffu, lane == 31);
  const int all = __all_sync(0xffffffffu, lane < 31);
  if (lane == 0) {
    out[3 * (threadIdx.x / 32) + 0] = ballot;
    out[3 * (threadIdx.x / 32) + 1] = static_cast<unsigned>(any);
    out[3 * (threadIdx.x / 32) + 2] = static_cast<unsigned>(all);
  }
}

// 2-D grid and block: each thread writes its flat coordinates.
__global__ void index_kernel(int* out) {
  const int x = blockIdx.x * blockDim.x + threadIdx.x;
  const int y = blockIdx.y * blockDim.y + threadIdx.y;
  const int width = gridDim.x * blockDim.x;
  out[y * width + x] = y * 1000 + x;
}

// Reverses a block's slice through dynamic shared memory (needs the barrier between write and
// read: lanes read what other warps wrote).
__global__ void reverse_kernel(const float* in, float* out) {
  DSTRAIN_DYNAMIC_SHARED(float, tile);
  const int i = threadIdx.x, n = blockDim.x;
  tile[i] = in[blockIdx.x * n + i];
  __syncthreads();
  out[blockIdx.x * n + i] = tile[n - 1 - i];
}

__global__ void read_shared_first_kernel(float* out) {
  DSTRAIN_DYNAMIC_SHARED(float, tile);
  out[threadIdx.x] = tile[threadIdx.x];
}

// Parameters are per thread: a thread that changes its copy changes nobody else's.
__global__ void parameter_copy_kernel(int* out, int base) {
  base += threadIdx.x;
  out[threadIdx.x] = base;
}

__global__ void count_kernel(unsigned* counter) { atomicAdd(counter, 1u); }

__global__ void noop_kernel(int) {}

// Half the warp waits at __syncwarp for lanes that wait at __syncthreads: a GPU hangs.
__global__ void deadlock_kernel() {
  if (threadIdx.x < 16) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}

// Lane 5 leaves before a full-mask shuffle: undefined on a GPU.
__global__ void exited_lane_shuffle_kernel(float* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// Lanes 16..31 exit while 0..15 wait for them in a full-mask shuffle.
__global__ void lane_exits_during_shuffle_kernel(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// out[i] = base + i
__global__ void iota_kernel(float* out, int n, float base) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = base + static_cast<float>(i);
}

// out[i] = 2 * in[i]
__global__ void double_kernel(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = 2.0f * in[i];
}

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = uniform(rng);
  return values;
}

TEST(CudaEmulator, BlockSumWithSharedMemoryAndShuffles) {
  for (int threads : {32, 96, 1024}) {
    const int blocks = 5, n = 777;
    const std::vector<float> in = random_floats(size_t(blocks) * n, 7);
    std::vector<float> out(blocks, NAN);
    DSTRAIN_LAUNCH(block_sum_kernel, blocks, threads, 0, nullptr)(in.data(), out.data(), n);
    cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    for (int b = 0; b < blocks; ++b) {
      double expected = 0.0;
      for (int i = 0; i < n; ++i) expected += in[size_t(b) * n + i];
      EXPECT_NEAR(out[b], expected, 1e-4) << "threads " << threads << " block " << b;
    }
  }
}

TEST(CudaEmulator, ShufflesFollowCudaLaneRules) {
  std::vector<int> out(128, -1);
  DSTRAIN_LAUNCH(shuffle_kernel, 1, 32, 0, nullptr)(out.data());
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  for (int lane = 0; lane < 32; ++lane) {
    EXPECT_EQ(out[4 * lane + 0], 107) << lane;
    EXPECT_EQ(out[4 * lane + 1], 100 + (lane ^ 3)) << lane;
    // down by 2 within segments of 16: the last 2 lanes of a segment keep their own value.
    const int down = (lane % 16) + 2 < 16 ? lane + 2 : lane;
    EXPECT_EQ(out[4 * lane + 2], 100 + down) << lane;
    // up by 1 within segments of 8: the first lane of a segment keeps its own value.
    const int up = lane % 8 == 0 ? lane : lane - 1;
    EXPECT_EQ(out[4 * lane + 3], 100 + up) << lane;
  }
}

TEST(CudaEmulator, VotesPerWarp) {
  std::vector<unsigned> out(6, 12345);
  DSTRAIN_LAUNCH(vote_kernel, 1, 64, 0, nullptr)(out.data());
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  unsigned expected_ballot = 0;
  for (int lane = 0; lane < 32; lane += 3) expected_ballot |= 1u << lane;
  for (int warp = 0; warp < 2; ++warp) {
    EXPECT_EQ(out[3 * warp + 0], expected_ballot);
    EXPECT_EQ(out[3 * warp + 1], 1u);
    EXPECT_EQ(out[3 * warp + 2], 0u);
  }
}

TEST(CudaEmulator, TwoDimensionalIndices) {
  const dim3 grid(3, 2), block(8, 4);
  const int width = 24, height = 8;
  std::vector<int> out(width * height, -1);
  DSTRAIN_LAUNCH(index_kernel, grid, block, 0, nullptr)(out.data());
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) EXPECT_EQ(out[y * width + x], y * 1000 + x);
  }
}

TEST(CudaEmulator, DynamicSharedMemoryIsPerBlockAndPoisoned) {
  const int blocks = 4, n = 256;
  const std::vector<float> in = random_floats(blocks * n, 3);
  std::vector<float> out(blocks * n, 0.0f);
  DSTRAIN_LAUNCH(reverse_kernel, blocks, n, n * sizeof(float), nullptr)(in.data(), out.data());
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    for (int i = 0; i < n; ++i) EXPECT_EQ(out[b * n + i], in[b * n + n - 1 - i]);
  }
  // Read before any write: the emulator's poison (NaN), never a previous block's data.
  std::vector<float> first(64, 0.0f);
  DSTRAIN_LAUNCH(read_shared_first_kernel, 1, 64, 64 * sizeof(float), nullptr)(first.data());
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  for (float v : first) EXPECT_TRUE(std::isnan(v));
}

TEST(CudaEmulator, ParametersAreCopiedPerThread) {
  std::vector<int> out(64, -1);
  DSTRAIN_LAUNCH(parameter_copy_kernel, 1, 64, 0, nullptr)(out.data(), 10);
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  for (int i = 0; i < 64; ++i) EXPECT_EQ(out[i], 10 + i);
}

TEST(CudaEmulator, HostThreadsLaunchConcurrently) {
  // Simulated ranks share the emulated GPU: each host thread runs its own blocks, with its own
  // shared memory; atomics are real atomics.
  unsigned counter = 0;
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const std::vector<float> in = random_floats(3 * 500, 100 + t);
      std::vector<float> out(3, NAN);
      for (int repeat = 0; repeat < 5; ++repeat) {
        DSTRAIN_LAUNCH(block_sum_kernel, 3, 128, 0, nullptr)(in.data(), out.data(), 500);
        cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
        DSTRAIN_LAUNCH(count_kernel, 2, 64, 0, nullptr)(&counter);
        cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
      }
      for (int b = 0; b < 3; ++b) {
        double expected = 0.0;
        for (int i = 0; i < 500; ++i) expected += in[b * 500 + i];
        results[t].push_back(std::fabs(out[b] - float(expected)));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(counter, 4u * 5u * 128u);
  for (const auto& errors : results) {
    for (float e : errors) EXPECT_LT(e, 1e-4f);
  }
}

TEST(CudaEmulator, InvalidLaunchConfigurationsSetTheLastError) {
  cudaGetLastError();
  DSTRAIN_LAUNCH(noop_kernel, 1, 2048, 0, nullptr)(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  DSTRAIN_LAUNCH(noop_kernel, dim3(1, 70000), 32, 0, nullptr)(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // read once, then cleared
}

TEST(CudaEmulator, SharedMemoryAboveDefaultNeedsOptInUpToTheSmallestReleaseGpu) {
  cudaGetLastError();
  std::vector<float> in(64, 1.0f), out(64, 0.0f);
  const size_t big = 64 * 1024;
  DSTRAIN_LAUNCH(reverse_kernel, 1, 64, big, nullptr)(in.data(), out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "64 KiB without the opt-in";
  ASSERT_EQ(cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(big)),
            cudaSuccess);
  DSTRAIN_LAUNCH(reverse_kernel, 1, 64, big, nullptr)(in.data(), out.data());
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // sm_86 / sm_89 allow 99 KiB per block: more fails, whatever the GPU of the day allows.
  EXPECT_NE(
      cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024),
      cudaSuccess);
  cudaGetLastError();
}

TEST(CudaEmulator, DeadlockIsReportedNotHung) {
  try {
    DSTRAIN_LAUNCH(deadlock_kernel, 1, 64, 0, nullptr)();
    cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
    FAIL() << "no error";
  } catch (const dstrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("deadlock_kernel"), std::string::npos) << e.what();
  }
  // The emulator is usable after the error.
  std::vector<int> out(64, -1);
  DSTRAIN_LAUNCH(parameter_copy_kernel, 1, 64, 0, nullptr)(out.data(), 0);
  cudaDeviceSynchronize();  // the kernel runs when its stream is waited for
  EXPECT_EQ(out[63], 63);
}

TEST(CudaEmulator, ShuffleWithAnExitedLaneIsAnError) {
  std::vector<float> out(32, 0.0f);
  // The error comes when the kernel runs: at the wait for its stream.
  EXPECT_THROW(
      {
        DSTRAIN_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, nullptr)(out.data());
        cudaDeviceSynchronize();
      },
      dstrain::Error);
  EXPECT_THROW(
      {
        DSTRAIN_LAUNCH(lane_exits_during_shuffle_kernel, 1, 32, 0, nullptr)(out.data());
        cudaDeviceSynchronize();
      },
      dstrain::Error);
}

TEST(CudaEmulator, IndicesOutsideAKernelAreAnError) {
  EXPECT_THROW((void)threadIdx.x, dstrain::Error);
}

TEST(CudaEmulator, DeviceMemoryIsCountedAndFreed) {
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
  size_t free_during = 0;
  cudaMemGetInfo(&free_during, &total);
  EXPECT_EQ(free_before - free_during, size_t{1} << 20);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_NE(cudaFree(p), cudaSuccess) << "a double free is reported";
  cudaGetLastError();
  EXPECT_EQ(cudaMalloc(&p, total + 1), cudaErrorMemoryAllocation);
  cudaGetLastError();
}

// ---- streams: lazy, with CUDA's ordering rules ----

// The tests of laziness itself: not with DSTRAIN_CUDA_EMU_STREAMS=eager (emu_streams.h).
#define REQUIRE_LAZY_STREAMS()                                                        \
  do {                                                                                \
    const char* mode = std::getenv("DSTRAIN_CUDA_EMU_STREAMS");                       \
    if (mode != nullptr && std::string(mode) == "eager") GTEST_SKIP() << "eager streams"; \
  } while (0)

// n floats of emulated device memory set to `value` (synchronously).
float* device_floats(int n, float value) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(float)), cudaSuccess);
  const std::vector<float> host(n, value);
  EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<float*>(p);
}

std::vector<float> to_host(const float* device, int n) {
  std::vector<float> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

TEST(CudaEmulatorStreams, AMissingWaitBetweenStreamsShowsUpAndAnEventWaitFixesIt) {
  REQUIRE_LAZY_STREAMS();
  const int n = 300;
  float* a = device_floats(n, -1.0f);
  float* b = device_floats(n, 0.0f);
  cudaStream_t producer, consumer;
  ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking), cudaSuccess);

  // No wait: the consumer may run first, and the emulator makes it (the latest legal schedule).
  DSTRAIN_LAUNCH(iota_kernel, 2, 64, 0, producer)(a, n, 1.0f);
  DSTRAIN_LAUNCH(double_kernel, 2, 64, 0, consumer)(a, b, n);
  ASSERT_EQ(cudaStreamSynchronize(consumer), cudaSuccess);
  EXPECT_EQ(to_host(b, n)[7], -2.0f) << "the consumer read a before the producer wrote it";
  ASSERT_EQ(cudaStreamSynchronize(producer), cudaSuccess);
  EXPECT_EQ(to_host(a, n)[7], 8.0f);

  // With an event between them, the consumer sees the producer's data.
  cudaEvent_t written;
  ASSERT_EQ(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), cudaSuccess);
  DSTRAIN_LAUNCH(iota_kernel, 2, 64, 0, producer)(a, n, 10.0f);
  ASSERT_EQ(cudaEventRecord(written, producer), cudaSuccess);
  DSTRAIN_LAUNCH(double_kernel, 2, 64, 0, consumer)(a, b, n);  // before the wait: still stale
  ASSERT_EQ(cudaStreamWaitEvent(consumer, written, 0), cudaSuccess);
  DSTRAIN_LAUNCH(double_kernel, 2, 64, 0, consumer)(a, b, n);
  ASSERT_EQ(cudaStreamSynchronize(consumer), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(written), cudaSuccess) << "the consumer's wait ran the producer";
  const std::vector<float> doubled = to_host(b, n);
  for (int i = 0; i < n; ++i) ASSERT_EQ(doubled[i], 2.0f * (10.0f + i)) << i;

  cudaEventDestroy(written);
  cudaStreamDestroy(producer);
  cudaStreamDestroy(consumer);
  cudaFree(a);
  cudaFree(b);
}

// Events are stamped in model time (emu_streams.h): two streams with no order between them
// overlap, as on a GPU, though the host runs their kernels one after the other; an event wait
// makes the second start after the first.
TEST(CudaEmulatorStreams, EventsTimeStreamsAsRunningAtOnceUnlessAnEventOrdersThem) {
  REQUIRE_LAZY_STREAMS();  // eager streams run each kernel as it is issued
  const int n = 1 << 16;  // long enough to take milliseconds on the host
  float* a = device_floats(n, 1.0f);
  float* b = device_floats(n, 2.0f);
  cudaStream_t first, second;
  ASSERT_EQ(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t begin1, end1, begin2, end2;
  for (cudaEvent_t* e : {&begin1, &end1, &begin2, &end2}) ASSERT_EQ(cudaEventCreate(e), cudaSuccess);
  auto elapsed = [](cudaEvent_t from, cudaEvent_t to) {
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, from, to), cudaSuccess);
    return ms;
  };
  for (bool ordered : {false, true}) {
    ASSERT_EQ(cudaEventRecord(begin1, first), cudaSuccess);
    DSTRAIN_LAUNCH(iota_kernel, 4, 64, 0, first)(a, n, 1.0f);
    ASSERT_EQ(cudaEventRecord(end1, first), cudaSuccess);
    if (ordered) ASSERT_EQ(cudaStreamWaitEvent(second, end1, 0), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(begin2, second), cudaSuccess);
    DSTRAIN_LAUNCH(iota_kernel, 4, 64, 0, second)(b, n, 2.0f);
    ASSERT_EQ(cudaEventRecord(end2, second), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const float one = elapsed(begin1, end1), two = elapsed(begin2, end2);
    const float both = std::max(elapsed(begin1, end2), elapsed(begin1, end1));
    ASSERT_GT(one, 0.0f);
    ASSERT_GT(two, 0.0f);
    if (ordered) {
      EXPECT_GE(elapsed(end1, begin2), 0.0f) << "the second stream started before the event";
      EXPECT_GE(both, one + two - 1e-3f);
    } else {
      // Both issued at once (within the host's launch time): they overlap.
      EXPECT_LT(elapsed(begin1, begin2), one) << "the second kernel waited for the first";
      EXPECT_LT(both, one + two);
    }
  }
  for (cudaEvent_t e : {begin1, end1, begin2, end2}) cudaEventDestroy(e);
  cudaStreamDestroy(first);
  cudaStreamDestroy(second);
  cudaFree(a);
  cudaFree(b);
}

TEST(CudaEmulatorStreams, TheLegacyStreamWaitsForBlockingStreamsOnly) {
  REQUIRE_LAZY_STREAMS();
  const int n = 64;
  float* a = device_floats(n, -1.0f);
  float* b = device_floats(n, 0.0f);
  cudaStream_t blocking, non_blocking;
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&non_blocking, cudaStreamNonBlocking), cudaSuccess);

  DSTRAIN_LAUNCH(iota_kernel, 1, 64, 0, blocking)(a, n, 1.0f);
  DSTRAIN_LAUNCH(double_kernel, 1, 64, 0, nullptr)(a, b, n);  // legacy: after `blocking`
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(to_host(b, n)[3], 8.0f);

  DSTRAIN_LAUNCH(iota_kernel, 1, 64, 0, non_blocking)(a, n, 100.0f);
  DSTRAIN_LAUNCH(double_kernel, 1, 64, 0, nullptr)(a, b, n);  // not ordered with it
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(to_host(b, n)[3], 8.0f) << "the legacy stream waited for a non-blocking stream";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(to_host(a, n)[3], 103.0f);

  cudaStreamDestroy(blocking);
  cudaStreamDestroy(non_blocking);
  cudaFree(a);
  cudaFree(b);
}

TEST(CudaEmulatorStreams, CopiesFollowTheRuntimesRulesForPinnedAndPageableMemory) {
  REQUIRE_LAZY_STREAMS();
  const int n = 32;
  float* device = device_floats(n, 5.0f);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const size_t bytes = n * sizeof(float);

  // Into pinned memory: asynchronous, landed only once the stream is waited for.
  float* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), bytes, cudaHostAllocDefault),
            cudaSuccess);
  for (int i = 0; i < n; ++i) pinned[i] = 0.0f;
  ASSERT_EQ(cudaMemcpyAsync(pinned, device, bytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  EXPECT_EQ(pinned[0], 0.0f) << "read before the wait: not landed yet";
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(pinned[0], 5.0f);

  // Into pageable memory: the call returns once the copy has landed.
  std::vector<float> pageable(n, 0.0f);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), device, bytes, cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  EXPECT_EQ(pageable[0], 5.0f);

  // From pageable memory: the source is read during the call, so it may change right after.
  std::vector<float> source(n, 7.0f);
  ASSERT_EQ(cudaMemcpyAsync(device, source.data(), bytes, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  source.assign(n, -7.0f);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(to_host(device, n)[0], 7.0f);

  // From pinned memory: read when the copy runs.
  for (int i = 0; i < n; ++i) pinned[i] = 9.0f;
  ASSERT_EQ(cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, stream), cudaSuccess);
  for (int i = 0; i < n; ++i) pinned[i] = 11.0f;  // a race on a GPU; the emulator runs it late
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(to_host(device, n)[0], 11.0f);

  cudaFreeHost(pinned);
  cudaStreamDestroy(stream);
  cudaFree(device);
}

TEST(CudaEmulatorStreams, GatedWorkWaitsForItsConditionAndQueriesDoNotBlock) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::atomic<bool> open{false};
  std::atomic<int> ran{0};
  dstrain::emu::enqueue(stream, [&] { ran = 1; }, [&] { return open.load(); });
  cudaEvent_t after;
  ASSERT_EQ(cudaEventCreate(&after), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(after, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady);
  EXPECT_EQ(cudaEventQuery(after), cudaErrorNotReady);
  EXPECT_EQ(ran.load(), 0);
  // Another thread opens the gate while this one waits for the stream.
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    open = true;
    dstrain::emu::notify_progress();
  });
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  opener.join();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_EQ(cudaEventQuery(after), cudaSuccess);
  cudaEventDestroy(after);
  cudaStreamDestroy(stream);
}

}  // namespace
