#include "kv/policy/composed.h"

#include <algorithm>
#include <utility>

#include "core/assert.h"
#include "core/mem.h"
#include "kv/policy/budgets.h"
#include "kv/policy/select_heads.h"
#include "kv/policy/select_keydiff.h"
#include "kv/policy/similarity.h"

namespace d2o {

namespace {

// Whether layer L holds more than its budget S (per head; heads=ada: S x n_head_kv in all).
bool over_budget(const KvLayer& L, int S) {
  if (S == PolicyState::kNoBudget) return false;
  return L.uniform() ? L.n_slot() > S : L.held_slots() > int64_t{S} * L.n_head_kv();
}

// Head g's cached key norms `inv` (d2o_key_inv_norms; `last` = the position of the last slot
// covered) brought up to the slots the head holds (new slots formed; a list that does not match
// the head formed again), then reordered for this compaction's kept slots keep[0..S): the slot
// order after KvCache::apply, which the search wants. Returns the S norms; the ne evicted slots'
// norms go to evicted_inv.
const float* kept_key_norms(const KvLayer& L, int g, const int32_t* keep, int S,
                            const int32_t* evicted, int ne, std::vector<float>& inv,
                            int32_t& last, float* evicted_inv) {
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

Status ragged_error() {
  return invalid_argument(
      "KV cache heads hold different slot counts (per-head budgets, heads=ada), which this "
      "policy cannot compact (a state belongs to one policy)");
}

}  // namespace

std::unique_ptr<PolicyExtState> ComposedPolicyState::clone() const {
  auto c = std::make_unique<ComposedPolicyState>();
  c->tau = tau;
  c->tau_ready = tau_ready;
  c->layer_variance = layer_variance;
  c->key_inv = key_inv;
  c->key_inv_last = key_inv_last;
  c->keep_merges = keep_merges;
  return c;
}

ComposedPolicyState& ComposedPolicy::own_state(const KvCache& cache, PolicyState& state) const {
  ComposedPolicyState& own = state.ext_as<ComposedPolicyState>();
  if (cfg_.merger == Merger::kD2o) {
    const size_t nlg = static_cast<size_t>(cache.n_layer()) *
                       static_cast<size_t>(cache.config().n_head_kv);
    if (own.tau.size() != nlg) own.tau.assign(nlg, 0.0f);
    if (own.tau_ready.size() != nlg) own.tau_ready.assign(nlg, 0);
    if (cfg_.sim == SimOn::kKey && own.key_inv.size() != nlg) {
      own.key_inv.assign(nlg, {});
      own.key_inv_last.assign(nlg, 0);
    }
  }
  return own;
}

void ComposedPolicy::refresh_key_norms(const KvCache& cache, int il, const CompactionPlan& plan,
                                       ComposedPolicyState& own) const {
  if (own.key_inv.empty() || plan.merges.empty()) return;
  const KvLayer& L = cache.layer(il);
  const size_t G = static_cast<size_t>(L.n_head_kv());
  for (const MergeTerm& t : plan.merges) {
    if (t.src != t.dst) continue;  // one term per merge group has src == dst
    std::vector<float>& inv =
        own.key_inv[static_cast<size_t>(il) * G + static_cast<size_t>(t.head)];
    if (static_cast<int>(inv.size()) != L.n_slot(t.head)) continue;  // not kept for this head
    // The merged slot's index after the gather: its place in the ascending keep list.
    const int32_t* keep = plan.keep_of(t.head);
    const int j =
        static_cast<int>(std::lower_bound(keep, keep + plan.n_keep_of(t.head), t.dst) - keep);
    d2o_key_inv_norms(L, t.head, j, 1, inv.data() + j);
  }
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
      (cfg_.merger == Merger::kD2o &&
       own->tau.size() != nl * static_cast<size_t>(cache.config().n_head_kv))) {
    return internal_error("KV policy '" + cfg_.name +
                          "': compact_layer called in a state that does not allow it");
  }
  const int budget = state.budgets[static_cast<size_t>(il)];
  if (!cache.layer(il).uniform() && cfg_.heads != HeadRule::kAda) return ragged_error();
  if (!over_budget(cache.layer(il), budget)) return {};
  if (state.plans.size() != nl) state.plans.resize(nl);
  if (own->scratch.empty()) own->scratch.resize(1);
  plan_layer(cache, il, state, *own, own->scratch[0], pass, pass.pool);
  own->probe.dot_layer = -1;  // read once, by this layer's planning
  cache.apply(il, state.plans[static_cast<size_t>(il)], pass.pool);
  refresh_key_norms(cache, il, state.plans[static_cast<size_t>(il)], *own);
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
    own->probe.dot_layer = -1;
    if (!layered) std::fill(own->probe.slot.begin(), own->probe.slot.end(), -1);
  }
  const int L = cache.n_layer();
  const size_t nl = static_cast<size_t>(L);
  if (state.budgets_set && state.budgets.size() != nl) {
    return invalid_argument("KV policy state holds budgets for " +
                            std::to_string(state.budgets.size()) + " layers but the cache has " +
                            std::to_string(L) + " (a state belongs to one sequence)");
  }
  if (cfg_.pos == PosMode::kShift && cache.config().has_sliding()) {
    // Shifting positions would have to re-rotate the sliding-window layers' keys too, with their
    // own RoPE; not supported.
    return unsupported(
        "KV policy '" + cfg_.name +
        "' with positions=shifted cannot run on a model with sliding-window layers (use "
        "positions=original)");
  }
  if (cache.config().type.rot_k &&
      (cfg_.pos == PosMode::kShift ||
       (cfg_.merger == Merger::kD2o && cfg_.mspace == MergeSpace::kUnrotated))) {
    // RoPE applied to a stored key does not commute with the rotation of rotated storage.
    return unsupported(
        "KV policy '" + cfg_.name + "' with " +
        (cfg_.pos == PosMode::kShift ? "positions=shifted" : "merge_keys=unrotated") +
        " re-rotates stored keys by RoPE, which rotated key storage (" +
        kv_type_name(cache.config().type) +
        ") does not allow (use positions=original / merge_keys=rotated or a type without r)");
  }
  if (cfg_.heads != HeadRule::kAda) {
    for (int il = 0; il < L; ++il)
      if (!cache.layer(il).uniform()) return ragged_error();
  }
  if (cfg_.pos == PosMode::kShift && !pass.rope) {
    return invalid_argument(
        "KV policy '" + cfg_.name +
        "' with positions=shifted needs the model's RoPE parameters (PassInfo::rope)");
  }
  if (cfg_.merger == Merger::kD2o && cfg_.mspace == MergeSpace::kUnrotated &&
      (!pass.rope || pass.rope->head_dim != cache.config().head_dim)) {
    return invalid_argument(
        "KV policy '" + cfg_.name +
        "' with merge_keys=unrotated needs the model's RoPE parameters (PassInfo::rope) "
        "for the cache's head size");
  }
  if (cfg_.pos == PosMode::kShift && pass.rope->head_dim != cache.config().head_dim) {
    return invalid_argument("KV policy '" + cfg_.name + "' with positions=shifted: RoPE head_dim " +
                            std::to_string(pass.rope->head_dim) + " does not match the cache's " +
                            std::to_string(cache.config().head_dim));
  }
  if (state.evicted.size() != nl) state.evicted.assign(nl, 0);
  if (state.merged.size() != nl) state.merged.assign(nl, 0);
  ComposedPolicyState& own = own_state(cache, state);

