// AVX2 + FMA + F16C variant of row_dots (compiled with -mavx2 -mfma -mf16c only).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Eight 8-lane accumulators -> their eight sums, in order.
inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                      __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1);  // per 128-bit half: pair sums of a0, a1
  const __m256 t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5);
  const __m256 t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [a0 a1 a2 a3 | a0 a1 a2 a3]: halves of each sum
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // [a4 a5 a6 a7 | a4 a5 a6 a7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <bool kF16>
inline __m256 load8(const uint8_t* p, int d) {
  if constexpr (kF16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(p) + d)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + d);
  }
}

template <bool kF16>
inline float load1(const uint8_t* p, int d) {
  if constexpr (kF16) {
    uint16_t h;  // rows may be misaligned: read with memcpy
    std::memcpy(&h, p + 2 * d, 2);
    return fp16_to_fp32(h);
  } else {
    float x;
    std::memcpy(&x, p + 4 * d, 4);
    return x;
  }
}

// Dots only (no inverse norms wanted): eight rows at a time, their eight dots reduced together.
// Each dot is summed exactly as in the four-row loop below (the same lane sums and the same
// reduction tree), so the dots do not depend on whether norms were asked for. Returns the rows
// done (a multiple of 8).
template <bool kF16>
int dots_by_eight(const RowDots& a) {
  const int d8 = a.dim & ~7;
  int r = 0;
  for (; r + 8 <= a.n; r += 8) {
    const uint8_t* p[8];
    for (int i = 0; i < 8; ++i) {
      p[i] = a.row(r + i);
      a.prefetch(r + i + RowDots::kPrefetchRows);
    }
    __m256 dv[8];
    for (int i = 0; i < 8; ++i) dv[i] = _mm256_setzero_ps();
    for (int d = 0; d < d8; d += 8) {
      const __m256 q = _mm256_loadu_ps(a.q + d);
      for (int i = 0; i < 8; ++i) dv[i] = _mm256_fmadd_ps(q, load8<kF16>(p[i], d), dv[i]);
    }
    __m256 v = reduce8(dv[0], dv[1], dv[2], dv[3], dv[4], dv[5], dv[6], dv[7]);
    if (d8 < a.dim) {  // tail elements, added to the lane sums
      float tail[8] = {};
      for (int i = 0; i < 8; ++i) {
        for (int d = d8; d < a.dim; ++d) tail[i] += a.q[d] * load1<kF16>(p[i], d);
      }
      v = _mm256_add_ps(v, _mm256_loadu_ps(tail));
    }
    _mm256_storeu_ps(a.dot + r, v);
  }
  return r;
}

