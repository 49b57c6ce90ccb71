// The column-statistics loop of attention (attn::Kernels::stats) and the other small loops every
// level shares, written once as plain loops and compiled in each per-ISA file so the compiler
// vectorises them for that level. Arithmetic order of stats: for each query row b in order,
// a_j = agg over the group's heads (in order) of p * f; col_j = (0 + a_0j) + a_1j + ...; then
// score_j += col_j (and the same over rows b >= window_from for window_j).
//
// The functions are `static`: each per-ISA file must keep its own copy. As plain inline functions
// they would be one weak symbol, and the linker would keep any one file's copy for every level
// (tests/check_isa_objects.cmake guards against that).
#pragma once

#include <algorithm>
#include <cmath>

#include "kv/attention_kernels.h"

namespace d2o::attn::detail {

static inline void stats_impl(const StatsArgs& a) {
  constexpr int kChunk = 256;
  float tmp[kChunk], col[kChunk], win[kChunk];
  const bool any_window = a.window && a.window_from < a.nb;
  for (int c0 = 0; c0 < a.n_cols; c0 += kChunk) {
    const int n = std::min(kChunk, a.n_cols - c0);
    for (int j = 0; j < n; ++j) col[j] = 0.0f;
    for (int j = 0; j < n; ++j) win[j] = 0.0f;
    for (int b = 0; b < a.nb; ++b) {
      const float* p0 = a.p[b * a.grp] + c0;
      const float f0 = a.f[b * a.grp];
      for (int j = 0; j < n; ++j) tmp[j] = p0[j] * f0;
      for (int hh = 1; hh < a.grp; ++hh) {
        const float* ph = a.p[b * a.grp + hh] + c0;
        const float fh = a.f[b * a.grp + hh];
        if (a.agg == 2) {  // max
          for (int j = 0; j < n; ++j) tmp[j] = std::max(tmp[j], ph[j] * fh);
        } else {
          for (int j = 0; j < n; ++j) tmp[j] += ph[j] * fh;
        }
      }
      if (a.agg == 1) {  // mean
        const float g = static_cast<float>(a.grp);
        for (int j = 0; j < n; ++j) tmp[j] /= g;
      }
      if (a.score) {
        for (int j = 0; j < n; ++j) col[j] += tmp[j];
      }
      if (any_window && b >= a.window_from) {
        if (a.window_max) {
          for (int j = 0; j < n; ++j) win[j] = std::max(win[j], tmp[j]);
        } else {
          for (int j = 0; j < n; ++j) win[j] += tmp[j];
        }
      }
    }
    if (a.score) {
      float* s = a.score + c0;
      for (int j = 0; j < n; ++j) s[j] += col[j];
    }
    if (any_window) {
      float* w = a.window + c0;
      if (a.window_max) {
        for (int j = 0; j < n; ++j) w[j] = std::max(w[j], win[j]);
      } else {
        for (int j = 0; j < n; ++j) w[j] += win[j];
      }
    }
  }
}

static inline float max_impl(const float* s, int n) {
  float m = -INFINITY;
  for (int j = 0; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

static inline void rescale_add_impl(float* o, const float* x, float a, float b, int n) {
  for (int d = 0; d < n; ++d) o[d] = o[d] * a + x[d] * b;
}

}  // namespace d2o::attn::detail
