// The scorer registry: what scorer= of the heavy-hitter presets (h2o, d2o) takes. One line a
// scorer; its class lives in its own score_*.cpp file.
#include "kv/policy/scorer.h"

namespace d2o {

const std::vector<ScorerDef>& scorer_defs() {
  static const std::vector<ScorerDef> defs = {
      {"accumulated_attention", "attention summed over every query so far (H2O)",
       make_accumulated_attention},
      {"mean_attention", "attention per query that saw the slot (RoCo)", make_mean_attention},
      {"key_diversity", "keys least like the head's mean key (KeyDiff)", make_key_diversity},
      {"value_norm", "the L2 norm of the slot's value", make_value_norm},
      {"expected_attention",
       "the attention the next queries are expected to give the slot, from the last queries' "
       "mean and covariance (Expected Attention)",
       make_expected_attention, /*reads_queries=*/true},
  };
  return defs;
}

const ScorerDef* find_scorer(std::string_view name) {
  for (const ScorerDef& d : scorer_defs())
    if (name == d.name) return &d;
  return nullptr;
}

bool reads_queries(const PolicyConfig& cfg) {
  if (cfg.selector != Selector::kHeavyRecent) return false;
  if (cfg.prompt == PromptScore::kExpected) return true;
  const ScorerDef* d = find_scorer(cfg.scorer);
  return d && d->reads_queries;
}

}  // namespace d2o
