// Deliberately naive re-implementations of the KV policies, for the policy tests.
//
// Written from docs/ADDING_A_POLICY.md and method.md, sharing no code with src/kv/policy/: a
// cache is a plain list of tokens per (layer, head) in doubles, rankings are full sorts, the
// D2O similarity is a full |E| x |C| matrix, budget totals are found by bisection, CaM merges
// are replayed token by token. Only the parsed PolicyConfig (plain data) is shared.
//
// A test snapshots the real cache before a compaction, compacts both, and compares (compare()).
// The naive State evolves on its own across steps (budgets, thresholds, counters, pos shift).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy/config.h"

namespace d2o::naive {

struct Tok {
  int32_t pos = 0;
  std::vector<double> k, v;
  double score = 0, window = 0;
  int merged = 0;
};
using Head = std::vector<Tok>;  // chronological

// One layer's recorded queries (KvCache::queries): m tokens' queries of n_head query heads,
// before RoPE, oldest first.
struct Queries {
  int n_head = 0, m = 0;
  double scale = 0;
  std::vector<double> q;  // [m][n_head][d]
};

struct Cache {
  int L = 0, G = 0, d = 0;
  std::vector<std::vector<Head>> h;  // [L][G]
  std::vector<Queries> queries;      // [L]
};

struct State {
  bool budgets_set = false;
  std::vector<int> budgets;
  std::vector<double> tau;
  std::vector<bool> tau_ready;
  std::vector<int64_t> evicted, merged;
  int64_t pos_shift = 0;
  bool compacted = false;  // a compaction has removed slots (prompt=, pmerge= act before that)
  // Every merge group of the last compaction: its weights (the retained slot's first).
  std::vector<std::vector<double>> last_groups;
};

inline Cache snapshot(const KvCache& c) {
  Cache n;
  n.L = c.n_layer();
  n.G = c.config().n_head_kv;
  n.d = c.config().head_dim;
  n.h.assign(static_cast<size_t>(n.L), std::vector<Head>(static_cast<size_t>(n.G)));
  n.queries.assign(static_cast<size_t>(n.L), Queries());
  std::vector<float> row(static_cast<size_t>(n.d));
  for (int il = 0; il < n.L; ++il) {
    const QueryWindow& w = c.queries(il);
    Queries& qs = n.queries[static_cast<size_t>(il)];
    qs.n_head = w.n_head();
    qs.m = w.count();
    qs.scale = w.scale();
    for (int i = 0; i < w.count(); ++i)
      for (int hq = 0; hq < w.n_head(); ++hq)
        for (int d = 0; d < w.head_dim(); ++d) qs.q.push_back(w.query(hq, i)[d]);
    const KvLayer& L = c.layer(il);
    for (int g = 0; g < n.G; ++g) {
      for (int j = 0; j < L.n_slot(g); ++j) {
        Tok t;
        t.pos = L.pos(g)[j];
        t.score = L.score(g)[j];
        t.window = L.window(g)[j];
        t.merged = L.merged(g)[j];
        L.load_key(g, j, row.data());
        t.k.assign(row.begin(), row.end());
        L.load_value(g, j, row.data());
        t.v.assign(row.begin(), row.end());
        n.h[static_cast<size_t>(il)][static_cast<size_t>(g)].push_back(t);
      }
    }
  }
  return n;
}

// "" when the real cache equals the naive one (values within tol * max(1, |x|)), else the
// first difference.
inline std::string compare(const KvCache& real, const Cache& ref, double tol) {
  std::vector<float> row(static_cast<size_t>(ref.d));
  char buf[256];
  for (int il = 0; il < ref.L; ++il) {
    const KvLayer& L = real.layer(il);
    for (int g = 0; g < ref.G; ++g) {
      const Head& h = ref.h[static_cast<size_t>(il)][static_cast<size_t>(g)];
      if (L.n_slot(g) != static_cast<int>(h.size())) {
        std::snprintf(buf, sizeof buf, "layer %d head %d: %d slots, expected %zu", il, g,
                      L.n_slot(g), h.size());
        return buf;
      }
      for (int j = 0; j < L.n_slot(g); ++j) {
        const Tok& t = h[static_cast<size_t>(j)];
        if (L.pos(g)[j] != t.pos) {
          std::snprintf(buf, sizeof buf, "layer %d head %d slot %d: position %d, expected %d", il,
                        g, j, L.pos(g)[j], t.pos);
          return buf;
        }
        if (L.merged(g)[j] != t.merged) {
          std::snprintf(buf, sizeof buf, "layer %d head %d slot %d: merged count %d, expected %d",
                        il, g, j, L.merged(g)[j], t.merged);
          return buf;
        }
        auto close = [tol](double a, double b) {
          return std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b));
        };
        if (!close(L.score(g)[j], t.score)) {
          std::snprintf(buf, sizeof buf, "layer %d head %d slot %d: score %.9g, expected %.9g", il,
                        g, j, L.score(g)[j], t.score);
          return buf;
        }
        for (int pass = 0; pass < 2; ++pass) {
          if (pass == 0)
            L.load_key(g, j, row.data());
          else
            L.load_value(g, j, row.data());
          const std::vector<double>& want = pass == 0 ? t.k : t.v;
          for (int d = 0; d < ref.d; ++d) {
            if (!close(row[static_cast<size_t>(d)], want[static_cast<size_t>(d)])) {
              std::snprintf(buf, sizeof buf,
                            "layer %d head %d slot %d (pos %d): %s[%d] = %.9g, expected %.9g", il,
                            g, j, t.pos, pass == 0 ? "key" : "value", d,
                            row[static_cast<size_t>(d)], want[static_cast<size_t>(d)]);
              return buf;
            }
          }
        }
      }
    }
  }
  return "";
}

// ---- budgets ----------------------------------------------------------------------------

inline int smallest_budget(const PolicyConfig& c) {
  if (c.selector == Selector::kSinkRecent) return c.sinks + 1;
  if (c.selector == Selector::kSnapWindow) return c.window;
  if (c.selector == Selector::kKeyDiff) return std::max(1, c.sinks + c.recent);
  return c.sinks + 4;
}

