// Policy spec strings: "name" or "name:key=value,key=value". One grammar for the CLI, the server
// and the bench. The registry below lists every preset (its defaults and the keys it accepts)
// and every key (how it is parsed and printed); docs/ADDING_A_POLICY.md has the reference table.
//
// Canonical form (spec()): the name, then ratio=... or budget=..., then every key the preset
// accepts in registry order, numbers in their shortest round-trip form. Parsing it gives back an
// identical PolicyConfig.
#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kv/policy.h"
#include "kv/policy/composed.h"
#include "kv/policy/config.h"

namespace d2o {

namespace {

// ---- value parsing helpers ------------------------------------------------------------------

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool parse_i64(std::string_view v, int64_t* out) {
  if (v.empty()) return false;
  const char* end = v.data() + v.size();
  auto r = std::from_chars(v.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end;
}

bool parse_u64(std::string_view v, uint64_t* out) {
  if (v.empty() || v.front() == '-') return false;
  const char* end = v.data() + v.size();
  auto r = std::from_chars(v.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end;
}

bool parse_f64(std::string_view v, double* out) {
  if (v.empty()) return false;
  const char* end = v.data() + v.size();
  auto r = std::from_chars(v.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end && std::isfinite(*out);
}

std::string fmt_f64(double x) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x);  // shortest round-trip representation
  return std::string(buf, r.ptr);
}

Status bad_value(const std::string& policy, std::string_view key, std::string_view value,
                 const std::string& allowed) {
  return invalid_argument("KV policy '" + policy + "': " + std::string(key) + "=" +
                          std::string(value) + " is not valid (" + allowed + ")");
}

// An integer key within [lo, hi].
Status int_key(const std::string& policy, std::string_view key, std::string_view v, int64_t lo,
               int64_t hi, int64_t* out) {
  if (!parse_i64(v, out) || *out < lo || *out > hi) {
    return bad_value(policy, key, v,
                     "an integer from " + std::to_string(lo) +
                         (hi == std::numeric_limits<int>::max() ? std::string(" up")
                                                                : " to " + std::to_string(hi)));
  }
  return {};
}

// A share: a number in [0, 1].
Status share_key(const std::string& policy, std::string_view key, std::string_view v, double* out) {
  if (!parse_f64(v, out) || !(*out >= 0.0 && *out <= 1.0))
    return bad_value(policy, key, v, "a number in [0, 1]");
  return {};
}

// One of a list of words; index into `words` on success.
Status word_key(const std::string& policy, std::string_view key, std::string_view v,
                const std::vector<const char*>& words, int* out) {
  for (size_t i = 0; i < words.size(); ++i) {
    if (v == words[i]) {
      *out = static_cast<int>(i);
      return {};
    }
  }
  std::string allowed = "one of ";
  for (size_t i = 0; i < words.size(); ++i) allowed += (i ? ", " : "") + std::string(words[i]);
  return bad_value(policy, key, v, allowed);
}

// ---- keys -----------------------------------------------------------------------------------

using ParseFn = Status (*)(std::string_view v, PolicyConfig& c);
using PrintFn = std::string (*)(const PolicyConfig& c);

struct KeyDef {
  const char* name;
  ParseFn parse;
  PrintFn print;
  // Non-null: the canonical form shows the key only when this says so (keys added after specs
  // were recorded, printed only when they differ from the behaviour those specs had).
  bool (*shown)(const PolicyConfig& c) = nullptr;
};

const std::vector<const char*> kAggWords = {"sum", "mean", "max"};
const std::vector<const char*> kNormWords = {"none", "queries"};
const std::vector<const char*> kPoolWords = {"max", "avg"};
const std::vector<const char*> kPosWords = {"original", "shift"};
const std::vector<const char*> kLayerWords = {"uniform", "variance", "reciprocal",
                                              "exp",     "pyramid",  "research"};
const std::vector<const char*> kMergeWords = {"off", "weighted", "average", "research",
                                              "sized"};
const std::vector<const char*> kSimWords = {"key", "value", "kv"};
const std::vector<const char*> kEmaWords = {"paper", "research"};
const std::vector<const char*> kReadingWords = {"paper", "research"};
const std::vector<const char*> kMscoreWords = {"sum", "keep", "mean", "max"};
const std::vector<const char*> kMropeWords = {"post", "pre"};
const std::vector<const char*> kDecideWords = {"head", "token"};
const std::vector<const char*> kProtectWords = {"none", "edges"};
const std::vector<const char*> kOnOffWords = {"off", "on"};
const std::vector<const char*> kHeadsWords = {"uniform", "ada"};

constexpr int kMaxInt = std::numeric_limits<int>::max();

const std::vector<KeyDef>& key_defs() {
  static const std::vector<KeyDef> defs = {
      {"sinks",
       [](std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, "sinks", v, 0, 1 << 20, &x));
         c.sinks = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.sinks); }},
      {"nm",
       [](std::string_view v, PolicyConfig& c) {
         const size_t colon = v.find(':');
         int64_t a = 0, b = 0;
         if (colon == std::string_view::npos || !parse_i64(v.substr(0, colon), &a) ||
             !parse_i64(v.substr(colon + 1), &b) || a <= 0 || b <= 0 || a > 1000000 ||
             b > 1000000) {
           return bad_value(c.name, "nm", v, "N:M with two positive integers, e.g. 3:1");
         }
         c.nm_n = static_cast<int>(a);
         c.nm_m = static_cast<int>(b);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.nm_n) + ":" + std::to_string(c.nm_m); }},
      {"beta",
       [](std::string_view v, PolicyConfig& c) {
         double x = 0;
         if (!parse_f64(v, &x) || !(x > 0.0 && x < 1.0))
           return bad_value(c.name, "beta", v, "a number in (0, 1)");
         c.beta = x;
         return Status();
       },
       [](const PolicyConfig& c) { return fmt_f64(c.beta); }},
      {"layers",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "layers", v, kLayerWords, &i));
         c.layers = static_cast<LayerRule>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kLayerWords[static_cast<size_t>(c.layers)]);
       }},
      {"merge",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "merge", v, kMergeWords, &i));
         c.merge = static_cast<MergeRule>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kMergeWords[static_cast<size_t>(c.merge)]);
       }},
      {"sim",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "sim", v, kSimWords, &i));
         c.sim = static_cast<SimOn>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kSimWords[static_cast<size_t>(c.sim)]); }},
      {"ema",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "ema", v, kEmaWords, &i));
         c.ema = static_cast<EmaRule>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kEmaWords[static_cast<size_t>(c.ema)]); }},
      {"mscore",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "mscore", v, kMscoreWords, &i));
         c.mscore = static_cast<MergedScore>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kMscoreWords[static_cast<size_t>(c.mscore)]);
       }},
      {"mrope",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "mrope", v, kMropeWords, &i));
         c.mspace = static_cast<MergeSpace>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kMropeWords[static_cast<size_t>(c.mspace)]);
       }},
      {"decide",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "decide", v, kDecideWords, &i));
         c.decide = static_cast<MergeDecision>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kDecideWords[static_cast<size_t>(c.decide)]);
       }},
      {"protect",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "protect", v, kProtectWords, &i));
         c.protect = static_cast<ProtectRule>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kProtectWords[static_cast<size_t>(c.protect)]);
       }},
      {"mass",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "mass", v, kOnOffWords, &i));
         c.mass = i == 1;
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kOnOffWords[c.mass ? 1 : 0]); }},
      {"window",
       [](std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, "window", v, 1, 1 << 20, &x));
         c.window = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.window); }},
      {"kernel",
       [](std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         if (!parse_i64(v, &x) || x < 1 || x > 1001 || x % 2 == 0) {
           return bad_value(c.name, "kernel", v, "an odd integer from 1 to 1001");
         }
         c.kernel = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.kernel); }},
      {"pool",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "pool", v, kPoolWords, &i));
         c.pool = static_cast<PoolKind>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kPoolWords[static_cast<size_t>(c.pool)]); }},
      {"pbeta",
       [](std::string_view v, PolicyConfig& c) {
         double x = 0;
         if (!parse_f64(v, &x) || !(x >= 1.0 && x <= 1e6))
           return bad_value(c.name, "pbeta", v, "a number >= 1");
         c.pbeta = x;
         return Status();
       },
       [](const PolicyConfig& c) { return fmt_f64(c.pbeta); }},
      {"pos",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "pos", v, kPosWords, &i));
         c.pos = static_cast<PosMode>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kPosWords[static_cast<size_t>(c.pos)]); }},
      {"mb",
       [](std::string_view v, PolicyConfig& c) {
         if (v == "recent") {
           c.cam_targets = 0;
           return Status();
         }
         int64_t x = 0;
         if (!parse_i64(v, &x) || x < 1 || x > (1 << 20)) {
           return bad_value(c.name, "mb", v, "'recent' or a positive integer");
         }
         c.cam_targets = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) {
         return c.cam_targets == 0 ? std::string("recent") : std::to_string(c.cam_targets);
       }},
      {"seed",
       [](std::string_view v, PolicyConfig& c) {
         uint64_t x = 0;
         if (!parse_u64(v, &x)) return bad_value(c.name, "seed", v, "a non-negative integer");
         c.seed = x;
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.seed); }},
      {"agg",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "agg", v, kAggWords, &i));
         c.agg = static_cast<ScoreAgg>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kAggWords[static_cast<size_t>(c.agg)]); }},
      {"norm",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "norm", v, kNormWords, &i));
         c.norm = static_cast<ScoreNorm>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kNormWords[static_cast<size_t>(c.norm)]); }},
      {"recent",
       [](std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, "recent", v, 0, 1 << 20, &x));
         c.recent = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.recent); }},
      {"heads",
       [](std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, "heads", v, kHeadsWords, &i));
         c.heads = static_cast<HeadRule>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kHeadsWords[static_cast<size_t>(c.heads)]); },
       [](const PolicyConfig& c) { return c.heads != HeadRule::kUniform; }},
      {"floor",
       [](std::string_view v, PolicyConfig& c) { return share_key(c.name, "floor", v, &c.floor); },
       [](const PolicyConfig& c) { return fmt_f64(c.floor); },
       [](const PolicyConfig& c) { return c.heads != HeadRule::kUniform; }},
      {"distinct",
       [](std::string_view v, PolicyConfig& c) {
         return share_key(c.name, "distinct", v, &c.distinct);
       },
       [](const PolicyConfig& c) { return fmt_f64(c.distinct); },
       [](const PolicyConfig& c) { return c.distinct != 0.0; }},
  };
  return defs;
}

