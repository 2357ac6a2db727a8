// The CPU backend: the Backend class, memory ops, and the helpers of cpu_ops.h.
#include <cblas.h>
#include <omp.h>

#include <cstring>
#include <string>

#include "core/format.h"
#include "kernels/cpu/cpu_ops.h"

namespace dstrain::cpu {

bool is_float_dtype(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16;
}

void check_float_tensor(const Tensor& t, const char* name) {
  DSTRAIN_CHECK(!t.empty()) << name << " is empty";
  DSTRAIN_CHECK(t.device.is_cpu())
      << name << " is on " << t.device.str() << ", the CPU backend needs host memory";
  DSTRAIN_CHECK(is_float_dtype(t.dtype))
      << name << " " << t.shape_str() << " must be F32, F16 or BF16";
}

void check_tensor_dtype(const Tensor& t, DType dtype, const char* name) {
  DSTRAIN_CHECK(!t.empty()) << name << " is empty";
  DSTRAIN_CHECK(t.device.is_cpu())
      << name << " is on " << t.device.str() << ", the CPU backend needs host memory";
  DSTRAIN_CHECK(t.dtype == dtype) << name << " " << t.shape_str() << " must be "
                                  << dtype_name(dtype);
}

int64_t cols_of(const Tensor& t) { return t.ndim == 0 ? 1 : t.shape[t.ndim - 1]; }

int64_t rows_of(const Tensor& t) {
  const int64_t cols = cols_of(t);
  return cols == 0 ? 0 : t.numel() / cols;
}

F32View::F32View(const CpuContext& ctx, const Tensor& t) {
  if (t.dtype == DType::F32) {
    data_ = static_cast<const float*>(t.data);
    return;
  }
  const int64_t n = t.numel();
  converted_.reset(new float[static_cast<size_t>(n)]);
  float* dst = converted_.get();
  parallel_for(ctx, num_chunks(n), [&](int64_t chunk, int) {
    const int64_t begin = chunk * kElementChunk;
    load_span_into(t, begin, std::min(kElementChunk, n - begin), dst + begin);
  });
  data_ = dst;
}

void fill_zero(const CpuContext& ctx, Tensor t) {
  if (t.empty()) return;
  DSTRAIN_CHECK(t.device.is_cpu()) << "fill_zero of a tensor on " << t.device.str();
  // All-zero bits are +0 in every dtype.
  std::memset(t.data, 0, t.nbytes());
}

void copy(const CpuContext& ctx, Tensor dst, Tensor src) {
  DSTRAIN_CHECK(dst.numel() == src.numel())
      << "copy of " << src.shape_str() << " into " << dst.shape_str();
  if (dst.numel() == 0) return;
  DSTRAIN_CHECK(!dst.empty() && !src.empty()) << "copy with an empty tensor";
  DSTRAIN_CHECK(dst.device.is_cpu() && src.device.is_cpu()) << "copy between non-host tensors";
  if (dst.dtype == src.dtype) {
    if (dst.data != src.data) std::memmove(dst.data, src.data, dst.nbytes());
    return;
  }
  check_float_tensor(dst, "copy dst");
  check_float_tensor(src, "copy src");
  const int64_t n = dst.numel();
  ThreadScratch scratch(ctx, kElementChunk);
  parallel_for(ctx, num_chunks(n), [&](int64_t chunk, int thread) {
    const int64_t begin = chunk * kElementChunk, count = std::min(kElementChunk, n - begin);
    commit_span(dst, begin, count, load_span(src, begin, count, scratch.get(thread)));
  });
}

namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads) {
    ctx_.num_threads = num_threads > 0 ? num_threads : omp_get_num_procs();
    // OpenBLAS's threaded sgemm blocks K differently from its single-threaded one, so its
    // bits depend on the thread count (see Matmul.OpenBlasThreadCountChangesBits). GEMMs
    // therefore run on a fixed tile grid, one single-threaded sgemm per tile, threaded by
    // OpenMP. The setting is process-wide; 1 is also what makes concurrent calls from rank
    // threads safe.
    openblas_set_num_threads(1);
  }

  Device device() const override { return Device{}; }
  std::string name() const override {
    return "cpu (" + count_of(ctx_.num_threads, "thread") + ", OpenBLAS)";
  }
  void synchronize(Stream) override {}

  void fill_zero(Tensor t, Stream) override { cpu::fill_zero(ctx_, t); }
  void copy(Tensor dst, Tensor src, Stream) override { cpu::copy(ctx_, dst, src); }
  void copy_bytes(void* dst, const void* src, size_t bytes, Stream) override {
    if (bytes == 0 || dst == src) return;
    DSTRAIN_CHECK(dst != nullptr && src != nullptr) << "copy_bytes of " << bytes << " bytes";
    std::memmove(dst, src, bytes);
  }

  using Backend::attention_backward;
  using Backend::attention_forward;
  using Backend::embedding_backward;
  using Backend::embedding_forward;
  using Backend::rope_backward;
  using Backend::rope_forward;
  void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                         int64_t vocab_begin, int64_t vocab_rows, Stream) override {
    cpu::embedding_forward(ctx_, out, tokens, positions, wte, wpe, vocab_begin, vocab_rows);
  }
  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                          int64_t vocab_begin, int64_t vocab_rows, Stream) override {
    cpu::embedding_backward(ctx_, dwte, dwpe, dout, tokens, positions, vocab_begin, vocab_rows);
  }
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias, Stream) override {
    cpu::layernorm_forward(ctx_, out, mean, rstd, inp, weight, bias);
  }
  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd, Stream) override {
    cpu::layernorm_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, mean, rstd);
  }
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps,
                       Stream) override {
    cpu::rmsnorm_forward(ctx_, out, rstd, inp, weight, eps);
  }
  void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                        Tensor rstd, Stream) override {
    cpu::rmsnorm_backward(ctx_, dinp, dweight, dout, inp, weight, rstd);
  }
  void swiglu_forward(Tensor out, Tensor inp, Tensor amax, Stream) override {
    cpu::swiglu_forward(ctx_, out, inp, amax);
  }
  void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp, Tensor amax, Stream) override {
    cpu::swiglu_backward(ctx_, dinp, dout, inp, amax);
  }
  void moe_route(Tensor topk_weight, Tensor topk_expert, Tensor scores, Tensor logits,
                 const MoeRouting& routing, Stream) override {
    cpu::moe_route(ctx_, topk_weight, topk_expert, scores, logits, routing);
  }
  void moe_route_backward(Tensor dlogits, Tensor dtopk_weight, Tensor dscores, Tensor scores,
                          Tensor topk_expert, const MoeRouting& routing, Stream) override {
    cpu::moe_route_backward(ctx_, dlogits, dtopk_weight, dscores, scores, topk_expert, routing);
  }
  void moe_dispatch(Tensor expert_offsets, Tensor source_rows, Tensor dest_rows,
                    Tensor topk_expert, int experts, Stream) override {
    cpu::moe_dispatch(ctx_, expert_offsets, source_rows, dest_rows, topk_expert, experts);
  }
  void moe_gather(Tensor out, Tensor inp, Tensor source_rows, Stream) override {
    cpu::moe_gather(ctx_, out, inp, source_rows);
  }
  void moe_combine(Tensor out, Tensor inp, Tensor dest_rows, Tensor weight, Stream) override {
    cpu::moe_combine(ctx_, out, inp, dest_rows, weight);
  }
  void moe_combine_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                            Tensor dest_rows, Tensor weight, Stream) override {
    cpu::moe_combine_backward(ctx_, dinp, dweight, dout, inp, dest_rows, weight);
  }
  void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor expert_offsets,
                              Stream) override {
    cpu::grouped_matmul_forward(ctx_, out, inp, weight, expert_offsets);
  }
  void grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                               Tensor weight, Tensor expert_offsets, Stream) override {
    cpu::grouped_matmul_backward(ctx_, dinp, dweight, dout, inp, weight, expert_offsets);
  }
  void fp8_quantize(Tensor out, Tensor out_t, Tensor scale_inv, Tensor inp, Tensor amax,
                    Stream) override {
    cpu::fp8_quantize(ctx_, out, out_t, scale_inv, inp, amax);
  }
  void fp8_amax(Tensor amax, Tensor inp, Stream) override { cpu::fp8_amax(ctx_, amax, inp); }
  void matmul_fp8(Tensor out, Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv,
                  Tensor bias, bool accumulate, Stream) override {
    cpu::matmul_fp8(ctx_, out, a, a_scale_inv, b, b_scale_inv, bias, accumulate);
  }
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, bool weight_out_by_in,
                      Stream) override {
    cpu::matmul_forward(ctx_, out, inp, weight, bias, weight_out_by_in);
  }
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, bool weight_out_by_in, Stream) override {
    cpu::matmul_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, weight_out_by_in);
  }
  void bias_backward(Tensor dbias, Tensor dout, Stream) override {
    cpu::column_sums_accumulate(ctx_, dbias, dout);
  }
  void matmul_gelu_forward(Tensor out, Tensor pre_gelu, Tensor inp, Tensor weight, Tensor bias,
                           Stream) override {
    cpu::matmul_gelu_forward(ctx_, out, pre_gelu, inp, weight, bias);
  }
  void attention_forward(Tensor out, Tensor lse, Tensor qkv, Tensor positions, int n_head,
                         int n_kv_head, Stream) override {
    cpu::attention_forward(ctx_, out, lse, qkv, positions, n_head, n_kv_head);
  }
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                          Tensor positions, int n_head, int n_kv_head, Stream) override {
    cpu::attention_backward(ctx_, dqkv, dout, qkv, out, lse, positions, n_head, n_kv_head);
  }
  void rope_forward(Tensor qkv, Tensor freqs, Tensor positions, int n_head, int n_kv_head,
                    Stream) override {
    cpu::rope(ctx_, qkv, freqs, positions, n_head, n_kv_head, false);
  }
  void rope_backward(Tensor dqkv, Tensor freqs, Tensor positions, int n_head, int n_kv_head,
                     Stream) override {
    cpu::rope(ctx_, dqkv, freqs, positions, n_head, n_kv_head, true);
  }
  void mla_pack(Tensor qkv, Tensor q, Tensor kv, Tensor k_rope, Tensor freqs, Tensor positions,
                const MlaHeads& heads, Stream) override {
    cpu::mla_pack(ctx_, qkv, q, kv, k_rope, freqs, positions, heads);
  }
  void mla_pack_backward(Tensor dq, Tensor dkv, Tensor dk_rope, Tensor dqkv, Tensor freqs,
                         Tensor positions, const MlaHeads& heads, Stream) override {
    cpu::mla_pack_backward(ctx_, dq, dkv, dk_rope, dqkv, freqs, positions, heads);
  }
  void mla_unpad(Tensor out, Tensor atty, const MlaHeads& heads, Stream) override {
    cpu::mla_unpad(ctx_, out, atty, heads);
  }
  void mla_unpad_backward(Tensor datty, Tensor dout, const MlaHeads& heads, Stream) override {
    cpu::mla_unpad_backward(ctx_, datty, dout, heads);
  }
  void gelu_forward(Tensor out, Tensor inp, Stream) override { cpu::gelu_forward(ctx_, out, inp); }
  void gelu_backward(Tensor dinp, Tensor dout, Tensor inp, Stream) override {
    cpu::gelu_backward(ctx_, dinp, dout, inp);
  }
  void gelu_backward_bias(Tensor dinp, Tensor dbias, Tensor dout, Tensor inp, Stream) override {
    cpu::gelu_backward(ctx_, dinp, dout, inp);
    if (!dbias.empty()) cpu::column_sums_accumulate(ctx_, dbias, dinp);
  }
  void residual_forward(Tensor out, Tensor a, Tensor b, Stream) override {
    cpu::residual_forward(ctx_, out, a, b);
  }
  void accumulate(Tensor dst, Tensor src, Stream) override { cpu::accumulate(ctx_, dst, src); }
  void add_bias(Tensor x, Tensor bias, Stream) override { cpu::add_bias(ctx_, x, bias); }
  void softmax_cross_entropy(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets,
                             int vocab, float dloss, Stream) override {
    cpu::softmax_cross_entropy(ctx_, losses, dlogits, logits, targets, vocab, dloss);
  }
  void cross_entropy_stats(Tensor stats, Tensor logits, Tensor targets, int64_t vocab_begin,
                           int vocab, Stream) override {
    cpu::cross_entropy_stats(ctx_, stats, logits, targets, vocab_begin, vocab);
  }
  void cross_entropy_from_stats(Tensor losses, Tensor dlogits, Tensor logits, Tensor stats,
                                Tensor targets, int64_t vocab_begin, int vocab, float dloss,
                                Stream) override {
    cpu::cross_entropy_from_stats(ctx_, losses, dlogits, logits, stats, targets, vocab_begin,
                                  vocab, dloss);
  }
  void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, Tensor param_copy,
             const AdamWStep& step, Stream) override {
    cpu::adamw(ctx_, param, grad, m, v, param_copy, step);
  }
  double sum_squares(Tensor x, Stream) override { return cpu::sum_squares(ctx_, x); }
  void scale(Tensor x, float s, Stream) override { cpu::scale(ctx_, x, s); }
  bool has_inf_or_nan(Tensor x, Stream) override { return cpu::has_inf_or_nan(ctx_, x); }

 private:
  CpuContext ctx_;
};

}  // namespace
}  // namespace dstrain::cpu

namespace dstrain {

std::unique_ptr<Backend> make_cpu_backend(int num_threads) {
  return std::make_unique<cpu::CpuBackend>(num_threads);
}

}  // namespace dstrain
