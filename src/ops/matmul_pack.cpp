// Repacking of GGUF blocks into the row-interleaved tile layouts of matmul_pack.h, and back.
//
// Both directions go through the block's plain values (scales and small integers per element),
// so the packed layout is free to order things for the kernels. Runs once at load time.
#include "ops/matmul_pack.h"

#include <cstddef>
#include <cstring>
#include <initializer_list>

#include "core/assert.h"
#include "ops/quant.h"

namespace d2o::mm {

namespace {

constexpr int64_t align64(int64_t v) {
  return (v + 63) / 64 * 64;
}

// Byte (r, i) of 64-byte chunk `chunk` of a section block: rows interleaved in 4-byte groups.
inline int64_t lane(int64_t chunk, int r, int i) {
  return 64 * chunk + 4 * r + i;
}

struct Sections {
  uint8_t* s[kMaxSections];
};
// Pointers to block b's bytes of every section of the tile at `tile_base`.
template <class Ptr>
void section_ptrs(const PackedLayout& l, Ptr tile_base, int64_t b, Ptr* out) {
  for (int s = 0; s < l.n_sections; ++s) {
    out[s] = tile_base + l.section_offset[s] + b * l.section_bytes[s];
  }
}

// Plain values of one K-format block (the fp16 fields stay raw bits).
struct KValues {
  uint16_t d = 0, dmin = 0;
  uint8_t sc[16] = {};  // Q4_K/Q5_K: 8 scales, Q6_K: 16 int8 scales (as bytes)
  uint8_t mn[16] = {};  // Q4_K/Q5_K: 8 mins, Q2_K: 16
  uint8_t q[kQKK] = {};  // element values: 4, 5 or 6 bits
};

void read_q45_k(const uint8_t* blk, bool five, KValues* v) {
  std::memcpy(&v->d, blk, 2);
  std::memcpy(&v->dmin, blk + 2, 2);
  const uint8_t* scales = blk + 4;
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (five ? 48 : 16);
  for (int j = 0; j < 8; ++j) get_scale_min_k4(j, scales, &v->sc[j], &v->mn[j]);
  for (int e = 0; e < kQKK; ++e) {
    int q = (qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0x0F;
    if (five) q |= ((qh[e % 32] >> (e / 32)) & 1) << 4;
    v->q[e] = static_cast<uint8_t>(q);
  }
}

void write_q45_k(const KValues& v, bool five, uint8_t* blk) {
  std::memcpy(blk, &v.d, 2);
  std::memcpy(blk + 2, &v.dmin, 2);
  pack_scale_min_k4(v.sc, v.mn, blk + 4);
  uint8_t* qh = blk + 16;
  uint8_t* qs = blk + (five ? 48 : 16);
  if (five) std::memset(qh, 0, 32);
  for (int g = 0; g < 4; ++g) {
    for (int l = 0; l < 32; ++l) {
      qs[32 * g + l] =
          static_cast<uint8_t>((v.q[64 * g + l] & 0x0F) | ((v.q[64 * g + 32 + l] & 0x0F) << 4));
    }
  }
  if (five) {
    for (int e = 0; e < kQKK; ++e)
      qh[e % 32] = static_cast<uint8_t>(qh[e % 32] | ((v.q[e] >> 4) << (e / 32)));
  }
}

void read_q6_k(const uint8_t* blk, KValues* v) {
  const auto* x = reinterpret_cast<const BlockQ6_K*>(blk);
  std::memcpy(&v->d, blk + offsetof(BlockQ6_K, d), 2);
  std::memcpy(v->sc, x->scales, 16);
  for (int e = 0; e < kQKK; ++e) {
    const int g = e / 128, r = e % 128;
    const int low = (x->ql[64 * g + r % 64] >> (4 * (r / 64))) & 0x0F;
    const int high = (x->qh[32 * g + r % 32] >> (2 * (r / 32))) & 3;
    v->q[e] = static_cast<uint8_t>(low | (high << 4));
  }
}

void write_q6_k(const KValues& v, uint8_t* blk) {
  auto* x = reinterpret_cast<BlockQ6_K*>(blk);
  std::memset(blk, 0, sizeof(BlockQ6_K));
  std::memcpy(blk + offsetof(BlockQ6_K, d), &v.d, 2);
  std::memcpy(x->scales, v.sc, 16);
  for (int e = 0; e < kQKK; ++e) {
    const int g = e / 128, r = e % 128;
    x->ql[64 * g + r % 64] =
        static_cast<uint8_t>(x->ql[64 * g + r % 64] | ((v.q[e] & 0x0F) << (4 * (r / 64))));
    x->qh[32 * g + r % 32] =
        static_cast<uint8_t>(x->qh[32 * g + r % 32] | ((v.q[e] >> 4) << (2 * (r / 32))));
  }
}

// Q3_K / Q2_K: element e = 128g + 32s + l has its low 2 bits at (qs[32g + l] >> 2s) & 3; Q3_K's
// bit 2 (hmask bit e / 32 of byte e % 32) is set when the value is not lowered by 4, so q + 4 =
// low | bit << 2.
void read_q23_k(const uint8_t* blk, bool three, KValues* v) {
  const uint8_t* qs = blk + (three ? 32 : 16);
  for (int e = 0; e < kQKK; ++e) {
    int q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
    if (three) q |= ((blk[e % 32] >> (e / 32)) & 1) << 2;
    v->q[e] = static_cast<uint8_t>(q);
  }
  if (three) {
    std::memcpy(&v->d, blk + offsetof(BlockQ3_K, d), 2);
    unpack_scales_q3_k(blk + offsetof(BlockQ3_K, scales), reinterpret_cast<int8_t*>(v->sc));
    return;
  }
  std::memcpy(&v->d, blk + offsetof(BlockQ2_K, d), 2);
  std::memcpy(&v->dmin, blk + offsetof(BlockQ2_K, dmin), 2);
  for (int j = 0; j < 16; ++j) {
    v->sc[j] = blk[j] & 0x0F;
    v->mn[j] = blk[j] >> 4;
  }
}

void write_q23_k(const KValues& v, bool three, uint8_t* blk) {
  std::memset(blk, 0, three ? sizeof(BlockQ3_K) : sizeof(BlockQ2_K));
  uint8_t* qs = blk + (three ? 32 : 16);
  for (int e = 0; e < kQKK; ++e) {
    const int at = 32 * (e / 128) + e % 32;
    qs[at] = static_cast<uint8_t>(qs[at] | ((v.q[e] & 3) << (2 * ((e % 128) / 32))));
    if (three) blk[e % 32] = static_cast<uint8_t>(blk[e % 32] | ((v.q[e] >> 2) << (e / 32)));
  }
  if (three) {
    std::memcpy(blk + offsetof(BlockQ3_K, d), &v.d, 2);
    uint8_t* packed = blk + offsetof(BlockQ3_K, scales);
    for (int j = 0; j < 16; ++j) {  // the inverse of unpack_scales_q3_k
      const int biased = static_cast<int8_t>(v.sc[j]) + 32;
      packed[j % 8] = static_cast<uint8_t>(packed[j % 8] | ((biased & 0x0F) << (4 * (j / 8))));
      packed[8 + j % 4] =
          static_cast<uint8_t>(packed[8 + j % 4] | ((biased >> 4) << (2 * (j / 4))));
    }
    return;
  }
  std::memcpy(blk + offsetof(BlockQ2_K, d), &v.d, 2);
  std::memcpy(blk + offsetof(BlockQ2_K, dmin), &v.dmin, 2);
  for (int j = 0; j < 16; ++j) blk[j] = static_cast<uint8_t>(v.sc[j] | (v.mn[j] << 4));
}

// Packed <-> plain values of Q3_K / Q2_K (sections as documented in matmul_pack.h).
void pack_q23_k(const PackedLayout& l, const KValues& v, uint8_t* const* s, int r) {
  const bool three = l.kind == PackKind::kQ3_K;
  std::memcpy(s[0] + 2 * r, &v.d, 2);
  if (!three) std::memcpy(s[1] + 2 * r, &v.dmin, 2);
  uint8_t* sc = s[three ? 1 : 2];
  uint8_t* ql = s[three ? 2 : 4];
  for (int j = 0; j < 16; ++j) {
    sc[32 * (j / 2) + 2 * r + j % 2] = v.sc[j];
    if (!three) s[3][32 * (j / 2) + 2 * r + j % 2] = v.mn[j];
    for (int i = 0; i < 4; ++i) {
      uint8_t low = 0, high = 0;
      for (int u = 0; u < 4; ++u) {
        const uint8_t q = v.q[16 * j + 4 * u + i];
        low = static_cast<uint8_t>(low | ((q & 3) << (2 * u)));
        high = static_cast<uint8_t>(high | ((q >> 2) << (4 * (j % 2) + u)));
      }
      ql[lane(j, r, i)] = low;
      if (three) s[3][lane(j / 2, r, i)] = static_cast<uint8_t>(s[3][lane(j / 2, r, i)] | high);
    }
  }
}

void unpack_q23_k(const PackedLayout& l, const uint8_t* const* s, int r, KValues* v) {
  const bool three = l.kind == PackKind::kQ3_K;
  std::memcpy(&v->d, s[0] + 2 * r, 2);
  if (!three) std::memcpy(&v->dmin, s[1] + 2 * r, 2);
  const uint8_t* sc = s[three ? 1 : 2];
  const uint8_t* ql = s[three ? 2 : 4];
  for (int j = 0; j < 16; ++j) {
    v->sc[j] = sc[32 * (j / 2) + 2 * r + j % 2];
    if (!three) v->mn[j] = s[3][32 * (j / 2) + 2 * r + j % 2];
    for (int i = 0; i < 4; ++i) {
      for (int u = 0; u < 4; ++u) {
        int q = (ql[lane(j, r, i)] >> (2 * u)) & 3;
        if (three) q |= ((s[3][lane(j / 2, r, i)] >> (4 * (j % 2) + u)) & 1) << 2;
        v->q[16 * j + 4 * u + i] = static_cast<uint8_t>(q);
      }
    }
  }
}

// Packed <-> plain values of the K formats (sections as documented in matmul_pack.h).
template <class Ptr>
void k_sections(const PackedLayout& l, Ptr tile_base, int64_t b, Ptr* s) {
  section_ptrs(l, tile_base, b, s);
}

void pack_k(const PackedLayout& l, const KValues& v, uint8_t* tile_base, int r, int64_t b) {
  uint8_t* s[kMaxSections];
  k_sections(l, tile_base, b, s);
  if (l.kind == PackKind::kQ6_K) {
    std::memcpy(s[0] + 2 * r, &v.d, 2);
    for (int j = 0; j < 16; ++j) s[1][32 * (j / 2) + 2 * r + j % 2] = v.sc[j];
    for (int j = 0; j < 16; ++j) {
      for (int a = 0; a < 2; ++a) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t lo = v.q[16 * j + 8 * a + i] & 0x0F,
                        hi = v.q[16 * j + 8 * a + 4 + i] & 0x0F;
          s[2][128 * j + lane(a, r, i)] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
      for (int i = 0; i < 4; ++i) {
        uint8_t bits = 0;
        for (int u = 0; u < 4; ++u)
          bits = static_cast<uint8_t>(bits | ((v.q[16 * j + 4 * u + i] >> 4) << (2 * u)));
        s[3][lane(j, r, i)] = bits;
      }
    }
    return;
  }
  const bool five = l.kind == PackKind::kQ5_K;
  std::memcpy(s[0] + 2 * r, &v.d, 2);
  std::memcpy(s[1] + 2 * r, &v.dmin, 2);
  for (int j = 0; j < 8; ++j) {
    s[2][32 * (j / 2) + 2 * r + j % 2] = v.sc[j];
    s[3][32 * (j / 2) + 2 * r + j % 2] = v.mn[j];
  }
  for (int j = 0; j < 8; ++j) {
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t lo = v.q[32 * j + 4 * c + i] & 0x0F, hi = v.q[32 * j + 16 + 4 * c + i] & 0x0F;
        s[4][256 * j + lane(c, r, i)] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
    if (five) {
      for (int i = 0; i < 4; ++i) {
        uint8_t bits = 0;
        for (int g = 0; g < 8; ++g)
          bits = static_cast<uint8_t>(bits | ((v.q[32 * j + 4 * g + i] >> 4) << g));
        s[5][lane(j, r, i)] = bits;
      }
    }
  }
}

void unpack_k(const PackedLayout& l, const uint8_t* tile_base, int r, int64_t b, KValues* v) {
  const uint8_t* s[kMaxSections];
  k_sections(l, tile_base, b, s);
  if (l.kind == PackKind::kQ6_K) {
    std::memcpy(&v->d, s[0] + 2 * r, 2);
    for (int j = 0; j < 16; ++j) v->sc[j] = s[1][32 * (j / 2) + 2 * r + j % 2];
    for (int j = 0; j < 16; ++j) {
      for (int a = 0; a < 2; ++a) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = s[2][128 * j + lane(a, r, i)];
          v->q[16 * j + 8 * a + i] = byte & 0x0F;
          v->q[16 * j + 8 * a + 4 + i] = byte >> 4;
        }
      }
      for (int i = 0; i < 4; ++i) {
        const uint8_t bits = s[3][lane(j, r, i)];
        for (int u = 0; u < 4; ++u) {
          v->q[16 * j + 4 * u + i] =
              static_cast<uint8_t>(v->q[16 * j + 4 * u + i] | (((bits >> (2 * u)) & 3) << 4));
        }
      }
    }
    return;
  }
  const bool five = l.kind == PackKind::kQ5_K;
  std::memcpy(&v->d, s[0] + 2 * r, 2);
  std::memcpy(&v->dmin, s[1] + 2 * r, 2);
  for (int j = 0; j < 8; ++j) {
    v->sc[j] = s[2][32 * (j / 2) + 2 * r + j % 2];
    v->mn[j] = s[3][32 * (j / 2) + 2 * r + j % 2];
  }
  for (int j = 0; j < 8; ++j) {
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = s[4][256 * j + lane(c, r, i)];
        v->q[32 * j + 4 * c + i] = byte & 0x0F;
        v->q[32 * j + 16 + 4 * c + i] = byte >> 4;
      }
    }
    if (five) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t bits = s[5][lane(j, r, i)];
        for (int g = 0; g < 8; ++g) {
          v->q[32 * j + 4 * g + i] =
              static_cast<uint8_t>(v->q[32 * j + 4 * g + i] | (((bits >> g) & 1) << 4));
        }
      }
    }
  }
}

