// AVX2 + FMA variant of nearest_rows: 4 queries x 16 packed columns of sums in 8 registers; a
// running maximum and its column index per query and lane (strict >: each lane keeps its first
// maximum), reduced at the end to the lowest index among equal maxima.
#include <immintrin.h>

#include <cstddef>

#include "kv/policy/nearest.h"

namespace d2o::simd {

void unit_row_f16_avx2(const uint16_t* row, int dim, double scale, float* out) {
  // acc0 holds lanes 0-3, acc1 lanes 4-7: lane j sums the elements d with d % 8 == j, in order.
  // A float's square is exact in double, so a fused multiply-add rounds as the add after the
  // multiply.
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
    _mm256_storeu_ps(out + d, x);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  alignas(32) double s[8];
  _mm256_store_pd(s, acc0);
  _mm256_store_pd(s + 4, acc1);
  if (d < dim) {  // a tail of fewer than eight: the scalar finish
    for (int i = d; i < dim; ++i) out[i] = _cvtsh_ss(row[i]);
    finish_unit_row(s, d, dim, scale, out);
    return;
  }
  const __m256 f = _mm256_set1_ps(unit_row_factor(s, scale));
  for (int i = 0; i < dim; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(out + i), f));
}

void nearest_rows_avx2(const PackedRows& b, const float* q, int n_q, int32_t* best,
                       float* best_dot) {
  if (n_q == 0) return;
  const float* qr[4];
  for (int i = 0; i < 4; ++i) qr[i] = q + static_cast<size_t>(i < n_q ? i : 0) * b.dim;
  const __m256 neg = _mm256_set1_ps(-__builtin_inff());
  __m256 bv[4] = {neg, neg, neg, neg};
  __m256i bi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                   _mm256_setzero_si256()};
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const size_t stride = static_cast<size_t>(b.s_pad);
  for (int c = 0; c < b.s; c += 16) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    const float* col = b.data.data() + c;
    for (int d = 0; d < b.dim; ++d) {
      const __m256 x0 = _mm256_loadu_ps(col + d * stride);
      const __m256 x1 = _mm256_loadu_ps(col + d * stride + 8);
      __m256 w = _mm256_broadcast_ss(qr[0] + d);
      a00 = _mm256_fmadd_ps(w, x0, a00);
      a01 = _mm256_fmadd_ps(w, x1, a01);
      w = _mm256_broadcast_ss(qr[1] + d);
      a10 = _mm256_fmadd_ps(w, x0, a10);
      a11 = _mm256_fmadd_ps(w, x1, a11);
      w = _mm256_broadcast_ss(qr[2] + d);
      a20 = _mm256_fmadd_ps(w, x0, a20);
      a21 = _mm256_fmadd_ps(w, x1, a21);
      w = _mm256_broadcast_ss(qr[3] + d);
      a30 = _mm256_fmadd_ps(w, x0, a30);
      a31 = _mm256_fmadd_ps(w, x1, a31);
    }
    const __m256i i0 = _mm256_add_epi32(lane, _mm256_set1_epi32(c));
    const __m256i i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
    // Columns past s (padding) never win.
    const __m256i lim = _mm256_set1_epi32(b.s);
    const __m256 ok0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, i0));
    const __m256 ok1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, i1));
    const __m256 acc0[4] = {a00, a10, a20, a30};
    const __m256 acc1[4] = {a01, a11, a21, a31};
    for (int i = 0; i < 4; ++i) {
      __m256 gt = _mm256_and_ps(ok0, _mm256_cmp_ps(acc0[i], bv[i], _CMP_GT_OQ));
      bv[i] = _mm256_blendv_ps(bv[i], acc0[i], gt);
      bi[i] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(bi[i]), _mm256_castsi256_ps(i0), gt));
      gt = _mm256_and_ps(ok1, _mm256_cmp_ps(acc1[i], bv[i], _CMP_GT_OQ));
      bv[i] = _mm256_blendv_ps(bv[i], acc1[i], gt);
      bi[i] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(bi[i]), _mm256_castsi256_ps(i1), gt));
    }
  }
  alignas(32) float v[8];
  alignas(32) int32_t ix[8];
  for (int i = 0; i < n_q; ++i) {
    _mm256_store_ps(v, bv[i]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ix), bi[i]);
    int k = 0;
    for (int l = 1; l < 8; ++l) {
      if (v[l] > v[k] || (v[l] == v[k] && ix[l] < ix[k])) k = l;
    }
    best[i] = ix[k];
    best_dot[i] = v[k];
  }
}

}  // namespace d2o::simd
