// AVX2 + F16C row dequantisers and fp16 row conversions (compiled with -mavx2 -mfma -mf16c).
//
// Each block is first decoded to its small integers (int8, in element order, 32 at a time), then
// converted to float and scaled with exactly the float operations of dequantize_row_ref: a plain
// multiply, then an add or subtract (never an fma), so the results are bit-identical.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "core/fp16.h"
#include "ops/quant.h"
#include "ops/quant_simd.h"

namespace d2o::simd {

namespace {

inline __m256 cvt8(__m128i q8_low8) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8_low8));
}

// The 32 int8 values of q as 4 float vectors of 8 (element order).
struct Floats32 {
  __m256 v[4];
};
inline Floats32 to_floats(__m256i q) {
  const __m128i lo = _mm256_castsi256_si128(q);
  const __m128i hi = _mm256_extracti128_si256(q, 1);
  return {{cvt8(lo), cvt8(_mm_srli_si128(lo, 8)), cvt8(hi), cvt8(_mm_srli_si128(hi, 8))}};
}

// y[i] = d * q[i]; d0 for elements 0..15, d1 for 16..31.
inline void store_scaled(float* y, __m256i q, float d0, float d1) {
  const Floats32 f = to_floats(q);
  const __m256 a = _mm256_set1_ps(d0), b = _mm256_set1_ps(d1);
  _mm256_storeu_ps(y, _mm256_mul_ps(a, f.v[0]));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(a, f.v[1]));
  _mm256_storeu_ps(y + 16, _mm256_mul_ps(b, f.v[2]));
  _mm256_storeu_ps(y + 24, _mm256_mul_ps(b, f.v[3]));
}

// y[i] = d * q[i] + m (Q4_1, Q5_1).
inline void store_mul_add(float* y, __m256i q, float d, float m) {
  const Floats32 f = to_floats(q);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  for (int k = 0; k < 4; ++k)
    _mm256_storeu_ps(y + 8 * k, _mm256_add_ps(_mm256_mul_ps(vd, f.v[k]), vm));
}

// y[i] = dl * q[i] - ml, (dl0, ml0) for elements 0..15, (dl1, ml1) for 16..31 (K formats).
inline void store_mul_sub(float* y, __m256i q, const float dl[2], const float ml[2]) {
  const Floats32 f = to_floats(q);
  for (int k = 0; k < 4; ++k) {
    const __m256 vd = _mm256_set1_ps(dl[k / 2]), vm = _mm256_set1_ps(ml[k / 2]);
    _mm256_storeu_ps(y + 8 * k, _mm256_sub_ps(_mm256_mul_ps(vd, f.v[k]), vm));
  }
}

// 16 packed bytes -> 32 nibbles: low nibbles first (elements 0..15), then high nibbles.
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

// Bit i of the 32-bit word -> byte i = 0x10 or 0 (bit 4 of the Q5 formats).
inline __m256i bits_to_0x10(uint32_t bits) {
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                          0x0202020202020202, 0x0303030303030303);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void q4_0(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ4_0*>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    const __m256i q = _mm256_sub_epi8(unpack_nibbles(x[i].qs), _mm256_set1_epi8(8));
    store_scaled(y, q, d, d);
  }
}

void q4_1(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ4_1*>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    store_mul_add(y, unpack_nibbles(x[i].qs), fp16_to_fp32(x[i].d), fp16_to_fp32(x[i].m));
  }
}

void q5_0(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ5_0*>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    __m256i q = _mm256_or_si256(unpack_nibbles(x[i].qs), bits_to_0x10(load_u32(x[i].qh)));
    q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    store_scaled(y, q, d, d);
  }
}

void q5_1(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ5_1*>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const __m256i q = _mm256_or_si256(unpack_nibbles(x[i].qs), bits_to_0x10(load_u32(x[i].qh)));
    store_mul_add(y, q, fp16_to_fp32(x[i].d), fp16_to_fp32(x[i].m));
  }
}

