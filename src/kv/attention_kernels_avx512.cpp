// AVX-512 attention loops (see attention_kernels.h). Head dimensions that are a multiple of 16
// use the vector code; others fall back to the scalar loops.
//
// Scores: the dot product of a query row and a key is one 16-lane accumulator (a product, then
// fused multiply-adds over the head dimension in order) whose lanes are summed in a fixed tree:
// (i, i+8), then (i, i+4), (i, i+2), (i, i+1). Two register layouts compute it:
//   - up to 4 rows x 4 keys, keys converted into registers once for all rows (decode: few rows,
//     F16 rows read straight from the cache);
//   - 1 row x 16 keys, keys read from memory (prefill: many rows over an F32 copy of a chunk that
//     sits in L1), in sub-blocks of 64 keys so the keys stay in L1 across rows.
// Both sum the lanes of several accumulators at once with shuffles (about 3 operations per score
// instead of 10 for a lane-by-lane reduction) and give bit-identical scores, as does the
// one-key tail (reduce16). tests/unit/test_attention.cpp checks the three against each other.
//
// GCC 12 reports its own AVX-512 headers' _mm512_undefined_ps() placeholders as "maybe
// uninitialized" once these intrinsics are inlined here: a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kv/attention_kernels.h"
#include "kv/attention_stats_impl.h"
#include "ops/quant.h"
#include "ops/vmath_avx512.h"

namespace d2o::attn {

namespace {

// Elements [16c, 16c + 16) of a row as floats. Q8_0 / Q4_0: q * d (Q4_0: (q - 8) * d), the
// products of the reference dequantisation, so the values equal dequantize_row's. The storage
// type is a template parameter: the loops below are instantiated per type, so the inner loops
// carry no branch on it.
template <KvElemType T>
inline __m512 load16(const uint8_t* row, int c) {
  switch (T) {
    case KvElemType::kF16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    case KvElemType::kQ8_0: {
      const auto* b = reinterpret_cast<const BlockQ8_0*>(row) + c / 2;
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs + 16 * (c % 2)));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                           _mm512_set1_ps(_cvtsh_ss(b->d)));
    }
    case KvElemType::kQ4_0: {
      // Elements 0-15 of a block are the low nibbles of qs[0..15], 16-31 the high ones.
      const auto* b = reinterpret_cast<const BlockQ4_0*>(row) + c / 2;
      __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
      if (c % 2) q = _mm_srli_epi16(q, 4);
      q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
      const __m512i w = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(8));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(_cvtsh_ss(b->d)));
    }
    default:
      return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c);
  }
}

using simd::exp512;

// ---- the lane-sum tree ---------------------------------------------------------------------

// Sum of the 16 lanes: a_i = v_i + v_(i+8), b_i = a_i + a_(i+4), c_i = b_i + b_(i+2), c_0 + c_1.
inline float reduce16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// Step a for two accumulators: [x lanes 0-7 + 8-15 | y lanes 0-7 + 8-15].
inline __m512 fold_a(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
// Step b for two fold_a results: 128-bit chunk k holds b_0..3 of accumulator k of (xy, zw).
inline __m512 fold_b(__m512 xy, __m512 zw) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(xy, zw, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(xy, zw, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Sums of 4 accumulators, in lanes 0..3 of the result.
inline __m128 reduce4x16(__m512 k0, __m512 k1, __m512 k2, __m512 k3) {
  __m512 s = fold_b(fold_a(k0, k1), fold_a(k2, k3));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));  // c
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));  // c_0 + c_1 in lane 0
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s));
}

// Sums of 16 accumulators, in key order.
inline __m512 reduce16x16(const __m512* k) {
  return simd::reduce_each16(k, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// ---- scores ---------------------------------------------------------------------------------

// The accumulator of one (row, key): q * k over NC 16-lane pieces, in order.
template <int NC>
inline __m512 dot_acc(const float* q, const __m512* kv) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), kv[0]);
  for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), kv[c], acc);
  return acc;
}

