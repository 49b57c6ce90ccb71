// AVX-512 VNNI kernels of the matmul for the formats in 256-element blocks (Q4_K, Q5_K, Q6_K,
// IQ4_XS, Q3_K, Q2_K) and for BF16 (compiled with AVX-512 F/BW/VL/DQ/VNNI flags). The level's
// other kernels and its kernel table are in matmul_avx512.cpp, which takes these through
// kquant_tiles_avx512() (matmul_kquant.h).
//
// As there, a micro-tile is 16 weight rows (one zmm lane per row) times NT <= 4 tokens, and
// vpdpbusd adds each group of 4 weight bytes times the token's 4 activation bytes into the row's
// lane; sub-block sums are scaled in int32, and the mins (or offsets) enter through vpdpwssd on
// the activations' partial sums. Arithmetic is the one defined in matmul_kernels.h, so results
// equal the scalar kernels bit for bit.
//
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which
// -W(maybe-)uninitialized reports as a false positive once inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "ops/matmul_kernels.h"
#include "ops/matmul_kquant.h"
#include "ops/quant.h"

// Small fixed-count loops over tokens, rows and groups must be unrolled completely so that the
// accumulator arrays live in registers (GCC -O2 would otherwise keep them on the stack).
#define D2O_UNROLL _Pragma("GCC unroll 16")

namespace d2o::mm {

namespace {

#include "ops/matmul_avx512_impl.h"  // helpers shared with matmul_avx512.cpp

// ---- Q4_K, Q5_K ------------------------------------------------------------------------------

template <bool kFive, int NT>
void tile_q45_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i m10 = _mm512_set1_epi8(0x10);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, 2, b);
    const uint8_t* mn = section(w, job.tile, 3, b);
    const uint8_t* qs = section(w, job.tile, 4, b);
    const uint8_t* qh = kFive ? section(w, job.tile, 5, b) : nullptr;
    __m512i total[NT], mins[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = mins[t] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      // Lane r: (scale of sub-block 2p, scale of 2p+1) as two int16; same for the mins.
      const __m512i sc16 = _mm512_cvtepu8_epi16(load32(sc + 32 * p));
      const __m512i mn16 = _mm512_cvtepu8_epi16(load32(mn + 32 * p));
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * p + s;
        const __m512i scale = s == 0 ? _mm512_and_si512(sc16, low16) : _mm512_srli_epi32(sc16, 16);
        const __m512i h = kFive ? load64(qh + 64 * j) : _mm512_setzero_si512();
        __m512i is[NT];
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) is[t] = _mm512_setzero_si512();
        D2O_UNROLL
        for (int c = 0; c < 4; ++c) {
          const __m512i raw = load64(qs + 256 * j + 64 * c);
          __m512i lo = _mm512_and_si512(raw, m4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
          if (kFive) {
            // Bit g of h is bit 4 of group g (lo: g = c, hi: g = c + 4).
            lo = or_and(lo, _mm512_slli_epi16(h, 4 - c), m10);
            hi = or_and(hi, _mm512_srli_epi16(h, c), m10);
          }
          D2O_UNROLL
          for (int t = 0; t < NT; ++t) {
            const int8_t* xs = act_qs(rec[t]) + 256 * b + 32 * j;
            is[t] = _mm512_dpbusd_epi32(is[t], lo, bcast4(xs + 4 * c));
            is[t] = _mm512_dpbusd_epi32(is[t], hi, bcast4(xs + 16 + 4 * c));
          }
        }
        D2O_UNROLL
        for (int t = 0; t < NT; ++t)
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is[t], scale));
      }
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        mins[t] =
            _mm512_dpwssd_epi32(mins[t], mn16, bcast4(act_a<int16_t>(al, rec[t]) + 8 * b + 2 * p));
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    const __m512 dmin = half16(section(w, job.tile, 1, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 dx = _mm512_set1_ps(act_d(al, rec[t])[b]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[t]), _mm512_mul_ps(dw, dx), acc[t]);
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[t]), _mm512_mul_ps(dmin, dx), acc[t]);
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- Q6_K ------------------------------------------------------------------------------------

