// Host-side AdamW for ZeRO-Offload: with --offload the fp32 master weights and the Adam
// moments of a rank's shard live in (pinned) host memory and the step runs on the host CPU.
//
// The result is BITWISE identical to the CPU backend's Backend::adamw
// (kernels/cpu/cpu_optim.cpp), for every ISA level and every thread count: each scalar
// operation of the reference is mirrored by exactly one vector operation (no FMA: the
// reference has none), so a run with --offload equals a run without to the bit.
//
// ISA levels are chosen at run time (AVX-512F, else AVX2 + F16C, else portable scalar code);
// the build needs no -march flag. Threads split the range into contiguous chunks; since the
// update is elementwise, chunk boundaries never change a result.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "kernels/ops.h"  // AdamWStep

namespace dstrain {

enum class HostAdamWIsa : uint8_t {
  Auto,    // the best level this CPU supports
  Scalar,  // portable C++
  Avx2,    // 8 floats per op; needs AVX2 and F16C
  Avx512,  // 16 floats per op; needs AVX-512F
};

// "auto", "scalar", "avx2", "avx512".
const char* host_adamw_isa_name(HostAdamWIsa isa);
// True when this CPU (and OS) can run `isa`. Auto and Scalar: always.
bool host_adamw_isa_supported(HostAdamWIsa isa);
// The level that Auto runs on this CPU: "avx512", "avx2" or "scalar".
const char* host_adamw_isa();

// One AdamW step on n elements, in place, all fp32:
//   param (n), grad (n), m (n), v (n)
// Same semantics and bits as Backend::adamw (see AdamWStep in kernels/ops.h): grad is
// multiplied by step.grad_scale first; weight decay is decoupled.
// num_threads <= 0: all of OpenMP's threads. Small n runs on fewer threads than asked.
// REQUIRES: step.step >= 1; param, m, v do not overlap each other or grad.
// Throws dstrain::Error on a broken requirement, before touching any memory.
void host_adamw(float* param, const float* grad, float* m, float* v, int64_t n,
                const AdamWStep& step, int num_threads);

// The mixed-precision form the offload path uses: gradients come down as fp32, fp16 or bf16,
// and the updated weights go back up rounded (RNE, as Backend::copy) to fp16 or bf16.
//   param (n) F32, grad (n) grad_dtype in {F32, F16, BF16}, m (n) F32, v (n) F32,
//   param_copy (n) copy_dtype in {F16, BF16}, or nullptr for no copy (copy_dtype ignored)
// Equals Backend::adamw(param, grad, m, v, param_copy, step) with tensors of those dtypes.
// param_copy may alias grad exactly (same address, both 16-bit): each element's gradient is
// read before its copy is written, so one staging buffer can carry grads in and weights out.
// Any other overlap is not allowed.
void host_adamw(float* param, const void* grad, DType grad_dtype, float* m, float* v,
                uint16_t* param_copy, DType copy_dtype, int64_t n, const AdamWStep& step,
                int num_threads);

// As above, on a forced ISA level (for tests and benchmarks).
// REQUIRES: host_adamw_isa_supported(isa); throws dstrain::Error otherwise.
void host_adamw_with(HostAdamWIsa isa, float* param, const void* grad, DType grad_dtype, float* m,
                     float* v, uint16_t* param_copy, DType copy_dtype, int64_t n,
                     const AdamWStep& step, int num_threads);

// bf16 optimizer states (--bf16-optimizer-states, DeepSpeed's bf16.bf16_optimizer_states): m and
// v (n) of moment_dtype F32 or BF16. BF16 moments are widened (exactly) to fp32, the step is the
// one above in fp32 -- the parameter's update uses the new moments before rounding -- and they
// are stored rounded (RNE, as fp32_to_bf16_bits). The same bits on every ISA level and thread
// count; with F32 moments, host_adamw_with's. The overlap rules of host_adamw apply.
void host_adamw_moments(HostAdamWIsa isa, float* param, const void* grad, DType grad_dtype,
                        void* m, void* v, DType moment_dtype, uint16_t* param_copy,
                        DType copy_dtype, int64_t n, const AdamWStep& step, int num_threads);

}  // namespace dstrain