inline double unbiased_variance(const Head& h) {
  const size_t n = h.size();
  if (n < 2) return 0.0;
  double mean = 0;
  for (const Tok& t : h) mean += t.score;
  mean /= static_cast<double>(n);
  double ss = 0;
  for (const Tok& t : h) ss += (t.score - mean) * (t.score - mean);
  return ss / static_cast<double>(n - 1);
}

// Integer budgets summing to `total`: clamp(c * target_l, lo, hi) with c found by bisection, then
// floors plus one for the largest fractional parts (ties: lower layer).
inline std::vector<int> share_out(const std::vector<double>& target, int64_t total, int64_t lo,
                                  int64_t hi) {
  const int L = static_cast<int>(target.size());
  lo = std::min(lo, hi);
  if (total <= L * lo) return std::vector<int>(static_cast<size_t>(L), static_cast<int>(lo));
  if (total >= L * hi) return std::vector<int>(static_cast<size_t>(L), static_cast<int>(hi));
  auto sum_at = [&](double c) {
    double s = 0;
    for (double t : target)
      s += std::min<double>(static_cast<double>(hi),
                            std::max<double>(static_cast<double>(lo), c * t));
    return s;
  };
  double a = 0, b = 1;
  while (sum_at(b) < static_cast<double>(total)) b *= 2;
  for (int it = 0; it < 300; ++it) {
    const double mid = 0.5 * (a + b);
    (sum_at(mid) < static_cast<double>(total) ? a : b) = mid;
  }
  std::vector<double> real(static_cast<size_t>(L));
  std::vector<int> out(static_cast<size_t>(L));
  int64_t floors = 0;
  for (int l = 0; l < L; ++l) {
    real[static_cast<size_t>(l)] = std::min<double>(
        static_cast<double>(hi),
        std::max<double>(static_cast<double>(lo), b * target[static_cast<size_t>(l)]));
    out[static_cast<size_t>(l)] = static_cast<int>(std::floor(real[static_cast<size_t>(l)]));
    floors += out[static_cast<size_t>(l)];
  }
  std::vector<int> idx(static_cast<size_t>(L));
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int x, int y) {
    const double fx = real[static_cast<size_t>(x)] - std::floor(real[static_cast<size_t>(x)]);
    const double fy = real[static_cast<size_t>(y)] - std::floor(real[static_cast<size_t>(y)]);
    if (fx != fy) return fx > fy;
    return x < y;
  });
  for (int64_t i = 0; i < total - floors; ++i)
    ++out[static_cast<size_t>(idx[static_cast<size_t>(i)])];
  return out;
}

inline std::vector<int> rule_budgets(const PolicyConfig& c, const Cache& cache, int64_t n) {
  const int L = cache.L;
  const int64_t lo = std::min<int64_t>(smallest_budget(c), n);
  const double rho = c.mode == BudgetMode::kRatio
                         ? c.ratio
                         : static_cast<double>(c.budget) / static_cast<double>(n);
  const int64_t total = c.mode == BudgetMode::kRatio
                            ? std::llround(c.ratio * L * static_cast<double>(n))
                            : c.budget * L;
  std::vector<double> v(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    std::vector<double> var;
    for (const Head& h : cache.h[static_cast<size_t>(l)]) var.push_back(unbiased_variance(h));
    if (c.layers == LayerRule::kResearch) {
      const double mn = *std::min_element(var.begin(), var.end()),
                   mx = *std::max_element(var.begin(), var.end());
      double s = 0;
      for (double x : var) s += (x - mn) / (mx - mn + 1e-6);
      v[static_cast<size_t>(l)] = s / static_cast<double>(var.size());
    } else {
      v[static_cast<size_t>(l)] =
          std::accumulate(var.begin(), var.end(), 0.0) / static_cast<double>(var.size());
    }
  }
  auto softmax_neg = [](const std::vector<double>& x) {
    std::vector<double> e(x.size());
    double z = 0;
    for (size_t i = 0; i < x.size(); ++i) z += (e[i] = std::exp(-x[i]));
    for (double& y : e) y /= z;
    return e;
  };
  std::vector<double> target(static_cast<size_t>(L));
  switch (c.layers) {
    case LayerRule::kUniform:
      if (!c.exact_total) {
        const int64_t s = c.mode == BudgetMode::kRatio
                              ? std::llround(c.ratio * static_cast<double>(n))
                              : c.budget;
        return std::vector<int>(static_cast<size_t>(L),
                                static_cast<int>(std::min(n, std::max(lo, s))));
      }
      for (double& t : target) t = rho * static_cast<double>(n);
      return share_out(target, total, lo, n);
    case LayerRule::kVariance: {
      const double mn = *std::min_element(v.begin(), v.end()),
                   mx = *std::max_element(v.begin(), v.end());
      std::vector<double> f(static_cast<size_t>(L), 0.0);
      if (mx > mn) {
        for (int l = 0; l < L; ++l)
          f[static_cast<size_t>(l)] = (v[static_cast<size_t>(l)] - mn) / (mx - mn);
      }
      const std::vector<double> a = softmax_neg(f);
      for (int l = 0; l < L; ++l)
        target[static_cast<size_t>(l)] =
            a[static_cast<size_t>(l)] * L * rho * static_cast<double>(n);
      return share_out(target, total, lo, n);
    }
    case LayerRule::kReciprocal: {
      double z = 0;
      for (double x : v) z += 1.0 / x;
      for (int l = 0; l < L; ++l)
        target[static_cast<size_t>(l)] =
            (1.0 / v[static_cast<size_t>(l)]) / z * L * rho * static_cast<double>(n);
      return share_out(target, total, lo, n);
    }
    case LayerRule::kExpDecay:
      for (int l = 0; l < L; ++l)
        target[static_cast<size_t>(l)] = std::exp(-2.0 * l / std::max(1, L - 1));
      return share_out(target, total, lo, n);
    case LayerRule::kPyramid: {
      for (int l = 0; l < L; ++l) {
        const double hi_w = 2.0 - 1.0 / c.pbeta, lo_w = 1.0 / c.pbeta;
        target[static_cast<size_t>(l)] = L > 1 ? hi_w - (hi_w - lo_w) * l / (L - 1) : 1.0;
      }
      if (c.selector != Selector::kSnapWindow) return share_out(target, total, lo, n);
      const int64_t w = std::min<int64_t>(c.window, n);
      std::vector<int> k = share_out(target, std::max<int64_t>(0, total - L * w), 0, n - w);
      for (int& x : k) x += static_cast<int>(w);
      return k;
    }
    case LayerRule::kResearch: {
      const std::vector<double> a = softmax_neg(v);
      std::vector<int> out(static_cast<size_t>(L));
      for (int l = 0; l < L; ++l) {
        if (l == 0 || l == 1 || l == L - 1) {
          out[static_cast<size_t>(l)] = -1;
          continue;
        }
        const double r = std::min(1.0, std::max(0.01, a[static_cast<size_t>(l)] * L * rho));
        const int64_t s = static_cast<int64_t>(std::floor(r * static_cast<double>(n)));
        out[static_cast<size_t>(l)] = static_cast<int>(std::min(n, std::max(lo, s)));
      }
      return out;
    }
  }
  return {};
}

