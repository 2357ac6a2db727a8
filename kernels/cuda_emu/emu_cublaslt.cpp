// cuBLASLt as the CUDA emulator provides it, with the toolkit's own declarations (cublasLt.h):
// handles, matmul / layout / preference descriptors, a heuristic that offers one algorithm, and
// cublasLtMatmul as the reference GEMM of emu_blas.h queued on the stream. What the CUDA backend
// uses is modelled -- fp32 compute and scale, F32/F16/BF16 storage (A and B alike, D in their
// type or F32), column-major single matrices, host alpha/beta, the DEFAULT and BIAS epilogues,
// and the FP8 GEMM as cuBLASLt documents its requirements (A and B E4M3/E5M2, not both E5M2, in
// the "TN" form, leading dimensions multiples of 16, 16-byte aligned; C = D of F32/F16/BF16; the
// A and B scale pointers, device floats read when the GEMM runs: D = alpha * scaleA * scaleB *
// sum + beta * C [+ bias]; FAST_ACCUM accepted, the sum being fp32 in k order either way) --
// and anything else is refused with CUBLAS_STATUS_NOT_SUPPORTED (an attribute the shim does not
// model included), so a backend that starts using more fails loudly here first.
// The algorithm remembers the pointer alignments the heuristic was told; cublasLtMatmul refuses
// (CUBLAS_STATUS_INVALID_VALUE) pointers less aligned than that, the case where a real cuBLASLt
// kernel would read out of bounds or fault.
#include <cublasLt.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda_emu/emu_blas.h"
#include "kernels/cuda_emu/emu_runtime.h"

// The handle: the emulated cuBLASLt has no state of its own.
struct cublasLtContext {};

namespace {

using dstrain::emu::blas_type_fp8;
using dstrain::emu::blas_type_supported;
using dstrain::emu::BlasMatrix;

struct MatmulDesc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int32_t bias_type = -1;  // -1: D's type
  const float* a_scale = nullptr;  // FP8 only: device pointers, null meaning 1
  const float* b_scale = nullptr;
  int8_t fast_accum = 0;
};

struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t order = CUBLASLT_ORDER_COL;
  int32_t batch_count = 1;
};

// The minimum alignments (bytes) the heuristic may assume, indexed A, B, C, D.
struct Preference {
  uint64_t max_workspace = 0;
  uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_MASK;
  uint32_t min_alignment[4] = {256, 256, 256, 256};
};

// What the heuristic's one algorithm holds in cublasLtMatmulAlgo_t::data.
constexpr uint64_t kAlgoTag = 0x656d752d6c74ull;  // "emu-lt"
enum AlgoSlot { kTag = 0, kAlignA = 1 };          // kAlignA + 0..3: A, B, C, D

MatmulDesc* state(cublasLtMatmulDesc_t desc) { return reinterpret_cast<MatmulDesc*>(desc); }
Layout* state(cublasLtMatrixLayout_t layout) { return reinterpret_cast<Layout*>(layout); }
Preference* state(cublasLtMatmulPreference_t pref) { return reinterpret_cast<Preference*>(pref); }

