#include "kv/policy/similarity.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/assert.h"
#include "core/fp16.h"
#include "ops/quant.h"

namespace d2o {

namespace {

// Rows may sit at any byte address (tests use odd strides): elements are read with memcpy.
float element(const uint8_t* p, int d, bool f16) {
  if (f16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * static_cast<size_t>(d), 2);
    return fp16_to_fp32(h);
  }
  float x;
  std::memcpy(&x, p + 4 * static_cast<size_t>(d), 4);
  return x;
}

void row_dots_scalar(const RowDots& a) {
  for (int r = 0; r < a.n; ++r) {
    const uint8_t* p = a.row(r);
    float dot = 0.0f, nn = 0.0f;
    for (int d = 0; d < a.dim; ++d) {
      const float x = element(p, d, a.f16);
      dot += a.q[d] * x;
      if (a.inv_norm) nn += x * x;
    }
    a.dot[r] = dot;
    if (a.inv_norm) a.inv_norm[r] = nn > 0.0f ? 1.0f / std::sqrt(nn) : 0.0f;
  }
}

}  // namespace

namespace {

int scaled_argmax_scalar(const float* dot, const float* inv, int n, float f, float* best) {
  int b = 0;
  float bs = 0.0f + f * dot[0] * inv[0];
  for (int i = 1; i < n; ++i) {
    const float s = 0.0f + f * dot[i] * inv[i];
    if (s > bs) {
      bs = s;
      b = i;
    }
  }
  *best = bs;
  return b;
}

// The *_at functions dispatch to a level without checking that it is available (the public entry
// points check a level they are given; best_kernel_isa() is available by construction).
int scaled_argmax_at(KernelIsa isa, const float* dot, const float* inv, int n, float f,
                     float* best) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return simd::scaled_argmax_avx512(dot, inv, n, f, best);
    case KernelIsa::kAvx2:
      return simd::scaled_argmax_avx2(dot, inv, n, f, best);
    case KernelIsa::kScalar:
      break;
  }
  return scaled_argmax_scalar(dot, inv, n, f, best);
}

}  // namespace

int scaled_argmax_isa(KernelIsa isa, const float* dot, const float* inv, int n, float f,
                      float* best) {
  D2O_ASSERT(kernel_isa_available(isa) && n >= 1);
  return scaled_argmax_at(isa, dot, inv, n, f, best);
}

int scaled_argmax(const float* dot, const float* inv, int n, float f, float* best) {
  D2O_ASSERT(n >= 1);
  return scaled_argmax_at(best_kernel_isa(), dot, inv, n, f, best);
}

namespace {

int last_min_index_scalar(const float* s, int n) {
  int b = 0;
  float bs = s[0];
  for (int j = 1; j < n; ++j) {
    if (s[j] <= bs) {
      bs = s[j];
      b = j;
    }
  }
  return b;
}

int last_min_index_at(KernelIsa isa, const float* s, int n) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return simd::last_min_index_avx512(s, n);
    case KernelIsa::kAvx2:
      return simd::last_min_index_avx2(s, n);
    case KernelIsa::kScalar:
      break;
  }
  return last_min_index_scalar(s, n);
}

}  // namespace

int last_min_index_isa(KernelIsa isa, const float* s, int n) {
  D2O_ASSERT(kernel_isa_available(isa) && n >= 1);
  return last_min_index_at(isa, s, n);
}

int last_min_index(const float* s, int n) {
  D2O_ASSERT(n >= 1);
  return last_min_index_at(best_kernel_isa(), s, n);
}

namespace {

void mean_attention_at(KernelIsa isa, const float* score, const int32_t* pos, int n, int64_t next,
                       float* out) {
  // The vector variants count in 32 bits (the same integers, so the same floats and quotients).
  if (next >= 0 && next <= INT32_MAX) {
    switch (isa) {
      case KernelIsa::kAvx512:
        return simd::mean_attention_avx512(score, pos, n, static_cast<int32_t>(next), out);
      case KernelIsa::kAvx2:
        return simd::mean_attention_avx2(score, pos, n, static_cast<int32_t>(next), out);
      case KernelIsa::kScalar:
        break;
    }
  }
  for (int j = 0; j < n; ++j) {
    const int64_t seen = std::max<int64_t>(1, next - pos[j]);
    out[j] = score[j] / static_cast<float>(seen);
  }
}

}  // namespace

void mean_attention_isa(KernelIsa isa, const float* score, const int32_t* pos, int n, int64_t next,
                        float* out) {
  D2O_ASSERT(kernel_isa_available(isa) && n >= 0);
  mean_attention_at(isa, score, pos, n, next, out);
}

void mean_attention(const float* score, const int32_t* pos, int n, int64_t next, float* out) {
  D2O_ASSERT(n >= 0);
  mean_attention_at(best_kernel_isa(), score, pos, n, next, out);
}

namespace {

int last_min_mean_index_at(KernelIsa isa, const float* score, const int32_t* pos, int n,
                           int64_t next) {
  if (next >= 0 && next <= INT32_MAX) {  // (as mean_attention_at: 32-bit counts, same integers)
    switch (isa) {
      case KernelIsa::kAvx512:
        return simd::last_min_mean_index_avx512(score, pos, n, static_cast<int32_t>(next));
      case KernelIsa::kAvx2:
        return simd::last_min_mean_index_avx2(score, pos, n, static_cast<int32_t>(next));
      case KernelIsa::kScalar:
        break;
    }
  }
  auto mean = [&](int j) {
    return score[j] / static_cast<float>(std::max<int64_t>(1, next - pos[j]));
  };
  int b = 0;
  float bs = mean(0);
  for (int j = 1; j < n; ++j) {
    const float m = mean(j);
    if (m <= bs) {
      bs = m;
      b = j;
    }
  }
  return b;
}

}  // namespace