// R rows x 4 keys per step, keys in registers; kPf: with k.prefetch (a separate instantiation, so
// the loop without it is unchanged).
template <int NC, int R, KvElemType T, bool kMap, bool kPf = false>
void scores_rows(const float* const* q, KvRows k, int n_keys, float scale, float* const* s) {
  if (!kPf && k.prefetch != nullptr)
    return scores_rows<NC, R, T, kMap, true>(q, k, n_keys, scale, s);
  const __m128 sc = _mm_set1_ps(scale);
  int j = 0;
  for (; j + 4 <= n_keys; j += 4) {
    if (kPf) k.prefetch_rows<kMap>(j, 4);
    __m512 acc[R][4];
    for (int i = 0; i < 4; ++i) {
      const uint8_t* row = k.row_at<kMap>(j + i);
      __m512 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = load16<T>(row, c);
      for (int r = 0; r < R; ++r) acc[r][i] = dot_acc<NC>(q[r], kv);
    }
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(s[r] + j,
                    _mm_mul_ps(reduce4x16(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), sc));
    }
  }
  for (; j < n_keys; ++j) {
    const uint8_t* row = k.row_at<kMap>(j);
    __m512 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = load16<T>(row, c);
    for (int r = 0; r < R; ++r) s[r][j] = reduce16(dot_acc<NC>(q[r], kv)) * scale;
  }
}

// R rows x 4 keys per step for wide heads (head_dim 256): 16 key pieces and R x 4 accumulators do
// not fit the 32 registers together, so the head dimension runs outermost: per 16-lane piece,
// the 4 keys' pieces are converted and each row's query piece is loaded once (4 + R loads for
// 4R fused multiply-adds, where holding a whole key took 1 + R loads per multiply-add with R = 1).
// Each accumulator still sums its products in head-dimension order: the scores are identical.
template <int NC, int R, KvElemType T, bool kMap>
void scores_wide(const float* const* q, KvRows k, int n_keys, float scale, float* const* s) {
  const __m128 sc = _mm_set1_ps(scale);
  int j = 0;
  for (; j + 4 <= n_keys; j += 4) {
    if (k.prefetch != nullptr) k.prefetch_rows<kMap>(j, 4);
    const uint8_t* row[4];
    for (int i = 0; i < 4; ++i) row[i] = k.row_at<kMap>(j + i);
    __m512 acc[R][4];
    for (int c = 0; c < NC; ++c) {
      __m512 kv[4];
      for (int i = 0; i < 4; ++i) kv[i] = load16<T>(row[i], c);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_loadu_ps(q[r] + 16 * c);
        for (int i = 0; i < 4; ++i)
          acc[r][i] = c == 0 ? _mm512_mul_ps(qv, kv[i]) : _mm512_fmadd_ps(qv, kv[i], acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(s[r] + j,
                    _mm_mul_ps(reduce4x16(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), sc));
    }
  }
  if (j == n_keys) return;
  KvRows tail = k;
  if constexpr (kMap) {
    tail.idx += j;
  } else {
    tail.base += static_cast<size_t>(j) * k.row_bytes;
  }
  tail.prefetch = nullptr;
  float* st[R];
  for (int r = 0; r < R; ++r) st[r] = s[r] + j;
  scores_rows<NC, R, T, kMap>(q, tail, n_keys - j, scale, st);
}

// One row x 16 keys per step over F32 keys read from memory; key sub-blocks of 64 keys are
// swept for all rows before moving on, so they stay in L1.
template <int NC, bool kMap>
void scores_many(const float* const* q, int n_rows, KvRows k, int n_keys, float scale,
                 float* const* s) {
  constexpr int kSub = 64;
  const __m512 sc = _mm512_set1_ps(scale);
  const int n16 = n_keys / 16 * 16;
  for (int j0 = 0; j0 < n16; j0 += kSub) {
    const int j1 = std::min(n16, j0 + kSub);
    for (int r = 0; r < n_rows; ++r) {
      __m512 qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q[r] + 16 * c);
      for (int j = j0; j < j1; j += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) {
          const float* kr = reinterpret_cast<const float*>(k.row_at<kMap>(j + i));
          acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int c = 1; c < NC; ++c)
            acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc[i]);
        }
        _mm512_storeu_ps(s[r] + j, _mm512_mul_ps(reduce16x16(acc), sc));
      }
    }
  }
  if (n16 < n_keys) {
    KvRows tail = k;
    if constexpr (kMap) {
      tail.idx += n16;
    } else {
      tail.base += static_cast<size_t>(n16) * k.row_bytes;
    }
    tail.prefetch = nullptr;  // like the rest of this layout (rows over an L1-resident chunk)
    float* st[1];
    for (int r = 0; r < n_rows; ++r) {
      st[0] = s[r] + n16;
      scores_rows<NC, 1, KvElemType::kF32, kMap>(q + r, tail, n_keys - n16, scale, st);
    }
  }
}

