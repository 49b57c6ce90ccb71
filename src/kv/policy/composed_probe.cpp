// ComposedPolicy's AttnProbe (kv/attention.h): D2O's decode-step search through the attention
// pass. After a layer's compaction the policy arms, per KV head, the slot it expects the next
// one-token pass to evict; that pass's attention forms the slot key's dots with every key while
// it reads them, and the layer's next compaction takes them when the slot evicted is the armed one.
// Otherwise d2o_nearest forms the same dots with the same kernel, so results never depend on it.
// Also here: the statistics the policy asks the attention pass for (needs, pass_needs).
#include <algorithm>

#include "kv/policy/composed.h"
#include "kv/policy/select.h"
#include "kv/policy/similarity.h"

namespace d2o {

StatsNeeds ComposedPolicy::needs() const {
  StatsNeeds n;
  // The heavy-hitter selector accumulates attention whatever ranks its candidates, unless nothing
  // reads it: a scorer of keys or values with uniform layer budgets and no merger.
  const bool scores_unread = cfg_.selector == Selector::kHeavyRecent && base_scorer_ &&
                             !base_scorer_->reads_accumulated() && !merger_ &&
                             cfg_.layers == LayerRule::kUniform;
  n.accumulate = cfg_.needs_accumulate() && !scores_unread;
  n.agg = cfg_.agg;
  n.window = cfg_.needs_window() ? cfg_.window : 0;
  // Proportional attention reads the merged counts, which stay 0 without merges (merge=off, the
  // d2o default), so the attention pass is not asked to scan them then.
  n.mass = cfg_.merger == Merger::kD2o && cfg_.mass && cfg_.merge != MergeRule::kOff;
  // Expected attention reads the last `window` queries of the sequence.
  n.queries = reads_queries(cfg_) ? cfg_.window : 0;
  return n;
}

StatsNeeds ComposedPolicy::pass_needs(const PolicyState& state, bool recalls) const {
  StatsNeeds n = needs();
  // prompt_ranking=window reads the window at the prompt's compaction (the sequence's first) and
  // at the compaction of a turn that recalled from the cold tier (PassInfo::recalled), which
  // ranks hot and recalled slots alike by the turn's window; with prefill=bounded at that of any
  // pass that ends a prompt, which the state does not tell apart: every pass collects it.
  if (cfg_.selector == Selector::kHeavyRecent && state.n_compactions > 0 && !recalls &&
      !cfg_.bounded_prefill())
    n.window = 0;
  // prompt_ranking=expected reads the recorded queries at the prompt's compaction only, unless
  // the scorer of later compactions reads them too (scorer=expected_attention).
  if (n.queries > 0 && state.n_compactions > 0 && !base_scorer_->reads_queries()) n.queries = 0;
  return n;
}

bool ComposedPolicy::probes() const {
  return probe_on_ && cfg_.merger == Merger::kD2o && cfg_.merge != MergeRule::kOff &&
         cfg_.sim == SimOn::kKey && cfg_.mspace != MergeSpace::kUnrotated &&
         cfg_.heads != HeadRule::kAda && cfg_.decide != MergeDecision::kToken &&
         cfg_.selector == Selector::kHeavyRecent && cfg_.distinct == 0.0 &&
         base_scorer_->reads_accumulated();
}

AttnProbe* ComposedPolicy::attention_probe(PolicyState& state) const {
  if (!probes() || !compacts_per_layer(state)) return nullptr;
  ComposedPolicyState* own = state.ext_if<ComposedPolicyState>();
  D2oMergeState* d2o = own ? d2o_merge_state(own->merger.get()) : nullptr;
  return d2o && d2o->probe.n_head_kv > 0 ? &d2o->probe : nullptr;
}

void ComposedPolicy::arm_probe(const KvCache& cache, int il, const PolicyState& state,
                               ComposedPolicyState& own, int64_t next) const {
  const KvLayer& L = cache.layer(il);
  const int G = L.n_head_kv();
  D2oMergeState* d2o = d2o_merge_state(own.merger.get());
  if (!d2o) return;  // (probes() holds only with D2O's merger, whose state compact() made)
  AttnProbe& P = d2o->probe;
  const size_t nlg = static_cast<size_t>(cache.n_layer()) * static_cast<size_t>(G);
  if (P.n_head_kv != G || P.slot.size() != nlg) {
    P.n_head_kv = G;
    P.slot.assign(nlg, -1);
  }
  const size_t base = static_cast<size_t>(il) * static_cast<size_t>(G);
  const int S = state.budgets[static_cast<size_t>(il)], n = L.n_slot();
  const int t = std::min(cfg_.sinks, S);
  int heavy = 0, recent = 0;
  split_heavy_recent(S, cfg_.sinks, cfg_.nm_n, cfg_.nm_m, &heavy, &recent);
  // The next pass appends one slot; one eviction then takes the last lowest score among the
  // candidates between the sinks and the recent window (select_top), these slots' scores plus
  // that pass's attention. Usually the lowest now is the lowest then.
  const int mid = n + 1 - recent - t;
  const bool steady = d2o_decode_dots(cfg_, L, 1, false) && L.uniform() && n == S && heavy >= 1 &&
                      mid == heavy + 1 && t + mid <= n;
  // Mean attention ranks by score over the queries that saw a slot: at the next pass one more.
  HeadView hv;
  hv.layer = &L;
  hv.il = il;
  hv.n = n;
  hv.S = S;
  hv.next = next + 1;
  for (int g = 0; g < G; ++g) {
    int e = -1;
    if (steady) {
      hv.head = g;
      e = base_scorer_->last_lowest(hv, t, t + mid);
      if (e < 0) e = t + last_min_index(L.score(g) + t, mid);
    }
    P.slot[base + static_cast<size_t>(g)] = e;
  }
}

const float* attention_probe_dots(const AttnProbe& P, const KvLayer& L, int il, int g, int e) {
  // The attention loaded the armed slot's key when it formed the dots, and nothing changed the
  // layer between that attention and this compaction (dot_layer is reset after each).
  const size_t i =
      static_cast<size_t>(il) * static_cast<size_t>(P.n_head_kv) + static_cast<size_t>(g);
  if (P.dot_layer != il || P.n_head_kv != L.n_head_kv() || P.dot_n != L.n_slot(g) ||
      i >= P.slot.size() || P.slot[i] != e || !P.formed[static_cast<size_t>(g)])
    return nullptr;
  return P.dot.data() + static_cast<size_t>(g) * static_cast<size_t>(P.dot_n);
}

}  // namespace d2o
