// The CUDA emulator's NCCL (kernels/cuda_emu/emu_nccl.cpp): every collective in every reduced
// dtype against a reference written here from the contract (fixed rank order, fp32, one
// rounding), in-place forms, splits, grouped point to point, non-blocking initialization,
// aborts, argument errors, and stream order (an output is written only when its stream gets
// there). Most tests drive several communicators from one thread, as NCCL allows inside
// ncclGroupStart/End; the communicator tests (tests/comm/nccl_test.cpp) use a thread per rank.
#include <gtest/gtest.h>

#ifdef DSTRAIN_WITH_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"

namespace {

using Bytes = std::vector<uint8_t>;

int emulated_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

#define REQUIRE_GPUS(n)                                                                     \
  do {                                                                                      \
    if (emulated_gpus() < (n))                                                              \
      GTEST_SKIP() << "needs " << (n) << " emulated GPUs (DSTRAIN_CUDA_EMU_DEVICES=" << (n) \
                   << ", as ctest sets)";                                                   \
  } while (0)

size_t type_size(ncclDataType_t type) {
  return type == ncclFloat16 || type == ncclBfloat16 ? 2 : 4;
}
const char* type_label(ncclDataType_t type) {
  switch (type) {
    case ncclFloat16:
      return "f16";
    case ncclBfloat16:
      return "bf16";
    case ncclInt32:
      return "i32";
    default:
      return "f32";
  }
}

// Element i of `bytes` as a float (the exact integer for ncclInt32), and back (rounded to
// nearest even by core/dtype.h, not by the CUDA conversions the emulator uses).
float get(const Bytes& bytes, ncclDataType_t type, size_t i) {
  const uint8_t* p = bytes.data() + i * type_size(type);
  uint16_t half;
  std::memcpy(&half, p, 2);
  switch (type) {
    case ncclFloat16:
      return dstrain::fp16_bits_to_fp32(half);
    case ncclBfloat16:
      return dstrain::bf16_bits_to_fp32(half);
    case ncclInt32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return static_cast<float>(v);
    }
    default: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
  }
}
void set(Bytes& bytes, ncclDataType_t type, size_t i, float value) {
  uint8_t* p = bytes.data() + i * type_size(type);
  uint16_t half = 0;
  if (type == ncclFloat16) half = dstrain::fp32_to_fp16_bits(value);
  if (type == ncclBfloat16) half = dstrain::fp32_to_bf16_bits(value);
  if (type == ncclFloat16 || type == ncclBfloat16) {
    std::memcpy(p, &half, 2);
  } else if (type == ncclInt32) {
    const int32_t v = static_cast<int32_t>(value);
    std::memcpy(p, &v, 4);
  } else {
    std::memcpy(p, &value, 4);
  }
}

// Random non-zero data: floats in [-1, 1) * (1 + rank) rounded to the type, integers in
// [-1000, 1000]; with `nan`, element 3 of rank 1 is NaN (float types).
Bytes random_data(ncclDataType_t type, size_t count, int rank, uint32_t seed, bool nan = false) {
  std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(rank));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> integer(-1000, 1000);
  Bytes bytes(count * type_size(type));
  for (size_t i = 0; i < count; ++i) {
    set(bytes, type, i,
        type == ncclInt32 ? static_cast<float>(integer(rng)) : unit(rng) * (1.0f + rank));
  }
  if (nan && type != ncclInt32 && rank == 1 && count > 3) set(bytes, type, 3, std::nanf(""));
  return bytes;
}