template <int NC, KvElemType T, bool kMap>
void scores_nc(const float* const* q, int n_rows, KvRows k, int n_keys, float scale,
               float* const* s) {
  // NC = 4 (head_dim 64): 4 rows x 4 keys = 16 accumulators + 4 key registers.
  constexpr int kRows = NC <= 4 ? 4 : NC <= 8 ? 2 : 1;
  if (T == KvElemType::kF32 && n_rows > kRows && NC <= 8) {
    return scores_many<NC, kMap>(q, n_rows, k, n_keys, scale, s);
  }
  if constexpr (NC >= 16) {
    int r = 0;
    for (; r + 4 <= n_rows; r += 4) scores_wide<NC, 4, T, kMap>(q + r, k, n_keys, scale, s + r);
    switch (n_rows - r) {
      case 3:
        return scores_wide<NC, 3, T, kMap>(q + r, k, n_keys, scale, s + r);
      case 2:
        return scores_wide<NC, 2, T, kMap>(q + r, k, n_keys, scale, s + r);
      case 1:
        return scores_wide<NC, 1, T, kMap>(q + r, k, n_keys, scale, s + r);
      default:
        return;
    }
  }
  int r = 0;
  for (; r + kRows <= n_rows; r += kRows)
    scores_rows<NC, kRows, T, kMap>(q + r, k, n_keys, scale, s + r);
  switch (n_rows - r) {
    case 3:
      return scores_rows<NC, 3, T, kMap>(q + r, k, n_keys, scale, s + r);
    case 2:
      return scores_rows<NC, 2, T, kMap>(q + r, k, n_keys, scale, s + r);
    case 1:
      return scores_rows<NC, 1, T, kMap>(q + r, k, n_keys, scale, s + r);
    default:
      return;
  }
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

void scores(const float* const* q, int n_rows, KvRows k, int n_keys, int hd, float scale,
            float* const* s) {
  switch (hd) {
    case 64:
      return scores_nc<4>(q, n_rows, k, n_keys, scale, s);
    case 128:
      return scores_nc<8>(q, n_rows, k, n_keys, scale, s);
    case 32:
      return scores_nc<2>(q, n_rows, k, n_keys, scale, s);
    case 256:
      return scores_nc<16>(q, n_rows, k, n_keys, scale, s);
    case 512:
      return scores_nc<32>(q, n_rows, k, n_keys, scale, s);
    default:
      return scalar_kernels().scores(q, n_rows, k, n_keys, hd, scale, s);
  }
}

// ---- softmax pieces --------------------------------------------------------------------------

float row_max(const float* s, int n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  if (j < n) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (n - j)) - 1u);
    m = _mm512_mask_max_ps(m, mk, m, _mm512_maskz_loadu_ps(mk, s + j));
  }
  return _mm512_reduce_max_ps(m);
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
    const __m512 e =
        _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), mv)));
    _mm512_mask_storeu_ps(s + j, mk, e);
    sum = _mm512_add_ps(sum, e);
    j = n_valid;
  }
  for (; j < n; ++j) s[j] = 0.0f;
  return reduce16(sum);
}

// ---- p v -------------------------------------------------------------------------------------

template <int NC, int R, KvElemType T, bool kMap>
void pv_nc(const float* const* p, KvRows v, int n_keys, float* const* acc_out) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int j = 0; j < n_keys; ++j) {
    const uint8_t* row = v.row_at<kMap>(j);
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16<T>(row, c);
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pj, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_out[r] + 16 * c, acc[r][c]);
}

template <int NC, KvElemType T, bool kMap>
void pv_rows(const float* const* p, int n_rows, KvRows v, int n_keys, float* const* acc) {
  // At most 16 accumulators live in registers: 4 rows of 64, 2 of 128, 1 of 256.
  constexpr int kRows = NC <= 4 ? 4 : NC <= 8 ? 2 : 1;
  int r = 0;
  for (; r + kRows <= n_rows; r += kRows) pv_nc<NC, kRows, T, kMap>(p + r, v, n_keys, acc + r);
  switch (n_rows - r) {
    case 3:
      return pv_nc<NC, 3, T, kMap>(p + r, v, n_keys, acc + r);
    case 2:
      return pv_nc<NC, 2, T, kMap>(p + r, v, n_keys, acc + r);
    case 1:
      return pv_nc<NC, 1, T, kMap>(p + r, v, n_keys, acc + r);
    default:
      return;
  }
}

