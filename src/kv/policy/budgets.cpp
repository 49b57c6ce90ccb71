#include "kv/policy/budgets.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "kv/policy/spec_keys.h"

namespace d2o {

namespace {

int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return std::max(lo, std::min(hi, x));
}

double clampd(double x, double lo, double hi) {
  return std::max(lo, std::min(hi, x));
}

double clamped_sum(const double* w, int n, double c, double lo, double hi) {
  double s = 0.0;
  for (int l = 0; l < n; ++l) s += clampd(c * w[l], lo, hi);
  return s;
}

}  // namespace

void allocate_proportional(const BudgetSplit& split, int* out, double* scratch, int32_t* order) {
  const double* weights = split.weights;
  const int n_layer = split.n_layer;
  const int64_t total = split.total, hi = split.hi, lo = std::min(split.lo, split.hi);
  D2O_ASSERT(n_layer > 0);
  const int64_t L = n_layer;
  if (total <= L * lo || total >= L * hi) {
    const int64_t v = total <= L * lo ? lo : hi;
    for (int l = 0; l < n_layer; ++l) out[l] = static_cast<int>(v);
    return;
  }
  const double dlo = static_cast<double>(lo), dhi = static_cast<double>(hi);
  const double dtot = static_cast<double>(total);
  // f(c) = sum_l clamp(c w_l, lo, hi) is continuous, non-decreasing and linear between the
  // breakpoints lo / w_l and hi / w_l. Find the segment where it crosses `total`, then solve the
  // linear equation on it exactly.
  double* bp = scratch;  // [2 * n_layer]
  for (int l = 0; l < n_layer; ++l) {
    D2O_ASSERT(weights[l] > 0.0);
    bp[2 * l] = dlo / weights[l];
    bp[2 * l + 1] = dhi / weights[l];
  }
  std::sort(bp, bp + 2 * n_layer);
  double prev = 0.0;  // f(0) = L * lo < total
  double c = bp[2 * n_layer - 1];
  for (int i = 0; i < 2 * n_layer; ++i) {
    const double b = bp[i];
    if (b <= prev) continue;
    if (clamped_sum(weights, n_layer, b, dlo, dhi) >= dtot) {
      const double mid = 0.5 * (prev + b);
      double fixed = 0.0, free_w = 0.0;
      for (int l = 0; l < n_layer; ++l) {
        const double x = mid * weights[l];
        if (x <= dlo)
          fixed += dlo;
        else if (x >= dhi)
          fixed += dhi;
        else
          free_w += weights[l];
      }
      c = free_w > 0.0 ? (dtot - fixed) / free_w : b;
      break;
    }
    prev = b;
  }
  // Real budgets, then largest-remainder rounding to the integer total.
  double* real = scratch;  // reuse: breakpoints are no longer needed
  int64_t floor_sum = 0;
  for (int l = 0; l < n_layer; ++l) {
    real[l] = clampd(c * weights[l], dlo, dhi);
    out[l] = static_cast<int>(clamp64(static_cast<int64_t>(std::floor(real[l])), lo, hi));
    floor_sum += out[l];
  }
  int64_t rest = total - floor_sum;
  for (int l = 0; l < n_layer; ++l) order[l] = l;
  std::sort(order, order + n_layer, [&](int32_t a, int32_t b) {
    const double fa = real[a] - std::floor(real[a]), fb = real[b] - std::floor(real[b]);
    return fa != fb ? fa > fb : a < b;
  });
  // rest is in [0, L) up to rounding; the loops below also absorb a stray +-1 from it.
  for (int i = 0; rest > 0 && i < n_layer; ++i) {
    const int l = order[i];
    if (out[l] < hi) {
      ++out[l];
      --rest;
    }
  }
  for (int i = n_layer - 1; rest < 0 && i >= 0; --i) {
    const int l = order[i];
    if (out[l] > lo) {
      --out[l];
      ++rest;
    }
  }
}

double head_score_variance(const KvLayer& layer, int g) {
  const int n = layer.n_slot();
  if (n < 2) return 0.0;
  const float* s = layer.score(g);
  double mean = 0.0;
  for (int j = 0; j < n; ++j) mean += s[j];
  mean /= n;
  double ss = 0.0;
  for (int j = 0; j < n; ++j) {
    const double d = s[j] - mean;
    ss += d * d;
  }
  return ss / (n - 1);
}