// IQ4_XS: d, the 8 sub-block scales (unbiased, int8 pairs as Q6_K's) and each sub-block's 16
// bytes of nibbles as an IQ4_NL block's.
void pack_iq4_xs(const uint8_t* src, uint8_t* const* s, int r) {
  BlockIQ4_XS x;
  std::memcpy(&x, src, sizeof x);
  std::memcpy(s[0] + 2 * r, &x.d, 2);
  for (int j = 0; j < 8; ++j) {
    s[1][32 * (j / 2) + 2 * r + j % 2] = static_cast<uint8_t>(iq4_xs_scale(x, j));
    for (int v = 0; v < 4; ++v)
      std::memcpy(s[2] + 256 * j + lane(v, r, 0), x.qs + 16 * j + 4 * v, 4);
  }
}

void unpack_iq4_xs(const uint8_t* const* s, int r, uint8_t* dst) {
  BlockIQ4_XS x{};
  std::memcpy(&x.d, s[0] + 2 * r, 2);
  for (int j = 0; j < 8; ++j) {
    const int ls = static_cast<int8_t>(s[1][32 * (j / 2) + 2 * r + j % 2]) + 32;
    x.scales_l[j / 2] = static_cast<uint8_t>(x.scales_l[j / 2] | ((ls & 0x0F) << (4 * (j % 2))));
    x.scales_h = static_cast<uint16_t>(x.scales_h | ((ls >> 4) << (2 * j)));
    for (int v = 0; v < 4; ++v)
      std::memcpy(x.qs + 16 * j + 4 * v, s[2] + 256 * j + lane(v, r, 0), 4);
  }
  std::memcpy(dst, &x, sizeof x);
}

}  // namespace

