// Portable scalar kernels of the matmul: activation quantisation, the integer micro-tiles of every
// packed format and the fp32 path. They define the arithmetic (matmul_kernels.h) that the SIMD
// levels reproduce bit for bit, and run where neither AVX2 nor AVX-512 is available.
#include <cmath>
#include <cstring>

#include "core/fp16.h"
#include "ops/matmul_kernels.h"
#include "ops/quant.h"

namespace d2o::mm {

namespace {

// round-to-nearest-even, then clamp exactly like max_ps(r, -127) / min_ps(r, 127) (NaN -> -127).
inline int8_t quantize_one(float v, float id) {
  float r = std::nearbyint(v * id);
  r = r > -127.0f ? r : -127.0f;
  r = r < 127.0f ? r : 127.0f;
  return static_cast<int8_t>(static_cast<int>(r));
}

void quantize_scalar(const ActLayout& l, const float* x, uint8_t* rec) {
  auto* qs = reinterpret_cast<int8_t*>(rec);
  auto* d = reinterpret_cast<float*>(rec + l.off_d);
  for (int64_t b = 0; b < l.n_cols / l.block; ++b) {
    const float* xb = x + b * l.block;
    int8_t* qb = qs + b * l.block;
    // amax, and the first element that reaches it (Q8_K keeps its sign).
    float amax = 0.0f, m = 0.0f;
    for (int64_t i = 0; i < l.block; ++i) {
      const float a = std::fabs(xb[i]);
      if (a > amax) {
        amax = a;
        m = xb[i];
      }
    }
    const Q8Scale sc = l.format == ActFormat::kQ8x32 ? q8x32_scale(amax) : q8x256_scale(m);
    d[b] = sc.d;
    for (int64_t i = 0; i < l.block; ++i) qb[i] = quantize_one(xb[i], sc.mul);
    if (l.format == ActFormat::kQ8x32) {
      int32_t s = 0;
      for (int i = 0; i < 32; ++i) s += qb[i];
      act_a_mut<int32_t>(l, rec)[b] = s;
      act_b_mut<float>(l, rec)[b] = q8x32_dsum(amax, s);
    }
  }
  if (l.format == ActFormat::kQ8x256) {
    auto* s32 = act_a_mut<int16_t>(l, rec);
    auto* s16 = act_b_mut<int16_t>(l, rec);
    for (int64_t b = 0; b < l.n_cols / 16; ++b) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += qs[16 * b + i];
      s16[b] = static_cast<int16_t>(s);
    }
    for (int64_t b = 0; b < l.n_cols / 32; ++b) {
      s32[b] = static_cast<int16_t>(s16[2 * b] + s16[2 * b + 1]);
    }
  }
}

inline float half_at(const uint8_t* p, int r) {
  uint16_t h;
  std::memcpy(&h, p + 2 * r, 2);
  return fp16_to_fp32(h);
}

// Byte (r, i) of chunk c of a packed block.
inline uint8_t at(const uint8_t* p, int64_t c, int r, int i) {
  return p[64 * c + 4 * r + i];
}

template <PackKind kKind>
void tile_32(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  const int qs_sec = kKind == PackKind::kQ4_1 ? 2 : 1;
  for (int t = 0; t < job.nt; ++t) {
    const uint8_t* rec = job.act + t * al.stride;
    const int8_t* xq = act_qs(rec);
    const float* dx = act_d(al, rec);
    const int32_t* qsum = act_a<int32_t>(al, rec);
    const float* dsum = act_b<float>(al, rec);
    for (int r = 0; r < job.rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.n_blocks; ++b) {
        const uint8_t* qs = section(w, job.tile, qs_sec, b);
        const int8_t* xb = xq + 32 * b;
        int32_t isum = 0;
        if (kKind == PackKind::kQ8_0) {
          for (int g = 0; g < 8; ++g) {
            for (int i = 0; i < 4; ++i)
              isum += static_cast<int8_t>(at(qs, g, r, i)) * xb[4 * g + i];
          }
        } else {
          // Q5_0: bit g of qh byte (r, i) is bit 4 of element 4g + i.
          const uint8_t* qh = kKind == PackKind::kQ5_0 ? section(w, job.tile, 2, b) : nullptr;
          for (int v = 0; v < 4; ++v) {
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = at(qs, v, r, i);
              int lo = byte & 0x0F, hi = byte >> 4;
              if (kKind == PackKind::kQ5_0) {
                const uint8_t bits = at(qh, 0, r, i);
                lo |= ((bits >> v) & 1) << 4;
                hi |= ((bits >> (v + 4)) & 1) << 4;
              }
              if (kKind == PackKind::kIQ4_NL) {
                lo = kIq4Values[lo];
                hi = kIq4Values[hi];
              }
              isum += lo * xb[4 * v + i] + hi * xb[16 + 4 * v + i];
            }
          }
        }
        const float dw = half_at(section(w, job.tile, 0, b), r);
        if (kKind == PackKind::kQ4_0) isum -= 8 * qsum[b];
        if (kKind == PackKind::kQ5_0) isum -= 16 * qsum[b];
        acc = std::fma(static_cast<float>(isum), dw * dx[b], acc);
        if (kKind == PackKind::kQ4_1)
          acc = std::fma(half_at(section(w, job.tile, 1, b), r), dsum[b], acc);
      }
      job.y[t * job.y_stride + r] = acc;
    }
  }
}