void layer_density(const KvCache& cache, std::span<const int> layers, bool research, double* v) {
  for (size_t i = 0; i < layers.size(); ++i) {
    const KvLayer& L = cache.layer(layers[i]);
    double* out = v + i;
    const int G = L.n_head_kv();
    double sum = 0.0, mn = 0.0, mx = 0.0;
    for (int g = 0; g < G; ++g) {
      const double var = head_score_variance(L, g);
      sum += var;
      mn = g == 0 ? var : std::min(mn, var);
      mx = g == 0 ? var : std::max(mx, var);
    }
    if (!research) {
      *out = sum / G;
      continue;
    }
    // Research code: (var - min) / (max - min + 1e-6) over the layer's heads, then the mean.
    double nsum = 0.0;
    for (int g = 0; g < G; ++g) nsum += (head_score_variance(L, g) - mn) / (mx - mn + 1e-6);
    *out = nsum / G;
  }
}

namespace {

// Per-layer weights of the D2O rules (any positive scale; only proportions matter).
void rule_weights(LayerRule rule, const double* v, int n_layer, double pbeta, double* w) {
  switch (rule) {
    case LayerRule::kVariance: {
      // F = min-max normalised v (all equal -> all 0); weight = exp(-F) (softmax numerator).
      const double mn = *std::min_element(v, v + n_layer), mx = *std::max_element(v, v + n_layer);
      for (int l = 0; l < n_layer; ++l) w[l] = std::exp(-(mx > mn ? (v[l] - mn) / (mx - mn) : 0.0));
      return;
    }
    case LayerRule::kReciprocal:
      for (int l = 0; l < n_layer; ++l) w[l] = 1.0 / std::max(v[l], 1e-30);
      return;
    case LayerRule::kExpDecay:
      // The paper gives no rate: the last layer gets e^-2 (about 1/7.4) of the first's share.
      for (int l = 0; l < n_layer; ++l)
        w[l] = n_layer > 1 ? std::exp(-2.0 * l / (n_layer - 1)) : 1.0;
      return;
    case LayerRule::kPyramid:
      // PyramidKV: linear from (2 - 1/beta) to 1/beta times the average, top to bottom.
      for (int l = 0; l < n_layer; ++l) {
        const double top = 2.0 - 1.0 / pbeta, bottom = 1.0 / pbeta;
        w[l] = n_layer > 1 ? top + (bottom - top) * l / (n_layer - 1) : 1.0;
      }
      return;
    case LayerRule::kUniform:
    case LayerRule::kResearch:
      for (int l = 0; l < n_layer; ++l) w[l] = 1.0;
      return;
  }
}

}  // namespace