PackKind pack_kind_for(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
      return PackKind::kQ4_0;
    case GgmlType::kQ4_1:
      return PackKind::kQ4_1;
    case GgmlType::kQ5_0:
      return PackKind::kQ5_0;
    case GgmlType::kQ8_0:
      return PackKind::kQ8_0;
    case GgmlType::kQ4_K:
      return PackKind::kQ4_K;
    case GgmlType::kQ5_K:
      return PackKind::kQ5_K;
    case GgmlType::kQ6_K:
      return PackKind::kQ6_K;
    case GgmlType::kIQ4_NL:
      return PackKind::kIQ4_NL;
    case GgmlType::kIQ4_XS:
      return PackKind::kIQ4_XS;
    case GgmlType::kBF16:
      return PackKind::kBF16;
    case GgmlType::kQ3_K:
      return PackKind::kQ3_K;
    case GgmlType::kQ2_K:
      return PackKind::kQ2_K;
    default:
      return PackKind::kRaw;
  }
}

PackedLayout make_packed_layout(GgmlType type, int64_t n_rows, int64_t n_cols) {
  PackedLayout l;
  l.kind = pack_kind_for(type);
  l.block_elems = ggml_block_size(type);
  if (l.kind == PackKind::kBF16) {  // packed in pairs of elements
    if (n_cols % 2 == 0) {
      l.block_elems = 2;
    } else {
      l.kind = PackKind::kRaw;
    }
  }
  D2O_ASSERT(n_cols % l.block_elems == 0);
  l.n_blocks = n_cols / l.block_elems;
  l.n_tiles = (n_rows + kTileRows - 1) / kTileRows;
  auto set = [&l](std::initializer_list<int64_t> sizes) {
    for (int64_t s : sizes) l.section_bytes[l.n_sections++] = s;
  };
  switch (l.kind) {
    case PackKind::kRaw:
      return l;
    case PackKind::kQ4_0:
    case PackKind::kIQ4_NL:
      set({32, 256});
      break;
    case PackKind::kQ4_1:
      set({32, 32, 256});
      break;
    case PackKind::kQ5_0:
      set({32, 256, 64});
      break;
    case PackKind::kQ8_0:
      set({32, 512});
      break;
    case PackKind::kQ4_K:
      set({32, 32, 128, 128, 2048});
      break;
    case PackKind::kQ5_K:
      set({32, 32, 128, 128, 2048, 512});
      break;
    case PackKind::kQ6_K:
      set({32, 256, 2048, 1024});
      break;
    case PackKind::kIQ4_XS:
      set({32, 128, 2048});
      break;
    case PackKind::kBF16:
      set({64});
      break;
    case PackKind::kQ3_K:
      set({32, 256, 1024, 512});
      break;
    case PackKind::kQ2_K:
      set({32, 32, 256, 256, 1024});
      break;
  }
  int64_t off = 0;
  for (int s = 0; s < l.n_sections; ++s) {
    l.section_offset[s] = off;
    off = align64(off + l.n_blocks * l.section_bytes[s]);
  }
  l.tile_bytes = off;
  return l;
}

