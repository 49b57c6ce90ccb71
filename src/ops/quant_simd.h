// Internal: the SIMD variants of the row (de)quantisers in src/ops/quant.h.
//
// Each returns false when it does not handle `type`, so the dispatcher falls back to a lower
// level. They may only be called when kernel_isa_available() says so for their level.
#pragma once

#include <cstdint>

#include "ops/ggml_type.h"
#include "ops/quant.h"

namespace d2o::simd {

bool dequantize_row_avx2(GgmlType type, const void* src, float* dst, int64_t n);
bool dequantize_row_avx512(GgmlType type, const void* src, float* dst, int64_t n);

// Q8_0 blocks of quantize_row_q8_0 (n a multiple of 32), byte for byte; a block holding a NaN
// or an infinity is left to the caller's scalar loop: returns the first such block's index, or
// n / 32 when every block was done.
int64_t quantize_row_q8_0_avx2(const float* x, BlockQ8_0* y, int64_t n);

void fp32_to_fp16_row_avx2(const float* src, uint16_t* dst, int64_t n);
void fp16_to_fp32_row_avx2(const uint16_t* src, float* dst, int64_t n);
void fp16_axpy_row_avx2(float* acc, const void* x, float w, int64_t n);
void fp32_to_fp16_row_avx512(const float* src, uint16_t* dst, int64_t n);
void fp16_to_fp32_row_avx512(const uint16_t* src, float* dst, int64_t n);

}  // namespace d2o::simd