void q8_0(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ8_0*>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs));
    store_scaled(y, q, d, d);
  }
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// (v >> shift) & mask on bytes (shift < 8; the 16-bit shift's spill-over is masked away).
inline __m256i bits_at(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)),
                          _mm256_set1_epi8(static_cast<char>(mask)));
}

void q2_k(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ2_K*>(src);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const float dmin = fp16_to_fp32(x[i].dmin);
    for (int g = 0; g < 2; ++g) {
      const __m256i raw = load32(x[i].qs + 32 * g);
      for (int s = 0; s < 4; ++s, y += 32) {
        const int j = 8 * g + 2 * s;  // first of the two 16-element sub-blocks
        const float dl[2] = {d * static_cast<float>(x[i].scales[j] & 0x0F),
                             d * static_cast<float>(x[i].scales[j + 1] & 0x0F)};
        const float ml[2] = {dmin * static_cast<float>(x[i].scales[j] >> 4),
                             dmin * static_cast<float>(x[i].scales[j + 1] >> 4)};
        store_mul_sub(y, bits_at(raw, 2 * s, 3), dl, ml);
      }
    }
  }
}

void q3_k(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ3_K*>(src);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    int8_t scales[16];
    unpack_scales_q3_k(x[i].scales, scales);
    const __m256i hmask = load32(x[i].hmask);
    for (int g = 0; g < 2; ++g) {
      const __m256i raw = load32(x[i].qs + 32 * g);
      for (int s = 0; s < 4; ++s, y += 32) {
        const int j = 8 * g + 2 * s;
        const __m256i low = bits_at(raw, 2 * s, 3);
        // A clear hmask bit subtracts 4: q = low - 4 + 4 * bit.
        const __m256i high4 = _mm256_slli_epi16(bits_at(hmask, 4 * g + s, 1), 2);
        const __m256i q = _mm256_sub_epi8(_mm256_add_epi8(low, high4), _mm256_set1_epi8(4));
        store_scaled(y, q, d * static_cast<float>(scales[j]),
                     d * static_cast<float>(scales[j + 1]));
      }
    }
  }
}

template <bool kFive>
void q45_k(const void* src, float* y, int64_t nb) {
  // Q4_K and Q5_K share scales and nibble layout; Q5_K adds bit 4 from qh.
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk =
        static_cast<const uint8_t*>(src) + i * (kFive ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
    uint16_t dh, dmh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&dmh, blk + 2, 2);
    const float d = fp16_to_fp32(dh), dmin = fp16_to_fp32(dmh);
    const uint8_t* scales = blk + 4;
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (kFive ? 48 : 16);
    const __m256i vqh = kFive ? load32(qh) : _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = load32(qs + 32 * p);
      for (int s = 0; s < 2; ++s, y += 32) {
        const int j = 2 * p + s;
        uint8_t sc, m;
        get_scale_min_k4(j, scales, &sc, &m);
        const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
        __m256i q = bits_at(raw, 4 * s, 0x0F);
        if (kFive) q = _mm256_or_si256(q, _mm256_slli_epi16(bits_at(vqh, j, 1), 4));
        const float dls[2] = {dl, dl}, mls[2] = {ml, ml};
        store_mul_sub(y, q, dls, mls);
      }
    }
  }
}

void q6_k(const void* src, float* y, int64_t nb) {
  const auto* x = static_cast<const BlockQ6_K*>(src);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    for (int g = 0; g < 2; ++g) {
      const __m256i qh = load32(x[i].qh + 32 * g);
      for (int s = 0; s < 4; ++s, y += 32) {
        // Elements 128g + 32s + l: low 4 bits from ql[64g + 32(s%2) + l] nibble s/2.
        const __m256i ql = load32(x[i].ql + 64 * g + 32 * (s % 2));
        const __m256i low = bits_at(ql, 4 * (s / 2), 0x0F);
        const __m256i high = _mm256_slli_epi16(bits_at(qh, 2 * s, 3), 4);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
        const int j = 8 * g + 2 * s;
        store_scaled(y, q, d * static_cast<float>(x[i].scales[j]),
                     d * static_cast<float>(x[i].scales[j + 1]));
      }
    }
  }
}

}  // namespace

