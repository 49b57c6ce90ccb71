// AVX2 + FMA + F16C attention loops (see attention_kernels.h). Head dimensions that are a multiple
// of 8 use the vector code; others fall back to the scalar loops.
//
// Scores: the dot product of a query row and a key is one 8-lane accumulator (a product, then
// fused multiply-adds over the head dimension in order) whose lanes are summed in a fixed tree,
// ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)). Up to 3 rows x 4 keys run at once (12
// accumulators; each key piece is loaded once for all rows) and their 4 sums per row are formed
// together with horizontal adds; a lone key (the tail) forms the same tree on its own, so a score
// never depends on how many keys a call holds.
#include <immintrin.h>

#include "kv/attention_kernels.h"
#include "kv/attention_stats_impl.h"
#include "ops/quant.h"
#include "ops/vmath_avx2.h"

namespace d2o::attn {

namespace {

// Elements [8c, 8c + 8) of a row as floats. Q8_0 / Q4_0: q * d (Q4_0: (q - 8) * d), the
// products of the reference dequantisation, so the values equal dequantize_row's. The storage
// type is a template parameter: the loops below are instantiated per type, so the inner loops
// carry no branch on it (a run-time switch here halved decoding speed).
template <KvElemType T>
inline __m256 load8(const uint8_t* row, int c) {
  switch (T) {
    case KvElemType::kF16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
    case KvElemType::kQ8_0: {
      const auto* b = reinterpret_cast<const BlockQ8_0*>(row) + c / 4;
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs + 8 * (c % 4)));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                           _mm256_set1_ps(_cvtsh_ss(b->d)));
    }
    case KvElemType::kQ4_0: {
      // Elements 0-15 of a block are the low nibbles of qs[0..15], 16-31 the high ones.
      const auto* b = reinterpret_cast<const BlockQ4_0*>(row) + c / 4;
      __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs + 8 * (c % 2)));
      if (c % 4 >= 2) q = _mm_srli_epi16(q, 4);
      q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
      const __m256i w = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), _mm256_set1_epi32(8));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(_cvtsh_ss(b->d)));
    }
    default:
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8 * c);
  }
}

// Quantised rows: the block scale of elements [8c, 8c + 8) as a vector, and load8 with that scale
// given (the same product q * d, so the same values), for loops that form a scale once per block.
template <KvElemType T>
inline __m256 block_scale(const uint8_t* row, int c) {
  if constexpr (T == KvElemType::kQ8_0)
    return _mm256_set1_ps(_cvtsh_ss((reinterpret_cast<const BlockQ8_0*>(row) + c / 4)->d));
  else if constexpr (T == KvElemType::kQ4_0)
    return _mm256_set1_ps(_cvtsh_ss((reinterpret_cast<const BlockQ4_0*>(row) + c / 4)->d));
  else
    return _mm256_setzero_ps();
}

template <KvElemType T>
inline __m256 load8_scaled(const uint8_t* row, int c, __m256 d) {
  if constexpr (T == KvElemType::kQ8_0) {
    const auto* b = reinterpret_cast<const BlockQ8_0*>(row) + c / 4;
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs + 8 * (c % 4)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
  } else if constexpr (T == KvElemType::kQ4_0) {
    const auto* b = reinterpret_cast<const BlockQ4_0*>(row) + c / 4;
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs + 8 * (c % 2)));
    if (c % 4 >= 2) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
    const __m256i w = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), _mm256_set1_epi32(8));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(w), d);
  } else {
    (void)d;
    return load8<T>(row, c);
  }
}

constexpr bool quantized_kv(KvElemType t) {
  return t == KvElemType::kQ8_0 || t == KvElemType::kQ4_0;
}

