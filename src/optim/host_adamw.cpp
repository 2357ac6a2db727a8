// Host-side AdamW: scalar, AVX2 and AVX-512 versions of one elementwise update, picked at run
// time, run over contiguous chunks by OpenMP threads.
//
// Bit-exactness with the CPU backend (kernels/cpu/cpu_optim.cpp) rests on three things:
// - the per-step scalars (decay, step size, ...) are computed by step_constants() with the
//   reference's double-precision expressions, then rounded to float where it rounds them;
// - every fp32 operation of the reference is mirrored by one vector operation on the same
//   operands in the same order (mul, add, sub, div and sqrt are correctly rounded both in
//   scalar SSE and in AVX/AVX-512);
// - nothing is fused into an FMA. GCC contracts a*b+c by default in C++ (-ffp-contract=fast,
//   even with -std=c++20), so this holds only where FMA is not in the target: the reference
//   and the scalar code are built for baseline x86-64, the AVX2 target leaves FMA out, and
//   the AVX-512 code (whose target implies FMA) uses _round_ intrinsics GCC never fuses;
// - fp16/bf16 conversions are exact (widening) or RNE with the reference's NaN encoding.
#include "optim/host_adamw.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/check.h"

#if defined(__x86_64__) || defined(__i386__)
#define DSTRAIN_HOST_ADAMW_X86 1
// GCC 12's AVX-512 headers seed results with _mm512_undefined_*(), which -Wmaybe-uninitialized
// misreads once inlined; the warning points into the header, so silence it there only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define DSTRAIN_HOST_ADAMW_X86 0
#endif

namespace dstrain {
namespace {

// Below this many elements per thread, waking another thread costs more than it saves.
constexpr int64_t kMinElementsPerThread = 16384;
// Chunk boundaries fall on multiples of 16 elements (64 bytes): whole cache lines and whole
// AVX-512 vectors when the arrays are 64-byte aligned. Results do not depend on it.
constexpr int64_t kChunkAlign = 16;

enum class GradFormat { F32, F16, BF16 };
enum class CopyFormat { None, F16, BF16 };
// The Adam moments: fp32, or bf16 (widened exactly to fp32 for the update, stored RNE).
enum class MomentFormat { F32, BF16 };

// The per-step scalars, exactly as the reference computes them.
struct StepConstants {
  float grad_scale;
  float decay;                  // 1 - lr * weight_decay
  float lerp_weight;            // 1 - beta1
  float one_minus_lerp_weight;  // 1 - (1 - beta1), rounded in float as ATen's lerp does
  bool lerp_weight_small;       // ATen's lerp switches formula at |weight| < 0.5
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float neg_step_size;  // -lr / bias_correction1
  float eps;
};

StepConstants step_constants(const AdamWStep& step) {
  const double lr = step.lr, beta1 = step.beta1, beta2 = step.beta2;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step.step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step.step));
  StepConstants c;
  c.grad_scale = step.grad_scale;
  c.decay = static_cast<float>(1.0 - lr * static_cast<double>(step.weight_decay));
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.one_minus_lerp_weight = 1.0f - c.lerp_weight;
  c.lerp_weight_small = std::abs(c.lerp_weight) < 0.5f;
  c.beta2 = step.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  c.eps = step.eps;
  return c;
}

struct Buffers {
  float* param;          // (n)
  const void* grad;      // (n) GradFormat
  void* m;               // (n) MomentFormat
  void* v;               // (n) MomentFormat
  uint16_t* param_copy;  // (n) CopyFormat; null for CopyFormat::None
};

using RangeKernel = void (*)(const Buffers& buffers, const StepConstants& c, int64_t begin,
                             int64_t end);

// ---- scalar: the fallback, and the tail of the vector versions ----

template <GradFormat G>
inline float load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradFormat::F32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == GradFormat::F16) {
    return fp16_bits_to_fp32(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return bf16_bits_to_fp32(static_cast<const uint16_t*>(grad)[i]);
  }
}

template <CopyFormat C>
inline void store_copy(uint16_t* param_copy, int64_t i, float value) {
  if constexpr (C == CopyFormat::F16) {
    param_copy[i] = fp32_to_fp16_bits(value);
  } else if constexpr (C == CopyFormat::BF16) {
    param_copy[i] = fp32_to_bf16_bits(value);
  }
}