// Column slices of kNC x 16: kRows rows share each loaded value. Used for wide heads over many
// rows (prefill): a whole 256-wide row as registers (16 accumulators and 16 values) does not
// fit the 32 registers, and each row then streamed the whole value chunk from L2; a slice of
// the chunk stays in L1 across the rows. Each output element is still the same sum over the
// keys in order: no result changes.
template <int kNC, int kRows, KvElemType T, bool kMap>
void pv_sliced(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc) {
  constexpr int kSlice = 16 * kNC;
  const size_t slice_bytes = kv_row_bytes(T, kSlice);
  for (int s = 0; s * kSlice < hd; ++s) {  // slices outer: a slice of the chunk stays in L1
    KvRows vs = v;
    vs.base = v.base + static_cast<size_t>(s) * slice_bytes;
    float* out[kRows];
    int r = 0;
    for (; r + kRows <= n_rows; r += kRows) {
      for (int i = 0; i < kRows; ++i) out[i] = acc[r + i] + s * kSlice;
      pv_nc<kNC, kRows, T, kMap>(p + r, vs, n_keys, out);
    }
    for (; r < n_rows; ++r) {
      out[0] = acc[r] + s * kSlice;
      pv_nc<kNC, 1, T, kMap>(p + r, vs, n_keys, out);
    }
  }
}

// Heads of 128 or 256 over more than 4 rows: slices of 64 columns, 4 rows (16 accumulators).
template <int NC, KvElemType T>
void pv_mapped(const float* const* p, int n_rows, KvRows v, int n_keys, float* const* acc) {
  if constexpr (NC >= 8) {
    if (n_rows > 4) {
      return v.idx ? pv_sliced<4, 4, T, true>(p, n_rows, v, n_keys, 16 * NC, acc)
                   : pv_sliced<4, 4, T, false>(p, n_rows, v, n_keys, 16 * NC, acc);
    }
  }
  if (v.idx) return pv_rows<NC, T, true>(p, n_rows, v, n_keys, acc);
  return pv_rows<NC, T, false>(p, n_rows, v, n_keys, acc);
}

template <int NC>
void pv_rows(const float* const* p, int n_rows, KvRows v, int n_keys, float* const* acc) {
  switch (v.type) {
    case KvElemType::kF16:
      return pv_mapped<NC, KvElemType::kF16>(p, n_rows, v, n_keys, acc);
    case KvElemType::kQ8_0:
      return pv_mapped<NC, KvElemType::kQ8_0>(p, n_rows, v, n_keys, acc);
    case KvElemType::kQ4_0:
      return pv_mapped<NC, KvElemType::kQ4_0>(p, n_rows, v, n_keys, acc);
    default:
      return pv_mapped<NC, KvElemType::kF32>(p, n_rows, v, n_keys, acc);
  }
}

void pv(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc) {
  switch (hd) {
    case 64:
      return pv_rows<4>(p, n_rows, v, n_keys, acc);
    case 128:
      return pv_rows<8>(p, n_rows, v, n_keys, acc);
    case 32:
      return pv_rows<2>(p, n_rows, v, n_keys, acc);
    case 256:
      return pv_rows<16>(p, n_rows, v, n_keys, acc);
    case 512:
      return pv_rows<32>(p, n_rows, v, n_keys, acc);
    default:
      return scalar_kernels().pv(p, n_rows, v, n_keys, hd, acc);
  }
}

void rescale_add(float* o, const float* x, float a, float b, int n) {
  const __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b);
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    _mm512_storeu_ps(o + d, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(o + d), av),
                                          _mm512_mul_ps(_mm512_loadu_ps(x + d), bv)));
  }
  for (; d < n; ++d) o[d] = o[d] * a + x[d] * b;
}

}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels k{scores, row_max, exp_sum, pv, rescale_add, detail::stats_impl};
  return k;
}

}  // namespace d2o::attn
