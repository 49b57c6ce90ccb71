// Reference quantisation of rows into Q8_0 / Q4_0 blocks (see ops/quant.h): the KV cache stores
// slots in these formats, bit for bit the reference's rounding. Q8_0 rounds without the library
// call, and eight values at a time on AVX2 (a cold tier quantises every slot a turn's compaction
// evicts).
#include <cmath>
#include <algorithm>

#include "core/assert.h"
#include "core/fp16.h"
#include "ops/quant.h"
#include "ops/quant_simd.h"

namespace d2o {

namespace {

// std::round (half away from zero) of v, |v| < 128, without the library call: the truncation
// toward zero, then one step away from zero where the remainder (exact: v and the truncation are
// within one of each other and below 2^7) is at least a half. The same integer for every such v
// (quant_avx2.cpp does the same eight at a time).
inline int8_t round_q8(float v) {
  const int t = static_cast<int>(v);
  const float f = v - static_cast<float>(t);
  return static_cast<int8_t>(t + (f >= 0.5f) - (f <= -0.5f));
}

}  // namespace

void quantize_row_q8_0_isa(KernelIsa isa, const float* x, BlockQ8_0* y, int64_t n) {
  D2O_ASSERT(kernel_isa_available(isa));
  D2O_ASSERT(n % kQK == 0);
  if (isa < KernelIsa::kAvx2) {
    quantize_q8_0_blocks(x, y, n);
    return;
  }
  while (n > 0) {
    const int64_t done = simd::quantize_row_q8_0_avx2(x, y, n);
    x += done * kQK;
    y += done;
    n -= done * kQK;
    if (n == 0) return;
    quantize_q8_0_blocks(x, y, kQK);  // a block holding a NaN or an infinity
    x += kQK;
    y += 1;
    n -= kQK;
  }
}

void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t n) {
  quantize_row_q8_0_isa(best_kernel_isa(), x, y, n);
}

void quantize_q8_0_blocks(const float* x, BlockQ8_0* y, int64_t n) {
  D2O_ASSERT(n % kQK == 0);
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    // |x * id| <= 127 (it rounds to at most amax * (1 / (amax / 127))) for finite rows; a row
    // with a NaN or an infinity takes the library's rounding, as it always did.
    bool finite = true;
    for (int j = 0; j < kQK; ++j) finite &= std::fabs(x[j] * id) < 128.0f;
    if (finite) {
      for (int j = 0; j < kQK; ++j) y[i].qs[j] = round_q8(x[j] * id);
    } else {
      for (int j = 0; j < kQK; ++j) y[i].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
    }
  }
}

void quantize_row_q4_0(const float* x, BlockQ4_0* y, int64_t n) {
  D2O_ASSERT(n % kQK == 0);
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    // x * id lies in [-8, 8]: the sum is in [0.5, 16.5], so the truncation fits a nibble after
    // the clamp.
    auto q = [&](float v) {
      const float x0 = v * id;
      return std::min(15, static_cast<int>(x0 + 8.5f));
    };
    for (int j = 0; j < kQK / 2; ++j) {
      y[i].qs[j] = static_cast<uint8_t>(q(x[j]) | (q(x[j + kQK / 2]) << 4));
    }
  }
}

void quantize_row(GgmlType type, const float* x, void* y, int64_t n) {
  switch (type) {
    case GgmlType::kQ8_0: return quantize_row_q8_0(x, static_cast<BlockQ8_0*>(y), n);
    case GgmlType::kQ4_0: return quantize_row_q4_0(x, static_cast<BlockQ4_0*>(y), n);
    default: D2O_ASSERT(false && "quantize_row: Q8_0 or Q4_0 only");
  }
}

}  // namespace d2o
