// The lines d2o.policies() shows for every preset and key (spec_docs.h). The full reference,
// with every decision behind the defaults, is docs/ADDING_A_POLICY.md; these are its summaries.
#include "kv/policy/spec_docs.h"

#include <map>
#include <string_view>

#include "kv/policy/spec_keys.h"

namespace d2o {

namespace spec_detail {

const char* preset_line(std::string_view name) {
  static const std::map<std::string_view, const char*> lines = {
      {"full", "Every token: no compression (the reference)."},
      {"streaming", "StreamingLLM: the first tokens (attention sinks) and the most recent ones."},
      {"h2o", "H2O: heavy hitters by accumulated attention, and the recent tokens."},
      {"snapkv",
       "SnapKV: the prompt's slots ranked by its last queries' pooled attention, and that window; "
       "later tokens appended (ratio mode)."},
      {"pyramidkv", "PyramidKV: SnapKV with budgets falling over depth."},
      {"roco", "RoCo: heavy hitters by mean attention, and the recent tokens."},
      {"cam", "CaM: sinks and recent tokens, evicted values merged into recent ones."},
      {"d2o",
       "D2O: sinks; the prompt ranked by its last queries' attention; then heavy hitters by mean "
       "attention and recent tokens; evicted slots kept in a cold tier on disk, from which each "
       "new turn recalls what it attends to (reading=paper: the paper's D2O)."},
      {"keydiff", "KeyDiff: the keys least like the head's mean key (no attention statistics)."},
  };
  auto it = lines.find(name);
  return it == lines.end() ? "" : it->second;
}

namespace {

const std::map<std::string_view, const char*>& key_lines() {
  static const std::map<std::string_view, const char*> lines = {
      {"ratio", "fraction of the prompt's cache kept (0, 1]; prompt-then-compress"},
      {"budget", "slots per KV head and layer kept at all times (exclusive with ratio)"},
      {"prefill",
       "exact: a prompt fed in passes is compressed once after its last; bounded: "
       "compacted to its budget between passes"},
      {"sinks", "the first T slots of every head are always kept (attention sinks)"},
      {"heavy_recent", "N:M split of the slots after the sinks between heavy hitters and recent"},
      {"agg", "how the attention of a KV head's query heads is aggregated: sum, mean, max"},
      {"scorer", "what ranks the heavy hitters"},
      {"positions", "StreamingLLM positions: original, or shifted (kept keys re-rotated)"},
      {"window", "observation window: the last w queries score the slots, the last w are kept"},
      {"kernel", "pooling kernel over neighbouring slots of the window's scores (odd)"},
      {"pool", "pooling of the window's scores: avg or max"},
      {"pyramid_beta", "PyramidKV: the last layer gets 1/beta of the average budget"},
      {"merge_targets", "CaM: an evicted value is spread over the next m slots"},
      {"seed", "CaM: Bernoulli sampling seed"},
      {"beta", "D2O: EMA weight of the newest similarity"},
      {"layers", "D2O layer budgets: variance (the paper's), uniform, or ablations"},
      {"merge", "D2O merge weights of evicted slots; off: no merging"},
      {"sim", "D2O merge similarity on keys, values, or both"},
      {"ema", "D2O threshold update: per token (paper) or per compaction (research)"},
      {"merged_score", "D2O: the score of a merged slot"},
      {"merge_keys", "D2O: keys compared and merged as cached (rotated) or rotated back first"},
      {"merge_decision", "D2O: merge decided per KV head, or per token over a layer's heads"},
      {"keep_edge_layers", "D2O: on keeps layers 0, 1 and the last whole"},
      {"proportional_attention",
       "D2O: a merged slot standing for k tokens gets log(k) added "
       "to its logit"},
      {"recent", "KeyDiff: the last R slots of every head are always kept"},
      {"heads", "per-head budgets: uniform, or shared over a layer's heads by score (ada)"},
      {"floor", "heads=ada: every head keeps at least this share of a uniform head's slots"},
      {"distinct_share", "share of the heavy-hitter places given to the most distinct keys"},
      {"prompt_ranking",
       "how the prompt's compaction ranks slots: accumulated attention, the "
       "last queries' window, a reconstruction, or expected attention"},
      {"prompt_merge", "d2o: off evicts without merging at the prompt's compaction"},
      {"prompt_scores", "the scores the prompt's compaction leaves: accumulated, or the window's"},
      {"future", "expected attention: future positions whose mean rotation turns the queries"},
      {"value_weight", "expected attention: multiplied by the value's norm, or by nothing"},
      {"hold_budget", "snapkv, pyramidkv: on keeps the prompt's budget while generating"},
      {"cold", "where evicted slots go: none (dropped), memory, or disk; a new turn recalls them"},
      {"cold_type", "KV storage type of the cold tier's rows"},
      {"cold_size", "most slots each KV head keeps cold (0: all)"},
      {"recall", "slots each KV head brings back from the cold tier per turn, ranked"},
      {"recall_all_up_to",
       "while a KV head's cold tier holds at most this many slots, a turn brings all of them "
       "back (nothing ranked); beyond it, the best recall= (0: never all)"},
      {"recall_ranking",
       "what ranks the cold slots a turn recalls: max (the most attention any of the turn's "
       "window queries gives a slot, the best of its neighbours) or sum (the window's attention "
       "summed over its queries and neighbouring slots, as the turn's compaction ranks) or whole "
       "(that sum with each query's attention over the whole context, hot and cold: what the "
       "compaction would rank by had every cold slot come back)"},
      {"recall_reach",
       "which rows of a turn attend to what it recalls: turn (all of them) or window (the "
       "window's rows that ranked the recall; the rows before them attend to the hot slots "
       "alone, so a large recall costs the window's attention to it, not the whole turn's)"},
      {"reading", "d2o: paper gives the paper's D2O, research its research code's (a shorthand)"},
  };
  return lines;
}

const char* key_line(std::string_view name) {
  auto it = key_lines().find(name);
  return it == key_lines().end() ? "" : it->second;
}

}  // namespace

}  // namespace spec_detail

std::vector<PolicyKeyDoc> policy_key_docs() {
  std::vector<PolicyKeyDoc> out;
  for (const char* name : {"ratio", "budget"}) {
    out.push_back({name, "", {}, spec_detail::key_line(name)});
  }
  for (const spec_detail::KeyDef& k : spec_detail::key_defs()) {
    PolicyKeyDoc d{k.name, k.old_name ? k.old_name : "", {}, spec_detail::key_line(k.name)};
    if (k.words) {
      for (const char* w : *k.words) d.values.emplace_back(w ? w : "");
    }
    out.push_back(std::move(d));
  }
  PolicyKeyDoc reading{"reading", "", {}, spec_detail::key_line("reading")};
  for (const char* w : spec_detail::kReadingWords) reading.values.emplace_back(w);
  out.push_back(std::move(reading));
  return out;
}

}  // namespace d2o
