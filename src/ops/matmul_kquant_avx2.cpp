// AVX2 kernels of the matmul for the formats in 256-element blocks (Q4_K, Q5_K, IQ4_XS, Q3_K,
// Q2_K, Q6_K) and for BF16 (compiled with -mavx2 -mfma -mf16c). The level's other kernels and its
// kernel table are in matmul_avx2.cpp, which takes these through kquant_tiles_avx2()
// (matmul_kquant.h).
//
// As there, a micro-tile is processed as two halves of 8 rows (one ymm lane per row), and
// vpmaddubsw's int16 pair sums are accumulated in int16 only as far as they provably cannot
// saturate (8 products of 4-bit weights, 4 of 5-bit, 2 of 6-bit), then widened by vpmaddwd
// directly with the sub-block scales. Integer results equal the exact sums, so the output is
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

#include "ops/matmul_avx2_impl.h"  // helpers shared with matmul_avx2.cpp

// ---- Q4_K, Q5_K ------------------------------------------------------------------------------

// (s_j, s_j) int16 pairs per row from lanes holding (s_{2p}, s_{2p+1}): which = 0 or 1.
inline __m256i dup_pair(__m256i pairs, int which) {
  const __m256i pick0 = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1,
                                         0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i pick1 = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2,
                                         3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
  return _mm256_shuffle_epi8(pairs, which == 0 ? pick0 : pick1);
}

template <bool kFive, int NT>
void tile_q45_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m10 = _mm256_set1_epi8(0x10);
  const int halves = job.rows > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    __m256 acc[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.n_blocks; ++b) {
      if (NT == 1 && h == 0) prefetch_ahead(w, job.tile, b);
      const uint8_t* sc = section(w, job.tile, 2, b) + 16 * h;
      const uint8_t* mn = section(w, job.tile, 3, b) + 16 * h;
      const uint8_t* qs = section(w, job.tile, 4, b) + 32 * h;
      const uint8_t* qh = kFive ? section(w, job.tile, 5, b) + 32 * h : nullptr;
      __m256i total[NT], mins[NT];
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) total[t] = mins[t] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i sc16 = _mm256_cvtepu8_epi16(load16(sc + 32 * p));
        const __m256i mn16 = _mm256_cvtepu8_epi16(load16(mn + 32 * p));
        for (int s = 0; s < 2; ++s) {
          const int j = 2 * p + s;
          const __m256i scale = dup_pair(sc16, s);
          const __m256i hb = kFive ? load32(qh + 64 * j) : _mm256_setzero_si256();
          // int16 partial sums: 4-bit weights allow all 8 products of a sub-block in one
          // accumulator, 5-bit ones only 4 (c = 0, 1 and c = 2, 3).
          __m256i s16a[NT], s16b[NT];
          D2O_UNROLL
          for (int t = 0; t < NT; ++t) s16a[t] = s16b[t] = _mm256_setzero_si256();
          D2O_UNROLL
          for (int c = 0; c < 4; ++c) {
            const __m256i raw = load32(qs + 256 * j + 64 * c);
            __m256i lo = _mm256_and_si256(raw, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (kFive) {
              lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4 - c), m10));
              hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(hb, c), m10));
            }
            D2O_UNROLL
            for (int t = 0; t < NT; ++t) {
              const int8_t* xs = act_qs(rec[t]) + 256 * b + 32 * j;
              __m256i& s16 = (kFive && c >= 2) ? s16b[t] : s16a[t];
              s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, bcast4(xs + 4 * c)));
              s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, bcast4(xs + 16 + 4 * c)));
            }
          }
          D2O_UNROLL
          for (int t = 0; t < NT; ++t) {
            total[t] = _mm256_add_epi32(total[t], _mm256_madd_epi16(s16a[t], scale));
            if (kFive) total[t] = _mm256_add_epi32(total[t], _mm256_madd_epi16(s16b[t], scale));
          }
        }
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256i xs = bcast4(act_a<int16_t>(al, rec[t]) + 8 * b + 2 * p);
          mins[t] = _mm256_add_epi32(mins[t], _mm256_madd_epi16(mn16, xs));
        }
      }
      const __m256 dw = half8(section(w, job.tile, 0, b) + 16 * h);
      const __m256 dmin = half8(section(w, job.tile, 1, b) + 16 * h);
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256 dx = _mm256_set1_ps(act_d(al, rec[t])[b]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[t]), _mm256_mul_ps(dw, dx), acc[t]);
        acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[t]), _mm256_mul_ps(dmin, dx), acc[t]);
      }
    }
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) store_half(job, t, h, acc[t]);
  }
}

// ---- IQ4_XS ----------------------------------------------------------------------------------

