// AVX2 + FMA + F16C variant of row_dots (compiled with -mavx2 -mfma -mf16c only).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "core/fp16.h"
#include "kv/policy/similarity.h"

namespace d2o::simd {

namespace {
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
}  // namespace

void row_dots_avx2(const RowDots& a) {
  const int d8 = a.dim & ~7;
  for (int r = 0; r < a.n; ++r) {
    const size_t row = static_cast<size_t>(a.rows ? a.rows[r] : r);
    const uint8_t* p = a.base + row * a.row_bytes;
    __m256 acc = _mm256_setzero_ps(), acc_n = _mm256_setzero_ps();
    float dot = 0.0f, nn = 0.0f;
    if (a.f16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
      for (int d = 0; d < d8; d += 8) {
        const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + d)));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.q + d), x, acc);
        acc_n = _mm256_fmadd_ps(x, x, acc_n);
      }
      for (int d = d8; d < a.dim; ++d) {  // tail: rows may be misaligned, read with memcpy
        uint16_t hv;
        std::memcpy(&hv, h + d, 2);
        const float x = fp16_to_fp32(hv);
        dot += a.q[d] * x;
        nn += x * x;
      }
    } else {
      const float* f = reinterpret_cast<const float*>(p);
      for (int d = 0; d < d8; d += 8) {
        const __m256 x = _mm256_loadu_ps(f + d);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.q + d), x, acc);
        acc_n = _mm256_fmadd_ps(x, x, acc_n);
      }
      for (int d = d8; d < a.dim; ++d) {
        float x;
        std::memcpy(&x, f + d, 4);
        dot += a.q[d] * x;
        nn += x * x;
      }
    }
    a.dot[r] = hsum(acc) + dot;
    if (a.inv_norm) {
      const float n2 = hsum(acc_n) + nn;
      a.inv_norm[r] = n2 > 0.0f ? 1.0f / std::sqrt(n2) : 0.0f;
    }
  }
}

}  // namespace d2o::simd
