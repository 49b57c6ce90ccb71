#include "kv/policy/merge_cam.h"

#include <algorithm>

#include "core/assert.h"

namespace d2o {

namespace {

uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

double cam_uniform(uint64_t seed, int il, int head, int32_t pos) {
  const uint64_t key = (static_cast<uint64_t>(il) << 48) ^ (static_cast<uint64_t>(head) << 32) ^
                       static_cast<uint64_t>(static_cast<uint32_t>(pos));
  return static_cast<double>(splitmix64(seed ^ key) >> 11) * 0x1p-53;
}

namespace {

// The slots of [e, e + recent] by decreasing score (a monotone deque over dq, sliding maximum).
struct SlidingMax {
  const float* score;
  int32_t* dq;
  int head, tail, next_in;
  // p_e = A_e / max(A over the sinks and [e, e + recent]) <= 1 (0 when all are 0), for e = t.
  double probability(int t, int recent, float sink_max) {
    for (; next_in <= t + recent; ++next_in) {
      while (tail > head && score[dq[tail - 1]] <= score[next_in]) --tail;
      dq[tail++] = next_in;
    }
    while (dq[head] < t) ++head;
    const double ref = std::max(sink_max, score[dq[head]]);
    const double p = ref > 0.0 ? static_cast<double>(score[t]) / ref : 0.0;
    return std::max(0.0, std::min(1.0, p));
  }
};

}  // namespace

int cam_merge_values(const CamHeadMerge& h, CamScratch& scratch) {
  const KvLayer& L = h.cache->layer(h.il);
  const int n = L.n_slot(), hd = L.head_dim();
  const int first = h.first_evicted, end = h.end_evicted;
  const int recent = n - end;
  // A budget no larger than the sinks leaves no recent window to merge into: the evicted slots
  // are dropped, as StreamingLLM drops them.
  if (end <= first || recent < 1) return 0;
  const int m = h.cfg->cam_targets > 0 ? std::min(h.cfg->cam_targets, recent) : recent;
  const float* score = L.score(h.head);
  const int32_t* pos = L.pos(h.head);

  // Scratch: acc[hd] cur[hd] ring[m][hd] (merged sources of the sliding window, as updated
  // values); ring_used[m] deque[n - first]; row[hd].
  const size_t nd = static_cast<size_t>(hd) * (2 + static_cast<size_t>(m));
  const size_t ni = static_cast<size_t>(m) + static_cast<size_t>(n - first);
  if (scratch.acc.size() < nd) scratch.acc.resize(nd);
  if (scratch.idx.size() < ni) scratch.idx.resize(ni);
  if (scratch.row.size() < static_cast<size_t>(hd)) scratch.row.resize(static_cast<size_t>(hd));
  double* acc = scratch.acc.data();
  double* cur = acc + hd;
  double* ring = cur + hd;
  int32_t* used = scratch.idx.data();
  float* row = scratch.row.data();
  std::fill(acc, acc + hd, 0.0);
  std::fill(used, used + m, 0);

  // Reference attention of the slot e evicted: the largest score among the sinks, e itself and
  // the recent window that survives it (e + 1 .. e + recent), as the authors' code takes the
  // maximum over the sinks and the window the slot leaves. Sinks: once; window: a monotone deque.
  float sink_max = 0.0f;
  for (int j = 0; j < first; ++j) sink_max = std::max(sink_max, score[j]);
  SlidingMax window{score, used + m, 0, 0, first};

  // The targets of source e are e+1 .. e+m; target t receives sum over merged e in [t-m, t-1]
  // of v'_e / m, where v' is the value after its own merges. A running sum over the window
  // makes this O((n - first) * head_dim) instead of O(E * m * head_dim).
  int n_merged = 0, in_window = 0;
  const double inv_m = 1.0 / m;
  for (int t = first; t < n; ++t) {
    if (t >= end && in_window == 0) break;  // nothing left to send or to receive
    // v'_t
    const bool receives = in_window > 0;
    L.load_value(h.head, t, row);
    for (int d = 0; d < hd; ++d) cur[d] = row[d] + (receives ? acc[d] * inv_m : 0.0);
    if (receives && t >= end) {
      for (int d = 0; d < hd; ++d) row[d] = static_cast<float>(cur[d]);
      h.cache->replace_value(h.il, h.head, t, row);
    }
    // Slide the window: source t - m leaves (target t + 1 sees [t+1-m, t]) and t may enter.
    const int slot = t % m;
    if (used[slot]) {
      double* old = ring + static_cast<size_t>(slot) * hd;
      for (int d = 0; d < hd; ++d) acc[d] -= old[d];
      used[slot] = 0;
      --in_window;
    }
    if (t < end) {
      const double p = window.probability(t, recent, sink_max);
      if (cam_uniform(h.cfg->seed, h.il, h.head, pos[t]) < p) {
        double* dst = ring + static_cast<size_t>(slot) * hd;
        for (int d = 0; d < hd; ++d) {
          dst[d] = cur[d];
          acc[d] += cur[d];
        }
        used[slot] = 1;
        ++in_window;
        ++n_merged;
      }
    }
  }
  return n_merged;
}

}  // namespace d2o
