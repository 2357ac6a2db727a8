// Matmul forward and backward (cuBLAS) against the CPU twin (OpenBLAS), both weight layouts,
// with and without bias, every dtype, plus a mixed-dtype case that takes the fp32 staging and
// epilogue paths. The sums run in other orders (and on tensor cores for 16-bit operands):
//   16-bit output: storage_tolerance (one unit of F16/BF16 rounding)
//   F32 output from F32 operands (exact fp32, no TF32): {atol 1e-4, rtol 1e-4, nmse 1e-10}
//   F32 output from 16-bit operands (tensor-core fp32 accumulation): {5e-4, 1e-3, 1e-8}
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

struct MatmulCase {
  int64_t N, C, OC;
};

const MatmulCase kCases[] = {{128, 256, 384}, {7, 13, 11}, {64, 1024, 96}};

Tolerance output_tolerance(DType out, DType operands) {
  if (out != DType::F32) return storage_tolerance(out);
  return operands == DType::F32 ? Tolerance{1e-4, 1e-4, 1e-10} : Tolerance{5e-4, 1e-3, 1e-8};
}

struct Dtypes {
  DType inp, weight, out, bias;      // forward
  DType dinp, dweight, dout, dbias;  // backward
  DType operands() const { return inp == weight ? inp : DType::F32; }
};

Dtypes uniform(DType dtype) { return {dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype}; }

const char* layout_name(bool weight_out_by_in) { return weight_out_by_in ? "(OC,C)" : "(C,OC)"; }

void check_forward(const MatmulCase& c, const Dtypes& d, bool weight_out_by_in, bool with_bias) {
  Random rng(51);
  HostTensor inp = random_tensor(rng, d.inp, {c.N, c.C});
  HostTensor weight = weight_out_by_in ? random_tensor(rng, d.weight, {c.OC, c.C})
                                       : random_tensor(rng, d.weight, {c.C, c.OC});
  HostTensor bias = random_tensor(rng, d.bias, {c.OC});
  HostTensor out_cpu = nan_tensor(d.out, {c.N, c.OC}), out_gpu = out_cpu.clone();
  cpu_backend().matmul_forward(out_cpu, inp, weight, with_bias ? bias.t() : Tensor(),
                               weight_out_by_in, nullptr);
  HostTensor inp_gpu = inp.clone(), weight_gpu = weight.clone(), bias_gpu = bias.clone();
  GpuRun run;
  const Tensor bias_view = run(bias_gpu);
  cuda_backend().matmul_forward(run(out_gpu), run(inp_gpu), run(weight_gpu),
                                with_bias ? bias_view : Tensor(), weight_out_by_in, nullptr);
  run.finish();
  EXPECT_TRUE(all_close(out_gpu.values(), out_cpu.values(), output_tolerance(d.out, d.operands())))
      << "out " << dtype_name(d.out) << " N=" << c.N << " C=" << c.C << " OC=" << c.OC << " "
      << layout_name(weight_out_by_in) << (with_bias ? " bias" : "");
  EXPECT_TRUE(bitwise_equal(inp_gpu, inp));
  EXPECT_TRUE(bitwise_equal(weight_gpu, weight));
  EXPECT_TRUE(guards_intact({&out_gpu, &inp_gpu, &weight_gpu, &bias_gpu}));
}