int last_min_mean_index_isa(KernelIsa isa, const float* score, const int32_t* pos, int n,
                            int64_t next) {
  D2O_ASSERT(kernel_isa_available(isa) && n >= 1);
  return last_min_mean_index_at(isa, score, pos, n, next);
}

int last_min_mean_index(const float* score, const int32_t* pos, int n, int64_t next) {
  D2O_ASSERT(n >= 1);
  return last_min_mean_index_at(best_kernel_isa(), score, pos, n, next);
}

namespace {

void row_dots_at(KernelIsa isa, const RowDots& a);

// Quantised rows (Q8_0 / Q4_0 KV storage): a few rows at a time are dequantised at the given level
// and handed to that level's float loop.
void row_dots_quantized(KernelIsa isa, const RowDots& a) {
  constexpr int kRows = 8, kMaxDim = 1024;
  D2O_ASSERT(a.dim <= kMaxDim);
  alignas(64) float buf[kRows * kMaxDim];
  for (int r0 = 0; r0 < a.n; r0 += kRows) {
    const int nr = std::min(kRows, a.n - r0);
    for (int i = 0; i < nr; ++i) {
      dequantize_row_isa(isa, a.quant, a.row(r0 + i), buf + static_cast<size_t>(i) * a.dim, a.dim);
    }
    RowDots f = a;
    f.base = reinterpret_cast<const uint8_t*>(buf);
    f.row_bytes = sizeof(float) * static_cast<size_t>(a.dim);
    f.f16 = false;
    f.quant = GgmlType::kF32;
    f.rows = nullptr;
    f.map = nullptr;
    f.n = nr;
    f.dot = a.dot + r0;
    f.inv_norm = a.inv_norm ? a.inv_norm + r0 : nullptr;
    row_dots_at(isa, f);
  }
}

void row_dots_at(KernelIsa isa, const RowDots& a) {
  if (a.quant != GgmlType::kF32) {
    row_dots_quantized(isa, a);
    return;
  }
  switch (isa) {
    case KernelIsa::kAvx512:
      simd::row_dots_avx512(a);
      return;
    case KernelIsa::kAvx2:
      simd::row_dots_avx2(a);
      return;
    case KernelIsa::kScalar:
      row_dots_scalar(a);
      return;
  }
}

}  // namespace

void row_dots_isa(KernelIsa isa, const RowDots& a) {
  D2O_ASSERT(kernel_isa_available(isa));
  row_dots_at(isa, a);
}

void row_dots(const RowDots& a) {
  row_dots_at(best_kernel_isa(), a);
}

void row_dots_queries_isa(KernelIsa isa, const RowDots& a, const float* qs, size_t q_stride,
                          int n_q, float scale, float* dot, size_t ld) {
  D2O_ASSERT(kernel_isa_available(isa));
  int done = 0;  // queries whose rows up to n4 the blocked loop did
  const int n4 = a.n & ~3;
  if (a.quant == GgmlType::kF32 && !a.f16 && !a.rows && !a.map && n4 > 0) {
    if (isa == KernelIsa::kAvx512 && a.dim % 16 == 0)
      done = simd::row_dots_queries_avx512(a, qs, q_stride, n_q, scale, dot, ld);
    else if (isa == KernelIsa::kAvx2 && a.dim % 8 == 0)
      done = simd::row_dots_queries_avx2(a, qs, q_stride, n_q, scale, dot, ld);
  }
  RowDots one = a;
  one.inv_norm = nullptr;
  for (int j = 0; j < n_q; ++j) {
    one.q = qs + static_cast<size_t>(j) * q_stride;
    if (j < done) {  // the last rows (fewer than four) as row_dots' one-row loop sums them
      if (n4 == a.n) continue;
      one.base = a.base + static_cast<size_t>(n4) * a.row_bytes;
      one.n = a.n - n4;
      one.dot = dot + static_cast<size_t>(j) * ld + n4;
    } else {
      one.base = a.base;
      one.n = a.n;
      one.dot = dot + static_cast<size_t>(j) * ld;
    }
    row_dots_at(isa, one);
    for (int i = 0; i < one.n; ++i) one.dot[i] *= scale;
  }
}

void row_dots_queries(const RowDots& a, const float* qs, size_t q_stride, int n_q, float scale,
                      float* dot, size_t ld) {
  row_dots_queries_isa(best_kernel_isa(), a, qs, q_stride, n_q, scale, dot, ld);
}

namespace {

float row_inv_norm_at(KernelIsa isa, const RowDots& a, int r) {
  D2O_ASSERT(a.quant == GgmlType::kF32 && r >= 0);
  switch (isa) {
    case KernelIsa::kAvx512:
      return simd::row_inv_norm_avx512(a, r);
    case KernelIsa::kAvx2:
      return simd::row_inv_norm_avx2(a, r);
    case KernelIsa::kScalar:
      break;
  }
  // row_dots_scalar's sum: every row alone.
  const uint8_t* p = a.row(r);
  float nn = 0.0f;
  for (int d = 0; d < a.dim; ++d) {
    const float x = element(p, d, a.f16);
    nn += x * x;
  }
  return nn > 0.0f ? 1.0f / std::sqrt(nn) : 0.0f;
}

}  // namespace

float row_inv_norm_isa(KernelIsa isa, const RowDots& a, int r) {
  D2O_ASSERT(kernel_isa_available(isa));
  return row_inv_norm_at(isa, a, r);
}

float row_inv_norm(const RowDots& a, int r) {
  return row_inv_norm_at(best_kernel_isa(), a, r);
}

}  // namespace d2o