// ---- selection ------------------------------------------------------------------------------

// Indices of `cand` ranked by value (desc, then index asc), first k of them.

// protect=edges: layers 0, 1 and L-1 keep all n tokens; the others share the rest of the total in
// proportion to what the layer rule gave them.
inline std::vector<int> budgets(const PolicyConfig& c, const Cache& cache, int64_t n) {
  std::vector<int> b = rule_budgets(c, cache, n);
  const int L = cache.L;
  if (c.protect != ProtectRule::kEdges || c.layers == LayerRule::kResearch || L < 4) return b;
  int64_t total = 0;
  for (int x : b) total += x;
  std::vector<double> target;
  for (int l = 2; l < L - 1; ++l)
    target.push_back(std::max(1.0, static_cast<double>(b[static_cast<size_t>(l)])));
  const std::vector<int> rest = share_out(target, std::max<int64_t>(0, total - 3 * n),
                                          std::min<int64_t>(smallest_budget(c), n), n);
  b[0] = b[1] = b[static_cast<size_t>(L - 1)] = static_cast<int>(n);
  for (int l = 2; l < L - 1; ++l) b[static_cast<size_t>(l)] = rest[static_cast<size_t>(l - 2)];
  return b;
}

inline std::vector<int> best_k(const std::vector<int>& cand, const std::vector<double>& value,
                               int k) {
  std::vector<int> s = cand;
  std::sort(s.begin(), s.end(), [&](int a, int b) {
    if (value[static_cast<size_t>(a)] != value[static_cast<size_t>(b)])
      return value[static_cast<size_t>(a)] > value[static_cast<size_t>(b)];
    return a < b;
  });
  s.resize(static_cast<size_t>(k));
  return s;
}

// KeyDiff's score of every token of a head: anchor the mean of the unit keys (a zero key adds
// nothing), score minus the cosine with it (0 for a zero key or anchor), rounded to float.
inline std::vector<double> keydiff_scores(const Head& h) {
  const int n = static_cast<int>(h.size());
  const size_t d = h[0].k.size();
  std::vector<double> anchor(d, 0.0);
  for (const Tok& tk : h) {
    double nn = 0;
    for (double x : tk.k) nn += x * x;
    if (nn == 0) continue;
    for (size_t x = 0; x < d; ++x) anchor[x] += tk.k[x] / std::sqrt(nn);
  }
  for (double& x : anchor) x /= n;
  std::vector<double> score(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    const std::vector<double>& k = h[static_cast<size_t>(j)].k;
    double ka = 0, kk = 0, aa = 0;
    for (size_t x = 0; x < d; ++x) {
      ka += k[x] * anchor[x];
      kk += k[x] * k[x];
      aa += anchor[x] * anchor[x];
    }
    const double cosine = kk > 0 && aa > 0 ? ka / std::sqrt(kk * aa) : 0.0;
    score[static_cast<size_t>(j)] = static_cast<float>(-cosine);
  }
  return score;
}

