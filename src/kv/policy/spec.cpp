// Policy spec strings: "name" or "name:key=value,key=value". One grammar for the CLI, the server
// and the bench. presets.cpp lists every preset as the parts it is made of (its defaults and the
// keys it accepts follow from them); spec_keys.cpp lists every key (how it is parsed and
// printed). docs/ADDING_A_POLICY.md has the reference table.
//
// Canonical form (spec()): the name, then ratio=... or budget=..., then the keys the preset
// accepts in registry order, prefill= (which every preset takes) first (a key with a `shown` rule
// only where it says so or where it differs from the preset's default; a key with an `applies`
// rule only where that holds), numbers in their shortest round-trip form. Parsing it gives back an
// identical PolicyConfig. Keys are printed by their readable names; their old names (nm=,
// mrope=post, ...) parse to the same config (spec_keys.cpp, kOldSpellings).
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "core/assert.h"
#include "kv/policy.h"
#include "kv/policy/composed.h"
#include "kv/policy/config.h"
#include "kv/policy/presets.h"
#include "kv/policy/scorer.h"
#include "kv/policy/spec_docs.h"
#include "kv/policy/spec_keys.h"

namespace d2o {

namespace {

using spec_detail::bad_value;
using spec_detail::current_word;
using spec_detail::find_key;
using spec_detail::fmt_f64;
using spec_detail::int_key;
using spec_detail::KeyDef;
using spec_detail::kReadingWords;
using spec_detail::parse_f64;
using spec_detail::split_items;
using spec_detail::trim;
using spec_detail::word_key;

constexpr int kMaxInt = std::numeric_limits<int>::max();

using spec_detail::find_preset;
using spec_detail::paper_d2o;
using spec_detail::PresetDef;
using spec_detail::presets;

std::string preset_names() {
  std::string s = "full";
  for (const PresetDef& p : presets()) s += std::string(", ") + p.name;
  return s;
}

std::string allowed_keys(const PresetDef& p) {
  std::string s = "ratio, budget";
  for (const char* k : p.keys) s += std::string(", ") + k;
  if (std::string_view(p.name) == "d2o") s += ", reading";
  return s;
}

// One key=value of a spec, in today's spelling: `key` is the registry's name of the key (the
// given one for ratio, budget, reading and unknown keys), `given` as written (for messages), and
// `value` with an old value word replaced by its word today.
struct Item {
  std::string_view key, given, value;
};

// The items of `body`, rejecting malformed items and keys given twice (under one name or both).
Status read_items(const std::string& name, const PresetDef& preset, std::string_view body,
                  std::vector<Item>& items) {
  for (const std::string_view raw : split_items(body)) {
    const std::string_view item = trim(raw);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos || trim(item.substr(0, eq)).empty()) {
      return invalid_argument("KV policy '" + name + "': expected key=value, got '" +
                              std::string(item) + "' (keys: " + allowed_keys(preset) + ")");
    }
    Item it{trim(item.substr(0, eq)), trim(item.substr(0, eq)), trim(item.substr(eq + 1))};
    if (const spec_detail::KeyDef* d = find_key(it.given)) {
      it.key = d->name;
      it.value = current_word(*d, it.value);
    }
    for (const Item& seen : items) {
      if (seen.key != it.key) continue;
      if (seen.given == it.given)
        return invalid_argument("KV policy '" + name + "': key '" + std::string(it.given) +
                                "' is given twice");
      return invalid_argument("KV policy '" + name + "': '" + std::string(seen.given) + "' and '" +
                              std::string(it.given) + "' are one key (" + std::string(it.key) +
                              ", formerly " + find_key(it.key)->old_name + "): give it once");
    }
    items.push_back(it);
  }
  return {};
}

// A key the preset does not take: why, and what it takes.
Status not_taken(const std::string& name, const PresetDef& preset, const Item& it) {
  if (it.key == "heads" || it.key == "floor") {
    return invalid_argument("KV policy '" + name + "' does not take " + std::string(it.key) +
                            "=: per-head budgets share slots by attention score, which it does "
                            "not rank by (heads=ada works with h2o, roco, snapkv, pyramidkv "
                            "and d2o)");
  }
  // An old name the preset does not take either: say which key it is today.
  const std::string today =
      it.key == it.given ? "" : "the old name of '" + std::string(it.key) + "'; ";
  return invalid_argument("KV policy '" + name + "': unknown key '" + std::string(it.given) +
                          "' (" + today + "allowed: " + allowed_keys(preset) + ")");
}

bool has_key(const std::vector<Item>& items, std::string_view key) {
  for (const Item& it : items) {
    if (it.key == key) return true;
  }
  return false;
}

std::string prompt_word(const PolicyConfig& c) {
  return c.prompt == PromptScore::kReconstruction ? "reconstruction"
         : c.prompt == PromptScore::kExpected     ? "expected"
                                                  : "window";
}

// Whether a policy ranks a turn's slots by the turn's own queries, as a cold tier needs.
bool ranks_turns_by_window(const PolicyConfig& c) {
  return c.selector == Selector::kSnapWindow ||
         (c.selector == Selector::kHeavyRecent &&
          (c.prompt == PromptScore::kWindow || c.prompt == PromptScore::kReconstruction) &&
          c.heads == HeadRule::kUniform);
}

// Whether a configuration can have a cold tier at all (check_cold's conditions).
bool tier_possible(const PolicyConfig& c) {
  return c.pos == PosMode::kOriginal && ranks_turns_by_window(c);
}

// The cold tier's keys: they apply only with cold=memory, and the tier needs a policy that ranks
// a turn's slots by the turn's own queries and keeps positions.
Status check_cold(const std::string& name, const std::vector<Item>& items, const PolicyConfig& c) {
  if (!c.cold.enabled()) {
    for (const char* k : {"cold_type", "cold_size", "recall", "recall_ranking", "recall_all_up_to",
                          "recall_reach"}) {
      if (has_key(items, k))
        return invalid_argument("KV policy '" + name + "': " + k + "= applies only with cold=memory or cold=disk");
    }
    return {};
  }
  if (c.pos != PosMode::kOriginal)
    return invalid_argument("KV policy '" + name +
                            "': a cold tier keeps slots at their own positions, which "
                            "positions=shifted renumbers");
  if (!ranks_turns_by_window(c))
    return invalid_argument("KV policy '" + name +
                            "': a cold tier needs the slots of a turn ranked by the turn's own "
                            "queries' attention: prompt_ranking=window (or reconstruction) with "
                            "heads=uniform, or snapkv / pyramidkv");
  return {};
}

// Keys that exclude each other or apply only with others, once every key is read.
Status check_combinations(const std::string& name, const std::vector<Item>& items,
                          const PolicyConfig& c) {
  // Where prompt_ranking=window comes from d2o's defaults, say how to leave it.
  const bool prompt_chosen = has_key(items, "prompt_ranking") || has_key(items, "reading");
  const std::string by_default = prompt_chosen
                                     ? ""
                                     : " (d2o compacts the prompt by its window by default: add "
                                       "prompt_ranking=accumulated)";
  const bool expected = reads_queries(c);
  for (const Item& it : items) {
    if (c.selector == Selector::kHeavyRecent && c.prompt == PromptScore::kAccumulated &&
        ((it.key == "window" && !expected) || it.key == "kernel" || it.key == "pool" ||
         it.key == "prompt_scores")) {
      return invalid_argument(
          "KV policy '" + name + "': " + std::string(it.given) +
          "= applies only with prompt_ranking=window, reconstruction or expected" +
          (it.key == "window" ? " (or scorer=expected_attention: the queries it reads)" : ""));
    }
    if (!expected && (it.key == "future" || it.key == "value_weight")) {
      return invalid_argument("KV policy '" + name + "': " + std::string(it.given) +
                              "= applies only with expected attention (scorer=expected_attention "
                              "or prompt_ranking=expected)");
    }
  }
  if (has_key(items, "floor") && c.heads != HeadRule::kAda)
    return invalid_argument("KV policy '" + name + "': floor= applies only with heads=ada");
  if (c.heads == HeadRule::kAda && c.distinct > 0.0) {
    return invalid_argument("KV policy '" + name +
                            "': distinct_share= applies with heads=uniform (heads=ada shares "
                            "the places over the heads by attention score alone)");
  }
  if (c.distinct > 0.0 && c.prompt != PromptScore::kAccumulated) {
    return invalid_argument("KV policy '" + name +
                            "': prompt_ranking=" + prompt_word(c) + " makes the prompt's compaction SnapKV's, "
                            "which distinct_share= does not apply to; use one of them" +
                            by_default);
  }
  if (c.heads == HeadRule::kAda && c.prompt != PromptScore::kAccumulated) {
    return invalid_argument("KV policy '" + name +
                            "': prompt_ranking=" + prompt_word(c) + " applies with heads=uniform" +
                            by_default);
  }
  D2O_RETURN_IF_ERROR(check_cold(name, items, c));
  if (c.heads == HeadRule::kAda && c.decide == MergeDecision::kToken) {
    return invalid_argument("KV policy '" + name +
                            "': heads=ada evicts different counts per head, which "
                            "merge_decision=per_token (one decision per evicted index over the "
                            "heads) cannot pair up; use merge_decision=per_head");
  }
  return {};
}

// budget=B below what the selector needs: the smallest usable budget and why.
Status budget_too_small(const std::string& name, const PolicyConfig& c) {
  const std::string why =
      c.selector == Selector::kSnapWindow
          ? "the observation window (window=" + std::to_string(c.window) + ")"
      : c.selector == Selector::kSinkRecent
          ? "sinks + 1 (sinks=" + std::to_string(c.sinks) + ", at least one recent slot)"
      : c.selector == Selector::kKeyDiff
          ? "sinks + recent (sinks=" + std::to_string(c.sinks) +
                ", recent=" + std::to_string(c.recent) + "), at least 1"
          : "sinks + " + std::to_string(PolicyConfig::kMinBody) +
                " (sinks=" + std::to_string(c.sinks) + ", at least " +
                std::to_string(PolicyConfig::kMinBody) + " heavy and recent slots)";
  return invalid_argument("KV policy '" + name + "': budget=" + std::to_string(c.budget) +
                          " is below the smallest usable budget " + std::to_string(c.min_budget()) +
                          ", " + why);
}

// d2o:reading=paper|research is a set of defaults, applied before the explicit keys.
Status apply_reading(const std::string& name, const std::vector<Item>& items, PolicyConfig& c) {
  for (const Item& it : items) {
    if (it.key != "reading" || name != "d2o") continue;
    int i = 0;
    D2O_RETURN_IF_ERROR(word_key(name, it.key, it.value, kReadingWords, &i));
    paper_d2o(c);
    if (i == 1) {
      c.layers = LayerRule::kResearch;
      c.nm_n = c.nm_m = 1;
      c.ema = EmaRule::kResearch;
      c.merge = MergeRule::kResearch;
      c.decide = MergeDecision::kToken;
    }
  }
  return {};
}

}  // namespace

