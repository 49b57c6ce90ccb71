// The D2O merger part (merge_d2o.h has the method): per KV head, its evicted slots' nearest kept
// slots and the threshold's decisions; with merge_decision=per_token, one decision per evicted
// index over all heads of the layer (end_layer). Its state (D2oMergeState, in
// ComposedPolicyState::merger): the thresholds, the kept keys' inverse norms, the attention
// probe's dots.
#include <algorithm>

#include "kv/policy/composed.h"
#include "kv/policy/merge_d2o.h"
#include "kv/policy/merger.h"
#include "kv/policy/spec_keys.h"

namespace d2o {

namespace {

// Head g's cached key norms `inv` (d2o_key_inv_norms; `last` = the position of the last slot
// covered) brought up to the slots the head holds (new slots formed; a list that does not match
// the head formed again), then reordered for this compaction's kept slots keep[0..S): the slot
// order after KvCache::apply, which the search wants. Returns the S norms; the ne evicted slots'
// norms go to evicted_inv.
const float* kept_key_norms(const KvLayer& L, int g, const int32_t* keep, int S,
                            const int32_t* evicted, int ne, std::vector<float>& inv, int32_t& last,
                            float* evicted_inv) {
  const int n = L.n_slot(g);
  const int32_t* pos = L.pos(g);
  int have = static_cast<int>(inv.size());
  if (have > n || (have > 0 && pos[have - 1] != last)) have = 0;
  inv.resize(static_cast<size_t>(n));  // grows only up to the most slots held
  if (have < n) d2o_key_inv_norms(L, g, have, n - have, inv.data() + have);
  float* v = inv.data();
  for (int i = 0; i < ne; ++i) evicted_inv[i] = v[evicted[i]];
  if (ne == 1) {
    std::copy(v + evicted[0] + 1, v + n, v + evicted[0]);
  } else {
    for (int c = 0; c < S; ++c) v[c] = v[keep[c]];  // keep ascending: keep[c] >= c
  }
  inv.resize(static_cast<size_t>(S));
  last = S > 0 ? pos[keep[S - 1]] : 0;
  return v;
}

// The evicted slots of a head holding n slots and keeping keep[0..S) (the complement, ascending)
// into evicted; returns their count.
int evicted_slots(const int32_t* keep, int S, int n, int32_t* evicted) {
  if (n - S == 1) {
    // A decode step: the evicted slot is the first gap in keep (or the last slot). keep is
    // ascending with keep[j] == j before the gap and j + 1 from it on: a binary search.
    evicted[0] = static_cast<int32_t>(
        std::partition_point(keep, keep + S, [keep](const int32_t& v) { return v == &v - keep; }) -
        keep);
    return 1;
  }
  int ne = 0;
  for (int j = 0, k = 0; j < n; ++j) {
    if (k < S && keep[k] == j)
      ++k;
    else
      evicted[ne++] = j;
  }
  return ne;
}

class D2oMerger final : public MergerPart {
 public:
  explicit D2oMerger(const PolicyConfig& cfg) : cfg_(cfg) {}