// Copies an attribute value of type T from the caller's buffer, checking its size as cuBLASLt
// does.
template <class T>
cublasStatus_t read_attribute(T& field, const void* buf, size_t size) {
  if (!buf || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

bool is_operation(int32_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; }

// An FP8 GEMM's own requirements (cuBLASLt's documentation: "TN", types, 16-element leading
// dimensions), when A or B is FP8.
cublasStatus_t check_fp8_problem(const MatmulDesc& desc, const Layout& a, const Layout& b,
                                 const Layout& c, const Layout& d) {
  if (!blas_type_fp8(a.type) || !blas_type_fp8(b.type) ||
      (a.type == CUDA_R_8F_E5M2 && b.type == CUDA_R_8F_E5M2) || !blas_type_supported(c.type) ||
      c.type != d.type) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (desc.transa != CUBLAS_OP_T || desc.transb != CUBLAS_OP_N) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (a.ld % 16 != 0 || b.ld % 16 != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

// The GEMM a descriptor and its layouts describe, when the shim can compute it.
cublasStatus_t check_problem(const MatmulDesc& desc, const Layout& a, const Layout& b,
                             const Layout& c, const Layout& d) {
  if (desc.compute != CUBLAS_COMPUTE_32F || desc.scale != CUDA_R_32F ||
      desc.pointer_mode != CUBLASLT_POINTER_MODE_HOST) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const bool fp8 = blas_type_fp8(a.type) || blas_type_fp8(b.type);
  for (const Layout* layout : {&a, &b, &c, &d}) {
    const bool operand = layout == &a || layout == &b;
    if (layout->order != CUBLASLT_ORDER_COL || layout->batch_count != 1 ||
        !(blas_type_supported(layout->type) || (fp8 && operand && blas_type_fp8(layout->type)))) {
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (layout->ld < static_cast<int64_t>(layout->rows)) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (fp8) {
    const cublasStatus_t status = check_fp8_problem(desc, a, b, c, d);
    if (status != CUBLAS_STATUS_SUCCESS) return status;
  } else if (a.type != b.type || c.type != d.type ||
             (d.type != a.type && d.type != CUDA_R_32F) || desc.a_scale || desc.b_scale) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (desc.epilogue == CUBLASLT_EPILOGUE_BIAS) {
    if (desc.bias_type != -1 && desc.bias_type != d.type) return CUBLAS_STATUS_NOT_SUPPORTED;
  } else if (desc.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  // op(A) (m,k) @ op(B) (k,n) into C, D (m,n).
  const bool ta = desc.transa == CUBLAS_OP_T, tb = desc.transb == CUBLAS_OP_T;
  const uint64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols;
  const uint64_t b_k = tb ? b.cols : b.rows, n = tb ? b.rows : b.cols;
  if (b_k != k || c.rows != m || c.cols != n || d.rows != m || d.cols != n) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}

bool aligned(const void* data, uint64_t alignment) {
  return reinterpret_cast<uintptr_t>(data) % alignment == 0;
}

}  // namespace

extern "C" {

cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasLtDestroy(cublasLtHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc,
                                                     cublasComputeType_t compute_type,
                                                     cudaDataType_t scale_type) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(new MatmulDesc{compute_type, scale_type});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete state(desc);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                           cublasLtMatmulDescAttributes_t attr,
                                                           const void* buf, size_t size) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  MatmulDesc& d = *state(desc);
  cublasStatus_t status = CUBLAS_STATUS_NOT_SUPPORTED;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      return read_attribute(d.pointer_mode, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
      int32_t& op = attr == CUBLASLT_MATMUL_DESC_TRANSA ? d.transa : d.transb;
      status = read_attribute(op, buf, size);
      return status == CUBLAS_STATUS_SUCCESS && !is_operation(op) ? CUBLAS_STATUS_NOT_SUPPORTED
                                                                   : status;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return read_attribute(d.epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return read_attribute(d.bias, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      return read_attribute(d.bias_type, buf, size);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
      return read_attribute(d.a_scale, buf, size);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      return read_attribute(d.b_scale, buf, size);
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM:
      return read_attribute(d.fast_accum, buf, size);
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout,
                                                       cudaDataType type, uint64_t rows,
                                                       uint64_t cols, int64_t ld) {
  if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete state(layout);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                             cublasLtMatrixLayoutAttribute_t attr,
                                                             const void* buf, size_t size) {
  if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
  Layout& l = *state(layout);
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: {
      uint32_t type = 0;
      const cublasStatus_t status = read_attribute(type, buf, size);
      if (status == CUBLAS_STATUS_SUCCESS) l.type = static_cast<cudaDataType_t>(type);
      return status;
    }
    case CUBLASLT_MATRIX_LAYOUT_ORDER:
      return read_attribute(l.order, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
      return read_attribute(l.batch_count, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_ROWS:
      return read_attribute(l.rows, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_COLS:
      return read_attribute(l.cols, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_LD:
      return read_attribute(l.ld, buf, size);
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(new Preference);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete state(pref);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(
    cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
    size_t size) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  Preference& p = *state(pref);
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      return read_attribute(p.max_workspace, buf, size);
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      return read_attribute(p.reduction_mask, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      return read_attribute(p.min_alignment[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf,
                            size);
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

// One algorithm (no split-K, no workspace) for every problem the shim computes; none
// (CUBLAS_STATUS_NOT_SUPPORTED, as cuBLASLt when it finds none) for the rest.
cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t results[],
    int* returned) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!desc || !a || !b || !c || !d || !pref || requested <= 0 || !results || !returned) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  *returned = 0;
  const cublasStatus_t status =
      check_problem(*state(desc), *state(a), *state(b), *state(c), *state(d));
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  // FP8 kernels read A and B in 16-byte pieces: none for operands the caller cannot align so.
  if (blas_type_fp8(state(a)->type) &&
      (state(pref)->min_alignment[0] < 16 || state(pref)->min_alignment[1] < 16)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  cublasLtMatmulHeuristicResult_t& result = results[0];
  result = cublasLtMatmulHeuristicResult_t{};
  result.algo.data[kTag] = kAlgoTag;
  for (int i = 0; i < 4; ++i) result.algo.data[kAlignA + i] = state(pref)->min_alignment[i];
  result.workspaceSize = 0;
  result.state = CUBLAS_STATUS_SUCCESS;
  result.wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

// D = alpha * op(A) @ op(B) + beta * C [+ bias], queued on `stream`. alpha and beta are read
// now (host pointer mode); everything the GEMM needs is captured by value.
cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                           const void* alpha, const void* A,
                                           cublasLtMatrixLayout_t a_layout, const void* B,
                                           cublasLtMatrixLayout_t b_layout, const void* beta,
                                           const void* C, cublasLtMatrixLayout_t c_layout, void* D,
                                           cublasLtMatrixLayout_t d_layout,
                                           const cublasLtMatmulAlgo_t* algo, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!desc || !alpha || !beta || !a_layout || !b_layout || !c_layout || !d_layout || !algo ||
      algo->data[kTag] != kAlgoTag) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const MatmulDesc op = *state(desc);
  const Layout a = *state(a_layout), b = *state(b_layout), c = *state(c_layout),
               d = *state(d_layout);
  const cublasStatus_t status = check_problem(op, a, b, c, d);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (op.epilogue == CUBLASLT_EPILOGUE_BIAS && !op.bias) return CUBLAS_STATUS_INVALID_VALUE;
  const float alpha_value = *static_cast<const float*>(alpha);
  const float beta_value = *static_cast<const float*>(beta);
  if (d.rows == 0 || d.cols == 0) return CUBLAS_STATUS_SUCCESS;
  if (!A || !B || !D || (beta_value != 0.0f && !C)) return CUBLAS_STATUS_INVALID_VALUE;
  const void* pointers[4] = {A, B, beta_value != 0.0f ? C : D, D};
  for (int i = 0; i < 4; ++i) {
    if (!aligned(pointers[i], algo->data[kAlignA + i])) return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool with_bias = op.epilogue == CUBLASLT_EPILOGUE_BIAS;
  const bool ta = op.transa == CUBLAS_OP_T, tb = op.transb == CUBLAS_OP_T;
  const int64_t m = static_cast<int64_t>(d.rows), n = static_cast<int64_t>(d.cols);
  const int64_t k = static_cast<int64_t>(ta ? a.rows : a.cols);
  const BlasMatrix a_matrix{A, a.type, a.ld, ta}, b_matrix{B, b.type, b.ld, tb};
  const BlasMatrix c_matrix{C, c.type, c.ld}, bias{op.bias, d.type, 1};
  const float* a_scale = op.a_scale;
  const float* b_scale = op.b_scale;
  dstrain::emu::enqueue(stream, [=] {
    // The scales as the GEMM runs (written by earlier work on the stream).
    const float scale = (a_scale ? *a_scale : 1.0f) * (b_scale ? *b_scale : 1.0f);
    dstrain::emu::reference_gemm(m, n, k, alpha_value * scale, a_matrix, b_matrix, beta_value,
                                 c_matrix, D, d.type, d.ld, with_bias ? &bias : nullptr);
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