// Sub-block j of block b, rows 8h..8h+7 (qs already offset by the half): signed table values as
// |w| x sign(x, w), each pair of products widened at once with the sub-block scale (s_j, s_j).
template <int NT>
inline void iq4_xs_sub(const uint8_t* qs, const uint8_t* const* rec, int64_t b, int j,
                       __m256i scale, __m256i* total) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lut = iq4_lut_s8();
  D2O_UNROLL
  for (int c = 0; c < 4; ++c) {
    const __m256i raw = load32(qs + 256 * j + 64 * c);
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, m4));
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
    const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const int8_t* xs = act_qs(rec[t]) + 256 * b + 32 * j;
      const __m256i plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bcast4(xs + 4 * c), lo));
      const __m256i phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bcast4(xs + 16 + 4 * c), hi));
      total[t] = _mm256_add_epi32(total[t], _mm256_madd_epi16(plo, scale));
      total[t] = _mm256_add_epi32(total[t], _mm256_madd_epi16(phi, scale));
      pin(total[t]);
    }
  }
}

template <int NT>
void tile_iq4_xs(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const int halves = job.rows > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    __m256 acc[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.n_blocks; ++b) {
      if (NT == 1 && h == 0) prefetch_ahead(w, job.tile, b);
      const uint8_t* sc = section(w, job.tile, 1, b) + 16 * h;
      const uint8_t* qs = section(w, job.tile, 2, b) + 32 * h;
      __m256i total[NT];
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) total[t] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(load16(sc + 32 * (j / 2)));  // signed pairs
        iq4_xs_sub<NT>(qs, rec, b, j, dup_pair(sc16, j % 2), total);
      }
      const __m256 dw = half8(section(w, job.tile, 0, b) + 16 * h);
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256 dwdx = _mm256_mul_ps(dw, _mm256_set1_ps(act_d(al, rec[t])[b]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[t]), dwdx, acc[t]);
      }
    }
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) store_half(job, t, h, acc[t]);
  }
}

// ---- Q3_K, Q2_K ------------------------------------------------------------------------------

// As the AVX-512 kernel: the 4 weight vectors of sub-block 2p + s.
template <bool kThree>
inline void q23_weights(__m256i wl, __m256i h, int s, __m256i* wv) {
  const __m256i m3 = _mm256_set1_epi8(3), m04 = _mm256_set1_epi8(4);
  D2O_UNROLL
  for (int u = 0; u < 4; ++u) {
    wv[u] = _mm256_and_si256(_mm256_srli_epi16(wl, 2 * u), m3);
    if (kThree) {
      const int shift = 4 * s + u - 2;
      const __m256i hv = shift >= 0 ? _mm256_srli_epi16(h, shift) : _mm256_slli_epi16(h, -shift);
      wv[u] = _mm256_or_si256(wv[u], _mm256_and_si256(hv, m04));
    }
  }
}

// Rows 8h..8h+7 of one block: adds sum_j sc_j * isum_j to total and sum_j mn_j * qsum16_j to
// offs (Q3_K: mn = sc). 3-bit weights: all 8 products of a sub-block fit one int16 accumulator.
template <bool kThree, int NT>
inline void q23_block(const TileJob& job, const uint8_t* const* rec, int64_t b, int h,
                      __m256i* total, __m256i* offs) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* sc = section(w, job.tile, kThree ? 1 : 2, b) + 16 * h;
  const uint8_t* mn = section(w, job.tile, kThree ? 1 : 3, b) + 16 * h;
  const uint8_t* ql = section(w, job.tile, kThree ? 2 : 4, b) + 32 * h;
  for (int p = 0; p < 8; ++p) {
    const __m256i sc16 = kThree ? _mm256_cvtepi8_epi16(load16(sc + 32 * p))
                                : _mm256_cvtepu8_epi16(load16(sc + 32 * p));
    const __m256i mn16 = kThree ? sc16 : _mm256_cvtepu8_epi16(load16(mn + 32 * p));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m256i xs = bcast4(act_b<int16_t>(al, rec[t]) + 16 * b + 2 * p);
      offs[t] = _mm256_add_epi32(offs[t], _mm256_madd_epi16(mn16, xs));
    }
    const __m256i hb =
        kThree ? load32(section(w, job.tile, 3, b) + 32 * h + 64 * p) : _mm256_setzero_si256();
    for (int s = 0; s < 2; ++s) {
      const int j = 2 * p + s;
      const __m256i scale = dup_pair(sc16, s);
      __m256i wv[4];
      q23_weights<kThree>(load32(ql + 64 * j), hb, s, wv);
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        const int8_t* xs = act_qs(rec[t]) + 256 * b + 16 * j;
        const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(wv[0], bcast4(xs)),
                                           _mm256_maddubs_epi16(wv[1], bcast4(xs + 4)));
        const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(wv[2], bcast4(xs + 8)),
                                           _mm256_maddubs_epi16(wv[3], bcast4(xs + 12)));
        total[t] = _mm256_add_epi32(total[t], _mm256_madd_epi16(_mm256_add_epi16(a, c), scale));
      }
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
  const int halves = job.rows > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    __m256 acc[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.n_blocks; ++b) {
      if (NT == 1 && h == 0) prefetch_ahead(w, job.tile, b);
      __m256i total[NT], offs[NT];
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm256_setzero_si256();
      q23_block<kThree, NT>(job, rec, b, h, total, offs);
      const __m256 dw = half8(section(w, job.tile, 0, b) + 16 * h);
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256 dx = _mm256_set1_ps(act_d(al, rec[t])[b]);
        if (kThree) {
          const __m256i tot = _mm256_sub_epi32(total[t], _mm256_slli_epi32(offs[t], 2));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(dw, dx), acc[t]);
        } else {
          const __m256 dmin = half8(section(w, job.tile, 1, b) + 16 * h);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[t]), _mm256_mul_ps(dw, dx), acc[t]);
          acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offs[t]), _mm256_mul_ps(dmin, dx), acc[t]);
        }
      }
    }
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) store_half(job, t, h, acc[t]);
  }
}