namespace {

// Budgets of the compressible layers `layers`, written to out.budgets[0, layers.size()).
// Scratch: d (4 L doubles), i (2 L ints).
void decide_rule_budgets(const PolicyConfig& cfg, const KvCache& cache, std::span<const int> layers,
                         BudgetBasis basis, LayerBudgets& out, double* d, int32_t* i) {
  const int L = static_cast<int>(layers.size());
  const int64_t n = basis.n;
  // The tokens a ratio applies to (n, or the whole prompt with prefill=bounded).
  const double nr = static_cast<double>(std::max(basis.n_ratio, n));
  out.budgets.assign(static_cast<size_t>(L), 0);
  out.variance.clear();
  const int64_t lo = std::min<int64_t>(cfg.min_budget(), n);
  // rho: the fraction of the tokens kept on average.
  const double rho = cfg.mode == BudgetMode::kRatio ? cfg.ratio : static_cast<double>(cfg.budget) / n;
  const int64_t total =
      cfg.mode == BudgetMode::kRatio ? std::llround(cfg.ratio * L * nr) : cfg.budget * L;
  double* v = d;           // [L]
  double* w = v + L;       // [L]
  double* scratch = w + L;  // [2L]
  int32_t* order = i;      // [L]

  const bool uses_variance = cfg.layers == LayerRule::kVariance ||
                             cfg.layers == LayerRule::kReciprocal ||
                             cfg.layers == LayerRule::kResearch;
  if (cfg.needs_accumulate()) {
    // Recorded for reports whenever scores exist; only some rules use it.
    layer_density(cache, layers, cfg.layers == LayerRule::kResearch, v);
    out.variance.assign(v, v + L);
  } else {
    D2O_ASSERT(!uses_variance);
  }

  switch (cfg.layers) {
    case LayerRule::kUniform:
      if (!cfg.exact_total) {
        // Baselines: every layer keeps round(rho * n) (or B), within [S_min, n].
        const int64_t s = cfg.mode == BudgetMode::kRatio ? std::llround(cfg.ratio * nr)
                                                          : cfg.budget;
        for (int l = 0; l < L; ++l)
          out.budgets[static_cast<size_t>(l)] = static_cast<int>(clamp64(s, lo, n));
        return;
      }
      [[fallthrough]];
    case LayerRule::kVariance:
    case LayerRule::kReciprocal:
    case LayerRule::kExpDecay:
      rule_weights(cfg.layers, v, L, cfg.pbeta, w);
      allocate_proportional({w, L, total, lo, n}, out.budgets.data(), scratch, order);
      return;
    case LayerRule::kPyramid: {
      rule_weights(cfg.layers, v, L, cfg.pbeta, w);
      if (cfg.selector != Selector::kSnapWindow) {
        allocate_proportional({w, L, total, lo, n}, out.budgets.data(), scratch, order);
        return;
      }
      // PyramidKV proper: the observation window is kept everywhere; the top-k part (total minus
      // L windows) decreases linearly over depth.
      const int64_t win = std::min<int64_t>(cfg.window, n);
      const int64_t k_total = std::max<int64_t>(0, total - L * win);
      allocate_proportional({w, L, k_total, 0, n - win}, out.budgets.data(), scratch, order);
      for (int l = 0; l < L; ++l) out.budgets[static_cast<size_t>(l)] += static_cast<int>(win);
      return;
    }
    case LayerRule::kResearch: {
      // Research code: ratio_l = clamp(softmax(-v)_l * L * rho, 0.01, 1), S_l = floor(ratio_l * n);
      // layers 0, 1 and L-1 are never compressed. No redistribution: the total is not preserved.
      const double mn = *std::min_element(v, v + L);
      double z = 0.0;
      for (int l = 0; l < L; ++l) z += std::exp(-(v[l] - mn));
      for (int l = 0; l < L; ++l) {
        if (l == 0 || l == 1 || l == L - 1) {
          out.budgets[static_cast<size_t>(l)] = PolicyState::kNoBudget;
          continue;
        }
        const double r = clampd(std::exp(-(v[l] - mn)) / z * L * rho, 0.01, 1.0);
        const double of = cfg.mode == BudgetMode::kRatio ? nr : static_cast<double>(n);
        const int64_t s = static_cast<int64_t>(std::floor(r * of));
        out.budgets[static_cast<size_t>(l)] = static_cast<int>(clamp64(s, lo, n));
      }
      return;
    }
  }
}

// keep_edge_layers=on: layers 0, 1 and L-1 keep all n slots; the other layers share what is left of
// the total in proportion to the budgets the layer rule gave them, within [S_min, n]. Scratch: d (4
// L doubles), i (2 L ints).
void protect_edges(const PolicyConfig& cfg, int L, int64_t n, std::vector<int>& budgets,
                   double* d, int32_t* i) {
  if (L < 4) return;  // no layer would be left to compress
  const int64_t lo = std::min<int64_t>(cfg.min_budget(), n);
  int64_t total = 0;
  for (int l = 0; l < L; ++l) total += budgets[static_cast<size_t>(l)];
  double* w = d;
  double* scratch = w + L;
  int32_t* order = i;
  int32_t* out = order + L;
  int m = 0;
  for (int l = 2; l < L - 1; ++l)
    w[m++] = std::max(1.0, static_cast<double>(budgets[static_cast<size_t>(l)]));
  const int64_t rest = std::max<int64_t>(0, total - 3 * n);
  allocate_proportional({w, m, rest, lo, n}, out, scratch, order);
  budgets[0] = budgets[1] = budgets[static_cast<size_t>(L - 1)] = static_cast<int>(n);
  for (int l = 2; l < L - 1; ++l) budgets[static_cast<size_t>(l)] = out[l - 2];
}

}  // namespace

