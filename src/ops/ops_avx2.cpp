// AVX2 variants of the element-wise operators (see ops_kernels.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "ops/ops_kernels.h"
#include "ops/vmath_avx2.h"

namespace d2o::ops {

namespace {

void swiglu(const float* gate, const float* up, int64_t n, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f);
  // exp256 builds its exponent from bits: -g is clamped to 88 (exp(88) = 1.7e38, so silu(g) for
  // g <= -88 comes out as g / 1.7e38 instead of g * exp(g), both below 1e-36).
  const __m256 hi = _mm256_set1_ps(88.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), hi));
    _mm256_storeu_ps(
        y + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void geglu_tanh(const float* gate, const float* up, int64_t n, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 a = _mm256_set1_ps(kGeluA), b = _mm256_set1_ps(kGeluB);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 t = _mm256_mul_ps(g, _mm256_add_ps(a, _mm256_mul_ps(_mm256_mul_ps(b, g), g)));
    const __m256 e = simd::exp256(_mm256_min_ps(t, hi));
    _mm256_storeu_ps(
        y + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(std::min(g * (kGeluA + kGeluB * g * g), 88.0f))) * up[i];
  }
}

double sum_squares(const float* x, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    const __m256d hi = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  const __m256d a = _mm256_add_pd(a0, a1);
  const __m128d b = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  double s = _mm_cvtsd_f64(_mm_add_sd(b, _mm_unpackhi_pd(b, b)));
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

void scale_mul(const float* x, float s, const float* w, int64_t n, float* y) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(
        y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = x[i] * s * w[i];
}

void add(float* y, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] += x[i];
}

float hmax(__m256 a) {
  const __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(c, _mm_movehdup_ps(c)));
}

float hsum(__m256 a) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

void delta_rule(float* m, const DeltaRuleToken& t, int64_t n, float* o) {
  const __m256 decay = _mm256_set1_ps(t.decay);
  for (int64_t j = 0; j < n; ++j) {
    float* row = m + j * n;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + i), decay);
      _mm256_storeu_ps(row + i, r);
      acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(t.k + i), acc);
    }
    float mk = hsum(acc);
    for (; i < n; ++i) {
      row[i] *= t.decay;
      mk += row[i] * t.k[i];
    }
    const float d = (t.v[j] - mk) * t.beta;
    const __m256 dv = _mm256_set1_ps(d);
    acc = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 r = _mm256_fmadd_ps(dv, _mm256_loadu_ps(t.k + i), _mm256_loadu_ps(row + i));
      _mm256_storeu_ps(row + i, r);
      acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(t.q + i), acc);
    }
    float mq = hsum(acc);
    for (; i < n; ++i) {
      row[i] += d * t.k[i];
      mq += row[i] * t.q[i];
    }
    o[j] = mq * t.scale;
  }
}

// l[i] = exp(l[i] - m), m = max l (in *m); returns the sum of the exponentials.
float exp_shifted(float* l, int64_t n, float* m_out) {
  __m256 mv = _mm256_set1_ps(l[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(l + i));
  float m = hmax(mv);
  for (; i < n; ++i) m = std::max(m, l[i]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = simd::exp256(_mm256_sub_ps(_mm256_loadu_ps(l + i), mb));
    _mm256_storeu_ps(l + i, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; i < n; ++i) {
    l[i] = std::exp(l[i] - m);
    sum += l[i];
  }
  *m_out = m;
  return sum;
}

// acc[i] += l[i] * c
void scaled_add(const float* l, int64_t n, float c, float* acc) {
  const __m256 cv = _mm256_set1_ps(c);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i),
                                            _mm256_mul_ps(_mm256_loadu_ps(l + i), cv)));
  for (; i < n; ++i) acc[i] += l[i] * c;
}

void softmax_add(float* l, int64_t n, float* acc) {
  float m;
  const float sum = exp_shifted(l, n, &m);
  scaled_add(l, n, 1.0f / sum, acc);
}

}  // namespace

const Kernels& avx2_kernels() {
  static const Kernels k{swiglu,     geglu_tanh,  sum_squares, scale_mul, add,
                         delta_rule, softmax_add, exp_shifted, scaled_add};
  return k;
}

}  // namespace d2o::ops
