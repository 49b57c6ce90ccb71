// AVX-512 VNNI kernels of the matmul (compiled with AVX-512 F/BW/VL/DQ/VNNI flags).
//
// A micro-tile is 16 weight rows (one zmm lane per row) times NT <= 4 tokens. Per group of 4
// elements, one 64-byte load of packed weights holds 4 unsigned bytes per row; vpdpbusd with the
// token's 4 activation bytes broadcast from memory adds their dot product into each row's lane.
// The weight vectors are decoded once per block and reused for all NT tokens. Arithmetic is the
// one defined in matmul_kernels.h, so results equal the scalar kernels bit for bit.
//
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which
// -W(maybe-)uninitialized reports as a false positive once inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "ops/matmul_kernels.h"
#include "ops/quant.h"
#include "ops/vmath_avx512.h"

// Small fixed-count loops over tokens, rows and groups must be unrolled completely so that the
// accumulator arrays live in registers (GCC -O2 would otherwise keep them on the stack).
#define D2O_UNROLL _Pragma("GCC unroll 16")

namespace d2o::mm {

namespace {

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512i bcast4(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i load64(const uint8_t* p) {
  return _mm512_loadu_si512(p);
}
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// a | (b & c) in one instruction.
inline __m512i or_and(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi32(a, b, c, 0xF8);
}

inline void store_rows(const TileJob& job, int t, __m512 v) {
  float* y = job.y + t * job.y_stride;
  if (job.rows == kTileRows) {
    _mm512_storeu_ps(y, v);
  } else {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << job.rows) - 1u), v);
  }
}

// ---- activation quantisation ----------------------------------------------------------------

// round_to_half (matmul_kernels.h) on 16 lanes: fp16 round trip (nearest-even) unless |v| >= 65520.
inline __m512 round_to_half16(__m512 v) {
  const __m512 h =
      _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __mmask16 in_range =
      _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(65520.0f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(in_range, v, h);
}

// Q8_0 / Q8_1 records of blocks 0 .. 16k-1, 16 blocks at a time: the per-block maxima, scales
// and sums are formed as vectors (reduce_each16) instead of one horizontal reduction and scalar
// fp16 rounding per block. The same values as the per-block code: maxima and sums of the
// quantised integers do not depend on the order, divisions and fp16 rounding are IEEE in both.
// Returns the number of blocks done.
int64_t quantize_q8x32_by16(const ActLayout& l, const float* x, uint8_t* rec) {
  auto* qs = reinterpret_cast<int8_t*>(rec);
  auto* d = reinterpret_cast<float*>(rec + l.off_d);
  int32_t* qsum = act_a_mut<int32_t>(l, rec);
  float* dsum = act_b_mut<float>(l, rec);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512 k127 = _mm512_set1_ps(127.0f);
  auto vmax = [](__m512 a, __m512 c) { return _mm512_max_ps(a, c); };
  auto vadd = [](__m512 a, __m512 c) { return _mm512_add_ps(a, c); };
  const int64_t n16 = l.n_cols / 32 / 16 * 16;
  for (int64_t b0 = 0; b0 < n16; b0 += 16) {
    __m512 m[16];
    D2O_UNROLL
    for (int k = 0; k < 16; ++k) {
      const float* xb = x + (b0 + k) * 32;
      m[k] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)),
                           _mm512_abs_ps(_mm512_loadu_ps(xb + 16)));
    }
    const __m512 amax = simd::reduce_each16(m, vmax);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    alignas(64) float mul[16];
    _mm512_store_ps(mul, _mm512_maskz_div_ps(nonzero, k127, amax));
    const __m512 step = _mm512_div_ps(amax, k127);  // amax / 127
    _mm512_storeu_ps(d + b0, round_to_half16(step));
    __m512 sums[16];
    for (int k = 0; k < 16; ++k) {
      const float* xb = x + (b0 + k) * 32;
      const __m512 vmul = _mm512_set1_ps(mul[k]);
      __m512 r[2];
      D2O_UNROLL
      for (int h = 0; h < 2; ++h) {
        r[h] = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), vmul),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r[h] = _mm512_min_ps(_mm512_max_ps(r[h], lo), hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + (b0 + k) * 32 + 16 * h),
                         _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r[h])));
      }
      sums[k] = _mm512_add_ps(r[0], r[1]);  // integers below 2^8: exact
    }
    const __m512 s = simd::reduce_each16(sums, vadd);  // |sum| <= 4064: exact
    _mm512_storeu_si512(qsum + b0, _mm512_cvttps_epi32(s));
    _mm512_storeu_ps(dsum + b0, round_to_half16(_mm512_mul_ps(step, s)));
  }
  return n16;
}