template <PackKind kKind>
void tile_q45_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  constexpr bool kFive = kKind == PackKind::kQ5_K;
  for (int t = 0; t < job.nt; ++t) {
    const uint8_t* rec = job.act + t * al.stride;
    const int8_t* xq = act_qs(rec);
    const float* dx = act_d(al, rec);
    const int16_t* qsum32 = act_a<int16_t>(al, rec);
    for (int r = 0; r < job.rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.n_blocks; ++b) {
        const uint8_t* sc = section(w, job.tile, 2, b);
        const uint8_t* mn = section(w, job.tile, 3, b);
        const uint8_t* qs = section(w, job.tile, 4, b);
        const uint8_t* qh = kFive ? section(w, job.tile, 5, b) : nullptr;
        int32_t total = 0, mins = 0;
        for (int j = 0; j < 8; ++j) {
          const int8_t* xs = xq + 256 * b + 32 * j;
          int32_t isum = 0;
          for (int c = 0; c < 4; ++c) {
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = at(qs + 256 * j, c, r, i);
              int lo = byte & 0x0F, hi = byte >> 4;
              if (kFive) {
                const uint8_t bits = at(qh + 64 * j, 0, r, i);
                lo |= ((bits >> c) & 1) << 4;
                hi |= ((bits >> (c + 4)) & 1) << 4;
              }
              isum += lo * xs[4 * c + i] + hi * xs[16 + 4 * c + i];
            }
          }
          const int pair = 32 * (j / 2) + 2 * r + j % 2;
          total += sc[pair] * isum;
          mins += mn[pair] * qsum32[8 * b + j];
        }
        const float dw = half_at(section(w, job.tile, 0, b), r);
        const float dmin = half_at(section(w, job.tile, 1, b), r);
        acc = std::fma(static_cast<float>(total), dw * dx[b], acc);
        acc = std::fma(-static_cast<float>(mins), dmin * dx[b], acc);
      }
      job.y[t * job.y_stride + r] = acc;
    }
  }
}

