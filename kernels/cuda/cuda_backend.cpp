// The CUDA backend: the Backend class (device, streams, cuBLAS handle, scratch pool, device
// error word) and the helpers of cuda_ops.h. The kernels live in the .cu files.
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"

namespace dstrain::cuda {

bool is_float_dtype(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16;
}

static void check_on_device(const CudaContext& ctx, const Tensor& t, const char* name) {
  DSTRAIN_CHECK(!t.empty()) << name << " is empty";
  DSTRAIN_CHECK(t.device.is_cuda() && t.device.index == ctx.device)
      << name << " " << t.shape_str() << " is on " << t.device.str()
      << ", the CUDA backend of cuda:" << ctx.device << " needs memory of that GPU";
}

void check_float_tensor(const CudaContext& ctx, const Tensor& t, const char* name) {
  check_on_device(ctx, t, name);
  DSTRAIN_CHECK(is_float_dtype(t.dtype))
      << name << " " << t.shape_str() << " must be F32, F16 or BF16";
}

void check_tensor_dtype(const CudaContext& ctx, const Tensor& t, DType dtype, const char* name) {
  check_on_device(ctx, t, name);
  DSTRAIN_CHECK(t.dtype == dtype) << name << " " << t.shape_str() << " must be "
                                  << dtype_name(dtype);
}

void check_residual_operands(const CudaContext& ctx, const Tensor& residual, const Tensor& a,
                             const Tensor& b) {
  check_float_tensor(ctx, residual, "residual");
  check_float_tensor(ctx, a, "residual a");
  check_float_tensor(ctx, b, "residual b");
  check_residual_shapes(residual, a, b);
}

void check_same_numel(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name) {
  DSTRAIN_CHECK(a.numel() == b.numel())
      << a_name << " " << a.shape_str() << " and " << b_name << " " << b.shape_str()
      << " must have the same number of elements";
}

int64_t cols_of(const Tensor& t) { return t.ndim == 0 ? 1 : t.shape[t.ndim - 1]; }

int64_t rows_of(const Tensor& t) {
  const int64_t cols = cols_of(t);
  return cols == 0 ? 0 : t.numel() / cols;
}

Scratch::Scratch(const CudaContext& ctx, size_t bytes, cudaStream_t stream) : stream_(stream) {
  if (bytes > 0) CUDA_CHECK(cudaMallocFromPoolAsync(&data_, bytes, ctx.scratch_pool, stream));
}

Scratch::~Scratch() {
  // A destructor must not throw; a failure here means the context is broken and the next
  // checked call reports it.
  if (data_) cudaFreeAsync(data_, stream_);
}

void* pinned_readback(size_t bytes) {
  // One per host thread, freed when the thread ends (best effort: at process exit the runtime
  // may already be gone).
  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
    ~Buffer() {
      if (data) cudaFreeHost(data);
    }
  };
  thread_local Buffer buffer;
  if (bytes > buffer.bytes) {
    if (buffer.data) CUDA_CHECK(cudaFreeHost(buffer.data));
    buffer.data = nullptr;
    buffer.bytes = 0;
    const size_t grown = std::max<size_t>(bytes, 4096);
    CUDA_CHECK(cudaHostAlloc(&buffer.data, grown, cudaHostAllocPortable));
    buffer.bytes = grown;
  }
  return buffer.data;
}

namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // what cuBLAS asks for on Hopper
// The pool keeps up to this much freed scratch instead of returning it to the driver at each
// synchronization: the next step's scratch is then a pool hit, not a cudaMalloc.
constexpr uint64_t kScratchPoolKeepBytes = uint64_t{256} << 20;

