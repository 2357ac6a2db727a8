// CUDA matmul through cuBLAS (cublasGemmEx, fp32 compute: F16/BF16 operands on tensor cores
// with fp32 accumulation, F32 operands in exact fp32 -- no TF32, like the CPU twin).
//
// Row-major to cuBLAS's column-major: a row-major (M,N) matrix is the column-major (N,M) matrix
// of the same memory, so C = op(A) @ op(B) row-major is C^T = op(B)^T @ op(A)^T column-major:
// swap the operands and keep each one's transpose flag.
//
// Storage dtypes are independent per tensor. cuBLAS wants both operands in one dtype and the
// output in that dtype or F32; anything else goes through fp32 scratch:
// - operands of different dtypes are both converted to F32 first (exact: every stored value is
//   an fp32 value);
// - an output whose dtype cuBLAS cannot write, or a bias of another dtype than the output, is
//   computed into fp32 scratch and rounded once by an epilogue kernel.
// A bias of the output's dtype is added by cuBLASLt's BIAS epilogue (cublasLtMatmul): the fp32
// sum plus the bias, rounded once, as the CPU does, with no extra pass over the output. Where
// cuBLASLt has no algorithm for the case, the bias is broadcast into the output first and added
// by the GEMM itself (beta = 1), with the same single rounding.
// dbias comes from the deterministic column sums of cuda_layernorm.cu.
//
// matmul_gelu_forward is that GEMM into pre_gelu, then the GELU kernel of cuda_elementwise.cu on
// the stored pre_gelu: bitwise matmul_forward + gelu_forward, as kernels/ops.h requires.
// cuBLASLt's GELU epilogues (GELU_AUX_BIAS: aux = pre-GELU matrix in D's dtype, ld a multiple
// of 8) are not used: their GELU -- the tanh approximation, as PyTorch's non-cuBLASLt fallback
// for the same epilogue assumes; cuBLAS's documentation names no formula -- reads the fp32 sum
// before it is rounded to pre_gelu's dtype and is computed with cuBLASLt's own tanh, so neither
// gelu_backward's input nor selective recompute (gelu_forward from the kept pre_gelu) would see
// the bits the forward used.
//
// matmul_fp8 is cuBLASLt's FP8 GEMM: row-major out (M,N) = a (M,K) b (N,K)^T is column-major
// out^T (N,M) = b (N,K) a^T, so cuBLASLt's A is our b, transposed (its stored (K,N) column-major
// matrix is b's rows), and its B is our a, not transposed: the "TN" form its FP8 kernels
// require. The scale_invs are its A and B scale pointers (read on the device when the GEMM
// runs); fp32 accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM off, which on Hopper would keep
// fewer bits of the partial sums); the BIAS epilogue for a bias; beta = 1 with C = D for
// `accumulate`. FP8 GEMMs run on sm_89 and later: elsewhere cuBLASLt offers no algorithm, and
// the call is an error naming the GPU.
//
// Determinism: cuBLASLt's algorithm comes from its heuristic for the call's shapes, dtypes,
// pointer alignments and our fixed workspace, with split-K partials only in fp32 (no in-place
// or output-dtype reductions): the same call gets the same algorithm, and the same bits.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/fp8_checks.h"