void quantize_avx512(const ActLayout& l, const float* x, uint8_t* rec) {
  auto* qs = reinterpret_cast<int8_t*>(rec);
  auto* d = reinterpret_cast<float*>(rec + l.off_d);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  // Sum of 16 quantised values.
  auto sum16 = [&](int64_t k) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * k));
    return _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(v));
  };
  const int64_t nb = l.n_cols / l.block;
  int64_t b = 0;
  if (l.format == ActFormat::kQ8x32) b = quantize_q8x32_by16(l, x, rec);
  for (; b < nb; ++b) {
    const float* xb = x + b * l.block;
    __m512 vmax = _mm512_setzero_ps();
    D2O_UNROLL
    for (int64_t i = 0; i < l.block; i += 16) {
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    Q8Scale sc;
    if (l.format == ActFormat::kQ8x32) {
      sc = q8x32_scale(amax);
    } else {
      float m = 0.0f;  // the first element of largest magnitude
      for (int64_t i = 0; amax > 0.0f && i < l.block; ++i) {
        if (xb[i] == amax || xb[i] == -amax) {
          m = xb[i];
          break;
        }
      }
      sc = q8x256_scale(m);
    }
    d[b] = sc.d;
    const __m512 vmul = _mm512_set1_ps(sc.mul);
    for (int64_t i = 0; i < l.block; i += 16) {
      __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vmul),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + b * l.block + i),
                       _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
    }
    if (l.format == ActFormat::kQ8x32) {
      const int32_t s = sum16(2 * b) + sum16(2 * b + 1);
      act_a_mut<int32_t>(l, rec)[b] = s;
      act_b_mut<float>(l, rec)[b] = q8x32_dsum(amax, s);
    }
  }
  if (l.format == ActFormat::kQ8x256) {
    auto* s32 = act_a_mut<int16_t>(l, rec);
    auto* s16 = act_b_mut<int16_t>(l, rec);
    for (int64_t k = 0; k < l.n_cols / 16; ++k) s16[k] = static_cast<int16_t>(sum16(k));
    for (int64_t b = 0; b < l.n_cols / 32; ++b) {
      s32[b] = static_cast<int16_t>(s16[2 * b] + s16[2 * b + 1]);
    }
  }
}

// ---- Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL ----------------------------------------------------------

// kIq4Values + 128 (1..241) in every 128-bit lane: vpshufb turns IQ4 nibbles into the unsigned
// bytes vpdpbusd takes; the excess 128 * sum(x) is removed with the block's bias.
inline __m512i iq4_lut_u8() {
  alignas(16) uint8_t v[16];
  for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(kIq4Values[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(v)));
}