template <MomentFormat M>
inline float load_moment(const void* moment, int64_t i) {
  if constexpr (M == MomentFormat::F32) {
    return static_cast<const float*>(moment)[i];
  } else {
    return bf16_bits_to_fp32(static_cast<const uint16_t*>(moment)[i]);
  }
}

template <MomentFormat M>
inline void store_moment(void* moment, int64_t i, float value) {
  if constexpr (M == MomentFormat::F32) {
    static_cast<float*>(moment)[i] = value;
  } else {
    static_cast<uint16_t*>(moment)[i] = fp32_to_bf16_bits(value);
  }
}

// noinline: inlined into a vector function, the loop would take on that function's target
// (avx512f brings FMA) and could be fused; out of line it keeps the reference's baseline ISA.
template <GradFormat G, CopyFormat C, MomentFormat M>
__attribute__((noinline)) void adamw_range_scalar(const Buffers& b, const StepConstants& c,
                                                  int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = load_grad<G>(b.grad, i) * c.grad_scale;
    const float param_decayed = b.param[i] * c.decay;
    const float m_old = load_moment<M>(b.m, i);
    const float m_new = c.lerp_weight_small ? m_old + c.lerp_weight * (g - m_old)
                                            : g - (g - m_old) * c.one_minus_lerp_weight;
    const float v_new = load_moment<M>(b.v, i) * c.beta2 + (c.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v_new) / c.bias_correction2_sqrt + c.eps;
    const float p_new = param_decayed + (c.neg_step_size * m_new) / denom;
    b.param[i] = p_new;
    store_moment<M>(b.m, i, m_new);
    store_moment<M>(b.v, i, v_new);
    store_copy<C>(b.param_copy, i, p_new);  // after the grad load: the two may alias
  }
}

#if DSTRAIN_HOST_ADAMW_X86

#define DSTRAIN_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define DSTRAIN_TARGET_AVX512 __attribute__((target("avx512f")))

// ---- AVX2 + F16C: 8 floats per op ----

// 8 bf16 values widened to fp32 (exact: the bits shifted up).
DSTRAIN_TARGET_AVX2 inline __m256 load_bf16x8(const uint16_t* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <GradFormat G>
DSTRAIN_TARGET_AVX2 inline __m256 load_grad8(const void* grad, int64_t i) {
  if constexpr (G == GradFormat::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else if constexpr (G == GradFormat::F16) {
    const __m128i bits =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_cvtph_ps(bits);  // exact
  } else {
    return load_bf16x8(static_cast<const uint16_t*>(grad) + i);
  }
}

// RNE on the bits, as fp32_to_bf16_bits: (x + 0x7fff + lsb) >> 16; NaN: (x >> 16) | 0x40.
DSTRAIN_TARGET_AVX2 inline void store_bf16x8(uint16_t* dst, __m256 value) {
  const __m256 is_nan = _mm256_cmp_ps(value, value, _CMP_UNORD_Q);
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i rounding =
      _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, rounding), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)),
                               _mm256_castps_si256(is_nan));
  // Every lane is <= 0xffff, so the unsigned saturating pack is a plain narrowing.
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                    _mm256_extracti128_si256(rounded, 1)));
}

template <CopyFormat C>
DSTRAIN_TARGET_AVX2 inline void store_copy8(uint16_t* param_copy, int64_t i, __m256 value) {
  // CopyFormat::None: nothing to write.
  if constexpr (C == CopyFormat::F16) {
    __m128i* dst = reinterpret_cast<__m128i*>(param_copy + i);
    const __m256 is_nan = _mm256_cmp_ps(value, value, _CMP_UNORD_Q);
    // The reference writes every NaN as sign | 0x7e00; the converter keeps a NaN's sign and
    // top mantissa bits, so a canonical quiet NaN of the same sign converts to exactly that.
    const __m256 canonical_nan =
        _mm256_or_ps(_mm256_and_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))),
                     _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    value = _mm256_blendv_ps(value, canonical_nan, is_nan);
    _mm_storeu_si128(dst, _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
  } else if constexpr (C == CopyFormat::BF16) {
    store_bf16x8(param_copy + i, value);
  }
}

