// Helpers of the CUDA kernel tests: every CUDA op runs against its CPU twin (the reference
// backend of tests/kernels/kernel_test_util.h) on the same random host data.
//
//   REQUIRE_CUDA_DEVICE();                    GTEST_SKIP() << "no CUDA device" without a GPU
//   GpuRun run;                               device copies of host tensors, data AND guard
//   cuda_backend().gelu_forward(run(out_gpu), run(x_gpu), nullptr);
//   run.finish();                             synchronize; copy every tensor (and its guard)
//                                             back into its host tensor
//   EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), tol));
//   EXPECT_TRUE(guards_intact({&out_gpu}));   an out-of-bounds device write shows up here
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "kernels/cuda/cuda_allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace dstrain::test {

inline bool have_cuda_device() { return cuda_device_count() > 0; }

#define REQUIRE_CUDA_DEVICE()                                                   \
  do {                                                                          \
    if (!::dstrain::test::have_cuda_device()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// The backend under test (device 0) and the CPU reference twin.
inline Backend& cuda_backend() {
  static std::unique_ptr<Backend> backend = make_cuda_backend(0);
  return *backend;
}
inline Backend& cpu_backend() { return *test_backend(); }

inline Allocator& cuda_test_allocator() {
  static std::unique_ptr<Allocator> allocator = make_cuda_allocator(0);
  return *allocator;
}

// Device copies of host tensors for one op: operator() uploads a HostTensor's data and its
// guard region and returns the device view; finish() waits for the backend and downloads every
// copy (guard included) back into the HostTensor it came from.
class GpuRun {
 public:
  Tensor operator()(HostTensor& host) {
    const size_t bytes = stored_bytes(host);
    Buffer buffer = cuda_test_allocator().allocate(MemCategory::Workspace, bytes);
    cuda_backend().copy_bytes(buffer.data(), host.t().data, bytes, nullptr);
    Tensor device = host.t();
    device.data = buffer.data();
    device.device = Device{Device::Kind::CUDA, 0};
    mirrors_.push_back({&host, std::move(buffer)});
    return device;
  }
  void finish() {
    cuda_backend().synchronize(nullptr);
    for (Mirror& mirror : mirrors_) {
      cuda_backend().copy_bytes(mirror.host->t().data, mirror.buffer.data(),
                                stored_bytes(*mirror.host), nullptr);
    }
    cuda_backend().synchronize(nullptr);
    mirrors_.clear();
  }

 private:
  // The tensor's bytes and the guard region after them (one allocation in HostTensor).
  static size_t stored_bytes(const HostTensor& host) {
    return host.t().nbytes() + HostTensor::kGuardElements * dtype_size(host.dtype());
  }
  struct Mirror {
    HostTensor* host;
    Buffer buffer;
  };
  std::vector<Mirror> mirrors_;
};

inline bool emulated_device() {
  return cuda_backend().name().find("emulator") != std::string::npos;
}

// A kernel whose arithmetic is its CPU twin's, operation for operation: bitwise on the emulator
// (host expf, no FMA contraction); on a GPU, where nvcc's expf and FMA contraction differ in the
// last bits, F32 within {2e-6, 2e-5, 1e-10} and 16-bit outputs within one storage value.
inline ::testing::AssertionResult matches_twin(const HostTensor& gpu, const HostTensor& cpu) {
  if (emulated_device()) return bitwise_equal(gpu, cpu);
  const Tolerance tol =
      gpu.dtype() == DType::F32 ? Tolerance{2e-6, 2e-5, 1e-10} : storage_tolerance(gpu.dtype());
  return all_close(gpu.values(), cpu.values(), tol);
}

inline HostTensor random_tensor(Random& rng, DType dtype, const std::vector<int64_t>& dims,
                                double lo = -1.0, double hi = 1.0) {
  HostTensor t(dtype, dims);
  t.fill_random(rng, lo, hi);
  return t;
}

inline HostTensor nan_tensor(DType dtype, const std::vector<int64_t>& dims) {
  HostTensor t(dtype, dims);
  t.fill_nan();
  return t;
}

// Token ids in [0, vocab) with repeats (ids drawn from the first `distinct` values).
inline HostTensor random_ids(Random& rng, const std::vector<int64_t>& dims, int64_t distinct) {
  HostTensor t(DType::I32, dims);
  for (int64_t i = 0; i < t.numel(); ++i) t.i32()[i] = static_cast<int32_t>(rng.integer(distinct));
  return t;
}

// positions (B,T) of packed sequences (kernels/ops.h): each row cut into sequences of random
// lengths (1 to 2 * mean_length), each counting from 0.
inline HostTensor random_positions(Random& rng, int64_t B, int64_t T, int64_t mean_length) {
  HostTensor t(DType::I32, {B, T});
  for (int64_t b = 0; b < B; ++b) {
    int64_t left = 0, position = 0;
    for (int64_t i = 0; i < T; ++i) {
      if (left == 0) {
        left = 1 + rng.integer(2 * mean_length);
        position = 0;
      }
      t.i32()[b * T + i] = static_cast<int32_t>(position++);
      --left;
    }
  }
  return t;
}

inline double norm_squared(const std::vector<double>& values) {
  double sum = 0.0;
  for (double v : values) sum += v * v;
  return sum;
}

inline const char* dtype_case(DType dtype) { return dtype_name(dtype); }

// Views that start inside a buffer, for the 128-bit vector paths (kernels/cuda/cuda_vector.cuh):
// 0 and 8 elements in (16 or 32 bytes: aligned, the vector kernel) and 1 element in (misaligned
// in every dtype: the scalar fallback). A view's tensor is buffer.slice(offset, dims).
constexpr int64_t kViewOffsets[] = {0, 8, 1};

// "BF16 13x301 at offset 8": a view case in failure messages.
inline std::string view_case(DType dtype, int64_t rows, int64_t cols, int64_t offset) {
  return std::string(dtype_name(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols) +
         " at offset " + std::to_string(offset);
}

// t's elements 1 element into a new buffer of t.numel() + 1 (element 0 uninitialized): the same
// values at an address misaligned for every dtype, for a scalar path against a vector one.
inline HostTensor one_element_in(const HostTensor& t) {
  HostTensor buffer(t.dtype(), {t.numel() + 1});
  for (int64_t i = 0; i < t.numel(); ++i) buffer.set(i + 1, t.get(i));
  return buffer;
}

// Two copies of each buffer, one for the CPU twin and one for the CUDA backend: an op runs on
// views into each, then every buffer compares whole -- the elements before a view and the guard
// after it must come back as they were.
struct TwinBuffers {
  std::vector<HostTensor> cpu, gpu;
  explicit TwinBuffers(std::initializer_list<const HostTensor*> buffers) {
    for (const HostTensor* buffer : buffers) {
      cpu.push_back(buffer->clone());
      gpu.push_back(buffer->clone());
    }
  }
  ::testing::AssertionResult bitwise_equal_all() const {
    for (size_t i = 0; i < cpu.size(); ++i) {
      auto equal = bitwise_equal(gpu[i], cpu[i]);
      if (!equal) return equal << " (buffer " << i << ")";
    }
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult guards_intact_all() const {
    for (size_t i = 0; i < gpu.size(); ++i) {
      if (!gpu[i].guard_intact()) {
        return ::testing::AssertionFailure() << "guard of buffer " << i << " was overwritten";
      }
    }
    return ::testing::AssertionSuccess();
  }
};

// The register-held rows of the norms (kernels/cuda/cuda_rows.cuh), C in packs of 8. One warp
// per row: 40 (5 packs, most lanes idle), 264 (lane 0 holds two), 1032 (8 packs per lane
// instantiated, 5 used). A block of 8 warps per row: 2056 (257 packs, thread 0 holds two),
// 4104 (4 per thread instantiated, thread 0 holds three), 8192 (the bound, every pack used).
constexpr int64_t kRowC[] = {40, 264, 1032, 2056, 4104, 8192};

// While it lives, the norms hold every row in a block of 8 warps (block_per_row) or in one warp
// up to C = 2048, forward and backward: set_cuda_norm_block_rows_above, the defaults restored at
// the end.
struct BlockPerRowNorms {
  explicit BlockPerRowNorms(bool block_per_row) {
    set_cuda_norm_block_rows_above(block_per_row ? 0 : 2048);
  }
  ~BlockPerRowNorms() { set_cuda_norm_block_rows_above(-1); }
  BlockPerRowNorms(const BlockPerRowNorms&) = delete;
  BlockPerRowNorms& operator=(const BlockPerRowNorms&) = delete;
};

// While it lives, the tensor-core attention forward gives each warp `rows` query rows (16 or
// 32 at head dims 64 and 128: set_cuda_attention_warp_rows); 16, the default, restored at the
// end.
struct AttentionWarpRows {
  explicit AttentionWarpRows(int rows) { set_cuda_attention_warp_rows(rows); }
  ~AttentionWarpRows() { set_cuda_attention_warp_rows(16); }
  AttentionWarpRows(const AttentionWarpRows&) = delete;
  AttentionWarpRows& operator=(const AttentionWarpRows&) = delete;
};

// The tolerance of a norm's per-row statistics (mean, rstd) over rows of C elements against the
// CPU twin. The twin adds its C terms in sequence in fp32: C roundings of a growing partial sum,
// a relative error of rms ~ eps * sqrt(C / 9), so its square, the normalized mse, grows with C.
// `nmse_at_1000` is the bound at C = 1000; atol and rtol per element stay as they are.
inline Tolerance row_stat_tolerance(int64_t C, double nmse_at_1000) {
  return {1e-6, 1e-5, nmse_at_1000 * std::max(1.0, static_cast<double>(C) / 1000.0)};
}

// The cases of the norms with the residual add fused in (layernorm and RMSNorm tests): the
// register-held rows of kRowC (one warp and one block per row) and C = 13 (the two ops'
// fallback), each at every offset of kViewOffsets.
constexpr int64_t kFusedNormC[] = {40, 1032, 2056, 4104, 13};

// Every GPU buffer of a fused op's run equals the same buffer of the two ops' run, bit for bit.
inline ::testing::AssertionResult gpu_buffers_bitwise_equal(const TwinBuffers& fused,
                                                            const TwinBuffers& two_ops) {
  for (size_t i = 0; i < fused.gpu.size(); ++i) {
    auto equal = bitwise_equal(fused.gpu[i], two_ops.gpu[i]);
    if (!equal) return equal << " (buffer " << i << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace dstrain::test
