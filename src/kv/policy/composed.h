// ComposedPolicy: the one KvPolicy implementation behind every preset, executing a PolicyConfig
// (budget rule x selector x merger, see config.h) after each forward pass of a sequence.
//
// compact(), per pass:
//   1. First compaction (budgets not set yet): ratio mode triggers on the pass that ends the
//      sequence's first prompt (prefill=bounded: on the first pass whose layers hold more than
//      rho of the prompt's whole length, fed and announced); budget mode as soon as the layers
//      hold more than B slots. The per-layer budgets are then decided once from the n slots
//      every layer holds (budgets.h) and kept for the sequence.
//   2. Every layer holding more than its budget S_l is compacted back to S_l: the selector picks
//      S_l slots per KV head, the merger folds evicted slots into kept ones (D2O: the
//      CompactionPlan's merge terms; CaM: KvCache::replace_value), KvCache::apply gathers.
//      SnapKV / PyramidKV in ratio mode compact only at the first compaction (prefill=bounded:
//      until the end of the prompt that decided the budgets).
//      heads=ada (select_heads.h): the layer keeps S_l x n_head_kv slots shared over its heads
//      by score, with a floor per head; heads then hold different counts (KvLayer::n_slot(h)).
//   3. StreamingLLM with positions=shifted: the plan also moves the kept recent slots'
//      positions down by r (r = slots removed), keys re-rotated (CompactionPlan::shift), and
//      compact() raises PolicyState::pos_shift by r, so positions stay contiguous.
// Everything mutable lives in PolicyState (the common part, and ComposedPolicyState); the policy
// object is const and shareable.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "kv/policy.h"
#include "kv/policy/config.h"
#include "kv/policy/keeper.h"
#include "kv/policy/merge_cam.h"
#include "kv/policy/merge_d2o.h"
#include "kv/policy/merger.h"
#include "kv/policy/scorer.h"
#include "kv/policy/select.h"

namespace d2o {

// Scratch of one thread of a compaction, one part per component.
struct ComposedScratch {
  SelectScratch select;
  D2oScratch d2o;
  CamScratch cam;
};

// The composed policies' own per-sequence state (PolicyState::ext).
class ComposedPolicyState final : public PolicyExtState {
 public:
  // The merger's own state (D2O's: D2oMergeState, merge_d2o.h); null without a merger or
  // before its first compaction.
  std::unique_ptr<MergerState> merger;
  // The density statistic of each layer when budgets were decided ([n_layer], empty when the
  // policy accumulates no scores): what D2O's variance rule shares budgets by, kept for reports.
  std::vector<double> layer_variance;
  // [threads] per-thread scratch; grows to the largest step seen, so a steady-state decode step
  // allocates nothing, and is released after a pass that evicted more slots from a head than a
  // decode step does (compact()).
  std::vector<ComposedScratch> scratch;
  // Scratch too, [n_head_kv]: each head's merge terms and its evicted and merged counts when a
  // layer's heads are planned in parallel (compact_layer with a pool).
  std::vector<std::vector<MergeTerm>> head_merges;
  std::vector<std::pair<int64_t, int64_t>> head_counts;
  // Keeps every pass's merge lists in its plans until the layer's next planning, for a reader of
  // them (tests); otherwise a list longer than a decode step's is released after its pass.
  bool keep_merges = false;
  // PassInfo::n_past at which the prompt whose compaction decided the budgets ends (the pass's
  // n_past plus the tokens it announced): prefill=bounded compacts a SnapKV-style policy, which
  // otherwise evicts at its first compaction only, until then.
  int64_t prompt_end = 0;
  // [n_layer] the budgets compression under memory pressure stops at (compress_step): the
  // policy's own, decided at its first step; empty before it.
  std::vector<int> pressure_floor;

