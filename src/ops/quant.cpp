// Scalar reference dequantisation of every supported GGUF type, and the dispatch to SIMD variants.
//
// The float operations follow the reference implementations exactly (same products, same order,
// no fused multiply-add): Q4_1 is d*q + m, K-formats compute the sub-block scale d*sc first and
// then (d*sc)*q - dmin*m. This is what makes results bit-identical to other GGUF tools.
#include "ops/quant.h"

#include <cstring>

#include "core/assert.h"
#include "core/fp16.h"
#include "ops/quant_simd.h"

namespace d2o {

namespace {

template <class Block>
const Block* blocks_of(const void* src) {
  return static_cast<const Block*>(src);
}

void dequant_q4_0(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ4_0>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * static_cast<float>((x[i].qs[j] & 0x0F) - 8);
      y[j + kQK / 2] = d * static_cast<float>((x[i].qs[j] >> 4) - 8);
    }
  }
}

void dequant_q4_1(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ4_1>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    const float m = fp16_to_fp32(x[i].m);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * static_cast<float>(x[i].qs[j] & 0x0F) + m;
      y[j + kQK / 2] = d * static_cast<float>(x[i].qs[j] >> 4) + m;
    }
  }
}

void dequant_q5_0(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ5_0>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    uint32_t qh;
    std::memcpy(&qh, x[i].qh, 4);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (x[i].qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (x[i].qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo - 16);
      y[j + kQK / 2] = d * static_cast<float>(hi - 16);
    }
  }
}

void dequant_q5_1(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ5_1>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    const float m = fp16_to_fp32(x[i].m);
    uint32_t qh;
    std::memcpy(&qh, x[i].qh, 4);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (x[i].qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (x[i].qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo) + m;
      y[j + kQK / 2] = d * static_cast<float>(hi) + m;
    }
  }
}

void dequant_q8_0(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ8_0>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(x[i].qs[j]) * d;
  }
}

void dequant_q2_k(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ2_K>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = fp16_to_fp32(x[i].d);
    const float dmin = fp16_to_fp32(x[i].dmin);
    for (int e = 0; e < kQKK; ++e) {
      const int g = e / 128, s = (e % 128) / 32, l = e % 32;
      const int q = (x[i].qs[32 * g + l] >> (2 * s)) & 3;
      const uint8_t sc = x[i].scales[e / 16];
      const float dl = d * static_cast<float>(sc & 0x0F);
      const float ml = dmin * static_cast<float>(sc >> 4);
      y[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

void dequant_q3_k(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ3_K>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = fp16_to_fp32(x[i].d);
    int8_t scales[16];
    unpack_scales_q3_k(x[i].scales, scales);
    for (int e = 0; e < kQKK; ++e) {
      const int g = e / 128, s = (e % 128) / 32, l = e % 32;
      const int low = (x[i].qs[32 * g + l] >> (2 * s)) & 3;
      const int high = (x[i].hmask[l] >> (e / 32)) & 1;
      const int q = low - (high ? 0 : 4);
      const float dl = d * static_cast<float>(scales[e / 16]);
      y[e] = dl * static_cast<float>(q);
    }
  }
}

void dequant_q4_k(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ4_K>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = fp16_to_fp32(x[i].d);
    const float dmin = fp16_to_fp32(x[i].dmin);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      get_scale_min_k4(j, x[i].scales, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* qs = x[i].qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        y[32 * j + l] = dl * static_cast<float>((qs[l] >> shift) & 0x0F) - ml;
      }
    }
  }
}

void dequant_q5_k(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ5_K>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = fp16_to_fp32(x[i].d);
    const float dmin = fp16_to_fp32(x[i].dmin);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      get_scale_min_k4(j, x[i].scales, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* qs = x[i].qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[l] >> shift) & 0x0F) | (((x[i].qh[l] >> j) & 1) << 4);
        y[32 * j + l] = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

void dequant_q6_k(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockQ6_K>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int e = 0; e < kQKK; ++e) {
      const int g = e / 128, r = e % 128;
      const int low = (x[i].ql[64 * g + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int high = (x[i].qh[32 * g + r % 32] >> (2 * (r / 32))) & 3;
      const float dl = d * static_cast<float>(x[i].scales[e / 16]);
      y[e] = dl * static_cast<float>((low | (high << 4)) - 32);
    }
  }
}

// y = d * value for IQ4_NL; IQ4_XS first forms each sub-block's d * (scale - 32).
void dequant_iq4_nl(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockIQ4_NL>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * static_cast<float>(kIq4Values[x[i].qs[j] & 0x0F]);
      y[j + kQK / 2] = d * static_cast<float>(kIq4Values[x[i].qs[j] >> 4]);
    }
  }
}

void dequant_iq4_xs(const void* src, float* y, int64_t nb) {
  const auto* x = blocks_of<BlockIQ4_XS>(src);
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(iq4_xs_scale(x[i], j));
      const uint8_t* qs = x[i].qs + 16 * j;
      for (int l = 0; l < 16; ++l) {
        y[32 * j + l] = dl * static_cast<float>(kIq4Values[qs[l] & 0x0F]);
        y[32 * j + 16 + l] = dl * static_cast<float>(kIq4Values[qs[l] >> 4]);
      }
    }
  }
}

}  // namespace

