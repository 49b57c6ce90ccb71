// Policy spec strings: "name" or "name:key=value,key=value". One grammar for the CLI, the server
// and the bench. The registry below lists every preset (its defaults and the keys it accepts);
// spec_keys.cpp lists every key (how it is parsed and printed). docs/ADDING_A_POLICY.md has the
// reference table.
//
// Canonical form (spec()): the name, then ratio=... or budget=..., then the keys the preset
// accepts in registry order (a key with a `shown` rule only where it says so or where it differs
// from the preset's default; a key with an `applies` rule only where that holds), numbers in
// their shortest round-trip form. Parsing it gives back an identical PolicyConfig.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "kv/policy.h"
#include "kv/policy/composed.h"
#include "kv/policy/config.h"
#include "kv/policy/spec_keys.h"

namespace d2o {

namespace {

using spec_detail::bad_value;
using spec_detail::find_key;
using spec_detail::fmt_f64;
using spec_detail::int_key;
using spec_detail::KeyDef;
using spec_detail::kReadingWords;
using spec_detail::parse_f64;
using spec_detail::trim;
using spec_detail::word_key;

constexpr int kMaxInt = std::numeric_limits<int>::max();

// ---- presets (the registration point of a new method) --------------------------------------

struct PresetDef {
  const char* name;
  void (*defaults)(PolicyConfig& c);
  std::vector<const char*> keys;  // accepted keys besides ratio/budget, in canonical order
};

// D2O as the paper states it (reading=paper): variance budgets, 3:1, weighted merges, the prompt
// compacted by its accumulated attention.
void paper_d2o(PolicyConfig& c) {
  const PolicyConfig plain;
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
  c.norm = plain.norm;
  c.prompt = plain.prompt;
  c.kernel = plain.kernel;
  c.prompt_merge = plain.prompt_merge;
  c.pscore = plain.pscore;
}

const std::vector<PresetDef>& presets() {
  static const std::vector<PresetDef> defs = {
      {"streaming",
       [](PolicyConfig& c) {
         c.selector = Selector::kSinkRecent;
         c.sinks = 4;
       },
       {"sinks", "pos"}},
      {"h2o",
       [](PolicyConfig& c) {
         c.selector = Selector::kHeavyRecent;
         c.sinks = 0;
         c.nm_n = c.nm_m = 1;
       },
       {"sinks", "nm", "agg", "norm", "heads", "floor", "distinct", "prompt", "window", "kernel",
        "pool", "pscore"}},
      {"snapkv",
       [](PolicyConfig& c) { c.selector = Selector::kSnapWindow; },
       {"window", "kernel", "pool", "agg", "heads", "floor", "hold"}},
      {"pyramidkv",
       [](PolicyConfig& c) {
         c.selector = Selector::kSnapWindow;
         c.layers = LayerRule::kPyramid;
       },
       {"window", "kernel", "pool", "pbeta", "agg", "heads", "floor", "hold"}},
      {"roco",
       [](PolicyConfig& c) {
         c.selector = Selector::kHeavyRecent;
         c.sinks = 0;
         c.nm_n = c.nm_m = 1;
         c.norm = ScoreNorm::kQueries;
       },
       {"sinks", "nm", "agg", "heads", "floor", "prompt", "window", "kernel", "pool", "pscore"}},
      {"cam",
       [](PolicyConfig& c) {
         c.selector = Selector::kSinkRecent;
         c.sinks = 4;
         c.merger = Merger::kCam;
       },
       {"sinks", "mb", "seed", "agg"}},
      {"d2o",
       [](PolicyConfig& c) {
         paper_d2o(c);
         // The best D2O measured (docs/results.md, "F, the d2o default"): uniform layer
         // budgets, a 1:1 heavy/recent split, mean attention as the score, and the prompt
         // compacted by its last queries' pooled attention (SnapKV's window, kernel 21, no
         // merges there), whose ranking the decode steps start from; evicted slots are dropped.
         // merge=sized (with mass=on: merges that carry their sources' attention mass into
         // size-weighted keys) gives E, which ties F on six of eight measures over both
         // models (it wins SmolLM2's perplexity at capacity 1024 and loses Gemma 3's
         // RULER-style score) at 1.4-1.6 times F's policy time. reading=paper gives the
         // paper's keys.
         c.layers = LayerRule::kUniform;
         c.nm_n = c.nm_m = 1;
         c.merge = MergeRule::kOff;
         c.mass = true;
         c.norm = ScoreNorm::kQueries;
         c.prompt = PromptScore::kWindow;
         c.kernel = 21;
         c.prompt_merge = false;
         c.pscore = PromptScore::kWindow;
       },
       {"sinks",    "nm",     "beta",   "layers", "merge",   "sim",    "ema",   "agg",
        "norm",     "mscore", "mrope",  "decide", "protect", "mass",   "heads", "floor",
        "distinct", "prompt", "window", "kernel", "pool",    "pmerge", "pscore"}},
      {"keydiff",
       [](PolicyConfig& c) {
         c.selector = Selector::kKeyDiff;
         c.sinks = 0;
         c.recent = 0;
       },
       {"sinks", "recent"}},
  };
  return defs;
}

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

bool accepts(const PresetDef& p, std::string_view key) {
  for (const char* k : p.keys) {
    if (key == k) return true;
  }
  return false;
}

}  // namespace

std::string format_policy_spec(const PolicyConfig& c) {
  std::string s = c.name + ":";
  s += c.mode == BudgetMode::kRatio ? "ratio=" + fmt_f64(c.ratio)
                                    : "budget=" + std::to_string(c.budget);
  for (const PresetDef& p : presets()) {
    if (c.name != p.name) continue;
    PolicyConfig dflt;
    dflt.name = c.name;
    p.defaults(dflt);
    for (const char* k : p.keys) {
      const KeyDef* d = find_key(k);
      if (d->applies && !d->applies(c)) continue;
      if (!d->shown || d->shown(c) || d->print(c) != d->print(dflt))
        s += std::string(",") + k + "=" + d->print(c);
    }
  }
  return s;
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
  const PresetDef* preset = nullptr;
  for (const PresetDef& p : presets()) {
    if (name == p.name) preset = &p;
  }
  if (!preset)
    return invalid_argument("unknown KV policy '" + name + "' (allowed: " + preset_names() + ")");

  // Split "k=v,k=v" into pairs, rejecting malformed items and repeated keys.
  std::vector<std::pair<std::string_view, std::string_view>> items;
  if (colon != std::string_view::npos) {
    std::string_view rest = body;
    while (true) {
      const size_t comma = rest.find(',');
      const std::string_view item = trim(rest.substr(0, comma));
      const size_t eq = item.find('=');
      if (eq == std::string_view::npos || trim(item.substr(0, eq)).empty()) {
        return invalid_argument("KV policy '" + name + "': expected key=value, got '" +
                                std::string(item) + "' (keys: " + allowed_keys(*preset) + ")");
      }
      const std::string_view key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
      for (const auto& kv : items) {
        if (kv.first == key)
          return invalid_argument("KV policy '" + name + "': key '" + std::string(key) +
                                  "' is given twice");
      }
      items.emplace_back(key, value);
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
  }

  PolicyConfig c;
  c.name = name;
  preset->defaults(c);
  // A reading of D2O is a set of defaults: apply it before the explicit keys.
  for (const auto& [key, value] : items) {
    if (key != "reading" || name != "d2o") continue;
    int i = 0;
    D2O_RETURN_IF_ERROR(word_key(name, key, value, kReadingWords, &i));
    paper_d2o(c);
    if (i == 1) {
      c.layers = LayerRule::kResearch;
      c.nm_n = c.nm_m = 1;
      c.ema = EmaRule::kResearch;
      c.merge = MergeRule::kResearch;
      c.decide = MergeDecision::kToken;
    }
  }
  bool has_ratio = false, has_budget = false;
  for (const auto& [key, value] : items) {
    if (key == "reading" && name == "d2o") continue;
    if (key == "ratio") {
      double x = 0;
      if (!parse_f64(value, &x) || !(x > 0.0 && x <= 1.0))
        return bad_value(name, key, value, "ratio must be in (0, 1]");
      c.ratio = x;
      has_ratio = true;
      continue;
    }
    if (key == "budget") {
      int64_t x = 0;
      D2O_RETURN_IF_ERROR(int_key(name, key, value, 1, kMaxInt / 4, &x));
      c.budget = x;
      has_budget = true;
      continue;
    }
    if (!accepts(*preset, key) && (key == "heads" || key == "floor")) {
      return invalid_argument("KV policy '" + name + "' does not take " + std::string(key) +
                              "=: per-head budgets share slots by attention score, which it does "
                              "not rank by (heads=ada works with h2o, roco, snapkv, pyramidkv "
                              "and d2o)");
    }
    if (!accepts(*preset, key)) {
      return invalid_argument("KV policy '" + name + "': unknown key '" + std::string(key) +
                              "' (allowed: " + allowed_keys(*preset) + ")");
    }
    D2O_RETURN_IF_ERROR(find_key(key)->parse(key, value, c));
  }
  bool has_floor = false, prompt_chosen = false;  // (prompt= given, or set by a reading)
  for (const auto& kv : items) {
    has_floor = has_floor || kv.first == "floor";
    prompt_chosen = prompt_chosen || kv.first == "prompt" || kv.first == "reading";
  }
  // Where prompt=window comes from d2o's defaults, say how to leave it.
  const std::string by_default =
      prompt_chosen ? "" : " (d2o compacts the prompt by its window by default: add prompt=acc)";
  for (const auto& kv : items) {
    if (c.selector == Selector::kHeavyRecent && c.prompt == PromptScore::kAccumulated &&
        (kv.first == "window" || kv.first == "kernel" || kv.first == "pool" ||
         kv.first == "pscore")) {
      return invalid_argument("KV policy '" + name + "': " + std::string(kv.first) +
                              "= applies only with prompt=window");
    }
  }
  if (has_floor && c.heads != HeadRule::kAda)
    return invalid_argument("KV policy '" + name + "': floor= applies only with heads=ada");
  if (c.heads == HeadRule::kAda && c.distinct > 0.0) {
    return invalid_argument("KV policy '" + name +
                            "': distinct= applies with heads=uniform (heads=ada shares the "
                            "places over the heads by attention score alone)");
  }
  if (c.distinct > 0.0 && c.prompt != PromptScore::kAccumulated) {
    return invalid_argument("KV policy '" + name +
                            "': prompt=window makes the prompt's compaction SnapKV's, which "
                            "distinct= does not apply to; use one of them" +
                            by_default);
  }
  if (c.heads == HeadRule::kAda && c.prompt != PromptScore::kAccumulated) {
    return invalid_argument("KV policy '" + name + "': prompt=window applies with heads=uniform" +
                            by_default);
  }
  if (c.heads == HeadRule::kAda && c.decide == MergeDecision::kToken) {
    return invalid_argument("KV policy '" + name +
                            "': heads=ada evicts different counts per "
                            "head, which decide=token (one decision per evicted index over the "
                            "heads) cannot pair up; use decide=head");
  }
  if (has_ratio && has_budget) {
    return invalid_argument("KV policy '" + name + "': give either ratio= or budget=, not both");
  }
  if (has_budget) {
    c.mode = BudgetMode::kBudget;
    c.ratio = 0.2;  // unused in budget mode; fixed so that equal specs give equal configs
    if (c.budget < c.min_budget()) {
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
                              " is below the smallest usable budget " +
                              std::to_string(c.min_budget()) + ", " + why);
    }
  }
  // Keys that do not apply take their plain values, so that equal canonical specs give equal
  // configs (d2o:prompt=acc drops the window keys of d2o's defaults).
  if (c.selector == Selector::kHeavyRecent && c.prompt == PromptScore::kAccumulated) {
    const PolicyConfig plain;
    c.window = plain.window;
    c.kernel = plain.kernel;
    c.pool = plain.pool;
    c.pscore = plain.pscore;
  }
  // hold takes its plain value where budget mode implies it (PolicyConfig::compacts_after_first).
  if (c.mode == BudgetMode::kBudget) c.hold = false;
  return std::unique_ptr<KvPolicy>(new ComposedPolicy(std::move(c)));
}

std::string paper_era_d2o_spec(const std::string& spec) {
  // Canonical d2o specs written while the defaults were the paper's omit the keys that now
  // differ from E's defaults wherever they had the paper's value: read with reading=paper, the
  // spec must print as it was written once those keys are left out again.
  if (spec.rfind("d2o:", 0) != 0 || spec.find("reading=") != std::string::npos) return "";
  auto today = parse_kv_policy(spec);
  if (today.ok() && (*today)->spec() == spec) return "";  // today's canonical form
  auto p = parse_kv_policy("d2o:reading=paper," + spec.substr(4));
  if (!p.ok()) return "";
  const std::string now = (*p)->spec();
  std::string then;
  size_t at = 0;
  while (at <= now.size()) {
    const size_t comma = std::min(now.find(',', at), now.size());
    const std::string item = now.substr(at, comma - at);
    if (item != "prompt=acc" && item != "pmerge=on" && item != "pscore=acc")
      then += (then.empty() ? "" : ",") + item;
    at = comma + 1;
  }
  return then == spec ? now : "";
}

}  // namespace d2o