template <PackKind kKind, int NT>
void tile_32(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const uint8_t* dsec = job.tile + w.section_offset[0];
  const uint8_t* msec = job.tile + w.section_offset[1];  // Q4_1 only
  const uint8_t* qsec = job.tile + w.section_offset[kKind == PackKind::kQ4_1 ? 2 : 1];
  const uint8_t* hsec = job.tile + w.section_offset[2];  // Q5_0 only
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i m10 = _mm512_set1_epi8(0x10);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i lut = kKind == PackKind::kIQ4_NL ? iq4_lut_u8() : _mm512_setzero_si512();
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    // Two integer accumulators per token (even and odd groups) so that 2 * NT independent
    // vpdpbusd chains hide its latency; integer sums are exact, so the split changes nothing.
    __m512i is[NT], is2[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) is[t] = is2[t] = _mm512_setzero_si512();
    if (kKind == PackKind::kQ8_0) {
      const uint8_t* q = qsec + 512 * b;
      D2O_UNROLL
      for (int g = 0; g < 8; g += 2) {
        // Signed weights made unsigned (+128); the excess 128 * sum(x) is removed below.
        const __m512i wv0 = _mm512_xor_si512(load64(q + 64 * g), sign);
        const __m512i wv1 = _mm512_xor_si512(load64(q + 64 * (g + 1)), sign);
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* xb = act_qs(rec[t]) + 32 * b;
          is[t] = _mm512_dpbusd_epi32(is[t], wv0, bcast4(xb + 4 * g));
          is2[t] = _mm512_dpbusd_epi32(is2[t], wv1, bcast4(xb + 4 * (g + 1)));
        }
      }
    } else {
      const uint8_t* q = qsec + 256 * b;
      const __m512i h = kKind == PackKind::kQ5_0 ? load64(hsec + 64 * b) : _mm512_setzero_si512();
      D2O_UNROLL
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = load64(q + 64 * v);
        __m512i lo = _mm512_and_si512(raw, m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        if (kKind == PackKind::kQ5_0) {
          // Bit g of h is bit 4 of group g (lo: g = v, hi: g = v + 4).
          lo = or_and(lo, _mm512_slli_epi16(h, 4 - v), m10);
          hi = or_and(hi, _mm512_srli_epi16(h, v), m10);
        }
        if (kKind == PackKind::kIQ4_NL) {
          lo = _mm512_shuffle_epi8(lut, lo);
          hi = _mm512_shuffle_epi8(lut, hi);
        }
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* xb = act_qs(rec[t]) + 32 * b;
          is[t] = _mm512_dpbusd_epi32(is[t], lo, bcast4(xb + 4 * v));
          is2[t] = _mm512_dpbusd_epi32(is2[t], hi, bcast4(xb + 16 + 4 * v));
        }
      }
    }
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) is[t] = _mm512_add_epi32(is[t], is2[t]);
    const __m512 dw = half16(dsec + 32 * b);
    const __m512 mw = kKind == PackKind::kQ4_1 ? half16(msec + 32 * b) : _mm512_setzero_ps();
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      __m512i isum = is[t];
      if (kKind != PackKind::kQ4_1) {
        // The weights' offset: 8 (Q4_0), 16 (Q5_0), 128 (Q8_0 and IQ4_NL, made unsigned above).
        const int32_t scale = kKind == PackKind::kQ4_0 ? 8 : (kKind == PackKind::kQ5_0 ? 16 : 128);
        const int32_t bias = scale * act_a<int32_t>(al, rec[t])[b];
        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(bias));
      }
      const __m512 dwdx = _mm512_mul_ps(dw, _mm512_set1_ps(act_d(al, rec[t])[b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dwdx, acc[t]);
      if (kKind == PackKind::kQ4_1) {
        acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(act_b<float>(al, rec[t])[b]), acc[t]);
      }
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- Q4_K, Q5_K ------------------------------------------------------------------------------

template <bool kFive, int NT>
void tile_q45_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i m10 = _mm512_set1_epi8(0x10);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, 2, b);
    const uint8_t* mn = section(w, job.tile, 3, b);
    const uint8_t* qs = section(w, job.tile, 4, b);
    const uint8_t* qh = kFive ? section(w, job.tile, 5, b) : nullptr;
    __m512i total[NT], mins[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = mins[t] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      // Lane r: (scale of sub-block 2p, scale of 2p+1) as two int16; same for the mins.
      const __m512i sc16 = _mm512_cvtepu8_epi16(load32(sc + 32 * p));
      const __m512i mn16 = _mm512_cvtepu8_epi16(load32(mn + 32 * p));
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * p + s;
        const __m512i scale = s == 0 ? _mm512_and_si512(sc16, low16) : _mm512_srli_epi32(sc16, 16);
        const __m512i h = kFive ? load64(qh + 64 * j) : _mm512_setzero_si512();
        __m512i is[NT];
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) is[t] = _mm512_setzero_si512();
        D2O_UNROLL
        for (int c = 0; c < 4; ++c) {
          const __m512i raw = load64(qs + 256 * j + 64 * c);
          __m512i lo = _mm512_and_si512(raw, m4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
          if (kFive) {
            // Bit g of h is bit 4 of group g (lo: g = c, hi: g = c + 4).
            lo = or_and(lo, _mm512_slli_epi16(h, 4 - c), m10);
            hi = or_and(hi, _mm512_srli_epi16(h, c), m10);
          }
          D2O_UNROLL
          for (int t = 0; t < NT; ++t) {
            const int8_t* xs = act_qs(rec[t]) + 256 * b + 32 * j;
            is[t] = _mm512_dpbusd_epi32(is[t], lo, bcast4(xs + 4 * c));
            is[t] = _mm512_dpbusd_epi32(is[t], hi, bcast4(xs + 16 + 4 * c));
          }
        }
        D2O_UNROLL
        for (int t = 0; t < NT; ++t)
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is[t], scale));
      }
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        mins[t] =
            _mm512_dpwssd_epi32(mins[t], mn16, bcast4(act_a<int16_t>(al, rec[t]) + 8 * b + 2 * p));
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    const __m512 dmin = half16(section(w, job.tile, 1, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 dx = _mm512_set1_ps(act_d(al, rec[t])[b]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[t]), _mm512_mul_ps(dw, dx), acc[t]);
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[t]), _mm512_mul_ps(dmin, dx), acc[t]);
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- Q6_K ------------------------------------------------------------------------------------

