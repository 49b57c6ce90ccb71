#include "kv/policy/select_keydiff.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/assert.h"
#include "kv/policy/select.h"

namespace d2o {

namespace {

double l2_norm(const float* row, int hd) {
  double s = 0.0;
  for (int d = 0; d < hd; ++d) s += static_cast<double>(row[d]) * row[d];
  return std::sqrt(s);
}

}  // namespace

void keydiff_scores(const KvLayer& L, int head, float* score, float* row, double* anchor) {
  const int n = L.n_slot(head), hd = L.head_dim();
  // Pass 1: the anchor, the mean of the normalised keys.
  std::fill(anchor, anchor + hd, 0.0);
  for (int j = 0; j < n; ++j) {
    L.load_key(head, j, row);
    const double norm = l2_norm(row, hd);
    if (norm == 0.0) continue;
    for (int d = 0; d < hd; ++d) anchor[d] += static_cast<double>(row[d]) / norm;
  }
  double anorm = 0.0;
  for (int d = 0; d < hd; ++d) {
    anchor[d] /= static_cast<double>(n);
    anorm += anchor[d] * anchor[d];
  }
  anorm = std::sqrt(anorm);
  // Pass 2: the negated cosine of every key with the anchor.
  for (int j = 0; j < n; ++j) {
    L.load_key(head, j, row);
    const double norm = l2_norm(row, hd);
    double dot = 0.0;
    for (int d = 0; d < hd; ++d) dot += static_cast<double>(row[d]) * anchor[d];
    const double cosine = norm > 0.0 && anorm > 0.0 ? dot / (norm * anorm) : 0.0;
    score[j] = static_cast<float>(-cosine);
  }
}

const float* guard_distinct(const KvLayer& L, int head, const float* score, int n, int S,
                            const PolicyConfig& cfg, SelectScratch& sc) {
  D2O_ASSERT(S >= 0 && S <= n && n == L.n_slot(head));
  const int t = std::min(cfg.sinks, S);
  int heavy = 0, recent = 0;
  split_heavy_recent(S, cfg.sinks, cfg.nm_n, cfg.nm_m, &heavy, &recent);
  const int mid = n - recent - t;
  const int k = std::min(heavy, static_cast<int>(std::floor(cfg.distinct * heavy + 0.5)));
  if (k <= 0 || mid <= heavy) return score;
  const size_t un = static_cast<size_t>(n), hd = static_cast<size_t>(L.head_dim());
  if (sc.guarded.size() < un) sc.guarded.resize(un);
  if (sc.order.size() < un) sc.order.resize(un);
  if (sc.row.size() < hd) sc.row.resize(hd);
  if (sc.anchor.size() < hd) sc.anchor.resize(hd);
  float* kd = sc.guarded.data();
  keydiff_scores(L, head, kd, sc.row.data(), sc.anchor.data());
  int32_t* idx = sc.order.data();
  for (int j = 0; j < mid; ++j) idx[j] = t + j;
  std::nth_element(idx, idx + (k - 1), idx + mid, [kd](int32_t a, int32_t b) {
    return kd[a] > kd[b] || (kd[a] == kd[b] && a < b);
  });
  // The guarded copy overwrites the KeyDiff scores: the k chosen slots are in idx[0, k).
  std::copy(score, score + n, kd);
  for (int i = 0; i < k; ++i) kd[idx[i]] = std::numeric_limits<float>::infinity();
  return kd;
}

}  // namespace d2o