  void size_state(const KvCache& cache, ComposedPolicyState& own) const override {
    if (!d2o_merge_state(own.merger.get())) own.merger = std::make_unique<D2oMergeState>();
    D2oMergeState& st = state(own);
    const size_t nlg =
        static_cast<size_t>(cache.n_layer()) * static_cast<size_t>(cache.config().n_head_kv);
    if (st.tau.size() != nlg) st.tau.assign(nlg, 0.0f);
    if (st.tau_ready.size() != nlg) st.tau_ready.assign(nlg, 0);
    if (cfg_.sim == SimOn::kKey && st.key_inv.size() != nlg) {
      st.key_inv.assign(nlg, {});
      st.key_inv_last.assign(nlg, 0);
    }
  }
  // The cached key norms of the slots the plan merged into.
  void after_apply(const KvCache& cache, int il, const CompactionPlan& plan,
                   ComposedPolicyState& own) const override {
    D2oMergeState& st = state(own);
    if (st.key_inv.empty() || plan.merges.empty()) return;
    const KvLayer& L = cache.layer(il);
    const size_t G = static_cast<size_t>(L.n_head_kv());
    for (const MergeTerm& t : plan.merges) {
      if (t.src != t.dst) continue;  // one term per merge group has src == dst
      std::vector<float>& inv =
          st.key_inv[static_cast<size_t>(il) * G + static_cast<size_t>(t.head)];
      if (static_cast<int>(inv.size()) != L.n_slot(t.head)) continue;  // not kept for this head
      // The merged slot's index after the gather: its place in the ascending keep list.
      const int32_t* keep = plan.keep_of(t.head);
      const int j =
          static_cast<int>(std::lower_bound(keep, keep + plan.n_keep_of(t.head), t.dst) - keep);
      d2o_key_inv_norms(L, t.head, j, 1, inv.data() + j);
    }
  }
  bool merges(const LayerJob& job) const override {
    // (No compaction has run before the prompt's, so no kept key norms exist that skipping its
    // merges could leave stale.)
    return cfg_.prompt_merge || !job.prompt_pass;
  }
  void begin_layer(LayerJob& job) const override {
    // A decode step's terms fit without growth, in exactly what state_bytes reserves.
    const size_t terms = ComposedPolicy::kKeptTermsPerHead * static_cast<size_t>(job.G);
    if (job.plan->merges.capacity() < terms) job.plan->merges.reserve(terms);
    job.plan->rope = cfg_.mspace == MergeSpace::kUnrotated ? job.pass->rope : nullptr;
  }
  bool heads_in_parallel(const LayerJob& job) const override { return !by_token(job); }
  void size_scratch(const LayerJob& job, ComposedScratch& hs) const override {
    D2oScratch& dsc = hs.d2o;
    const int E = job.n - job.S;
    if (by_token(job)) {
      const size_t ge = static_cast<size_t>(job.G) * static_cast<size_t>(E);
      if (dsc.evicted.size() < ge) dsc.evicted.resize(ge);
      if (dsc.best.size() < ge) dsc.best.resize(ge);
      if (dsc.best_sim.size() < ge + static_cast<size_t>(E)) dsc.best_sim.resize(ge + E);
      if (dsc.merge.size() < static_cast<size_t>(E)) dsc.merge.resize(static_cast<size_t>(E));
    } else if (dsc.evicted.size() < static_cast<size_t>(job.n)) {
      dsc.evicted.resize(static_cast<size_t>(job.n));
    }
  }
  int64_t plan_head(const LayerJob& job, int g, ComposedScratch& hs,
                    std::vector<MergeTerm>& terms) const override;
  int64_t end_layer(const LayerJob& job, ComposedScratch& hs) const override;

 private:
  // merge_decision=per_token: every head's nearest neighbours first, then one decision per
  // evicted index.
  bool by_token(const LayerJob& job) const {
    return job.merging && cfg_.decide == MergeDecision::kToken && cfg_.merge != MergeRule::kOff;
  }
  D2oHeadMerge head_merge(const LayerJob& job, int g, const int32_t* evicted, int ne) const {
    const size_t ti = static_cast<size_t>(job.il) * job.G + static_cast<size_t>(g);
    D2oHeadMerge h;
    h.cfg = &cfg_;
    h.layer = job.layer;
    h.head = g;
    h.keep = job.plan->keep_of(g);
    h.n_keep = job.plan->n_keep_of(g);
    h.evicted = evicted;
    h.n_evicted = ne;
    h.tau = &state(*job.own).tau[ti];
    h.tau_ready = &state(*job.own).tau_ready[ti];
    h.rope = job.plan->rope;
    return h;
  }
  // The merger's state, which size_state() made before any layer is planned.
  static D2oMergeState& state(ComposedPolicyState& own) {
    return static_cast<D2oMergeState&>(*own.merger);
  }
  // The cached key norms and the probe's dots for head g's search, where they serve.
  void key_norms(const LayerJob& job, int g, D2oHeadMerge& h, float* evicted_inv) const;