template <MomentFormat M>
DSTRAIN_TARGET_AVX2 inline __m256 load_moment8(const void* moment, int64_t i) {
  if constexpr (M == MomentFormat::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(moment) + i);
  } else {
    return load_bf16x8(static_cast<const uint16_t*>(moment) + i);
  }
}

template <MomentFormat M>
DSTRAIN_TARGET_AVX2 inline void store_moment8(void* moment, int64_t i, __m256 value) {
  if constexpr (M == MomentFormat::F32) {
    _mm256_storeu_ps(static_cast<float*>(moment) + i, value);
  } else {
    store_bf16x8(static_cast<uint16_t*>(moment) + i, value);
  }
}

template <GradFormat G, CopyFormat C, MomentFormat M>
DSTRAIN_TARGET_AVX2 void adamw_range_avx2(const Buffers& b, const StepConstants& c, int64_t begin,
                                          int64_t end) {
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 lerp_weight = _mm256_set1_ps(c.lerp_weight);
  const __m256 one_minus_lerp_weight = _mm256_set1_ps(c.one_minus_lerp_weight);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bias_correction2_sqrt = _mm256_set1_ps(c.bias_correction2_sqrt);
  const __m256 neg_step_size = _mm256_set1_ps(c.neg_step_size);
  const __m256 eps = _mm256_set1_ps(c.eps);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    // One line per line of adamw_range_scalar, one intrinsic per scalar operation.
    const __m256 g = _mm256_mul_ps(load_grad8<G>(b.grad, i), grad_scale);
    const __m256 param_decayed = _mm256_mul_ps(_mm256_loadu_ps(b.param + i), decay);
    const __m256 m_old = load_moment8<M>(b.m, i);
    const __m256 g_minus_m = _mm256_sub_ps(g, m_old);
    const __m256 m_new = c.lerp_weight_small
                             ? _mm256_add_ps(m_old, _mm256_mul_ps(lerp_weight, g_minus_m))
                             : _mm256_sub_ps(g, _mm256_mul_ps(g_minus_m, one_minus_lerp_weight));
    const __m256 v_new = _mm256_add_ps(_mm256_mul_ps(load_moment8<M>(b.v, i), beta2),
                                       _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
    const __m256 denom =
        _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_new), bias_correction2_sqrt), eps);
    const __m256 p_new =
        _mm256_add_ps(param_decayed, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m_new), denom));
    _mm256_storeu_ps(b.param + i, p_new);
    store_moment8<M>(b.m, i, m_new);
    store_moment8<M>(b.v, i, v_new);
    store_copy8<C>(b.param_copy, i, p_new);
  }
  adamw_range_scalar<G, C, M>(b, c, i, end);
}

// ---- AVX-512F: 16 floats per op ----
//
// GCC compiles C++ with -ffp-contract=fast by default (even with -std=c++20), and the avx512f
// target brings FMA along: plain _mm512_mul_ps feeding _mm512_add_ps gets fused into one
// vfmadd, skipping the rounding the reference does in between. The _round_ forms are opaque
// builtins that are never fused; _MM_FROUND_CUR_DIRECTION rounds as MXCSR says, like the
// scalar reference. (The AVX2 target has no FMA, so it cannot fuse.)

DSTRAIN_TARGET_AVX512 inline __m512 add16(__m512 a, __m512 b) {
  return _mm512_add_round_ps(a, b, _MM_FROUND_CUR_DIRECTION);
}
DSTRAIN_TARGET_AVX512 inline __m512 sub16(__m512 a, __m512 b) {
  return _mm512_sub_round_ps(a, b, _MM_FROUND_CUR_DIRECTION);
}
DSTRAIN_TARGET_AVX512 inline __m512 mul16(__m512 a, __m512 b) {
  return _mm512_mul_round_ps(a, b, _MM_FROUND_CUR_DIRECTION);
}
DSTRAIN_TARGET_AVX512 inline __m512 div16(__m512 a, __m512 b) {
  return _mm512_div_round_ps(a, b, _MM_FROUND_CUR_DIRECTION);
}