void pack_scale_min_k4(const uint8_t sc[8], const uint8_t m[8], uint8_t q[12]) {
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4));
  }
}

void unpack_scales_q3_k(const uint8_t packed[12], int8_t scales[16]) {
  // Scale j: low 4 bits from byte j % 8 (nibble j / 8), high 2 bits from byte 8 + j % 4 (bits
  // 2 * (j / 4)); stored biased by 32.
  for (int j = 0; j < 16; ++j) {
    const int low = (packed[j % 8] >> (4 * (j / 8))) & 0x0F;
    const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
    scales[j] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

bool dequantize_supported(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
    case GgmlType::kIQ4_NL:
    case GgmlType::kIQ4_XS:
      return true;
    default:
      return false;
  }
}

void dequantize_row_ref(GgmlType type, const void* src, float* dst, int64_t n) {
  D2O_ASSERT(dequantize_supported(type));
  D2O_ASSERT(n >= 0 && n % ggml_block_size(type) == 0);
  const int64_t nb = n / ggml_block_size(type);
  switch (type) {
    case GgmlType::kF32:
      if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case GgmlType::kF16: {
      const auto* h = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, h + 2 * i, 2);
        dst[i] = fp16_to_fp32(v);
      }
      return;
    }
    case GgmlType::kBF16: {
      const auto* h = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, h + 2 * i, 2);
        dst[i] = bf16_to_fp32(v);
      }
      return;
    }
    case GgmlType::kQ4_0:
      return dequant_q4_0(src, dst, nb);
    case GgmlType::kQ4_1:
      return dequant_q4_1(src, dst, nb);
    case GgmlType::kQ5_0:
      return dequant_q5_0(src, dst, nb);
    case GgmlType::kQ5_1:
      return dequant_q5_1(src, dst, nb);
    case GgmlType::kQ8_0:
      return dequant_q8_0(src, dst, nb);
    case GgmlType::kQ2_K:
      return dequant_q2_k(src, dst, nb);
    case GgmlType::kQ3_K:
      return dequant_q3_k(src, dst, nb);
    case GgmlType::kQ4_K:
      return dequant_q4_k(src, dst, nb);
    case GgmlType::kQ5_K:
      return dequant_q5_k(src, dst, nb);
    case GgmlType::kQ6_K:
      return dequant_q6_k(src, dst, nb);
    case GgmlType::kIQ4_NL:
      return dequant_iq4_nl(src, dst, nb);
    case GgmlType::kIQ4_XS:
      return dequant_iq4_xs(src, dst, nb);
    default:
      D2O_ASSERT(false);
  }
}

void dequantize_row_isa(KernelIsa isa, GgmlType type, const void* src, float* dst, int64_t n) {
  D2O_ASSERT(kernel_isa_available(isa));
  D2O_ASSERT(dequantize_supported(type));
  D2O_ASSERT(n >= 0 && n % ggml_block_size(type) == 0);
  if (isa == KernelIsa::kAvx512 && simd::dequantize_row_avx512(type, src, dst, n)) return;
  if (isa >= KernelIsa::kAvx2 && simd::dequantize_row_avx2(type, src, dst, n)) return;
  dequantize_row_ref(type, src, dst, n);
}

void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  dequantize_row_isa(best_kernel_isa(), type, src, dst, n);
}

void fp32_to_fp16_row_isa(KernelIsa isa, const float* src, uint16_t* dst, int64_t n) {
  D2O_ASSERT(kernel_isa_available(isa));
  switch (isa) {
    case KernelIsa::kAvx512:
      return simd::fp32_to_fp16_row_avx512(src, dst, n);
    case KernelIsa::kAvx2:
      return simd::fp32_to_fp16_row_avx2(src, dst, n);
    case KernelIsa::kScalar:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
      return;
  }
}

void fp16_to_fp32_row_isa(KernelIsa isa, const uint16_t* src, float* dst, int64_t n) {
  D2O_ASSERT(kernel_isa_available(isa));
  switch (isa) {
    case KernelIsa::kAvx512:
      return simd::fp16_to_fp32_row_avx512(src, dst, n);
    case KernelIsa::kAvx2:
      return simd::fp16_to_fp32_row_avx2(src, dst, n);
    case KernelIsa::kScalar:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
      return;
  }
}

void fp16_axpy_row_isa(KernelIsa isa, float* acc, const void* x, float w, int64_t n) {
  D2O_ASSERT(kernel_isa_available(isa));
  if (isa != KernelIsa::kScalar) return simd::fp16_axpy_row_avx2(acc, x, w, n);
  const auto* p = static_cast<const uint8_t*>(x);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof h);
    const float prod = w * fp16_to_fp32(h);
    acc[i] = acc[i] + prod;
  }
}

void fp16_axpy_row(float* acc, const void* x, float w, int64_t n) {
  fp16_axpy_row_isa(best_kernel_isa(), acc, x, w, n);
}

void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n) {
  fp32_to_fp16_row_isa(best_kernel_isa(), src, dst, n);
}

void fp16_to_fp32_row(const uint16_t* src, float* dst, int64_t n) {
  fp16_to_fp32_row_isa(best_kernel_isa(), src, dst, n);
}

}  // namespace d2o