template <int NT>
void tile_q6_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, 1, b);
    const uint8_t* ql = section(w, job.tile, 2, b);
    const uint8_t* qh = section(w, job.tile, 3, b);
    __m512i total[NT], offs[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
      const __m512i sc16 = _mm512_cvtepi8_epi16(load32(sc + 32 * p));  // signed pairs
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        offs[t] =
            _mm512_dpwssd_epi32(offs[t], sc16, bcast4(act_b<int16_t>(al, rec[t]) + 16 * b + 2 * p));
      }
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * p + s;
        const __m512i scale = s == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16)
                                     : _mm512_srai_epi32(sc16, 16);
        const __m512i l0 = load64(ql + 128 * j), l1 = load64(ql + 128 * j + 64);
        const __m512i h = load64(qh + 64 * j);
        // Group u: low nibble from chunk u / 2 (nibble u % 2), high bits 2u..2u+1 of h.
        __m512i wv[4];
        wv[0] = or_and(_mm512_and_si512(l0, m4), _mm512_slli_epi16(h, 4), m30);
        wv[1] =
            or_and(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_slli_epi16(h, 2), m30);
        wv[2] = or_and(_mm512_and_si512(l1, m4), h, m30);
        wv[3] =
            or_and(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_srli_epi16(h, 2), m30);
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* xs = act_qs(rec[t]) + 256 * b + 16 * j;
          __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(xs));
          is = _mm512_dpbusd_epi32(is, wv[1], bcast4(xs + 4));
          is = _mm512_dpbusd_epi32(is, wv[2], bcast4(xs + 8));
          is = _mm512_dpbusd_epi32(is, wv[3], bcast4(xs + 12));
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is, scale));
        }
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512i tot = _mm512_sub_epi32(total[t], _mm512_slli_epi32(offs[t], 5));
      const __m512 dwdx = _mm512_mul_ps(dw, _mm512_set1_ps(act_d(al, rec[t])[b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), dwdx, acc[t]);
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- IQ4_XS ----------------------------------------------------------------------------------

// Sub-block j of block b: the unsigned table bytes (value + 128) times the token's quants.
template <int NT>
inline void iq4_xs_sub(const uint8_t* qs, const uint8_t* const* rec, int64_t b, int j, __m512i lut,
                       __m512i* is) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) is[t] = _mm512_setzero_si512();
  D2O_UNROLL
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = load64(qs + 256 * j + 64 * c);
    const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, m4));
    const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const int8_t* xs = act_qs(rec[t]) + 256 * b + 32 * j;
      is[t] = _mm512_dpbusd_epi32(is[t], lo, bcast4(xs + 4 * c));
      is[t] = _mm512_dpbusd_epi32(is[t], hi, bcast4(xs + 16 + 4 * c));
    }
  }
}