// 16 bf16 values widened to fp32 (exact: the bits shifted up).
DSTRAIN_TARGET_AVX512 inline __m512 load_bf16x16(const uint16_t* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <GradFormat G>
DSTRAIN_TARGET_AVX512 inline __m512 load_grad16(const void* grad, int64_t i) {
  if constexpr (G == GradFormat::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else if constexpr (G == GradFormat::F16) {
    const __m256i bits = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm512_cvtph_ps(bits);  // exact
  } else {
    return load_bf16x16(static_cast<const uint16_t*>(grad) + i);
  }
}

// Integer RNE, not AVX512_BF16's converter: that one flushes subnormal inputs to zero.
DSTRAIN_TARGET_AVX512 inline void store_bf16x16(uint16_t* dst, __m512 value) {
  const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i rounding =
      _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16);
  rounded = _mm512_mask_or_epi32(rounded, is_nan, high, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(rounded));  // lanes <= 0xffff: exact
}

template <CopyFormat C>
DSTRAIN_TARGET_AVX512 inline void store_copy16(uint16_t* param_copy, int64_t i, __m512 value) {
  // CopyFormat::None: nothing to write.
  if constexpr (C == CopyFormat::F16) {
    __m256i* dst = reinterpret_cast<__m256i*>(param_copy + i);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    const __m512i bits = _mm512_castps_si512(value);
    // As in store_copy8: a canonical quiet NaN converts to the reference's sign | 0x7e00.
    const __m512i canonical_nan = _mm512_or_si512(
        _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN)), _mm512_set1_epi32(0x7fc00000));
    value = _mm512_mask_mov_ps(value, is_nan, _mm512_castsi512_ps(canonical_nan));
    _mm256_storeu_si256(dst, _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
  } else if constexpr (C == CopyFormat::BF16) {
    store_bf16x16(param_copy + i, value);
  }
}

template <MomentFormat M>
DSTRAIN_TARGET_AVX512 inline __m512 load_moment16(const void* moment, int64_t i) {
  if constexpr (M == MomentFormat::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(moment) + i);
  } else {
    return load_bf16x16(static_cast<const uint16_t*>(moment) + i);
  }
}

template <MomentFormat M>
DSTRAIN_TARGET_AVX512 inline void store_moment16(void* moment, int64_t i, __m512 value) {
  if constexpr (M == MomentFormat::F32) {
    _mm512_storeu_ps(static_cast<float*>(moment) + i, value);
  } else {
    store_bf16x16(static_cast<uint16_t*>(moment) + i, value);
  }
}

template <GradFormat G, CopyFormat C, MomentFormat M>
DSTRAIN_TARGET_AVX512 void adamw_range_avx512(const Buffers& b, const StepConstants& c,
                                              int64_t begin, int64_t end) {
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 lerp_weight = _mm512_set1_ps(c.lerp_weight);
  const __m512 one_minus_lerp_weight = _mm512_set1_ps(c.one_minus_lerp_weight);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bias_correction2_sqrt = _mm512_set1_ps(c.bias_correction2_sqrt);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  const __m512 eps = _mm512_set1_ps(c.eps);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    // One line per line of adamw_range_scalar, one intrinsic per scalar operation.
    const __m512 g = mul16(load_grad16<G>(b.grad, i), grad_scale);
    const __m512 param_decayed = mul16(_mm512_loadu_ps(b.param + i), decay);
    const __m512 m_old = load_moment16<M>(b.m, i);
    const __m512 g_minus_m = sub16(g, m_old);
    const __m512 m_new = c.lerp_weight_small ? add16(m_old, mul16(lerp_weight, g_minus_m))
                                             : sub16(g, mul16(g_minus_m, one_minus_lerp_weight));
    const __m512 v_new =
        add16(mul16(load_moment16<M>(b.v, i), beta2), mul16(mul16(one_minus_beta2, g), g));
    const __m512 denom = add16(div16(_mm512_sqrt_ps(v_new), bias_correction2_sqrt), eps);
    const __m512 p_new = add16(param_decayed, div16(mul16(neg_step_size, m_new), denom));
    _mm512_storeu_ps(b.param + i, p_new);
    store_moment16<M>(b.m, i, m_new);
    store_moment16<M>(b.v, i, v_new);
    store_copy16<C>(b.param_copy, i, p_new);
  }
  adamw_range_scalar<G, C, M>(b, c, i, end);
}