const KeyDef* find_key(std::string_view name) {
  for (const KeyDef& k : key_defs()) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

// ---- presets (the registration point of a new method) --------------------------------------

struct PresetDef {
  const char* name;
  void (*defaults)(PolicyConfig& c);
  std::vector<const char*> keys;  // accepted keys besides ratio/budget, in canonical order
};

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
       {"sinks", "nm", "agg", "norm", "heads", "floor", "distinct"}},
      {"snapkv",
       [](PolicyConfig& c) { c.selector = Selector::kSnapWindow; },
       {"window", "kernel", "pool", "agg", "heads", "floor"}},
      {"pyramidkv",
       [](PolicyConfig& c) {
         c.selector = Selector::kSnapWindow;
         c.layers = LayerRule::kPyramid;
       },
       {"window", "kernel", "pool", "pbeta", "agg", "heads", "floor"}},
      {"roco",
       [](PolicyConfig& c) {
         c.selector = Selector::kHeavyRecent;
         c.sinks = 0;
         c.nm_n = c.nm_m = 1;
         c.norm = ScoreNorm::kQueries;
       },
       {"sinks", "nm", "agg", "heads", "floor"}},
      {"cam",
       [](PolicyConfig& c) {
         c.selector = Selector::kSinkRecent;
         c.sinks = 4;
         c.merger = Merger::kCam;
       },
       {"sinks", "mb", "seed", "agg"}},
      {"d2o",
       [](PolicyConfig& c) {
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
       },
       {"sinks", "nm", "beta", "layers", "merge", "sim", "ema", "agg", "norm", "mscore", "mrope",
        "decide", "protect", "mass", "heads", "floor", "distinct"}},
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
    for (const char* k : p.keys) {
      const KeyDef* d = find_key(k);
      if (!d->shown || d->shown(c)) s += std::string(",") + k + "=" + d->print(c);
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
  // The research-code reading of D2O is a set of defaults: apply it before the explicit keys.
  for (const auto& [key, value] : items) {
    if (key != "reading" || name != "d2o") continue;
    int i = 0;
    D2O_RETURN_IF_ERROR(word_key(name, key, value, kReadingWords, &i));
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
    D2O_RETURN_IF_ERROR(find_key(key)->parse(value, c));
  }
  bool has_floor = false;
  for (const auto& kv : items) has_floor = has_floor || kv.first == "floor";
  if (has_floor && c.heads != HeadRule::kAda)
    return invalid_argument("KV policy '" + name + "': floor= applies only with heads=ada");
  if (c.heads == HeadRule::kAda && c.distinct > 0.0) {
    return invalid_argument("KV policy '" + name +
                            "': distinct= applies with heads=uniform (heads=ada shares the "
                            "places over the heads by attention score alone)");
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
  // SnapKV and PyramidKV compress the prompt only; in budget mode they keep the capacity.
  if (c.selector == Selector::kSnapWindow) c.compact_after_first = c.mode == BudgetMode::kBudget;
  return std::unique_ptr<KvPolicy>(new ComposedPolicy(std::move(c)));
}

}  // namespace d2o
