// Internal: the interface between the matmul driver (matmul.cpp) and its kernels, one table per
// instruction-set level (matmul_scalar.cpp, matmul_avx2.cpp, matmul_avx512.cpp; the SIMD levels'
// tiles of the formats in 256-element blocks and of BF16 in matmul_kquant_avx2.cpp and
// matmul_kquant_avx512.cpp).
//
// Activation quantisation reproduces llama.cpp's (ggml-cpu on x86) bit for bit, so that d2o's
// products carry the same rounding as llama.cpp's and logits stay close to its logits:
//   Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL weights: per 32 elements (block_q8_0 / block_q8_1):
//     amax = max |x|, q = round-to-nearest-even(x * (127 / amax)) (0 when amax = 0),
//     dx = fp16(amax / 127); for Q4_1 also s = fp16(amax / 127 * sum(q))
//   Q2_K .. Q6_K, IQ4_XS weights: per 256 elements (block_q8_K): m = the first element of
//     largest |x|, iscale = -127 / m, q = min(127, round-to-nearest-even(iscale * x)),
//     dx = 1 / iscale (q = 0, dx = 0 when all are 0), with sums of q per 16 and per 32 elements.
//   BF16 weights: each activation rounded to bf16 (nearest-even, as llama.cpp's BF16 dot
//     product takes them), kept as float.
// (fp16(v) = v rounded to half precision and back, unless it would overflow; q is also clamped at
// -127, which only ever changes NaN inputs.)
//
// Per-block float arithmetic of the integer kernels (isum = exact integer dot of the block's
// stored integers with q; dw, mw, dmin = the weight's fp16 fields as float; dx = d above):
//   Q4_0  acc = fma(float(isum_u4 - 8 * qsum), dw * dx, acc)          (isum over 0..15 nibbles)
//   Q4_1  acc = fma(float(isum_u4), dw * dx, acc); acc = fma(mw, s, acc)
//   Q5_0  acc = fma(float(isum_u5 - 16 * qsum), dw * dx, acc)        (isum over 0..31 values)
//   Q8_0  acc = fma(float(isum_s8), dw * dx, acc)
//   IQ4_NL acc = fma(float(isum_nl), dw * dx, acc)         (isum over the values kIq4Values[q])
//   Q4_K, Q5_K (per 256): I = sum_j sc_j * isum_j, M = sum_j mn_j * qsum32_j,
//         acc = fma(float(I), dw * dx, acc); acc = fma(-float(M), dmin * dx, acc)
//   Q6_K  (per 256): I = sum_j sc_j * isum_u6_j, M = sum_j sc_j * qsum16_j,
//         acc = fma(float(I - 32 * M), dw * dx, acc)
//   Q3_K  (per 256): as Q6_K with the stored values q + 4 (0..7): acc = fma(float(I - 4 * M), ...)
//   Q2_K  (per 256): I = sum_j sc_j * isum_u2_j, M = sum_j mn_j * qsum16_j (16 sub-blocks),
//         acc = fma(float(I), dw * dx, acc); acc = fma(-float(M), dmin * dx, acc)
//   IQ4_XS (per 256): I = sum_j sc_j * isum_nl_j (sc_j = scale - 32, isum_nl_j over the values
//         kIq4Values[q] of sub-block j), acc = fma(float(I), dw * dx, acc)
//   BF16  four accumulators per row: element 2b + e (pair b, e = 0 or 1) goes to
//         a[2 * (b % 2) + e] = fma(w, x, a[...]); y = (a0 + a1) + (a2 + a3)
// Every level does exactly this per (row, token), so all levels agree bit for bit.
#pragma once

#include <cstdint>

#include "core/fp16.h"
#include "ops/matmul_pack.h"