// Expected attention of every token of head g (G KV heads) from the layer's recorded queries qs,
// as the method states it: mu and the population covariance Sigma of each query head's queries,
// Rbar the mean of the F = c.future RoPE rotation matrices R(p), p in [next_pos, next_pos + F)
// (adjacent pairs, theta_i = base^(-2i/d), as PolicySim's RoPE), z_j = scale (Rbar mu) . k_j +
// scale^2 / 2 k_j^T Rbar Sigma Rbar^T k_j (+ log(1 + merged) with proportional attention, D2O),
// the softmax over the head's tokens averaged over the group's query heads, then times |v_j| /
// (sum e |v| / sum e) with value_weight=norm. No queries: 1 / n each.
inline std::vector<double> expected_scores(const PolicyConfig& c, const Head& h, const Queries& qs,
                                           int g, int G, int64_t next_pos, double base) {
  const int n = static_cast<int>(h.size());
  std::vector<double> e(static_cast<size_t>(n), n > 0 ? 1.0 / n : 0.0);
  if (n > 0 && qs.m > 0 && qs.n_head % G == 0) {
    const int d = static_cast<int>(h[0].k.size()), grp = qs.n_head / G, F = c.future;
    std::vector<double> R(static_cast<size_t>(d * d), 0.0);  // Rbar, row-major
    for (int t = 0; t < F; ++t) {
      const double p = static_cast<double>(next_pos + t);
      for (int i = 0; i < d; ++i) {
        if (i % 2 == 1) continue;
        const double ang = p * std::pow(base, -static_cast<double>(i) / d);
        R[static_cast<size_t>(i * d + i)] += std::cos(ang) / F;
        R[static_cast<size_t>(i * d + i + 1)] += -std::sin(ang) / F;
        R[static_cast<size_t>((i + 1) * d + i)] += std::sin(ang) / F;
        R[static_cast<size_t>((i + 1) * d + i + 1)] += std::cos(ang) / F;
      }
    }
    std::fill(e.begin(), e.end(), 0.0);
    for (int r = 0; r < grp; ++r) {
      const int hq = g * grp + r;
      auto q = [&](int i, int k) {
        return qs.q[(static_cast<size_t>(i) * qs.n_head + hq) * d + static_cast<size_t>(k)];
      };
      std::vector<double> mu(static_cast<size_t>(d), 0.0), sig(static_cast<size_t>(d * d), 0.0);
      for (int i = 0; i < qs.m; ++i)
        for (int k = 0; k < d; ++k) mu[static_cast<size_t>(k)] += q(i, k) / qs.m;
      for (int i = 0; i < qs.m; ++i)
        for (int a = 0; a < d; ++a)
          for (int b = 0; b < d; ++b)
            sig[static_cast<size_t>(a * d + b)] += (q(i, a) - mu[static_cast<size_t>(a)]) *
                                                    (q(i, b) - mu[static_cast<size_t>(b)]) / qs.m;
      std::vector<double> muf(static_cast<size_t>(d), 0.0), tmp(static_cast<size_t>(d * d), 0.0),
          sf(static_cast<size_t>(d * d), 0.0);
      for (int a = 0; a < d; ++a)
        for (int b = 0; b < d; ++b)
          muf[static_cast<size_t>(a)] += R[static_cast<size_t>(a * d + b)] * mu[static_cast<size_t>(b)];
      for (int a = 0; a < d; ++a)  // tmp = R Sigma
        for (int b = 0; b < d; ++b)
          for (int k = 0; k < d; ++k)
            tmp[static_cast<size_t>(a * d + b)] +=
                R[static_cast<size_t>(a * d + k)] * sig[static_cast<size_t>(k * d + b)];
      for (int a = 0; a < d; ++a)  // sf = tmp R^T
        for (int b = 0; b < d; ++b)
          for (int k = 0; k < d; ++k)
            sf[static_cast<size_t>(a * d + b)] +=
                tmp[static_cast<size_t>(a * d + k)] * R[static_cast<size_t>(b * d + k)];
      std::vector<double> z(static_cast<size_t>(n), 0.0);
      for (int j = 0; j < n; ++j) {
        const std::vector<double>& k = h[static_cast<size_t>(j)].k;
        double lin = 0.0, quad = 0.0;
        for (int a = 0; a < d; ++a) {
          lin += muf[static_cast<size_t>(a)] * k[static_cast<size_t>(a)];
          for (int b = 0; b < d; ++b)
            quad += k[static_cast<size_t>(a)] * sf[static_cast<size_t>(a * d + b)] *
                    k[static_cast<size_t>(b)];
        }
        z[static_cast<size_t>(j)] = qs.scale * lin + 0.5 * qs.scale * qs.scale * quad;
        if (c.merger == Merger::kD2o && c.mass)
          z[static_cast<size_t>(j)] += std::log(1.0 + h[static_cast<size_t>(j)].merged);
      }
      const double zmax = *std::max_element(z.begin(), z.end());
      double sum = 0.0;
      for (double x : z) sum += std::exp(x - zmax);
      for (int j = 0; j < n; ++j)
        e[static_cast<size_t>(j)] += std::exp(z[static_cast<size_t>(j)] - zmax) / sum / grp;
    }
  }
  if (c.value_weight == ValueWeight::kNorm) {
    std::vector<double> vn(static_cast<size_t>(n), 0.0);
    double num = 0.0, den = 0.0;
    for (int j = 0; j < n; ++j) {
      for (double x : h[static_cast<size_t>(j)].v) vn[static_cast<size_t>(j)] += x * x;
      vn[static_cast<size_t>(j)] = std::sqrt(vn[static_cast<size_t>(j)]);
      num += e[static_cast<size_t>(j)] * vn[static_cast<size_t>(j)];
      den += e[static_cast<size_t>(j)];
    }
    if (num > 0.0)
      for (int j = 0; j < n; ++j) e[static_cast<size_t>(j)] *= vn[static_cast<size_t>(j)] * den / num;
  }
  return e;
}

// The layer statistics a heavy-hitter scorer ranks a head by besides the slots' own: KeyDiff's
// scores, or expected attention from the layer's recorded queries (head g of G).
struct HeadInputs {
  const Queries* queries = nullptr;
  int g = 0, G = 1;
  double rope_base = 10000.0;
};
inline std::vector<double> scorer_input(const PolicyConfig& c, const Head& h, int64_t next_pos,
                                        const HeadInputs& in) {
  if (c.scorer == "key_diversity") return keydiff_scores(h);
  if (c.scorer == "expected_attention" && in.queries)
    return expected_scores(c, h, *in.queries, in.g, in.G, next_pos, in.rope_base);
  return {};
}

// The heavy hitters' score of token j by the policy's scorer (scorer=), in float where the policy
// reads float statistics; kd: scorer_input(), KeyDiff's or expected attention's scores.
inline double heavy_score(const PolicyConfig& c, const Head& h, int j, int64_t next_pos,
                          const std::vector<double>& kd) {
  const Tok& tk = h[static_cast<size_t>(j)];
  if (c.scorer == "mean_attention")  // mean attention
    return static_cast<double>(static_cast<float>(tk.score) /
                               static_cast<float>(std::max<int64_t>(1, next_pos - tk.pos)));
  if (c.scorer == "key_diversity" || c.scorer == "expected_attention")
    return static_cast<float>(kd[static_cast<size_t>(j)]);
  if (c.scorer == "value_norm") {  // |v|, over the value as stored (float)
    double s = 0.0;
    for (const double x : tk.v)
      s += static_cast<double>(static_cast<float>(x)) * static_cast<float>(x);
    return static_cast<float>(std::sqrt(s));
  }
  return tk.score;
}

// max over score[j - half .. j + half] within [0, n), or the sum over the kernel / kernel (the
// padding counted as zeros) with avg: SnapKV's 1-D pooling.
inline std::vector<double> pooled(const std::vector<double>& score, int kernel, PoolKind pool) {
  const int n = static_cast<int>(score.size());
  std::vector<double> out(score.size());
  for (int j = 0; j < n; ++j) {
    double acc = pool == PoolKind::kMax ? -1e300 : 0.0;
    for (int i = j - kernel / 2; i <= j + kernel / 2; ++i) {
      if (i < 0 || i >= n) continue;
      acc = pool == PoolKind::kMax ? std::max(acc, score[static_cast<size_t>(i)])
                                   : acc + score[static_cast<size_t>(i)];
    }
    out[static_cast<size_t>(j)] = pool == PoolKind::kMax ? acc : acc / kernel;
  }
  return out;
}

