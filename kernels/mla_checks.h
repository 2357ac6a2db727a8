// Shape checks of the multi-head latent attention ops (kernels/ops.h, mla_pack and mla_unpad),
// written once for every backend. Throw dstrain::Error.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace dstrain {

struct MlaShape {
  int64_t B, T, H, dn, dr, dv;
  int64_t D() const { return dn + dr; }
  int64_t q_width() const { return H * D(); }         // a q row (and each third of qkv's)
  int64_t kv_width() const { return H * (dn + dv); }  // a kv row
  int64_t rows() const { return B * T; }
};

inline MlaShape check_mla_heads(const MlaHeads& h, const Tensor& qkv, const char* op) {
  DSTRAIN_CHECK(h.heads >= 1 && h.nope_dim >= 0 && h.rope_dim >= 2 && h.rope_dim % 2 == 0 &&
                h.v_dim >= 1 && h.v_dim <= h.qk_dim())
      << op << ": heads " << h.heads << ", nope dim " << h.nope_dim << ", rope dim " << h.rope_dim
      << " (even, >= 2), v dim " << h.v_dim << " (<= nope + rope)";
  DSTRAIN_CHECK(qkv.ndim == 3) << op << " qkv " << qkv.shape_str() << " must be (B, T, 3 H D)";
  return MlaShape{qkv.shape[0], qkv.shape[1], h.heads, h.nope_dim, h.rope_dim, h.v_dim};
}

// (B, T, width) in `like`'s dtype.
inline void check_mla_tensor(const Tensor& t, const MlaShape& s, int64_t width, const Tensor& like,
                             const char* name) {
  DSTRAIN_CHECK(t.ndim == 3 && t.shape[0] == s.B && t.shape[1] == s.T && t.shape[2] == width &&
                t.dtype == like.dtype)
      << name << " " << t.shape_str() << " must be (" << s.B << ", " << s.T << ", " << width << ") "
      << dtype_name(like.dtype);
}

// mla_pack / mla_pack_backward: qkv (B,T,3*H*D), q (B,T,H*D), kv (B,T,H*(dn+dv)), k_rope
// (B,T,dr), one dtype; freqs (maxT, dr/2, 2) F32 with maxT >= T.
inline MlaShape check_mla_pack_shapes(const Tensor& qkv, const Tensor& q, const Tensor& kv,
                                      const Tensor& k_rope, const Tensor& freqs,
                                      const MlaHeads& heads, const char* op) {
  const MlaShape s = check_mla_heads(heads, qkv, op);
  check_mla_tensor(qkv, s, 3 * s.q_width(), qkv, "mla qkv");
  check_mla_tensor(q, s, s.q_width(), qkv, "mla q");
  check_mla_tensor(kv, s, s.kv_width(), qkv, "mla kv");
  check_mla_tensor(k_rope, s, s.dr, qkv, "mla k_rope");
  DSTRAIN_CHECK(freqs.dtype == DType::F32 && freqs.numel() % s.dr == 0 &&
                freqs.numel() / s.dr >= s.T)
      << op << " freqs " << freqs.shape_str() << " must be (maxT >= " << s.T << ", " << s.dr / 2
      << ", 2) F32";
  return s;
}

// mla_unpad / mla_unpad_backward: out (B,T,H*dv), atty (B,T,H*D), one dtype.
inline MlaShape check_mla_unpad_shapes(const Tensor& out, const Tensor& atty, const MlaHeads& heads,
                                       const char* op) {
  DSTRAIN_CHECK(atty.ndim == 3) << op << " atty " << atty.shape_str() << " must be (B, T, H D)";
  const MlaShape s = check_mla_heads(heads, atty, op);
  check_mla_tensor(atty, s, s.q_width(), atty, "mla atty");
  check_mla_tensor(out, s, s.H * s.dv, atty, "mla out");
  return s;
}

}  // namespace dstrain