// Makes the backend's device current for the calling thread before an op (and leaves it
// current: a rank thread works on one device), so a thread that switched devices cannot launch
// on the wrong GPU.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    int current = -1;
    CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) CUDA_CHECK(cudaSetDevice(device));
  }
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) {
    try {
      initialize(device);
    } catch (...) {
      release();  // a half-built backend must not leak its handle, pool or workspace
      throw;
    }
  }

  ~CudaBackend() override { release(); }

 private:
  void initialize(int device) {
    int count = 0;
    const cudaError_t probe = cudaGetDeviceCount(&count);
    if (probe != cudaSuccess) {
      cudaGetLastError();
      DSTRAIN_CHECK(false) << "no usable CUDA device for the CUDA backend: "
                           << cudaGetErrorString(probe);
    }
    DSTRAIN_CHECK(device >= 0 && device < count)
        << "CUDA device " << device << " does not exist (" << count << " devices)";
    ctx_.device = device;
    DeviceScope scope(device);
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    ctx_.sm_count = prop.multiProcessorCount;
    name_ = "cuda:" + std::to_string(device) + " (" + prop.name + ", sm_" +
            std::to_string(prop.major) + std::to_string(prop.minor) + ", cuBLAS)";

    CUBLAS_CHECK(cublasCreate(&ctx_.cublas));
    // No TF32 (F32 GEMMs stay exact fp32 like the CPU twin), fp32 accumulation, and no
    // reduced-precision split-K reductions for fp16 outputs.
    CUBLAS_CHECK(cublasSetMathMode(
        ctx_.cublas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                               CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    // cuBLASLt for the GEMMs with a bias epilogue; no state of its own besides the handle.
    CUBLAS_CHECK(cublasLtCreate(&ctx_.cublaslt));
    // A workspace of our own: cuBLAS then picks the same algorithm on every stream, which keeps
    // its results bitwise reproducible.
    CUDA_CHECK(cudaMalloc(&ctx_.cublas_workspace, kCublasWorkspaceBytes));
    ctx_.cublas_workspace_bytes = kCublasWorkspaceBytes;

    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    CUDA_CHECK(cudaMemPoolCreate(&ctx_.scratch_pool, &props));
    uint64_t keep = kScratchPoolKeepBytes;
    CUDA_CHECK(cudaMemPoolSetAttribute(ctx_.scratch_pool, cudaMemPoolAttrReleaseThreshold, &keep));

    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ctx_.error_word), sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(ctx_.error_word, 0, sizeof(unsigned)));
    // That memset is on the legacy stream, which the backend's non-blocking streams do not
    // wait for: finish it before any of them reads the word.
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Best effort: called from the destructor (which must not throw); a broken context cannot be
  // repaired here.
  void release() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != ctx_.device)
      cudaSetDevice(ctx_.device);
    cudaDeviceSynchronize();  // no kernel of ours may still use what is freed below
    if (ctx_.error_word) cudaFree(ctx_.error_word);
    if (ctx_.scratch_pool) cudaMemPoolDestroy(ctx_.scratch_pool);
    if (ctx_.cublas) cublasDestroy(ctx_.cublas);
    if (ctx_.cublaslt) cublasLtDestroy(ctx_.cublaslt);
    if (ctx_.cublas_workspace) cudaFree(ctx_.cublas_workspace);
    ctx_ = CudaContext{};
    cudaGetLastError();
  }

 public:
  Device device() const override { return Device{Device::Kind::CUDA, ctx_.device}; }
  std::string name() const override { return name_; }

  void synchronize(Stream stream) override {
    DeviceScope scope(ctx_.device);
    check_error_word(to_stream(stream));
  }

  // Streams and events of this backend's device.
  Stream create_stream() override {
    DeviceScope scope(ctx_.device);
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  }
  void destroy_stream(Stream stream) override {
    if (stream == nullptr) return;
    DeviceScope scope(ctx_.device);
    cudaStreamDestroy(to_stream(stream));  // best effort: called from destructors
  }
  Event create_event() override {
    DeviceScope scope(ctx_.device);
    cudaEvent_t event = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  void destroy_event(Event event) override {
    if (event == nullptr) return;
    DeviceScope scope(ctx_.device);
    cudaEventDestroy(static_cast<cudaEvent_t>(event));  // best effort: called from destructors
  }
  void record_event(Event event, Stream stream) override {
    DeviceScope scope(ctx_.device);
    CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), to_stream(stream)));
  }
  void wait_event(Stream stream, Event event) override {
    DeviceScope scope(ctx_.device);
    CUDA_CHECK(cudaStreamWaitEvent(to_stream(stream), static_cast<cudaEvent_t>(event), 0));
  }
  void synchronize_event(Event event) override {
    DeviceScope scope(ctx_.device);
    CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }
  Event create_timing_event() override {
    DeviceScope scope(ctx_.device);
    cudaEvent_t event = nullptr;
    CUDA_CHECK(cudaEventCreate(&event));
    return event;
  }
  double elapsed_seconds(Event start, Event end) override {
    DeviceScope scope(ctx_.device);
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start),
                                    static_cast<cudaEvent_t>(end)));
    return 1e-3 * static_cast<double>(ms);
  }

  void fill_zero(Tensor t, Stream stream) override {
    if (t.empty() || t.numel() == 0) return;
    DeviceScope scope(ctx_.device);
    DSTRAIN_CHECK(t.device.is_cuda() && t.device.index == ctx_.device)
        << "fill_zero of " << t.shape_str() << " on " << t.device.str();
    // All-zero bits are +0 in every dtype.
    CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), to_stream(stream)));
  }

  void copy(Tensor dst, Tensor src, Stream stream) override {
    DSTRAIN_CHECK(dst.numel() == src.numel())
        << "copy of " << src.shape_str() << " into " << dst.shape_str();
    if (dst.numel() == 0) return;
    DSTRAIN_CHECK(!dst.empty() && !src.empty()) << "copy with an empty tensor";
    DeviceScope scope(ctx_.device);
    if (dst.dtype == src.dtype) {
      // Same dtype: bytes, and then either side may be host memory too.
      if (dst.data != src.data) {
        CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDefault,
                                   to_stream(stream)));
      }
      return;
    }
    cuda::copy_convert(ctx_, dst, src, to_stream(stream));
  }

  void copy_bytes(void* dst, const void* src, size_t bytes, Stream stream) override {
    if (bytes == 0 || dst == src) return;
    DSTRAIN_CHECK(dst != nullptr && src != nullptr) << "copy_bytes of " << bytes << " bytes";
    DeviceScope scope(ctx_.device);
    // cudaMemcpyDefault: the direction follows from the pointers (unified addressing).
    // Pageable host memory makes the copy synchronous; pinned memory keeps it asynchronous.
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, to_stream(stream)));
  }

  using Backend::attention_backward;
  using Backend::attention_forward;
  using Backend::embedding_backward;
  using Backend::embedding_forward;
  using Backend::rope_backward;
  using Backend::rope_forward;
  void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                         int64_t vocab_begin, int64_t vocab_rows, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::embedding_forward(ctx_, out, tokens, positions, wte, wpe, vocab_begin, vocab_rows,
                            to_stream(stream));
  }
  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                          int64_t vocab_begin, int64_t vocab_rows, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::embedding_backward(ctx_, dwte, dwpe, dout, tokens, positions, vocab_begin, vocab_rows,
                             to_stream(stream));
  }
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::layernorm_forward(ctx_, out, mean, rstd, inp, weight, bias, to_stream(stream));
  }
  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::layernorm_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                             to_stream(stream));
  }
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps,
                       Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::rmsnorm_forward(ctx_, out, rstd, inp, weight, eps, to_stream(stream));
  }
  void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                        Tensor rstd, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::rmsnorm_backward(ctx_, dinp, dweight, dout, inp, weight, rstd, to_stream(stream));
  }
  void moe_route(Tensor topk_weight, Tensor topk_expert, Tensor scores, Tensor logits,
                 const MoeRouting& routing, Stream stream) override {
    cuda::moe_route(ctx_, topk_weight, topk_expert, scores, logits, routing, to_stream(stream));
  }
  void moe_route_backward(Tensor dlogits, Tensor dtopk_weight, Tensor dscores, Tensor scores,
                          Tensor topk_expert, const MoeRouting& routing, Stream stream) override {
    cuda::moe_route_backward(ctx_, dlogits, dtopk_weight, dscores, scores, topk_expert, routing,
                             to_stream(stream));
  }
  void moe_dispatch(Tensor expert_offsets, Tensor source_rows, Tensor dest_rows,
                    Tensor topk_expert, int experts, Stream stream) override {
    cuda::moe_dispatch(ctx_, expert_offsets, source_rows, dest_rows, topk_expert, experts,
                       to_stream(stream));
  }
  void moe_gather(Tensor out, Tensor inp, Tensor source_rows, Stream stream) override {
    cuda::moe_gather(ctx_, out, inp, source_rows, to_stream(stream));
  }
  void moe_combine(Tensor out, Tensor inp, Tensor dest_rows, Tensor weight,
                   Stream stream) override {
    cuda::moe_combine(ctx_, out, inp, dest_rows, weight, to_stream(stream));
  }
  void moe_combine_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                            Tensor dest_rows, Tensor weight, Stream stream) override {
    cuda::moe_combine_backward(ctx_, dinp, dweight, dout, inp, dest_rows, weight,
                               to_stream(stream));
  }
  void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor expert_offsets,
                              Stream stream) override {
    cuda::grouped_matmul_forward(ctx_, out, inp, weight, expert_offsets, to_stream(stream));
  }
  void grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                               Tensor weight, Tensor expert_offsets, Stream stream) override {
    cuda::grouped_matmul_backward(ctx_, dinp, dweight, dout, inp, weight, expert_offsets,
                                  to_stream(stream));
  }
  void fp8_quantize(Tensor out, Tensor out_t, Tensor scale_inv, Tensor inp, Tensor amax,
                    Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::fp8_quantize(ctx_, out, out_t, scale_inv, inp, amax, to_stream(stream));
  }
  void fp8_amax(Tensor amax, Tensor inp, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::fp8_amax(ctx_, amax, inp, to_stream(stream));
  }
  void matmul_fp8(Tensor out, Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv,
                  Tensor bias, bool accumulate, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::matmul_fp8(ctx_, out, a, a_scale_inv, b, b_scale_inv, bias, accumulate,
                     to_stream(stream));
  }
  void swiglu_forward(Tensor out, Tensor inp, Tensor amax, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::swiglu_forward(ctx_, out, inp, amax, to_stream(stream));
  }
  void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp, Tensor amax, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::swiglu_backward(ctx_, dinp, dout, inp, amax, to_stream(stream));
  }
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, bool weight_out_by_in,
                      Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::matmul_forward(ctx_, out, inp, weight, bias, weight_out_by_in, to_stream(stream));
  }
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, bool weight_out_by_in, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::matmul_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, weight_out_by_in,
                          to_stream(stream));
  }
  void bias_backward(Tensor dbias, Tensor dout, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::column_sums_accumulate(ctx_, dbias, dout, to_stream(stream));
  }
  void matmul_gelu_forward(Tensor out, Tensor pre_gelu, Tensor inp, Tensor weight, Tensor bias,
                           Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::matmul_gelu_forward(ctx_, out, pre_gelu, inp, weight, bias, to_stream(stream));
  }
  void attention_forward(Tensor out, Tensor lse, Tensor qkv, Tensor positions, int n_head,
                         int n_kv_head, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::attention_forward(ctx_, out, lse, qkv, positions, n_head, n_kv_head, to_stream(stream));
  }
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                          Tensor positions, int n_head, int n_kv_head, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::attention_backward(ctx_, dqkv, dout, qkv, out, lse, positions, n_head, n_kv_head,
                             to_stream(stream));
  }
  void rope_forward(Tensor qkv, Tensor freqs, Tensor positions, int n_head, int n_kv_head,
                    Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::rope(ctx_, qkv, freqs, positions, n_head, n_kv_head, false, to_stream(stream));
  }
  void rope_backward(Tensor dqkv, Tensor freqs, Tensor positions, int n_head, int n_kv_head,
                     Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::rope(ctx_, dqkv, freqs, positions, n_head, n_kv_head, true, to_stream(stream));
  }
  void mla_pack(Tensor qkv, Tensor q, Tensor kv, Tensor k_rope, Tensor freqs, Tensor positions,
                const MlaHeads& heads, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::mla_pack(ctx_, qkv, q, kv, k_rope, freqs, positions, heads, to_stream(stream));
  }
  void mla_pack_backward(Tensor dq, Tensor dkv, Tensor dk_rope, Tensor dqkv, Tensor freqs,
                         Tensor positions, const MlaHeads& heads, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::mla_pack_backward(ctx_, dq, dkv, dk_rope, dqkv, freqs, positions, heads,
                            to_stream(stream));
  }
  void mla_unpad(Tensor out, Tensor atty, const MlaHeads& heads, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::mla_unpad(ctx_, out, atty, heads, to_stream(stream));
  }
  void mla_unpad_backward(Tensor datty, Tensor dout, const MlaHeads& heads, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::mla_unpad_backward(ctx_, datty, dout, heads, to_stream(stream));
  }
  void gelu_forward(Tensor out, Tensor inp, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::gelu_forward(ctx_, out, inp, to_stream(stream));
  }
  void gelu_backward(Tensor dinp, Tensor dout, Tensor inp, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::gelu_backward(ctx_, dinp, dout, inp, to_stream(stream));
  }
  void gelu_backward_bias(Tensor dinp, Tensor dbias, Tensor dout, Tensor inp,
                          Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::gelu_backward_bias(ctx_, dinp, dbias, dout, inp, to_stream(stream));
  }
  void residual_forward(Tensor out, Tensor a, Tensor b, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::residual_forward(ctx_, out, a, b, to_stream(stream));
  }
  void accumulate(Tensor dst, Tensor src, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::accumulate(ctx_, dst, src, to_stream(stream));
  }
  void add_bias(Tensor x, Tensor bias, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::add_bias(ctx_, x, bias, to_stream(stream));
  }
  void softmax_cross_entropy(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets,
                             int vocab, float dloss, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::softmax_cross_entropy(ctx_, losses, dlogits, logits, targets, vocab, dloss,
                                to_stream(stream));
  }
  void cross_entropy_stats(Tensor stats, Tensor logits, Tensor targets, int64_t vocab_begin,
                           int vocab, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::cross_entropy_stats(ctx_, stats, logits, targets, vocab_begin, vocab, to_stream(stream));
  }
  void cross_entropy_from_stats(Tensor losses, Tensor dlogits, Tensor logits, Tensor stats,
                                Tensor targets, int64_t vocab_begin, int vocab, float dloss,
                                Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::cross_entropy_from_stats(ctx_, losses, dlogits, logits, stats, targets, vocab_begin,
                                   vocab, dloss, to_stream(stream));
  }
  void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
             const AdamWStep& step, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::adamw(ctx_, param, grad, m, v, param_copy, step, to_stream(stream));
  }
  double sum_squares(Tensor x, Stream stream) override {
    const GradientTensor buffer{x, true};
    return gradient_stats({&buffer, 1}, stream).squares[0];
  }
  void scale(Tensor x, float s, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::scale(ctx_, x, s, to_stream(stream));
  }
  bool has_inf_or_nan(Tensor x, Stream stream) override {
    const GradientTensor buffer{x, false};
    return gradient_stats({&buffer, 1}, stream).found_inf;
  }
  void residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean, Tensor rstd,
                                  Tensor a, Tensor b, Tensor weight, Tensor bias,
                                  Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::residual_layernorm_forward(ctx_, residual, out, mean, rstd, a, b, weight, bias,
                                     to_stream(stream));
  }
  void residual_rmsnorm_forward(Tensor residual, Tensor out, Tensor rstd, Tensor a, Tensor b,
                                Tensor weight, float eps, Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::residual_rmsnorm_forward(ctx_, residual, out, rstd, a, b, weight, eps,
                                   to_stream(stream));
  }
  void adamw_multi(std::span<const AdamWTensors> buffers, const AdamWStep& step,
                   Stream stream) override {
    DeviceScope scope(ctx_.device);
    cuda::adamw_multi(ctx_, buffers, step, to_stream(stream));
  }
  GradientStats gradient_stats(std::span<const GradientTensor> buffers, Stream stream) override {
    DeviceScope scope(ctx_.device);
    GradientReadback readback = cuda::gradient_stats(ctx_, buffers, to_stream(stream));
    if (readback.device_error != 0) raise_device_error(readback.device_error, to_stream(stream));
    return std::move(readback.stats);
  }

 private:
  static cudaStream_t to_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }

  // Waits for `stream`, then: did a kernel flag bad data? Clears the word and says what was
  // wrong. The read is ordered on `stream` itself (not the legacy default stream, which would
  // also wait for every other blocking stream, e.g. a communication stream).
  // The word lands in pinned memory, so the stream is waited on once.
  void check_error_word(cudaStream_t stream) {
    auto* word = static_cast<unsigned*>(pinned_readback(sizeof(unsigned)));
    CUDA_CHECK(
        cudaMemcpyAsync(word, ctx_.error_word, sizeof *word, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    if (*word != 0) raise_device_error(*word, stream);
  }

  // A kernel flagged bad data (`word`, read after `stream` was waited on): clears the word and
  // says what was wrong.
  [[noreturn]] void raise_device_error(unsigned word, cudaStream_t stream) {
    CUDA_CHECK(cudaMemsetAsync(ctx_.error_word, 0, sizeof word, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::ostringstream sentence;
    if (word & kBadTokenId) {
      sentence << "a token id is outside the model's vocabulary (found on " << where_running()
               << " by the embedding): check that the data was tokenized for this model";
    } else if (word & kBadMoeIndex) {
      sentence << "a mixture-of-experts index (an expert, or a row of the expert-ordered "
               << "buffer) is out of range (found on " << where_running() << ")";
    } else {
      sentence << "a target id is outside the vocabulary (found on " << where_running()
               << " by the cross-entropy): check that the data was tokenized for this model";
    }
    throw UserError(sentence.str());
  }

  CudaContext ctx_;
  std::string name_;
};

}  // namespace
}  // namespace dstrain::cuda

namespace dstrain {

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<cuda::CudaBackend>(device);
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for this question
    return 0;
  }
  return count;
}

}  // namespace dstrain