// The lane-sum tree above for 4 accumulators at once: lane i holds the sum of a_i.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
// The same tree for one accumulator.
inline float reduce1(__m256 a) {
  const __m256 t = _mm256_hadd_ps(a, a);
  const __m256 u = _mm256_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

using simd::exp256;

// R (1..3) rows x 4 keys per step; kPf: with k.prefetch (a separate instantiation).
template <int NC, int R, KvElemType T, bool kMap, bool kPf = false>
void scores_rows(const float* const* q, KvRows k, int n_keys, float scale, float* const* s) {
  if (!kPf && k.prefetch != nullptr)
    return scores_rows<NC, R, T, kMap, true>(q, k, n_keys, scale, s);
  const __m128 sc = _mm_set1_ps(scale);
  int j = 0;
  for (; j + 4 <= n_keys; j += 4) {
    if (kPf) k.prefetch_rows<kMap>(j, 4);
    const uint8_t* row[4] = {k.row_at<kMap>(j), k.row_at<kMap>(j + 1), k.row_at<kMap>(j + 2),
                             k.row_at<kMap>(j + 3)};
    __m256 acc[R][4];
    // Quantised keys: each key's block scale formed once per block of 32, not per 8 elements.
    __m256 dk[4];
    for (int i = 0; i < 4; ++i) dk[i] = block_scale<T>(row[i], 0);
    for (int i = 0; i < 4; ++i) {
      const __m256 kc = load8_scaled<T>(row[i], 0, dk[i]);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm256_mul_ps(_mm256_loadu_ps(q[r]), kc);
    }
    for (int c = 1; c < NC; ++c) {
      if constexpr (quantized_kv(T)) {
        if (c % 4 == 0)
          for (int i = 0; i < 4; ++i) dk[i] = block_scale<T>(row[i], c);
      }
      for (int i = 0; i < 4; ++i) {
        const __m256 kc = load8_scaled<T>(row[i], c, dk[i]);
        for (int r = 0; r < R; ++r)
          acc[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 8 * c), kc, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(s[r] + j, _mm_mul_ps(reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), sc));
  }
  for (; j < n_keys; ++j) {
    if (kPf) k.prefetch_rows<kMap>(j, 1);
    const uint8_t* row = k.row_at<kMap>(j);
    for (int r = 0; r < R; ++r) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q[r]), load8<T>(row, 0));
      for (int c = 1; c < NC; ++c)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 8 * c), load8<T>(row, c), acc);
      s[r][j] = reduce1(acc) * scale;
    }
  }
}

template <int NC, KvElemType T, bool kMap>
void scores_nc(const float* const* q, int n_rows, KvRows k, int n_keys, float scale,
               float* const* s) {
  int r = 0;
  for (; r + 3 <= n_rows; r += 3) scores_rows<NC, 3, T, kMap>(q + r, k, n_keys, scale, s + r);
  if (n_rows - r == 2) scores_rows<NC, 2, T, kMap>(q + r, k, n_keys, scale, s + r);
  if (n_rows - r == 1) scores_rows<NC, 1, T, kMap>(q + r, k, n_keys, scale, s + r);
}

template <int NC, KvElemType T>
void scores_mapped(const float* const* q, int n_rows, KvRows k, int n_keys, float scale,
                   float* const* s) {
  if (k.idx) return scores_nc<NC, T, true>(q, n_rows, k, n_keys, scale, s);
  return scores_nc<NC, T, false>(q, n_rows, k, n_keys, scale, s);
}

template <int NC>
void scores_nc(const float* const* q, int n_rows, KvRows k, int n_keys, float scale,
               float* const* s) {
  switch (k.type) {
    case KvElemType::kF16:
      return scores_mapped<NC, KvElemType::kF16>(q, n_rows, k, n_keys, scale, s);
    case KvElemType::kQ8_0:
      return scores_mapped<NC, KvElemType::kQ8_0>(q, n_rows, k, n_keys, scale, s);
    case KvElemType::kQ4_0:
      return scores_mapped<NC, KvElemType::kQ4_0>(q, n_rows, k, n_keys, scale, s);
    default:
      return scores_mapped<NC, KvElemType::kF32>(q, n_rows, k, n_keys, scale, s);
  }
}

