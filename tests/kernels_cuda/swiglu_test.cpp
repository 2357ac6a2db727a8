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
      cpu_backend().swiglu_forward(out_cpu, inp, Tensor(), nullptr);
      HostTensor inp_gpu = inp.clone();
      GpuRun run;
      cuda_backend().swiglu_forward(run(out_gpu), run(inp_gpu), Tensor(), nullptr);
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
      cpu_backend().swiglu_backward(dinp_cpu, dout, inp, Tensor(), nullptr);
      GpuRun run;
      cuda_backend().swiglu_backward(run(dinp_gpu), run(dout), run(inp), Tensor(), nullptr);
      run.finish();
      const std::string where = std::string(dtype_name(dtype)) + " " + inp.t().shape_str();
      EXPECT_TRUE(matches_twin(dinp_gpu, dinp_cpu)) << where;
      EXPECT_TRUE(guards_intact({&dinp_gpu})) << where;
    }
  }
}

// The 128-bit form (I % 8 == 0, every tensor aligned: I = 24, three packs per row, and 1024) and
// the element-wise one on the same rows 1 element into their buffers (misaligned), forward and
// backward, against the CPU twin; every buffer compared whole.
TEST(CudaSwiglu, VectorRowsAndOffsetsMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (int64_t I : {int64_t{24}, int64_t{1024}}) {
      for (int64_t offset : kViewOffsets) {
        const int64_t N = 5;
        const auto rows = [&](const Tensor& buffer, int64_t width) {
          return buffer.slice(offset, {N, width});
        };
        Random rng(73);
        const HostTensor inp = random_tensor(rng, dtype, {offset + N * 2 * I}, -6.0, 6.0);
        const HostTensor out = random_tensor(rng, dtype, {offset + N * I});
        const HostTensor dout = random_tensor(rng, dtype, {offset + N * I});
        const HostTensor dinp = random_tensor(rng, dtype, {offset + N * 2 * I});
        TwinBuffers t({&out, &dinp, &inp, &dout});
        cpu_backend().swiglu_forward(rows(t.cpu[0], I), rows(t.cpu[2], 2 * I), Tensor(), nullptr);
        cpu_backend().swiglu_backward(rows(t.cpu[1], 2 * I), rows(t.cpu[3], I),
                                      rows(t.cpu[2], 2 * I), Tensor(), nullptr);
        GpuRun run;
        std::vector<Tensor> g;
        for (HostTensor& buffer : t.gpu) g.push_back(run(buffer));
        cuda_backend().swiglu_forward(rows(g[0], I), rows(g[2], 2 * I), Tensor(), nullptr);
        cuda_backend().swiglu_backward(rows(g[1], 2 * I), rows(g[3], I), rows(g[2], 2 * I),
                                       Tensor(), nullptr);
        run.finish();
        const std::string where = view_case(dtype, N, I, offset);
        EXPECT_FALSE(bitwise_equal(t.gpu[0], out)) << "out did not change, " << where;
        for (int i : {0, 1}) EXPECT_TRUE(matches_twin(t.gpu[i], t.cpu[i])) << i << " " << where;
        EXPECT_TRUE(bitwise_equal(t.gpu[2], inp) && bitwise_equal(t.gpu[3], dout)) << where;
        EXPECT_TRUE(t.guards_intact_all()) << where;
      }
    }
  }
}

// Asked for it (--precision fp8), each kernel finds max |what it stored|: the amax fp8_amax
// finds of its output, on the vector form and the element-wise one (a misaligned view).
TEST(CudaSwiglu, TheAmaxFoundIsTheOutputsAmax) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (int64_t offset : kViewOffsets) {
      const int64_t N = 9, I = 40;
      Random rng(74);
      HostTensor inp = random_tensor(rng, dtype, {offset + N * 2 * I}, -6.0, 6.0);
      HostTensor dout = random_tensor(rng, dtype, {offset + N * I});
      HostTensor out = random_tensor(rng, dtype, {offset + N * I});
      HostTensor dinp = random_tensor(rng, dtype, {offset + N * 2 * I});
      HostTensor out_amax(DType::F32, {1}), dinp_amax(DType::F32, {1});
      GpuRun run;
      const Tensor in = run(inp).slice(offset, {N, 2 * I});
      const Tensor o = run(out).slice(offset, {N, I}), d = run(dinp).slice(offset, {N, 2 * I});
      cuda_backend().swiglu_forward(o, in, run(out_amax), nullptr);
      cuda_backend().swiglu_backward(d, run(dout).slice(offset, {N, I}), in, run(dinp_amax),
                                     nullptr);
      run.finish();
      HostTensor want_out(DType::F32, {1}), want_dinp(DType::F32, {1});
      cpu_backend().fp8_amax(want_out, out.t().slice(offset, {N, I}), nullptr);
      cpu_backend().fp8_amax(want_dinp, dinp.t().slice(offset, {N, 2 * I}), nullptr);
      const std::string where = view_case(dtype, N, I, offset);
      EXPECT_GT(want_out.get(0), 0.0) << where;
      EXPECT_TRUE(bitwise_equal(out_amax, want_out)) << where;
      EXPECT_TRUE(bitwise_equal(dinp_amax, want_dinp)) << where;
      EXPECT_TRUE(guards_intact({&out, &dinp, &out_amax, &dinp_amax})) << where;
    }
  }
}

}  // namespace
}  // namespace dstrain::test