namespace d2o::mm {

inline constexpr int kMaxTokens = 4;  // tokens per micro-tile

enum class ActFormat { kQ8x32 = 0, kQ8x256 = 1, kBf16 = 2 };

// Per-block quantisation parameters (computed in scalar code by every level, so they agree).
struct Q8Scale {
  float mul = 0;  // q = round(x * mul)
  float d = 0;    // x ~ q * d
};
// llama.cpp stores these block scales as fp16. Values beyond the fp16 range (|v| >= 65520, where
// llama.cpp would get Inf, e.g. a Q8_1 sum over a block with activations in the thousands) are
// kept in fp32 instead.
inline float round_to_half(float v) {
  return (v < 65520.0f && v > -65520.0f) ? fp16_to_fp32(fp32_to_fp16(v)) : v;
}
// Q8_0 / Q8_1 block of 32 with max |x| = amax.
inline Q8Scale q8x32_scale(float amax) {
  return {amax != 0.0f ? 127.0f / amax : 0.0f, round_to_half(amax / 127.0f)};
}
// The s field of a Q8_1 block: fp16(amax / 127 * sum(q)).
inline float q8x32_dsum(float amax, int32_t qsum) {
  return round_to_half(amax / 127.0f * static_cast<float>(qsum));
}
// Q8_K block of 256 whose first element of largest magnitude is m (0 when all are 0).
inline Q8Scale q8x256_scale(float m) {
  if (m == 0.0f) return {0.0f, 0.0f};
  const float iscale = -127.0f / m;
  return {iscale, 1.0f / iscale};
}

// One token's quantised activations are a record of `stride` bytes:
//   qs int8[n_cols] at 0, d float[n_cols / block] at off_d,
//   kQ8x32:  qsum int32[n_cols / 32] at off_a, dsum float[n_cols / 32] (Q8_1's s) at off_b
//   kQ8x256: qsum32 int16[n_cols / 32] at off_a, qsum16 int16[n_cols / 16] at off_b
//   kBf16:   float[n_cols] (bf16 values) at 0, nothing else
struct ActLayout {
  ActFormat format = ActFormat::kQ8x32;
  int64_t n_cols = 0;
  int64_t block = 32;
  int64_t off_d = 0, off_a = 0, off_b = 0;
  int64_t stride = 0;  // multiple of 64
};
ActLayout make_act_layout(ActFormat format, int64_t n_cols);
ActFormat act_format_for(PackKind kind);

// One micro-tile: a tile of 16 weight rows times nt consecutive tokens.
struct TileJob {
  const PackedLayout* w = nullptr;
  const uint8_t* tile = nullptr;  // start of the tile's bytes
  const ActLayout* acts = nullptr;
  const uint8_t* act = nullptr;  // record of the first token; token k at act + k * stride
  int nt = 1;                    // 1..kMaxTokens
  int rows = kTileRows;          // valid rows of the tile (the rest is padding)
  float* y = nullptr;            // y of the first token and the tile's first row
  int64_t y_stride = 0;          // floats between tokens (n_rows)
};

// fp32 path: nr (1..4) weight rows times nt (1..4) tokens of n elements.
struct F32Job {
  const float* rows[4] = {};
  int nr = 1;
  const float* x = nullptr;  // first token; token k at x + k * x_stride
  int64_t x_stride = 0;
  int nt = 1;
  int64_t n = 0;
  float* y = nullptr;  // y[k * y_stride + i] for token k, row i
  int64_t y_stride = 0;
};

using QuantizeFn = void (*)(const ActLayout& l, const float* x, uint8_t* record);
using TileFn = void (*)(const TileJob& job);
using F32Fn = void (*)(const F32Job& job);

struct KernelTable {
  QuantizeFn quantize[3] = {};   // by ActFormat
  TileFn tile[kPackKinds] = {};  // by PackKind (kRaw unused)
  F32Fn f32 = nullptr;
};

// The kBf16 records, for every level (matmul_scalar.cpp): rounding is exact integer work.
void quantize_bf16(const ActLayout& l, const float* x, uint8_t* record);

const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();

// Record accessors.
inline const int8_t* act_qs(const uint8_t* rec) {
  return reinterpret_cast<const int8_t*>(rec);
}
inline const float* act_d(const ActLayout& l, const uint8_t* rec) {
  return reinterpret_cast<const float*>(rec + l.off_d);
}
template <class T>
inline const T* act_a(const ActLayout& l, const uint8_t* rec) {
  return reinterpret_cast<const T*>(rec + l.off_a);
}
template <class T>
inline const T* act_b(const ActLayout& l, const uint8_t* rec) {
  return reinterpret_cast<const T*>(rec + l.off_b);
}

// Decode streams every weight once from DRAM. Each section of a tile is a separate short stream
// that the hardware prefetcher barely ramps up on, so while a matvec works on block b of one tile
// it asks for block b of every section kPrefetchTiles tiles ahead, into L2 (measured on Zen 4:
// two tiles ahead into L2 beat one tile, four tiles, and L1 prefetches).
inline constexpr int kPrefetchTiles = 2;
inline void prefetch_ahead(const PackedLayout& w, const uint8_t* tile, int64_t b) {
  const uint8_t* next = tile + kPrefetchTiles * w.tile_bytes;
  for (int s = 0; s < w.n_sections; ++s) {
    const uint8_t* p = next + w.section_offset[s] + b * w.section_bytes[s];
    for (int64_t off = 0; off < w.section_bytes[s]; off += 64) __builtin_prefetch(p + off, 0, 2);
  }
}

template <class T>
inline T* act_a_mut(const ActLayout& l, uint8_t* rec) {
  return reinterpret_cast<T*>(rec + l.off_a);
}
template <class T>
inline T* act_b_mut(const ActLayout& l, uint8_t* rec) {
  return reinterpret_cast<T*>(rec + l.off_b);
}

// Pointer to block b of section s of a tile.
inline const uint8_t* section(const PackedLayout& w, const uint8_t* tile, int s, int64_t b) {
  return tile + w.section_offset[s] + b * w.section_bytes[s];
}

}  // namespace d2o::mm
