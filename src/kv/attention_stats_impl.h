// The column-statistics loop of attention (attn::Kernels::stats), written once as plain loops and
// compiled in each per-ISA file so the compiler vectorises it for that level. Arithmetic order:
// for each query row b in order, a_j = agg over the group's heads (in order) of p * inv, then
// score_j += a_j and window_j += a_j.
#pragma once

#include <algorithm>

#include "kv/attention_kernels.h"

namespace d2o::attn::detail {

inline void stats_impl(const StatsArgs& a) {
  constexpr int kChunk = 256;
  float tmp[kChunk];
  for (int c0 = 0; c0 < a.n_cols; c0 += kChunk) {
    const int n = std::min(kChunk, a.n_cols - c0);
    for (int b = 0; b < a.nb; ++b) {
      const float* p0 = a.p[b * a.grp] + c0;
      const float i0 = a.inv[b * a.grp];
      for (int j = 0; j < n; ++j) tmp[j] = p0[j] * i0;
      for (int hh = 1; hh < a.grp; ++hh) {
        const float* ph = a.p[b * a.grp + hh] + c0;
        const float ih = a.inv[b * a.grp + hh];
        if (a.agg == 2) {  // max
          for (int j = 0; j < n; ++j) tmp[j] = std::max(tmp[j], ph[j] * ih);
        } else {
          for (int j = 0; j < n; ++j) tmp[j] += ph[j] * ih;
        }
      }
      if (a.agg == 1) {  // mean
        const float g = static_cast<float>(a.grp);
        for (int j = 0; j < n; ++j) tmp[j] /= g;
      }
      if (a.score) {
        float* s = a.score + c0;
        for (int j = 0; j < n; ++j) s[j] += tmp[j];
      }
      if (a.window && b >= a.window_from) {
        float* w = a.window + c0;
        for (int j = 0; j < n; ++j) w[j] += tmp[j];
      }
    }
  }
}

}  // namespace d2o::attn::detail