// The excess 128 * sum(x) of the unsigned bytes is removed once per block, as
// 128 * sum_j sc_j * qsum32_j (vpdpwssd on the scale pairs, like the K formats' mins).
template <int NT>
void tile_iq4_xs(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  const __m512i lut = iq4_lut_u8();
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, 1, b);
    const uint8_t* qs = section(w, job.tile, 2, b);
    __m512i total[NT], offs[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      const __m512i sc16 = _mm512_cvtepi8_epi16(load32(sc + 32 * p));  // signed pairs
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        offs[t] =
            _mm512_dpwssd_epi32(offs[t], sc16, bcast4(act_a<int16_t>(al, rec[t]) + 8 * b + 2 * p));
      }
      for (int s = 0; s < 2; ++s) {
        const __m512i scale = s == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16)
                                     : _mm512_srai_epi32(sc16, 16);
        __m512i is[NT];
        iq4_xs_sub<NT>(qs, rec, b, 2 * p + s, lut, is);
        D2O_UNROLL
        for (int t = 0; t < NT; ++t)
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is[t], scale));
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512i tot = _mm512_sub_epi32(total[t], _mm512_slli_epi32(offs[t], 7));
      const __m512 dwdx = _mm512_mul_ps(dw, _mm512_set1_ps(act_d(al, rec[t])[b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), dwdx, acc[t]);
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- Q3_K, Q2_K ------------------------------------------------------------------------------

// The 4 weight vectors (groups u = 0..3) of sub-block 2p + s: 2 low bits from ql, Q3_K's bit 2
// from bit 4s + u of its qh chunk h.
template <bool kThree>
inline void q23_weights(__m512i wl, __m512i h, int s, __m512i* wv) {
  const __m512i m3 = _mm512_set1_epi8(3), m04 = _mm512_set1_epi8(4);
  D2O_UNROLL
  for (int u = 0; u < 4; ++u) {
    wv[u] = _mm512_and_si512(_mm512_srli_epi16(wl, 2 * u), m3);
    if (kThree) {
      const int shift = 4 * s + u - 2;  // bit 4s + u to bit 2 (within the byte: shift <= 5)
      const __m512i hv = shift >= 0 ? _mm512_srli_epi16(h, shift) : _mm512_slli_epi16(h, -shift);
      wv[u] = or_and(wv[u], hv, m04);
    }
  }
}

template <bool kThree, int NT>
void tile_q23_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const uint8_t* rec[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) rec[t] = job.act + t * al.stride;
  __m512 acc[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.n_blocks; ++b) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const uint8_t* sc = section(w, job.tile, kThree ? 1 : 2, b);
    const uint8_t* mn = section(w, job.tile, kThree ? 1 : 3, b);
    const uint8_t* ql = section(w, job.tile, kThree ? 2 : 4, b);
    __m512i total[NT], offs[NT];
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) total[t] = offs[t] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
      // Lane r: (scale of sub-block 2p, of 2p + 1) as int16; the same for Q2_K's mins.
      const __m512i sc16 = kThree ? _mm512_cvtepi8_epi16(load32(sc + 32 * p))
                                  : _mm512_cvtepu8_epi16(load32(sc + 32 * p));
      const __m512i mn16 = kThree ? sc16 : _mm512_cvtepu8_epi16(load32(mn + 32 * p));
      D2O_UNROLL
      for (int t = 0; t < NT; ++t) {
        offs[t] =
            _mm512_dpwssd_epi32(offs[t], mn16, bcast4(act_b<int16_t>(al, rec[t]) + 16 * b + 2 * p));
      }
      const __m512i h =
          kThree ? load64(section(w, job.tile, 3, b) + 64 * p) : _mm512_setzero_si512();
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * p + s;
        const __m512i scale = s == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16)
                                     : _mm512_srai_epi32(sc16, 16);
        __m512i wv[4];
        q23_weights<kThree>(load64(ql + 64 * j), h, s, wv);
        D2O_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* xs = act_qs(rec[t]) + 256 * b + 16 * j;
          __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(xs));
          is = _mm512_dpbusd_epi32(is, wv[1], bcast4(xs + 4));
          is = _mm512_dpbusd_epi32(is, wv[2], bcast4(xs + 8));
          is = _mm512_dpbusd_epi32(is, wv[3], bcast4(xs + 12));
          total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(is, scale));
        }
      }
    }
    const __m512 dw = half16(section(w, job.tile, 0, b));
    const __m512 dmin = kThree ? _mm512_setzero_ps() : half16(section(w, job.tile, 1, b));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 dx = _mm512_set1_ps(act_d(al, rec[t])[b]);
      if (kThree) {
        const __m512i tot = _mm512_sub_epi32(total[t], _mm512_slli_epi32(offs[t], 2));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(dw, dx), acc[t]);
      } else {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[t]), _mm512_mul_ps(dw, dx), acc[t]);
        acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(offs[t]), _mm512_mul_ps(dmin, dx), acc[t]);
      }
    }
  }
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) store_rows(job, t, acc[t]);
}

// ---- BF16 ------------------------------------------------------------------------------------

// One 64-byte load holds a pair of elements of each of the 16 rows; a shift (element 2b) and a
// mask (element 2b + 1) make them fp32. Blocks alternate between two pairs of accumulators.
template <int NT>
void tile_bf16(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const uint8_t* sec = job.tile + w.section_offset[0];
  const float* x[NT];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t)
    x[t] = reinterpret_cast<const float*>(job.act + t * job.acts->stride);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a[NT][4];
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) D2O_UNROLL
  for (int c = 0; c < 4; ++c) a[t][c] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int c) {
    if (NT == 1) prefetch_ahead(w, job.tile, b);
    const __m512i v = load64(sec + 64 * b);
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    D2O_UNROLL
    for (int t = 0; t < NT; ++t) {
      a[t][c] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[t][2 * b]), a[t][c]);
      a[t][c + 1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[t][2 * b + 1]), a[t][c + 1]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= w.n_blocks; b += 2) {
    step(b, 0);
    step(b + 1, 2);
  }
  if (b < w.n_blocks) step(b, 0);
  D2O_UNROLL
  for (int t = 0; t < NT; ++t) {
    store_rows(job, t,
               _mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
  }
}

#include "ops/matmul_kquant_impl.h"  // the dispatch glue and make_kquant_tiles

}  // namespace

KQuantTiles kquant_tiles_avx512() {
  return make_kquant_tiles();
}

}  // namespace d2o::mm