void tile_q6_k(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  for (int t = 0; t < job.nt; ++t) {
    const uint8_t* rec = job.act + t * al.stride;
    const int8_t* xq = act_qs(rec);
    const float* dx = act_d(al, rec);
    const int16_t* qsum16 = act_b<int16_t>(al, rec);
    for (int r = 0; r < job.rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.n_blocks; ++b) {
        const auto* sc = reinterpret_cast<const int8_t*>(section(w, job.tile, 1, b));
        const uint8_t* ql = section(w, job.tile, 2, b);
        const uint8_t* qh = section(w, job.tile, 3, b);
        int32_t total = 0, offs = 0;
        for (int j = 0; j < 16; ++j) {
          const int8_t* xs = xq + 256 * b + 16 * j;
          int32_t isum = 0;
          for (int u = 0; u < 4; ++u) {
            for (int i = 0; i < 4; ++i) {
              const int low = (at(ql + 128 * j, u / 2, r, i) >> (4 * (u % 2))) & 0x0F;
              const int high = (at(qh + 64 * j, 0, r, i) >> (2 * u)) & 3;
              isum += (low | (high << 4)) * xs[4 * u + i];
            }
          }
          const int s = sc[32 * (j / 2) + 2 * r + j % 2];
          total += s * isum;
          offs += s * qsum16[16 * b + j];
        }
        const float dw = half_at(section(w, job.tile, 0, b), r);
        acc = std::fma(static_cast<float>(total - 32 * offs), dw * dx[b], acc);
      }
      job.y[t * job.y_stride + r] = acc;
    }
  }
}

void tile_iq4_xs(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  for (int t = 0; t < job.nt; ++t) {
    const uint8_t* rec = job.act + t * al.stride;
    const int8_t* xq = act_qs(rec);
    const float* dx = act_d(al, rec);
    for (int r = 0; r < job.rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.n_blocks; ++b) {
        const auto* sc = reinterpret_cast<const int8_t*>(section(w, job.tile, 1, b));
        const uint8_t* qs = section(w, job.tile, 2, b);
        int32_t total = 0;
        for (int j = 0; j < 8; ++j) {
          const int8_t* xs = xq + 256 * b + 32 * j;
          int32_t isum = 0;
          for (int v = 0; v < 4; ++v) {
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = at(qs + 256 * j, v, r, i);
              isum += kIq4Values[byte & 0x0F] * xs[4 * v + i] +
                      kIq4Values[byte >> 4] * xs[16 + 4 * v + i];
            }
          }
          total += sc[32 * (j / 2) + 2 * r + j % 2] * isum;
        }
        const float dw = half_at(section(w, job.tile, 0, b), r);
        acc = std::fma(static_cast<float>(total), dw * dx[b], acc);
      }
      job.y[t * job.y_stride + r] = acc;
    }
  }
}

// Q3_K (values q + 4) and Q2_K: 16 sub-blocks of 16 per block.
template <PackKind kKind>
void tile_q23_k(const TileJob& job) {
  constexpr bool kThree = kKind == PackKind::kQ3_K;
  const PackedLayout& w = *job.w;
  const ActLayout& al = *job.acts;
  for (int t = 0; t < job.nt; ++t) {
    const uint8_t* rec = job.act + t * al.stride;
    const float* dx = act_d(al, rec);
    const int16_t* qsum16 = act_b<int16_t>(al, rec);
    for (int r = 0; r < job.rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.n_blocks; ++b) {
        const uint8_t* sc = section(w, job.tile, kThree ? 1 : 2, b);
        const uint8_t* mn = section(w, job.tile, kThree ? 1 : 3, b);
        const uint8_t* ql = section(w, job.tile, kThree ? 2 : 4, b);
        const uint8_t* qh = section(w, job.tile, 3, b);  // Q3_K only
        int32_t total = 0, offs = 0;
        for (int j = 0; j < 16; ++j) {
          const int8_t* xs = act_qs(rec) + 256 * b + 16 * j;
          int32_t isum = 0;
          for (int u = 0; u < 4; ++u) {
            for (int i = 0; i < 4; ++i) {
              int q = (at(ql, j, r, i) >> (2 * u)) & 3;
              if (kThree) q |= ((at(qh, j / 2, r, i) >> (4 * (j % 2) + u)) & 1) << 2;
              isum += q * xs[4 * u + i];
            }
          }
          const int pair = 32 * (j / 2) + 2 * r + j % 2;
          const int s = kThree ? static_cast<int8_t>(sc[pair]) : sc[pair];
          total += s * isum;
          offs += (kThree ? s : mn[pair]) * qsum16[16 * b + j];
        }
        const float dw = half_at(section(w, job.tile, 0, b), r);
        if (kThree) {
          acc = std::fma(static_cast<float>(total - 4 * offs), dw * dx[b], acc);
        } else {
          const float dmin = half_at(section(w, job.tile, 1, b), r);
          acc = std::fma(static_cast<float>(total), dw * dx[b], acc);
          acc = std::fma(-static_cast<float>(offs), dmin * dx[b], acc);
        }
      }
      job.y[t * job.y_stride + r] = acc;
    }
  }
}