void check_backward(const MatmulCase& c, const Dtypes& d, bool weight_out_by_in, bool with_bias,
                    bool with_dinp) {
  Random rng(52);
  HostTensor inp = random_tensor(rng, d.inp, {c.N, c.C});
  const std::vector<int64_t> weight_shape =
      weight_out_by_in ? std::vector<int64_t>{c.OC, c.C} : std::vector<int64_t>{c.C, c.OC};
  HostTensor weight = random_tensor(rng, d.weight, weight_shape);
  HostTensor dout = random_tensor(rng, d.dout, {c.N, c.OC});
  HostTensor dinp_cpu = nan_tensor(d.dinp, {c.N, c.C}), dinp_gpu = dinp_cpu.clone();
  // Parameter gradients accumulate: start from non-zero values.
  HostTensor dweight_cpu = random_tensor(rng, d.dweight, weight_shape),
             dweight_gpu = dweight_cpu.clone();
  HostTensor dbias_cpu = random_tensor(rng, d.dbias, {c.OC}), dbias_gpu = dbias_cpu.clone();
  cpu_backend().matmul_backward(with_dinp ? dinp_cpu.t() : Tensor(), dweight_cpu,
                                with_bias ? dbias_cpu.t() : Tensor(), dout, inp, weight,
                                weight_out_by_in, nullptr);
  HostTensor dout_gpu = dout.clone(), inp_gpu = inp.clone(), weight_gpu = weight.clone();
  GpuRun run;
  const Tensor dinp_view = run(dinp_gpu), dbias_view = run(dbias_gpu);
  cuda_backend().matmul_backward(with_dinp ? dinp_view : Tensor(), run(dweight_gpu),
                                 with_bias ? dbias_view : Tensor(), run(dout_gpu), run(inp_gpu),
                                 run(weight_gpu), weight_out_by_in, nullptr);
  run.finish();
  const std::string where = std::string(" N=") + std::to_string(c.N) + " C=" + std::to_string(c.C) +
                            " OC=" + std::to_string(c.OC) + " " + layout_name(weight_out_by_in);
  // Each GEMM's operand dtype: its two inputs' shared dtype, else both staged as F32.
  const DType dinp_operands = d.dout == d.weight ? d.dout : DType::F32;
  const DType dweight_operands = d.dout == d.inp ? d.dout : DType::F32;
  if (with_dinp) {
    EXPECT_TRUE(
        all_close(dinp_gpu.values(), dinp_cpu.values(), output_tolerance(d.dinp, dinp_operands)))
        << "dinp " << dtype_name(d.dinp) << where;
  } else {
    for (int64_t i = 0; i < dinp_gpu.numel(); ++i) {
      ASSERT_TRUE(std::isnan(dinp_gpu.get(i))) << "dinp was written although not asked for";
    }
  }
  EXPECT_TRUE(all_close(dweight_gpu.values(), dweight_cpu.values(),
                        output_tolerance(d.dweight, dweight_operands)))
      << "dweight " << dtype_name(d.dweight) << where;
  if (with_bias) {
    const Tolerance tol =
        d.dbias == DType::F32 ? Tolerance{1e-4, 1e-4, 1e-9} : storage_tolerance(d.dbias);
    EXPECT_TRUE(all_close(dbias_gpu.values(), dbias_cpu.values(), tol))
        << "dbias " << dtype_name(d.dbias) << where;
  }
  EXPECT_TRUE(
      guards_intact({&dinp_gpu, &dweight_gpu, &dbias_gpu, &dout_gpu, &inp_gpu, &weight_gpu}));
}

TEST(CudaMatmul, ForwardEveryDTypeLayoutAndBias) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const MatmulCase& c : kCases) {
      for (bool weight_out_by_in : {false, true}) {
        for (bool with_bias : {false, true})
          check_forward(c, uniform(dtype), weight_out_by_in, with_bias);
      }
    }
  }
}

TEST(CudaMatmul, BackwardEveryDTypeLayoutAndBias) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const MatmulCase& c : kCases) {
      for (bool weight_out_by_in : {false, true}) {
        check_backward(c, uniform(dtype), weight_out_by_in, true, true);
      }
      check_backward(c, uniform(dtype), false, false, false);  // no dbias, no dinp
    }
  }
}

// bias_backward alone (the FP8 linears' bias gradient): the twin's column sums, on the vector
// path (OC % 8 == 0) and the scalar one, over several row chunks.
TEST(CudaMatmul, BiasBackwardMatchesTheTwin) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : kFloatDTypes) {
    for (const auto& [N, OC] : {std::pair<int64_t, int64_t>{300, 64}, {7, 13}}) {
      Random rng(36);
      HostTensor dout = random_tensor(rng, dtype, {N, OC});
      HostTensor dbias_cpu = random_tensor(rng, DType::F32, {OC}), dbias_gpu = dbias_cpu.clone();
      cpu_backend().bias_backward(dbias_cpu, dout, nullptr);
      GpuRun run;
      cuda_backend().bias_backward(run(dbias_gpu), run(dout), nullptr);
      run.finish();
      EXPECT_TRUE(all_close(dbias_gpu.values(), dbias_cpu.values(), {1e-5, 1e-5, 1e-12}))
          << dtype_name(dtype) << " " << N << "x" << OC;
      EXPECT_TRUE(guards_intact({&dbias_gpu})) << N;
    }
  }
}

// Operands of different dtypes (converted to fp32 first), an output cuBLAS cannot write from
// those operands and a bias of another dtype (both through the fp32 epilogue), F32 gradients
// of BF16 activations (written by cuBLAS directly).
TEST(CudaMatmul, MixedDTypes) {
  REQUIRE_CUDA_DEVICE();
  const Dtypes mixed{DType::BF16, DType::F32, DType::F16,  DType::F32,
                     DType::F32,  DType::F32, DType::BF16, DType::F32};
  const Dtypes f16_out_of_f32{DType::F32, DType::F32, DType::F16, DType::F16,
                              DType::F16, DType::F16, DType::F32, DType::F16};
  const Dtypes f32_grads{DType::BF16, DType::BF16, DType::BF16, DType::F32,
                         DType::F32,  DType::F32,  DType::BF16, DType::F32};
  for (const MatmulCase& c : kCases) {
    for (bool weight_out_by_in : {false, true}) {
      for (const Dtypes& d : {mixed, f16_out_of_f32, f32_grads}) {
        check_forward(c, d, weight_out_by_in, true);
        check_backward(c, d, weight_out_by_in, true, true);
      }
    }
  }
}

}  // namespace
}  // namespace dstrain::test
