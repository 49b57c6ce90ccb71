// Policy spec keys (spec_keys.h): the value parsers and the registry of keys, each with how it
// is parsed and printed. docs/ADDING_A_POLICY.md has the reference table.
#include "kv/policy/spec_keys.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kv/policy/scorer.h"

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
const std::vector<const char*> kPoolWords = {"max", "avg"};
const std::vector<const char*> kPromptWords = {"accumulated", "window"};
const std::vector<const char*> kRankingWords = {"accumulated", "window", "reconstruction",
                                                "expected"};
const std::vector<const char*> kValueWeightWords = {"norm", "none"};
const std::vector<const char*> kPositionsWords = {"original", "shifted"};
const std::vector<const char*> kLayerWords = {"uniform", "variance", "reciprocal",
                                              "exp",     "pyramid",  "research"};
const std::vector<const char*> kMergeWords = {"off", "weighted", "average", "research", "sized"};
const std::vector<const char*> kSimWords = {"key", "value", "kv"};
const std::vector<const char*> kEmaWords = {"paper", "research"};
const std::vector<const char*> kMergedScoreWords = {"sum", "keep", "mean", "max"};
const std::vector<const char*> kMergeKeysWords = {"rotated", "unrotated"};
const std::vector<const char*> kDecisionWords = {"per_head", "per_token"};
const std::vector<const char*> kOnOffWords = {"off", "on"};
const std::vector<const char*> kHeadsWords = {"uniform", "ada"};
const std::vector<const char*> kPrefillWords = {"exact", "bounded"};

// The spellings of before the keys were given readable names: each renamed key's old name and,
// where its values were renamed too, its old value words, index for index with its words (null:
// unchanged). Accepted for good, since reports, session files and scripts hold them.
struct OldSpelling {
  const char* old_name;
  const char* name;
  std::vector<const char*> old_words;
};
const std::vector<OldSpelling> kOldSpellings = {
    {"nm", "heavy_recent", {}},
    {"mscore", "merged_score", {}},
    {"mrope", "merge_keys", {"post", "pre"}},
    {"decide", "merge_decision", {"head", "token"}},
    {"protect", "keep_edge_layers", {"none", "edges"}},
    {"mass", "proportional_attention", {}},
    {"pbeta", "pyramid_beta", {}},
    {"pos", "positions", {nullptr, "shift"}},
    {"mb", "merge_targets", {}},
    {"distinct", "distinct_share", {}},
    {"pmerge", "prompt_merge", {}},
    {"prompt", "prompt_ranking", {"acc", nullptr}},
    {"pscore", "prompt_scores", {"acc", nullptr}},
    {"hold", "hold_budget", {}},
    {"norm", "scorer", {"none", "queries"}},
};

constexpr int kMaxInt = std::numeric_limits<int>::max();

// A key whose value is one of `Words`, stored as its index in the enum (or bool) `Member`.
template <auto Member, const std::vector<const char*>& Words>
KeyDef word_def(const char* name, ShownFn shown = nullptr, ShownFn applies = nullptr) {
  KeyDef d = {
      name,
      [](std::string_view key, std::string_view v, PolicyConfig& c) {
        int i = 0;
        D2O_RETURN_IF_ERROR(word_key(c.name, key, v, Words, &i));
        c.*Member = static_cast<std::remove_reference_t<decltype(c.*Member)>>(i);
        return Status();
      },
      [](const PolicyConfig& c) { return std::string(Words[static_cast<size_t>(c.*Member)]); },
      shown, applies};
  d.words = &Words;
  return d;
}

// An integer key within [lo, hi] stored in the int `Member`.
template <int PolicyConfig::*Member, int64_t Lo, int64_t Hi>
KeyDef int_def(const char* name, ShownFn shown = nullptr, ShownFn applies = nullptr) {
  return {name,
          [](std::string_view key, std::string_view v, PolicyConfig& c) {
            int64_t x = 0;
            D2O_RETURN_IF_ERROR(int_key(c.name, key, v, Lo, Hi, &x));
            c.*Member = static_cast<int>(x);
            return Status();
          },
          [](const PolicyConfig& c) { return std::to_string(c.*Member); }, shown, applies};
}

// SnapKV's pooling keys (and prompt_scores=): always for its selector, for the heavy-hitter ones
// with a prompt phase (prompt_ranking=window, reconstruction or expected).
bool window_shown(const PolicyConfig& c) {
  return c.needs_window() || c.prompt_phase();
}