// Four rows at a time: their eight sums (dot and squared norm per row) are reduced together and
// the four inverse norms computed as one vector, which for short rows (head_dim 64) costs less
// than one horizontal sum, square root and division per row.
template <bool kF16>
void row_dots_impl(const RowDots& a) {
  const int d8 = a.dim & ~7;
  auto row_ptr = [&a](int r) { return a.row(r); };
  alignas(32) float sums[8];
  int r = a.inv_norm ? 0 : dots_by_eight<kF16>(a);
  for (; r + 4 <= a.n; r += 4) {
    const uint8_t* p[4] = {row_ptr(r), row_ptr(r + 1), row_ptr(r + 2), row_ptr(r + 3)};
    __m256 dv[4], nv[4];
    for (int i = 0; i < 4; ++i) dv[i] = nv[i] = _mm256_setzero_ps();
    for (int d = 0; d < d8; d += 8) {
      const __m256 q = _mm256_loadu_ps(a.q + d);
      for (int i = 0; i < 4; ++i) {
        const __m256 x = load8<kF16>(p[i], d);
        dv[i] = _mm256_fmadd_ps(q, x, dv[i]);
        nv[i] = _mm256_fmadd_ps(x, x, nv[i]);
      }
    }
    __m256 v = reduce8(dv[0], nv[0], dv[1], nv[1], dv[2], nv[2], dv[3], nv[3]);
    if (d8 < a.dim) {  // tail elements, added to the lane sums
      float tail[8] = {};
      for (int i = 0; i < 4; ++i) {
        for (int d = d8; d < a.dim; ++d) {
          const float x = load1<kF16>(p[i], d);
          tail[2 * i] += a.q[d] * x;
          tail[2 * i + 1] += x * x;
        }
      }
      v = _mm256_add_ps(v, _mm256_loadu_ps(tail));
    }
    // Odd lanes: 1 / sqrt(nn), 0 where nn == 0.
    const __m256 odd = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
    const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ), odd);
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(_mm256_max_ps(v, _mm256_set1_ps(1e-30f))));
    v = _mm256_blendv_ps(_mm256_andnot_ps(odd, v), inv, pos);
    _mm256_store_ps(sums, v);
    for (int i = 0; i < 4; ++i) {
      a.dot[r + i] = sums[2 * i];
      if (a.inv_norm) a.inv_norm[r + i] = sums[2 * i + 1];
    }
  }
  for (; r < a.n; ++r) {
    const uint8_t* p = row_ptr(r);
    __m256 acc = _mm256_setzero_ps(), acc_n = _mm256_setzero_ps();
    float dot = 0.0f, nn = 0.0f;
    for (int d = 0; d < d8; d += 8) {
      const __m256 x = load8<kF16>(p, d);
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.q + d), x, acc);
      acc_n = _mm256_fmadd_ps(x, x, acc_n);
    }
    for (int d = d8; d < a.dim; ++d) {
      const float x = load1<kF16>(p, d);
      dot += a.q[d] * x;
      nn += x * x;
    }
    a.dot[r] = hsum(acc) + dot;
    if (a.inv_norm) {
      const float n2 = hsum(acc_n) + nn;
      a.inv_norm[r] = n2 > 0.0f ? 1.0f / std::sqrt(n2) : 0.0f;
    }
  }
}

}  // namespace

namespace {

// The lanes i < left (0..8) of a mask for the block's last, partial load.
inline __m256i first_lanes(int left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hmax8(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

inline float hmin8(__m256 v) {
  v = _mm256_min_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_min_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_min_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

// One block of a running extreme per lane: where x compares kCmp to the lane's best, the lane
// takes x and the index in cur; cur moves on to the next block.
template <int kCmp>
inline void lane_update(__m256 x, __m256& best, __m256i& idx, __m256i& cur) {
  const __m256 take = _mm256_cmp_ps(x, best, kCmp);
  best = _mm256_blendv_ps(best, x, take);
  idx = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(cur), take));
  cur = _mm256_add_epi32(cur, _mm256_set1_epi32(8));
}

inline int hmin8_epi32(__m256i v) {
  v = _mm256_min_epi32(v, _mm256_permute2x128_si256(v, v, 1));
  v = _mm256_min_epi32(v, _mm256_shuffle_epi32(v, 0x4E));
  v = _mm256_min_epi32(v, _mm256_shuffle_epi32(v, 0xB1));
  return _mm256_cvtsi256_si32(v);
}

inline int hmax8_epi32(__m256i v) {
  v = _mm256_max_epi32(v, _mm256_permute2x128_si256(v, v, 1));
  v = _mm256_max_epi32(v, _mm256_shuffle_epi32(v, 0x4E));
  v = _mm256_max_epi32(v, _mm256_shuffle_epi32(v, 0xB1));
  return _mm256_cvtsi256_si32(v);
}

}  // namespace

// Eight lanes each keep the first index of their own largest s (strictly greater replaces, so
// NaN never enters; the last, partial block reads NaN past n); the answer is the smallest index
// among the lanes holding the overall largest value. s_0 seeds the running answer as in the
// scalar loop: a lane takes over only when strictly greater.
int scaled_argmax_avx2(const float* dot, const float* inv, int n, float f, float* best) {
  const float s0 = 0.0f + f * dot[0] * inv[0];
  if (s0 != s0) {  // NaN s_0: nothing is greater
    *best = s0;
    return 0;
  }
  const __m256 fv = _mm256_set1_ps(f), zero = _mm256_setzero_ps();
  const __m256 nan = _mm256_set1_ps(NAN);
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  __m256i vidx = _mm256_setzero_si256();
  __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto update = [&](__m256 s) { lane_update<_CMP_GT_OQ>(s, vmax, vidx, cur); };
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 fd = _mm256_mul_ps(fv, _mm256_loadu_ps(dot + i));
    update(_mm256_add_ps(zero, _mm256_mul_ps(fd, _mm256_loadu_ps(inv + i))));
  }
  if (i < n) {
    const __m256i m = first_lanes(n - i);
    const __m256 fd = _mm256_mul_ps(fv, _mm256_maskload_ps(dot + i, m));
    const __m256 s = _mm256_add_ps(zero, _mm256_mul_ps(fd, _mm256_maskload_ps(inv + i, m)));
    update(_mm256_blendv_ps(nan, s, _mm256_castsi256_ps(m)));
  }
  const float mx = hmax8(vmax);
  if (!(mx > s0)) {
    *best = s0;
    return 0;
  }
  const __m256 at = _mm256_cmp_ps(vmax, _mm256_set1_ps(mx), _CMP_EQ_OQ);
  *best = mx;  // every s is 0 + x, so no -0 can stand for a +0
  return hmin8_epi32(_mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX)), _mm256_castsi256_ps(vidx), at)));
}

