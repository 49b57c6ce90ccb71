// AVX-512 VNNI kernels of the matmul (compiled with AVX-512 F/BW/VL/DQ/VNNI flags): activation
// quantisation, the formats in 32-element blocks (Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL), the fp32 path
// and the level's kernel table. The tiles of the formats in 256-element blocks (Q2_K .. Q6_K,
// IQ4_XS) and of BF16 are in matmul_kquant_avx512.cpp.
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
#include "ops/matmul_kquant.h"
#include "ops/quant.h"
#include "ops/vmath_avx512.h"

// Small fixed-count loops over tokens, rows and groups must be unrolled completely so that the
// accumulator arrays live in registers (GCC -O2 would otherwise keep them on the stack).
#define D2O_UNROLL _Pragma("GCC unroll 16")

namespace d2o::mm {

namespace {

#include "ops/matmul_avx512_impl.h"  // helpers shared with matmul_kquant_avx512.cpp

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
  static const KernelTable table = make_kernel_table(quantize_avx512, kquant_tiles_avx512());
  return table;
}

}  // namespace d2o::mm