namespace dstrain::cuda {

namespace {

constexpr int kThreads = 256;

// op(X) of a row-major matrix: `data` holds X (or X^T when `transposed`) with leading dimension
// `ld`, in `dtype`. Mirrors the CPU twin's Operand.
struct Operand {
  const void* data;
  DType dtype;
  int64_t ld;
  bool transposed;
};

// c (M,N) row-major in c_dtype = op(a) (M,K) @ op(b) (K,N) + beta * c.
// REQUIRES: a.dtype == b.dtype, c_dtype is that dtype or F32.
void gemm(const CudaContext& ctx, void* c, DType c_dtype, int64_t M, int64_t N, int64_t K,
          Operand a, Operand b, float beta, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  DSTRAIN_CHECK(a.dtype == b.dtype && (c_dtype == a.dtype || c_dtype == DType::F32))
      << "gemm of " << dtype_name(a.dtype) << " x " << dtype_name(b.dtype) << " into "
      << dtype_name(c_dtype);
  DSTRAIN_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && a.ld <= INT_MAX && b.ld <= INT_MAX)
      << "matmul (" << M << ", " << N << ", " << K << ") too large for 32-bit cuBLAS sizes";
  // cublasSetStream resets the workspace to cuBLAS's own pool: set ours after it.
  CUBLAS_CHECK(cublasSetStream(ctx.cublas, stream));
  CUBLAS_CHECK(cublasSetWorkspace(ctx.cublas, ctx.cublas_workspace, ctx.cublas_workspace_bytes));
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasGemmEx(
      ctx.cublas, b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
      a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
      static_cast<int>(K), &alpha, b.data, cuda_data_type(b.dtype), static_cast<int>(b.ld), a.data,
      cuda_data_type(a.dtype), static_cast<int>(a.ld), &beta, c, cuda_data_type(c_dtype),
      static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Owns one cuBLASLt descriptor for the duration of a call: destroyed also when a check throws.
template <class Handle, cublasStatus_t (*destroy)(Handle)>
class LtOwned {
 public:
  LtOwned() = default;
  ~LtOwned() {
    if (handle_) destroy(handle_);
  }
  LtOwned(const LtOwned&) = delete;
  LtOwned& operator=(const LtOwned&) = delete;
  Handle* out() { return &handle_; }
  Handle get() const { return handle_; }

 private:
  Handle handle_ = nullptr;
};
using LtMatmulDesc = LtOwned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using LtLayout = LtOwned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using LtPreference = LtOwned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

// Attribute setters: the value's own type is the attribute's (cuBLASLt checks the size).
template <class T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                   const T& value) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof value));
}
template <class T>
void set_attribute(cublasLtMatmulPreference_t preference,
                   cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof value));
}

// The alignment of `data` in bytes, up to the 256 cuBLASLt's heuristic assumes by default: it
// must only offer algorithms that can read and write our (possibly offset) tensor views.
uint32_t alignment_of(const void* data) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// The preference of every cuBLASLt GEMM here: our workspace; split-K partials in fp32 only (no
// reduction in the output's dtype, in place or staged, like
// CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION on the cuBLAS handle); and the alignments of
// cuBLASLt's A and B operands and of its C = D.
void prepare_preference(LtPreference& preference, const CudaContext& ctx, const void* lt_a,
                        const void* lt_b, const void* d) {
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(preference.out()));
  set_attribute(preference.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                uint64_t{ctx.cublas_workspace_bytes});
  set_attribute(preference.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                uint32_t{CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE});
  set_attribute(preference.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(lt_a));
  set_attribute(preference.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(lt_b));
  set_attribute(preference.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(d));
  set_attribute(preference.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(d));
}

// c (M,N) row-major in c_dtype = op(a) (M,K) @ op(b) (K,N) + bias (N) broadcast over the rows,
// by cuBLASLt's BIAS epilogue (fp32 sum + bias, one rounding). Returns false, having enqueued
// nothing, when cuBLASLt has no algorithm for the case; the caller then takes the cuBLAS path.
// REQUIRES: a.dtype == b.dtype, c_dtype is that dtype or F32, bias (N) in c_dtype.
bool gemm_bias_lt(const CudaContext& ctx, void* c, DType c_dtype, int64_t M, int64_t N, int64_t K,
                  Operand a, Operand b, const void* bias, cudaStream_t stream) {
  // Column-major, as in gemm(): D (N,M) = op(b)^T (N,K) @ op(a)^T (K,M), D's rows the bias.
  LtMatmulDesc desc;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(desc.out(), CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA,
                static_cast<int32_t>(b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N));
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB,
                static_cast<int32_t>(a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N));
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, uint32_t{CUBLASLT_EPILOGUE_BIAS});
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  const auto rows = [](int64_t n) { return static_cast<uint64_t>(n); };
  LtLayout a_layout, b_layout, d_layout;  // cuBLASLt's A is our b, its B our a
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(a_layout.out(), cuda_data_type(b.dtype),
                                          rows(b.transposed ? K : N), rows(b.transposed ? N : K),
                                          b.ld));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(b_layout.out(), cuda_data_type(a.dtype),
                                          rows(a.transposed ? M : K), rows(a.transposed ? K : M),
                                          a.ld));
  CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(d_layout.out(), cuda_data_type(c_dtype), rows(N), rows(M), N));

  LtPreference preference;
  prepare_preference(preference, ctx, b.data, a.data, c);

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      ctx.cublaslt, desc.get(), a_layout.get(), b_layout.get(), d_layout.get(), d_layout.get(),
      preference.get(), 1, &heuristic, &found);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) {
    return false;
  }
  CUBLAS_CHECK(status);
  const float alpha = 1.0f, beta = 0.0f;  // host pointer mode: read before cublasLtMatmul returns
  CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt, desc.get(), &alpha, b.data, a_layout.get(), a.data,
                              b_layout.get(), &beta, c, d_layout.get(), c, d_layout.get(),
                              &heuristic.algo, ctx.cublas_workspace, ctx.cublas_workspace_bytes,
                              stream));
  return true;
}

