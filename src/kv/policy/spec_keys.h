// The keys of policy spec strings (spec.cpp): how each value is parsed and printed, and the
// value parsers the grammar shares with them. Internal to the spec parser.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "d2o/status.h"
#include "kv/policy/config.h"

namespace d2o::spec_detail {

std::string_view trim(std::string_view s);
bool parse_f64(std::string_view v, double* out);
// Shortest round-trip form.
std::string fmt_f64(double x);
Status bad_value(const std::string& policy, std::string_view key, std::string_view value,
                 const std::string& allowed);
// An integer key within [lo, hi].
Status int_key(const std::string& policy, std::string_view key, std::string_view v, int64_t lo,
               int64_t hi, int64_t* out);
// One of a list of words; index into `words` on success.
Status word_key(const std::string& policy, std::string_view key, std::string_view v,
                const std::vector<const char*>& words, int* out);

// d2o's reading= values (a shorthand applied before the other keys, not a KeyDef).
extern const std::vector<const char*> kReadingWords;

// Parses value `v` of key `key` (the key's name, for error messages) into `c`.
using ParseFn = Status (*)(std::string_view key, std::string_view v, PolicyConfig& c);
using PrintFn = std::string (*)(const PolicyConfig& c);
using ShownFn = bool (*)(const PolicyConfig& c);

struct KeyDef {
  const char* name;  // canonical, printed by spec()
  ParseFn parse;
  PrintFn print;
  // Non-null: the canonical form shows the key when this says so (keys added after specs were
  // recorded, printed when they differ from the behaviour those specs had) or when its value
  // differs from the preset's default (so that the form parses back to the same config).
  ShownFn shown = nullptr;
  // Non-null: the key means something only when this says so (SnapKV's window keys, for the
  // heavy-hitter policies only with prompt_ranking=window); otherwise it is never shown.
  ShownFn applies = nullptr;
  // The spellings of before the keys were given readable names, accepted for good since reports,
  // session files and scripts hold them: the key's old name (null: it kept its name), and for a
  // word key its value words (`words`, what it prints) with their old words index for index
  // (`old_words`, null entries for words that kept their spelling).
  const char* old_name = nullptr;
  const std::vector<const char*>* words = nullptr;
  const std::vector<const char*>* old_words = nullptr;
};

// Every key: each part's keys (below), in key_defs()'s order of parts, with their old spellings.
const std::vector<KeyDef>& key_defs();

// The keys each part of a policy owns, registered by the part's own file (one line each in
// key_defs()). What a preset accepts, and in which order its canonical form prints them, follows
// from the parts it is made of (presets.cpp).
std::vector<KeyDef> budget_keys();      // budgets.cpp: prefill, layers, beta, pyramid_beta, ...
std::vector<KeyDef> keeper_keys();      // keeper.cpp: sinks, heavy_recent, recent, positions
std::vector<KeyDef> scorer_keys();      // scorers.cpp: scorer, agg, proportional_attention
std::vector<KeyDef> window_keys();      // score_window.cpp: window, kernel, pool, prompt_*
std::vector<KeyDef> expected_keys();    // score_expected.cpp: future, value_weight
std::vector<KeyDef> head_keys();        // select_heads.cpp: heads, floor, distinct_share
std::vector<KeyDef> d2o_merger_keys();  // merger_d2o.cpp: merge, sim, ema, merged_score, ...
std::vector<KeyDef> cam_merger_keys();  // merger_cam.cpp: merge_targets, seed
std::vector<KeyDef> cold_tier_keys();   // cold_keys.cpp: cold, cold_type, cold_size, recall

// ---- what the parts' registrations share ---------------------------------------------------

bool parse_i64(std::string_view v, int64_t* out);
bool parse_u64(std::string_view v, uint64_t* out);
// A share: a number in [0, 1].
Status share_key(const std::string& policy, std::string_view key, std::string_view v, double* out);
extern const std::vector<const char*> kOnOffWords;  // off, on

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
bool window_shown(const PolicyConfig& c);

// The key called `name`, by its canonical or its old name, or null.
const KeyDef* find_key(std::string_view name);

// `v` in today's spelling: an old value word of `d` becomes the word it stands for; any other
// value is returned as it is.
std::string_view current_word(const KeyDef& d, std::string_view v);

// The one-line summary of preset `name` (spec_docs.cpp); "" for a name it does not know.
const char* preset_line(std::string_view name);

// "k=v,k=v" cut at its commas, untrimmed (views into `body`).
std::vector<std::string_view> split_items(std::string_view body);

}  // namespace d2o::spec_detail