// The window statistics of h's first n - w slots, pooled as c says; with prompt_ranking=expected
// its expected attention (from `in`) instead.
inline std::vector<double> pooled_prefix(const PolicyConfig& c, const Head& h, int w,
                                         int64_t next_pos = 0, const HeadInputs& in = {}) {
  const int n = static_cast<int>(h.size());
  std::vector<double> win(static_cast<size_t>(n - w));
  std::vector<double> ex;
  if (c.prompt == PromptScore::kExpected && c.selector == Selector::kHeavyRecent && in.queries)
    ex = expected_scores(c, h, *in.queries, in.g, in.G, next_pos, in.rope_base);
  for (int j = 0; j < n - w; ++j)
    win[static_cast<size_t>(j)] = ex.empty() ? h[static_cast<size_t>(j)].window
                                             : static_cast<float>(ex[static_cast<size_t>(j)]);
  return pooled(win, c.kernel, c.pool);
}

// pscore=window, at the prompt's compaction: every slot of [t, n - w) (t sinks, w the window's
// kept slots, as keep_list has them) takes the window's pooled attention per window query times
// the queries that have seen it, before any merge.
// With prompt_ranking=expected, the pooled expected attention is one query's already.
inline void carry_window(const PolicyConfig& c, Head& h, int S, int64_t next_pos, int n_tokens,
                         const HeadInputs& in = {}) {
  const int n = static_cast<int>(h.size());
  const int t = std::min(c.sinks, S), w = std::min(c.window, S - t);
  const std::vector<double> p = pooled_prefix(c, h, w, next_pos, in);
  const int queries = c.prompt == PromptScore::kExpected ? 1 : std::min(c.window, n_tokens);
  for (int j = t; j < n - w; ++j) {
    Tok& tk = h[static_cast<size_t>(j)];
    tk.score = p[static_cast<size_t>(j)] / queries * static_cast<double>(next_pos - tk.pos);
  }
}

// first: the first compaction of the sequence (prompt=window ranks it by the pooled window).
inline std::vector<int> keep_list(const PolicyConfig& c, const Head& h, int S, int64_t next_pos,
                                  bool first = false, const HeadInputs& in = {}) {
  const int n = static_cast<int>(h.size());
  std::vector<int> keep;
  if (c.selector == Selector::kSnapWindow ||
      (first && c.selector == Selector::kHeavyRecent &&
       (c.prompt == PromptScore::kWindow || c.prompt == PromptScore::kExpected))) {
    // SnapKV: the last w slots and the best S - w of [0, n - w) by the window attention pooled
    // over [0, n - w). prompt=window of the heavy-hitter policies: the same at the prompt's
    // compaction, the first t = min(sinks, S) slots kept as well.
    const int t = c.selector == Selector::kSnapWindow ? 0 : std::min(c.sinks, S);
    const int w = std::min(c.window, S - t);
    const std::vector<double> pooled_win = pooled_prefix(c, h, w, next_pos, in);
    std::vector<int> cand;
    for (int j = t; j < n - w; ++j) cand.push_back(j);
    for (int j = 0; j < t; ++j) keep.push_back(j);
    for (int j : best_k(cand, pooled_win, S - t - w)) keep.push_back(j);
    for (int j = n - w; j < n; ++j) keep.push_back(j);
  } else if (c.selector == Selector::kKeyDiff) {
    const std::vector<double> score = keydiff_scores(h);
    const int t = std::min(c.sinks, S);
    const int r = std::min(c.recent, S - t);
    for (int j = 0; j < t; ++j) keep.push_back(j);
    std::vector<int> cand;
    for (int j = t; j < n - r; ++j) cand.push_back(j);
    for (int j : best_k(cand, score, S - t - r)) keep.push_back(j);
    for (int j = n - r; j < n; ++j) keep.push_back(j);
  } else {
    const int t = std::min(c.sinks, S);
    const int body = S - t;
    int recent = body, heavy = 0;
    if (c.selector == Selector::kHeavyRecent && body > 0) {
      recent = static_cast<int>(
          std::floor(static_cast<double>(body) * c.nm_m / (c.nm_n + c.nm_m) + 0.5));
      recent = std::max(1, std::min(body, recent));
      heavy = body - recent;
    }
    for (int j = 0; j < t; ++j) keep.push_back(j);
    if (heavy > 0) {
      std::vector<double> score(static_cast<size_t>(n));
      const std::vector<double> kd = scorer_input(c, h, next_pos, in);
      for (int j = 0; j < n; ++j)
        score[static_cast<size_t>(j)] = heavy_score(c, h, j, next_pos, kd);
      std::vector<int> cand;
      for (int j = t; j < n - recent; ++j) cand.push_back(j);
      // distinct=F: the first round(F x heavy) places go to the best KeyDiff scores among the
      // candidates (when any candidate is evicted), the rest to the best attention scores.
      int k_distinct = static_cast<int>(std::floor(c.distinct * heavy + 0.5));
      if (static_cast<int>(cand.size()) <= heavy) k_distinct = 0;
      if (k_distinct > 0) {
        const std::vector<int> chosen = best_k(cand, keydiff_scores(h), k_distinct);
        for (int j : chosen) keep.push_back(j);
        std::vector<int> rest;
        for (int j : cand) {
          if (std::find(chosen.begin(), chosen.end(), j) == chosen.end()) rest.push_back(j);
        }
        cand = rest;
      }
      for (int j : best_k(cand, score, heavy - k_distinct)) keep.push_back(j);
    }
    for (int j = n - recent; j < n; ++j) keep.push_back(j);
  }
  std::sort(keep.begin(), keep.end());
  return keep;
}

