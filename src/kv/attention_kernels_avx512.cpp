// AVX-512 attention loops (see attention_kernels.h). Head dimensions that are a multiple of 16
// use the vector code; others fall back to the scalar loops.
// GCC 12 reports its own AVX-512 headers' _mm512_undefined_ps() placeholders as "maybe
// uninitialized" once these intrinsics are inlined here: a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "kv/attention_kernels.h"
#include "kv/attention_stats_impl.h"

namespace d2o::attn {

namespace {

inline __m512 load16(const uint8_t* row, KvType type, int c) {
  if (type == KvType::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
  }
  return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c);
}

// exp(x) for x <= 0 (Cephes polynomial, about 1 ulp); inputs below -87.3 give ~1e-38.
inline __m512 exp512(__m512 x) {
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

template <int NC>
void scores_nc(const float* const* q, int n_rows, KvRows k, int n_keys, float scale, float* const* s) {
  __m512 qv[kMaxRows][NC];
  for (int r = 0; r < n_rows; ++r)
    for (int c = 0; c < NC; ++c) qv[r][c] = _mm512_loadu_ps(q[r] + 16 * c);
  for (int j = 0; j < n_keys; ++j) {
    const uint8_t* row = k.base + static_cast<size_t>(j) * k.row_bytes;
    __m512 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = load16(row, k.type, c);
    for (int r = 0; r < n_rows; ++r) {
      __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
      for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[r][c], kv[c], acc);
      s[r][j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

void scores(const float* const* q, int n_rows, KvRows k, int n_keys, int hd, float scale, float* const* s) {
  switch (hd) {
    case 64: return scores_nc<4>(q, n_rows, k, n_keys, scale, s);
    case 128: return scores_nc<8>(q, n_rows, k, n_keys, scale, s);
    case 32: return scores_nc<2>(q, n_rows, k, n_keys, scale, s);
    case 256:
      for (int r = 0; r < n_rows; ++r) scores_nc<16>(q + r, 1, k, n_keys, scale, s + r);
      return;
    default: return scalar_kernels().scores(q, n_rows, k, n_keys, hd, scale, s);
  }
}

float exp_sum(float* s, int n_valid, int n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int j = 0;
  for (; j + 16 <= n_valid; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n_valid) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (n_valid - j)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), mv)));
    _mm512_mask_storeu_ps(s + j, mk, e);
    sum = _mm512_add_ps(sum, e);
    j = n_valid;
  }
  for (; j < n; ++j) s[j] = 0.0f;
  return _mm512_reduce_add_ps(sum);
}

template <int NC, int R>
void pv_nc(const float* const* p, KvRows v, int n_keys, float* const* acc_out) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int j = 0; j < n_keys; ++j) {
    const uint8_t* row = v.base + static_cast<size_t>(j) * v.row_bytes;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(row, v.type, c);
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pj, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_out[r] + 16 * c, acc[r][c]);
}

template <int NC>
void pv_rows(const float* const* p, int n_rows, KvRows v, int n_keys, float* const* acc) {
  // At most 16 accumulators live in registers: 4 rows of 64, 2 of 128, 1 of 256.
  constexpr int kRows = NC <= 4 ? 4 : NC <= 8 ? 2 : 1;
  int r = 0;
  for (; r + kRows <= n_rows; r += kRows) pv_nc<NC, kRows>(p + r, v, n_keys, acc + r);
  for (; r < n_rows; ++r) pv_nc<NC, 1>(p + r, v, n_keys, acc + r);
}

void pv(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc) {
  switch (hd) {
    case 64: return pv_rows<4>(p, n_rows, v, n_keys, acc);
    case 128: return pv_rows<8>(p, n_rows, v, n_keys, acc);
    case 32: return pv_rows<2>(p, n_rows, v, n_keys, acc);
    case 256: return pv_rows<16>(p, n_rows, v, n_keys, acc);
    default: return scalar_kernels().pv(p, n_rows, v, n_keys, hd, acc);
  }
}

}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels k{scores, exp_sum, pv, detail::stats_impl};
  return k;
}

}  // namespace d2o::attn
