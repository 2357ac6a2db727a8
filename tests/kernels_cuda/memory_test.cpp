// The CUDA allocators, and the memory ops (fill_zero, copy with dtype conversion, copy_bytes)
// against the CPU twin: bitwise, since both round with RNE.
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

TEST(CudaBackend, NameAndDevice) {
  REQUIRE_CUDA_DEVICE();
  EXPECT_TRUE(cuda_backend().device().is_cuda());
  EXPECT_EQ(cuda_backend().device().index, 0);
  EXPECT_EQ(cuda_backend().name().rfind("cuda:0 (", 0), 0u) << cuda_backend().name();
  cuda_backend().synchronize(nullptr);
}

TEST(CudaAllocator, CountsCategoriesAndPeaks) {
  REQUIRE_CUDA_DEVICE();
  auto allocator = make_cuda_allocator(0);
  EXPECT_TRUE(allocator->device().is_cuda());
  {
    Buffer params = allocator->allocate(MemCategory::Parameters, 1000);
    Buffer acts = allocator->allocate(MemCategory::Activations, 5000);
    EXPECT_TRUE(params.device().is_cuda());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(params.data()) % 64, 0u);
    const MemoryStats stats = allocator->stats();
    EXPECT_EQ(stats.current[static_cast<int>(MemCategory::Parameters)], 1000u);
    EXPECT_EQ(stats.current_total, 6000u);
  }
  const MemoryStats stats = allocator->stats();
  EXPECT_EQ(stats.current_total, 0u);
  EXPECT_EQ(stats.peak_total, 6000u);
}

TEST(CudaAllocator, OutOfMemoryNamesTheCategory) {
  REQUIRE_CUDA_DEVICE();
  auto allocator = make_cuda_allocator(0);
  try {
    Buffer huge = allocator->allocate(MemCategory::Activations, size_t{1} << 52);  // 4 PiB
    FAIL() << "4 PiB of device memory was allocated";
  } catch (const UserError& e) {
    const std::string text = e.what();
    EXPECT_NE(text.find("activations"), std::string::npos) << text;
    EXPECT_NE(text.find("dstrain plan"), std::string::npos) << text;
  }
  // The failed allocation left no sticky error: the device still works.
  Buffer small = allocator->allocate(MemCategory::Workspace, 256);
  EXPECT_FALSE(small.empty());
  cuda_backend().synchronize(nullptr);
}

TEST(CudaAllocator, PinnedHostMemoryIsHostAndCopies) {
  REQUIRE_CUDA_DEVICE();
  auto pinned = make_pinned_host_allocator();
  Buffer host = pinned->allocate(MemCategory::OptimizerStateHost, 4096);
  EXPECT_TRUE(host.device().is_cpu());
  auto* bytes = static_cast<uint8_t*>(host.data());
  for (int i = 0; i < 4096; ++i) bytes[i] = static_cast<uint8_t>(i * 7);
  Buffer device = cuda_test_allocator().allocate(MemCategory::Workspace, 4096);
  Buffer back = pinned->allocate(MemCategory::OptimizerStateHost, 4096);
  cuda_backend().copy_bytes(device.data(), host.data(), 4096, nullptr);
  cuda_backend().copy_bytes(back.data(), device.data(), 4096, nullptr);
  cuda_backend().synchronize(nullptr);
  EXPECT_EQ(std::memcmp(host.data(), back.data(), 4096), 0);
  EXPECT_EQ(pinned->stats().current[static_cast<int>(MemCategory::OptimizerStateHost)], 8192u);
}

TEST(CudaMemory, FillZeroEveryDType) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::I32}) {
    Random rng(81);
    HostTensor t(dtype, {3, 7, 13});
    t.fill_random(rng, 1.0, 2.0);
    GpuRun run;
    cuda_backend().fill_zero(run(t), nullptr);
    run.finish();
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.get(i), 0.0) << dtype_name(dtype) << i;
    EXPECT_TRUE(guards_intact({&t})) << dtype_name(dtype);
  }
}

// Every conversion pair, on values around the 16-bit rounding boundaries plus random ones of
// many magnitudes: the GPU's __float2half_rn / __float2bfloat16_rn must give the CPU's bits.
TEST(CudaMemory, CopyConvertsBitwiseLikeTheCpu) {
  REQUIRE_CUDA_DEVICE();
  std::vector<double> values = {0.0,           -0.0,         1.0,          -1.0,
                                65504.0,       65520.0,      1e-8,         6e-5,
                                1.00048828,    3.14159,      -2.5e38,      1e38,
                                1e-40,         1.0 + 0x1p-8, 1.0 + 0x1p-9, 1.0 + 3 * 0x1p-9,
                                1.0 + 0x1p-11, INFINITY,     -INFINITY};
  Random rng(82);
  for (int i = 0; i < 5000; ++i) {
    values.push_back(rng.uniform(-1.0, 1.0) * std::pow(2.0, rng.uniform(-30, 17)));
  }
  const int64_t n = static_cast<int64_t>(values.size());
  for (DType from : kFloatDTypes) {
    for (DType to : kFloatDTypes) {
      HostTensor src(from, {n});
      src.set(values);
      HostTensor dst_cpu = nan_tensor(to, {n});
      HostTensor dst_gpu = dst_cpu.clone();
      HostTensor src_gpu = src.clone();
      cpu_backend().copy(dst_cpu, src, nullptr);
      GpuRun run;
      cuda_backend().copy(run(dst_gpu), run(src_gpu), nullptr);
      run.finish();
      EXPECT_TRUE(bitwise_equal(dst_gpu, dst_cpu)) << dtype_name(from) << " -> " << dtype_name(to);
      EXPECT_TRUE(bitwise_equal(src_gpu, src)) << "source changed";
      EXPECT_TRUE(guards_intact({&dst_gpu, &src_gpu}));
    }
  }
}

TEST(CudaMemory, CopyBetweenHostAndDeviceSameDType) {
  REQUIRE_CUDA_DEVICE();
  Random rng(83);
  HostTensor host = random_tensor(rng, DType::BF16, {5, 7, 11});
  HostTensor back = nan_tensor(DType::BF16, {5, 7, 11});
  Buffer device = cuda_test_allocator().allocate(MemCategory::Workspace, host.t().nbytes());
  Tensor device_view = host.t();
  device_view.data = device.data();
  device_view.device = Device{Device::Kind::CUDA, 0};
  cuda_backend().copy(device_view, host, nullptr);  // same dtype: either side may be host
  cuda_backend().copy(back, device_view, nullptr);
  cuda_backend().synchronize(nullptr);
  EXPECT_TRUE(bitwise_equal(back, host));
  EXPECT_TRUE(guards_intact({&back}));
}

}  // namespace
}  // namespace dstrain::test