// The contract: out[i] = in0[first + i] op in1[first + i] op ..., left to right in fp32 (int32
// with wrap-around for ncclInt32), NaN-propagating max, rounded once.
Bytes reference_reduce(const std::vector<Bytes>& inputs, size_t first, size_t count,
                       ncclDataType_t type, ncclRedOp_t op) {
  Bytes out(count * type_size(type));
  for (size_t i = 0; i < count; ++i) {
    if (type == ncclInt32) {
      uint32_t acc = static_cast<uint32_t>(static_cast<int32_t>(get(inputs[0], type, first + i)));
      for (size_t r = 1; r < inputs.size(); ++r) {
        const int32_t v = static_cast<int32_t>(get(inputs[r], type, first + i));
        acc = op == ncclSum ? acc + static_cast<uint32_t>(v)
                            : static_cast<uint32_t>(std::max(static_cast<int32_t>(acc), v));
      }
      const int32_t value = static_cast<int32_t>(acc);
      std::memcpy(out.data() + 4 * i, &value, 4);
      continue;
    }
    float acc = get(inputs[0], type, first + i);
    for (size_t r = 1; r < inputs.size(); ++r) {
      const float v = get(inputs[r], type, first + i);
      acc = op == ncclSum ? acc + v : (std::isnan(acc) || std::isnan(v)) ? NAN : std::max(acc, v);
    }
    set(out, type, i, acc);
  }
  return out;
}

// Equal bits, or both NaN.
void expect_same(const Bytes& got, const Bytes& want, ncclDataType_t type,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size() / type_size(type); ++i) {
    const float g = get(got, type, i), w = get(want, type, i);
    if (type != ncclInt32 && std::isnan(w)) {
      ASSERT_TRUE(std::isnan(g)) << what << " [" << i << "]: " << g << ", want NaN";
      continue;
    }
    ASSERT_EQ(std::memcmp(got.data() + i * type_size(type), want.data() + i * type_size(type),
                          type_size(type)),
              0)
        << what << " [" << i << "]: " << g << ", want " << w;
  }
}

// Device memory of one GPU with guard regions on both sides (inside the allocation, so the
// emulator's bounds check cannot see an overrun: the guards must).
class DeviceBuffer {
 public:
  static constexpr size_t kGuard = 256;
  static constexpr uint8_t kSentinel = 0xA7;