void fp16_to_fp32_row_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

void fp16_axpy_row_avx2(float* acc, const void* x, float w, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(x);
  const __m256 vw = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    const __m256 prod = _mm256_mul_ps(vw, _mm256_cvtph_ps(h));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), prod));
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof h);
    const float prod = w * fp16_to_fp32(h);
    acc[i] = acc[i] + prod;
  }
}

void fp32_to_fp16_row_avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

bool dequantize_row_avx2(GgmlType type, const void* src, float* dst, int64_t n) {
  const int64_t nb = n / ggml_block_size(type);
  switch (type) {
    case GgmlType::kF16: {
      // The source may be unaligned for uint16_t (a row inside a byte buffer): copy-free via
      // unaligned vector loads, scalar tail through memcpy.
      const auto* h = static_cast<const uint8_t*>(src);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(v));
      }
      for (; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, h + 2 * i, 2);
        dst[i] = fp16_to_fp32(v);
      }
      return true;
    }
    case GgmlType::kBF16: {
      const auto* h = static_cast<const uint8_t*>(src);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
      }
      for (; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, h + 2 * i, 2);
        dst[i] = bf16_to_fp32(v);
      }
      return true;
    }
    case GgmlType::kQ4_0:
      q4_0(src, dst, nb);
      return true;
    case GgmlType::kQ4_1:
      q4_1(src, dst, nb);
      return true;
    case GgmlType::kQ5_0:
      q5_0(src, dst, nb);
      return true;
    case GgmlType::kQ5_1:
      q5_1(src, dst, nb);
      return true;
    case GgmlType::kQ8_0:
      q8_0(src, dst, nb);
      return true;
    case GgmlType::kQ2_K:
      q2_k(src, dst, nb);
      return true;
    case GgmlType::kQ3_K:
      q3_k(src, dst, nb);
      return true;
    case GgmlType::kQ4_K:
      q45_k<false>(src, dst, nb);
      return true;
    case GgmlType::kQ5_K:
      q45_k<true>(src, dst, nb);
      return true;
    case GgmlType::kQ6_K:
      q6_k(src, dst, nb);
      return true;
    default:
      return false;  // F32: the reference memcpy is as fast as it gets
  }
}

// Per block: max |x| (vector maxima of finite values: the same as the scalar running maximum),
// the scale and its inverse in scalar, x * id as one rounded product per element, then round half
// away from zero as the scalar round_q8 does it (the truncation, plus or minus one where the exact
// remainder is at least a half), converted and packed in element order.
int64_t quantize_row_q8_0_avx2(const float* x, BlockQ8_0* y, int64_t n) {
  const int64_t nb = n / kQK;
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  const __m256 half = _mm256_set1_ps(0.5f), mhalf = _mm256_set1_ps(-0.5f),
               one = _mm256_set1_ps(1.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    __m256 v[4], a[4];
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      a[i] = _mm256_andnot_ps(sign, v[i]);
    }
    // Finite: |x| < inf is false for infinities and NaN.
    const __m256 fin = _mm256_and_ps(
        _mm256_and_ps(_mm256_cmp_ps(a[0], inf, _CMP_LT_OQ), _mm256_cmp_ps(a[1], inf, _CMP_LT_OQ)),
        _mm256_and_ps(_mm256_cmp_ps(a[2], inf, _CMP_LT_OQ), _mm256_cmp_ps(a[3], inf, _CMP_LT_OQ)));
    if (_mm256_movemask_ps(fin) != 0xFF) return b;
    __m256 m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    const __m256 idv = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 p = _mm256_mul_ps(v[i], idv);
      const __m256 t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 f = _mm256_sub_ps(p, t);
      const __m256 up = _mm256_and_ps(_mm256_cmp_ps(f, half, _CMP_GE_OQ), one);
      const __m256 down = _mm256_and_ps(_mm256_cmp_ps(f, mhalf, _CMP_LE_OQ), one);
      q[i] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(t, up), down));
    }
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), b8);
  }
  return nb;
}

}  // namespace d2o::simd