  // The state without the scratch (scratch, head_merges, head_counts).
  std::unique_ptr<PolicyExtState> clone() const override;
  // Layer statistics and the merger's state (not the scratch).
  size_t bytes() const override;
};

// The ComposedPolicyState of a sequence's state, or null (another policy, or none created yet).
inline const ComposedPolicyState* composed_state(const PolicyState& s) {
  return s.ext_if<ComposedPolicyState>();
}
// The D2O merger's state of a sequence's state, or null (another merger, or none yet).
inline const D2oMergeState* d2o_merge_state(const PolicyState& s) {
  const ComposedPolicyState* own = composed_state(s);
  return own ? d2o_merge_state(own->merger.get()) : nullptr;
}

class ComposedPolicy final : public KvPolicy {
 public:
  // Builds the configuration's parts: its scorer and keeper (and the prompt phase's), its merger.
  explicit ComposedPolicy(PolicyConfig cfg);

  const PolicyConfig& config() const { return cfg_; }
  std::string spec() const override;
  StatsNeeds needs() const override;
  StatsNeeds pass_needs(const PolicyState& state, bool recalls = false) const override;
  Status compact(KvCache& cache, PolicyState& state, const PassInfo& pass) const override;
  // Halves every compressible layer down to the budgets decided at the first step (kept in
  // ComposedPolicyState::pressure_floor; a state that decided its budgets otherwise, as a
  // sequence compacted by compact() did, stops at those).
  Result<bool> compress_step(KvCache& cache, PolicyState& state,
                             const PassInfo& pass) const override;
  // After the first compaction (budgets decided), every layer is compacted on its own, unless
  // positions are shifted (one shift per pass for all layers).
  bool compacts_per_layer(const PolicyState& state) const override;
  Status compact_layer(KvCache& cache, PolicyState& state, const PassInfo& pass,
                       int il) const override;
  // prompt_ranking=reconstruction, ratio mode, before the first compaction: kReconstructionChunk.
  int reconstruction_chunk(const PolicyState& state) const override;
  ColdTierConfig cold_tier() const override;
  // Slots a turn may recall into a layer's head above its budget (0 without a cold tier).
  int64_t recall() const { return cfg_.cold.enabled() ? cfg_.cold.max_recall() : 0; }
  static constexpr int kReconstructionChunk = 256;
  bool reconstructs() const {
    return cfg_.prompt == PromptScore::kReconstruction && cfg_.mode == BudgetMode::kRatio;
  }
  int64_t peak_slots(int64_t n_prompt, int64_t n_total, int max_chunk) const override;
  int64_t peak_slots_for(const FeedPlan& plan) const override;
  int64_t one_layer_extra_for(const FeedPlan& plan) const override;
  // The most slots one KV head of a layer holds right after a compaction to a budget of S per
  // head: S, or with per-head budgets (heads=ada) what the head may win from the other
  // n_head_kv - 1 heads on top of S (-1 when n_head_kv is unknown, 0).
  int64_t head_peak_after_compaction(int64_t S, int n_head_kv) const;
  // peak_slots_for() with `recall` slots a layer may recall (every layer at once, or 0 where one
  // layer at a time recalls: one_layer_extra_for()).
  int64_t peak_with_recall(const FeedPlan& plan, int64_t recall) const;
  // Whether a turn's recall is compacted layer by layer (Engine::after_attention: each layer
  // hands its recalled slots back before the next layer recalls).
  bool recalls_layer_by_layer() const;
  // Every composed policy: each compressible layer's plan, kept between passes (its list of kept
  // slots; with per-head budgets, the heads' counts). D2O also: a decode step's merge list per
  // layer, and with key similarity its key norms per slot of every compressible layer and the
  // probe's dots of one layer, with its armed slots and keys; its thresholds.
  size_t state_bytes(const KvCacheConfig& cfg, int64_t slots) const override;
  // Merge terms a layer's plan keeps between passes, per KV head: one decode step's (a kept slot
  // and the one merged into it). A longer list is released after compact_layer() applies it, after
  // compact() applies one of a pass that evicted more than 64 slots a head, and otherwise at the
  // layer's next planning.
  static constexpr size_t kKeptTermsPerHead = 2;
  // D2O with key similarity, heavy hitters and one threshold per head (uniform budgets), keys
  // compared as stored: the state's probe, armed at each layer's compaction.
  AttnProbe* attention_probe(PolicyState& state) const override;
  // Tests: whether attention_probe() hands the probe out (outputs are the same either way).
  void set_attention_probe(bool on) { probe_on_ = on; }

