// Vector math for AVX-512 files only (include it from *_avx512.cpp). The functions are `static`
// so each file that includes this keeps its own copy (see tests/check_isa_objects.cmake).
#pragma once

#include <immintrin.h>

namespace d2o::simd {

// exp(x) (Cephes polynomial, about 1 ulp); inputs below -87.3 give ~1e-38, above 88.7 +inf.
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Reduces each of 16 vectors over its 16 lanes with the lane-wise operation `op` (max, add):
// lane k of the result is the reduction of v[k], always in the same tree: (i, i+8), (i, i+4),
// (i, i+2), (i, i+1), as reduce16 of the attention kernels sums one vector, so float sums are
// reproducible and equal to that one-vector sum. About 2 operations per vector instead of 8 for
// a separate reduction of each.
template <class Op>
static inline __m512 reduce_each16(const __m512* v, Op op) {
  // Pairs of 128-bit chunks: x's partials in chunks 0-1, y's in chunks 2-3.
  auto fold_a = [&](__m512 x, __m512 y) {
    return op(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  // Chunk k holds 4 lanes of partials of vector k of the four folded in.
  auto fold_b = [&](__m512 xy, __m512 zw) {
    return op(_mm512_shuffle_f32x4(xy, zw, _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(xy, zw, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  const __m512 s0 = fold_b(fold_a(v[0], v[1]), fold_a(v[2], v[3]));
  const __m512 s1 = fold_b(fold_a(v[4], v[5]), fold_a(v[6], v[7]));
  const __m512 s2 = fold_b(fold_a(v[8], v[9]), fold_a(v[10], v[11]));
  const __m512 s3 = fold_b(fold_a(v[12], v[13]), fold_a(v[14], v[15]));
  // Within each chunk: lanes (0, 2), (1, 3) of two vectors, then the remaining pairs.
  auto fold_c = [&](__m512 x, __m512 y) {
    const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    return op(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)),
              _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));
  };
  const __m512 r1 = fold_c(s0, s1), r2 = fold_c(s2, s3);
  const __m512 t = op(_mm512_shuffle_ps(r1, r2, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(r1, r2, _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4 * c + i holds vector c + 4 * i.
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

}  // namespace d2o::simd