void scores(const float* const* q, int n_rows, KvRows k, int n_keys, int hd, float scale, float* const* s) {
  switch (hd) {
    case 64: return scores_nc<8>(q, n_rows, k, n_keys, scale, s);
    case 128: return scores_nc<16>(q, n_rows, k, n_keys, scale, s);
    case 32: return scores_nc<4>(q, n_rows, k, n_keys, scale, s);
    case 256: return scores_nc<32>(q, n_rows, k, n_keys, scale, s);
    case 512:
      return scores_nc<64>(q, n_rows, k, n_keys, scale, s);
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

template <int NC, int R, KvElemType T, bool kMap>
void pv_nc(const float* const* p, KvRows v, int n_keys, float* const* acc_out) {
  __m256 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int j = 0; j < n_keys; ++j) {
    const uint8_t* row = v.row_at<kMap>(j);
    __m256 vv[NC];
    __m256 d = block_scale<T>(row, 0);
    for (int c = 0; c < NC; ++c) {
      if (quantized_kv(T) && c > 0 && c % 4 == 0) d = block_scale<T>(row, c);
      vv[c] = load8_scaled<T>(row, c, d);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_set1_ps(p[r][j]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(pj, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc_out[r] + 8 * c, acc[r][c]);
}

template <int NC, KvElemType T, bool kMap>
void pv_rows(const float* const* p, int n_rows, KvRows v, int n_keys, float* const* acc) {
  constexpr int kRows = NC <= 4 ? 2 : 1;  // at most 8-16 accumulators of 16
  int r = 0;
  for (; r + kRows <= n_rows; r += kRows) pv_nc<NC, kRows, T, kMap>(p + r, v, n_keys, acc + r);
  for (; r < n_rows; ++r) pv_nc<NC, 1, T, kMap>(p + r, v, n_keys, acc + r);
}

// Column slices of 32: 3 rows share each loaded value, with 12 accumulators, in registers. Used
// for heads of 128 or 256 always (a whole 256-wide row as registers, 32 accumulators and 32
// values, lived on the stack: AVX2 has 16 registers, and the spills made the values product
// of head_dim 256 several times slower), and for 64 when many rows share a chunk (prefill) or the
// values are quantised (each value is then converted once for 3 rows instead of once per row).
// Each output element is still the same sum over the keys in order: no result changes.
template <KvElemType T, bool kMap>
void pv_sliced(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc) {
  constexpr int kSlice = 32, kRows = 3;
  const size_t slice_bytes = kv_row_bytes(T, kSlice);
  for (int s = 0; s * kSlice < hd; ++s) {  // slices outer: a slice of the chunk stays in cache
    KvRows vs = v;
    vs.base = v.base + static_cast<size_t>(s) * slice_bytes;
    float* out[kRows];
    int r = 0;
    for (; r + kRows <= n_rows; r += kRows) {
      for (int i = 0; i < kRows; ++i) out[i] = acc[r + i] + s * kSlice;
      pv_nc<4, kRows, T, kMap>(p + r, vs, n_keys, out);
    }
    for (int i = 0; r + i < n_rows; ++i) out[i] = acc[r + i] + s * kSlice;
    if (n_rows - r == 2) pv_nc<4, 2, T, kMap>(p + r, vs, n_keys, out);
    if (n_rows - r == 1) pv_nc<4, 1, T, kMap>(p + r, vs, n_keys, out);
  }
}

template <int NC>
void pv_rows(const float* const* p, int n_rows, KvRows v, int n_keys, float* const* acc) {
  if constexpr (NC >= 8) {
    if (NC >= 16 || n_rows > 4 || kv_quantized(v.type)) {
      switch (v.type) {
        case KvElemType::kF16:
          return v.idx ? pv_sliced<KvElemType::kF16, true>(p, n_rows, v, n_keys, 8 * NC, acc)
                       : pv_sliced<KvElemType::kF16, false>(p, n_rows, v, n_keys, 8 * NC, acc);
        case KvElemType::kQ8_0:
          return v.idx ? pv_sliced<KvElemType::kQ8_0, true>(p, n_rows, v, n_keys, 8 * NC, acc)
                       : pv_sliced<KvElemType::kQ8_0, false>(p, n_rows, v, n_keys, 8 * NC, acc);
        case KvElemType::kQ4_0:
          return v.idx ? pv_sliced<KvElemType::kQ4_0, true>(p, n_rows, v, n_keys, 8 * NC, acc)
                       : pv_sliced<KvElemType::kQ4_0, false>(p, n_rows, v, n_keys, 8 * NC, acc);
        default:
          return v.idx ? pv_sliced<KvElemType::kF32, true>(p, n_rows, v, n_keys, 8 * NC, acc)
                       : pv_sliced<KvElemType::kF32, false>(p, n_rows, v, n_keys, 8 * NC, acc);
      }
    }
  }
  switch (v.type) {
    case KvElemType::kF16:
      return v.idx ? pv_rows<NC, KvElemType::kF16, true>(p, n_rows, v, n_keys, acc)
                   : pv_rows<NC, KvElemType::kF16, false>(p, n_rows, v, n_keys, acc);
    case KvElemType::kQ8_0:
      return v.idx ? pv_rows<NC, KvElemType::kQ8_0, true>(p, n_rows, v, n_keys, acc)
                   : pv_rows<NC, KvElemType::kQ8_0, false>(p, n_rows, v, n_keys, acc);
    case KvElemType::kQ4_0:
      return v.idx ? pv_rows<NC, KvElemType::kQ4_0, true>(p, n_rows, v, n_keys, acc)
                   : pv_rows<NC, KvElemType::kQ4_0, false>(p, n_rows, v, n_keys, acc);
    default:
      return v.idx ? pv_rows<NC, KvElemType::kF32, true>(p, n_rows, v, n_keys, acc)
                   : pv_rows<NC, KvElemType::kF32, false>(p, n_rows, v, n_keys, acc);
  }
}

void pv(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc) {
  switch (hd) {
    case 64: return pv_rows<8>(p, n_rows, v, n_keys, acc);
    case 128: return pv_rows<16>(p, n_rows, v, n_keys, acc);
    case 32: return pv_rows<4>(p, n_rows, v, n_keys, acc);
    case 256: return pv_rows<32>(p, n_rows, v, n_keys, acc);
    case 512:
      return pv_rows<64>(p, n_rows, v, n_keys, acc);
    default: return scalar_kernels().pv(p, n_rows, v, n_keys, hd, acc);
  }
}

}  // namespace

const Kernels& avx2_kernels() {
  static const Kernels k{scores, detail::max_impl, exp_sum, pv, detail::rescale_add_impl, detail::stats_impl};
  return k;
}

}  // namespace d2o::attn
