// AVX2 kernels of the matmul (compiled with -mavx2 -mfma -mf16c): activation quantisation, the
// formats in 32-element blocks (Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL), the fp32 path and the level's
// kernel table. The tiles of the formats in 256-element blocks (Q2_K .. Q6_K, IQ4_XS) and of BF16
// are in matmul_kquant_avx2.cpp.
//
// Same packed layouts and micro-tiles as the AVX-512 kernels, processed as two halves of 8 rows
// (one ymm lane per row). AVX2 has no VNNI: vpmaddubsw multiplies unsigned weight bytes with
// signed activation bytes into int16 pair sums, which are accumulated in int16 only as far as
// they provably cannot saturate (|x| <= 127: 8 products of 4-bit weights, 4 of 5-bit, 2 of
// 6-bit), then widened by vpmaddwd, with ones or, for the K formats, directly with the sub-block
// scales. Q8_0 uses |w| x sign(x, w). Integer results equal the exact sums, so the output is
// bit-identical to the scalar and AVX-512 kernels.
#include <immintrin.h>

#include <cstring>

#include "ops/matmul_kernels.h"
#include "ops/matmul_kquant.h"
#include "ops/quant.h"

// Small fixed-count loops over tokens, rows and groups must be unrolled completely so that the
// accumulator arrays live in registers (GCC -O2 would otherwise keep them on the stack).
#define D2O_UNROLL _Pragma("GCC unroll 16")

namespace d2o::mm {

namespace {

#include "ops/matmul_avx2_impl.h"  // helpers shared with matmul_kquant_avx2.cpp

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
inline float hmax_ps(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- activation quantisation ----------------------------------------------------------------

// The eight results of op over the lanes of v[0..7] (an associative, commutative op on values
// where order cannot matter: maxima, sums of small integers), in lane order.
template <class Op>
inline __m256 reduce_each8(const __m256* v, Op op) {
  auto fold_a = [&](__m256 x, __m256 y) {  // [x lo + hi | y lo + hi]
    return op(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  };
  auto fold_b = [&](__m256 xy, __m256 zw) {  // per half: (0 + 2, 1 + 3) of x/y, then of z/w
    return op(_mm256_shuffle_ps(xy, zw, _MM_SHUFFLE(1, 0, 1, 0)),
              _mm256_shuffle_ps(xy, zw, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m256 u0 = fold_b(fold_a(v[0], v[1]), fold_a(v[2], v[3]));
  const __m256 u1 = fold_b(fold_a(v[4], v[5]), fold_a(v[6], v[7]));
  const __m256 t = op(_mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  // t = [v0 v2 v4 v6 | v1 v3 v5 v7]
  return _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// round_to_half (matmul_kernels.h) on 8 lanes: fp16 round trip (nearest-even) unless |v| >= 65520.
inline __m256 round_to_half8(__m256 v) {
  const __m256 h = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256 av = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  return _mm256_blendv_ps(v, h, _mm256_cmp_ps(av, _mm256_set1_ps(65520.0f), _CMP_LT_OQ));
}

// Q8_0 / Q8_1 records of blocks 0 .. 8k-1, 8 at a time: the per-block maxima, scales and sums are
// formed as vectors (reduce_each8) instead of one horizontal reduction and scalar fp16 rounding
// per block. The same values as the per-block code (maxima and sums of the quantised integers do
// not depend on the order; divisions and fp16 rounding are IEEE in both). Returns the number of
// blocks done.
int64_t quantize_q8x32_by8(const ActLayout& l, const float* x, uint8_t* rec) {
  auto* qs = reinterpret_cast<int8_t*>(rec);
  auto* d = reinterpret_cast<float*>(rec + l.off_d);
  int32_t* qsum = act_a_mut<int32_t>(l, rec);
  float* dsum = act_b_mut<float>(l, rec);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 k127 = _mm256_set1_ps(127.0f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto vmax = [](__m256 a, __m256 c) { return _mm256_max_ps(a, c); };
  auto vadd = [](__m256 a, __m256 c) { return _mm256_add_ps(a, c); };
  const int64_t n8 = l.n_cols / 32 / 8 * 8;
  for (int64_t b0 = 0; b0 < n8; b0 += 8) {
    __m256 m[8];
    D2O_UNROLL
    for (int k = 0; k < 8; ++k) {
      const float* xb = x + (b0 + k) * 32;
      __m256 a = _mm256_and_ps(_mm256_loadu_ps(xb), abs_mask);
      for (int i = 8; i < 32; i += 8) a = _mm256_max_ps(a, _mm256_and_ps(_mm256_loadu_ps(xb + i), abs_mask));
      m[k] = a;
    }
    const __m256 amax = reduce_each8(m, vmax);
    const __m256 nonzero = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    alignas(32) float mul[8];
    _mm256_store_ps(mul, _mm256_and_ps(_mm256_div_ps(k127, amax), nonzero));
    const __m256 step = _mm256_div_ps(amax, k127);  // amax / 127
    _mm256_storeu_ps(d + b0, round_to_half8(step));
    __m256 sums[8];
    for (int k = 0; k < 8; ++k) {
      const float* xb = x + (b0 + k) * 32;
      const __m256 vm = _mm256_set1_ps(mul[k]);
      __m256i q[4];
      __m256 s = _mm256_setzero_ps();
      D2O_UNROLL
      for (int i = 0; i < 4; ++i) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), vm),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        s = _mm256_add_ps(s, r);  // integers below 2^12: exact
        q[i] = _mm256_cvttps_epi32(r);
      }
      const __m256i w16a = _mm256_packs_epi32(q[0], q[1]);
      const __m256i w16b = _mm256_packs_epi32(q[2], q[3]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + (b0 + k) * 32),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), perm));
      sums[k] = s;
    }
    const __m256 s = reduce_each8(sums, vadd);  // |sum| <= 4064: exact
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qsum + b0), _mm256_cvttps_epi32(s));
    _mm256_storeu_ps(dsum + b0, round_to_half8(_mm256_mul_ps(step, s)));
  }
  return n8;
}

void quantize_avx2(const ActLayout& l, const float* x, uint8_t* rec) {
  auto* qs = reinterpret_cast<int8_t*>(rec);
  auto* d = reinterpret_cast<float*>(rec + l.off_d);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i ones = _mm256_set1_epi16(1);
  // Sum of 16 quantised values.
  auto sum16 = [&](int64_t k) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * k));
    return hsum_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(v), ones));
  };
  const int64_t nb = l.n_cols / l.block;
  int64_t b0 = 0;
  if (l.format == ActFormat::kQ8x32) b0 = quantize_q8x32_by8(l, x, rec);
  for (int64_t b = b0; b < nb; ++b) {
    const float* xb = x + b * l.block;
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t i = 0; i < l.block; i += 8) {
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xb + i), abs_mask));
    }
    const float amax = hmax_ps(vmax);
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
    const __m256 vmul = _mm256_set1_ps(sc.mul);
    for (int64_t i = 0; i < l.block; i += 32) {
      __m256i q[4];
      D2O_UNROLL
      for (int k = 0; k < 4; ++k) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * k), vmul),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        q[k] = _mm256_cvttps_epi32(r);
      }
      // int32 -> int8 with in-lane packs, then undo the lane interleave.
      const __m256i w16a = _mm256_packs_epi32(q[0], q[1]);
      const __m256i w16b = _mm256_packs_epi32(q[2], q[3]);
      const __m256i w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * l.block + i), w8);
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

