// AVX-512 variant of row_dots (compiled with the AVX-512 F/BW/VL/DQ flags). Tails use masked
// loads, so any row length works without a scalar loop. Rows go four at a time and their eight
// sums (dot and squared norm per row) are reduced together, which for short rows (head_dim 64)
// costs less than the loads themselves.
// GCC 12's AVX-512 headers trip a false -Wmaybe-uninitialized in some 512 -> 256 extractions;
// nothing here reads undefined lanes.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kv/policy/similarity.h"

namespace d2o::simd {

namespace {

template <bool kF16>
inline __m512 load16(const uint8_t* p, int d) {
  if constexpr (kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(p) + d)));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + d);
  }
}

template <bool kF16>
inline __m512 load16_masked(const uint8_t* p, int d, __mmask16 m) {
  if constexpr (kF16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + d));
  } else {
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(p) + d);
  }
}

inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

// Eight 16-lane accumulators -> their eight sums, in order.
inline __m256 reduce8(__m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 a4, __m512 a5, __m512 a6,
                      __m512 a7) {
  const __m256 t0 = _mm256_hadd_ps(fold(a0), fold(a1));
  const __m256 t1 = _mm256_hadd_ps(fold(a2), fold(a3));
  const __m256 t2 = _mm256_hadd_ps(fold(a4), fold(a5));
  const __m256 t3 = _mm256_hadd_ps(fold(a6), fold(a7));
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [s0 s1 s2 s3 | s0 s1 s2 s3]: halves of each sum
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // [s4 s5 s6 s7 | s4 s5 s6 s7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Dots only (no inverse norms wanted): eight rows at a time, their eight dots reduced together.
// Each dot is summed exactly as in the four-row loop of row_dots_impl (the same lane sums and the
// same reduction tree), so the dots do not depend on whether norms were asked for. Returns the
// rows done (a multiple of 8).
template <bool kF16>
int dots_by_eight(const RowDots& a) {
  const int full = a.dim / 16;
  const int tail = a.dim - 16 * full;
  const __mmask16 tmask = static_cast<__mmask16>((1u << tail) - 1u);
  int r = 0;
  for (; r + 8 <= a.n; r += 8) {
    const uint8_t* p[8];
    for (int i = 0; i < 8; ++i) {
      p[i] = a.row(r + i);
      a.prefetch(r + i + RowDots::kPrefetchRows);
    }
    __m512 dv[8];
    for (int i = 0; i < 8; ++i) dv[i] = _mm512_setzero_ps();
    for (int c = 0; c < full; ++c) {
      const int d = 16 * c;
      const __m512 q = _mm512_loadu_ps(a.q + d);
      for (int i = 0; i < 8; ++i) dv[i] = _mm512_fmadd_ps(q, load16<kF16>(p[i], d), dv[i]);
    }
    if (tail) {
      const int d = 16 * full;
      const __m512 q = _mm512_maskz_loadu_ps(tmask, a.q + d);
      for (int i = 0; i < 8; ++i)
        dv[i] = _mm512_fmadd_ps(q, load16_masked<kF16>(p[i], d, tmask), dv[i]);
    }
    _mm256_storeu_ps(a.dot + r, reduce8(dv[0], dv[1], dv[2], dv[3], dv[4], dv[5], dv[6], dv[7]));
  }
  return r;
}

template <bool kF16>
void row_dots_impl(const RowDots& a) {
  const int full = a.dim / 16;
  const int tail = a.dim - 16 * full;
  const __mmask16 tmask = static_cast<__mmask16>((1u << tail) - 1u);
  auto row_ptr = [&a](int r) { return a.row(r); };
  alignas(32) float sums[8];
  int r = a.inv_norm ? 0 : dots_by_eight<kF16>(a);
  for (; r + 4 <= a.n; r += 4) {
    const uint8_t* p0 = row_ptr(r);
    const uint8_t* p1 = row_ptr(r + 1);
    const uint8_t* p2 = row_ptr(r + 2);
    const uint8_t* p3 = row_ptr(r + 3);
    __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0, n0 = d0, n1 = d0, n2 = d0, n3 = d0;
    auto step = [&](__m512 q, __m512 x0, __m512 x1, __m512 x2, __m512 x3) {
      d0 = _mm512_fmadd_ps(q, x0, d0);
      n0 = _mm512_fmadd_ps(x0, x0, n0);
      d1 = _mm512_fmadd_ps(q, x1, d1);
      n1 = _mm512_fmadd_ps(x1, x1, n1);
      d2 = _mm512_fmadd_ps(q, x2, d2);
      n2 = _mm512_fmadd_ps(x2, x2, n2);
      d3 = _mm512_fmadd_ps(q, x3, d3);
      n3 = _mm512_fmadd_ps(x3, x3, n3);
    };
    for (int c = 0; c < full; ++c) {
      const int d = 16 * c;
      step(_mm512_loadu_ps(a.q + d), load16<kF16>(p0, d), load16<kF16>(p1, d), load16<kF16>(p2, d),
           load16<kF16>(p3, d));
    }
    if (tail) {
      const int d = 16 * full;
      step(_mm512_maskz_loadu_ps(tmask, a.q + d), load16_masked<kF16>(p0, d, tmask),
           load16_masked<kF16>(p1, d, tmask), load16_masked<kF16>(p2, d, tmask),
           load16_masked<kF16>(p3, d, tmask));
    }
    __m256 v = reduce8(d0, n0, d1, n1, d2, n2, d3, n3);  // [dot0 nn0 dot1 nn1 ...]
    // Odd lanes: 1 / sqrt(nn), 0 where nn == 0.
    const __mmask8 odd_pos = _mm256_cmp_ps_mask(v, _mm256_setzero_ps(), _CMP_GT_OQ) & 0xAA;
    v = _mm256_mask_div_ps(_mm256_mask_blend_ps(0xAA, v, _mm256_setzero_ps()), odd_pos,
                           _mm256_set1_ps(1.0f), _mm256_sqrt_ps(v));
    _mm256_store_ps(sums, v);
    a.dot[r] = sums[0];
    a.dot[r + 1] = sums[2];
    a.dot[r + 2] = sums[4];
    a.dot[r + 3] = sums[6];
    if (a.inv_norm) {
      a.inv_norm[r] = sums[1];
      a.inv_norm[r + 1] = sums[3];
      a.inv_norm[r + 2] = sums[5];
      a.inv_norm[r + 3] = sums[7];
    }
  }
  for (; r < a.n; ++r) {
    const uint8_t* p = row_ptr(r);
    __m512 acc = _mm512_setzero_ps(), acc_n = _mm512_setzero_ps();
    for (int c = 0; c < full; ++c) {
      const __m512 x = load16<kF16>(p, 16 * c);
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.q + 16 * c), x, acc);
      acc_n = _mm512_fmadd_ps(x, x, acc_n);
    }
    if (tail) {
      const __m512 x = load16_masked<kF16>(p, 16 * full, tmask);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tmask, a.q + 16 * full), x, acc);
      acc_n = _mm512_fmadd_ps(x, x, acc_n);
    }
    a.dot[r] = _mm512_reduce_add_ps(acc);
    if (a.inv_norm) {
      const float n2 = _mm512_reduce_add_ps(acc_n);
      a.inv_norm[r] = n2 > 0.0f ? 1.0f / std::sqrt(n2) : 0.0f;
    }
  }
}

}  // namespace