int64_t uniform_ratio_budget(const PolicyConfig& cfg, int64_t n_ratio) {
  const int64_t lo = std::min<int64_t>(cfg.min_budget(), n_ratio);
  return clamp64(std::llround(cfg.ratio * static_cast<double>(n_ratio)), lo, n_ratio);
}

void decide_budgets(const PolicyConfig& cfg, const KvCache& cache, BudgetBasis basis,
                    LayerBudgets& out) {
  const int64_t n = basis.n;
  // The rules share the total out over the compressible layers only (sliding-window layers keep
  // their window and are never compacted), as if the model had only those.
  const KvCacheConfig& cc = cache.config();
  std::vector<int> layers;
  for (int il = 0; il < cc.n_layer; ++il)
    if (cc.layer_compressible(il)) layers.push_back(il);
  if (layers.empty()) {
    out.budgets.assign(static_cast<size_t>(cc.n_layer), PolicyState::kNoBudget);
    out.variance.clear();
    return;
  }
  // Scratch of the rules (budgets are decided once per sequence: no reuse needed).
  std::vector<double> d(4 * layers.size());
  std::vector<int32_t> i(2 * layers.size());
  decide_rule_budgets(cfg, cache, layers, basis, out, d.data(), i.data());
  if (cfg.protect == ProtectRule::kEdges && cfg.layers != LayerRule::kResearch)
    protect_edges(cfg, static_cast<int>(layers.size()), n, out.budgets, d.data(), i.data());
  if (layers.size() == static_cast<size_t>(cc.n_layer)) return;
  std::vector<int> budgets(static_cast<size_t>(cc.n_layer), PolicyState::kNoBudget);
  std::vector<double> variance(out.variance.empty() ? 0 : budgets.size(), 0.0);
  for (size_t l = 0; l < layers.size(); ++l) {
    budgets[static_cast<size_t>(layers[l])] = out.budgets[l];
    if (!variance.empty()) variance[static_cast<size_t>(layers[l])] = out.variance[l];
  }
  out.budgets = std::move(budgets);
  out.variance = std::move(variance);
}

}  // namespace d2o

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kPrefillWords = {"exact", "bounded"};
const std::vector<const char*> kLayerWords = {"uniform", "variance", "reciprocal",
                                              "exp",     "pyramid",  "research"};
}  // namespace

// The layer budgets' keys: how the prompt is fed (prefill=), how budgets are shared over layers
// (layers=, beta=, pyramid_beta=, keep_edge_layers=) and whether a ratio budget holds after the
// prompt (hold_budget=).
std::vector<KeyDef> budget_keys() {
  return {
      // Shown when bounded (added after specs were recorded); meaningful in ratio mode only.
      word_def<&PolicyConfig::prefill, kPrefillWords>(
          "prefill", [](const PolicyConfig& c) { return c.prefill != PrefillMode::kExact; },
          [](const PolicyConfig& c) { return c.mode == BudgetMode::kRatio; }),
      {"beta",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         double x = 0;
         if (!parse_f64(v, &x) || !(x > 0.0 && x < 1.0))
           return bad_value(c.name, key, v, "a number in (0, 1)");
         c.beta = x;
         return Status();
       },
       [](const PolicyConfig& c) { return fmt_f64(c.beta); }},
      word_def<&PolicyConfig::layers, kLayerWords>("layers"),
      word_def<&PolicyConfig::protect, kOnOffWords>("keep_edge_layers"),
      {"pyramid_beta",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         double x = 0;
         if (!parse_f64(v, &x) || !(x >= 1.0 && x <= 1e6))
           return bad_value(c.name, key, v, "a number >= 1");
         c.pbeta = x;
         return Status();
       },
       [](const PolicyConfig& c) { return fmt_f64(c.pbeta); }},
      word_def<&PolicyConfig::hold, kOnOffWords>(
          "hold_budget", [](const PolicyConfig& c) { return c.hold; },
          [](const PolicyConfig& c) { return c.mode == BudgetMode::kRatio; }),
  };
}

}  // namespace d2o::spec_detail