// A plain loop: this file's flags (-O3 and the ISA) vectorise it (subtract, max, convert, divide).
void mean_attention_avx2(const float* score, const int32_t* pos, int n, int32_t next, float* out) {
  for (int j = 0; j < n; ++j) {
    const int32_t seen = std::max<int32_t>(1, next - pos[j]);
    out[j] = score[j] / static_cast<float>(seen);
  }
}

// Eight lanes each keep their smallest value and the last index holding it (<= replaces, so NaN
// never enters; the last, partial block reads NaN past n); the answer is the largest index among
// the lanes holding the overall smallest value, as the scalar running minimum. full(i): the
// eight values at i; part(i, m): the lanes m of the last, partial block.
namespace {

template <class Full, class Part>
int last_min_scan(int n, Full full, Part part) {
  const __m256 nan = _mm256_set1_ps(NAN);
  __m256 vmin = _mm256_set1_ps(INFINITY);
  __m256i vidx = _mm256_set1_epi32(-1);
  __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto update = [&](__m256 x) { lane_update<_CMP_LE_OQ>(x, vmin, vidx, cur); };
  int i = 0;
  for (; i + 8 <= n; i += 8) update(full(i));
  if (i < n) {
    const __m256i m = first_lanes(n - i);
    update(_mm256_blendv_ps(nan, part(i, m), _mm256_castsi256_ps(m)));
  }
  // Lane 0 holds the first value at least (not NaN, <= infinity); lanes never written keep -1.
  const float mn = hmin8(vmin);
  const __m256 at = _mm256_cmp_ps(vmin, _mm256_set1_ps(mn), _CMP_EQ_OQ);
  return hmax8_epi32(_mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(-1)), _mm256_castsi256_ps(vidx), at)));
}

}  // namespace

int last_min_index_avx2(const float* s, int n) {
  if (s[0] != s[0]) return 0;  // NaN s_0: nothing is <= it
  return last_min_scan(
      n, [&](int i) { return _mm256_loadu_ps(s + i); },
      [&](int i, __m256i m) { return _mm256_maskload_ps(s + i, m); });
}