#endif  // DSTRAIN_HOST_ADAMW_X86

// ---- dispatch ----

HostAdamWIsa detect_best_isa() {
#if DSTRAIN_HOST_ADAMW_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return HostAdamWIsa::Avx512;
#if defined(__clang__) && __clang_major__ < 15
  // clang 14 (the fuzz build's) does not know "f16c" here; every AVX2 x86 CPU has F16C.
  if (__builtin_cpu_supports("avx2")) return HostAdamWIsa::Avx2;
#else
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return HostAdamWIsa::Avx2;
#endif
#endif
  return HostAdamWIsa::Scalar;
}

HostAdamWIsa best_isa() {
  static const HostAdamWIsa best = detect_best_isa();
  return best;
}

template <GradFormat G, CopyFormat C, MomentFormat M>
RangeKernel kernel_for(HostAdamWIsa isa) {
#if DSTRAIN_HOST_ADAMW_X86
  if (isa == HostAdamWIsa::Avx512) return adamw_range_avx512<G, C, M>;
  if (isa == HostAdamWIsa::Avx2) return adamw_range_avx2<G, C, M>;
#endif
  return adamw_range_scalar<G, C, M>;
}

template <GradFormat G, CopyFormat C>
RangeKernel kernel_for(HostAdamWIsa isa, MomentFormat moments) {
  return moments == MomentFormat::BF16 ? kernel_for<G, C, MomentFormat::BF16>(isa)
                                       : kernel_for<G, C, MomentFormat::F32>(isa);
}

template <GradFormat G>
RangeKernel kernel_for(HostAdamWIsa isa, CopyFormat copy, MomentFormat moments) {
  switch (copy) {
    case CopyFormat::F16:
      return kernel_for<G, CopyFormat::F16>(isa, moments);
    case CopyFormat::BF16:
      return kernel_for<G, CopyFormat::BF16>(isa, moments);
    default:
      return kernel_for<G, CopyFormat::None>(isa, moments);
  }
}

RangeKernel kernel_for(HostAdamWIsa isa, GradFormat grad, CopyFormat copy, MomentFormat moments) {
  switch (grad) {
    case GradFormat::F16:
      return kernel_for<GradFormat::F16>(isa, copy, moments);
    case GradFormat::BF16:
      return kernel_for<GradFormat::BF16>(isa, copy, moments);
    default:
      return kernel_for<GradFormat::F32>(isa, copy, moments);
  }
}

// Contiguous chunks, one per thread; the update is elementwise, so where the chunks end never
// changes a bit. Nothing inside the parallel region can throw.
void run_in_chunks(RangeKernel kernel, const Buffers& buffers, const StepConstants& c, int64_t n,
                   int num_threads) {
  const int64_t wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int threads = static_cast<int>(
      std::clamp<int64_t>(n / kMinElementsPerThread, 1, std::max<int64_t>(wanted, 1)));
  if (threads == 1) {
    kernel(buffers, c, 0, n);
    return;
  }
  const int64_t blocks = (n + kChunkAlign - 1) / kChunkAlign;
#pragma omp parallel num_threads(threads)
  {
    // The team may be smaller than asked (nested regions, thread limits): split by its size.
    const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t begin = std::min(n, blocks * id / team * kChunkAlign);
    const int64_t end = std::min(n, blocks * (id + 1) / team * kChunkAlign);
    if (begin < end) kernel(buffers, c, begin, end);
  }
}

}  // namespace

const char* host_adamw_isa_name(HostAdamWIsa isa) {
  switch (isa) {
    case HostAdamWIsa::Auto:
      return "auto";
    case HostAdamWIsa::Scalar:
      return "scalar";
    case HostAdamWIsa::Avx2:
      return "avx2";
    case HostAdamWIsa::Avx512:
      return "avx512";
  }
  return "unknown";
}

bool host_adamw_isa_supported(HostAdamWIsa isa) {
  switch (isa) {
    case HostAdamWIsa::Auto:
    case HostAdamWIsa::Scalar:
      return true;
    case HostAdamWIsa::Avx2:
      return best_isa() == HostAdamWIsa::Avx2 || best_isa() == HostAdamWIsa::Avx512;
    case HostAdamWIsa::Avx512:
      return best_isa() == HostAdamWIsa::Avx512;
  }
  return false;
}