// heads=ada: the kept lists of every head of a layer under budget S per head on average. Each
// head protects what its uniform selector protects (sinks and the recent part of the N:M split;
// SnapKV's observation window); of the K = S - protected scored slots a uniform head keeps, every
// head first keeps its floor(floor * K) best candidates, then the G * K - sum of those go to the
// best remaining candidates of all heads, ranked by (score desc, head asc, slot asc).
inline std::vector<std::vector<int>> ada_keep_lists(const PolicyConfig& c,
                                                    const std::vector<Head>& heads, int S,
                                                    int64_t next_pos, HeadInputs in = {}) {
  const int G = static_cast<int>(heads.size());
  int first = 0, last = 0;  // protected: slots [0, first) and the last `last`
  if (c.selector == Selector::kSnapWindow) {
    last = std::min(c.window, S);
  } else {
    first = std::min(c.sinks, S);
    const int body = S - first;
    if (body > 0) {
      last = static_cast<int>(
          std::floor(static_cast<double>(body) * c.nm_m / (c.nm_n + c.nm_m) + 0.5));
      last = std::max(1, std::min(body, last));
    }
  }
  const int K = S - first - last;
  const int floor_k = static_cast<int>(std::floor(c.floor * K));
  struct Cand {
    double s;
    int g, j;
  };
  std::vector<Cand> rest;
  std::vector<std::vector<int>> keep(static_cast<size_t>(G));
  int64_t joint = static_cast<int64_t>(G) * K;
  for (int g = 0; g < G; ++g) {
    const Head& h = heads[static_cast<size_t>(g)];
    const int n = static_cast<int>(h.size());
    std::vector<double> score(static_cast<size_t>(n), 0.0);
    in.g = g;
    in.G = G;
    const std::vector<double> kd = scorer_input(c, h, next_pos, in);
    for (int j = 0; j < n; ++j) {
      if (c.selector == Selector::kSnapWindow) {
        if (j >= n - last) continue;
        double acc = c.pool == PoolKind::kMax ? -1e300 : 0.0;
        for (int i = j - c.kernel / 2; i <= j + c.kernel / 2; ++i) {
          if (i < 0 || i >= n - last) continue;
          const double w = h[static_cast<size_t>(i)].window;
          acc = c.pool == PoolKind::kMax ? std::max(acc, w) : acc + w;
        }
        score[static_cast<size_t>(j)] = c.pool == PoolKind::kMax ? acc : acc / c.kernel;
      } else {
        score[static_cast<size_t>(j)] = heavy_score(c, h, j, next_pos, kd);
      }
    }
    std::vector<int> cand;
    for (int j = first; j < n - last; ++j) cand.push_back(j);
    const int fg = std::min(floor_k, static_cast<int>(cand.size()));
    std::vector<int>& kg = keep[static_cast<size_t>(g)];
    kg = best_k(cand, score, fg);
    for (int j : cand) {
      if (std::find(kg.begin(), kg.end(), j) == kg.end())
        rest.push_back({score[static_cast<size_t>(j)], g, j});
    }
    joint -= fg;
    for (int j = 0; j < first; ++j) kg.push_back(j);
    for (int j = n - last; j < n; ++j) kg.push_back(j);
  }
  std::sort(rest.begin(), rest.end(), [](const Cand& a, const Cand& b) {
    if (a.s != b.s) return a.s > b.s;
    if (a.g != b.g) return a.g < b.g;
    return a.j < b.j;
  });
  for (int64_t i = 0; i < joint; ++i) {
    const Cand& x = rest[static_cast<size_t>(i)];
    keep[static_cast<size_t>(x.g)].push_back(x.j);
  }
  for (std::vector<int>& kg : keep) std::sort(kg.begin(), kg.end());
  return keep;
}

// RoPE (adjacent pairs, theta_i = base^(-2i/d)) rotation of a key by `delta` positions.
inline void rotate(std::vector<double>& k, double delta, double base) {
  const size_t d = k.size();
  for (size_t i = 0; i < d / 2; ++i) {
    const double a = delta * std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    const double x0 = k[2 * i], x1 = k[2 * i + 1];
    k[2 * i] = x0 * std::cos(a) - x1 * std::sin(a);
    k[2 * i + 1] = x0 * std::sin(a) + x1 * std::cos(a);
  }
}

// ---- mergers ---------------------------------------------------------------------------------

inline double cosine(const std::vector<double>& a, const std::vector<double>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
}

// The nearest kept token nn[e] (index into keep) of every evicted token and its similarity m[e];
// with rope_base > 0 (mrope=pre) keys are compared rotated back to position 0.
struct Nearest {
  std::vector<int> ev, nn;
  std::vector<double> m;
};

inline Nearest d2o_nearest(const PolicyConfig& c, const Head& h, const std::vector<int>& keep,
                           double rope_base) {
  Nearest r;
  for (int j = 0; j < static_cast<int>(h.size()); ++j) {
    if (!std::binary_search(keep.begin(), keep.end(), j)) r.ev.push_back(j);
  }
  const size_t E = r.ev.size(), C = keep.size();
  auto key = [&](int j) {
    std::vector<double> k = h[static_cast<size_t>(j)].k;
    if (c.mspace == MergeSpace::kUnrotated)
      rotate(k, -static_cast<double>(h[static_cast<size_t>(j)].pos), rope_base);
    return k;
  };
  for (size_t e = 0; e < E; ++e) {
    std::vector<double> u(C);
    for (size_t i = 0; i < C; ++i) {
      const Tok& a = h[static_cast<size_t>(r.ev[e])];
      const Tok& b = h[static_cast<size_t>(keep[i])];
      const double ck = cosine(key(r.ev[e]), key(keep[i])), cv = cosine(a.v, b.v);
      u[i] = c.sim == SimOn::kKey ? ck : c.sim == SimOn::kValue ? cv : 0.5 * ck + 0.5 * cv;
    }
    const int best = static_cast<int>(std::max_element(u.begin(), u.end()) - u.begin());
    r.nn.push_back(best);  // the first maximum
    r.m.push_back(u[static_cast<size_t>(best)]);
  }
  return r;
}

inline std::vector<bool> d2o_decide(const PolicyConfig& c, const std::vector<double>& m,
                                    double& tau, bool& ready) {
  const size_t E = m.size();
  std::vector<bool> merge(E);
  const double mean = std::accumulate(m.begin(), m.end(), 0.0) / static_cast<double>(E);
  if (!ready) {
    tau = mean;
    ready = true;
    for (size_t e = 0; e < E; ++e) merge[e] = m[e] >= tau;
  } else if (c.ema == EmaRule::kPaper) {
    for (size_t e = 0; e < E; ++e) {
      merge[e] = m[e] >= tau;
      tau = c.beta * m[e] + (1 - c.beta) * tau;
    }
  } else {
    tau = 0.5 * tau + 0.5 * mean;
    for (size_t e = 0; e < E; ++e) merge[e] = m[e] >= tau;
  }
  return merge;
}