// last_min_index_avx2 over score_j / float(max(1, next - pos_j)), formed in the registers.
int last_min_mean_index_avx2(const float* score, const int32_t* pos, int n, int32_t next) {
  const float m0 = score[0] / static_cast<float>(std::max<int32_t>(1, next - pos[0]));
  if (m0 != m0) return 0;  // NaN mean_0: nothing is <= it
  const __m256i vnext = _mm256_set1_epi32(next), one = _mm256_set1_epi32(1);
  auto mean8 = [&](__m256 s, __m256i p) {
    return _mm256_div_ps(s, _mm256_cvtepi32_ps(_mm256_max_epi32(one, _mm256_sub_epi32(vnext, p))));
  };
  return last_min_scan(
      n,
      [&](int i) {
        return mean8(_mm256_loadu_ps(score + i),
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + i)));
      },
      [&](int i, __m256i m) {
        return mean8(_mm256_maskload_ps(score + i, m), _mm256_maskload_epi32(pos + i, m));
      });
}

namespace {

template <bool kF16>
float row_inv_norm_impl(const RowDots& a, int r) {
  const int d8 = a.dim & ~7;
  const uint8_t* p = a.row(r);
  __m256 n = _mm256_setzero_ps();
  for (int d = 0; d < d8; d += 8) {
    const __m256 x = load8<kF16>(p, d);
    n = _mm256_fmadd_ps(x, x, n);
  }
  // reduce8's tree for one of its eight sums, then the tail's sum added.
  alignas(32) float f[8];
  _mm256_store_ps(f, n);
  float nn = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
  if (d8 < a.dim) {
    float t = 0.0f;
    for (int d = d8; d < a.dim; ++d) {
      const float x = load1<kF16>(p, d);
      t += x * x;
    }
    nn += t;
  }
  return nn > 0.0f ? 1.0f / std::sqrt(std::max(nn, 1e-30f)) : 0.0f;
}

}  // namespace

float row_inv_norm_avx2(const RowDots& a, int r) {
  return a.f16 ? row_inv_norm_impl<true>(a, r) : row_inv_norm_impl<false>(a, r);
}

// Two queries by four rows a block (eight accumulators: sixteen registers in all), each row chunk
// loaded once for both queries. Every dot is the four-row loop's: the same chain of fused
// multiply-adds over the 8-float chunks from zero, and reduce8's tree (the same for each sum).
int row_dots_queries_avx2(const RowDots& a, const float* qs, size_t q_stride, int n_q, float scale,
                          float* dot, size_t ld) {
  const int n4 = a.n & ~3;
  int j = 0;
  for (; j + 2 <= n_q; j += 2) {
    const float* q0 = qs + static_cast<size_t>(j) * q_stride;
    const float* q1 = q0 + q_stride;
    for (int r = 0; r < n4; r += 4) {
      const float* p[4];
      for (int i = 0; i < 4; ++i)
        p[i] = reinterpret_cast<const float*>(a.base + static_cast<size_t>(r + i) * a.row_bytes);
      __m256 a0[4], a1[4];
      for (int i = 0; i < 4; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
      for (int d = 0; d < a.dim; d += 8) {
        const __m256 u = _mm256_loadu_ps(q0 + d), w = _mm256_loadu_ps(q1 + d);
        for (int i = 0; i < 4; ++i) {
          const __m256 x = _mm256_loadu_ps(p[i] + d);
          a0[i] = _mm256_fmadd_ps(u, x, a0[i]);
          a1[i] = _mm256_fmadd_ps(w, x, a1[i]);
        }
      }
      alignas(32) float s[8];
      _mm256_store_ps(s, reduce8(a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]));
      float* o0 = dot + static_cast<size_t>(j) * ld + r;
      float* o1 = o0 + ld;
      for (int t = 0; t < 4; ++t) {
        o0[t] = s[t] * scale;
        o1[t] = s[4 + t] * scale;
      }
    }
  }
  return j;
}

void row_dots_avx2(const RowDots& a) {
  if (a.f16)
    row_dots_impl<true>(a);
  else
    row_dots_impl<false>(a);
}

}  // namespace d2o::simd