const char* host_adamw_isa() { return host_adamw_isa_name(best_isa()); }

void host_adamw_with(HostAdamWIsa isa, float* param, const void* grad, DType grad_dtype, float* m,
                     float* v, uint16_t* param_copy, DType copy_dtype, int64_t n,
                     const AdamWStep& step, int num_threads) {
  host_adamw_moments(isa, param, grad, grad_dtype, m, v, DType::F32, param_copy, copy_dtype, n,
                     step, num_threads);
}

void host_adamw_moments(HostAdamWIsa isa, float* param, const void* grad, DType grad_dtype,
                        void* m, void* v, DType moment_dtype, uint16_t* param_copy,
                        DType copy_dtype, int64_t n, const AdamWStep& step, int num_threads) {
  DSTRAIN_CHECK(moment_dtype == DType::F32 || moment_dtype == DType::BF16)
      << "host_adamw moments must be F32 or BF16, not " << dtype_name(moment_dtype);
  DSTRAIN_CHECK(step.step >= 1) << "host_adamw step " << step.step << " must be >= 1 (1-based)";
  DSTRAIN_CHECK(n >= 0) << "host_adamw n = " << n << " must be >= 0";
  DSTRAIN_CHECK(grad_dtype == DType::F32 || grad_dtype == DType::F16 || grad_dtype == DType::BF16)
      << "host_adamw grad must be F32, F16 or BF16, not " << dtype_name(grad_dtype);
  DSTRAIN_CHECK(param_copy == nullptr || copy_dtype == DType::F16 || copy_dtype == DType::BF16)
      << "host_adamw param_copy must be F16 or BF16, not " << dtype_name(copy_dtype);
  DSTRAIN_CHECK(host_adamw_isa_supported(isa))
      << "host_adamw: this CPU cannot run the " << host_adamw_isa_name(isa)
      << " level (best: " << host_adamw_isa() << ")";
  if (n == 0) return;
  DSTRAIN_CHECK(param != nullptr && grad != nullptr && m != nullptr && v != nullptr)
      << "host_adamw: null param, grad, m or v for n = " << n;
  // A 16-bit copy may share the 16-bit grad buffer, but never the fp32 state.
  DSTRAIN_CHECK(param_copy == nullptr ||
                (static_cast<void*>(param_copy) != param && static_cast<void*>(param_copy) != m &&
                 static_cast<void*>(param_copy) != v &&
                 (param_copy != grad || grad_dtype != DType::F32)))
      << "host_adamw param_copy may alias only a 16-bit grad";

  const GradFormat grad_format = grad_dtype == DType::F16    ? GradFormat::F16
                                 : grad_dtype == DType::BF16 ? GradFormat::BF16
                                                             : GradFormat::F32;
  const CopyFormat copy_format = param_copy == nullptr      ? CopyFormat::None
                                 : copy_dtype == DType::F16 ? CopyFormat::F16
                                                            : CopyFormat::BF16;
  const MomentFormat moment_format =
      moment_dtype == DType::BF16 ? MomentFormat::BF16 : MomentFormat::F32;
  const HostAdamWIsa level = isa == HostAdamWIsa::Auto ? best_isa() : isa;
  const Buffers buffers{param, grad, m, v, param_copy};
  run_in_chunks(kernel_for(level, grad_format, copy_format, moment_format), buffers,
                step_constants(step), n, num_threads);
}

void host_adamw(float* param, const void* grad, DType grad_dtype, float* m, float* v,
                uint16_t* param_copy, DType copy_dtype, int64_t n, const AdamWStep& step,
                int num_threads) {
  host_adamw_with(HostAdamWIsa::Auto, param, grad, grad_dtype, m, v, param_copy, copy_dtype, n,
                  step, num_threads);
}

void host_adamw(float* param, const float* grad, float* m, float* v, int64_t n,
                const AdamWStep& step, int num_threads) {
  host_adamw_with(HostAdamWIsa::Auto, param, grad, DType::F32, m, v, nullptr, DType::F16, n, step,
                  num_threads);
}

}  // namespace dstrain
