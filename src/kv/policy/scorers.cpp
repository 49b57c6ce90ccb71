// The scorer registry: what scorer= of the heavy-hitter presets (h2o, d2o) takes. One line a
// scorer; its class lives in its own score_*.cpp file.
#include "kv/policy/scorer.h"
#include "kv/policy/spec_keys.h"

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

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kAggWords = {"sum", "mean", "max"};

// The scorers' names (scorer_defs()), as the scorer= key's words.
const std::vector<const char*>& scorer_words() {
  static const std::vector<const char*> words = [] {
    std::vector<const char*> w;
    for (const ScorerDef& d : scorer_defs()) w.push_back(d.name);
    return w;
  }();
  return words;
}

std::string scorer_words_list() {
  std::string s;
  for (const char* w : scorer_words()) s += (s.empty() ? "" : ", ") + std::string(w);
  return s;
}
}  // namespace

// The scorers' shared keys: which one ranks (scorer=), how a KV head's query heads' attention is
// combined (agg=), and whether merged slots count once per token they stand for
// (proportional_attention=).
std::vector<KeyDef> scorer_keys() {
  KeyDef scorer = {"scorer",
                   [](std::string_view key, std::string_view v, PolicyConfig& c) {
                     if (!find_scorer(v))
                       return bad_value(c.name, key, v, "one of " + scorer_words_list());
                     c.scorer = std::string(v);
                     return Status();
                   },
                   [](const PolicyConfig& c) { return c.scorer; }};
  scorer.words = &scorer_words();
  return {
      word_def<&PolicyConfig::mass, kOnOffWords>("proportional_attention"),
      word_def<&PolicyConfig::agg, kAggWords>("agg"),
      scorer,
  };
}

}  // namespace d2o::spec_detail
