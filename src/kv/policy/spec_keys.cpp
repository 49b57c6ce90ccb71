// Policy spec keys (spec_keys.h): the value parsers and the registry of keys, each with how it
// is parsed and printed. docs/ADDING_A_POLICY.md has the reference table.
#include "kv/policy/spec_keys.h"

#include <charconv>
#include <cmath>
#include <limits>

namespace d2o::spec_detail {

namespace {

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

}  // namespace

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
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

const std::vector<const char*> kReadingWords = {"paper", "research"};

namespace {

// A share: a number in [0, 1].
Status share_key(const std::string& policy, std::string_view key, std::string_view v, double* out) {
  if (!parse_f64(v, out) || !(*out >= 0.0 && *out <= 1.0))
    return bad_value(policy, key, v, "a number in [0, 1]");
  return {};
}

const std::vector<const char*> kAggWords = {"sum", "mean", "max"};
const std::vector<const char*> kNormWords = {"none", "queries"};
const std::vector<const char*> kPoolWords = {"max", "avg"};
const std::vector<const char*> kPosWords = {"original", "shift"};
const std::vector<const char*> kLayerWords = {"uniform", "variance", "reciprocal",
                                              "exp",     "pyramid",  "research"};
const std::vector<const char*> kMergeWords = {"off", "weighted", "average", "research", "sized"};
const std::vector<const char*> kSimWords = {"key", "value", "kv"};
const std::vector<const char*> kEmaWords = {"paper", "research"};
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

}  // namespace

const KeyDef* find_key(std::string_view name) {
  for (const KeyDef& k : key_defs()) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

}  // namespace d2o::spec_detail
