// Layer level: how many slots per KV head each layer keeps (decided once, at a sequence's first
// compaction, from the n slots every layer holds at that moment).
//
// Units: a budget S_l is slots per KV head of layer l. Totals are over layers (sum_l S_l).
// D2O (method.md, "layer level"): v_l = mean over KV heads of the (unbiased) variance of the
// head's accumulated column-sum vector; F = min-max normalised v; S_l proportional to
// softmax(-F)_l, clamped to [S_min, n] with what the clamps remove or add handed to the other
// layers in proportion to their shares, so that sum_l S_l = round(rho * L * n) exactly.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "kv/policy/config.h"

namespace d2o {

// A total to split over layers in proportion to positive weights, within [lo, hi] per layer.
struct BudgetSplit {
  const double* weights = nullptr;  // [n_layer], > 0
  int n_layer = 0;
  int64_t total = 0;
  int64_t lo = 0;  // lowered to hi when lo > hi
  int64_t hi = 0;
};

// Integer budgets out[l] with sum_l out[l] == total, out[l] in [lo, hi], proportional to the
// weights where the clamps allow:
//   real_l = clamp(c * weights[l], lo, hi) with the unique c for which sum_l real_l == total,
//   out[l] = floor(real_l), plus one for the (total - sum floor) layers with the largest
//   fractional parts (ties: the lower layer index).
// When total is outside [L * lo, L * hi] the clamps win (every layer at lo, or at hi).
// scratch must hold 2 * n_layer doubles; order must hold n_layer ints.
void allocate_proportional(const BudgetSplit& split, int* out, double* scratch, int32_t* order);

// Unbiased variance (divide by n - 1; 0 when n < 2) of head g's accumulated scores over the
// layer's n_slot slots, accumulated in double.
double head_score_variance(const KvLayer& layer, int g);

// The per-layer density statistic v_l of layers[i], written to v[i]:
//   paper reading     mean over KV heads of head_score_variance;
//   research reading  per-head variances min-max normalised within the layer
//                     ((var - min) / (max - min + 1e-6)), then averaged over the heads.
void layer_density(const KvCache& cache, std::span<const int> layers, bool research, double* v);

// Per-layer budgets and, when the policy accumulates scores, the density statistic they were
// decided from (D2O's variance rule; recorded for reports with every rule).
struct LayerBudgets {
  std::vector<int> budgets;      // [n_layer] (PolicyState::budgets)
  std::vector<double> variance;  // [n_layer] or empty
};

// The token counts budgets are decided from: the n slots every compressible layer holds, and
// the n_ratio tokens a ratio applies to (n, or with prefill=bounded the prompt's whole length,
// n_ratio >= n). Ignored in budget mode.
struct BudgetBasis {
  int64_t n = 0;
  int64_t n_ratio = 0;
};

// Decides the budgets for a cache whose compressible layers all hold basis.n slots (each layer's
// budget at most that); sliding-window layers get kNoBudget (and variance 0), the rules share the
// total over the others.
void decide_budgets(const PolicyConfig& cfg, const KvCache& cache, BudgetBasis basis,
                    LayerBudgets& out);

// Ratio mode: the budget every layer keeps with uniform per-layer budgets, round(rho x n_ratio)
// within [the selector's least, n_ratio].
int64_t uniform_ratio_budget(const PolicyConfig& cfg, int64_t n_ratio);

}  // namespace d2o