  PolicyConfig cfg_;
};

void D2oMerger::key_norms(const LayerJob& job, int g, D2oHeadMerge& h, float* evicted_inv) const {
  D2oMergeState& own = state(*job.own);
  const KvLayer& L = *job.layer;
  if (own.key_inv.size() != static_cast<size_t>(job.cache->n_layer()) * job.G) return;
  const size_t ti = static_cast<size_t>(job.il) * job.G + static_cast<size_t>(g);
  const bool unrotated = h.rope != nullptr;
  if (d2o_uses_kept_norms(cfg_, h.n_evicted, unrotated) && cfg_.merge != MergeRule::kOff) {
    h.kept_inv = kept_key_norms(L, g, h.keep, h.n_keep, h.evicted, h.n_evicted, own.key_inv[ti],
                                own.key_inv_last[ti], evicted_inv);
    h.evicted_inv = evicted_inv;
    if (d2o_decode_dots(cfg_, L, h.n_evicted, unrotated)) {
      const float* dots = attention_probe_dots(own.probe, L, job.il, g, h.evicted[0]);
      h.all_dots = dots;
      h.all_dots_scale = own.probe.dot_scale;
      (dots ? own.probe_used : own.probe_missed).fetch_add(1, std::memory_order_relaxed);
    }
  } else if (h.n_evicted > 0) {
    own.key_inv[ti].clear();  // formed again when next needed
  }
}

int64_t D2oMerger::plan_head(const LayerJob& job, int g, ComposedScratch& hs,
                             std::vector<MergeTerm>& terms) const {
  D2oScratch& hd = hs.d2o;
  const bool token = by_token(job);
  const int E = job.n - job.S;
  int32_t* evicted = hd.evicted.data() + (token ? static_cast<size_t>(g) * E : 0);
  const int ne =
      evicted_slots(job.plan->keep_of(g), job.plan->n_keep_of(g), job.layer->n_slot(g), evicted);
  D2oHeadMerge h = head_merge(job, g, evicted, ne);
  float evicted_inv[kD2oFewEvicted];  // (d2o_uses_kept_norms)
  key_norms(job, g, h, evicted_inv);
  if (!token) return plan_d2o_merges(h, hd, terms);
  const size_t off = static_cast<size_t>(g) * E;
  d2o_nearest(h, hd, hd.best.data() + off, hd.best_sim.data() + off);
  return 0;
}

int64_t D2oMerger::end_layer(const LayerJob& job, ComposedScratch& hs) const {
  const int E = job.n - job.S, G = job.G;
  if (!by_token(job) || E <= 0 || job.S <= 0) return 0;
  D2oScratch& dsc = hs.d2o;
  // The research code's rule: the mean over the heads of the i-th evicted slot's similarity
  // against one threshold per layer (kept in head 0's entry).
  float* mean = dsc.best_sim.data() + static_cast<size_t>(G) * E;
  for (int i = 0; i < E; ++i) {
    double a = 0.0;
    for (int g = 0; g < G; ++g) a += dsc.best_sim[static_cast<size_t>(g) * E + i];
    mean[i] = static_cast<float>(a / G);
  }
  const size_t ti = static_cast<size_t>(job.il) * G;
  const int n_merge = d2o_decide(cfg_, mean, E, &state(*job.own).tau[ti],
                                 &state(*job.own).tau_ready[ti], dsc.merge.data());
  if (n_merge == 0) return 0;
  for (int g = 0; g < G; ++g) {
    const size_t off = static_cast<size_t>(g) * E;
    d2o_emit(head_merge(job, g, dsc.evicted.data() + off, E), dsc, dsc.best.data() + off,
             dsc.best_sim.data() + off, dsc.merge.data(), job.plan->merges);
  }
  return static_cast<int64_t>(n_merge) * G;
}

}  // namespace

std::unique_ptr<MergerState> D2oMergeState::clone() const {
  auto c = std::make_unique<D2oMergeState>();
  c->tau = tau;
  c->tau_ready = tau_ready;
  c->key_inv = key_inv;
  c->key_inv_last = key_inv_last;
  return c;
}

size_t D2oMergeState::bytes() const {
  size_t b = tau.capacity() * sizeof(float) + tau_ready.capacity() +
             key_inv.capacity() * sizeof(std::vector<float>) +
             key_inv_last.capacity() * sizeof(int32_t);
  for (const std::vector<float>& v : key_inv) b += v.capacity() * sizeof(float);
  b += probe.slot.capacity() * sizeof(int32_t) +
       (probe.key.capacity() + probe.dot.capacity()) * sizeof(float) + probe.formed.capacity();
  return b;
}

std::unique_ptr<MergerPart> make_d2o_merger(const PolicyConfig& cfg) {
  return std::make_unique<D2oMerger>(cfg);
}

}  // namespace d2o

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kMergeWords = {"off", "weighted", "average", "research", "sized"};
const std::vector<const char*> kSimWords = {"key", "value", "kv"};
const std::vector<const char*> kEmaWords = {"paper", "research"};
const std::vector<const char*> kMergedScoreWords = {"sum", "keep", "mean", "max"};
const std::vector<const char*> kMergeKeysWords = {"rotated", "unrotated"};
const std::vector<const char*> kDecisionWords = {"per_head", "per_token"};
}  // namespace

// D2O's merger's keys: how an evicted slot folds into its nearest kept one (merge=, sim=,
// merge_keys=), the threshold's running average (ema=, merge_decision=), the merged slot's score
// (merged_score=), and whether the prompt's compaction merges (prompt_merge=).
std::vector<KeyDef> d2o_merger_keys() {
  return {
      word_def<&PolicyConfig::merge, kMergeWords>("merge"),
      word_def<&PolicyConfig::sim, kSimWords>("sim"),
      word_def<&PolicyConfig::ema, kEmaWords>("ema"),
      word_def<&PolicyConfig::mscore, kMergedScoreWords>("merged_score"),
      word_def<&PolicyConfig::mspace, kMergeKeysWords>("merge_keys"),
      word_def<&PolicyConfig::decide, kDecisionWords>("merge_decision"),
      word_def<&PolicyConfig::prompt_merge, kOnOffWords>(
          "prompt_merge", [](const PolicyConfig& c) { return !c.prompt_merge; }),
  };
}

}  // namespace d2o::spec_detail
