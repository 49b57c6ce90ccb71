// The presets as lists of parts (presets.h). A new method is one more entry of presets(): the
// parts it is made of, each with the values it starts from; its spec keys follow from its parts.
#include "kv/policy/presets.h"

#include <algorithm>
#include <utility>

#include "core/assert.h"

namespace d2o::spec_detail {

namespace {

// ---- the parts, as presets use them ------------------------------------------------------------

PresetPart prompt_feeding() {
  return {"prompt: compressed once it is whole, or to its budget between chunks (prefill=)",
          {},
          {"prefill"}};
}

PresetPart sinks_and_recent(int sinks, std::vector<const char*> keys) {
  return {"keeper: the first slots (sinks) + the most recent ones",
          [sinks](PolicyConfig& c) {
            c.selector = Selector::kSinkRecent;
            c.sinks = sinks;
          },
          std::move(keys)};
}

PresetPart heavy_and_recent(int sinks) {
  return {"keeper: sinks + the best-scored slots (heavy hitters) + a recent window, split N:M",
          [sinks](PolicyConfig& c) {
            c.selector = Selector::kHeavyRecent;
            c.sinks = sinks;
            c.nm_n = c.nm_m = 1;
          },
          {"sinks", "heavy_recent"}};
}

PresetPart key_diversity() {
  return {"keeper + scorer: sinks + the keys least like the head's mean key + recent slots",
          [](PolicyConfig& c) {
            c.selector = Selector::kKeyDiff;
            c.sinks = 0;
            c.recent = 0;
          },
          {"sinks", "recent"}};
}

PresetPart observation_window() {
  return {
      "keeper + scorer: the last `window` slots + the rest by the last queries' pooled "
      "attention",
      [](PolicyConfig& c) { c.selector = Selector::kSnapWindow; },
      {"window", "kernel", "pool"}};
}

// The statistics every attention-ranked part reads; `scorer`: also what ranks the heavy hitters.
PresetPart attention_statistics() {
  return {"statistics: attention over the query heads of a KV head (agg=)", {}, {"agg"}};
}
PresetPart attention_scorer(const char* scorer, std::vector<const char*> keys) {
  return {std::string("scorer: ") + scorer + " (scorer=)",
          [scorer](PolicyConfig& c) { c.scorer = scorer; }, std::move(keys)};
}

PresetPart pyramid_budgets() {
  return {"layer budgets: a pyramid, the most in the first layers",
          [](PolicyConfig& c) { c.layers = LayerRule::kPyramid; },
          {"pyramid_beta"}};
}

PresetPart exact_layer_budgets() {
  return {"layer budgets: uniform, variance-driven or others (layers=), summing to the total",
          [](PolicyConfig& c) {
            c.exact_total = true;
            c.layers = LayerRule::kUniform;
          },
          {"layers"}};
}

PresetPart head_shares() {
  return {"head shares: equal, or by score over the heads of a layer (heads=ada)",
          {},
          {"heads", "floor"}};
}

PresetPart distinct_candidates() {
  return {
      "heavy-hitter places for keys unlike the mean key (distinct_share=)", {}, {"distinct_share"}};
}

PresetPart hold_after_prompt() {
  return {"after the prompt: the budget held or the cache left to grow (hold_budget=)",
          {},
          {"hold_budget"}};
}

// The prompt's own compaction (prompt_ranking=); d2o's starts from the window ranking.
PresetPart prompt_phase() {
  return {
      "prompt phase: the prompt ranked by its accumulated score, its last queries' window, "
      "or others (prompt_ranking=)",
      {},
      {"prompt_ranking", "window", "kernel", "pool", "prompt_scores"}};
}
PresetPart d2o_prompt_phase() {
  return {
      "prompt phase: the prompt ranked by its last queries' pooled attention "
      "(prompt_ranking=window), no merges there",
      [](PolicyConfig& c) {
        c.prompt = PromptScore::kWindow;
        c.kernel = 21;
        c.prompt_merge = false;
        c.pscore = PromptScore::kWindow;
      },
      {"prompt_ranking", "window", "kernel", "pool", "prompt_merge", "prompt_scores"}};
}

PresetPart expected_attention() {
  return {"expected attention's settings (future=, value_weight=)", {}, {"future", "value_weight"}};
}

PresetPart cold_tier(ColdPlace place) {
  return {place == ColdPlace::kNone
              ? "cold tier: none unless cold= asks, evicted slots kept for later turns"
              : "cold tier: evicted slots kept on disk (q8_0), recalled by each new turn (cold=)",
          [place](PolicyConfig& c) {
            c.cold.place = place;
            c.cold.type =
                c.cold.enabled() ? ColdTierConfig::default_type(place) : ColdTierConfig{}.type;
          },
          {"cold", "cold_type", "cold_size", "recall", "recall_ranking", "recall_all_up_to",
           "recall_reach"}};
}

PresetPart cam_merger() {
  return {"merger: evicted values spread over the following slots (CaM)",
          [](PolicyConfig& c) { c.merger = Merger::kCam; },
          {"merge_targets", "seed"}};
}

PresetPart d2o_merger() {
  return {
      "merger: D2O's, evicted slots merged into their nearest kept slot (merge=, off by "
      "default)",
      [](PolicyConfig& c) {
        c.merger = Merger::kD2o;
        c.merge = MergeRule::kOff;
        c.sim = SimOn::kKey;
        c.ema = EmaRule::kPaper;
        c.beta = 0.7;
        c.mass = true;
      },
      {"beta", "merge", "sim", "ema", "merged_score", "merge_keys", "merge_decision",
       "keep_edge_layers"}};
}

PresetDef make(const char* name, std::vector<PresetPart> parts,
               std::vector<const char*> order = {}) {
  PresetDef p{name, std::move(parts), std::move(order)};
  if (p.keys.empty()) p.keys = p.part_keys();
  return p;
}

}  // namespace

std::vector<const char*> PresetDef::part_keys() const {
  std::vector<const char*> out;
  for (const PresetPart& part : parts) out.insert(out.end(), part.keys.begin(), part.keys.end());
  return out;
}

void PresetDef::defaults(PolicyConfig& c) const {
  for (const PresetPart& part : parts) {
    if (part.set) part.set(c);
  }
}

bool PresetDef::accepts(std::string_view key) const {
  return std::any_of(keys.begin(), keys.end(), [key](const char* k) { return key == k; });
}

void paper_d2o(PolicyConfig& c) {
  const PolicyConfig plain;
  c.cold = plain.cold;
  c.selector = Selector::kHeavyRecent;
  c.exact_total = true;
  c.layers = LayerRule::kVariance;
  c.sinks = 4;
  c.nm_n = 3;
  c.nm_m = 1;
  c.merger = Merger::kD2o;
  c.merge = MergeRule::kWeighted;
  c.sim = SimOn::kKey;
  c.ema = EmaRule::kPaper;
  c.beta = 0.7;
  c.mass = plain.mass;
  c.scorer = plain.scorer;
  c.prompt = plain.prompt;
  c.kernel = plain.kernel;
  c.prompt_merge = plain.prompt_merge;
  c.pscore = plain.pscore;
}

const std::vector<PresetDef>& presets() {
  static const std::vector<PresetDef> defs = {
      make("streaming", {prompt_feeding(), sinks_and_recent(4, {"sinks", "positions"})}),
      make("h2o", {prompt_feeding(), heavy_and_recent(0),
                   attention_scorer("accumulated_attention", {"agg", "scorer"}), head_shares(),
                   distinct_candidates(), prompt_phase(), expected_attention(),
                   cold_tier(ColdPlace::kNone)}),
      make("snapkv", {prompt_feeding(), observation_window(), attention_statistics(), head_shares(),
                      hold_after_prompt(), cold_tier(ColdPlace::kNone)}),
      make("pyramidkv",
           {prompt_feeding(), observation_window(), pyramid_budgets(), attention_statistics(),
            head_shares(), hold_after_prompt(), cold_tier(ColdPlace::kNone)}),
      make("roco",
           {prompt_feeding(), heavy_and_recent(0), attention_scorer("mean_attention", {"agg"}),
            head_shares(), prompt_phase(), expected_attention(), cold_tier(ColdPlace::kNone)}),
      make("cam", {prompt_feeding(), sinks_and_recent(4, {"sinks"}), cam_merger(),
                   attention_statistics()}),
      // The best D2O measured with the question in the prompt (docs/results.md): uniform layer
      // budgets, a 1:1 heavy/recent split, mean attention as the score, and the prompt compacted
      // by its last queries' pooled attention (SnapKV's window, kernel 21, no merges there), whose
      // ranking the decode steps start from; evicted slots are dropped. merge=sized (with
      // proportional_attention=on: merges that carry their sources' attention mass into
      // size-weighted keys) ties this default on six of eight measures over both models (it wins
      // SmolLM2's perplexity at capacity 1024 and loses Gemma 3's RULER-style score) at 1.4-1.6
      // times its policy time. reading=paper gives the paper's keys. What the compactions evict
      // goes to a cold tier on disk (q8_0, in an unlinked file under $TMPDIR), and each new turn
      // recalls the whole tier while it is small (recall_all_up_to=2048 slots a head), else the
      // slots its own queries attend to most: a later question can still find what the first
      // compaction did not keep. The tier is left out where the configuration cannot
      // have one (spec.cpp, tier_possible) unless cold= is given.
      make("d2o",
           {prompt_feeding(), heavy_and_recent(4), exact_layer_budgets(), d2o_merger(),
            attention_scorer("mean_attention", {"agg", "scorer", "proportional_attention"}),
            head_shares(), distinct_candidates(), d2o_prompt_phase(), expected_attention(),
            cold_tier(ColdPlace::kDisk)},
           {"prefill",
            "sinks",
            "heavy_recent",
            "beta",
            "layers",
            "merge",
            "sim",
            "ema",
            "agg",
            "scorer",
            "merged_score",
            "merge_keys",
            "merge_decision",
            "keep_edge_layers",
            "proportional_attention",
            "heads",
            "floor",
            "distinct_share",
            "prompt_ranking",
            "window",
            "kernel",
            "pool",
            "prompt_merge",
            "prompt_scores",
            "future",
            "value_weight",
            "cold",
            "cold_type",
            "cold_size",
            "recall",
            "recall_ranking",
            "recall_all_up_to",
            "recall_reach"}),
      make("keydiff", {prompt_feeding(), key_diversity()}),
  };
  return defs;
}

const PresetDef* find_preset(std::string_view name) {
  for (const PresetDef& p : presets()) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

}  // namespace d2o::spec_detail