// As scaled_argmax_avx2, sixteen lanes; the last block is masked, so no scalar tail.
int scaled_argmax_avx512(const float* dot, const float* inv, int n, float f, float* best) {
  const float s0 = 0.0f + f * dot[0] * inv[0];
  if (s0 != s0) {  // NaN s_0: nothing is greater
    *best = s0;
    return 0;
  }
  const __m512 fv = _mm512_set1_ps(f), zero = _mm512_setzero_ps();
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __m512i vidx = _mm512_setzero_si512();
  __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 fd = _mm512_mul_ps(fv, _mm512_maskz_loadu_ps(m, dot + i));
    const __m512 s = _mm512_add_ps(zero, _mm512_mul_ps(fd, _mm512_maskz_loadu_ps(m, inv + i)));
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, s, vmax, _CMP_GT_OQ);
    vmax = _mm512_mask_mov_ps(vmax, gt, s);
    vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    cur = _mm512_add_epi32(cur, step);
  }
  // s_0 is lane 0's first value and the running answer's seed: a lane takes over only when
  // strictly greater, and then the first index among the lanes holding the maximum wins.
  const float mx = _mm512_reduce_max_ps(vmax);
  if (!(mx > s0)) {
    *best = s0;
    return 0;
  }
  const __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(mx), _CMP_EQ_OQ);
  *best = mx;  // every s is 0 + x, so no -0 can stand for a +0
  return _mm512_mask_reduce_min_epi32(at, vidx);
}

// A plain loop: this file's flags (-O3 and the ISA) vectorise it (subtract, max, convert, divide).
void mean_attention_avx512(const float* score, const int32_t* pos, int n, int32_t next,
                           float* out) {
  for (int j = 0; j < n; ++j) {
    const int32_t seen = std::max<int32_t>(1, next - pos[j]);
    out[j] = score[j] / static_cast<float>(seen);
  }
}

// As last_min_scan of the AVX2 file, sixteen lanes; the last block is masked, so no scalar tail.
// x(i, m): the values at i, lanes m.
namespace {

template <class Values>
int last_min_scan(int n, Values x) {
  __m512 vmin = _mm512_set1_ps(INFINITY);
  __m512i vidx = _mm512_set1_epi32(-1);
  __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 v = x(i, m);
    const __mmask16 le = _mm512_mask_cmp_ps_mask(m, v, vmin, _CMP_LE_OQ);
    vmin = _mm512_mask_mov_ps(vmin, le, v);
    vidx = _mm512_mask_mov_epi32(vidx, le, cur);
    cur = _mm512_add_epi32(cur, step);
  }
  // Lane 0 holds the first value at least (not NaN, <= infinity); lanes never written keep -1.
  const float mn = _mm512_reduce_min_ps(vmin);
  const __mmask16 at = _mm512_cmp_ps_mask(vmin, _mm512_set1_ps(mn), _CMP_EQ_OQ);
  return _mm512_mask_reduce_max_epi32(at, vidx);
}

}  // namespace

