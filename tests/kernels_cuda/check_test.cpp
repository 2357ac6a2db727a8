// The CUDA members of the check family, and the backend/allocator factories' errors. These run
// without a GPU: the CUDA runtime names its errors without a device.
#include <cublas_api.h>

#include <string>

#include "cuda_test_util.h"
#include "kernels/cuda/cuda_check.h"

namespace dstrain::test {
namespace {

std::string message_of(void (*f)()) {
  try {
    f();
  } catch (const UserError& e) {
    return std::string("user: ") + e.what();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaCheck, ReportsStatementErrorFileLineAndRank) {
  thread_error_context().rank = 3;
  const std::string text = message_of([] { CUDA_CHECK(cudaErrorInvalidValue); });
  thread_error_context().rank = -1;
  EXPECT_NE(text.find("cudaErrorInvalidValue"), std::string::npos) << text;
  EXPECT_NE(text.find("in `cudaErrorInvalidValue`"), std::string::npos)
      << "the statement: " << text;
  EXPECT_NE(text.find("check_test.cpp:"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 3"), std::string::npos) << text;
  EXPECT_EQ(text.rfind("user: ", 0), std::string::npos) << "an internal error, not a user error";
}

TEST(CudaCheck, SuccessDoesNotThrow) {
  EXPECT_NO_THROW(CUDA_CHECK(cudaSuccess));
  EXPECT_NO_THROW(CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
}

TEST(CudaCheck, OutOfMemoryIsAUserErrorPointingToPlan) {
  const std::string text = message_of([] { CUDA_CHECK(cudaErrorMemoryAllocation); });
  EXPECT_EQ(text.rfind("user: ", 0), 0u) << text;
  EXPECT_NE(text.find("dstrain plan"), std::string::npos) << text;
}

TEST(CudaCheck, CublasStatusIsNamed) {
  const std::string text = message_of([] { CUBLAS_CHECK(CUBLAS_STATUS_INVALID_VALUE); });
  EXPECT_NE(text.find("CUBLAS_STATUS_INVALID_VALUE"), std::string::npos) << text;
  EXPECT_NE(text.find("check_test.cpp:"), std::string::npos) << text;
}

TEST(CudaCheck, LaunchCheckIsCleanWithoutPendingError) {
  // Without a driver the runtime's initialization error is sticky: only meaningful on a GPU.
  REQUIRE_CUDA_DEVICE();
  (void)cuda_device_count();
  EXPECT_NO_THROW(CUDA_CHECK_LAUNCH());
}

TEST(CudaFactories, MissingDeviceIsAnError) {
  const int count = cuda_device_count();
  EXPECT_GE(count, 0);
  EXPECT_THROW(make_cuda_backend(count + 7), Error);
  EXPECT_THROW(make_cuda_allocator(count + 7), Error);
}

}  // namespace
}  // namespace dstrain::test