 private:
  bool probes() const;
  // After layer il's compaction: the slot each of its heads would evict at the next one-token
  // pass if that pass did not change the scores' order (`next`: this pass's query count for
  // mean attention, n_past - pos_shift).
  void arm_probe(const KvCache& cache, int il, const PolicyState& state, ComposedPolicyState& own,
                 int64_t next) const;
  bool probe_on_ = true;
  // What compact() refuses before touching anything: a cache or a pass the configuration cannot
  // run on (composed_check.cpp).
  Status check(const KvCache& cache, const PolicyState& state, const PassInfo& pass) const;
  static Status ragged_error();
  // The first compaction: the per-layer budgets, once every compressible layer holds the whole
  // prompt (ratio mode) or more than the budget (budget mode); *decided false: not yet.
  Status decide_layer_budgets(const KvCache& cache, PolicyState& state, ComposedPolicyState& own,
                              const PassInfo& pass, bool* decided) const;
  // Plans the layers in state.todo (in parallel on pass.pool) and applies the plans.
  Status compact_todo(KvCache& cache, PolicyState& state, ComposedPolicyState& own,
                      const PassInfo& pass) const;
  // Applies the plans of the layers in state.todo in layer order, counts the pass and releases
  // what a long pass left (merge lists, search scratch).
  Status apply_plans(KvCache& cache, PolicyState& state, ComposedPolicyState& own) const;
  // Selection and merge planning of one layer into state.plans[il] (CaM also replaces values of
  // the layer's kept slots). heads: a pool to plan the layer's KV heads on in parallel
  // (compact_layer outside any pool task), or null.
  void plan_layer(KvCache& cache, int il, PolicyState& state, ComposedPolicyState& own,
                  ComposedScratch& scratch, const PassInfo& pass, ThreadPool* heads) const;
  // Every head of the job's layer: its kept slots, then its merges (in parallel on `heads` when
  // the parts allow it); returns the evicted and merged slot counts.
  std::pair<int64_t, int64_t> plan_heads(const LayerJob& job, ComposedScratch& sc,
                                         ThreadPool* heads) const;
  // Head g's kept slots into the job's plan (uniform budgets): the prompt phase's parts at the
  // prompt's compaction, otherwise the policy's scorer and keeper.
  void keep_head(const LayerJob& job, int g, SelectScratch& sc) const;
  // heads=ada: the kept slots of every head of the job's layer, with per-head counts.
  void keep_shared(const LayerJob& job, SelectScratch& sc) const;
  // Sizes `own` for the cache (the merger's state) and returns it.
  ComposedPolicyState& own_state(const KvCache& cache, PolicyState& state) const;
  // The scorer that ranks candidates: base_scorer_, or the distinct_share guard around it.
  const Scorer* scorer() const { return guard_ ? guard_.get() : base_scorer_.get(); }

  PolicyConfig cfg_;
  // The parts (config.h says what each preset is made of).
  std::unique_ptr<Scorer> base_scorer_;  // null: the keeper ranks nothing (sinks + recent)
  std::unique_ptr<Scorer> guard_;        // distinct_share=, around base_scorer_
  Keeper keeper_;
  std::unique_ptr<Scorer> prompt_scorer_;  // prompt_ranking=window: the prompt's compaction's
  Keeper prompt_keeper_;
  std::unique_ptr<MergerPart> merger_;  // null: evicted slots are dropped
};

// The attention's dots of slot e's key with every slot of head g of layer il, formed by the pass
// for that slot (AttnProbe), or null (composed_probe.cpp).
const float* attention_probe_dots(const AttnProbe& P, const KvLayer& L, int il, int g, int e);

// The canonical spec string of a configuration (spec.cpp).
std::string format_policy_spec(const PolicyConfig& cfg);

}  // namespace d2o