template <int NT>
void tile_q6_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, 1, b);
    const uint8_t* ql = section(w, job.tile, 2, b);
    const uint8_t* qh = section(w, job.tile, 3, b);
    __m512i total[NT], offs[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
      const __m512i sc16 = _mm512_cvtepi8_epi16(load32(sc + 32 * p));  // signed pairs
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        offs[t] =
            _mm512_dpwssd_epi32(offs[t], sc16, bcast4(act_b<int16_t>(al, rec[t]) + 16 * b + 2 * p));
      }
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * p + s;
        const __m512i scale = s == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16)
                                     : _mm512_srai_epi32(sc16, 16);
        const __m512i l0 = load64(ql + 128 * j), l1 = load64(ql + 128 * j + 64);
        const __m512i h = load64(qh + 64 * j);
        // Group u: low nibble from chunk u / 2 (nibble u % 2), high bits 2u..2u+1 of h.
        __m512i wv[4];
        wv[0] = or_and(_mm512_and_si512(l0, m4), _mm512_slli_epi16(h, 4), m30);
        wv[1] =
            or_and(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_slli_epi16(h, 2), m30);
        wv[2] = or_and(_mm512_and_si512(l1, m4), h, m30);
        wv[3] =
            or_and(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_srli_epi16(h, 2), m30);
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* xs = act_qs(rec[t]) + 256 * b + 16 * j;
          __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(xs));
          is = _mm512_dpbusd_epi32(is, wv[1], bcast4(xs + 4));
          is = _mm512_dpbusd_epi32(is, wv[2], bcast4(xs + 8));
          is = _mm512_dpbusd_epi32(is, wv[3], bcast4(xs + 12));
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is, scale));
        }
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512i tot = _mm512_sub_epi32(total[t], _mm512_slli_epi32(offs[t], 5));
      const __m512 dwdx = _mm512_mul_ps(dw, _mm512_set1_ps(act_d(al, rec[t])[b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), dwdx, acc[t]);
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- IQ4_XS ----------------------------------------------------------------------------------

// Sub-block j of block b: the unsigned table bytes (value + 128) times the token's quants.
template <int NT>
inline void iq4_xs_sub(const uint8_t* qs, const uint8_t* const* rec, int64_t b, int j, __m512i lut,
                       __m512i* is) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) is[t] = _mm512_setzero_si512();
  D2O_UNROLL
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = load64(qs + 256 * j + 64 * c);
    const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, m4));
    const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const int8_t* xs = act_qs(rec[t]) + 256 * b + 32 * j;
      is[t] = _mm512_dpbusd_epi32(is[t], lo, bcast4(xs + 4 * c));
      is[t] = _mm512_dpbusd_epi32(is[t], hi, bcast4(xs + 16 + 4 * c));
    }
  }
}

