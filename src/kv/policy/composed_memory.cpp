// What a composed policy holds for a sequence, for admission control and memory reports: the most
// slots per KV head and layer (peak_slots, peak_slots_for) and its own per-slot state
// (state_bytes).
#include <algorithm>
#include <cmath>
#include <limits>

#include "kv/policy/budgets.h"
#include "kv/policy/composed.h"
#include "kv/policy/keeper.h"

namespace d2o {

int64_t ComposedPolicy::peak_slots(int64_t n_prompt, int64_t n_total, int max_chunk) const {
  // An upper bound per KV head and layer: a layer holds at most its budget plus one pass of new
  // tokens before it is compacted. Budgets are only known at the first compaction, so variable
  // ones (D2O, PyramidKV) are bounded by the slot count at that moment (their clamp).
  const int64_t chunk = std::max(1, max_chunk);
  n_total = std::max(n_total, n_prompt);
  if (n_total <= 0) return 0;
  if (cfg_.layers == LayerRule::kResearch) return n_total;  // layers 0, 1 and L-1 keep everything
  // heads=ada: one head may hold up to n_head_kv x S slots (not known here): no tighter bound.
  if (cfg_.heads == HeadRule::kAda) return n_total;
  const bool variable = cfg_.exact_total || cfg_.layers != LayerRule::kUniform;
  int64_t n_first = 0, s_max = 0;
  if (cfg_.mode == BudgetMode::kRatio) {
    n_first = std::min(n_total, n_prompt > 0 ? std::min(n_prompt, chunk) : chunk);
    const int64_t lo = std::min<int64_t>(cfg_.min_budget(), n_first);
    s_max = variable ? n_first
                     : std::clamp<int64_t>(std::llround(cfg_.ratio * static_cast<double>(n_first)),
                                           lo, n_first);
  } else {
    if (n_total <= cfg_.budget) return n_total;
    n_first = std::min(n_total, cfg_.budget + chunk);
    s_max = variable ? n_first : cfg_.budget;
  }
  const int64_t held = n_first + (reconstructs() ? kReconstructionChunk : 0);
  if (!cfg_.compacts_after_first()) return std::max(held, std::min(n_total, s_max + (n_total - n_first) + recall()));
  return std::max(held, std::min(n_total, s_max + chunk + recall()));
}

size_t ComposedPolicy::state_bytes(const KvCacheConfig& cfg, int64_t slots) const {
  const size_t G = static_cast<size_t>(cfg.n_head_kv), nl = static_cast<size_t>(cfg.n_layer);
  size_t compressible = 0;
  for (int il = 0; il < cfg.n_layer; ++il) compressible += cfg.layer_compressible(il) ? 1 : 0;
  const size_t s = static_cast<size_t>(std::max<int64_t>(slots, 0));
  // Each compressible layer's plan: the slots its heads kept (CompactionPlan::keep, sized exactly
  // for the most kept, at most `slots` a head), with per-head budgets the heads' counts and
  // offsets.
  size_t b = compressible * G * s * sizeof(int32_t);
  if (cfg_.heads == HeadRule::kAda) b += compressible * 2 * G * sizeof(int32_t);
  // Expected attention: each compressible layer's recorded queries, the last `window` tokens'
  // (kept in the cache, KvCache::queries; whatever the slots).
  if (reads_queries(cfg_)) {
    const int n_head = cfg.n_head > 0 ? cfg.n_head : cfg.n_head_kv;
    b += compressible * QueryWindow::bytes_for(n_head, cfg.head_dim, cfg_.window, cfg.head_dim);
  }
  if (cfg_.merger != Merger::kD2o) return b;
  b += compressible * G * kKeptTermsPerHead * sizeof(MergeTerm);  // a decode step's merge list
  // A list holds a head's slots between a pass's append and its compaction: the budget plus one
  // decode token (a longer pass's lists are formed again, at most `slots` long).
  const size_t n = s + 1;
  b += nl * G * (sizeof(float) + sizeof(uint8_t));                         // tau, tau_ready
  if (cfg_.sim == SimOn::kKey) b += compressible * G * n * sizeof(float);  // key_inv
  if (probes()) {
    b += nl * G * sizeof(int32_t);                                     // armed slots
    b += G * (n + static_cast<size_t>(cfg.head_dim)) * sizeof(float);  // one layer's dots, keys
  }
  return b;
}

int64_t ComposedPolicy::head_peak_after_compaction(int64_t S, int n_head_kv) const {
  if (cfg_.heads != HeadRule::kAda) return S;
  // heads=ada (select_heads.h): a head keeps its t sinks, r recent slots, its floor f of the K =
  // S - t - r scored ones, and whatever it wins of the G x (K - f) slots left to all heads
  // jointly. Every head has at least f candidates at each compaction (more than S slots before
  // the first; t + r + f kept since, plus the pass after them), so the other heads always take
  // their floors: one head holds at most S + (G - 1) x (K - f).
  if (n_head_kv <= 0 || S > std::numeric_limits<int>::max()) return -1;  // no bound known
  const KeepShape sh = Keeper::of(cfg_).shape(static_cast<int>(S));
  const int64_t k = sh.top;
  const int64_t f = static_cast<int64_t>(std::floor(cfg_.floor * static_cast<double>(k)));
  return S + int64_t{n_head_kv - 1} * (k - f);
}

bool ComposedPolicy::recalls_layer_by_layer() const {
  // compacts_per_layer() once the budgets are set, which they are by the compaction that first
  // fills the tier (a tier needs positions=original).
  return cfg_.compacts_after_first() && cfg_.pos != PosMode::kShift;
}

int64_t ComposedPolicy::peak_slots_for(const FeedPlan& f) const {
  return peak_with_recall(f, recalls_layer_by_layer() ? 0 : recall());
}

int64_t ComposedPolicy::one_layer_extra_for(const FeedPlan& f) const {
  if (recall() == 0 || !recalls_layer_by_layer()) return 0;
  return peak_with_recall(f, recall()) - peak_with_recall(f, 0);
}

int64_t ComposedPolicy::peak_with_recall(const FeedPlan& f, int64_t recall) const {
  // As peak_slots(), with the prompt's later chunks announced (PassInfo::prompt_rest) and passes
  // after the prompt of at most decode_chunk tokens.
  const int64_t n_prompt = f.n_prompt, n_total = std::max(f.n_total, f.n_prompt);
  if (n_total <= 0) return 0;
  if (n_prompt <= 0) return peak_slots(0, n_total, f.decode_chunk);
  if (cfg_.layers == LayerRule::kResearch) return n_total;
  // What one head holds right after a compaction to a budget of S per head.
  auto head = [&](int64_t S) { return head_peak_after_compaction(S, f.n_head_kv); };
  if (head(1) < 0) return n_total;  // heads=ada without the head count
  const int64_t pc = std::max(1, f.prompt_chunk), dc = std::max(1, f.decode_chunk);
  const bool variable = cfg_.exact_total || cfg_.layers != LayerRule::kUniform;
  if (cfg_.bounded_prefill() && n_prompt > pc) {
    // prefill=bounded: as a fixed budget of B = rho x the prompt's tokens during the prompt (the
    // first compaction once more than B slots are held, at most B + one chunk), then as a ratio
    // policy after it; the prompt's last chunk may recall from a cold tier.
    const int64_t B = uniform_ratio_budget(cfg_, n_prompt);
    const int64_t n_first = std::min(n_prompt, B + pc);
    const int64_t s_max = variable ? n_first : B;
    const int64_t in_prompt = std::max(n_first, std::min(n_prompt, s_max + pc + recall));
    if (!cfg_.compacts_after_first())
      return std::max(in_prompt, std::min(n_total, s_max + (n_total - n_prompt) + recall));
    return std::max(in_prompt, std::min(n_total, s_max + std::max(pc, dc) + recall));
  }
  if (cfg_.mode == BudgetMode::kRatio) {
    // The whole prompt is held, then compacted once to budgets decided from its n_prompt slots.
    const int64_t lo = std::min<int64_t>(cfg_.min_budget(), n_prompt);
    const int64_t s_max = head(
        variable ? n_prompt
                 : std::clamp<int64_t>(std::llround(cfg_.ratio * static_cast<double>(n_prompt)), lo,
                                       n_prompt));
    // prompt_ranking=reconstruction: the prompt and one reconstruction pass, for a moment.
    const int64_t held = n_prompt + (reconstructs() ? kReconstructionChunk : 0);
    if (!cfg_.compacts_after_first())
      return std::max(held, std::min(n_total, s_max + (n_total - n_prompt) + recall));
    return std::max(held, std::min(n_total, s_max + dc + recall));
  }
  // Budget mode: compaction whenever a layer holds more than B slots, prompt chunks included.
  if (n_total <= cfg_.budget) return n_total;
  const bool in_prompt = n_prompt > cfg_.budget;  // the first compaction comes during the prompt
  const int64_t n_first = std::min(n_total, cfg_.budget + (in_prompt ? pc : dc));
  const int64_t s_max = head(variable ? n_first : cfg_.budget);
  const int64_t pass = in_prompt ? std::max(pc, dc) : dc;  // passes after the first compaction
  if (!cfg_.compacts_after_first())
    return std::max(n_first, std::min(n_total, s_max + (n_total - n_first) + recall));
  return std::max(n_first, std::min(n_total, s_max + pass + recall));
}

}  // namespace d2o
