// AVX2 + FMA + F16C attention loops (see attention_kernels.h). Head dimensions that are a multiple
// of 8 use the vector code; others fall back to the scalar loops.
#include <immintrin.h>

#include "kv/attention_kernels.h"
#include "kv/attention_stats_impl.h"
#include "ops/vmath_avx2.h"

namespace d2o::attn {

namespace {

inline __m256 load8(const uint8_t* row, KvType type, int c) {
  if (type == KvType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8 * c);
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

using simd::exp256;

template <int NC, bool kPf = false>
void scores_nc(const float* const* q, int n_rows, KvRows k, int n_keys, float scale,
               float* const* s) {
  if (!kPf && k.prefetch != nullptr) return scores_nc<NC, true>(q, n_rows, k, n_keys, scale, s);
  for (int j = 0; j < n_keys; ++j) {
    if (kPf) {  // the hint of KvRows: the row read next, one request per line
      const uint8_t* p = k.prefetch + static_cast<size_t>(j) * k.row_bytes;
      for (size_t o = 0; o < k.row_bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
    }
    const uint8_t* row = k.base + static_cast<size_t>(j) * k.row_bytes;
    __m256 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = load8(row, k.type, c);
    for (int r = 0; r < n_rows; ++r) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q[r]), kv[0]);
      for (int c = 1; c < NC; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 8 * c), kv[c], acc);
      s[r][j] = hsum(acc) * scale;
    }
  }
}

void scores(const float* const* q, int n_rows, KvRows k, int n_keys, int hd, float scale, float* const* s) {
  switch (hd) {
    case 64: return scores_nc<8>(q, n_rows, k, n_keys, scale, s);
    case 128: return scores_nc<16>(q, n_rows, k, n_keys, scale, s);
    case 32: return scores_nc<4>(q, n_rows, k, n_keys, scale, s);
    case 256: return scores_nc<32>(q, n_rows, k, n_keys, scale, s);
    default: return scalar_kernels().scores(q, n_rows, k, n_keys, hd, scale, s);
  }
}

float exp_sum(float* s, int n_valid, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n_valid; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float tail[8] = {};
  const int rest = n_valid - j;
  for (int i = 0; i < rest; ++i) tail[i] = s[j + i] - m;
  if (rest > 0) {
    __m256 e = exp256(_mm256_loadu_ps(tail));
    _mm256_storeu_ps(tail, e);
    for (int i = rest; i < 8; ++i) tail[i] = 0.0f;
    sum = _mm256_add_ps(sum, _mm256_loadu_ps(tail));
    for (int i = 0; i < rest; ++i) s[j + i] = tail[i];
    j = n_valid;
  }
  for (; j < n; ++j) s[j] = 0.0f;
  return hsum(sum);
}

template <int NC, int R>
void pv_nc(const float* const* p, KvRows v, int n_keys, float* const* acc_out) {
  __m256 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int j = 0; j < n_keys; ++j) {
    const uint8_t* row = v.base + static_cast<size_t>(j) * v.row_bytes;
    __m256 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load8(row, v.type, c);
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_set1_ps(p[r][j]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(pj, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc_out[r] + 8 * c, acc[r][c]);
}

template <int NC>
void pv_rows(const float* const* p, int n_rows, KvRows v, int n_keys, float* const* acc) {
  constexpr int kRows = NC <= 4 ? 2 : 1;  // at most 8-16 accumulators of 16
  int r = 0;
  for (; r + kRows <= n_rows; r += kRows) pv_nc<NC, kRows>(p + r, v, n_keys, acc + r);
  for (; r < n_rows; ++r) pv_nc<NC, 1>(p + r, v, n_keys, acc + r);
}

void pv(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc) {
  switch (hd) {
    case 64: return pv_rows<8>(p, n_rows, v, n_keys, acc);
    case 128: return pv_rows<16>(p, n_rows, v, n_keys, acc);
    case 32: return pv_rows<4>(p, n_rows, v, n_keys, acc);
    case 256: return pv_rows<32>(p, n_rows, v, n_keys, acc);
    default: return scalar_kernels().pv(p, n_rows, v, n_keys, hd, acc);
  }
}

}  // namespace

const Kernels& avx2_kernels() {
  static const Kernels k{scores, detail::max_impl, exp_sum, pv, detail::rescale_add_impl, detail::stats_impl};
  return k;
}

}  // namespace d2o::attn
