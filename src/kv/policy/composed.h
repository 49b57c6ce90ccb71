// ComposedPolicy: the one KvPolicy implementation behind every preset, executing a PolicyConfig
// (budget rule x selector x merger, see config.h) after each forward pass of a sequence.
//
// compact(), per pass:
//   1. First compaction (budgets not set yet): ratio mode triggers on the sequence's first call;
//      budget mode as soon as the layers hold more than B slots. The per-layer budgets are then
//      decided once from the n slots every layer holds (budgets.h) and kept for the sequence.
//   2. Every layer holding more than its budget S_l is compacted back to S_l: the selector picks
//      S_l slots per KV head, the merger folds evicted slots into kept ones (D2O: through the
//      CompactionPlan's merge terms; CaM: values updated in place), KvCache::apply gathers.
//      SnapKV / PyramidKV in ratio mode compact only at the first compaction.
//   3. StreamingLLM with pos=shift re-rotates the kept recent keys by -r (r = slots removed) and
//      raises PolicyState::pos_shift by r, so positions stay contiguous.
// Everything mutable lives in PolicyState; the policy object is const and shareable.
#pragma once

#include <string>

#include "kv/policy.h"
#include "kv/policy/config.h"

namespace d2o {

class ComposedPolicy final : public KvPolicy {
 public:
  explicit ComposedPolicy(PolicyConfig cfg) : cfg_(std::move(cfg)) {}

  const PolicyConfig& config() const { return cfg_; }
  std::string spec() const override;
  StatsNeeds needs() const override;
  Status compact(KvCache& cache, PolicyState& state, const PassInfo& pass) const override;
  // After the first compaction (budgets decided), every layer is compacted on its own, unless
  // positions are shifted (one shift per pass for all layers).
  bool compacts_per_layer(const PolicyState& state) const override;
  Status compact_layer(KvCache& cache, PolicyState& state, const PassInfo& pass,
                       int il) const override;
  int64_t peak_slots(int64_t n_prompt, int64_t n_total, int max_chunk) const override;
  int64_t peak_slots_for(const FeedPlan& plan) const override;

 private:
  // Selection and merge planning of one layer into state.plans[il] (CaM also updates values).
  void plan_layer(KvCache& cache, int il, PolicyState& state, PolicyScratch& scratch,
                  const PassInfo& pass) const;
  void shift_positions(KvLayer& layer, int removed, PolicyScratch& scratch,
                       const RopeParams& rope) const;

  PolicyConfig cfg_;
};

// The canonical spec string of a configuration (spec.cpp).
std::string format_policy_spec(const PolicyConfig& cfg);

}  // namespace d2o
