#include "kv/policy/composed.h"

#include <algorithm>
#include <utility>

#include "core/assert.h"
#include "core/mem.h"
#include "kv/policy/budgets.h"
#include "kv/policy/select_heads.h"

namespace d2o {

namespace {

// Whether layer L holds more than its budget S (per head; heads=ada: S x n_head_kv in all).
bool over_budget(const KvLayer& L, int S) {
  if (S == PolicyState::kNoBudget) return false;
  return L.uniform() ? L.n_slot() > S : L.held_slots() > int64_t{S} * L.n_head_kv();
}

// The first lines of an array a compaction is about to read (the hardware follows a stream once
// it runs).
constexpr size_t kPrefetchStartBytes = 1024;
void prefetch_start(const void* p, size_t bytes) {
  prefetch_bytes(p, std::min(bytes, kPrefetchStartBytes));
}

// Slots one compaction evicts from a head above which it releases the search scratch
// (ComposedPolicy::compact): more than a decode step evicts (D2O searches with the unit rows of
// every kept key above it). Merge lists longer than a decode step's go after every pass.
constexpr int kReleaseAfter = kD2oFewEvicted;

// Releases a plan's merge list if it holds more than one decode step's terms
// (ComposedPolicy::kKeptTermsPerHead a head, what state_bytes reserves).
void release_merges(CompactionPlan& plan) {
  if (plan.merges.capacity() >
      ComposedPolicy::kKeptTermsPerHead * static_cast<size_t>(plan.n_head_kv))
    std::vector<MergeTerm>().swap(plan.merges);
}

}  // namespace

std::unique_ptr<PolicyExtState> ComposedPolicyState::clone() const {
  auto c = std::make_unique<ComposedPolicyState>();
  if (merger) c->merger = merger->clone();
  c->layer_variance = layer_variance;
  c->keep_merges = keep_merges;
  c->prompt_end = prompt_end;
  c->pressure_floor = pressure_floor;
  return c;
}

size_t ComposedPolicyState::bytes() const {
  return layer_variance.capacity() * sizeof(double) + pressure_floor.capacity() * sizeof(int) +
         (merger ? merger->bytes() : 0);
}

ComposedPolicy::ComposedPolicy(PolicyConfig cfg) : cfg_(std::move(cfg)) {
  switch (cfg_.selector) {
    case Selector::kHeavyRecent: {
      const ScorerDef* d = find_scorer(cfg_.scorer);
      D2O_ASSERT(d != nullptr);  // (the spec parser checks scorer=)
      base_scorer_ = d->make(cfg_);
      if (cfg_.distinct > 0.0) guard_ = make_distinct_guard(cfg_, base_scorer_.get());
      break;
    }
    case Selector::kSnapWindow:
      base_scorer_ = make_window_attention(cfg_);
      break;
    case Selector::kKeyDiff:
      base_scorer_ = make_key_diversity(cfg_);
      break;
    case Selector::kSinkRecent:
      break;
  }
  keeper_ = Keeper::of(cfg_);
  if (cfg_.prompt_phase()) {
    prompt_scorer_ = cfg_.prompt == PromptScore::kExpected ? make_expected_attention_pooled(cfg_)
                                                           : make_window_attention(cfg_);
    prompt_keeper_ = Keeper::prompt_window(cfg_);
  }
  if (cfg_.merger == Merger::kD2o) merger_ = make_d2o_merger(cfg_);
  if (cfg_.merger == Merger::kCam) merger_ = make_cam_merger(cfg_);
}

ComposedPolicyState& ComposedPolicy::own_state(const KvCache& cache, PolicyState& state) const {
  ComposedPolicyState& own = state.ext_as<ComposedPolicyState>();
  if (merger_) merger_->size_state(cache, own);
  return own;
}

int ComposedPolicy::reconstruction_chunk(const PolicyState& state) const {
  return reconstructs() && !state.budgets_set ? kReconstructionChunk : 0;
}

ColdTierConfig ComposedPolicy::cold_tier() const {
  ColdTierConfig c = cfg_.cold;
  c.window = cfg_.window;  // the turn's queries that score the cold slots: the policy's window
  c.kernel = cfg_.kernel;  // and its pooling kernel
  return c;
}

std::string ComposedPolicy::spec() const {
  return format_policy_spec(cfg_);
}

bool ComposedPolicy::compacts_per_layer(const PolicyState& state) const {
  return state.budgets_set && cfg_.compacts_after_first() && cfg_.pos != PosMode::kShift;
}

Status ComposedPolicy::compact_layer(KvCache& cache, PolicyState& state, const PassInfo& pass,
                                     int il) const {
  const size_t nl = static_cast<size_t>(cache.n_layer());
  ComposedPolicyState* own = state.ext_if<ComposedPolicyState>();
  if (!compacts_per_layer(state) || il < 0 || static_cast<size_t>(il) >= nl ||
      state.budgets.size() != nl || state.evicted.size() != nl || state.merged.size() != nl ||
      !own ||
      (cfg_.merger == Merger::kD2o && (!d2o_merge_state(own->merger.get()) ||
                                       d2o_merge_state(own->merger.get())->tau.size() !=
                                           nl * static_cast<size_t>(cache.config().n_head_kv)))) {
    return internal_error("KV policy '" + cfg_.name +
                          "': compact_layer called in a state that does not allow it");
  }
  const int budget = state.budgets[static_cast<size_t>(il)];
  if (!cache.layer(il).uniform() && cfg_.heads != HeadRule::kAda) return ragged_error();
  if (!over_budget(cache.layer(il), budget)) return {};
  if (state.plans.size() != nl) state.plans.resize(nl);
  if (own->scratch.empty()) own->scratch.resize(1);
  plan_layer(cache, il, state, *own, own->scratch[0], pass, pass.pool);
  if (D2oMergeState* d2o = d2o_merge_state(own->merger.get()))
    d2o->probe.dot_layer = -1;  // read once, by this layer's planning
  cache.apply(il, state.plans[static_cast<size_t>(il)], pass.pool);
  if (merger_) merger_->after_apply(cache, il, state.plans[static_cast<size_t>(il)], *own);
  release_merges(state.plans[static_cast<size_t>(il)]);
  if (probes()) arm_probe(cache, il, state, *own, pass.n_past - state.pos_shift);
  state.layer_compacted = true;
  return {};
}

Status ComposedPolicy::compact(KvCache& cache, PolicyState& state, const PassInfo& pass) const {
  // Layers compacted during the pass (compact_layer) count this pass as a compaction.
  const bool layered = std::exchange(state.layer_compacted, false);
  if (ComposedPolicyState* own = state.ext_if<ComposedPolicyState>()) {
    // The probe serves the compaction right after its layer's attention only; slots compacted
    // here, outside a layer-by-layer pass, are armed again at the next one.
    if (D2oMergeState* d2o = d2o_merge_state(own->merger.get())) {
      d2o->probe.dot_layer = -1;
      if (!layered) std::fill(d2o->probe.slot.begin(), d2o->probe.slot.end(), -1);
    }
  }
  D2O_RETURN_IF_ERROR(check(cache, state, pass));
  const int L = cache.n_layer();
  const size_t nl = static_cast<size_t>(L);
  if (state.evicted.size() != nl) state.evicted.assign(nl, 0);
  if (state.merged.size() != nl) state.merged.assign(nl, 0);
  ComposedPolicyState& own = own_state(cache, state);

  if (!state.budgets_set) {
    bool decided = false;
    D2O_RETURN_IF_ERROR(decide_layer_budgets(cache, state, own, pass, &decided));
    if (!decided) return {};
  } else if (!cfg_.compacts_after_first() &&
             !(cfg_.bounded_prefill() && pass.n_past <= own.prompt_end)) {
    // (prefill=bounded: the prompt whose length set the budget is compacted to it until its end.)
    return {};
  }

  // Plan every layer that overflows (in parallel when a pool is given: layers are independent,
  // each writes only its own plan, thresholds, counters and, for CaM, its own values), then apply
  // the plans in layer order.
  state.todo.clear();
  for (int il = 0; il < L; ++il) {
    if (over_budget(cache.layer(il), state.budgets[static_cast<size_t>(il)]))
      state.todo.push_back(il);
  }
  if (state.todo.empty()) {
    if (layered) ++state.n_compactions;
    return {};
  }
  return compact_todo(cache, state, own, pass);
}

Status ComposedPolicy::compact_todo(KvCache& cache, PolicyState& state, ComposedPolicyState& own,
                                    const PassInfo& pass) const {
  const size_t nl = static_cast<size_t>(cache.n_layer());
  if (state.plans.size() != nl) state.plans.resize(nl);
  const int threads = pass.pool && state.todo.size() > 1 ? pass.pool->n_threads() : 1;
  if (own.scratch.size() < static_cast<size_t>(threads))
    own.scratch.resize(static_cast<size_t>(threads));
  auto plan_one = [&](int64_t t, int thread) {
    const int il = state.todo[static_cast<size_t>(t)];
    plan_layer(cache, il, state, own, own.scratch[static_cast<size_t>(thread)], pass, nullptr);
  };
  if (threads > 1) {
    pass.pool->run(static_cast<int64_t>(state.todo.size()), plan_one);
  } else {
    for (size_t t = 0; t < state.todo.size(); ++t) plan_one(static_cast<int64_t>(t), 0);
  }

  D2O_RETURN_IF_ERROR(apply_plans(cache, state, own));
  // prompt_ranking=expected with a scorer that reads no queries: the prompt's compaction was
  // their last reader (the attention pass records no more of them, pass_needs).
  if (cfg_.prompt == PromptScore::kExpected && !base_scorer_->reads_queries()) cache.drop_queries();
  return {};
}

Result<bool> ComposedPolicy::compress_step(KvCache& cache, PolicyState& state,
                                           const PassInfo& pass) const {
  D2O_RETURN_IF_ERROR(check(cache, state, pass));
  const size_t nl = static_cast<size_t>(cache.n_layer());
  if (state.evicted.size() != nl) state.evicted.assign(nl, 0);
  if (state.merged.size() != nl) state.merged.assign(nl, 0);
  ComposedPolicyState& own = own_state(cache, state);
  if (!state.budgets_set) {
    bool decided = false;
    D2O_RETURN_IF_ERROR(decide_layer_budgets(cache, state, own, pass, &decided));
    if (!decided) return false;  // within the policy's budget already
    own.pressure_floor = state.budgets;
  }
  if (own.pressure_floor.size() != nl) own.pressure_floor = state.budgets;
  state.todo.clear();
  for (size_t il = 0; il < nl; ++il) {
    const int floor = own.pressure_floor[il];
    if (floor == PolicyState::kNoBudget) continue;
    const KvLayer& layer = cache.layer(static_cast<int>(il));
    // Slots per KV head (heads=ada: on average over the layer's heads).
    const int64_t per_head = layer.uniform() ? layer.n_slot()
                                             : (layer.held_slots() + layer.n_head_kv() - 1) /
                                                   std::max(1, layer.n_head_kv());
    state.budgets[il] = static_cast<int>(std::max<int64_t>(floor, (per_head + 1) / 2));
    if (over_budget(layer, state.budgets[il])) state.todo.push_back(static_cast<int32_t>(il));
  }
  if (state.todo.empty()) return false;
  D2O_RETURN_IF_ERROR(compact_todo(cache, state, own, pass));
  return true;
}

Status ComposedPolicy::decide_layer_budgets(const KvCache& cache, PolicyState& state,
                                            ComposedPolicyState& own, const PassInfo& pass,
                                            bool* decided) const {
  const int L = cache.n_layer();
  // Prompt-then-compress compresses the whole prompt: when it is prefilled in chunks, the first
  // compaction waits for the pass that ends it (PassInfo::prompt_rest). With prefill=bounded the
  // budget comes from the prompt's whole length instead, and the first compaction is the first
  // pass that holds more (below).
  if (cfg_.mode == BudgetMode::kRatio && !cfg_.bounded_prefill() && pass.prompt_rest > 0)
    return {};
  // The compressible layers (sliding-window ones keep their window) all hold the prompt.
  const KvCacheConfig& cc = cache.config();
  int n = -1;
  for (int il = 0; il < L; ++il) {
    if (!cc.layer_compressible(il)) continue;
    if (n < 0) n = cache.layer(il).n_slot();
    if (cache.layer(il).n_slot() != n) {
      return invalid_argument("KV cache layers hold different slot counts (" + std::to_string(n) +
                              " and " + std::to_string(cache.layer(il).n_slot()) +
                              ") before the first compaction");
    }
  }
  if (n <= 0) return {};
  if (cfg_.mode == BudgetMode::kBudget && n <= cfg_.budget) return {};
  // prefill=bounded: rho of the slots held and the prompt tokens still announced (the whole
  // prompt, for a sequence's first prompt); while they fit that budget, the prompt goes on
  // uncompressed. The pass that ends the prompt decides in any case, as prompt-then-compress does.
  const int64_t n_ratio = cfg_.bounded_prefill() ? n + pass.prompt_rest : n;
  if (cfg_.bounded_prefill() && pass.prompt_rest > 0 && n <= uniform_ratio_budget(cfg_, n_ratio))
    return {};
  LayerBudgets lb;
  decide_budgets(cfg_, cache, {n, n_ratio}, lb);
  state.budgets = std::move(lb.budgets);
  own.layer_variance = std::move(lb.variance);
  own.prompt_end = pass.n_past + pass.prompt_rest;
  state.budgets_set = true;
  *decided = true;
  return {};
}

Status ComposedPolicy::apply_plans(KvCache& cache, PolicyState& state,
                                   ComposedPolicyState& own) const {
  int removed_all = -1, removed_most = 0;
  for (const int il : state.todo) {
    const int removed = cache.layer(il).n_slot() - state.budgets[static_cast<size_t>(il)];
    const CompactionPlan& plan = state.plans[static_cast<size_t>(il)];
    for (int g = 0; g < cache.layer(il).n_head_kv(); ++g) {
      removed_most = std::max(removed_most, cache.layer(il).n_slot(g) - plan.n_keep_of(g));
    }
    if (cfg_.pos == PosMode::kShift) {
      // One position shift per sequence: every layer must have removed the same count (uniform
      // budgets and equal slot counts guarantee it).
      if (removed_all >= 0 && removed != removed_all) {
        return internal_error("positions=shifted: layers removed different slot counts");
      }
      removed_all = removed;
    }
    cache.apply(il, state.plans[static_cast<size_t>(il)]);
    if (merger_) merger_->after_apply(cache, il, state.plans[static_cast<size_t>(il)], own);
  }
  if (removed_all > 0) state.pos_shift += removed_all;
  ++state.n_compactions;
  // A merge list longer than a decode step's (a term per merged slot) is released: the memory
  // pool reserves a sequence's KV slots and one decode step's plans (state_bytes).
  if (!own.keep_merges) {
    for (const int il : state.todo) release_merges(state.plans[static_cast<size_t>(il)]);
  }
  if (removed_most > kReleaseAfter) {
    // A pass that evicted more than a decode step does (a prompt, a new turn of a conversation)
    // leaves search scratch sized for it (D2O: the unit rows of every kept key, the evicted
    // slots' nearest rows). Released, so that what a sequence holds between steps does not grow
    // with its last pass.
    std::vector<ComposedScratch>().swap(own.scratch);
    std::vector<std::vector<MergeTerm>>().swap(own.head_merges);
  }
  return {};
}

namespace {

// In a batch, a sequence's slot lists were last touched a whole step ago, and the dots its
// attention formed for the probe have since made way for the other sequences' keys: the lists
// a compaction reads, asked for together rather than one miss after another.
void prefetch_layer(const LayerJob& job) {
  const KvLayer& L = *job.layer;
  const D2oMergeState* d2o = d2o_merge_state(job.own->merger.get());
  const bool norms =
      d2o && d2o->key_inv.size() == static_cast<size_t>(job.cache->n_layer()) * job.G;
  for (int g = 0; g < job.G; ++g) {
    const size_t b = static_cast<size_t>(L.n_slot(g)) * sizeof(float);
    prefetch_start(L.score(g), b);
    prefetch_start(L.pos(g), b);
    prefetch_start(L.rows(g), b);
    prefetch_start(L.merged(g), b);
    if (norms) {
      const std::vector<float>& inv = d2o->key_inv[static_cast<size_t>(job.il) * job.G + g];
      prefetch_start(inv.data(), inv.size() * sizeof(float));
    }
    if (d2o && d2o->probe.dot_layer == job.il && d2o->probe.dot_n == L.n_slot(g))
      prefetch_start(d2o->probe.dot.data() + static_cast<size_t>(g) * d2o->probe.dot_n, b);
  }
}

}  // namespace

void ComposedPolicy::plan_layer(KvCache& cache, int il, PolicyState& state,
                                ComposedPolicyState& own, ComposedScratch& sc, const PassInfo& pass,
                                ThreadPool* heads) const {
  const KvLayer& L = cache.layer(il);
  LayerJob job;
  job.cache = &cache;
  job.layer = &L;
  job.il = il;
  job.n = L.n_slot();
  job.G = L.n_head_kv();
  job.S = state.budgets[static_cast<size_t>(il)];
  D2O_ASSERT(job.S >= 0 && job.S < job.n);
  job.plan = &state.plans[static_cast<size_t>(il)];
  job.own = &own;
  job.pass = &pass;
  job.next = pass.n_past - state.pos_shift;
  // The prompt's compaction: the sequence's first, after a pass of more than one token (a token
  // by token feed has none); with prefill=bounded also that of every pass of several tokens that
  // ends a prompt (its last chunk, where a question stands, ranks what was kept of the chunks
  // before it as a recalling turn does).
  job.prompt_pass = (state.n_compactions == 0 || pass.recalled ||
                     (cfg_.bounded_prefill() && pass.prompt_rest == 0)) &&
                    pass.n_tokens > 1;
  job.ada = cfg_.heads == HeadRule::kAda;
  job.merging = merger_ && merger_->merges(job);
  prefetch_layer(job);
  CompactionPlan& plan = *job.plan;
  if (job.ada) {
    keep_shared(job, sc.select);
  } else {
    plan.reset(job.G, job.S);
  }
  plan.merged_score = cfg_.mscore;
  release_merges(plan);
  plan.rope = nullptr;
  if (job.merging) merger_->begin_layer(job);
  if (cfg_.pos == PosMode::kShift) {
    // Sinks keep their positions; the recent slots after them move down by the n - S removed.
    plan.shift.first_slot = std::min(cfg_.sinks, job.S);
    plan.shift.by = job.n - job.S;
    plan.shift.rope = pass.rope;
  }
  const auto [evicted, merged] = plan_heads(job, sc, heads);
  state.evicted[static_cast<size_t>(il)] += evicted;
  state.merged[static_cast<size_t>(il)] += merged;
}

std::pair<int64_t, int64_t> ComposedPolicy::plan_heads(const LayerJob& job, ComposedScratch& sc,
                                                       ThreadPool* heads) const {
  const int G = job.G;
  ComposedPolicyState& own = *job.own;
  // One head: its kept slots, then its merges (appended to `terms`), with scratch `hs`.
  auto one = [&](int g, ComposedScratch& hs, std::vector<MergeTerm>& terms) {
    if (!job.ada) keep_head(job, g, hs.select);  // (shared budgets: keep_shared chose them)
    const int64_t m = job.merging ? merger_->plan_head(job, g, hs, terms) : 0;
    return std::pair<int64_t, int64_t>{job.layer->n_slot(g) - job.plan->n_keep_of(g), m};
  };
  auto size = [&](ComposedScratch& hs) {
    if (job.merging) merger_->size_scratch(job, hs);
    const size_t n = static_cast<size_t>(job.n);
    if (hs.select.order.size() < n) hs.select.order.resize(n);
    if (hs.select.score.size() < n) hs.select.score.resize(n);
  };
  std::pair<int64_t, int64_t> total{0, 0};
  // In parallel: uniform budgets and a merger whose heads decide alone.
  const bool parallel =
      heads && !job.ada && G > 1 && (!job.merging || merger_->heads_in_parallel(job));
  if (!parallel) {
    size(sc);
    for (int g = 0; g < G; ++g) {
      const auto [e, m] = one(g, sc, job.plan->merges);
      total.first += e;
      total.second += m;
    }
    if (job.merging) total.second += merger_->end_layer(job, sc);
    return total;
  }
  const int threads = std::min(heads->n_threads(), G);
  if (own.scratch.size() < static_cast<size_t>(threads))
    own.scratch.resize(static_cast<size_t>(threads));
  if (own.head_merges.size() < static_cast<size_t>(G))
    own.head_merges.resize(static_cast<size_t>(G));
  for (int t = 0; t < threads; ++t) size(own.scratch[static_cast<size_t>(t)]);
  std::vector<std::pair<int64_t, int64_t>>& counts = own.head_counts;
  counts.assign(static_cast<size_t>(G), {0, 0});
  heads->run(G, [&](int64_t g, int thread) {
    std::vector<MergeTerm>& terms = own.head_merges[static_cast<size_t>(g)];
    terms.clear();
    counts[static_cast<size_t>(g)] =
        one(static_cast<int>(g), own.scratch[static_cast<size_t>(thread)], terms);
  });
  for (int g = 0; g < G; ++g) {  // the serial order: head by head
    const std::vector<MergeTerm>& terms = own.head_merges[static_cast<size_t>(g)];
    job.plan->merges.insert(job.plan->merges.end(), terms.begin(), terms.end());
    total.first += counts[static_cast<size_t>(g)].first;
    total.second += counts[static_cast<size_t>(g)].second;
  }
  return total;
}

void ComposedPolicy::keep_head(const LayerJob& job, int g, SelectScratch& sc) const {
  HeadView h;
  h.layer = job.layer;
  h.il = job.il;
  h.head = g;
  h.n = job.n;
  h.S = job.S;
  h.next = job.next;
  h.queries = &job.cache->queries(job.il);
  int32_t* keep = job.plan->keep_of(g);
  if (!prompt_scorer_ || !job.prompt_pass) {
    keeper_.keep(h, scorer(), sc, keep);
    return;
  }
  // The prompt's compaction (prompt_ranking=window) is SnapKV's, with the policy's sinks kept.
  const KeepShape s = prompt_keeper_.shape(job.S);
  const int end = job.n - s.recent;
  float* pooled = sc.score.data();
  prompt_scorer_->score(h, s.sinks, end, sc, pooled);
  prompt_keeper_.keep_ranked(pooled, job.n, job.S, sc, keep);
  if (cfg_.pscore == PromptScore::kWindow) {
    // prompt_scores=window: the pooled scores become the slots' accumulated scores (in place),
    // as attention per query (the window's sums over its queries; expected attention is one
    // query's already).
    const int per = cfg_.prompt == PromptScore::kExpected
                        ? 1
                        : std::min(cfg_.window, job.pass->n_tokens);
    window_scores(pooled, job.layer->pos(g), s.sinks, end, per, job.next, pooled);
    job.cache->replace_scores(job.il, g, s.sinks, end - s.sinks, pooled + s.sinks);
  }
}

void ComposedPolicy::keep_shared(const LayerJob& job, SelectScratch& sc) const {
  const KvLayer& L = *job.layer;
  const int G = job.G;
  const size_t cells = static_cast<size_t>(L.held_slots());  // bounded: no growth once steady
  if (sc.head_score.size() < cells) sc.head_score.resize(cells);
  if (sc.head_keep.size() < cells) sc.head_keep.resize(cells);
  sc.head_n.resize(static_cast<size_t>(G));
  sc.head_off.resize(static_cast<size_t>(G));
  sc.head_count.resize(static_cast<size_t>(G));
  const int r = keeper_.shape(job.S).recent;  // (the candidates end where the recent slots begin)
  // Each head's candidate scores, as its uniform selector ranks them.
  HeadView h;
  h.layer = &L;
  h.il = job.il;
  h.S = job.S;
  h.next = job.next;
  h.queries = &job.cache->queries(job.il);
  int32_t off = 0;
  for (int g = 0; g < G; ++g) {
    const int n_g = L.n_slot(g);
    sc.head_n[static_cast<size_t>(g)] = n_g;
    sc.head_off[static_cast<size_t>(g)] = off;
    float* dst = sc.head_score.data() + off;
    off += n_g;
    h.head = g;
    h.n = n_g;
    const float* s = base_scorer_->score(h, 0, n_g - r, sc, dst);
    if (s != dst) std::copy_n(s, n_g - r, dst);
  }
  CompactionPlan& plan = *job.plan;
  select_ada(cfg_, sc.head_score.data(), sc.head_off.data(), sc.head_n.data(), G, job.S,
             sc.head_keep.data(), sc.head_count.data(), sc);
  plan.reset_heads(G, sc.head_count.data());
  for (int g = 0; g < G; ++g) {
    std::copy_n(sc.head_keep.data() + sc.head_off[static_cast<size_t>(g)],
                sc.head_count[static_cast<size_t>(g)], plan.keep_of(g));
  }
}

}  // namespace d2o
