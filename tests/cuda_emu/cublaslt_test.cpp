// The CUDA emulator's cuBLASLt (kernels/cuda_emu/emu_cublaslt.cpp): the BIAS epilogue's result,
// operand transposes, alpha/beta read at call time, and the statuses for what it does not model
// -- so the CUDA backend's fallbacks and alignment preferences are exercised without a GPU.
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace {

#define EXPECT_CUBLAS(expr, status) EXPECT_EQ((expr), (status)) << #expr

// Device copies for one test, freed at the end.
class DeviceMemory {
 public:
  template <class T>
  T* upload(const std::vector<T>& host) {
    void* data = nullptr;
    EXPECT_EQ(cudaMalloc(&data, host.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    buffers_.push_back(data);
    return static_cast<T*>(data);
  }
  ~DeviceMemory() {
    for (void* data : buffers_) cudaFree(data);
  }

 private:
  std::vector<void*> buffers_;
};

template <class T>
std::vector<T> download(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

// One D = op(A) @ op(B) (+ bias) problem, column-major, every matrix in `type`.
struct Problem {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;

  Problem(cudaDataType type, int64_t m, int64_t n, int64_t k, bool transpose_a) {
    EXPECT_CUBLAS(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
    EXPECT_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                  CUBLAS_STATUS_SUCCESS);
    const int32_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    EXPECT_CUBLAS(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
        CUBLAS_STATUS_SUCCESS);
    EXPECT_CUBLAS(cublasLtMatrixLayoutCreate(&a, type, transpose_a ? k : m, transpose_a ? m : k,
                                             transpose_a ? k : m),
                  CUBLAS_STATUS_SUCCESS);
    EXPECT_CUBLAS(cublasLtMatrixLayoutCreate(&b, type, k, n, k), CUBLAS_STATUS_SUCCESS);
    EXPECT_CUBLAS(cublasLtMatrixLayoutCreate(&d, type, m, n, m), CUBLAS_STATUS_SUCCESS);
    EXPECT_CUBLAS(cublasLtMatmulPreferenceCreate(&preference), CUBLAS_STATUS_SUCCESS);
  }
  ~Problem() {
    cublasLtMatmulPreferenceDestroy(preference);
    cublasLtMatrixLayoutDestroy(d);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(handle);
  }
  void set_bias(const void* bias) {
    const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    EXPECT_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                 sizeof epilogue),
                  CUBLAS_STATUS_SUCCESS);
    EXPECT_CUBLAS(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
        CUBLAS_STATUS_SUCCESS);
  }
  cublasStatus_t heuristic(cublasLtMatmulHeuristicResult_t* result) {
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, preference, 1, result, &found);
    if (status == CUBLAS_STATUS_SUCCESS) {
      EXPECT_EQ(found, 1);
    }
    return status;
  }
  cublasStatus_t run(const cublasLtMatmulHeuristicResult_t& algo, const float* alpha, const void* A,
                     const void* B, void* D, cudaStream_t stream) {
    const float beta = 0.0f;
    return cublasLtMatmul(handle, desc, alpha, A, a, B, b, &beta, D, d, D, d, &algo.algo, nullptr,
                          0, stream);
  }
};

// A (2,3) @ B (3,2) + bias (2) with small integers: every fp32 sum is exact, so the result is
// known exactly; A stored transposed.
TEST(CublasLtEmulator, BiasEpilogueWithTransposedOperand) {
  // Column-major A^T (3,2) = A (2,3) = [[1, 2, 3], [4, 5, 6]]; B (3,2) = [[1, 0], [0, 1], [1, 1]].
  const std::vector<float> a_t = {1, 2, 3, 4, 5, 6}, b = {1, 0, 1, 0, 1, 1}, bias = {10, -20};
  DeviceMemory memory;
  const float* a_device = memory.upload(a_t);
  const float* b_device = memory.upload(b);
  const float* bias_device = memory.upload(bias);
  float* d_device = memory.upload(std::vector<float>(4, -1.0f));
  Problem problem(CUDA_R_32F, 2, 2, 3, true);
  problem.set_bias(bias_device);
  cublasLtMatmulHeuristicResult_t algo{};
  ASSERT_EQ(problem.heuristic(&algo), CUBLAS_STATUS_SUCCESS);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  float alpha = 2.0f;
  ASSERT_EQ(problem.run(algo, &alpha, a_device, b_device, d_device, stream), CUBLAS_STATUS_SUCCESS);
  alpha = 100.0f;  // read at call time (host pointer mode): this must not change the result
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  // A @ B = [[4, 5], [10, 11]]; D = 2 (A @ B) + bias per row, column-major.
  EXPECT_EQ(download(d_device, 4), (std::vector<float>{18, 0, 20, 2}));
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// F16 storage: the fp32 sum plus the bias is rounded once, to nearest even.
TEST(CublasLtEmulator, HalfOutputIsRoundedOnceAfterTheBias) {
  // 1 * 1 + 2048 = 2049 lies between the halves 2048 and 2050: RNE gives 2048.
  // 1 * 3 + 2048 = 2051 lies between 2050 and 2052: RNE gives 2052.
  const std::vector<__half> a = {__float2half(1.0f), __float2half(3.0f)};
  const std::vector<__half> b = {__float2half(1.0f)};
  const std::vector<__half> bias = {__float2half(2048.0f), __float2half(2048.0f)};
  DeviceMemory memory;
  const __half* a_device = memory.upload(a);
  const __half* b_device = memory.upload(b);
  const __half* bias_device = memory.upload(bias);
  __half* d_device = memory.upload(std::vector<__half>(2));
  Problem problem(CUDA_R_16F, 2, 1, 1, false);
  problem.set_bias(bias_device);
  cublasLtMatmulHeuristicResult_t algo{};
  ASSERT_EQ(problem.heuristic(&algo), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f;
  ASSERT_EQ(problem.run(algo, &alpha, a_device, b_device, d_device, nullptr),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<__half> d = download(d_device, 2);
  EXPECT_EQ(__half2float(d[0]), 2048.0f);
  EXPECT_EQ(__half2float(d[1]), 2052.0f);
}

TEST(CublasLtEmulator, RefusesWhatItDoesNotModel) {
  Problem problem(CUDA_R_16BF, 8, 8, 8, false);
  // GELU epilogues: no algorithm (the CUDA backend does not use them).
  const uint32_t gelu = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  EXPECT_CUBLAS(cublasLtMatmulDescSetAttribute(problem.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &gelu,
                                               sizeof gelu),
                CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t algo{};
  EXPECT_EQ(problem.heuristic(&algo), CUBLAS_STATUS_NOT_SUPPORTED);
  // An attribute the shim does not model, and a value of the wrong size.
  const int64_t aux_ld = 8;
  EXPECT_CUBLAS(cublasLtMatmulDescSetAttribute(problem.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                               &aux_ld, sizeof aux_ld),
                CUBLAS_STATUS_NOT_SUPPORTED);
  const int64_t wrong_size = CUBLAS_OP_T;
  EXPECT_CUBLAS(cublasLtMatmulDescSetAttribute(problem.desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                               &wrong_size, sizeof wrong_size),
                CUBLAS_STATUS_INVALID_VALUE);
  // A and B of different types.
  const uint32_t plain = CUBLASLT_EPILOGUE_DEFAULT;
  EXPECT_CUBLAS(cublasLtMatmulDescSetAttribute(problem.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &plain,
                                               sizeof plain),
                CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(problem.heuristic(&algo), CUBLAS_STATUS_SUCCESS);
  const uint32_t f32 = CUDA_R_32F;
  EXPECT_CUBLAS(
      cublasLtMatrixLayoutSetAttribute(problem.b, CUBLASLT_MATRIX_LAYOUT_TYPE, &f32, sizeof f32),
      CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(problem.heuristic(&algo), CUBLAS_STATUS_NOT_SUPPORTED);
}

// The heuristic assumes 256-byte aligned matrices unless told otherwise; a pointer less aligned
// than the algorithm was chosen for is refused, as a real kernel would misread it.
TEST(CublasLtEmulator, PointersLessAlignedThanTheHeuristicWasToldAreRefused) {
  DeviceMemory memory;
  float* a_device = memory.upload(std::vector<float>(5, 1.0f));
  const float* b_device = memory.upload(std::vector<float>(1, 2.0f));
  float* d_device = memory.upload(std::vector<float>(5, 0.0f));
  Problem problem(CUDA_R_32F, 4, 1, 1, false);
  cublasLtMatmulHeuristicResult_t algo{};
  ASSERT_EQ(problem.heuristic(&algo), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f;
  EXPECT_EQ(problem.run(algo, &alpha, a_device + 1, b_device, d_device, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  const uint32_t four = 4;
  EXPECT_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(
          problem.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &four, sizeof four),
      CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(problem.heuristic(&algo), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(problem.run(algo, &alpha, a_device + 1, b_device, d_device, nullptr),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(download(d_device, 4), (std::vector<float>{2, 2, 2, 2}));
}

}  // namespace