  if (!state.budgets_set) {
    // Prompt-then-compress compresses the whole prompt: when it is prefilled in chunks, the first
    // compaction waits for the pass that ends it (PassInfo::prompt_rest).
    if (cfg_.mode == BudgetMode::kRatio && pass.prompt_rest > 0) return {};
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
    LayerBudgets lb;
    decide_budgets(cfg_, cache, n, lb);
    state.budgets = std::move(lb.budgets);
    own.layer_variance = std::move(lb.variance);
    state.budgets_set = true;
  } else if (!cfg_.compacts_after_first()) {
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
    refresh_key_norms(cache, il, state.plans[static_cast<size_t>(il)], own);
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

void ComposedPolicy::plan_layer(KvCache& cache, int il, PolicyState& state,
                                ComposedPolicyState& own, ComposedScratch& sc,
                                const PassInfo& pass, ThreadPool* heads) const {
  const KvLayer& L = cache.layer(il);
  const int n = L.n_slot(), G = L.n_head_kv(), S = state.budgets[static_cast<size_t>(il)];
  D2O_ASSERT(S >= 0 && S < n);
  CompactionPlan& plan = state.plans[static_cast<size_t>(il)];
  const bool ada = cfg_.heads == HeadRule::kAda;
  // In a batch, a sequence's slot lists were last touched a whole step ago, and the dots its
  // attention formed for the probe have since made way for the other sequences' keys: the lists
  // this compaction reads, asked for together rather than one miss after another.
  const bool d2o_norms =
      cfg_.merger == Merger::kD2o && own.key_inv.size() == static_cast<size_t>(cache.n_layer()) * G;
  for (int g = 0; g < G; ++g) {
    const size_t b = static_cast<size_t>(L.n_slot(g)) * sizeof(float);
    prefetch_start(L.score(g), b);
    prefetch_start(L.pos(g), b);
    prefetch_start(L.rows(g), b);
    prefetch_start(L.merged(g), b);
    if (d2o_norms) {
      const std::vector<float>& inv = own.key_inv[static_cast<size_t>(il) * G + g];
      prefetch_start(inv.data(), inv.size() * sizeof(float));
    }
    if (own.probe.dot_layer == il && own.probe.dot_n == L.n_slot(g))
      prefetch_start(own.probe.dot.data() + static_cast<size_t>(g) * own.probe.dot_n, b);
  }
  if (ada) {
    plan_heads(L, sc.select, plan, S, pass.n_past - state.pos_shift);
  } else {
    plan.reset(G, S);
  }
  plan.merged_score = cfg_.mscore;
  // The prompt's compaction: the sequence's first, after a pass of more than one token (a token
  // by token feed has none). prompt_ranking=window ranks its heavy hitters by the window's
  // attention; with prompt_merge=off it only evicts.
  const bool prompt_pass = state.n_compactions == 0 && pass.n_tokens > 1;
  // (No compaction has run, so no kept key norms exist that skipping the merges could leave stale.)
  const bool d2o = cfg_.merger == Merger::kD2o && (cfg_.prompt_merge || !prompt_pass);
  // A decode step's terms fit without growth, in exactly what state_bytes reserves.
  release_merges(plan);
  if (d2o && plan.merges.capacity() < kKeptTermsPerHead * static_cast<size_t>(G))
    plan.merges.reserve(kKeptTermsPerHead * static_cast<size_t>(G));
  const RopeParams* unrotate = d2o && cfg_.mspace == MergeSpace::kUnrotated ? pass.rope : nullptr;
  plan.rope = unrotate;
  if (cfg_.pos == PosMode::kShift) {
    // Sinks keep their positions; the recent slots after them move down by the n - S removed.
    plan.shift.first_slot = std::min(cfg_.sinks, S);
    plan.shift.by = n - S;
    plan.shift.rope = pass.rope;
  }
  // merge_decision=per_token: every head's nearest neighbours first, then one decision per evicted
  // index.
  const bool by_token =
      d2o && cfg_.decide == MergeDecision::kToken && cfg_.merge != MergeRule::kOff;
  const int E = n - S;
  auto size_scratch = [&](ComposedScratch& hs) {
    D2oScratch& dsc = hs.d2o;
    if (by_token) {
      const size_t ge = static_cast<size_t>(G) * static_cast<size_t>(E);
      if (dsc.evicted.size() < ge) dsc.evicted.resize(ge);
      if (dsc.best.size() < ge) dsc.best.resize(ge);
      if (dsc.best_sim.size() < ge + static_cast<size_t>(E)) dsc.best_sim.resize(ge + E);
      if (dsc.merge.size() < static_cast<size_t>(E)) dsc.merge.resize(static_cast<size_t>(E));
    } else if (d2o && dsc.evicted.size() < static_cast<size_t>(n)) {
      dsc.evicted.resize(static_cast<size_t>(n));
    }
    SelectScratch& ssc = hs.select;
    if (ssc.order.size() < static_cast<size_t>(n)) ssc.order.resize(static_cast<size_t>(n));
    if (ssc.score.size() < static_cast<size_t>(n)) ssc.score.resize(static_cast<size_t>(n));
  };
  D2oScratch& dsc = sc.d2o;
  auto head_merge = [&](int g, const int32_t* evicted, int ne) {
    const size_t ti = static_cast<size_t>(il) * G + static_cast<size_t>(g);
    D2oHeadMerge h;
    h.cfg = &cfg_;
    h.layer = &L;
    h.head = g;
    h.keep = plan.keep_of(g);
    h.n_keep = plan.n_keep_of(g);
    h.evicted = evicted;
    h.n_evicted = ne;
    h.tau = &own.tau[ti];
    h.tau_ready = &own.tau_ready[ti];
    h.rope = unrotate;
    return h;
  };

  // One head: its kept slots, and for D2O its merges (appended to `terms`), with scratch `hs`.
  // Heads share nothing but the layer they read, so they may run in parallel. Returns the
  // evicted and merged slot counts.
  auto plan_head = [&](int g, ComposedScratch& hs, std::vector<MergeTerm>& terms) {
    D2oScratch& hd = hs.d2o;
    SelectScratch& ssc = hs.select;
    int32_t* keep = plan.keep_of(g);
    // Per-head budgets (plan_heads): head g holds n_g and keeps S_g; uniform: n and S.
    const int n_g = L.n_slot(g), S_g = plan.n_keep_of(g);
    int64_t merged_g = 0;
    if (!ada) {  // (per-head budgets: plan_heads selected every head's slots above)
      switch (cfg_.selector) {
        case Selector::kSinkRecent:
          select_sink_recent(n, S, cfg_.sinks, keep);
          break;
        case Selector::kHeavyRecent: {
          const float* score = L.score(g);
          if (cfg_.prompt == PromptScore::kWindow && prompt_pass) {
            // The prompt's compaction is SnapKV's, with the policy's sinks kept.
            const int t = std::min(cfg_.sinks, S), w = std::min(cfg_.window, S - t);
            pool_window(L.window(g), n - w, cfg_.kernel, cfg_.pool, ssc.score.data());
            select_snap(ssc.score.data(), n, S, w, keep, ssc.order.data(), cfg_.sinks);
            if (cfg_.pscore == PromptScore::kWindow) {  // (the pooled scores, in place)
              window_scores(ssc.score.data(), L.pos(g), t, n - w,
                            std::min(cfg_.window, pass.n_tokens), pass.n_past - state.pos_shift,
                            ssc.score.data());
              cache.replace_scores(il, g, t, n - w - t, ssc.score.data() + t);
            }
            break;
          }
          if (cfg_.norm == ScoreNorm::kQueries) {
            // Mean attention: the slot at position p was seen by the queries at p .. next - 1.
            const int64_t next = pass.n_past - state.pos_shift;
            if (cfg_.distinct == 0.0) {
              select_heavy_recent_mean(score, L.pos(g), next, n, S, cfg_, keep, ssc.order.data(),
                                       ssc.score.data());
              break;
            }
            mean_attention(score, L.pos(g), n, next, ssc.score.data());
            score = ssc.score.data();
          }
          if (cfg_.distinct > 0.0) score = guard_distinct(L, g, score, n, S, cfg_, ssc);
          select_heavy_recent(score, n, S, cfg_, keep, ssc.order.data());
          break;
        }
        case Selector::kSnapWindow: {
          const int w = std::min(cfg_.window, S);
          pool_window(L.window(g), n - w, cfg_.kernel, cfg_.pool, ssc.score.data());
          select_snap(ssc.score.data(), n, S, cfg_.window, keep, ssc.order.data());
          break;
        }
        case Selector::kKeyDiff:
          select_keydiff(L, g, S, cfg_, keep, ssc);
          break;
      }
    }
    if (d2o) {
      // Evicted = the complement of keep, ascending.
      int32_t* evicted = hd.evicted.data() + (by_token ? static_cast<size_t>(g) * E : 0);
      int ne = 0;
      if (n_g - S_g == 1) {
        // A decode step: the evicted slot is the first gap in keep (or the last slot). keep is
        // ascending with keep[j] == j before the gap and j + 1 from it on: a binary search.
        evicted[ne++] = static_cast<int32_t>(
            std::partition_point(keep, keep + S_g,
                                 [keep](const int32_t& v) { return v == &v - keep; }) -
            keep);
      } else {
        for (int j = 0, k = 0; j < n_g; ++j) {
          if (k < S_g && keep[k] == j)
            ++k;
          else
            evicted[ne++] = j;
        }
      }
      D2oHeadMerge h = head_merge(g, evicted, ne);
      float evicted_inv[kD2oFewEvicted];  // (d2o_uses_kept_norms)
      if (own.key_inv.size() == static_cast<size_t>(cache.n_layer()) * G) {
        const size_t ti = static_cast<size_t>(il) * G + static_cast<size_t>(g);
        if (d2o_uses_kept_norms(cfg_, ne, unrotate != nullptr) && cfg_.merge != MergeRule::kOff) {
          h.kept_inv = kept_key_norms(L, g, keep, S_g, evicted, ne, own.key_inv[ti],
                                      own.key_inv_last[ti], evicted_inv);
          h.evicted_inv = evicted_inv;
          if (d2o_decode_dots(cfg_, L, ne, unrotate != nullptr)) {
            const float* dots = probe_dots(own.probe, L, il, g, evicted[0]);
            h.all_dots = dots;
            h.all_dots_scale = own.probe.dot_scale;
            (dots ? own.probe_used : own.probe_missed).fetch_add(1, std::memory_order_relaxed);
          }
        } else if (ne > 0) {
          own.key_inv[ti].clear();  // formed again when next needed
        }
      }
      if (by_token) {
        const size_t off = static_cast<size_t>(g) * E;
        d2o_nearest(h, hd, hd.best.data() + off, hd.best_sim.data() + off);
      } else {
        merged_g += plan_d2o_merges(h, hd, terms);
      }
    } else if (cfg_.merger == Merger::kCam) {
      const int t = std::min(cfg_.sinks, S);
      CamHeadMerge h;
      h.cfg = &cfg_;
      h.cache = &cache;
      h.il = il;
      h.head = g;
      h.first_evicted = t;
      h.end_evicted = n - (S - t);
      merged_g += cam_merge_values(h, hs.cam);
    }
    return std::pair<int64_t, int64_t>{n_g - S_g, merged_g};
  };

  int64_t merged = 0, evicted_all = 0;
  // In parallel: uniform budgets, heads deciding alone, no CaM (it writes values while planning).
  const int threads = heads && !ada && !by_token && cfg_.merger != Merger::kCam && G > 1
                          ? std::min(heads->n_threads(), G)
                          : 1;
  if (threads > 1) {
    if (own.scratch.size() < static_cast<size_t>(threads))
      own.scratch.resize(static_cast<size_t>(threads));
    if (own.head_merges.size() < static_cast<size_t>(G))
      own.head_merges.resize(static_cast<size_t>(G));
    for (int t = 0; t < threads; ++t) size_scratch(own.scratch[static_cast<size_t>(t)]);
    std::vector<std::pair<int64_t, int64_t>>& counts = own.head_counts;
    counts.assign(static_cast<size_t>(G), {0, 0});
    heads->run(G, [&](int64_t g, int thread) {
      std::vector<MergeTerm>& terms = own.head_merges[static_cast<size_t>(g)];
      terms.clear();
      counts[static_cast<size_t>(g)] = plan_head(static_cast<int>(g),
                                                 own.scratch[static_cast<size_t>(thread)], terms);
    });
    for (int g = 0; g < G; ++g) {  // the serial order: head by head
      const std::vector<MergeTerm>& terms = own.head_merges[static_cast<size_t>(g)];
      plan.merges.insert(plan.merges.end(), terms.begin(), terms.end());
      evicted_all += counts[static_cast<size_t>(g)].first;
      merged += counts[static_cast<size_t>(g)].second;
    }
  } else {
    size_scratch(sc);
    for (int g = 0; g < G; ++g) {
      const auto [e, m] = plan_head(g, sc, plan.merges);
      evicted_all += e;
      merged += m;
    }
  }
  if (by_token && E > 0 && S > 0) {
    // The research code's rule: the mean over the heads of the i-th evicted slot's similarity
    // against one threshold per layer (kept in head 0's entry).
    float* mean = dsc.best_sim.data() + static_cast<size_t>(G) * E;
    for (int i = 0; i < E; ++i) {
      double a = 0.0;
      for (int g = 0; g < G; ++g) a += dsc.best_sim[static_cast<size_t>(g) * E + i];
      mean[i] = static_cast<float>(a / G);
    }
    const size_t ti = static_cast<size_t>(il) * G;
    const int n_merge = d2o_decide(cfg_, mean, E, &own.tau[ti], &own.tau_ready[ti],
                                   dsc.merge.data());
    if (n_merge > 0) {
      for (int g = 0; g < G; ++g) {
        const size_t off = static_cast<size_t>(g) * E;
        d2o_emit(head_merge(g, dsc.evicted.data() + off, E), dsc, dsc.best.data() + off,
                 dsc.best_sim.data() + off, dsc.merge.data(), plan.merges);
      }
      merged += static_cast<int64_t>(n_merge) * G;
    }
  }
  state.evicted[static_cast<size_t>(il)] += evicted_all;
  state.merged[static_cast<size_t>(il)] += merged;
}

void ComposedPolicy::plan_heads(const KvLayer& L, SelectScratch& sc, CompactionPlan& plan, int S,
                                int64_t next) const {
  const int G = L.n_head_kv();
  const size_t cells = static_cast<size_t>(L.held_slots());  // bounded: no growth once steady
  if (sc.head_score.size() < cells) sc.head_score.resize(cells);
  if (sc.head_keep.size() < cells) sc.head_keep.resize(cells);
  sc.head_n.resize(static_cast<size_t>(G));
  sc.head_off.resize(static_cast<size_t>(G));
  sc.head_count.resize(static_cast<size_t>(G));
  int t = 0, r = 0, k = 0;
  ada_protected(cfg_, S, &t, &r, &k);
  // Each head's scores as its uniform selector ranks them.
  int32_t off = 0;
  for (int g = 0; g < G; ++g) {
    const int n_g = L.n_slot(g);
    sc.head_n[static_cast<size_t>(g)] = n_g;
    sc.head_off[static_cast<size_t>(g)] = off;
    float* dst = sc.head_score.data() + off;
    off += n_g;
    if (cfg_.selector == Selector::kSnapWindow) {
      pool_window(L.window(g), n_g - r, cfg_.kernel, cfg_.pool, dst);
    } else if (cfg_.norm == ScoreNorm::kQueries) {
      mean_attention(L.score(g), L.pos(g), n_g, next, dst);
    } else {
      std::copy_n(L.score(g), n_g, dst);
    }
  }
  select_ada(cfg_, sc.head_score.data(), sc.head_off.data(), sc.head_n.data(), G, S,
             sc.head_keep.data(), sc.head_count.data(), sc);
  plan.reset_heads(G, sc.head_count.data());
  for (int g = 0; g < G; ++g) {
    std::copy_n(sc.head_keep.data() + sc.head_off[static_cast<size_t>(g)],
                sc.head_count[static_cast<size_t>(g)], plan.keep_of(g));
  }
}

}  // namespace d2o