inline int d2o_apply(const PolicyConfig& c, Head& h, const std::vector<int>& keep,
                     const Nearest& nr, const std::vector<bool>& merge, double rope_base,
                     std::vector<std::vector<double>>& groups) {
  const size_t E = nr.ev.size(), C = keep.size();
  int n_merged = 0;
  std::vector<std::pair<size_t, Tok>> updated;  // (kept index, merged token)
  for (size_t i = 0; i < C; ++i) {
    std::vector<size_t> members;
    for (size_t e = 0; e < E; ++e) {
      if (merge[e] && nr.nn[e] == static_cast<int>(i)) members.push_back(e);
    }
    if (members.empty()) continue;
    n_merged += static_cast<int>(members.size());
    const double k = static_cast<double>(members.size());
    const Tok& dst = h[static_cast<size_t>(keep[i])];
    auto tok = [&](size_t e) -> const Tok& { return h[static_cast<size_t>(nr.ev[e])]; };
    std::vector<double> w;  // retained first
    if (c.merge == MergeRule::kWeighted) {
      double z = std::exp(1.0);
      for (size_t e : members) z += std::exp(nr.m[e]);
      w.push_back(std::exp(1.0) / z);
      for (size_t e : members) w.push_back(std::exp(nr.m[e]) / z);
    } else if (c.merge == MergeRule::kSized) {
      double z = (1.0 + dst.merged) * std::exp(1.0);
      for (size_t e : members) z += (1.0 + tok(e).merged) * std::exp(nr.m[e]);
      w.push_back((1.0 + dst.merged) * std::exp(1.0) / z);
      for (size_t e : members) w.push_back((1.0 + tok(e).merged) * std::exp(nr.m[e]) / z);
    } else if (c.merge == MergeRule::kAverage) {
      w.assign(members.size() + 1, 1.0 / (1 + k));
    } else {
      w.push_back(1.0 / (1 + k));
      for (size_t e : members) w.push_back(nr.m[e] / (1 + k));
    }
    groups.push_back(w);
    Tok out = dst;
    for (size_t x = 0; x < out.k.size(); ++x) {
      out.k[x] = w[0] * dst.k[x];
      out.v[x] = w[0] * dst.v[x];
    }
    double score_max = dst.score;
    for (size_t j = 0; j < members.size(); ++j) {
      const Tok& src = tok(members[j]);
      std::vector<double> sk = src.k;
      // mrope=pre: the un-rotated key, rotated for the retained token's position.
      if (c.mspace == MergeSpace::kUnrotated)
        rotate(sk, static_cast<double>(dst.pos) - static_cast<double>(src.pos), rope_base);
      for (size_t x = 0; x < out.k.size(); ++x) {
        out.k[x] += w[j + 1] * sk[x];
        out.v[x] += w[j + 1] * src.v[x];
      }
      out.score += src.score;
      score_max = std::max(score_max, src.score);
      out.merged += 1 + src.merged;
    }
    switch (c.mscore) {
      case MergedScore::kSum:
        break;
      case MergedScore::kKeep:
        out.score = dst.score;
        break;
      case MergedScore::kMean:
        out.score /= 1.0 + k;
        break;
      case MergedScore::kMax:
        out.score = score_max;
        break;
    }
    updated.emplace_back(i, out);
  }
  // Write back after all groups are built (sources are evicted, so order does not matter).
  for (const auto& [i, tok] : updated) h[static_cast<size_t>(keep[i])] = tok;
  return n_merged;
}

inline int d2o_merge(const PolicyConfig& c, Head& h, const std::vector<int>& keep, double& tau,
                     bool& ready, std::vector<std::vector<double>>& groups, double rope_base) {
  if (c.merge == MergeRule::kOff || keep.size() == h.size()) return 0;
  const Nearest nr = d2o_nearest(c, h, keep, rope_base);
  const std::vector<bool> merge = d2o_decide(c, nr.m, tau, ready);
  return d2o_apply(c, h, keep, nr, merge, rope_base, groups);
}

inline uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline int cam_merge(const PolicyConfig& c, Head& h, int S, int il, int g) {
  const int n = static_cast<int>(h.size());
  const int t0 = std::min(c.sinks, S), recent = S - t0;
  if (recent <= 0) return 0;  // no recent window to merge into: evicted slots are dropped
  const int m = c.cam_targets == 0 ? recent : std::min(c.cam_targets, recent);
  int merged = 0;
  for (int e = t0; e < n - recent; ++e) {
    // Reference: the largest score among the sinks, e and the recent slots after it.
    double ref = 0;
    for (int j = 0; j < t0; ++j) ref = std::max(ref, h[static_cast<size_t>(j)].score);
    for (int j = e; j <= e + recent; ++j) ref = std::max(ref, h[static_cast<size_t>(j)].score);
    const double s = h[static_cast<size_t>(e)].score;
    double p = ref > 0 ? s / ref : 0.0;
    p = std::min(1.0, std::max(0.0, p));
    const uint64_t key = (static_cast<uint64_t>(il) << 48) ^ (static_cast<uint64_t>(g) << 32) ^
                         static_cast<uint32_t>(h[static_cast<size_t>(e)].pos);
    const double u = static_cast<double>(splitmix(c.seed ^ key) >> 11) / 9007199254740992.0;
    if (!(u < p)) continue;
    ++merged;
    for (int t = e + 1; t <= e + m; ++t) {
      for (size_t x = 0; x < h[0].v.size(); ++x)
        h[static_cast<size_t>(t)].v[x] += h[static_cast<size_t>(e)].v[x] / m;
    }
  }
  return merged;
}

// ---- the policy ------------------------------------------------------------------------------