// out (rows, cols) = bias (cols) broadcast, stored values copied as they are.
__global__ void broadcast_rows_kernel(DeviceTensor out, DeviceTensor bias, int64_t rows,
                                      int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store(out, i, load(bias, i % cols));
  }
}

// out (rows, cols) = round(acc + bias) (bias optional), or out = round(out + acc) when
// `accumulate`. acc (rows, cols) fp32.
__global__ void gemm_epilogue_kernel(DeviceTensor out, const float* acc, DeviceTensor bias,
                                     int64_t rows, int64_t cols, bool accumulate) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float value = acc[i];
    if (bias.data) value += load(bias, i % cols);
    if (accumulate) value = load(out, i) + value;
    store(out, i, value);
  }
}

// The operands of one GEMM in a dtype cuBLAS takes: as they are when both share one, else both
// converted to F32 scratch.
class GemmOperands {
 public:
  GemmOperands(const CudaContext& ctx, const Tensor& x, const Tensor& y, cudaStream_t stream)
      : x_(x), y_(y) {
    if (x.dtype == y.dtype) return;
    const size_t x_bytes = x.dtype == DType::F32 ? 0 : align_up(x.numel() * sizeof(float));
    const size_t y_bytes = y.dtype == DType::F32 ? 0 : align_up(y.numel() * sizeof(float));
    scratch_ = std::make_unique<Scratch>(ctx, x_bytes + y_bytes, stream);
    char* base = scratch_->as<char>();
    const Device device{Device::Kind::CUDA, ctx.device};
    if (x_bytes) {
      x_ = Tensor(base, DType::F32, {x.numel()}, device);
      copy_convert(ctx, x_, x.reshape({x.numel()}), stream);
    }
    if (y_bytes) {
      y_ = Tensor(base + x_bytes, DType::F32, {y.numel()}, device);
      copy_convert(ctx, y_, y.reshape({y.numel()}), stream);
    }
  }
  const Tensor& x() const { return x_; }
  const Tensor& y() const { return y_; }
  DType dtype() const { return x_.dtype; }

 private:
  Tensor x_, y_;
  std::unique_ptr<Scratch> scratch_;
};

// out (M,N) = op(a) @ op(b) [+ bias], or out += op(a) @ op(b) when `accumulate`, for any dtype of
// out and bias: directly into out when cuBLAS can write it, else through fp32 scratch.
void gemm_into(const CudaContext& ctx, const Tensor& out, int64_t M, int64_t N, int64_t K,
               Operand a, Operand b, DType operand_dtype, const Tensor& bias, bool accumulate,
               cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  const bool writable = out.dtype == operand_dtype || out.dtype == DType::F32;
  const bool bias_in_place = bias.empty() || bias.dtype == out.dtype;
  if (writable && bias_in_place) {
    if (!bias.empty() && !accumulate &&
        gemm_bias_lt(ctx, out.data, out.dtype, M, N, K, a, b, bias.data, stream)) {
      return;
    }
    if (!bias.empty()) {
      DSTRAIN_LAUNCH(broadcast_rows_kernel, grid_for(ctx, M * N, kThreads), kThreads, 0, stream)
      (device_tensor(out), device_tensor(bias), M, N);
      CUDA_CHECK_LAUNCH();
    }
    gemm(ctx, out.data, out.dtype, M, N, K, a, b, (accumulate || !bias.empty()) ? 1.0f : 0.0f,
         stream);
    return;
  }
  Scratch acc(ctx, static_cast<size_t>(M * N) * sizeof(float), stream);
  gemm(ctx, acc.as<float>(), DType::F32, M, N, K, a, b, 0.0f, stream);
  DSTRAIN_LAUNCH(gemm_epilogue_kernel, grid_for(ctx, M * N, kThreads), kThreads, 0, stream)
  (device_tensor(out), acc.as<float>(),
   bias.empty() ? DeviceTensor{nullptr, DType::F32} : device_tensor(bias), M, N, accumulate);
  CUDA_CHECK_LAUNCH();
}

