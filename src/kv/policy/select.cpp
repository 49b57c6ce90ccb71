#include "kv/policy/select.h"

#include <algorithm>
#include <cstring>

#include "core/assert.h"
#include "kv/policy/similarity.h"

namespace d2o {

void write_range(int32_t* out, int32_t first, int n) {
  // Four lanes a store: a decode step writes a whole head's keep list (1,638 slots at SmolLM2's
  // depth 8192, 90 heads), which one scalar store an element made a tenth of H2O's step.
  using V4 = int32_t __attribute__((vector_size(16)));
  V4 v = {first, first + 1, first + 2, first + 3};
  const V4 step = {4, 4, 4, 4};
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    std::memcpy(out + i, &v, sizeof v);
    v += step;
  }
  for (; i < n; ++i) out[i] = first + i;
}

void split_heavy_recent(int S, int sinks, int nm_n, int nm_m, int* heavy, int* recent) {
  const int body = std::max(0, S - std::min(sinks, S));
  if (body == 0) {
    *heavy = *recent = 0;
    return;
  }
  const int64_t den = static_cast<int64_t>(nm_n) + nm_m;
  int m = static_cast<int>((static_cast<int64_t>(body) * nm_m + den / 2) / den);
  m = std::max(1, std::min(body, m));
  *recent = m;
  *heavy = body - m;
}

void select_top(const float* score, int first, int count, int k, int32_t* out, int32_t* scratch) {
  D2O_ASSERT(k >= 0 && k <= count);
  // better(a, b): a ranks before b.
  auto better = [score](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  };
  if (k == count) {
    write_range(out, first, count);
    return;
  }
  if (k == 0) return;
  if (k == count - 1) {
    // One eviction: the worst slot in one (vectorised) pass. Scanning upwards, j is worse than
    // the current worst iff its score is lower or equal (equal scores: the newer slot goes).
    const int32_t worst = first + last_min_index(score + first, count);
    write_range(out, first, worst - first);
    write_range(out + (worst - first), worst + 1, first + count - worst - 1);
    return;
  }
  write_range(scratch, first, count);
  std::nth_element(scratch, scratch + k, scratch + count, better);
  std::sort(scratch, scratch + k);
  std::copy(scratch, scratch + k, out);
}

void select_heavy_recent(const float* score, int n, int S, const PolicyConfig& cfg, int32_t* keep,
                         int32_t* scratch) {
  D2O_ASSERT(S <= n);
  const int t = std::min(cfg.sinks, S);
  int heavy = 0, recent = 0;
  split_heavy_recent(S, cfg.sinks, cfg.nm_n, cfg.nm_m, &heavy, &recent);
  write_range(keep, 0, t);
  // Candidates: everything between the sinks and the recent window.
  const int mid = n - recent - t;
  select_top(score, t, mid, heavy, keep + t, scratch);
  write_range(keep + t + heavy, n - recent, recent);
  D2O_ASSERT(t + heavy + recent == S);
}

void pool_window(const float* window, int n_prefix, int kernel, PoolKind pool, float* out) {
  const int half = kernel / 2;
  for (int j = 0; j < n_prefix; ++j) {
    const int a = std::max(0, j - half), b = std::min(n_prefix - 1, j + half);
    if (pool == PoolKind::kMax) {
      float m = window[a];
      for (int i = a + 1; i <= b; ++i) m = std::max(m, window[i]);
      out[j] = m;
    } else {
      float s = 0.0f;
      for (int i = a; i <= b; ++i) s += window[i];
      out[j] = s / static_cast<float>(kernel);
    }
  }
}

void window_scores(const float* pooled, const int32_t* pos, int first, int end, int n_queries,
                   int64_t next_pos, float* out) {
  for (int j = first; j < end; ++j)
    out[j] = pooled[j] / static_cast<float>(n_queries) * static_cast<float>(next_pos - pos[j]);
}

}  // namespace d2o