// ---- BF16 ------------------------------------------------------------------------------------

// As the AVX-512 kernel, on rows 8h..8h+7 (the second 32 bytes of each block).
template <int NT>
void tile_bf16(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const float* x[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t)
    x[t] = reinterpret_cast<const float*>(job.act + t * job.acts->stride);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int halves = job.rows > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    const uint8_t* sec = job.tile + w.section_offset[0] + 32 * h;
    __m256 a[NT][4];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) D2O_UNROLL
    for (int c = 0; c < 4; ++c) a[t][c] = _mm256_setzero_ps();
    auto step = [&](int64_t b, int c) {
      if (NT == 1 && h == 0) prefetch_ahead(w, job.tile, b);
      const __m256i v = load32(sec + 64 * b);
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        a[t][c] = _mm256_fmadd_ps(w0, _mm256_set1_ps(x[t][2 * b]), a[t][c]);
        a[t][c + 1] = _mm256_fmadd_ps(w1, _mm256_set1_ps(x[t][2 * b + 1]), a[t][c + 1]);
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
      store_half(job, t, h,
                 _mm256_add_ps(_mm256_add_ps(a[t][0], a[t][1]), _mm256_add_ps(a[t][2], a[t][3])));
    }
  }
}

// ---- Q6_K ------------------------------------------------------------------------------------

template <int NT>
void tile_q6_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  const int halves = job.rows > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    __m256 acc[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.n_blocks; ++b) {
      if (NT == 1 && h == 0) prefetch_ahead(w, job.tile, b);
      const uint8_t* sc = section(w, job.tile, 1, b) + 16 * h;
      const uint8_t* ql = section(w, job.tile, 2, b) + 32 * h;
      const uint8_t* qh = section(w, job.tile, 3, b) + 32 * h;
      __m256i total[NT], offs[NT];
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(load16(sc + 32 * p));
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256i xs = bcast4(act_b<int16_t>(al, rec[t]) + 16 * b + 2 * p);
          offs[t] = _mm256_add_epi32(offs[t], _mm256_madd_epi16(sc16, xs));
        }
        for (int s = 0; s < 2; ++s) {
          const int j = 2 * p + s;
          const __m256i scale = dup_pair(sc16, s);
          const __m256i l0 = load32(ql + 128 * j), l1 = load32(ql + 128 * j + 64);
          const __m256i hb = load32(qh + 64 * j);
          const __m256i w0 = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                             _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
          const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                             _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
          const __m256i w2 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(hb, m30));
          const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                             _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
          D2O_UNROLL
          for (int t = 0; t < NT; ++t) {
            const int8_t* xs = act_qs(rec[t]) + 256 * b + 16 * j;
            // 6-bit weights: two products per int16 accumulator at most.
            const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(xs)),
                                               _mm256_maddubs_epi16(w1, bcast4(xs + 4)));
            const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(w2, bcast4(xs + 8)),
                                               _mm256_maddubs_epi16(w3, bcast4(xs + 12)));
            total[t] = _mm256_add_epi32(total[t], _mm256_madd_epi16(a, scale));
            total[t] = _mm256_add_epi32(total[t], _mm256_madd_epi16(c, scale));
          }
        }
      }
      const __m256 dw = half8(section(w, job.tile, 0, b) + 16 * h);
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256i tot = _mm256_sub_epi32(total[t], _mm256_slli_epi32(offs[t], 5));
        const __m256 dwdx = _mm256_mul_ps(dw, _mm256_set1_ps(act_d(al, rec[t])[b]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), dwdx, acc[t]);
      }
    }
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) store_half(job, t, h, acc[t]);
  }
}

#include "ops/matmul_kquant_impl.h"  // the dispatch glue and make_kquant_tiles

}  // namespace

KQuantTiles kquant_tiles_avx2() {
  return make_kquant_tiles();
}

}  // namespace d2o::mm