struct MatmulShape {
  int64_t N, C, OC;
};

MatmulShape check_matmul(const CudaContext& ctx, const Tensor& inp, const Tensor& weight,
                         bool weight_out_by_in) {
  check_float_tensor(ctx, inp, "matmul inp");
  check_float_tensor(ctx, weight, "matmul weight");
  DSTRAIN_CHECK(weight.ndim == 2) << "matmul weight " << weight.shape_str() << " must be 2-D";
  const int64_t C = cols_of(inp);
  const int64_t weight_in = weight_out_by_in ? weight.shape[1] : weight.shape[0];
  const int64_t OC = weight_out_by_in ? weight.shape[0] : weight.shape[1];
  DSTRAIN_CHECK(C > 0 && weight_in == C)
      << "matmul inp " << inp.shape_str() << " does not match weight " << weight.shape_str()
      << (weight_out_by_in ? " (OC, C)" : " (C, OC)");
  return {rows_of(inp), C, OC};
}

void check_rows_cols(const CudaContext& ctx, const Tensor& t, const char* name, int64_t rows,
                     int64_t cols) {
  check_float_tensor(ctx, t, name);
  DSTRAIN_CHECK(cols_of(t) == cols && rows_of(t) == rows)
      << name << " " << t.shape_str() << " must be (" << rows << ", " << cols << ")";
}

}  // namespace

void matmul_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                    bool weight_out_by_in, cudaStream_t stream) {
  const MatmulShape s = check_matmul(ctx, inp, weight, weight_out_by_in);
  check_rows_cols(ctx, out, "matmul out", s.N, s.OC);
  if (!bias.empty()) {
    check_float_tensor(ctx, bias, "matmul bias");
    DSTRAIN_CHECK(bias.numel() == s.OC)
        << "matmul bias " << bias.shape_str() << " must have " << s.OC << " elements";
  }
  const GemmOperands ops(ctx, inp, weight, stream);
  // out = inp @ weight (C,OC), or inp @ weight^T for weight (OC,C).
  const Operand a{ops.x().data, ops.dtype(), s.C, false};
  const Operand b = weight_out_by_in ? Operand{ops.y().data, ops.dtype(), s.C, true}
                                     : Operand{ops.y().data, ops.dtype(), s.OC, false};
  gemm_into(ctx, out, s.N, s.OC, s.C, a, b, ops.dtype(), bias, false, stream);
}

void matmul_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                     Tensor inp, Tensor weight, bool weight_out_by_in, cudaStream_t stream) {
  const MatmulShape s = check_matmul(ctx, inp, weight, weight_out_by_in);
  check_rows_cols(ctx, dout, "matmul dout", s.N, s.OC);
  if (!dinp.empty()) check_rows_cols(ctx, dinp, "matmul dinp", s.N, s.C);
  check_float_tensor(ctx, dweight, "matmul dweight");
  DSTRAIN_CHECK(dweight.ndim == 2 && dweight.shape[0] == weight.shape[0] &&
                dweight.shape[1] == weight.shape[1])
      << "matmul dweight " << dweight.shape_str() << " must match weight " << weight.shape_str();
  if (!dbias.empty()) {
    check_float_tensor(ctx, dbias, "matmul dbias");
    DSTRAIN_CHECK(dbias.numel() == s.OC)
        << "matmul dbias " << dbias.shape_str() << " must have " << s.OC << " elements";
  }
  if (!dinp.empty()) {
    // dinp (N,C) = dout (N,OC) @ W^T: weight (C,OC) transposed, or weight (OC,C) as is.
    const GemmOperands ops(ctx, dout, weight, stream);
    const Operand a{ops.x().data, ops.dtype(), s.OC, false};
    const Operand b = weight_out_by_in ? Operand{ops.y().data, ops.dtype(), s.C, false}
                                       : Operand{ops.y().data, ops.dtype(), s.OC, true};
    gemm_into(ctx, dinp, s.N, s.C, s.OC, a, b, ops.dtype(), Tensor(), false, stream);
  }
  {
    const GemmOperands ops(ctx, dout, inp, stream);  // x: dout (N,OC), y: inp (N,C)
    if (weight_out_by_in) {
      // dweight (OC,C) += dout^T (OC,N) @ inp (N,C)
      gemm_into(ctx, dweight, s.OC, s.C, s.N, Operand{ops.x().data, ops.dtype(), s.OC, true},
                Operand{ops.y().data, ops.dtype(), s.C, false}, ops.dtype(), Tensor(), true,
                stream);
    } else {
      // dweight (C,OC) += inp^T (C,N) @ dout (N,OC)
      gemm_into(ctx, dweight, s.C, s.OC, s.N, Operand{ops.y().data, ops.dtype(), s.C, true},
                Operand{ops.x().data, ops.dtype(), s.OC, false}, ops.dtype(), Tensor(), true,
                stream);
    }
  }
  if (!dbias.empty()) column_sums_accumulate(ctx, dbias, dout, stream);
}