// window= itself: also where expected attention reads the last `window` queries.
bool window_count_shown(const PolicyConfig& c) {
  return window_shown(c) || reads_queries(c);
}

// Expected attention's own keys (future=, value_weight=).
bool expected_shown(const PolicyConfig& c) {
  return reads_queries(c);
}

// Keys shown only away from the uniform per-head rule, or with a share of distinct keys (added
// after specs were recorded).
bool ada_shown(const PolicyConfig& c) {
  return c.heads != HeadRule::kUniform;
}

// The cold tier's keys: shown (and meaningful) only with one.
bool cold_shown(const PolicyConfig& c) {
  return c.cold.enabled();
}
const std::vector<const char*> kColdWords = {"none", "memory", "disk"};

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

// `defs` with their old spellings (kOldSpellings) filled in.
std::vector<KeyDef> with_old_spellings(std::vector<KeyDef> defs) {
  for (KeyDef& d : defs) {
    if (std::string_view(d.name) == "scorer") d.words = &scorer_words();
  }
  for (const OldSpelling& o : kOldSpellings) {
    for (KeyDef& d : defs) {
      if (std::string_view(d.name) != o.name) continue;
      d.old_name = o.old_name;
      if (!o.old_words.empty()) d.old_words = &o.old_words;
    }
  }
  return defs;
}

}  // namespace