// The excess 128 * sum(x) of the unsigned bytes is removed once per block, as
// 128 * sum_j sc_j * qsum32_j (vpdpwssd on the scale pairs, like the K formats' mins).
template <int NT>
void tile_iq4_xs(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m512i lut = iq4_lut_u8();
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, 1, b);
    const uint8_t* qs = section(w, job.tile, 2, b);
    __m512i total[NT], offs[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      const __m512i sc16 = _mm512_cvtepi8_epi16(load32(sc + 32 * p));  // signed pairs
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        offs[t] =
            _mm512_dpwssd_epi32(offs[t], sc16, bcast4(act_a<int16_t>(al, rec[t]) + 8 * b + 2 * p));
      }
      for (int s = 0; s < 2; ++s) {
        const __m512i scale = s == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16)
                                     : _mm512_srai_epi32(sc16, 16);
        __m512i is[NT];
        iq4_xs_sub<NT>(qs, rec, b, 2 * p + s, lut, is);
        D2O_UNROLL
        for (int t = 0; t < NT; ++t)
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is[t], scale));
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512i tot = _mm512_sub_epi32(total[t], _mm512_slli_epi32(offs[t], 7));
      const __m512 dwdx = _mm512_mul_ps(dw, _mm512_set1_ps(act_d(al, rec[t])[b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), dwdx, acc[t]);
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- Q3_K, Q2_K ------------------------------------------------------------------------------

// The 4 weight vectors (groups u = 0..3) of sub-block 2p + s: 2 low bits from ql, Q3_K's bit 2
// from bit 4s + u of its qh chunk h.
template <bool kThree>
inline void q23_weights(__m512i wl, __m512i h, int s, __m512i* wv) {
  const __m512i m3 = _mm512_set1_epi8(3), m04 = _mm512_set1_epi8(4);
  D2O_UNROLL
  for (int u = 0; u < 4; ++u) {
    wv[u] = _mm512_and_si512(_mm512_srli_epi16(wl, 2 * u), m3);
    if (kThree) {
      const int shift = 4 * s + u - 2;  // bit 4s + u to bit 2 (within the byte: shift <= 5)
      const __m512i hv = shift >= 0 ? _mm512_srli_epi16(h, shift) : _mm512_slli_epi16(h, -shift);
      wv[u] = or_and(wv[u], hv, m04);
    }
  }
}

template <bool kThree, int NT>
void tile_q23_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, kThree ? 1 : 2, b);
    const uint8_t* mn = section(w, job.tile, kThree ? 1 : 3, b);
    const uint8_t* ql = section(w, job.tile, kThree ? 2 : 4, b);
    __m512i total[NT], offs[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
      // Lane r: (scale of sub-block 2p, of 2p + 1) as int16; the same for Q2_K's mins.
      const __m512i sc16 = kThree ? _mm512_cvtepi8_epi16(load32(sc + 32 * p))
                                  : _mm512_cvtepu8_epi16(load32(sc + 32 * p));
      const __m512i mn16 = kThree ? sc16 : _mm512_cvtepu8_epi16(load32(mn + 32 * p));
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        offs[t] =
            _mm512_dpwssd_epi32(offs[t], mn16, bcast4(act_b<int16_t>(al, rec[t]) + 16 * b + 2 * p));
      }
      const __m512i h =
          kThree ? load64(section(w, job.tile, 3, b) + 64 * p) : _mm512_setzero_si512();
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * p + s;
        const __m512i scale = s == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16)
                                     : _mm512_srai_epi32(sc16, 16);
        __m512i wv[4];
        q23_weights<kThree>(load64(ql + 64 * j), h, s, wv);
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* xs = act_qs(rec[t]) + 256 * b + 16 * j;
          __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(xs));
          is = _mm512_dpbusd_epi32(is, wv[1], bcast4(xs + 4));
          is = _mm512_dpbusd_epi32(is, wv[2], bcast4(xs + 8));
          is = _mm512_dpbusd_epi32(is, wv[3], bcast4(xs + 12));
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is, scale));
        }
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    const __m512 dmin = kThree ? _mm512_setzero_ps() : half16(section(w, job.tile, 1, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 dx = _mm512_set1_ps(act_d(al, rec[t])[b]);
      if (kThree) {
        const __m512i tot = _mm512_sub_epi32(total[t], _mm512_slli_epi32(offs[t], 2));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(dw, dx), acc[t]);
      } else {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[t]), _mm512_mul_ps(dw, dx), acc[t]);
        acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(offs[t]), _mm512_mul_ps(dmin, dx), acc[t]);
      }
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- BF16 ------------------------------------------------------------------------------------

