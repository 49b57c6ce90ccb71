// AVX-512 variant of nearest_rows: 4 queries x 32 packed columns of sums in 8 registers; a running
// maximum and its column index per query and lane (strict >, so each lane keeps its first maximum).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstddef>

#include "kv/policy/nearest.h"

namespace d2o::simd {

void unit_row_f16_avx512(const uint16_t* row, int dim, double scale, float* out) {
  // Lane j of the eight doubles sums the elements d with d % 8 == j, in order of d. A float's
  // square is exact in double, so a fused multiply-add rounds as the add after the multiply.
  __m512d acc = _mm512_setzero_pd();
  int d = 0;
  for (; d + 16 <= dim; d += 16) {
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
    _mm512_storeu_ps(out + d, x);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc = _mm512_fmadd_pd(lo, lo, acc);
    acc = _mm512_fmadd_pd(hi, hi, acc);
  }
  if (d + 8 <= dim) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
    _mm256_storeu_ps(out + d, x);
    const __m512d w = _mm512_cvtps_pd(x);
    acc = _mm512_fmadd_pd(w, w, acc);
    d += 8;
  }
  alignas(64) double s[8];
  _mm512_store_pd(s, acc);
  if (d < dim) {  // a tail of fewer than eight: the scalar finish
    for (int i = d; i < dim; ++i) out[i] = _cvtsh_ss(row[i]);
    finish_unit_row(s, d, dim, scale, out);
    return;
  }
  const __m512 f = _mm512_set1_ps(unit_row_factor(s, scale));
  int i = 0;
  for (; i + 16 <= dim; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), f));
  if (i < dim) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(out + i), _mm512_castps512_ps256(f)));
  }
}

void nearest_rows_avx512(const PackedRows& b, const float* q, int n_q, int32_t* best,
                         float* best_dot) {
  if (n_q == 0) return;
  // Missing queries read query 0 again; their results are not stored.
  const float* qr[4];
  for (int i = 0; i < 4; ++i) qr[i] = q + static_cast<size_t>(i < n_q ? i : 0) * b.dim;
  const __m512 neg = _mm512_set1_ps(-__builtin_inff());
  __m512 bv[4] = {neg, neg, neg, neg};
  __m512i bi[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                   _mm512_setzero_si512()};
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const size_t stride = static_cast<size_t>(b.s_pad);
  for (int c = 0; c < b.s; c += 32) {
    const float* col = b.data.data() + c;
    const int left = b.s - c;
    const __mmask16 m0 =
        left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512i i0 = _mm512_add_epi32(lane, _mm512_set1_epi32(c));
    if (left <= 16) {
      // The last block holds at most 16 columns: half the sums (s = 102 pads to 128 columns,
      // which this block would otherwise spend a quarter of the search on).
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int d = 0; d < b.dim; ++d) {
        const __m512 x0 = _mm512_loadu_ps(col + d * stride);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(qr[0][d]), x0, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(qr[1][d]), x0, a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(qr[2][d]), x0, a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(qr[3][d]), x0, a3);
      }
      const __m512 acc0[4] = {a0, a1, a2, a3};
      for (int i = 0; i < 4; ++i) {
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(m0, acc0[i], bv[i], _CMP_GT_OQ);
        bv[i] = _mm512_mask_mov_ps(bv[i], gt, acc0[i]);
        bi[i] = _mm512_mask_mov_epi32(bi[i], gt, i0);
      }
      break;
    }
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    for (int d = 0; d < b.dim; ++d) {
      const __m512 x0 = _mm512_loadu_ps(col + d * stride);
      const __m512 x1 = _mm512_loadu_ps(col + d * stride + 16);
      __m512 w = _mm512_set1_ps(qr[0][d]);
      a00 = _mm512_fmadd_ps(w, x0, a00);
      a01 = _mm512_fmadd_ps(w, x1, a01);
      w = _mm512_set1_ps(qr[1][d]);
      a10 = _mm512_fmadd_ps(w, x0, a10);
      a11 = _mm512_fmadd_ps(w, x1, a11);
      w = _mm512_set1_ps(qr[2][d]);
      a20 = _mm512_fmadd_ps(w, x0, a20);
      a21 = _mm512_fmadd_ps(w, x1, a21);
      w = _mm512_set1_ps(qr[3][d]);
      a30 = _mm512_fmadd_ps(w, x0, a30);
      a31 = _mm512_fmadd_ps(w, x1, a31);
    }
    // Columns past s (padding) never win.
    const __mmask16 m1 = left >= 32 ? static_cast<__mmask16>(0xFFFF)
                                    : static_cast<__mmask16>((1u << (left - 16)) - 1u);
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(16));
    const __m512 acc0[4] = {a00, a10, a20, a30};
    const __m512 acc1[4] = {a01, a11, a21, a31};
    for (int i = 0; i < 4; ++i) {
      __mmask16 gt = _mm512_mask_cmp_ps_mask(m0, acc0[i], bv[i], _CMP_GT_OQ);
      bv[i] = _mm512_mask_mov_ps(bv[i], gt, acc0[i]);
      bi[i] = _mm512_mask_mov_epi32(bi[i], gt, i0);
      gt = _mm512_mask_cmp_ps_mask(m1, acc1[i], bv[i], _CMP_GT_OQ);
      bv[i] = _mm512_mask_mov_ps(bv[i], gt, acc1[i]);
      bi[i] = _mm512_mask_mov_epi32(bi[i], gt, i1);
    }
  }
  for (int i = 0; i < n_q; ++i) {
    const float mx = _mm512_reduce_max_ps(bv[i]);
    const __mmask16 at = _mm512_cmp_ps_mask(bv[i], _mm512_set1_ps(mx), _CMP_EQ_OQ);
    best[i] = _mm512_mask_reduce_min_epi32(at, bi[i]);
    best_dot[i] = mx;
  }
}

}  // namespace d2o::simd