std::string format_policy_spec(const PolicyConfig& c) {
  std::string s = c.name + ":";
  s += c.mode == BudgetMode::kRatio ? "ratio=" + fmt_f64(c.ratio)
                                    : "budget=" + std::to_string(c.budget);
  if (const PresetDef* p = find_preset(c.name)) {
    PolicyConfig dflt;
    dflt.name = c.name;
    p->defaults(dflt);
    for (const char* k : p->keys) {
      const KeyDef* d = find_key(k);
      if (d->applies && !d->applies(c)) continue;
      if (!d->shown || d->shown(c) || d->print(c) != d->print(dflt))
        s += std::string(",") + k + "=" + d->print(c);
    }
  }
  return s;
}

namespace {

// Which of ratio= and budget= a spec gave.
struct Sizing {
  bool ratio = false, budget = false;
};

// The items over the preset's defaults (a reading first, then the keys in their order).
Status apply_items(const PresetDef& preset, const std::vector<Item>& items, PolicyConfig& c,
                   Sizing& given) {
  const std::string& name = c.name;
  D2O_RETURN_IF_ERROR(apply_reading(name, items, c));
  for (const Item& it : items) {
    if (it.key == "reading" && name == "d2o") continue;
    if (it.key == "ratio") {
      double x = 0;
      if (!parse_f64(it.value, &x) || !(x > 0.0 && x <= 1.0))
        return bad_value(name, it.key, it.value, "ratio must be in (0, 1]");
      c.ratio = x;
      given.ratio = true;
      continue;
    }
    if (it.key == "budget") {
      int64_t x = 0;
      D2O_RETURN_IF_ERROR(int_key(name, it.key, it.value, 1, kMaxInt / 4, &x));
      c.budget = x;
      given.budget = true;
      continue;
    }
    if (!preset.accepts(it.key)) return not_taken(name, preset, it);
    D2O_RETURN_IF_ERROR(find_key(it.key)->parse(it.given, it.value, c));
  }
  // A tier from the preset's defaults (d2o's) is left out where the configuration cannot have
  // one (heads=ada, prompt_ranking=accumulated, reading=paper, positions=shifted); cold= given
  // with such a configuration is refused with a reason (check_cold).
  if (!has_key(items, "cold") && c.cold.enabled() && !tier_possible(c)) c.cold = ColdTierConfig{};
  // The tier's storage type follows its place unless cold_type= is given (without a tier, a
  // bare config's).
  if (!c.cold.enabled())
    c.cold.type = ColdTierConfig{}.type;
  else if (!has_key(items, "cold_type"))
    c.cold.type = ColdTierConfig::default_type(c.cold.place);
  return {};
}

// ratio= or budget=, and how the prompt is fed: the rules between them and the other keys; sets
// budget mode.
Status apply_sizing(const std::vector<Item>& items, const Sizing& given, PolicyConfig& c) {
  const std::string& name = c.name;
  if (given.ratio && given.budget) {
    return invalid_argument("KV policy '" + name + "': give either ratio= or budget=, not both");
  }
  if (given.budget && has_key(items, "prefill")) {
    return invalid_argument("KV policy '" + name +
                            "': prefill= applies with ratio= (budget= compacts between a prompt's "
                            "passes already)");
  }
  if (c.prefill == PrefillMode::kBounded && c.prompt == PromptScore::kReconstruction) {
    return invalid_argument("KV policy '" + name +
                            "': prompt_ranking=reconstruction feeds the whole prompt again before "
                            "compressing it, which prefill=bounded does not hold; use "
                            "prefill=exact or another prompt_ranking");
  }
  if (c.prefill == PrefillMode::kBounded && c.prompt == PromptScore::kExpected) {
    return invalid_argument("KV policy '" + name +
                            "': prompt_ranking=expected ranks the whole prompt once by its last "
                            "queries, which prefill=bounded, compacting between chunks, does not "
                            "hold; use prefill=exact or another prompt_ranking");
  }
  if (!given.budget) return {};
  c.mode = BudgetMode::kBudget;
  c.ratio = 0.2;  // unused in budget mode; fixed so that equal specs give equal configs
  if (c.budget < c.min_budget()) return budget_too_small(name, c);
  if (c.prompt == PromptScore::kReconstruction)
    return invalid_argument("KV policy '" + name +
                            "': prompt_ranking=reconstruction applies in ratio mode (a prompt "
                            "compressed once it is whole); use ratio=");
  return {};
}

// Keys that do not apply take their plain values, so that equal canonical specs give equal
// configs (d2o:prompt_ranking=accumulated drops the window keys of d2o's defaults).
void plain_where_unused(PolicyConfig& c) {
  const PolicyConfig plain;
  if (c.selector == Selector::kHeavyRecent && c.prompt == PromptScore::kAccumulated) {
    if (!reads_queries(c)) c.window = plain.window;
    c.kernel = plain.kernel;
    c.pool = plain.pool;
    c.pscore = plain.pscore;
  }
  if (!reads_queries(c)) {
    c.future = plain.future;
    c.value_weight = plain.value_weight;
  }
  // hold_budget takes its plain value where budget mode implies it
  // (PolicyConfig::compacts_after_first).
  if (c.mode == BudgetMode::kBudget) c.hold = false;
}

}  // namespace

