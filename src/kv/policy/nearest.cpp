#include "kv/policy/nearest.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "ops/quant.h"

namespace d2o {

namespace {

// Column blocks of the packing: a multiple of every variant's register tile (32 AVX-512 lanes).
constexpr int kPackAlign = 32;

void nearest_rows_scalar(const PackedRows& b, const float* q, int n_q, int32_t* best,
                         float* best_dot) {
  std::vector<float> sums(static_cast<size_t>(b.s_pad));
  for (int i = 0; i < n_q; ++i) {
    std::fill(sums.begin(), sums.end(), 0.0f);
    const float* qi = q + static_cast<size_t>(i) * b.dim;
    for (int d = 0; d < b.dim; ++d) {
      const float a = qi[d];
      const float* row = b.data.data() + static_cast<size_t>(d) * b.s_pad;
      for (int c = 0; c < b.s; ++c) sums[static_cast<size_t>(c)] += a * row[c];
    }
    int arg = 0;
    for (int c = 1; c < b.s; ++c) {
      if (sums[static_cast<size_t>(c)] > sums[static_cast<size_t>(arg)]) arg = c;
    }
    best[i] = arg;
    best_dot[i] = sums[static_cast<size_t>(arg)];
  }
}

}  // namespace

void unit_row(const float* row, int dim, double scale, float* out) {
  // Eight named sums (an array of them stays in memory, one store per addition).
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
  auto sq = [row](int d) { return static_cast<double>(row[d]) * row[d]; };
  int d = 0;
  for (; d + 8 <= dim; d += 8) {
    s0 += sq(d);
    s1 += sq(d + 1);
    s2 += sq(d + 2);
    s3 += sq(d + 3);
    s4 += sq(d + 4);
    s5 += sq(d + 5);
    s6 += sq(d + 6);
    s7 += sq(d + 7);
  }
  double* lane[8] = {&s0, &s1, &s2, &s3, &s4, &s5, &s6, &s7};
  for (; d < dim; ++d) *lane[d & 7] += sq(d);
  const double n2 = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
  const float f = n2 > 0.0 ? static_cast<float>(scale / std::sqrt(n2)) : 0.0f;
  for (int i = 0; i < dim; ++i) out[i] = row[i] * f;
}

namespace simd {

float unit_row_factor(const double* s, double scale) {
  const double n2 = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  return n2 > 0.0 ? static_cast<float>(scale / std::sqrt(n2)) : 0.0f;
}

void finish_unit_row(double* s, int d, int dim, double scale, float* out) {
  for (; d < dim; ++d) s[d & 7] += static_cast<double>(out[d]) * out[d];
  const float f = unit_row_factor(s, scale);
  for (int i = 0; i < dim; ++i) out[i] *= f;
}

}  // namespace simd

void unit_row_f16_isa(KernelIsa isa, const uint16_t* row, int dim, double scale, float* out) {
  D2O_ASSERT(kernel_isa_available(isa));
  switch (isa) {
    case KernelIsa::kAvx512:
      simd::unit_row_f16_avx512(row, dim, scale, out);
      return;
    case KernelIsa::kAvx2:
      simd::unit_row_f16_avx2(row, dim, scale, out);
      return;
    case KernelIsa::kScalar:
      fp16_to_fp32_row_isa(KernelIsa::kScalar, row, out, dim);
      unit_row(out, dim, scale, out);
      return;
  }
}

void unit_row_f16(const uint16_t* row, int dim, double scale, float* out) {
  unit_row_f16_isa(best_kernel_isa(), row, dim, scale, out);
}

void pack_rows(const float* rows, int s, int dim, PackedRows& out) {
  D2O_ASSERT(s > 0 && dim > 0);
  out.s = s;
  out.dim = dim;
  out.s_pad = (s + kPackAlign - 1) / kPackAlign * kPackAlign;
  out.data.assign(static_cast<size_t>(out.s_pad) * dim, 0.0f);
  for (int c = 0; c < s; ++c) {
    const float* r = rows + static_cast<size_t>(c) * dim;
    for (int d = 0; d < dim; ++d) out.data[static_cast<size_t>(d) * out.s_pad + c] = r[d];
  }
}

void nearest_rows_isa(KernelIsa isa, const PackedRows& b, const float* q, int n_q, int32_t* best,
                      float* best_dot) {
  D2O_ASSERT(kernel_isa_available(isa));
  D2O_ASSERT(n_q >= 0 && n_q <= 4 && b.s > 0);
  switch (isa) {
    case KernelIsa::kAvx512:
      simd::nearest_rows_avx512(b, q, n_q, best, best_dot);
      return;
    case KernelIsa::kAvx2:
      simd::nearest_rows_avx2(b, q, n_q, best, best_dot);
      return;
    case KernelIsa::kScalar:
      nearest_rows_scalar(b, q, n_q, best, best_dot);
      return;
  }
}

void nearest_rows(const PackedRows& b, const float* q, int n_q, int32_t* best, float* best_dot) {
  nearest_rows_isa(best_kernel_isa(), b, q, n_q, best, best_dot);
}

}  // namespace d2o