// IQ4_NL block b, rows 8h..8h+7: the table values are signed (|v| <= 127), so like Q8_0 they
// enter vpmaddubsw as |w| x sign(x, w); a pair of such products already needs most of int16,
// so every group is widened to int32 at once.
template <int NT>
void iq4_nl_block(const uint8_t* q, const uint8_t* const* rec, int64_t b, __m256i* is) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i lut = iq4_lut_s8();
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) is[t] = _mm256_setzero_si256();
  D2O_UNROLL
  for (int v = 0; v < 4; ++v) {
    const __m256i raw = load32(q + 64 * v);
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, m4));
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
    const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const int8_t* xb = act_qs(rec[t]) + 32 * b;
      const __m256i plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bcast4(xb + 4 * v), lo));
      const __m256i phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bcast4(xb + 16 + 4 * v), hi));
      is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(plo, ones));
      is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(phi, ones));
      pin(is[t]);
    }
  }
}

template <PackKind kKind, int NT>
void tile_32(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const uint8_t* dsec = job.tile + w.section_offset[0];
  const uint8_t* msec = job.tile + w.section_offset[1];
  const uint8_t* qsec = job.tile + w.section_offset[kKind == PackKind::kQ4_1 ? 2 : 1];
  const uint8_t* hsec = job.tile + w.section_offset[2];  // Q5_0 only
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m10 = _mm256_set1_epi8(0x10);
  const __m256i ones = _mm256_set1_epi16(1);
  const int halves = job.rows > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    __m256 acc[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.n_blocks; ++b) {
      if (NT == 1 && h == 0) prefetch_ahead(w, job.tile, b);
      __m256i is[NT];
      if (kKind == PackKind::kIQ4_NL) {
        iq4_nl_block<NT>(qsec + 256 * b + 32 * h, rec, b, is);
      } else if (kKind == PackKind::kQ8_0) {
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) is[t] = _mm256_setzero_si256();
        const uint8_t* q = qsec + 512 * b + 32 * h;
        D2O_UNROLL
        for (int g = 0; g < 8; ++g) {
          const __m256i wv = load32(q + 64 * g);
          const __m256i aw = _mm256_abs_epi8(wv);
          D2O_UNROLL
          for (int t = 0; t < NT; ++t) {
            const __m256i xs = _mm256_sign_epi8(bcast4(act_qs(rec[t]) + 32 * b + 4 * g), wv);
            is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
            pin(is[t]);
          }
        }
      } else {
        // int16 partial sums: all 8 products of 4-bit weights fit one accumulator, of 5-bit
        // ones (Q5_0) only 4, so those are widened to int32 halfway (after v = 1).
        constexpr bool kFive = kKind == PackKind::kQ5_0;
        __m256i s16[NT];
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) s16[t] = _mm256_setzero_si256();
        const uint8_t* q = qsec + 256 * b + 32 * h;
        const __m256i hb = kFive ? load32(hsec + 64 * b + 32 * h) : _mm256_setzero_si256();
        D2O_UNROLL
        for (int v = 0; v < 4; ++v) {
          const __m256i raw = load32(q + 64 * v);
          __m256i lo = _mm256_and_si256(raw, m4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
          if (kFive) {
            // Bit g of hb is bit 4 of group g (lo: g = v, hi: g = v + 4).
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4 - v), m10));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(hb, v), m10));
          }
          D2O_UNROLL
          for (int t = 0; t < NT; ++t) {
            const int8_t* xb = act_qs(rec[t]) + 32 * b;
            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(lo, bcast4(xb + 4 * v)));
            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(hi, bcast4(xb + 16 + 4 * v)));
            pin(s16[t]);
          }
          if (kFive && v == 1) {
            D2O_UNROLL
            for (int t = 0; t < NT; ++t) {
              is[t] = _mm256_madd_epi16(s16[t], ones);
              s16[t] = _mm256_setzero_si256();
            }
          }
        }
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          is[t] = kFive ? _mm256_add_epi32(is[t], _mm256_madd_epi16(s16[t], ones))
                        : _mm256_madd_epi16(s16[t], ones);
        }
      }
      const __m256 dw = half8(dsec + 32 * b + 16 * h);
      const __m256 mw =
          kKind == PackKind::kQ4_1 ? half8(msec + 32 * b + 16 * h) : _mm256_setzero_ps();
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        __m256i isum = is[t];
        if (kKind == PackKind::kQ4_0 || kKind == PackKind::kQ5_0) {
          const int32_t bias = (kKind == PackKind::kQ4_0 ? 8 : 16) * act_a<int32_t>(al, rec[t])[b];
          isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(bias));
        }
        const __m256 dwdx = _mm256_mul_ps(dw, _mm256_set1_ps(act_d(al, rec[t])[b]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dwdx, acc[t]);
        if (kKind == PackKind::kQ4_1) {
          acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(act_b<float>(al, rec[t])[b]), acc[t]);
        }
      }
    }
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) store_half(job, t, h, acc[t]);
  }
}

// ---- fp32 path -------------------------------------------------------------------------------

template <int NR, int NT>
void f32_tile(const F32Job& job) {
  __m256 acc[NR][NT];
  D2O_UNROLL
  for (int i = 0; i < NR; ++i) D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= job.n; k += 8) {
    __m256 xv[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) xv[t] = _mm256_loadu_ps(job.x + t * job.x_stride + k);
    D2O_UNROLL
    for (int i = 0; i < NR; ++i) {
      const __m256 wv = _mm256_loadu_ps(job.rows[i] + k);
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_fmadd_ps(wv, xv[t], acc[i][t]);
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) {
    const float* x = job.x + t * job.x_stride;
    D2O_UNROLL
    for (int i = 0; i < NR; ++i) {
      float s = hsum_ps(acc[i][t]);
      for (int64_t kk = k; kk < job.n; ++kk) s += job.rows[i][kk] * x[kk];
      job.y[t * job.y_stride + i] = s;
    }
  }
}

#include "ops/matmul_table_impl.h"  // the dispatch glue and make_kernel_table

}  // namespace

const KernelTable& kernels_avx2() {
  static const KernelTable table = make_kernel_table(quantize_avx2, kquant_tiles_avx2());
  return table;
}

}  // namespace d2o::mm