  DeviceBuffer(int device, size_t bytes) : bytes_(bytes) {
    cudaSetDevice(device);
    EXPECT_EQ(cudaMalloc(&base_, bytes + 2 * kGuard), cudaSuccess);
    upload(Bytes(bytes, 0));
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  uint8_t* data() const { return static_cast<uint8_t*>(base_) + kGuard; }
  void upload(const Bytes& bytes) {
    Bytes image(bytes_ + 2 * kGuard, kSentinel);
    std::memcpy(image.data() + kGuard, bytes.data(), bytes_);
    EXPECT_EQ(cudaMemcpy(base_, image.data(), image.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  Bytes download(size_t offset = 0, size_t bytes = SIZE_MAX) const {
    const Bytes image = whole();
    const size_t n = std::min(bytes, bytes_ - offset);
    return Bytes(image.begin() + kGuard + offset, image.begin() + kGuard + offset + n);
  }
  bool guards_intact() const {
    const Bytes image = whole();
    for (size_t i = 0; i < kGuard; ++i) {
      if (image[i] != kSentinel || image[image.size() - 1 - i] != kSentinel) return false;
    }
    return true;
  }

 private:
  Bytes whole() const {
    Bytes image(bytes_ + 2 * kGuard);
    EXPECT_EQ(cudaMemcpy(image.data(), base_, image.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return image;
  }
  void* base_ = nullptr;
  size_t bytes_;
};

// `n` communicators driven from this thread, rank r on GPU r with a non-blocking stream of its
// own: initialized together in a group (NCCL's single-thread form).
struct Ranks {
  explicit Ranks(int n) : comms(n), streams(n) {
    ncclUniqueId id;
    EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    EXPECT_EQ(ncclGroupStart(), ncclSuccess);
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(r);
      EXPECT_EQ(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), cudaSuccess);
      EXPECT_EQ(ncclCommInitRank(&comms[r], n, id, r), ncclSuccess);
    }
    EXPECT_EQ(ncclGroupEnd(), ncclSuccess) << ncclGetLastError(nullptr);
  }
  ~Ranks() {
    for (size_t r = 0; r < comms.size(); ++r) {
      cudaStreamSynchronize(streams[r]);
      cudaStreamDestroy(streams[r]);
      if (comms[r] != nullptr) ncclCommDestroy(comms[r]);
    }
  }
  void synchronize() {
    for (cudaStream_t s : streams) ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  }
  int size() const { return static_cast<int>(comms.size()); }
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;
};

ncclResult_t async_error(ncclComm_t comm) {
  ncclResult_t state = ncclInternalError;
  EXPECT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  return state;
}

constexpr ncclDataType_t kTypes[] = {ncclFloat32, ncclFloat16, ncclBfloat16, ncclInt32};

// ---- collectives against the reference ----

TEST(NcclEmulator, AllReduceAndReduceScatterMatchTheRankOrderReference) {
  REQUIRE_GPUS(4);
  for (const int ranks : {3, 4}) {
    Ranks world(ranks);
    for (const size_t n : {size_t{1024}, size_t{1001}}) {  // per-rank block, round and odd
      for (ncclDataType_t type : kTypes) {
        for (ncclRedOp_t op : {ncclSum, ncclMax}) {
          const std::string what = std::string("all_reduce/reduce_scatter ") + type_label(type) +
                                   (op == ncclSum ? "_sum_" : "_max_") + std::to_string(ranks) +
                                   "ranks_n" + std::to_string(n);
          SCOPED_TRACE(what);
          const size_t bytes = n * type_size(type);
          std::vector<Bytes> inputs;
          std::vector<std::unique_ptr<DeviceBuffer>> reduced, scattered, sources;
          for (int r = 0; r < ranks; ++r) {
            inputs.push_back(random_data(type, n * ranks, r, 17, /*nan=*/op == ncclMax));
            sources.push_back(std::make_unique<DeviceBuffer>(r, bytes * ranks));
            sources[r]->upload(inputs[r]);
            reduced.push_back(std::make_unique<DeviceBuffer>(r, bytes * ranks));
            scattered.push_back(std::make_unique<DeviceBuffer>(r, bytes));
          }
          ASSERT_EQ(ncclGroupStart(), ncclSuccess);
          for (int r = 0; r < ranks; ++r) {
            ASSERT_EQ(ncclAllReduce(sources[r]->data(), reduced[r]->data(), n * ranks, type, op,
                                    world.comms[r], world.streams[r]),
                      ncclSuccess);
            ASSERT_EQ(ncclReduceScatter(sources[r]->data(), scattered[r]->data(), n, type, op,
                                        world.comms[r], world.streams[r]),
                      ncclSuccess);
          }
          ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
          world.synchronize();
          const Bytes want = reference_reduce(inputs, 0, n * ranks, type, op);
          bool any_nonzero = false;
          for (uint8_t b : want) any_nonzero |= b != 0;
          ASSERT_TRUE(any_nonzero) << "the reference is all zero";
          for (int r = 0; r < ranks; ++r) {
            expect_same(reduced[r]->download(), want, type, "all_reduce rank " + std::to_string(r));
            expect_same(scattered[r]->download(),
                        Bytes(want.begin() + r * bytes, want.begin() + (r + 1) * bytes), type,
                        "reduce_scatter rank " + std::to_string(r));
            EXPECT_TRUE(reduced[r]->guards_intact() && scattered[r]->guards_intact());
            EXPECT_EQ(sources[r]->download(), inputs[r]) << "the send buffer was written";
          }
        }
      }
    }
  }
}

TEST(NcclEmulator, AllGatherAndBroadcastCopyEveryByte) {
  REQUIRE_GPUS(3);
  const int ranks = 3;
  Ranks world(ranks);
  for (ncclDataType_t type : kTypes) {
    SCOPED_TRACE(type_label(type));
    const size_t n = 1001, bytes = n * type_size(type);
    std::vector<Bytes> inputs;
    std::vector<std::unique_ptr<DeviceBuffer>> sources, gathered, broadcast;
    for (int r = 0; r < ranks; ++r) {
      inputs.push_back(random_data(type, n, r, 23));
      sources.push_back(std::make_unique<DeviceBuffer>(r, bytes));
      sources[r]->upload(inputs[r]);
      gathered.push_back(std::make_unique<DeviceBuffer>(r, bytes * ranks));
      broadcast.push_back(std::make_unique<DeviceBuffer>(r, bytes));
    }
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    for (int r = 0; r < ranks; ++r) {
      ASSERT_EQ(ncclAllGather(sources[r]->data(), gathered[r]->data(), n, type, world.comms[r],
                              world.streams[r]),
                ncclSuccess);
      // Root 2: the other ranks' send buffers are not read.
      ASSERT_EQ(ncclBroadcast(r == 2 ? sources[r]->data() : nullptr, broadcast[r]->data(), n, type,
                              2, world.comms[r], world.streams[r]),
                ncclSuccess);
    }
    ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
    world.synchronize();
    for (int r = 0; r < ranks; ++r) {
      for (int s = 0; s < ranks; ++s) {
        EXPECT_EQ(gathered[r]->download(s * bytes, bytes), inputs[s])
            << "rank " << r << " block " << s;
      }
      EXPECT_EQ(broadcast[r]->download(), inputs[2]) << "rank " << r;
      EXPECT_TRUE(gathered[r]->guards_intact() && broadcast[r]->guards_intact());
    }
  }
}

TEST(NcclEmulator, InPlaceFormsReadTheirInputBeforeAnyRankWrites) {
  REQUIRE_GPUS(4);
  const int ranks = 4;
  const ncclDataType_t type = ncclFloat32;
  const size_t n = 513, bytes = n * 4;
  Ranks world(ranks);
  std::vector<Bytes> inputs;
  std::vector<std::unique_ptr<DeviceBuffer>> reduced, gathered, scattered, broadcast;
  for (int r = 0; r < ranks; ++r) {
    inputs.push_back(random_data(type, n * ranks, r, 29));
    reduced.push_back(std::make_unique<DeviceBuffer>(r, bytes * ranks));
    reduced[r]->upload(inputs[r]);
    scattered.push_back(std::make_unique<DeviceBuffer>(r, bytes * ranks));
    scattered[r]->upload(inputs[r]);
    gathered.push_back(std::make_unique<DeviceBuffer>(r, bytes * ranks));
    gathered[r]->upload(inputs[r]);  // its own block is the send buffer
    broadcast.push_back(std::make_unique<DeviceBuffer>(r, bytes));
    broadcast[r]->upload(Bytes(inputs[r].begin(), inputs[r].begin() + bytes));
  }
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < ranks; ++r) {
    uint8_t* own_block_g = gathered[r]->data() + r * bytes;
    uint8_t* own_block_s = scattered[r]->data() + r * bytes;
    ASSERT_EQ(ncclAllReduce(reduced[r]->data(), reduced[r]->data(), n * ranks, type, ncclSum,
                            world.comms[r], world.streams[r]),
              ncclSuccess);
    ASSERT_EQ(
        ncclAllGather(own_block_g, gathered[r]->data(), n, type, world.comms[r], world.streams[r]),
        ncclSuccess);
    ASSERT_EQ(ncclReduceScatter(scattered[r]->data(), own_block_s, n, type, ncclSum, world.comms[r],
                                world.streams[r]),
              ncclSuccess);
    ASSERT_EQ(ncclBroadcast(broadcast[r]->data(), broadcast[r]->data(), n, type, 1, world.comms[r],
                            world.streams[r]),
              ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  world.synchronize();
  const Bytes sum = reference_reduce(inputs, 0, n * ranks, type, ncclSum);
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_same(reduced[r]->download(), sum, type, "all_reduce in place");
    for (int s = 0; s < ranks; ++s) {
      EXPECT_EQ(gathered[r]->download(s * bytes, bytes),
                Bytes(inputs[s].begin() + s * bytes, inputs[s].begin() + (s + 1) * bytes))
          << "all_gather in place, block " << s;
    }
    expect_same(scattered[r]->download(r * bytes, bytes),
                Bytes(sum.begin() + r * bytes, sum.begin() + (r + 1) * bytes), type,
                "reduce_scatter in place");
    EXPECT_EQ(broadcast[r]->download(), Bytes(inputs[1].begin(), inputs[1].begin() + bytes));
  }
}

// ---- stream order ----

TEST(NcclEmulator, OutputIsWrittenOnlyWhenTheStreamGetsThere) {
  REQUIRE_GPUS(2);
  Ranks world(2);
  const size_t n = 64;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<Bytes> inputs;
  for (int r = 0; r < 2; ++r) {
    inputs.push_back(random_data(ncclFloat32, n, r, 31));
    buffers.push_back(std::make_unique<DeviceBuffer>(r, n * 4));
    buffers[r]->upload(inputs[r]);
  }
  for (int r = 0; r < 2; ++r) {  // separate threads' calls, made from one: no group needed
    ASSERT_EQ(ncclAllReduce(buffers[r]->data(), buffers[r]->data(), n, ncclFloat32, ncclSum,
                            world.comms[r], world.streams[r]),
              ncclSuccess);
  }
  // Issued, not run: the streams have not been waited for.
  for (int r = 0; r < 2; ++r) EXPECT_EQ(buffers[r]->download(), inputs[r]) << "rank " << r;
  world.synchronize();
  const Bytes want = reference_reduce(inputs, 0, n, ncclFloat32, ncclSum);
  for (int r = 0; r < 2; ++r) expect_same(buffers[r]->download(), want, ncclFloat32, "after");
}

// ---- communicators ----

TEST(NcclEmulator, SplitGroupsByColorRanksByKeyThenOldRankAndNoColorGetsNull) {
  REQUIRE_GPUS(4);
  Ranks world(4);
  // Old rank: color, key. Color 0: ranks 0 (key 5), 2 (key 1), 3 (key 1) -> order 2, 3, 0.
  const int colors[] = {0, NCCL_SPLIT_NOCOLOR, 0, 0};
  const int keys[] = {5, 0, 1, 1};
  std::vector<ncclComm_t> split(4, nullptr);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(ncclCommSplit(world.comms[r], colors[r], keys[r], &split[r], nullptr), ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess) << ncclGetLastError(nullptr);
  EXPECT_EQ(split[1], nullptr);
  const int want_rank[] = {2, -1, 0, 1};
  for (int r : {0, 2, 3}) {
    ASSERT_NE(split[r], nullptr);
    int size = 0, rank = -1;
    ASSERT_EQ(ncclCommCount(split[r], &size), ncclSuccess);
    ASSERT_EQ(ncclCommUserRank(split[r], &rank), ncclSuccess);
    EXPECT_EQ(size, 3);
    EXPECT_EQ(rank, want_rank[r]) << "old rank " << r;
  }
  // The split communicates among its own ranks: a sum of new ranks.
  std::vector<std::unique_ptr<DeviceBuffer>> values(4);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r : {0, 2, 3}) {
    values[r] = std::make_unique<DeviceBuffer>(r, 4);
    const int32_t mine = want_rank[r] + 1;
    Bytes bytes(4);
    std::memcpy(bytes.data(), &mine, 4);
    values[r]->upload(bytes);
    ASSERT_EQ(ncclAllReduce(values[r]->data(), values[r]->data(), 1, ncclInt32, ncclSum, split[r],
                            world.streams[r]),
              ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  world.synchronize();
  for (int r : {0, 2, 3}) {
    int32_t total = 0;
    std::memcpy(&total, values[r]->download().data(), 4);
    EXPECT_EQ(total, 1 + 2 + 3);
    EXPECT_EQ(ncclCommDestroy(split[r]), ncclSuccess);
  }
}

TEST(NcclEmulator, NonBlockingInitIsInProgressUntilEveryRankHasJoined) {
  REQUIRE_GPUS(2);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comms[2] = {nullptr, nullptr};
  cudaSetDevice(0);
  const ncclResult_t started = ncclCommInitRankConfig(&comms[0], 2, id, 0, &config);
  EXPECT_TRUE(started == ncclInProgress || started == ncclSuccess) << started;
  ASSERT_NE(comms[0], nullptr);
  EXPECT_EQ(async_error(comms[0]), ncclInProgress);
  int size = 0;
  EXPECT_EQ(ncclCommCount(comms[0], &size), ncclInvalidArgument) << "used before it is ready";
  DeviceBuffer value(0, 4);
  EXPECT_EQ(ncclAllReduce(value.data(), value.data(), 1, ncclFloat32, ncclSum, comms[0], nullptr),
            ncclInvalidArgument);
  EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("before"), std::string::npos)
      << ncclGetLastError(nullptr);
  EXPECT_EQ(async_error(comms[0]), ncclInProgress) << "still: rank 1 has not joined";
  cudaSetDevice(1);
  ASSERT_EQ(ncclCommInitRankConfig(&comms[1], 2, id, 1, &config), ncclSuccess);
  for (ncclComm_t comm : comms) {
    EXPECT_EQ(async_error(comm), ncclSuccess);
    EXPECT_EQ(ncclCommCount(comm, &size), ncclSuccess);
    EXPECT_EQ(size, 2);
    EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
  }
}

TEST(NcclEmulator, BlockingInitWaitsForEveryRank) {
  REQUIRE_GPUS(2);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comms[2] = {nullptr, nullptr};
  std::atomic<bool> rank0_returned{false};
  ncclResult_t rank0_result = ncclInternalError;
  std::thread rank0([&] {
    cudaSetDevice(0);
    rank0_result = ncclCommInitRank(&comms[0], 2, id, 0);
    rank0_returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(rank0_returned.load()) << "returned before rank 1 joined";
  cudaSetDevice(1);
  EXPECT_EQ(ncclCommInitRank(&comms[1], 2, id, 1), ncclSuccess);
  rank0.join();
  EXPECT_EQ(rank0_result, ncclSuccess);
  for (ncclComm_t comm : comms) EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
}

TEST(NcclEmulator, TwoRanksOnOneDeviceAreInvalidUsage) {
  REQUIRE_GPUS(1);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comms[2] = {nullptr, nullptr};
  cudaSetDevice(0);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(ncclCommInitRank(&comms[r], 2, id, r), ncclSuccess);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);
  EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("duplicate GPU"), std::string::npos)
      << ncclGetLastError(nullptr);
  for (ncclComm_t comm : comms) {
    EXPECT_EQ(async_error(comm), ncclInvalidUsage);
    EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
  }
}

TEST(NcclEmulator, FinalizeFlushesTheQueuedWork) {
  REQUIRE_GPUS(2);
  Ranks world(2);
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<Bytes> inputs;
  for (int r = 0; r < 2; ++r) {
    inputs.push_back(random_data(ncclBfloat16, 100, r, 37));
    buffers.push_back(std::make_unique<DeviceBuffer>(r, 200));
    buffers[r]->upload(inputs[r]);
    ASSERT_EQ(ncclAllReduce(buffers[r]->data(), buffers[r]->data(), 100, ncclBfloat16, ncclMax,
                            world.comms[r], world.streams[r]),
              ncclSuccess);
  }
  // Blocking communicators: ncclCommFinalize returns once the work has run.
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ncclCommFinalize(world.comms[r]), ncclSuccess);
    EXPECT_EQ(async_error(world.comms[r]), ncclSuccess);
  }
  const Bytes want = reference_reduce(inputs, 0, 100, ncclBfloat16, ncclMax);
  for (int r = 0; r < 2; ++r) expect_same(buffers[r]->download(), want, ncclBfloat16, "max");
}

// ---- point to point ----

TEST(NcclEmulator, GroupedSendRecvRingCompletesAndUngroupedDeadlocksLikeNccl) {
  REQUIRE_GPUS(4);
  const int ranks = 4;
  Ranks world(ranks);
  const size_t n = 300;
  std::vector<Bytes> inputs;
  std::vector<std::unique_ptr<DeviceBuffer>> sent, received;
  for (int r = 0; r < ranks; ++r) {
    inputs.push_back(random_data(ncclFloat16, n, r, 41));
    sent.push_back(std::make_unique<DeviceBuffer>(r, n * 2));
    sent[r]->upload(inputs[r]);
    received.push_back(std::make_unique<DeviceBuffer>(r, n * 2));
  }
  // Grouped: every rank sends to the next and receives from the previous.
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(ncclSend(sent[r]->data(), n, ncclFloat16, (r + 1) % ranks, world.comms[r],
                       world.streams[r]),
              ncclSuccess);
    ASSERT_EQ(ncclRecv(received[r]->data(), n, ncclFloat16, (r + ranks - 1) % ranks, world.comms[r],
                       world.streams[r]),
              ncclSuccess);
  }
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  world.synchronize();
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(received[r]->download(), inputs[(r + ranks - 1) % ranks]) << "rank " << r;
    EXPECT_TRUE(received[r]->guards_intact());
  }

