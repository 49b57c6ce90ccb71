// AVX-512 variants of the element-wise operators (see ops_kernels.h).
//
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which
// -W(maybe-)uninitialized reports as a false positive once inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "ops/ops_kernels.h"
#include "ops/vmath_avx512.h"

namespace d2o::ops {

namespace {

void swiglu(const float* gate, const float* up, int64_t n, float* y) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(
        y + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 e = simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_mask_storeu_ps(
        y + i, m,
        _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_maskz_loadu_ps(m, up + i)));
  }
}

__m512 geglu16(__m512 g, __m512 u) {
  const __m512 t = _mm512_mul_ps(
      g, _mm512_add_ps(_mm512_set1_ps(kGeluA), _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(kGeluB), g), g)));
  const __m512 e = simd::exp512(_mm512_min_ps(t, _mm512_set1_ps(88.0f)));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

void geglu_tanh(const float* gate, const float* up, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, geglu16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(
        y + i, m, geglu16(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, up + i)));
  }
}

double sum_squares(const float* x, int64_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    const __m512d hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  double s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

void scale_mul(const float* x, float s, const float* w, int64_t n, float* y) {
  const __m512 sv = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), sv), _mm512_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = x[i] * s * w[i];
}

void add(float* y, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] += x[i];
}

void delta_rule(float* m, const DeltaRuleToken& t, int64_t n, float* o) {
  const __m512 decay = _mm512_set1_ps(t.decay);
  for (int64_t j = 0; j < n; ++j) {
    float* row = m + j * n;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + i), decay);
      _mm512_storeu_ps(row + i, r);
      acc = _mm512_fmadd_ps(r, _mm512_loadu_ps(t.k + i), acc);
    }
    float mk = _mm512_reduce_add_ps(acc);
    for (; i < n; ++i) {
      row[i] *= t.decay;
      mk += row[i] * t.k[i];
    }
    const float d = (t.v[j] - mk) * t.beta;
    const __m512 dv = _mm512_set1_ps(d);
    acc = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 r = _mm512_fmadd_ps(dv, _mm512_loadu_ps(t.k + i), _mm512_loadu_ps(row + i));
      _mm512_storeu_ps(row + i, r);
      acc = _mm512_fmadd_ps(r, _mm512_loadu_ps(t.q + i), acc);
    }
    float mq = _mm512_reduce_add_ps(acc);
    for (; i < n; ++i) {
      row[i] += d * t.k[i];
      mq += row[i] * t.q[i];
    }
    o[j] = mq * t.scale;
  }
}

// l[i] = exp(l[i] - m), m = max l (in *m); returns the sum of the exponentials.
float exp_shifted(float* l, int64_t n, float* m_out) {
  __m512 mv = _mm512_set1_ps(l[0]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(l + i));
  float m = _mm512_reduce_max_ps(mv);
  for (; i < n; ++i) m = std::max(m, l[i]);
  const __m512 mb = _mm512_set1_ps(m);
  __m512 sv = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = simd::exp512(_mm512_sub_ps(_mm512_loadu_ps(l + i), mb));
    _mm512_storeu_ps(l + i, e);
    sv = _mm512_add_ps(sv, e);
  }
  float sum = _mm512_reduce_add_ps(sv);
  for (; i < n; ++i) {
    l[i] = std::exp(l[i] - m);
    sum += l[i];
  }
  *m_out = m;
  return sum;
}

// acc[i] += l[i] * c
void scaled_add(const float* l, int64_t n, float c, float* acc) {
  const __m512 cv = _mm512_set1_ps(c);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i),
                                            _mm512_mul_ps(_mm512_loadu_ps(l + i), cv)));
  for (; i < n; ++i) acc[i] += l[i] * c;
}

void softmax_add(float* l, int64_t n, float* acc) {
  float m;
  const float sum = exp_shifted(l, n, &m);
  scaled_add(l, n, 1.0f / sum, acc);
}

}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels k{swiglu,     geglu_tanh,  sum_squares, scale_mul, add,
                         delta_rule, softmax_add, exp_shifted, scaled_add};
  return k;
}

}  // namespace d2o::ops
