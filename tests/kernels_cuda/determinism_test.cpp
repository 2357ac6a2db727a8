// The same inputs give the same bits on every run (ops.h's determinism contract): the ops with
// reductions across threads or blocks run twice on fresh copies and must agree bitwise.
#include "cuda_test_util.h"

namespace dstrain::test {
namespace {

// Runs `op` twice on copies of `outputs` (same starting values) and compares each output.
template <class Op>
void expect_repeatable(std::vector<HostTensor>& outputs, Op op, const char* name) {
  std::vector<HostTensor> first, second;
  for (const HostTensor& t : outputs) {
    first.push_back(t.clone());
    second.push_back(t.clone());
  }
  for (std::vector<HostTensor>* run_outputs : {&first, &second}) {
    GpuRun run;
    std::vector<Tensor> views;
    for (HostTensor& t : *run_outputs) views.push_back(run(t));
    op(run, views);
    run.finish();
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    EXPECT_GT(norm_squared(first[i].values()), 0.0) << name << " output " << i;
    EXPECT_TRUE(bitwise_equal(first[i], second[i])) << name << " output " << i;
  }
}

TEST(CudaDeterminism, BackwardOpsRepeatBitwise) {
  REQUIRE_CUDA_DEVICE();
  Random rng(91);
  const int64_t B = 4, T = 96, NH = 4, hd = 32, C = NH * hd, N = B * T, Vp = 97;
  HostTensor x = random_tensor(rng, DType::BF16, {B, T, C});
  HostTensor dx = random_tensor(rng, DType::BF16, {B, T, C});
  HostTensor weight = random_tensor(rng, DType::BF16, {C});
  HostTensor tokens = random_ids(rng, {B, T}, 20);
  HostTensor mean = nan_tensor(DType::F32, {N}), rstd = nan_tensor(DType::F32, {N});
  HostTensor ln_out = nan_tensor(DType::BF16, {B, T, C});
  cpu_backend().layernorm_forward(ln_out, mean, rstd, x, weight, weight, nullptr);

  {
    std::vector<HostTensor> grads;
    grads.push_back(random_tensor(rng, DType::F32, {Vp, C}));
    grads.push_back(random_tensor(rng, DType::F32, {T, C}));
    expect_repeatable(
        grads,
        [&](GpuRun& run, std::vector<Tensor>& g) {
          cuda_backend().embedding_backward(g[0], g[1], run(dx), run(tokens), 0, Vp, nullptr);
        },
        "embedding_backward");
  }
  {
    std::vector<HostTensor> grads;
    grads.push_back(random_tensor(rng, DType::BF16, {B, T, C}));
    grads.push_back(random_tensor(rng, DType::F32, {C}));
    grads.push_back(random_tensor(rng, DType::F32, {C}));
    expect_repeatable(
        grads,
        [&](GpuRun& run, std::vector<Tensor>& g) {
          cuda_backend().layernorm_backward(g[0], g[1], g[2], run(dx), run(x), run(weight),
                                            run(mean), run(rstd), nullptr);
        },
        "layernorm_backward");
  }
  {
    // dweight sums N = 384 rows in three partials: the order must not depend on the run.
    HostTensor rms_out = nan_tensor(DType::BF16, {B, T, C}), rms_rstd = nan_tensor(DType::F32, {N});
    cpu_backend().rmsnorm_forward(rms_out, rms_rstd, x, weight, 1e-5f, nullptr);
    std::vector<HostTensor> grads;
    grads.push_back(random_tensor(rng, DType::BF16, {B, T, C}));
    grads.push_back(random_tensor(rng, DType::F32, {C}));
    expect_repeatable(
        grads,
        [&](GpuRun& run, std::vector<Tensor>& g) {
          cuda_backend().rmsnorm_backward(g[0], g[1], run(dx), run(x), run(weight), run(rms_rstd),
                                          nullptr);
        },
        "rmsnorm_backward");
  }
  {
    HostTensor w = random_tensor(rng, DType::BF16, {C, 3 * C});
    HostTensor dout = random_tensor(rng, DType::BF16, {N, 3 * C});
    std::vector<HostTensor> grads;
    grads.push_back(nan_tensor(DType::BF16, {N, C}));
    grads.push_back(random_tensor(rng, DType::F32, {C, 3 * C}));
    grads.push_back(random_tensor(rng, DType::F32, {3 * C}));
    expect_repeatable(
        grads,
        [&](GpuRun& run, std::vector<Tensor>& g) {
          cuda_backend().matmul_backward(g[0], g[1], g[2], run(dout), run(ln_out), run(w), false,
                                         nullptr);
        },
        "matmul_backward");
  }
  {
    HostTensor qkv = random_tensor(rng, DType::BF16, {B, T, 3 * C});
    HostTensor out = nan_tensor(DType::BF16, {B, T, C}), lse = nan_tensor(DType::F32, {B, NH, T});
    cpu_backend().attention_forward(out, lse, qkv, static_cast<int>(NH), static_cast<int>(NH),
                                    nullptr);
    std::vector<HostTensor> outputs;
    outputs.push_back(nan_tensor(DType::BF16, {B, T, C}));
    outputs.push_back(nan_tensor(DType::F32, {B, NH, T}));
    outputs.push_back(nan_tensor(DType::BF16, {B, T, 3 * C}));
    expect_repeatable(
        outputs,
        [&](GpuRun& run, std::vector<Tensor>& o) {
          const int nh = static_cast<int>(NH);
          cuda_backend().attention_forward(o[0], o[1], run(qkv), nh, nh, nullptr);
          cuda_backend().attention_backward(o[2], run(dx), run(qkv), run(out), run(lse), nh, nh,
                                            nullptr);
        },
        "attention");
  }
}

}  // namespace
}  // namespace dstrain::test
