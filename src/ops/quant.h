// Block layouts of the GGUF quantisation formats, and (de)quantisation of rows.
//
// The structs below spell out the byte layout of one block of each format as GGUF files store it
// (little-endian, packed, fp16 scales stored as raw uint16 bits). Element order inside a block:
//   Q4_0/Q4_1  qs[j] low nibble = element j, high nibble = element j + 16           (32 elements)
//   Q5_0/Q5_1  as Q4_x for the low 4 bits; bit j of qh (little-endian u32) = bit 4 of element j
//   Q8_0       qs[j] = element j
//   Q2_K       element 128g + 32s + l = (qs[32g + l] >> 2s) & 3, sub-block (16 elements) = e / 16
//   Q3_K       low 2 bits as Q2_K; bit (e / 32) of hmask[e % 32] clear means "subtract 4"
//   Q4_K       element 64g + 32s + l = (qs[32g + l] >> 4s) & 15, sub-block (32 elements) = e / 32
//   Q5_K       low 4 bits as Q4_K; bit (e / 32) of qh[e % 32] = bit 4
//   Q6_K       low 4 bits of e = 128g + 64s + l: (ql[64g + l] >> 4s) & 15; high 2 bits of
//              e = 128g + 32s + l: (qh[32g + l] >> 2s) & 3; value - 32; sub-block = e / 16
//   IQ4_NL     nibbles as Q4_0, each an index into the 16 non-linear values kIq4Values
//   IQ4_XS     sub-block j (32 elements) = qs[16j..16j+15] laid out as an IQ4_NL block, with
//              the 6-bit scale (scales_l nibble j | bits 2j..2j+1 of scales_h << 4) - 32
// Dequantised values are computed with exactly the float32 operations (and operation order) of
// the reference implementations, so that results match other GGUF tools bit for bit.
#pragma once

#include <cstdint>

#include "ops/ggml_type.h"
#include "ops/kernel_isa.h"

namespace d2o {

inline constexpr int kQK = 32;    // elements per block of the 32-element formats
inline constexpr int kQKK = 256;  // elements per super-block of the K formats

struct BlockQ4_0 {
  uint16_t d;  // fp16 scale
  uint8_t qs[kQK / 2];
};
struct BlockQ4_1 {
  uint16_t d;  // fp16 scale
  uint16_t m;  // fp16 minimum (added)
  uint8_t qs[kQK / 2];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];  // bit 4 of each element
  uint8_t qs[kQK / 2];
};
struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQK];
};
struct BlockIQ4_NL {
  uint16_t d;  // fp16 scale
  uint8_t qs[kQK / 2];
};
struct BlockIQ4_XS {
  uint16_t d;                   // fp16 super-block scale
  uint16_t scales_h;            // high 2 bits of the 8 sub-block scales
  uint8_t scales_l[kQKK / 64];  // low 4 bits, two sub-blocks per byte
  uint8_t qs[kQKK / 2];
};
// The 16 values an IQ4_NL / IQ4_XS nibble selects (a fact of the format), before scaling.
inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};
// The 6-bit scale of sub-block j (0..7) of an IQ4_XS block, unbiased (-32..31).
inline int iq4_xs_scale(const BlockIQ4_XS& x, int j) {
  const int low = (x.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
  const int high = (x.scales_h >> (2 * j)) & 3;
  return (low | (high << 4)) - 32;
}
struct BlockQ2_K {
  uint8_t scales[kQKK / 16];  // low nibble: scale, high nibble: min, per 16 elements
  uint8_t qs[kQKK / 4];
  uint16_t d;
  uint16_t dmin;
};
struct BlockQ3_K {
  uint8_t hmask[kQKK / 8];
  uint8_t qs[kQKK / 4];
  uint8_t scales[12];  // 16 6-bit scales, biased by 32
  uint16_t d;
};
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];  // 8 6-bit scales and 8 6-bit mins
  uint8_t qs[kQKK / 2];
};
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[kQKK / 8];
  uint8_t qs[kQKK / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  uint16_t d;
};

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockIQ4_NL) == 18);
static_assert(sizeof(BlockIQ4_XS) == 136);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's packed `scales`.
inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}
// Inverse of get_scale_min_k4: packs 8 scales and 8 mins (each < 64) into 12 bytes.
void pack_scale_min_k4(const uint8_t sc[8], const uint8_t m[8], uint8_t q[12]);

// The 6-bit scales of a Q3_K block, unbiased (-32..31).
void unpack_scales_q3_k(const uint8_t packed[12], int8_t scales[16]);

// Dequantises n elements (n a multiple of the type's block size) of `type` from src into dst.
// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_NL, IQ4_XS.
// Uses the fastest available path; results are bit-identical to dequantize_row_ref.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);
void dequantize_row_ref(GgmlType type, const void* src, float* dst, int64_t n);  // scalar
bool dequantize_supported(GgmlType type);

// Quantises n floats (n a multiple of 32) into Q8_0 / Q4_0 blocks with the float operations of
// the reference quantisers (ggml's quantize_row_q8_0_ref / q4_0_ref and the `gguf` PyPI
// package's gguf.quants.quantize), so the blocks are bit-identical to theirs:
//   Q8_0  d = max|x| / 127, q = round-half-away(x * (1 / d))                  (1 / d = 0 if d = 0)
//   Q4_0  m = the x of largest |x| (the first of equals), d = m / -8,
//         q = min(15, trunc(x * (1 / d) + 8.5)), the product and the sum each rounded to float
//         (no fused multiply-add: the build has -ffp-contract=off).
void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t n);
void quantize_row_q4_0(const float* x, BlockQ4_0* y, int64_t n);
// The same for `type` (Q8_0 or Q4_0 only).
void quantize_row(GgmlType type, const float* x, void* y, int64_t n);

// F32 <-> F16 bulk conversion (F16C where available), used by the KV cache. Rounding is to
// nearest-even; results equal fp32_to_fp16 / fp16_to_fp32 of src/core/fp16.h for every non-NaN
// value (NaNs stay NaN).
void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n);
void fp16_to_fp32_row(const uint16_t* src, float* dst, int64_t n);
// acc[i] = acc[i] + w * fp16_to_fp32(x[i]) for i < n: a product, then a sum, each rounded (no
// fused multiply-add), so every level gives the bits of that loop. x: F16 values at any address.
void fp16_axpy_row(float* acc, const void* x, float w, int64_t n);

// The same at a given instruction-set level (which must be available; a level that has no
// variant of its own for `type` uses the next lower one). For tests and benchmarks.
void dequantize_row_isa(KernelIsa isa, GgmlType type, const void* src, float* dst, int64_t n);
void fp32_to_fp16_row_isa(KernelIsa isa, const float* src, uint16_t* dst, int64_t n);
void fp16_to_fp32_row_isa(KernelIsa isa, const uint16_t* src, float* dst, int64_t n);
void fp16_axpy_row_isa(KernelIsa isa, float* acc, const void* x, float w, int64_t n);
void quantize_row_q8_0_isa(KernelIsa isa, const float* x, BlockQ8_0* y, int64_t n);
// quantize_row_q8_0's scalar loop (every level's blocks equal its bytes).
void quantize_q8_0_blocks(const float* x, BlockQ8_0* y, int64_t n);

}  // namespace d2o
