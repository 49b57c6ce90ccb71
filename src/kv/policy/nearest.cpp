#include "kv/policy/nearest.h"

#include <algorithm>

#include "core/assert.h"

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
