// SwiGLU forward and backward against the CPU twin. The kernel's arithmetic is the twin's,
// operation for operation: on the emulator (host expf, no FMA contraction) the results are
// bitwise equal. On a GPU nvcc's expf (within 2 ulp) and FMA contraction differ in the last bits:
//   F32 {atol 2e-6, rtol 2e-5, nmse 1e-10}; F16/BF16 storage_tolerance (one storage value).
#include <string>

#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

// (..., 2I): round (I = 1024), odd (I = 37), and 3-D (I = 13).
const std::vector<std::vector<int64_t>> kShapes = {{64, 2048}, {7, 74}, {5, 7, 26}};

bool emulated_device() { return cuda_backend().name().find("emulator") != std::string::npos; }

// Bitwise on the emulator, else within the stated tolerance.
::testing::AssertionResult matches_twin(const HostTensor& gpu, const HostTensor& cpu) {
  if (emulated_device()) return bitwise_equal(gpu, cpu);
  const Tolerance tol =
      gpu.dtype() == DType::F32 ? Tolerance{2e-6, 2e-5, 1e-10} : storage_tolerance(gpu.dtype());
  return all_close(gpu.values(), cpu.values(), tol);
}

std::vector<int64_t> halved(std::vector<int64_t> shape) {
  shape.back() /= 2;
  return shape;
}

TEST(CudaSwiglu, ForwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& shape : kShapes) {
      Random rng(71);
      HostTensor inp = random_tensor(rng, dtype, shape, -6.0, 6.0);
      HostTensor out_cpu = nan_tensor(dtype, halved(shape)), out_gpu = out_cpu.clone();
      cpu_backend().swiglu_forward(out_cpu, inp, nullptr);
      HostTensor inp_gpu = inp.clone();
      GpuRun run;
      cuda_backend().swiglu_forward(run(out_gpu), run(inp_gpu), nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " " + inp.t().shape_str();
      EXPECT_TRUE(matches_twin(out_gpu, out_cpu)) << where;
      EXPECT_TRUE(bitwise_equal(inp_gpu, inp)) << where;
      EXPECT_TRUE(guards_intact({&out_gpu, &inp_gpu})) << where;
    }
  }
}

TEST(CudaSwiglu, BackwardMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& shape : kShapes) {
      Random rng(72);
      HostTensor inp = random_tensor(rng, dtype, shape, -6.0, 6.0);
      HostTensor dout = random_tensor(rng, dtype, halved(shape));
      // Overwritten, not accumulated: start both from the same non-zero values.
      HostTensor dinp_cpu = random_tensor(rng, dtype, shape), dinp_gpu = dinp_cpu.clone();
      cpu_backend().swiglu_backward(dinp_cpu, dout, inp, nullptr);
      GpuRun run;
      cuda_backend().swiglu_backward(run(dinp_gpu), run(dout), run(inp), nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " " + inp.t().shape_str();
      EXPECT_TRUE(matches_twin(dinp_gpu, dinp_cpu)) << where;
      EXPECT_TRUE(guards_intact({&dinp_gpu})) << where;
    }
  }
}

}  // namespace
}  // namespace dstrain::test