const std::vector<KeyDef>& key_defs() {
  static const std::vector<KeyDef> defs = with_old_spellings({
      // Shown when bounded (added after specs were recorded); meaningful in ratio mode only.
      word_def<&PolicyConfig::prefill, kPrefillWords>(
          "prefill", [](const PolicyConfig& c) { return c.prefill != PrefillMode::kExact; },
          [](const PolicyConfig& c) { return c.mode == BudgetMode::kRatio; }),
      int_def<&PolicyConfig::sinks, 0, 1 << 20>("sinks"),
      {"heavy_recent",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         const size_t colon = v.find(':');
         int64_t a = 0, b = 0;
         if (colon == std::string_view::npos || !parse_i64(v.substr(0, colon), &a) ||
             !parse_i64(v.substr(colon + 1), &b) || a <= 0 || b <= 0 || a > 1000000 ||
             b > 1000000) {
           return bad_value(c.name, key, v, "N:M with two positive integers, e.g. 3:1");
         }
         c.nm_n = static_cast<int>(a);
         c.nm_m = static_cast<int>(b);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.nm_n) + ":" + std::to_string(c.nm_m); }},
      {"beta",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         double x = 0;
         if (!parse_f64(v, &x) || !(x > 0.0 && x < 1.0))
           return bad_value(c.name, key, v, "a number in (0, 1)");
         c.beta = x;
         return Status();
       },
       [](const PolicyConfig& c) { return fmt_f64(c.beta); }},
      word_def<&PolicyConfig::layers, kLayerWords>("layers"),
      word_def<&PolicyConfig::merge, kMergeWords>("merge"),
      word_def<&PolicyConfig::sim, kSimWords>("sim"),
      word_def<&PolicyConfig::ema, kEmaWords>("ema"),
      word_def<&PolicyConfig::mscore, kMergedScoreWords>("merged_score"),
      word_def<&PolicyConfig::mspace, kMergeKeysWords>("merge_keys"),
      word_def<&PolicyConfig::decide, kDecisionWords>("merge_decision"),
      word_def<&PolicyConfig::protect, kOnOffWords>("keep_edge_layers"),
      word_def<&PolicyConfig::mass, kOnOffWords>("proportional_attention"),
      int_def<&PolicyConfig::window, 1, 1 << 20>("window", nullptr, window_count_shown),
      {"kernel",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         if (!parse_i64(v, &x) || x < 1 || x > 1001 || x % 2 == 0) {
           return bad_value(c.name, key, v, "an odd integer from 1 to 1001");
         }
         c.kernel = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.kernel); }, nullptr, window_shown},
      word_def<&PolicyConfig::pool, kPoolWords>("pool", nullptr, window_shown),
      {"pyramid_beta",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         double x = 0;
         if (!parse_f64(v, &x) || !(x >= 1.0 && x <= 1e6))
           return bad_value(c.name, key, v, "a number >= 1");
         c.pbeta = x;
         return Status();
       },
       [](const PolicyConfig& c) { return fmt_f64(c.pbeta); }},
      word_def<&PolicyConfig::pos, kPositionsWords>("positions"),
      {"merge_targets",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         if (v == "recent") {
           c.cam_targets = 0;
           return Status();
         }
         int64_t x = 0;
         if (!parse_i64(v, &x) || x < 1 || x > (1 << 20)) {
           return bad_value(c.name, key, v, "'recent' or a positive integer");
         }
         c.cam_targets = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) {
         return c.cam_targets == 0 ? std::string("recent") : std::to_string(c.cam_targets);
       }},
      {"seed",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         uint64_t x = 0;
         if (!parse_u64(v, &x)) return bad_value(c.name, key, v, "a non-negative integer");
         c.seed = x;
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.seed); }},
      word_def<&PolicyConfig::agg, kAggWords>("agg"),
      {"scorer",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         if (!find_scorer(v)) return bad_value(c.name, key, v, "one of " + scorer_words_list());
         c.scorer = std::string(v);
         return Status();
       },
       [](const PolicyConfig& c) { return c.scorer; }},
      int_def<&PolicyConfig::recent, 0, 1 << 20>("recent"),
      word_def<&PolicyConfig::heads, kHeadsWords>("heads", ada_shown),
      {"floor",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         return share_key(c.name, key, v, &c.floor);
       },
       [](const PolicyConfig& c) { return fmt_f64(c.floor); }, ada_shown},
      {"distinct_share",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         return share_key(c.name, key, v, &c.distinct);
       },
       [](const PolicyConfig& c) { return fmt_f64(c.distinct); },
       [](const PolicyConfig& c) { return c.distinct != 0.0; }},
      word_def<&PolicyConfig::prompt_merge, kOnOffWords>(
          "prompt_merge", [](const PolicyConfig& c) { return !c.prompt_merge; }),
      word_def<&PolicyConfig::prompt, kRankingWords>(
          "prompt_ranking",
          [](const PolicyConfig& c) { return c.prompt != PromptScore::kAccumulated; }),
      word_def<&PolicyConfig::pscore, kPromptWords>(
          "prompt_scores",
          [](const PolicyConfig& c) { return c.pscore != PromptScore::kAccumulated; },
          window_shown),
      int_def<&PolicyConfig::future, 1, 1 << 16>("future", nullptr, expected_shown),
      word_def<&PolicyConfig::value_weight, kValueWeightWords>("value_weight", nullptr,
                                                              expected_shown),
      {"cold",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, key, v, kColdWords, &i));
         c.cold.place = static_cast<ColdPlace>(i);
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kColdWords[static_cast<size_t>(c.cold.place)]); },
       cold_shown},
      {"cold_type",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         auto t = parse_kv_type(std::string(v));
         if (!t.ok()) return bad_value(c.name, key, v, "a KV storage type such as q4_0r, q8_0 or f16");
         c.cold.type = *t;
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kv_type_name(c.cold.type)); }, nullptr,
       cold_shown},
      {"cold_size",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, key, v, 0, int64_t{1} << 40, &x));
         c.cold.max_slots = x;
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.cold.max_slots); }, nullptr,
       cold_shown},
      {"recall",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, key, v, 1, 1 << 20, &x));
         c.cold.recall = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.cold.recall); }, nullptr, cold_shown},
      word_def<&PolicyConfig::hold, kOnOffWords>(
          "hold_budget", [](const PolicyConfig& c) { return c.hold; },
          [](const PolicyConfig& c) { return c.mode == BudgetMode::kRatio; }),
  });
  return defs;
}

const KeyDef* find_key(std::string_view name) {
  for (const KeyDef& k : key_defs()) {
    if (name == k.name || (k.old_name && name == k.old_name)) return &k;
  }
  return nullptr;
}

std::vector<std::string_view> split_items(std::string_view body) {
  std::vector<std::string_view> out;
  while (true) {
    const size_t comma = body.find(',');
    out.push_back(body.substr(0, comma));
    if (comma == std::string_view::npos) return out;
    body = body.substr(comma + 1);
  }
}

std::string_view current_word(const KeyDef& d, std::string_view v) {
  if (!d.old_words) return v;
  for (size_t i = 0; i < d.old_words->size(); ++i) {
    const char* old = (*d.old_words)[i];
    if (old && v == old) return (*d.words)[i];
  }
  return v;
}

}  // namespace d2o::spec_detail