// One 64-byte load holds a pair of elements of each of the 16 rows; a shift (element 2b) and a
// mask (element 2b + 1) make them fp32. Blocks alternate between two pairs of accumulators.
template <int NT>
void tile_bf16(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const uint8_t* sec = job.tile + w.section_offset[0];
  const float* x[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t)
    x[t] = reinterpret_cast<const float*>(job.act + t * job.acts->stride);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a[NT][4];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) D2O_UNROLL
  for (int c = 0; c < 4; ++c) a[t][c] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int c) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const __m512i v = load64(sec + 64 * b);
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      a[t][c] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[t][2 * b]), a[t][c]);
      a[t][c + 1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[t][2 * b + 1]), a[t][c + 1]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= w.n_blocks; b += 2) {
    step(b, 0);
    step(b + 1, 2);
  }
  if (b < w.n_blocks) step(b, 0);
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) {
    store_rows(job, t,
               _mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
  }
}

// ---- fp32 path -------------------------------------------------------------------------------

template <int NR, int NT>
void f32_tile(const F32Job& job) {
  __m512 acc[NR][NT];
  D2O_UNROLL
  for (int i = 0; i < NR; ++i) D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  int64_t k = 0;
  auto step = [&](__mmask16 m) {
    __m512 xv[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_maskz_loadu_ps(m, job.x + t * job.x_stride + k);
    D2O_UNROLL
    for (int i = 0; i < NR; ++i) {
      const __m512 wv = _mm512_maskz_loadu_ps(m, job.rows[i] + k);
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
    }
  };
  for (; k + 16 <= job.n; k += 16) step(0xFFFF);
  if (k < job.n) step(static_cast<__mmask16>((1u << (job.n - k)) - 1u));
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) D2O_UNROLL
  for (int i = 0; i < NR; ++i) job.y[t * job.y_stride + i] = _mm512_reduce_add_ps(acc[i][t]);
}

#include "ops/matmul_table_impl.h"  // the dispatch glue and make_kernel_table

}  // namespace

const KernelTable& kernels_avx512() {
  static const KernelTable table = make_kernel_table(quantize_avx512);
  return table;
}

}  // namespace d2o::mm
