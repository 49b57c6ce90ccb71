// Policy specs as they were recorded: reports, session files and scripts hold canonical specs
// of earlier releases (the old key names, d2o's paper-era defaults, d2o before its cold tier,
// cold tiers before recall_ranking= or recall_all_up_to= was printed);
// each reads as the policy it ran, in today's canonical form (policy.h: recorded_spec_today).
#include <initializer_list>
#include <string>
#include <string_view>

#include "kv/policy.h"
#include "kv/policy/spec_keys.h"

namespace d2o {

namespace {

using spec_detail::current_word;
using spec_detail::find_key;
using spec_detail::split_items;

// `spec` with every old key name and old value word (kOldSpellings) in today's spelling, the
// rest, spaces included, as it is: a spec canonical under the old names becomes canonical.
std::string respelled(std::string_view spec) {
  const size_t colon = spec.find(':');
  if (colon == std::string_view::npos) return std::string(spec);
  std::string out(spec.substr(0, colon + 1));
  bool first = true;
  for (const std::string_view item : split_items(spec.substr(colon + 1))) {
    if (!first) out += ',';
    first = false;
    const size_t eq = item.find('=');
    const spec_detail::KeyDef* d =
        eq == std::string_view::npos ? nullptr : find_key(item.substr(0, eq));
    if (!d) {
      out += item;
      continue;
    }
    out += std::string(d->name) + "=" + std::string(current_word(*d, item.substr(eq + 1)));
  }
  return out;
}

// Canonical d2o specs written before d2o's defaults had a cold tier carry no cold= key and meant
// none: read with cold=none, the spec must print as it was written once that key is left out.
std::string pre_tier_d2o_spec(const std::string& spec) {
  if (spec.rfind("d2o:", 0) != 0) return "";
  const std::string body = spec.substr(4);  // (the items are views into it)
  for (const std::string_view item : split_items(body)) {
    if (item.rfind("cold=", 0) == 0 || item.rfind("reading=", 0) == 0) return "";
  }
  auto p = parse_kv_policy(spec + ",cold=none");
  if (!p.ok()) return "";
  const std::string now = (*p)->spec();
  std::string then;
  for (const std::string_view item : split_items(now)) {
    if (item != "cold=none") then += (then.empty() ? "" : ",") + std::string(item);
  }
  return then == spec ? now : "";
}

// Canonical specs with a cold tier written before some of its keys were printed carry none of
// them and meant `added` (key=value items, in the order they print): read with them, the spec
// must print as it was written once they are left out again.
std::string pre_tier_keys_spec(const std::string& spec,
                               std::initializer_list<std::string_view> added) {
  const size_t colon = spec.find(':');
  if (colon == std::string::npos) return "";
  const std::string body = spec.substr(colon + 1);  // (the items are views into it)
  bool tier = false;
  for (const std::string_view item : split_items(body)) {
    for (const std::string_view a : added) {
      if (item.substr(0, item.find('=')) == a.substr(0, a.find('='))) return "";
    }
    if (item == "cold=memory" || item == "cold=disk") tier = true;
  }
  if (!tier) return "";
  std::string with = spec;
  for (const std::string_view a : added) with += "," + std::string(a);
  auto p = parse_kv_policy(with);
  if (!p.ok()) return "";
  const std::string now = (*p)->spec();
  const size_t at = now.find(':') + 1;
  const std::string now_body = now.substr(at);  // (the items are views into it)
  std::string then = now.substr(0, at);
  bool first = true;
  for (const std::string_view item : split_items(now_body)) {
    bool was_added = false;
    for (const std::string_view a : added) was_added = was_added || item == a;
    if (was_added) continue;
    then += (first ? "" : ",") + std::string(item);
    first = false;
  }
  return then == spec ? now : "";
}

// Cold tiers written before recall_ranking= was printed ranked by max (the recall= they printed
// keeps its value); before recall_all_up_to= was printed, a turn never recalled a whole tier.
std::string pre_ranking_spec(const std::string& spec) {
  return pre_tier_keys_spec(spec, {"recall_ranking=max", "recall_all_up_to=0"});
}
std::string pre_recall_all_spec(const std::string& spec) {
  return pre_tier_keys_spec(spec, {"recall_all_up_to=0"});
}

}  // namespace

std::string paper_era_d2o_spec(const std::string& recorded) {
  // Canonical d2o specs written while the defaults were the paper's omit the keys that now
  // differ from the defaults that followed them wherever they had the paper's value: read with
  // reading=paper, the spec must print as it was written once those keys are left out again. Those
  // specs predate the readable key names: compare them in today's.
  const std::string spec = respelled(recorded);
  if (spec.rfind("d2o:", 0) != 0 || spec.find("reading=") != std::string::npos) return "";
  auto today = parse_kv_policy(spec);
  if (today.ok() && (*today)->spec() == spec) return "";  // today's canonical form
  if (!pre_tier_d2o_spec(spec).empty()) return "";        // canonical before the cold tier
  if (!pre_ranking_spec(spec).empty()) return "";         // canonical before recall_ranking=
  if (!pre_recall_all_spec(spec).empty()) return "";      // canonical before recall_all_up_to=
  auto p = parse_kv_policy("d2o:reading=paper," + spec.substr(4));
  if (!p.ok()) return "";
  const std::string now = (*p)->spec();
  std::string then;
  for (const std::string_view item : split_items(now)) {
    if (item != "prompt_ranking=accumulated" && item != "prompt_merge=on" &&
        item != "prompt_scores=accumulated" && item != "cold=none")
      then += (then.empty() ? "" : ",") + std::string(item);
  }
  return then == spec ? now : "";
}

std::string recorded_spec_today(const std::string& recorded) {
  const std::string spec = respelled(recorded);
  auto p = parse_kv_policy(spec);
  if (p.ok() && (*p)->spec() == spec) return spec;
  if (std::string now = pre_tier_d2o_spec(spec); !now.empty()) return now;
  if (std::string now = pre_ranking_spec(spec); !now.empty()) return now;
  if (std::string now = pre_recall_all_spec(spec); !now.empty()) return now;
  return paper_era_d2o_spec(recorded);
}

}  // namespace d2o
