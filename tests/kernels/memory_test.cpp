// Memory ops: fill_zero, copy (dtype conversion, RNE), copy_bytes; the backend's identity.
#include "kernel_test_util.h"

namespace dstrain::test {
namespace {

TEST(Backend, NameAndDevice) {
  auto backend = make_cpu_backend(3);
  EXPECT_EQ(backend->name(), "cpu (3 threads, OpenBLAS)");
  EXPECT_TRUE(backend->device().is_cpu());
  auto all_cores = make_cpu_backend(0);
  EXPECT_NE(all_cores->name().find("threads"), std::string::npos);
  backend->synchronize(nullptr);
}

TEST(Memory, FillZeroEveryDType) {
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::I32}) {
    HostTensor t(dtype, {3, 7, 13});
    Random rng(81);
    t.fill_random(rng, 1.0, 2.0);
    test_backend()->fill_zero(t, nullptr);
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.get(i), 0.0) << dtype_name(dtype) << i;
    EXPECT_TRUE(guards_intact({&t}));
  }
}

// Values around the rounding boundaries of both 16-bit formats, plus random ones.
std::vector<float> conversion_inputs() {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -1.0f,
                               65504.0f,
                               65520.0f,
                               1e-8f,
                               6e-5f,
                               1.00048828f,
                               1.00146484f,
                               3.14159f,
                               -2.5e38f,
                               1e38f,
                               1e-40f,
                               INFINITY,
                               -INFINITY,
                               1.0f + 0x1p-8f,
                               1.0f + 0x1p-9f,
                               1.0f + 3 * 0x1p-9f,
                               1.0f + 0x1p-11f};
  Random rng(82);
  for (int i = 0; i < 20000; ++i) {
    values.push_back(
        static_cast<float>(rng.uniform(-1.0, 1.0) * std::pow(2.0, rng.uniform(-30, 17))));
  }
  return values;
}

TEST(Memory, CopyF32ToF16AndBF16RoundsToNearestEven) {
  const std::vector<float> values = conversion_inputs();
  const int64_t n = static_cast<int64_t>(values.size());
  HostTensor src(DType::F32, {n});
  for (int64_t i = 0; i < n; ++i) src.set(i, values[i]);
  for (DType dtype : {DType::F16, DType::BF16}) {
    HostTensor dst(dtype, {n});
    dst.fill_nan();
    test_backend()->copy(dst, src, nullptr);
    const uint16_t* bits = static_cast<const uint16_t*>(dst.t().data);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t expected =
          dtype == DType::F16 ? fp32_to_fp16_bits(values[i]) : fp32_to_bf16_bits(values[i]);
      ASSERT_EQ(bits[i], expected) << dtype_name(dtype) << " of " << values[i] << " at " << i;
    }
    EXPECT_TRUE(guards_intact({&dst}));
    // And back: 16-bit values are exact in fp32.
    HostTensor back(DType::F32, {n});
    test_backend()->copy(back, dst, nullptr);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back.get(i), dst.get(i)) << i;
  }
  // NaN stays NaN.
  HostTensor nan_src(DType::F32, {1}), nan_dst(DType::BF16, {1});
  nan_src.set(0, std::nan(""));
  test_backend()->copy(nan_dst, nan_src, nullptr);
  EXPECT_TRUE(std::isnan(nan_dst.get(0)));
}

TEST(Memory, CopyBF16ToF16AndSameDType) {
  Random rng(83);
  HostTensor src(DType::BF16, {3, 7, 13});
  src.fill_random(rng, -4.0, 4.0);
  HostTensor dst(DType::F16, {3, 7, 13});
  test_backend()->copy(dst, src, nullptr);
  for (int64_t i = 0; i < src.numel(); ++i) {
    ASSERT_EQ(dst.get(i), round_to(DType::F16, src.get(i))) << i;
  }
  HostTensor same(DType::BF16, {3 * 7 * 13});  // other shape, same numel
  test_backend()->copy(same, src, nullptr);
  EXPECT_TRUE(bitwise_equal(same, src));
  EXPECT_TRUE(guards_intact({&dst, &same}));
}

TEST(Memory, CopyNumelMismatchThrows) {
  HostTensor a(DType::F32, {4}), b(DType::F32, {5}), tokens(DType::I32, {4});
  EXPECT_THROW(test_backend()->copy(a, b, nullptr), Error);
  EXPECT_THROW(test_backend()->copy(a, tokens, nullptr), Error);
}

TEST(Memory, CopyBytes) {
  std::vector<uint8_t> src(1001), dst(1001 + 7, 0xEE);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  test_backend()->copy_bytes(dst.data(), src.data(), src.size(), nullptr);
  EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin()));
  for (size_t i = src.size(); i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << i;
}

}  // namespace
}  // namespace dstrain::test
