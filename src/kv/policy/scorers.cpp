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
  };
  return defs;
}

const ScorerDef* find_scorer(std::string_view name) {
  for (const ScorerDef& d : scorer_defs())
    if (name == d.name) return &d;
  return nullptr;
}

}  // namespace d2o
