#include "kv/attention_kernels.h"

#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/fp16.h"
#include "kv/attention_stats_impl.h"
#include "ops/quant.h"

namespace d2o::attn {

namespace {

inline void load_row(const KvRows& r, int j, int hd, float* out) {
  const uint8_t* p = r.row(j);
  if (r.type == KvElemType::kF32) {
    std::memcpy(out, p, static_cast<size_t>(hd) * sizeof(float));
  } else if (kv_quantized(r.type)) {
    dequantize_row_isa(KernelIsa::kScalar, kv_ggml_type(r.type), p, out, hd);
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    for (int d = 0; d < hd; ++d) out[d] = fp16_to_fp32(h[d]);
  }
}

void scores_scalar(const float* const* q, int n_rows, KvRows k, int n_keys, int hd, float scale, float* const* s) {
  float row[1024];
  for (int j = 0; j < n_keys; ++j) {
    load_row(k, j, hd, row);
    for (int r = 0; r < n_rows; ++r) {
      float acc = 0.0f;
      for (int d = 0; d < hd; ++d) acc += q[r][d] * row[d];
      s[r][j] = acc * scale;
    }
  }
}

float exp_sum_scalar(float* s, int n_valid, int n, float m) {
  float sum = 0.0f;
  for (int j = 0; j < n_valid; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  for (int j = n_valid; j < n; ++j) s[j] = 0.0f;
  return sum;
}

void pv_scalar(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc) {
  float row[1024];
  for (int r = 0; r < n_rows; ++r) std::memset(acc[r], 0, static_cast<size_t>(hd) * sizeof(float));
  for (int j = 0; j < n_keys; ++j) {
    load_row(v, j, hd, row);
    for (int r = 0; r < n_rows; ++r) {
      const float pj = p[r][j];
      for (int d = 0; d < hd; ++d) acc[r][d] += pj * row[d];
    }
  }
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k{scores_scalar,     detail::max_impl,         exp_sum_scalar,
                         pv_scalar,         detail::rescale_add_impl, detail::stats_impl};
  return k;
}

const Kernels& kernels_for(KernelIsa isa) {
  D2O_ASSERT(kernel_isa_available(isa));
  switch (isa) {
    case KernelIsa::kAvx512: return avx512_kernels();
    case KernelIsa::kAvx2: return avx2_kernels();
    default: return scalar_kernels();
  }
}

const Kernels& best_kernels() {
  static const Kernels& k = kernels_for(best_kernel_isa());
  return k;
}

}  // namespace d2o::attn
