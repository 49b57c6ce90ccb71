// Policy spec keys (spec_keys.h): the value parsers and the registry of keys, each with how it
// is parsed and printed. docs/ADDING_A_POLICY.md has the reference table.
#include "kv/policy/spec_keys.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kv/policy/scorer.h"

namespace d2o::spec_detail {

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

Status share_key(const std::string& policy, std::string_view key, std::string_view v, double* out) {
  if (!parse_f64(v, out) || !(*out >= 0.0 && *out <= 1.0))
    return bad_value(policy, key, v, "a number in [0, 1]");
  return {};
}

const std::vector<const char*> kOnOffWords = {"off", "on"};

bool window_shown(const PolicyConfig& c) {
  return c.needs_window() || c.prompt_phase();
}

namespace {

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

// `defs` with their old spellings (kOldSpellings) filled in.
std::vector<KeyDef> with_old_spellings(std::vector<KeyDef> defs) {
  for (const OldSpelling& o : kOldSpellings) {
    for (KeyDef& d : defs) {
      if (std::string_view(d.name) != o.name) continue;
      d.old_name = o.old_name;
      if (!o.old_words.empty()) d.old_words = &o.old_words;
    }
  }
  return defs;
}

// The parts' keys concatenated (each part's file registers its own).
std::vector<KeyDef> all_part_keys() {
  std::vector<KeyDef> all;
  for (std::vector<KeyDef> (*part)() :
       {budget_keys, keeper_keys, scorer_keys, window_keys, expected_keys, head_keys,
        d2o_merger_keys, cam_merger_keys, cold_tier_keys}) {
    for (KeyDef& d : part()) all.push_back(d);
  }
  return all;
}

}  // namespace

const std::vector<KeyDef>& key_defs() {
  static const std::vector<KeyDef> defs = with_old_spellings(all_part_keys());
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