  // Not grouped: every send waits for a receive queued behind it (NCCL: "blocking for the
  // GPU"), so no stream completes -- until a rank aborts and releases the others.
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(ncclSend(sent[r]->data(), n, ncclFloat16, (r + 1) % ranks, world.comms[r],
                       world.streams[r]),
              ncclSuccess);
  }
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(ncclRecv(received[r]->data(), n, ncclFloat16, (r + ranks - 1) % ranks, world.comms[r],
                       world.streams[r]),
              ncclSuccess);
  }
  for (int poll = 0; poll < 3; ++poll) {
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(cudaStreamQuery(world.streams[r]), cudaErrorNotReady);
  }
  ASSERT_EQ(ncclCommAbort(world.comms[0]), ncclSuccess);
  world.comms[0] = nullptr;
  world.synchronize();
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(async_error(world.comms[r]), ncclRemoteError);
}

TEST(NcclEmulator, AbortReleasesAPeerWaitingOnItsStream) {
  REQUIRE_GPUS(2);
  Ranks world(2);
  DeviceBuffer value(1, 4 * 8);
  const Bytes before = random_data(ncclFloat32, 8, 1, 43);
  value.upload(before);
  std::atomic<bool> returned{false};
  cudaError_t synchronized = cudaErrorUnknown;
  std::thread rank1([&] {
    cudaSetDevice(1);
    EXPECT_EQ(ncclAllReduce(value.data(), value.data(), 8, ncclFloat32, ncclSum, world.comms[1],
                            world.streams[1]),
              ncclSuccess);
    synchronized = cudaStreamSynchronize(world.streams[1]);  // rank 0 never joins
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(returned.load()) << "the all-reduce completed without rank 0";
  ASSERT_EQ(ncclCommAbort(world.comms[0]), ncclSuccess);
  world.comms[0] = nullptr;
  rank1.join();
  EXPECT_EQ(synchronized, cudaSuccess);
  EXPECT_EQ(async_error(world.comms[1]), ncclRemoteError);
  EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("ncclCommAbort"), std::string::npos)
      << ncclGetLastError(nullptr);
  EXPECT_EQ(value.download(), before) << "an aborted all-reduce wrote its output";
}

// ---- errors ----

TEST(NcclEmulator, InvalidArgumentsAreRejectedWithASentence) {
  REQUIRE_GPUS(2);
  Ranks world(2);
  DeviceBuffer buffer(0, 64);
  ncclComm_t comm = world.comms[0];
  cudaStream_t stream = world.streams[0];
  const auto expect_invalid = [](ncclResult_t result, const char* fragment) {
    EXPECT_EQ(result, ncclInvalidArgument) << fragment;
    EXPECT_NE(std::string(ncclGetLastError(nullptr)).find(fragment), std::string::npos)
        << ncclGetLastError(nullptr);
  };
  uint8_t* data = buffer.data();
  expect_invalid(ncclAllReduce(data, data, 4, ncclFloat32, ncclSum, nullptr, stream),
                 "not a communicator");
  expect_invalid(ncclAllReduce(data, data, 4, ncclNumTypes, ncclSum, comm, stream), "data type");
  expect_invalid(ncclAllReduce(data, data, 4, ncclFloat32, ncclNumOps, comm, stream),
                 "reduction operation");
  expect_invalid(ncclAllReduce(data, data, 4, ncclFloat32, ncclProd, comm, stream),
                 "emulator reduces only");
  expect_invalid(ncclAllReduce(data, data, 4, ncclFloat64, ncclSum, comm, stream),
                 "emulator reduces only");
  expect_invalid(ncclAllReduce(data, data, 100, ncclFloat32, ncclSum, comm, stream),
                 "past the end");  // beyond the guards too: out of the allocation
  std::vector<float> host(4);
  expect_invalid(ncclAllReduce(host.data(), host.data(), 4, ncclFloat32, ncclSum, comm, stream),
                 "not device memory");
  DeviceBuffer other_device(1, 64);
  expect_invalid(ncclAllGather(other_device.data(), data, 2, ncclFloat32, comm, stream),
                 "on device 1");
  expect_invalid(ncclBroadcast(data, data, 4, ncclFloat32, 2, comm, stream), "invalid root");
  expect_invalid(ncclSend(data, 4, ncclFloat32, -1, comm, stream), "invalid peer");
  expect_invalid(ncclRecv(data, 4, ncclFloat32, 2, comm, stream), "invalid peer");
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage) << "no group to end";
  EXPECT_EQ(async_error(comm), ncclSuccess) << "rejected calls leave the communicator usable";
  int version = 0;
  EXPECT_EQ(ncclGetVersion(&version), ncclSuccess);
  EXPECT_EQ(version, NCCL_VERSION_CODE);
  EXPECT_STREQ(ncclGetErrorString(ncclRemoteError),
               "remote process exited or there was a network error");
}