// Compacts `cache` after a pass; n_past = tokens processed so far; rope_base for pos=shift.
// n_tokens: the pass's tokens (the prompt's compaction is the first after a pass of more than one).
inline void compact(const PolicyConfig& c, Cache& cache, State& st, int64_t n_past,
                    double rope_base = 10000.0, int n_tokens = 1) {
  const int L = cache.L, G = cache.G;
  if (st.evicted.empty()) {
    st.evicted.assign(static_cast<size_t>(L), 0);
    st.merged.assign(static_cast<size_t>(L), 0);
    st.tau.assign(static_cast<size_t>(L * G), 0.0);
    st.tau_ready.assign(static_cast<size_t>(L * G), false);
  }
  st.last_groups.clear();
  const bool first = !st.compacted && n_tokens > 1;
  if (!st.budgets_set) {
    const int64_t n = static_cast<int64_t>(cache.h[0][0].size());
    if (n == 0) return;
    if (c.mode == BudgetMode::kBudget && n <= c.budget) return;
    st.budgets = budgets(c, cache, n);
    st.budgets_set = true;
  } else if (c.selector == Selector::kSnapWindow && c.mode == BudgetMode::kRatio && !c.hold) {
    return;  // SnapKV / PyramidKV at a ratio compress the prompt only, unless they hold it
  }
  int64_t removed = 0;
  // pmerge=off: the first compaction only evicts.
  const bool merging = c.merger == Merger::kD2o && (c.prompt_merge || !first);
  const bool carry = first && c.selector == Selector::kHeavyRecent &&
                     (c.prompt == PromptScore::kWindow || c.prompt == PromptScore::kExpected) &&
                     c.pscore == PromptScore::kWindow;
  // What the scorers read of layer l beside head g's tokens (its recorded queries).
  auto inputs = [&](int l, int g) {
    HeadInputs in;
    if (!cache.queries.empty()) in.queries = &cache.queries[static_cast<size_t>(l)];
    in.g = g;
    in.G = G;
    in.rope_base = rope_base;
    return in;
  };
  for (int l = 0; l < L; ++l) {
    const int S = st.budgets[static_cast<size_t>(l)];
    if (c.heads == HeadRule::kAda) {
      std::vector<Head>& hs = cache.h[static_cast<size_t>(l)];
      int64_t held = 0;
      for (const Head& h : hs) held += static_cast<int64_t>(h.size());
      if (S < 0 || held <= static_cast<int64_t>(S) * G) continue;
      const std::vector<std::vector<int>> keeps =
          ada_keep_lists(c, hs, S, n_past - st.pos_shift, inputs(l, 0));
      st.compacted = true;
      for (int g = 0; g < G; ++g) {
        Head& h = hs[static_cast<size_t>(g)];
        const std::vector<int>& keep = keeps[static_cast<size_t>(g)];
        if (merging) {
          const size_t ti = static_cast<size_t>(l * G + g);
          bool ready = st.tau_ready[ti];
          st.merged[static_cast<size_t>(l)] +=
              d2o_merge(c, h, keep, st.tau[ti], ready, st.last_groups, rope_base);
          st.tau_ready[ti] = ready;
        }
        st.evicted[static_cast<size_t>(l)] += static_cast<int64_t>(h.size() - keep.size());
        Head out;
        for (int j : keep) out.push_back(h[static_cast<size_t>(j)]);
        h = out;
      }
      continue;
    }
    // decide=token: the i-th evicted token of every head merges when the mean over the heads of
    // its similarity reaches the layer's threshold (kept at index l * G).
    const bool by_token =
        merging && c.decide == MergeDecision::kToken && c.merge != MergeRule::kOff;
    if (by_token) {
      const int n = static_cast<int>(cache.h[static_cast<size_t>(l)][0].size());
      if (S < 0 || n <= S) continue;
      std::vector<std::vector<int>> keeps;
      std::vector<Nearest> nrs;
      std::vector<double> mean(static_cast<size_t>(n - S), 0.0);
      for (int g = 0; g < G; ++g) {
        const Head& h = cache.h[static_cast<size_t>(l)][static_cast<size_t>(g)];
        keeps.push_back(keep_list(c, h, S, n_past - st.pos_shift, first, inputs(l, g)));
        nrs.push_back(d2o_nearest(c, h, keeps.back(), rope_base));
        for (int e = 0; e < n - S; ++e) mean[static_cast<size_t>(e)] += nrs.back().m[e] / G;
      }
      st.compacted = true;
      for (int g = 0; carry && g < G; ++g)
        carry_window(c, cache.h[static_cast<size_t>(l)][static_cast<size_t>(g)], S,
                     n_past - st.pos_shift, n_tokens, inputs(l, g));
      const size_t ti = static_cast<size_t>(l * G);
      bool ready = st.tau_ready[ti];
      const std::vector<bool> merge = d2o_decide(c, mean, st.tau[ti], ready);
      st.tau_ready[ti] = ready;
      for (int g = 0; g < G; ++g) {
        Head& h = cache.h[static_cast<size_t>(l)][static_cast<size_t>(g)];
        st.merged[static_cast<size_t>(l)] +=
            d2o_apply(c, h, keeps[static_cast<size_t>(g)], nrs[static_cast<size_t>(g)], merge,
                      rope_base, st.last_groups);
        st.evicted[static_cast<size_t>(l)] += n - S;
        Head out;
        for (int j : keeps[static_cast<size_t>(g)]) out.push_back(h[static_cast<size_t>(j)]);
        h = out;
      }
      continue;
    }
    for (int g = 0; g < G; ++g) {
      Head& h = cache.h[static_cast<size_t>(l)][static_cast<size_t>(g)];
      const int n = static_cast<int>(h.size());
      if (S < 0 || n <= S) continue;
      const std::vector<int> keep = keep_list(c, h, S, n_past - st.pos_shift, first, inputs(l, g));
      st.compacted = true;
      if (carry) carry_window(c, h, S, n_past - st.pos_shift, n_tokens, inputs(l, g));
      if (merging) {
        const size_t ti = static_cast<size_t>(l * G + g);
        bool ready = st.tau_ready[ti];
        st.merged[static_cast<size_t>(l)] +=
            d2o_merge(c, h, keep, st.tau[ti], ready, st.last_groups, rope_base);
        st.tau_ready[ti] = ready;
      } else if (c.merger == Merger::kCam) {
        st.merged[static_cast<size_t>(l)] += cam_merge(c, h, S, l, g);
      }
      st.evicted[static_cast<size_t>(l)] += n - S;
      Head out;
      for (int j : keep) out.push_back(h[static_cast<size_t>(j)]);
      if (c.pos == PosMode::kShift) {
        const int t = std::min(c.sinks, S);
        for (int j = t; j < S; ++j) {
          rotate(out[static_cast<size_t>(j)].k, -static_cast<double>(n - S), rope_base);
          out[static_cast<size_t>(j)].pos -= n - S;
        }
        removed = n - S;
      }
      h = out;
    }
  }
  st.pos_shift += removed;
}

}  // namespace d2o::naive