void pack_block(const PackedLayout& l, const uint8_t* src, uint8_t* tile_base, int r, int64_t b) {
  D2O_ASSERT(r >= 0 && r < kTileRows && b >= 0 && b < l.n_blocks);
  uint8_t* s[kMaxSections];
  section_ptrs(l, tile_base, b, s);
  switch (l.kind) {
    case PackKind::kQ4_0:  // d, qs[16]: chunk v = bytes 4v..4v+3 of qs
    case PackKind::kIQ4_NL:
      std::memcpy(s[0] + 2 * r, src, 2);
      for (int v = 0; v < 4; ++v) std::memcpy(s[1] + lane(v, r, 0), src + 2 + 4 * v, 4);
      return;
    case PackKind::kQ4_1:
      std::memcpy(s[0] + 2 * r, src, 2);
      std::memcpy(s[1] + 2 * r, src + 2, 2);
      for (int v = 0; v < 4; ++v) std::memcpy(s[2] + lane(v, r, 0), src + 4 + 4 * v, 4);
      return;
    case PackKind::kQ5_0: {  // d, qh[4], qs[16]
      std::memcpy(s[0] + 2 * r, src, 2);
      for (int v = 0; v < 4; ++v) std::memcpy(s[1] + lane(v, r, 0), src + 6 + 4 * v, 4);
      uint32_t qh;
      std::memcpy(&qh, src + 2, 4);
      for (int i = 0; i < 4; ++i) {
        uint8_t bits = 0;
        for (int g = 0; g < 8; ++g)
          bits = static_cast<uint8_t>(bits | (((qh >> (4 * g + i)) & 1u) << g));
        s[2][lane(0, r, i)] = bits;
      }
      return;
    }
    case PackKind::kQ8_0:
      std::memcpy(s[0] + 2 * r, src, 2);
      for (int g = 0; g < 8; ++g) std::memcpy(s[1] + lane(g, r, 0), src + 2 + 4 * g, 4);
      return;
    case PackKind::kQ4_K:
    case PackKind::kQ5_K: {
      KValues v;
      read_q45_k(src, l.kind == PackKind::kQ5_K, &v);
      pack_k(l, v, tile_base, r, b);
      return;
    }
    case PackKind::kQ6_K: {
      KValues v;
      read_q6_k(src, &v);
      pack_k(l, v, tile_base, r, b);
      return;
    }
    case PackKind::kIQ4_XS:
      return pack_iq4_xs(src, s, r);
    case PackKind::kBF16:
      std::memcpy(s[0] + 4 * r, src, 4);
      return;
    case PackKind::kQ3_K:
    case PackKind::kQ2_K: {
      KValues v;
      read_q23_k(src, l.kind == PackKind::kQ3_K, &v);
      pack_q23_k(l, v, s, r);
      return;
    }
    case PackKind::kRaw:
      D2O_ASSERT(false);
  }
}