std::vector<PolicyPresetDoc> policy_preset_docs() {
  std::vector<PolicyPresetDoc> out;
  out.push_back({"full", spec_detail::preset_line("full"), "full", {}, {}});
  for (const PresetDef& p : presets()) {
    auto parsed = parse_kv_policy(p.name);
    D2O_ASSERT(parsed.ok());
    PolicyPresetDoc d{p.name, spec_detail::preset_line(p.name), (*parsed)->spec(), {}, {}};
    for (const char* k : p.keys) d.keys.emplace_back(k);
    for (const spec_detail::PresetPart& part : p.parts) d.parts.push_back(part.what);
    if (std::string_view(p.name) == "d2o") d.keys.emplace_back("reading");
    out.push_back(std::move(d));
  }
  return out;
}

Result<std::unique_ptr<KvPolicy>> parse_kv_policy(std::string_view spec) {
  const std::string_view s = trim(spec);
  const size_t colon = s.find(':');
  const std::string name(trim(s.substr(0, colon)));
  const std::string_view body =
      colon == std::string_view::npos ? std::string_view() : s.substr(colon + 1);
  if (name == "full" || s.empty()) {
    if (!trim(body).empty())
      return invalid_argument("KV policy 'full' takes no keys (got '" + std::string(body) + "')");
    return std::unique_ptr<KvPolicy>(new FullPolicy());
  }
  const PresetDef* preset = find_preset(name);
  if (!preset)
    return invalid_argument("unknown KV policy '" + name + "' (allowed: " + preset_names() + ")");

  std::vector<Item> items;
  if (colon != std::string_view::npos) D2O_RETURN_IF_ERROR(read_items(name, *preset, body, items));

  PolicyConfig c;
  c.name = name;
  preset->defaults(c);
  Sizing given;
  D2O_RETURN_IF_ERROR(apply_items(*preset, items, c, given));
  D2O_RETURN_IF_ERROR(check_combinations(name, items, c));
  D2O_RETURN_IF_ERROR(apply_sizing(items, given, c));
  plain_where_unused(c);
  return std::unique_ptr<KvPolicy>(new ComposedPolicy(std::move(c)));
}

}  // namespace d2o
