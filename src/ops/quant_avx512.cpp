// AVX-512 fp16 row conversions and the half-precision dequantisers (16 elements per instruction,
// masked tails). The block formats use the AVX2 decoders: their cost is in the integer decode,
// which AVX-512 does not shorten much, and they run only off the hot path (embedding rows, the
// fp32 fallback of rarely used types).
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which
// -W(maybe-)uninitialized reports as a false positive once inlined; nothing here reads undefined
// lanes.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "ops/quant.h"
#include "ops/quant_simd.h"

namespace d2o::simd {

namespace {
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}
}  // namespace

void fp16_to_fp32_row_avx512(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m256i h = _mm256_maskz_loadu_epi16(k, src + i);
    _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(h));
  }
}

void fp32_to_fp16_row_avx512(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_mask_storeu_epi16(dst + i, k, h);
  }
}

bool dequantize_row_avx512(GgmlType type, const void* src, float* dst, int64_t n) {
  const auto* h = static_cast<const uint8_t*>(src);
  switch (type) {
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m256i v = _mm256_maskz_loadu_epi16(k, h + 2 * i);
        _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(v));
      }
      return true;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m256i v = _mm256_maskz_loadu_epi16(k, h + 2 * i);
        const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16);
        _mm512_mask_storeu_ps(dst + i, k, _mm512_castsi512_ps(w));
      }
      return true;
    default:
      return false;
  }
}

}  // namespace d2o::simd