void matmul_fp8(const CudaContext& ctx, Tensor out, Tensor a, Tensor a_scale_inv, Tensor b,
                Tensor b_scale_inv, Tensor bias, bool accumulate, cudaStream_t stream) {
  const Fp8MatmulShape s = check_matmul_fp8(out, a, a_scale_inv, b, b_scale_inv, bias, accumulate);
  for (const Tensor* t : {&a, &b, &a_scale_inv, &b_scale_inv}) {
    check_tensor_dtype(ctx, *t, t->dtype, "matmul_fp8 operand");
  }
  check_float_tensor(ctx, out, "matmul_fp8 out");
  if (!bias.empty()) check_float_tensor(ctx, bias, "matmul_fp8 bias");
  if (s.M == 0) return;
  DSTRAIN_CHECK(s.M <= INT_MAX && s.N <= INT_MAX && s.K <= INT_MAX)
      << "matmul_fp8 (" << s.M << ", " << s.N << ", " << s.K << ") too large for cuBLASLt";
  LtMatmulDesc desc;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(desc.out(), CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, int32_t{CUBLAS_OP_T});
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, int32_t{CUBLAS_OP_N});
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale_inv.data);
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale_inv.data);
  set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{0});
  if (!bias.empty()) {
    set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, uint32_t{CUBLASLT_EPILOGUE_BIAS});
    set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias.data));
  }
  const auto size = [](int64_t n) { return static_cast<uint64_t>(n); };
  LtLayout a_layout, b_layout, d_layout;  // cuBLASLt's A is our b, its B our a
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(a_layout.out(), cuda_data_type(b.dtype), size(s.K),
                                          size(s.N), s.K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(b_layout.out(), cuda_data_type(a.dtype), size(s.K),
                                          size(s.M), s.K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(d_layout.out(), cuda_data_type(out.dtype), size(s.N),
                                          size(s.M), s.N));
  LtPreference preference;
  prepare_preference(preference, ctx, b.data, a.data, out.data);
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      ctx.cublaslt, desc.get(), a_layout.get(), b_layout.get(), d_layout.get(), d_layout.get(),
      preference.get(), 1, &heuristic, &found);
  DSTRAIN_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0)
      << "cuBLASLt has no FP8 GEMM for (" << s.M << ", " << s.N << ", " << s.K << ") "
      << dtype_name(a.dtype) << " x " << dtype_name(b.dtype) << " into " << dtype_name(out.dtype)
      << " on this GPU (FP8 tensor cores need sm_89 or later; status " << status << ")";
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt, desc.get(), &alpha, b.data, a_layout.get(), a.data,
                              b_layout.get(), &beta, out.data, d_layout.get(), out.data,
                              d_layout.get(), &heuristic.algo, ctx.cublas_workspace,
                              ctx.cublas_workspace_bytes, stream));
}

void matmul_gelu_forward(const CudaContext& ctx, Tensor out, Tensor pre_gelu, Tensor inp,
                         Tensor weight, Tensor bias, cudaStream_t stream) {
  const MatmulShape s = check_matmul(ctx, inp, weight, false);
  check_rows_cols(ctx, out, "matmul_gelu out", s.N, s.OC);
  DSTRAIN_CHECK(!overlaps(out, pre_gelu))
      << "matmul_gelu out " << out.shape_str() << " overlaps pre_gelu " << pre_gelu.shape_str();
  // pre_gelu (N,OC) = inp @ weight + bias (the BIAS epilogue), then the GELU kernel on the
  // stored pre_gelu: the same two launchers as matmul_forward + gelu_forward, so the same bits.
  matmul_forward(ctx, pre_gelu, inp, weight, bias, false, stream);
  gelu_forward(ctx, out, pre_gelu, stream);
}

}  // namespace dstrain::cuda
