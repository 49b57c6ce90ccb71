// Internal: how QMatrix stores a weight matrix for the integer kernels ("packed" layouts).
//
// Rows are grouped in tiles of kTileRows = 16 (the last tile padded with zero rows). Inside a
// tile, each section (scales, quants, ...) holds every block of the row range contiguously:
//   tile = [section 0: n_blocks x section_bytes[0]] [section 1: ...] ...   (each 64-byte aligned)
// and within one block of one section the 16 rows are interleaved in 4-byte groups, so that one
// 64-byte vector holds "4 consecutive elements of each of the 16 rows". A VNNI dot product
// (vpdpbusd) of that vector with 4 activation bytes broadcast to all lanes then yields one
// partial sum per row in each 32-bit lane: no horizontal reductions anywhere.
//
// Group g of a 32-element block means elements 4g..4g+3 of that block; "row r, byte i" below is
// byte 4r + i of a 64-byte chunk. Layouts per type (per block of one tile):
//   Q4_0  d[16] fp16 | qs: chunk v (0..3): low nibble = element 4v+i, high = element 16+4v+i
//   Q4_1  d[16] fp16 | m[16] fp16 | qs as Q4_0
//   Q5_0  d[16] fp16 | qs as Q4_0 (low 4 bits) | qh: bit g of row r byte i = bit 4 of element
//         4g+i (one chunk: g 0..3 complete the low nibbles of qs chunk g, 4..7 the high ones)
//   Q8_0  d[16] fp16 | qs: chunk g (0..7): int8 element 4g+i
//   Q4_K  d[16] | dmin[16] | sc[4 pairs][16 rows][2] u8 | mn (same) | qs: sub-block j (0..7),
//         chunk v: low nibble = element 32j+4v+i, high nibble = element 32j+16+4v+i
//   Q5_K  as Q4_K, then qh: sub-block j: bit g of row r byte i = bit 4 of element 32j+4g+i
//   Q6_K  d[16] | sc[8 pairs][16 rows][2] int8 | ql: sub-block j (0..15), chunk a (0..1):
//         low nibble = element 16j+8a+i, high = 16j+8a+4+i (low 4 bits) | qh: sub-block j:
//         bits 2u..2u+1 of row r byte i = high 2 bits of element 16j+4u+i
//   IQ4_NL as Q4_0 (the nibbles index kIq4Values of ops/quant.h)
//   IQ4_XS d[16] | sc[4 pairs][16 rows][2] int8 (scale - 32) | qs: sub-block j (0..7), chunk
//         v: low nibble = element 32j+4v+i, high nibble = element 32j+16+4v+i (as IQ4_NL)
//   Q3_K  d[16] | sc[8 pairs][16 rows][2] int8 | ql: sub-block j (0..15): bits 2u..2u+1 of row
//         r byte i = low 2 bits of element 16j+4u+i | qh: sub-blocks 2p, 2p+1: bit 4s+u of row r
//         byte i = bit 2 of element 16(2p+s)+4u+i, the stored value being q + 4 (0..7)
//   Q2_K  d[16] | dmin[16] | sc[8 pairs][16 rows][2] u8 | mn (same) | ql as Q3_K (the values)
//   BF16  blocks of 2 elements (rows of odd length stay raw): bytes 4r..4r+3 of the block's 64
//         = row r's elements 2b, 2b+1 as raw bf16
// Every other type is stored as its GGUF rows unchanged ("raw") and multiplied through fp32.
#pragma once

#include <cstdint>

#include "ops/ggml_type.h"

namespace d2o::mm {

inline constexpr int kTileRows = 16;
inline constexpr int kMaxSections = 6;

enum class PackKind {
  kRaw,
  kQ4_0,
  kQ4_1,
  kQ5_0,
  kQ8_0,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  kIQ4_NL,
  kIQ4_XS,
  kBF16,
  kQ3_K,
  kQ2_K
};
inline constexpr int kPackKinds = static_cast<int>(PackKind::kQ2_K) + 1;

struct PackedLayout {
  PackKind kind = PackKind::kRaw;
  int64_t block_elems = 1;  // elements per block (32 or 256; 2 for BF16; 1 for raw types)
  int64_t n_blocks = 0;     // blocks per row
  int n_sections = 0;
  int64_t section_bytes[kMaxSections] = {};   // bytes of one block of one tile
  int64_t section_offset[kMaxSections] = {};  // from the tile start, 64-byte aligned
  int64_t tile_bytes = 0;                     // multiple of 64
  int64_t n_tiles = 0;
};

// The packed kind for a GGUF type (kRaw when the type goes through the fp32 path).
PackKind pack_kind_for(GgmlType type);
// Layout of an [n_rows, n_cols] matrix of `type` (n_cols a multiple of the block size).
PackedLayout make_packed_layout(GgmlType type, int64_t n_rows, int64_t n_cols);

// Copies GGUF block `b` of row `r` (within tile `tile`, which starts at `tile_base`) in / out of
// the packed layout. `gguf_block` has the GGUF block size of the type.
void pack_block(const PackedLayout& l, const uint8_t* gguf_block, uint8_t* tile_base, int r,
                int64_t b);
void unpack_block(const PackedLayout& l, const uint8_t* tile_base, int r, int64_t b,
                  uint8_t* gguf_block);

}  // namespace d2o::mm