TEST(NcclEmulator, MismatchedCallsAreInvalidUsageOnEveryRank) {
  REQUIRE_GPUS(2);
  Ranks world(2);
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  for (int r = 0; r < 2; ++r) {
    buffers.push_back(std::make_unique<DeviceBuffer>(r, 64));
    buffers[r]->upload(random_data(ncclFloat32, 16, r, 47));
  }
  const Bytes before = buffers[1]->download();
  ASSERT_EQ(ncclAllReduce(buffers[0]->data(), buffers[0]->data(), 10, ncclFloat32, ncclSum,
                          world.comms[0], world.streams[0]),
            ncclSuccess);
  ASSERT_EQ(ncclAllReduce(buffers[1]->data(), buffers[1]->data(), 12, ncclFloat32, ncclSum,
                          world.comms[1], world.streams[1]),
            ncclSuccess);
  world.synchronize();  // released, not hung
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(async_error(world.comms[r]), ncclInvalidUsage) << "rank " << r;
    const std::string text = ncclGetLastError(nullptr);
    EXPECT_NE(text.find("mismatched"), std::string::npos) << text;
    EXPECT_NE(text.find("count 12"), std::string::npos) << text;
  }
  EXPECT_EQ(buffers[1]->download(), before) << "a mismatched all-reduce wrote its output";
}

}  // namespace

#else  // no NCCL (the emulator's NCCL is built in DSTRAIN_CUDA=EMULATOR mode, with nccl.h)

TEST(NcclEmulator, AllReduceAndReduceScatterMatchTheRankOrderReference) {
  GTEST_SKIP() << "no emulated NCCL in this build (DSTRAIN_CUDA=EMULATOR with nccl.h has it)";
}

#endif