void tile_bf16(const TileJob& job) {
  const PackedLayout& w = *job.w;
  const uint8_t* sec = job.tile + w.section_offset[0];
  for (int t = 0; t < job.nt; ++t) {
    const auto* x = reinterpret_cast<const float*>(job.act + t * job.acts->stride);
    for (int r = 0; r < job.rows; ++r) {
      float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t b = 0; b < w.n_blocks; ++b) {
        for (int e = 0; e < 2; ++e) {
          uint16_t h;
          std::memcpy(&h, sec + 64 * b + 4 * r + 2 * e, 2);
          float& acc = a[2 * (b % 2) + e];
          acc = std::fma(bf16_to_fp32(h), x[2 * b + e], acc);
        }
      }
      job.y[t * job.y_stride + r] = (a[0] + a[1]) + (a[2] + a[3]);
    }
  }
}

void f32_scalar(const F32Job& job) {
  for (int t = 0; t < job.nt; ++t) {
    const float* x = job.x + t * job.x_stride;
    for (int i = 0; i < job.nr; ++i) {
      const float* w = job.rows[i];
      float s = 0.0f;
      for (int64_t k = 0; k < job.n; ++k) s += w[k] * x[k];
      job.y[t * job.y_stride + i] = s;
    }
  }
}

}  // namespace

void quantize_bf16(const ActLayout& l, const float* x, uint8_t* record) {
  auto* out = reinterpret_cast<float*>(record);
  for (int64_t i = 0; i < l.n_cols; ++i) out[i] = bf16_to_fp32(fp32_to_bf16(x[i]));
}

const KernelTable& kernels_scalar() {
  static const KernelTable table = [] {
    KernelTable t;
    t.quantize[0] = quantize_scalar;
    t.quantize[1] = quantize_scalar;
    t.quantize[2] = quantize_bf16;
    t.tile[static_cast<int>(PackKind::kQ4_0)] = tile_32<PackKind::kQ4_0>;
    t.tile[static_cast<int>(PackKind::kQ4_1)] = tile_32<PackKind::kQ4_1>;
    t.tile[static_cast<int>(PackKind::kQ5_0)] = tile_32<PackKind::kQ5_0>;
    t.tile[static_cast<int>(PackKind::kQ8_0)] = tile_32<PackKind::kQ8_0>;
    t.tile[static_cast<int>(PackKind::kIQ4_NL)] = tile_32<PackKind::kIQ4_NL>;
    t.tile[static_cast<int>(PackKind::kQ4_K)] = tile_q45_k<PackKind::kQ4_K>;
    t.tile[static_cast<int>(PackKind::kQ5_K)] = tile_q45_k<PackKind::kQ5_K>;
    t.tile[static_cast<int>(PackKind::kQ6_K)] = tile_q6_k;
    t.tile[static_cast<int>(PackKind::kIQ4_XS)] = tile_iq4_xs;
    t.tile[static_cast<int>(PackKind::kBF16)] = tile_bf16;
    t.tile[static_cast<int>(PackKind::kQ3_K)] = tile_q23_k<PackKind::kQ3_K>;
    t.tile[static_cast<int>(PackKind::kQ2_K)] = tile_q23_k<PackKind::kQ2_K>;
    t.f32 = f32_scalar;
    return t;
  }();
  return table;
}

}  // namespace d2o::mm