void unpack_block(const PackedLayout& l, const uint8_t* tile_base, int r, int64_t b, uint8_t* dst) {
  D2O_ASSERT(r >= 0 && r < kTileRows && b >= 0 && b < l.n_blocks);
  const uint8_t* s[kMaxSections];
  section_ptrs(l, tile_base, b, s);
  switch (l.kind) {
    case PackKind::kQ4_0:
    case PackKind::kIQ4_NL:
      std::memcpy(dst, s[0] + 2 * r, 2);
      for (int v = 0; v < 4; ++v) std::memcpy(dst + 2 + 4 * v, s[1] + lane(v, r, 0), 4);
      return;
    case PackKind::kQ4_1:
      std::memcpy(dst, s[0] + 2 * r, 2);
      std::memcpy(dst + 2, s[1] + 2 * r, 2);
      for (int v = 0; v < 4; ++v) std::memcpy(dst + 4 + 4 * v, s[2] + lane(v, r, 0), 4);
      return;
    case PackKind::kQ5_0: {
      std::memcpy(dst, s[0] + 2 * r, 2);
      for (int v = 0; v < 4; ++v) std::memcpy(dst + 6 + 4 * v, s[1] + lane(v, r, 0), 4);
      uint32_t qh = 0;
      for (int i = 0; i < 4; ++i) {
        const uint8_t bits = s[2][lane(0, r, i)];
        for (int g = 0; g < 8; ++g) qh |= static_cast<uint32_t>((bits >> g) & 1) << (4 * g + i);
      }
      std::memcpy(dst + 2, &qh, 4);
      return;
    }
    case PackKind::kQ8_0:
      std::memcpy(dst, s[0] + 2 * r, 2);
      for (int g = 0; g < 8; ++g) std::memcpy(dst + 2 + 4 * g, s[1] + lane(g, r, 0), 4);
      return;
    case PackKind::kQ4_K:
    case PackKind::kQ5_K: {
      KValues v;
      unpack_k(l, tile_base, r, b, &v);
      write_q45_k(v, l.kind == PackKind::kQ5_K, dst);
      return;
    }
    case PackKind::kQ6_K: {
      KValues v;
      unpack_k(l, tile_base, r, b, &v);
      write_q6_k(v, dst);
      return;
    }
    case PackKind::kIQ4_XS:
      return unpack_iq4_xs(s, r, dst);
    case PackKind::kBF16:
      std::memcpy(dst, s[0] + 4 * r, 4);
      return;
    case PackKind::kQ3_K:
    case PackKind::kQ2_K: {
      KValues v;
      unpack_q23_k(l, s, r, &v);
      write_q23_k(v, l.kind == PackKind::kQ3_K, dst);
      return;
    }
    case PackKind::kRaw:
      D2O_ASSERT(false);
  }
}

}  // namespace d2o::mm
