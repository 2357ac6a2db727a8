// Shape checks of the ops on a qkv buffer (attention, rope), written once for every backend
// (the ggml habit: an op's shapes are checked where the op is defined). A backend adds its own
// device and dtype checks; these look only at shapes and head counts. Throw dstrain::Error.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "core/tensor.h"

namespace dstrain {

// The layout of a qkv buffer (B,T,(NH+2KV)*hd): per position [q (NH heads) | k (KV heads) |
// v (KV heads)], each head hd wide. Query head h reads kv head h / group().
struct QkvShape {
  int64_t B, T, NH, KV, hd;
  int64_t group() const { return NH / KV; }              // query heads per kv head
  int64_t width() const { return (NH + 2 * KV) * hd; }   // a qkv row
  int64_t q_width() const { return NH * hd; }            // an attention output row
  int64_t k_column(int64_t kv_head) const { return (NH + kv_head) * hd; }
  int64_t v_column(int64_t kv_head) const { return (NH + KV + kv_head) * hd; }
};

// qkv (B,T,(NH+2KV)*hd) with NH % KV == 0.
inline QkvShape check_qkv_shape(const Tensor& qkv, int n_head, int n_kv_head, const char* op) {
  DSTRAIN_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0)
      << op << ": n_head = " << n_head << " must be a positive multiple of n_kv_head = "
      << n_kv_head;
  const int64_t heads = int64_t{n_head} + 2 * int64_t{n_kv_head};
  DSTRAIN_CHECK(qkv.ndim == 3 && qkv.shape[2] % heads == 0)
      << op << " qkv " << qkv.shape_str() << " must be (B, T, (n_head + 2 n_kv_head) * hd) with "
      << "n_head = " << n_head << ", n_kv_head = " << n_kv_head;
  return QkvShape{qkv.shape[0], qkv.shape[1], n_head, n_kv_head, qkv.shape[2] / heads};
}

namespace qkv_detail {
inline bool has_shape(const Tensor& t, int64_t d0, int64_t d1, int64_t d2) {
  return t.ndim == 3 && t.shape[0] == d0 && t.shape[1] == d1 && t.shape[2] == d2;
}
}  // namespace qkv_detail

// attention_forward: qkv as above, out (B,T,NH*hd), lse (B,NH,T).
inline QkvShape check_attention_shapes(const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                       int n_head, int n_kv_head) {
  const QkvShape s = check_qkv_shape(qkv, n_head, n_kv_head, "attention");
  DSTRAIN_CHECK(qkv_detail::has_shape(out, s.B, s.T, s.q_width()))
      << "attention out " << out.shape_str() << " must be (" << s.B << ", " << s.T << ", "
      << s.q_width() << ")";
  DSTRAIN_CHECK(qkv_detail::has_shape(lse, s.B, s.NH, s.T))
      << "attention lse " << lse.shape_str() << " must be (" << s.B << ", " << s.NH << ", " << s.T
      << ")";
  return s;
}

// attention_backward: the forward's shapes plus dqkv like qkv and dout like out.
inline QkvShape check_attention_backward_shapes(const Tensor& dqkv, const Tensor& dout,
                                                const Tensor& qkv, const Tensor& out,
                                                const Tensor& lse, int n_head, int n_kv_head) {
  const QkvShape s = check_attention_shapes(qkv, out, lse, n_head, n_kv_head);
  DSTRAIN_CHECK(qkv_detail::has_shape(dqkv, s.B, s.T, s.width()))
      << "attention dqkv " << dqkv.shape_str() << " must match qkv " << qkv.shape_str();
  DSTRAIN_CHECK(qkv_detail::has_shape(dout, s.B, s.T, s.q_width()))
      << "attention dout " << dout.shape_str() << " must match out " << out.shape_str();
  return s;
}

// rope_forward / rope_backward: qkv as above with hd even, freqs (maxT,hd/2,2), maxT >= T.
inline QkvShape check_rope_shapes(const Tensor& qkv, const Tensor& freqs, int n_head,
                                  int n_kv_head) {
  const QkvShape s = check_qkv_shape(qkv, n_head, n_kv_head, "rope");
  DSTRAIN_CHECK(s.hd % 2 == 0) << "rope: head dim " << s.hd << " of qkv " << qkv.shape_str()
                               << " must be even (rotate-half pairs x[i] with x[i + hd/2])";
  DSTRAIN_CHECK(freqs.ndim == 3 && freqs.shape[0] >= s.T && freqs.shape[1] == s.hd / 2 &&
                freqs.shape[2] == 2)
      << "rope freqs " << freqs.shape_str() << " must be (maxT >= " << s.T << ", " << s.hd / 2
      << ", 2): (cos, sin) per position and frequency";
  return s;
}

}  // namespace dstrain