int last_min_index_avx512(const float* s, int n) {
  if (s[0] != s[0]) return 0;  // NaN s_0: nothing is <= it
  return last_min_scan(n, [&](int i, __mmask16 m) { return _mm512_maskz_loadu_ps(m, s + i); });
}

// last_min_index_avx512 over score_j / float(max(1, next - pos_j)), formed in the registers.
int last_min_mean_index_avx512(const float* score, const int32_t* pos, int n, int32_t next) {
  const float m0 = score[0] / static_cast<float>(std::max<int32_t>(1, next - pos[0]));
  if (m0 != m0) return 0;  // NaN mean_0: nothing is <= it
  const __m512i vnext = _mm512_set1_epi32(next), one = _mm512_set1_epi32(1);
  return last_min_scan(n, [&](int i, __mmask16 m) {
    const __m512i seen =
        _mm512_max_epi32(one, _mm512_sub_epi32(vnext, _mm512_maskz_loadu_epi32(m, pos + i)));
    return _mm512_div_ps(_mm512_maskz_loadu_ps(m, score + i), _mm512_cvtepi32_ps(seen));
  });
}

namespace {

template <bool kF16>
float row_inv_norm_impl(const RowDots& a, int r) {
  const int full = a.dim / 16;
  const int tail = a.dim - 16 * full;
  const uint8_t* p = a.row(r);
  __m512 n = _mm512_setzero_ps();
  for (int c = 0; c < full; ++c) {
    const __m512 x = load16<kF16>(p, 16 * c);
    n = _mm512_fmadd_ps(x, x, n);
  }
  if (tail) {
    const __m512 x = load16_masked<kF16>(p, 16 * full, static_cast<__mmask16>((1u << tail) - 1u));
    n = _mm512_fmadd_ps(x, x, n);
  }
  // reduce8's tree for one of its eight sums.
  alignas(32) float f[8];
  _mm256_store_ps(f, fold(n));
  const float nn = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
  return nn > 0.0f ? 1.0f / std::sqrt(nn) : 0.0f;
}

}  // namespace

float row_inv_norm_avx512(const RowDots& a, int r) {
  return a.f16 ? row_inv_norm_impl<true>(a, r) : row_inv_norm_impl<false>(a, r);
}

// Four queries by four rows a block: sixteen accumulators, each row chunk loaded once for the four
// queries. Every dot is the four-row loop's: the same chain of fused multiply-adds over the
// 16-float chunks from zero, and reduce8's tree (the same for each of its eight sums).
int row_dots_queries_avx512(const RowDots& a, const float* qs, size_t q_stride, int n_q,
                            float scale, float* dot, size_t ld) {
  const int full = a.dim / 16;
  const int n4 = a.n & ~3;
  int j = 0;
  for (; j + 4 <= n_q; j += 4) {
    const float* q[4];
    for (int i = 0; i < 4; ++i) q[i] = qs + static_cast<size_t>(j + i) * q_stride;
    for (int r = 0; r < n4; r += 4) {
      const float* p[4];
      for (int i = 0; i < 4; ++i)
        p[i] = reinterpret_cast<const float*>(a.base + static_cast<size_t>(r + i) * a.row_bytes);
      __m512 acc[4][4];
      for (auto& row : acc)
        for (__m512& x : row) x = _mm512_setzero_ps();
      for (int c = 0; c < full; ++c) {
        const int d = 16 * c;
        const __m512 x0 = _mm512_loadu_ps(p[0] + d), x1 = _mm512_loadu_ps(p[1] + d);
        const __m512 x2 = _mm512_loadu_ps(p[2] + d), x3 = _mm512_loadu_ps(p[3] + d);
        for (int i = 0; i < 4; ++i) {
          const __m512 qv = _mm512_loadu_ps(q[i] + d);
          acc[i][0] = _mm512_fmadd_ps(qv, x0, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(qv, x1, acc[i][1]);
          acc[i][2] = _mm512_fmadd_ps(qv, x2, acc[i][2]);
          acc[i][3] = _mm512_fmadd_ps(qv, x3, acc[i][3]);
        }
      }
      alignas(32) float s[8];
      for (int i = 0; i < 4; i += 2) {
        _mm256_store_ps(s, reduce8(acc[i][0], acc[i][1], acc[i][2], acc[i][3], acc[i + 1][0],
                                   acc[i + 1][1], acc[i + 1][2], acc[i + 1][3]));
        float* o0 = dot + static_cast<size_t>(j + i) * ld + r;
        float* o1 = o0 + ld;
        for (int t = 0; t < 4; ++t) {
          o0[t] = s[t] * scale;
          o1[t] = s[4 + t] * scale;
        }
      }
    }
  }
  return j;
}

void row_dots_avx512(const RowDots& a) {
  if (a.f16)
    row_dots_impl<true>(a);
  else
    row_dots_impl<false>(a);
}

}  // namespace d2o::simd
