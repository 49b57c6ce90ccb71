#include "kv/policy/keeper.h"

#include <algorithm>

#include "core/assert.h"
#include "kv/policy/scorer.h"
#include "kv/policy/select.h"
#include "kv/policy/spec_keys.h"

namespace d2o {

Keeper Keeper::of(const PolicyConfig& cfg) {
  switch (cfg.selector) {
    case Selector::kSinkRecent:
      return Keeper(Recent::kAll, cfg.sinks, 0);
    case Selector::kHeavyRecent:
      return Keeper(Recent::kSplit, cfg.sinks, 0, cfg.nm_n, cfg.nm_m);
    case Selector::kSnapWindow:
      return Keeper(Recent::kWindow, 0, cfg.window);
    case Selector::kKeyDiff:
      return Keeper(Recent::kFixed, cfg.sinks, cfg.recent);
  }
  return {};
}

Keeper Keeper::prompt_window(const PolicyConfig& cfg) {
  return Keeper(Recent::kWindow, cfg.sinks, cfg.window);
}

KeepShape Keeper::shape(int S) const {
  KeepShape s;
  s.sinks = std::min(sinks_, S);
  switch (rule_) {
    case Recent::kAll:
      s.recent = S - s.sinks;
      break;
    case Recent::kSplit: {
      int heavy = 0;
      split_heavy_recent(S, sinks_, nm_n_, nm_m_, &heavy, &s.recent);
      break;
    }
    case Recent::kWindow:
    case Recent::kFixed:
      s.recent = std::min(recent_, S - s.sinks);
      break;
  }
  s.top = S - s.sinks - s.recent;
  return s;
}

void Keeper::keep(const HeadView& h, const Scorer* scorer, SelectScratch& sc, int32_t* keep) const {
  const KeepShape s = shape(h.S);
  const int n = h.n, t = s.sinks, r = s.recent, mid = n - t - r;
  D2O_ASSERT(h.S <= n && mid >= s.top);
  if (s.top == 0 || s.top == mid) {  // nothing ranked: no scores needed
    write_range(keep, 0, t);
    write_range(keep + t, t, s.top);
    write_range(keep + t + s.top, n - r, r);
    return;
  }
  D2O_ASSERT(scorer != nullptr);
  const int worst = s.top == mid - 1 ? scorer->last_lowest(h, t, n - r) : -1;
  if (worst >= 0) {  // one eviction: every slot but `worst`
    write_range(keep, 0, worst);
    write_range(keep + worst, worst + 1, n - worst - 1);
    return;
  }
  keep_ranked(scorer->score(h, t, n - r, sc, sc.score.data()), n, h.S, sc, keep);
}

void Keeper::keep_ranked(const float* score, int n, int S, SelectScratch& sc, int32_t* keep) const {
  const KeepShape s = shape(S);
  const int t = s.sinks, r = s.recent;
  D2O_ASSERT(S <= n);
  write_range(keep, 0, t);
  select_top(score, t, n - t - r, s.top, keep + t, sc.order.data());
  write_range(keep + t + s.top, n - r, r);
}

}  // namespace d2o

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kPositionsWords = {"original", "shifted"};
}  // namespace

// The keeper's keys: the protected slots (sinks=, recent=, the heavy/recent split heavy_recent=)
// and whether kept slots keep their positions (positions=).
std::vector<KeyDef> keeper_keys() {
  return {
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
      int_def<&PolicyConfig::recent, 0, 1 << 20>("recent"),
      word_def<&PolicyConfig::pos, kPositionsWords>("positions"),
  };
}

}  // namespace d2o::spec_detail
