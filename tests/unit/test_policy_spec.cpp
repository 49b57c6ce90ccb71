// Policy spec strings: canonical round trips, defaults and readings, what each policy asks of the
// attention kernel, every error with its message, and the old spellings of the keys (before they
// had readable names), which parse to the same policies for good.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kv/policy.h"
#include "kv/policy/composed.h"
#include "kv/policy/presets.h"
#include "kv/policy/spec_keys.h"

namespace d2o {
namespace {

const PolicyConfig& config_of(const KvPolicy& p) {
  const auto* cp = dynamic_cast<const ComposedPolicy*>(&p);
  EXPECT_NE(cp, nullptr);
  static PolicyConfig empty;
  return cp ? cp->config() : empty;
}

std::string canonical(const std::string& spec) {
  auto p = parse_kv_policy(spec);
  EXPECT_TRUE(p.ok()) << spec << ": " << p.status().message();
  return p.ok() ? (*p)->spec() : "";
}

// The paper's D2O, canonical: what reading=paper gives.
const char* const kPaperD2o =
    "d2o:ratio=0.2,sinks=4,heavy_recent=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,"
    "ema=paper,agg=sum,scorer=accumulated_attention,merged_score=sum,merge_keys=rotated,merge_"
    "decision=per_head,"
    "keep_edge_layers=off,proportional_attention=off,prompt_ranking=accumulated,prompt_merge=on,"
    "cold=none";

// d2o's defaults (the best measured, with a cold tier on disk), canonical.
const char* const kDefaultD2o =
    "d2o:ratio=0.2,sinks=4,heavy_recent=1:1,beta=0.7,layers=uniform,merge=off,sim=key,ema=paper,"
    "agg=sum,scorer=mean_attention,merged_score=sum,merge_keys=rotated,merge_decision=per_head,"
    "keep_edge_layers=off,proportional_attention=on,prompt_ranking=window,window=32,kernel=21,"
    "pool=avg,prompt_merge=off,prompt_scores=window,cold=disk,cold_type=q8_0,cold_size=0,"
    "recall=512,recall_ranking=sum,recall_all_up_to=2048";

TEST(PolicySpec, DefaultsAreTheBestMeasuredAndThePapers) {
  // d2o's defaults: the best D2O measured, `d2o:merge=sized` without merging
  // (docs/research/results_notes.md, the `merge=off` section).
  EXPECT_EQ(canonical("d2o"), kDefaultD2o);
  EXPECT_EQ(canonical("d2o:proportional_attention=on,merge=off,layers=uniform,heavy_recent=1:1,"
                      "scorer=mean_attention,prompt_ranking=window,kernel=21,prompt_merge=off,"
                      "prompt_scores=window"),
            canonical("d2o"));
  // E, the default before it: d2o with merges.
  EXPECT_EQ(canonical("d2o:merge=sized"),
            std::string(kDefaultD2o)
                .replace(std::string(kDefaultD2o).find("merge=off"), 9, "merge=sized"));
  EXPECT_EQ(canonical("d2o:reading=paper"), kPaperD2o);
  // The paper's keys, given one by one over d2o's defaults, are the paper's reading.
  EXPECT_EQ(
      canonical(
          "d2o:heavy_recent=3:1,layers=variance,merge=weighted,"
          "proportional_attention=off,scorer=accumulated_attention,prompt_ranking=accumulated,"
          "prompt_merge=on"),
      kPaperD2o);
  // Keys that differ from the defaults are printed, those that do not apply are not: the paper's
  // prompt compaction with F's other keys keeps prompt_merge=off and drops the window keys.
  EXPECT_EQ(canonical("d2o:prompt_ranking=accumulated"),
            "d2o:ratio=0.2,sinks=4,heavy_recent=1:1,beta=0.7,layers=uniform,merge=off,sim=key,"
            "ema=paper,agg=sum,scorer=mean_attention,merged_score=sum,merge_keys=rotated,"
            "merge_decision=per_head,keep_edge_layers=off,proportional_attention=on,"
            "prompt_ranking=accumulated,prompt_merge=off,cold=none");
  EXPECT_EQ(canonical("d2o:prompt_scores=accumulated"),
            std::string(kDefaultD2o)
                .replace(std::string(kDefaultD2o).find("prompt_scores=window"), 20,
                         "prompt_scores=accumulated"));
  EXPECT_TRUE(config_of(*parse_kv_policy("d2o:prompt_ranking=accumulated").value()) ==
              config_of(*parse_kv_policy(canonical("d2o:prompt_ranking=accumulated")).value()));
  EXPECT_EQ(canonical("h2o"),
            "h2o:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum,scorer=accumulated_attention");
  EXPECT_EQ(canonical("streaming"), "streaming:ratio=0.2,sinks=4,positions=original");
  EXPECT_EQ(canonical("snapkv"), "snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum");
  EXPECT_EQ(canonical("pyramidkv"),
            "pyramidkv:ratio=0.2,window=32,kernel=7,pool=avg,pyramid_beta=20,agg=sum");
  EXPECT_EQ(canonical("roco"), "roco:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum");
  EXPECT_EQ(canonical("cam"), "cam:ratio=0.2,sinks=4,merge_targets=recent,seed=0,agg=sum");
  EXPECT_EQ(canonical("keydiff"), "keydiff:ratio=0.2,sinks=0,recent=0");
  // distinct_share= is printed only when set, so the specs above stay those of the paper.
  EXPECT_EQ(canonical("h2o:distinct_share=0.5"),
            "h2o:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum,scorer=accumulated_attention,distinct_"
            "share=0.5");
  EXPECT_EQ(canonical("h2o:distinct_share=0"), canonical("h2o"));
  // So are prompt_ranking= (with the window keys it brings) and prompt_merge=.
  EXPECT_EQ(canonical("h2o:prompt_ranking=window"),
            "h2o:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum,scorer=accumulated_attention,prompt_"
            "ranking=window,"
            "window=32,kernel=7,pool=avg");
  EXPECT_EQ(canonical("d2o:reading=paper,prompt_merge=off"),
            std::string(kPaperD2o).replace(std::string(kPaperD2o).find("prompt_merge=on"), 15,
                                           "prompt_merge=off"));
  EXPECT_EQ(canonical("d2o:reading=paper,prompt_merge=on"), kPaperD2o);
  EXPECT_EQ(canonical("roco:prompt_ranking=window,prompt_scores=window"),
            canonical("roco:prompt_ranking=window") + ",prompt_scores=window");
  EXPECT_EQ(canonical("h2o:prompt_ranking=window,prompt_scores=accumulated"),
            canonical("h2o:prompt_ranking=window"));
  const StatsNeeds pw = parse_kv_policy("h2o:prompt_ranking=window,window=16").value()->needs();
  EXPECT_EQ(pw.window, 16);
  EXPECT_TRUE(pw.accumulate);
  EXPECT_EQ(parse_kv_policy("h2o").value()->needs().window, 0);
  EXPECT_EQ(canonical("full"), "full");
  EXPECT_EQ(canonical(""), "full");
  EXPECT_TRUE(parse_kv_policy("full").value()->is_full());
}

TEST(PolicySpec, CanonicalFormRoundTrips) {
  const std::vector<std::string> specs = {
      "d2o:ratio=0.2,sinks=4,heavy_recent=3:1,beta=0.7",
      "d2o:budget=512,beta=0.55,layers=reciprocal,merge=average,sim=kv,ema=research,agg=max,norm="
      "queries",
      "d2o:reading=research",
      "d2o:reading=research,heavy_recent=2:1,merge=weighted",
      "d2o:ratio=0.125,layers=exp",
      "d2o:ratio=0.3333333333333333,layers=pyramid,merge=off",
      "d2o:budget=64,merged_score=max,merge_keys=unrotated,merge_decision=per_token,"
      "keep_edge_layers=on,proportional_attention=on,merge=sized",
      " h2o : budget = 64 , sinks = 4 ",
      "streaming:budget=100,sinks=0,positions=shifted",
      "snapkv:budget=300,window=16,kernel=5,pool=max,agg=mean",
      "pyramidkv:ratio=0.1,pyramid_beta=8.5",
      "roco:ratio=1",
      "cam:budget=64,merge_targets=16,seed=18446744073709551615",
      "keydiff:ratio=0.25",
      "keydiff:budget=64,sinks=4,recent=16",
      "keydiff: recent = 8 , budget = 8",
      "h2o:ratio=0.2,distinct_share=0.5",
      "d2o:ratio=0.2,heavy_recent=1:1,distinct_share=0.25,merge=off,"
      "prompt_ranking=accumulated",
      "d2o:reading=paper,ratio=0.2,heavy_recent=1:1,distinct_share=0.25,merge=off",
      "d2o:ratio=0.2,prompt_ranking=window,kernel=21,pool=max,window=16,prompt_merge=off",
      "d2o:reading=paper,ratio=0.2,prompt_ranking=window,kernel=21,pool=max,window=16,"
      "prompt_merge=off",
      "d2o",
      "d2o:reading=paper",
      "d2o:prompt_ranking=accumulated",
      "d2o:prompt_scores=accumulated,prompt_merge=on,kernel=7",
      "d2o:reading=paper,heads=ada,floor=0.5",
      "d2o:prompt_ranking=accumulated,heads=ada",
      "roco:budget=64,prompt_ranking=window",
      "h2o:ratio=0.2,prompt_ranking=window,prompt_scores=window,kernel=21",
      "d2o:ratio=0.2,prompt_ranking=window,prompt_scores=window,prompt_merge=off,scorer=mean_"
      "attention",
      "snapkv:ratio=0.2,hold_budget=on",
      "pyramidkv:ratio=0.1,hold_budget=on,pyramid_beta=8.5",
      // The old spellings round-trip to the same canonical form.
      "d2o:budget=64,mscore=max,mrope=pre,decide=token,protect=edges,mass=on,merge=sized",
      "h2o:ratio=0.2,nm=3:1,prompt=window,pscore=window,kernel=21",
      // Expected attention.
      "h2o:ratio=0.2,scorer=expected_attention",
      "h2o:budget=64,scorer=expected_attention,window=64,future=128,value_weight=none",
      "h2o:ratio=0.2,scorer=expected_attention,heads=ada,floor=0.3",
      "d2o:ratio=0.2,prompt_ranking=expected",
      "d2o:prompt_ranking=expected,kernel=1,prompt_scores=accumulated,future=1",
      "roco:budget=64,prompt_ranking=expected,window=8,value_weight=none",
      "d2o:prompt_ranking=accumulated,scorer=expected_attention,heads=ada",
  };
  for (const std::string& s : specs) {
    SCOPED_TRACE(s);
    auto a = parse_kv_policy(s);
    ASSERT_TRUE(a.ok()) << a.status().message();
    const std::string c1 = (*a)->spec();
    auto b = parse_kv_policy(c1);
    ASSERT_TRUE(b.ok()) << b.status().message();
    EXPECT_EQ((*b)->spec(), c1);
    EXPECT_TRUE(config_of(**a) == config_of(**b));
    EXPECT_EQ(recorded_spec_today(c1), c1);  // today's form is its own
  }
  // Values survive exactly.
  auto exact = parse_kv_policy("d2o:ratio=0.3333333333333333,beta=0.123456789");
  ASSERT_TRUE(exact.ok());
  const PolicyConfig& c = config_of(**exact);
  EXPECT_EQ(c.ratio, 0.3333333333333333);
  EXPECT_EQ(c.beta, 0.123456789);
  EXPECT_EQ(canonical("cam:merge_targets=16,seed=7"),
            "cam:ratio=0.2,sinks=4,merge_targets=16,seed=7,agg=sum");
  EXPECT_EQ(canonical("keydiff:recent=32,budget=256,sinks=4"),
            "keydiff:budget=256,sinks=4,recent=32");
  // Expected attention's keys print where it is used: window= (its queries), future=,
  // value_weight=; the pooling keys only with a prompt phase.
  EXPECT_EQ(canonical("h2o:scorer=expected_attention"),
            "h2o:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum,scorer=expected_attention,window=32,"
            "future=512,value_weight=norm");
  EXPECT_EQ(canonical("h2o:ratio=0.2"), "h2o:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum,"
                                        "scorer=accumulated_attention");
  const auto ex_policy = parse_kv_policy("d2o:prompt_ranking=expected").value();
  const PolicyConfig& ex = config_of(*ex_policy);
  EXPECT_EQ(ex.future, 512);
  EXPECT_EQ(ex.value_weight, ValueWeight::kNorm);
  EXPECT_EQ(ex.kernel, 21);
  EXPECT_EQ(ex.window, 32);
}

// hold_budget=on keeps SnapKV's and PyramidKV's prompt budget through the decode steps in ratio
// mode; it prints only there and only when on, so the specs recorded without it read as before.
TEST(PolicySpec, HoldKeepsThePromptsBudgetInRatioMode) {
  EXPECT_EQ(canonical("snapkv:hold_budget=on"),
            "snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum,hold_budget=on");
  EXPECT_EQ(canonical("snapkv:hold_budget=off"), canonical("snapkv"));
  EXPECT_EQ(canonical("snapkv:budget=64,hold_budget=on"), canonical("snapkv:budget=64"));
  for (const char* spec : {"snapkv:hold_budget=on", "pyramidkv:hold_budget=on", "snapkv:budget=64",
                           "snapkv:budget=64,hold_budget=on"}) {
    auto p = parse_kv_policy(spec);
    ASSERT_TRUE(p.ok()) << spec;
    EXPECT_TRUE(config_of(**p).compacts_after_first()) << spec;
  }
  for (const char* spec : {"snapkv", "pyramidkv:ratio=0.3", "snapkv:hold_budget=off"}) {
    auto p = parse_kv_policy(spec);
    ASSERT_TRUE(p.ok()) << spec;
    EXPECT_FALSE(config_of(**p).compacts_after_first()) << spec;
  }
}

TEST(PolicySpec, ReadingsSetTheirDefaultsAndKeysOverride) {
  const std::string research =
      "d2o:ratio=0.2,sinks=4,heavy_recent=1:1,beta=0.7,layers=research,merge=research,sim=key,"
      "ema=research,agg=sum,scorer=accumulated_attention,merged_score=sum,merge_keys=rotated,"
      "merge_decision=per_token,keep_edge_layers=off,proportional_attention=off,"
      "prompt_ranking=accumulated,prompt_merge=on,cold=none";
  EXPECT_EQ(canonical("d2o:reading=research"), research);
  // Explicit keys win whatever their position.
  EXPECT_EQ(
      canonical("d2o:heavy_recent=3:1,reading=research"),
      std::string(research).replace(research.find("heavy_recent=1:1"), 16, "heavy_recent=3:1"));
  EXPECT_EQ(canonical("d2o:reading=research,merge_decision=per_head"),
            std::string(research).replace(research.find("merge_decision=per_token"), 24,
                                          "merge_decision=per_head"));
  EXPECT_EQ(
      canonical("d2o:proportional_attention=on,reading=paper"),
      std::string(kPaperD2o).replace(std::string(kPaperD2o).find("proportional_attention=off"), 26,
                                     "proportional_attention=on"));
  // Over the paper's reading, the window keys of the defaults come back with
  // prompt_ranking=window.
  EXPECT_EQ(
      canonical("d2o:reading=paper,prompt_ranking=window"),
      "d2o:ratio=0.2,sinks=4,heavy_recent=3:1,beta=0.7,layers=variance,merge=weighted,"
      "sim=key,ema=paper,agg=sum,scorer=accumulated_attention,merged_score=sum,merge_keys=rotated,"
      "merge_decision=per_head,keep_edge_layers=off,proportional_attention=off,"
      "prompt_ranking=window,window=32,kernel=7,pool=avg,prompt_merge=on,"
      "prompt_scores=accumulated,cold=none");
}

// Every renamed key: its old and today's name, values in both spellings ({old, today}), and the
// specs it is tried in, one per preset that takes it (with the keys it needs there).
struct Renamed {
  const char* old_key;
  const char* key;
  std::vector<std::pair<const char*, const char*>> values;
  std::vector<const char*> bases;
};

const std::vector<Renamed>& renamed_keys() {
  static const std::vector<Renamed> keys = {
      {"nm", "heavy_recent", {{"3:1", "3:1"}, {"1:2", "1:2"}}, {"h2o:", "roco:", "d2o:"}},
      {"mscore", "merged_score", {{"keep", "keep"}, {"max", "max"}}, {"d2o:"}},
      {"mrope", "merge_keys", {{"post", "rotated"}, {"pre", "unrotated"}}, {"d2o:"}},
      {"decide", "merge_decision", {{"head", "per_head"}, {"token", "per_token"}}, {"d2o:"}},
      {"protect", "keep_edge_layers", {{"none", "off"}, {"edges", "on"}}, {"d2o:"}},
      {"mass", "proportional_attention", {{"off", "off"}, {"on", "on"}}, {"d2o:"}},
      {"pbeta", "pyramid_beta", {{"8.5", "8.5"}}, {"pyramidkv:"}},
      {"pos", "positions", {{"original", "original"}, {"shift", "shifted"}}, {"streaming:"}},
      {"mb", "merge_targets", {{"recent", "recent"}, {"16", "16"}}, {"cam:"}},
      {"distinct",
       "distinct_share",
       {{"0.5", "0.5"}, {"1", "1"}},
       {"h2o:", "d2o:prompt_ranking=accumulated,"}},
      {"pmerge", "prompt_merge", {{"on", "on"}, {"off", "off"}}, {"d2o:"}},
      {"prompt",
       "prompt_ranking",
       {{"acc", "accumulated"}, {"window", "window"}},
       {"h2o:", "roco:", "d2o:"}},
      {"pscore",
       "prompt_scores",
       {{"acc", "accumulated"}, {"window", "window"}},
       {"h2o:prompt_ranking=window,", "roco:prompt_ranking=window,", "d2o:"}},
      {"hold", "hold_budget", {{"off", "off"}, {"on", "on"}}, {"snapkv:", "pyramidkv:"}},
      {"norm",
       "scorer",
       {{"none", "accumulated_attention"}, {"queries", "mean_attention"}},
       {"h2o:", "d2o:"}},
  };
  return keys;
}

// A canonical spec in the old spellings (as reports and session files recorded it).
std::string old_spelling(const std::string& spec) {
  const size_t colon = spec.find(':');
  std::string out = spec.substr(0, colon + 1);
  size_t at = colon + 1;
  while (colon != std::string::npos && at <= spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    std::string item = spec.substr(at, comma - at);
    const size_t eq = item.find('=');
    for (const Renamed& r : renamed_keys()) {
      if (item.substr(0, eq) != r.key) continue;
      std::string value = item.substr(eq + 1);
      for (const auto& [old_value, today] : r.values) {
        if (value == today) value = old_value;
      }
      item = std::string(r.old_key) + "=" + value;
    }
    out += (at == colon + 1 ? "" : ",") + item;
    at = comma + 1;
  }
  return out;
}

// A preset is the list of its parts: the keys it takes are its parts' keys, each registered by
// the part that owns it, each once, whatever order its canonical form prints them in; every part
// says what it is.
TEST(PolicySpec, EveryPresetTakesTheKeysOfItsParts) {
  ASSERT_FALSE(spec_detail::presets().empty());
  for (const spec_detail::PresetDef& p : spec_detail::presets()) {
    const std::vector<const char*> from_parts = p.part_keys();
    std::multiset<std::string> parts(from_parts.begin(), from_parts.end());
    std::multiset<std::string> taken(p.keys.begin(), p.keys.end());
    EXPECT_EQ(parts, taken) << p.name;
    EXPECT_EQ(std::set<std::string>(taken.begin(), taken.end()).size(), taken.size()) << p.name;
    for (const std::string& k : taken) {
      EXPECT_NE(spec_detail::find_key(k), nullptr) << p.name << ": " << k;
      EXPECT_TRUE(p.accepts(k)) << p.name << ": " << k;
    }
    EXPECT_FALSE(p.accepts("no_such_key")) << p.name;
    for (const spec_detail::PresetPart& part : p.parts) EXPECT_FALSE(part.what.empty()) << p.name;
    // Its parts' values are its defaults, and its canonical form parses back to them.
    PolicyConfig c;
    c.name = p.name;
    p.defaults(c);
    auto parsed = parse_kv_policy(p.name);
    ASSERT_TRUE(parsed.ok()) << p.name;
    const auto* composed = dynamic_cast<const ComposedPolicy*>(parsed->get());
    ASSERT_NE(composed, nullptr) << p.name;
    EXPECT_TRUE(composed->config() == c) << p.name;
    auto again = parse_kv_policy((*parsed)->spec());
    ASSERT_TRUE(again.ok()) << (*parsed)->spec();
    EXPECT_EQ((*again)->spec(), (*parsed)->spec());
  }
  EXPECT_NE(spec_detail::find_preset("d2o"), nullptr);
  EXPECT_EQ(spec_detail::find_preset("full"), nullptr);  // no parts: not a composed policy
}

// The old names are the registry's, every old value word among them.
TEST(PolicySpec, TheRenamedKeysAreTheRegistrysOldSpellings) {
  std::set<std::pair<std::string, std::string>> registry, tested;
  for (const spec_detail::KeyDef& d : spec_detail::key_defs()) {
    if (!d.old_name) continue;
    registry.emplace(d.old_name, d.name);
    for (size_t i = 0; d.old_words && i < d.old_words->size(); ++i) {
      const char* old = (*d.old_words)[i];
      if (old) registry.emplace(std::string(d.old_name) + "=" + old, (*d.words)[i]);
    }
  }
  for (const Renamed& r : renamed_keys()) {
    tested.emplace(r.old_key, r.key);
    for (const auto& [old_value, today] : r.values) {
      if (std::string(old_value) != today)
        tested.emplace(std::string(r.old_key) + "=" + old_value, today);
    }
  }
  EXPECT_EQ(tested, registry);
}

// Reports, session files and scripts hold the old spellings: each parses, for every preset that
// takes the key, to the config its today's spelling gives (old value words under either name).
TEST(PolicySpec, OldSpellingsParseToTheSameConfig) {
  const std::vector<std::string> presets = {"streaming", "h2o", "snapkv", "pyramidkv",
                                            "roco",      "cam", "d2o",    "keydiff"};
  for (const Renamed& r : renamed_keys()) {
    for (const auto& [old_value, today] : r.values) {
      for (const std::string base : r.bases) {
        const std::string now = base + r.key + "=" + today;
        SCOPED_TRACE(now);
        auto want = parse_kv_policy(now);
        ASSERT_TRUE(want.ok()) << want.status().message();
        for (const std::string& spec :
             {base + r.old_key + "=" + old_value, base + r.old_key + "=" + today,
              base + r.key + "=" + old_value}) {
          auto got = parse_kv_policy(spec);
          ASSERT_TRUE(got.ok()) << spec << ": " << got.status().message();
          EXPECT_TRUE(config_of(**got) == config_of(**want)) << spec;
          EXPECT_EQ((*got)->spec(), (*want)->spec()) << spec;
        }
      }
    }
    // The presets that take the key are those tried above.
    for (const std::string& p : presets) {
      bool tried = false;
      for (const std::string base : r.bases) tried = tried || base.rfind(p + ":", 0) == 0;
      for (const char* key : {r.key, r.old_key}) {
        auto s = parse_kv_policy(p + ":" + key + "=" + r.values[0].second);
        const bool unknown =
            !s.ok() && s.status().message().find("unknown key") != std::string::npos;
        EXPECT_EQ(unknown, !tried) << p << ":" << key;
      }
    }
  }
  // Whole canonical specs in the old spellings.
  EXPECT_EQ(old_spelling(kDefaultD2o),
            "d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=off,sim=key,ema=paper,"
            "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,"
            "prompt=window,window=32,kernel=21,pool=avg,pmerge=off,pscore=window,cold=disk,"
            "cold_type=q8_0,cold_size=0,recall=512,recall_ranking=sum,recall_all_up_to=2048");
  for (const std::string& spec :
       {std::string(kDefaultD2o), std::string(kPaperD2o), canonical("d2o:reading=research"),
        canonical("streaming:positions=shifted"), canonical("cam:merge_targets=8"),
        canonical("pyramidkv:pyramid_beta=4,hold_budget=on"),
        canonical("h2o:prompt_ranking=window,prompt_scores=window"),
        canonical("d2o:budget=64,merge_keys=unrotated,keep_edge_layers=on,"
                  "prompt_ranking=accumulated,distinct_share=0.5")}) {
    SCOPED_TRACE(spec);
    const std::string old = old_spelling(spec);
    ASSERT_NE(old, spec);
    EXPECT_EQ(canonical(old), spec);
    EXPECT_EQ(recorded_spec_today(old), spec);  // a session file's spec as it was written
    EXPECT_TRUE(config_of(*parse_kv_policy(old).value()) ==
                config_of(*parse_kv_policy(spec).value()));
  }
}

// A key given by both of its names is given twice.
TEST(PolicySpec, AKeyByItsOldAndItsNewNameIsRefused) {
  for (const Renamed& r : renamed_keys()) {
    const std::string base = r.bases[0];
    const auto [old_value, today] = r.values[0];
    for (const std::string& spec :
         {base + r.old_key + "=" + old_value + "," + r.key + "=" + today,
          base + r.key + "=" + today + "," + r.old_key + "=" + old_value}) {
      SCOPED_TRACE(spec);
      auto p = parse_kv_policy(spec);
      ASSERT_FALSE(p.ok());
      EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
      const std::string& m = p.status().message();
      EXPECT_NE(m.find("are one key (" + std::string(r.key) + ", formerly " + r.old_key + ")"),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("give it once"), std::string::npos) << m;
    }
  }
  auto twice = parse_kv_policy("h2o:nm=1:1,nm=3:1");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("key 'nm' is given twice"), std::string::npos)
      << twice.status().message();
}

// Specs recorded while d2o's defaults were the paper's: read as the same policy, in today's form.
TEST(PolicySpec, PaperEraSpecsReadAsThePapersPolicy) {
  for (const char* keys : {"", ",proportional_attention=on,heavy_recent=1:3",
                           ",prompt_ranking=window,kernel=21,prompt_merge=off"}) {
    const std::string today = canonical(std::string("d2o:reading=paper") + keys);
    std::string then = today;
    for (const char* drop :
         {",prompt_ranking=accumulated", ",prompt_merge=on", ",prompt_scores=accumulated",
          ",cold=none"}) {
      const size_t at = then.find(drop);
      if (at != std::string::npos) then.erase(at, std::strlen(drop));
    }
    SCOPED_TRACE(then);
    ASSERT_NE(then, today);
    EXPECT_EQ(paper_era_d2o_spec(then), today);
    EXPECT_EQ(recorded_spec_today(then), today);
    // They were recorded under the old key names.
    EXPECT_EQ(paper_era_d2o_spec(old_spelling(then)), today);
    EXPECT_EQ(recorded_spec_today(old_spelling(then)), today);
  }
  // The paper's D2O as its reports recorded it.
  EXPECT_EQ(paper_era_d2o_spec("d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=variance,merge="
                               "weighted,sim=key,ema=paper,agg=sum,norm=none,mscore=sum,mrope=post,"
                               "decide=head,protect=none,mass=off"),
            kPaperD2o);
  // Not such a spec: today's canonical form (in either spelling), one canonical in neither era,
  // another preset.
  EXPECT_EQ(paper_era_d2o_spec(canonical("d2o")), "");
  EXPECT_EQ(paper_era_d2o_spec(old_spelling(canonical("d2o"))), "");
  EXPECT_EQ(paper_era_d2o_spec(kPaperD2o), "");
  EXPECT_EQ(paper_era_d2o_spec(old_spelling(kPaperD2o)), "");
  EXPECT_EQ(paper_era_d2o_spec("d2o:budget=32,nm=3:1"), "");
  EXPECT_EQ(paper_era_d2o_spec(canonical("h2o")), "");
  EXPECT_EQ(paper_era_d2o_spec("d2o"), "");
  // Never canonical: spaces, a key given twice, an unknown preset.
  EXPECT_EQ(recorded_spec_today(" " + canonical("d2o")), "");
  EXPECT_EQ(recorded_spec_today("d2o:budget=32,nm=3:1"), "");
  EXPECT_EQ(recorded_spec_today(canonical("h2o") + ",nm=1:1"), "");
  EXPECT_EQ(recorded_spec_today("lru:ratio=0.2"), "");
}

// Specs recorded in docs/results/**/*.json (the "spec" of each policy), one of each form found
// there: every preset, the old key names, and d2o in each era of its defaults (the paper's,
// read today as d2o:reading=paper,...; then E and F, canonical as they are).
struct Recorded {
  const char* spec;
  bool paper_era;
};

const std::vector<Recorded>& recorded_specs() {
  static const std::vector<Recorded> specs = {
      {"full", false},
      {"streaming:ratio=0.2,sinks=4,pos=original", false},
      {"h2o:ratio=0.2,sinks=0,nm=1:1,agg=sum,norm=none", false},
      {"h2o:ratio=0.2,sinks=0,nm=3:1,agg=sum,norm=none,distinct=0.5", false},
      {"h2o:budget=1024,sinks=0,nm=1:1,agg=sum,norm=none,heads=ada,floor=0.2", false},
      {"h2o:ratio=0.2,sinks=0,nm=1:1,agg=sum,norm=none,prompt=window,window=32,kernel=21,pool=avg,"
       "pscore=window",
       false},
      {"snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum", false},
      {"snapkv:ratio=0.1,window=32,kernel=21,pool=avg,agg=sum,hold=on", false},
      {"snapkv:budget=1024,window=32,kernel=7,pool=avg,agg=sum,heads=ada,floor=0.2", false},
      {"pyramidkv:ratio=0.2,window=32,kernel=7,pool=avg,pbeta=20,agg=sum", false},
      {"roco:budget=1024,sinks=0,nm=1:1,agg=sum", false},
      {"cam:ratio=0.2,sinks=4,mb=recent,seed=0,agg=sum", false},
      {"keydiff:ratio=0.2,sinks=4,recent=200", false},
      // d2o under the paper's defaults.
      {"d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
       "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off",
       true},
      {"d2o:budget=1024,sinks=4,nm=1:3,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
       "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=on",
       true},
      {"d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
       "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off,heads=ada,"
       "floor=0.2",
       true},
      {"d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=uniform,merge=off,sim=key,ema=paper,agg=sum,"
       "norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off,distinct=1",
       true},
      {"d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=research,merge=research,sim=key,ema=research,"
       "agg=sum,norm=none,mscore=sum,mrope=post,decide=token,protect=none,mass=off",
       true},
      {"d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=sized,sim=key,ema=paper,"
       "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,prompt=window,"
       "window=32,kernel=21,pool=avg",
       true},
      {"d2o:budget=1024,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=sized,sim=key,ema=paper,"
       "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,prompt=window,"
       "window=32,kernel=21,pool=avg,pmerge=off",
       true},
      // E, then F, the defaults; the paper's D2O recorded beside them.
      {"d2o:ratio=0.1,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=sized,sim=key,ema=paper,"
       "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,prompt=window,"
       "window=32,kernel=21,pool=avg,pmerge=off,pscore=window",
       false},
      {"d2o:budget=1024,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=off,sim=key,ema=paper,"
       "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,prompt=window,"
       "window=32,kernel=21,pool=avg,pmerge=off,pscore=window",
       false},
      {"d2o:ratio=0.1,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
       "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off,prompt=acc,"
       "pmerge=on",
       false},
      {"d2o:budget=1456,sinks=4,nm=1:3,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
       "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=on,prompt=acc,"
       "pmerge=on",
       false},
      // A cold tier, before it was d2o's default.
      {"d2o:ratio=0.2,sinks=4,heavy_recent=1:1,beta=0.7,layers=uniform,merge=off,sim=key,"
       "ema=paper,agg=sum,scorer=mean_attention,merged_score=sum,merge_keys=rotated,"
       "merge_decision=per_head,keep_edge_layers=off,proportional_attention=on,"
       "prompt_ranking=window,window=32,kernel=21,pool=avg,prompt_merge=off,prompt_scores=window,"
       "cold=memory,cold_type=q4_0r,cold_size=0,recall=64",
       false},
      // d2o's default with its tier on disk, before recall_ranking= was shown (it ranked by max).
      {"d2o:ratio=0.2,sinks=4,heavy_recent=1:1,beta=0.7,layers=uniform,merge=off,sim=key,"
       "ema=paper,agg=sum,scorer=mean_attention,merged_score=sum,merge_keys=rotated,"
       "merge_decision=per_head,keep_edge_layers=off,proportional_attention=on,"
       "prompt_ranking=window,window=32,kernel=21,pool=avg,prompt_merge=off,prompt_scores=window,"
       "cold=disk,cold_type=q4_0r,cold_size=0,recall=64",
       false},
      {"snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum,cold=memory,cold_type=q4_0r,"
       "cold_size=0,recall=128",
       false},
      // d2o's default before recall_all_up_to= was shown (no turn recalled a whole tier).
      {"d2o:ratio=0.2,sinks=4,heavy_recent=1:1,beta=0.7,layers=uniform,merge=off,sim=key,"
       "ema=paper,agg=sum,scorer=mean_attention,merged_score=sum,merge_keys=rotated,"
       "merge_decision=per_head,keep_edge_layers=off,proportional_attention=on,"
       "prompt_ranking=window,window=32,kernel=21,pool=avg,prompt_merge=off,prompt_scores=window,"
       "cold=disk,cold_type=q4_0r,cold_size=0,recall=512,recall_ranking=sum",
       false},
      {"snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum,cold=memory,cold_type=q4_0r,"
       "cold_size=0,recall=128,recall_ranking=whole",
       false},
  };
  return specs;
}

TEST(PolicySpec, RecordedSpecsParseAndReadAsTheirPolicyToday) {
  for (const Recorded& r : recorded_specs()) {
    const std::string spec = r.spec;
    SCOPED_TRACE(spec);
    // Canonical when recorded: read as the policy it ran, in today's canonical form.
    const std::string today = recorded_spec_today(spec);
    ASSERT_FALSE(today.empty());
    EXPECT_EQ(canonical(today), today);
    EXPECT_EQ(paper_era_d2o_spec(spec), r.paper_era ? today : "");
    // The policy it ran: its own keys, over the paper's defaults where they were d2o's, and
    // without a cold tier where d2o's defaults had none (a d2o spec without cold=).
    const bool pre_tier = spec.rfind("d2o:", 0) == 0 && spec.find("cold=") == std::string::npos;
    // and ranked by max where a tier was recorded without recall_ranking=, never recalling a
    // whole tier where it was recorded without recall_all_up_to=.
    const bool tier = spec.find("cold=memory") != std::string::npos ||
                      spec.find("cold=disk") != std::string::npos;
    const bool pre_ranking = tier && spec.find("recall_ranking=") == std::string::npos;
    const bool pre_recall_all = tier && spec.find("recall_all_up_to=") == std::string::npos;
    const std::string ran = r.paper_era      ? "d2o:reading=paper," + spec.substr(4)
                            : pre_tier       ? spec + ",cold=none"
                            : pre_ranking    ? spec + ",recall_ranking=max,recall_all_up_to=0"
                            : pre_recall_all ? spec + ",recall_all_up_to=0"
                                             : spec;
    auto p = parse_kv_policy(ran);
    ASSERT_TRUE(p.ok()) << p.status().message();
    EXPECT_EQ((*p)->spec(), today);
    auto back = parse_kv_policy(today);
    ASSERT_TRUE(back.ok()) << back.status().message();
    if (!(*p)->is_full()) {
      EXPECT_TRUE(config_of(**p) == config_of(**back));
    }
  }
  // Over today's defaults (prompt_ranking=window), a paper-era spec with heads=ada or distinct=
  // is refused: it is read only as the paper's D2O.
  int refused = 0;
  for (const Recorded& r : recorded_specs()) {
    const std::string spec = r.spec;
    if (!r.paper_era || (spec.find("heads=ada") == std::string::npos &&
                         spec.find("distinct=") == std::string::npos))
      continue;
    EXPECT_FALSE(parse_kv_policy(spec).ok()) << spec;
    ++refused;
  }
  EXPECT_EQ(refused, 2);
}

TEST(PolicySpec, NeedsMatchThePolicy) {
  auto needs = [](const std::string& s) { return parse_kv_policy(s).value()->needs(); };
  EXPECT_TRUE(needs("d2o").accumulate);
  EXPECT_EQ(needs("d2o").window, 32);
  EXPECT_EQ(needs("d2o:reading=paper").window, 0);
  EXPECT_EQ(needs("d2o:prompt_ranking=accumulated").window, 0);
  EXPECT_EQ(needs("d2o:agg=max").agg, ScoreAgg::kMax);
  // Proportional attention only where slots can stand for merged tokens.
  EXPECT_FALSE(needs("d2o").mass);
  EXPECT_TRUE(needs("d2o:merge=sized").mass);
  EXPECT_FALSE(needs("d2o:reading=paper").mass);
  EXPECT_TRUE(needs("h2o").accumulate);
  EXPECT_TRUE(needs("roco").accumulate);
  EXPECT_TRUE(needs("cam").accumulate);
  EXPECT_FALSE(needs("streaming").accumulate);
  EXPECT_EQ(needs("streaming").window, 0);
  EXPECT_FALSE(needs("snapkv").accumulate);
  EXPECT_EQ(needs("snapkv").window, 32);
  EXPECT_EQ(needs("pyramidkv:window=8").window, 8);
  // KeyDiff reads only the keys: no statistics, so the engine skips them.
  EXPECT_FALSE(needs("keydiff").accumulate);
  EXPECT_EQ(needs("keydiff").window, 0);
  EXPECT_FALSE(needs("keydiff:budget=64,sinks=4,recent=8").accumulate);
  EXPECT_FALSE(parse_kv_policy("d2o").value()->is_full());
  // Expected attention: the last `window` queries, recorded; no accumulated attention where
  // nothing else reads it.
  EXPECT_EQ(needs("h2o:scorer=expected_attention").queries, 32);
  EXPECT_FALSE(needs("h2o:scorer=expected_attention").accumulate);
  EXPECT_EQ(needs("h2o:scorer=expected_attention").window, 0);
  EXPECT_EQ(needs("h2o:scorer=expected_attention,window=8").queries, 8);
  EXPECT_EQ(needs("d2o:prompt_ranking=expected").queries, 32);
  EXPECT_EQ(needs("d2o:prompt_ranking=expected").window, 0);
  EXPECT_TRUE(needs("d2o:prompt_ranking=expected").accumulate);
  EXPECT_EQ(needs("d2o").queries, 0);
  EXPECT_EQ(needs("snapkv").queries, 0);
  // A pass asks for the window only while a compaction may still read it: prompt_ranking=window
  // until the sequence's first compaction, SnapKV always (a fixed capacity compacts again).
  PolicyState fresh, compacted;
  compacted.n_compactions = 1;
  for (const char* spec :
       {"h2o:prompt_ranking=window,window=16",
        "d2o:prompt_ranking=window,window=16,prompt_merge=off", "snapkv:window=16"}) {
    SCOPED_TRACE(spec);
    auto p = parse_kv_policy(spec).value();
    EXPECT_EQ(p->pass_needs(fresh).window, 16);
    EXPECT_EQ(p->pass_needs(compacted).window, spec[0] == 's' ? 16 : 0);
    // A turn that recalls from a cold tier is ranked by its window again.
    EXPECT_EQ(p->pass_needs(compacted, /*recalls=*/true).window, 16);
    EXPECT_EQ(p->pass_needs(compacted).accumulate, p->needs().accumulate);
  }
  // The recorded queries: prompt_ranking=expected until the prompt's compaction, a scorer that
  // reads them always.
  auto d2o_ex = parse_kv_policy("d2o:prompt_ranking=expected,window=16").value();
  EXPECT_EQ(d2o_ex->pass_needs(fresh).queries, 16);
  EXPECT_EQ(d2o_ex->pass_needs(compacted).queries, 0);
  auto h2o_ex = parse_kv_policy("h2o:scorer=expected_attention,window=16").value();
  EXPECT_EQ(h2o_ex->pass_needs(fresh).queries, 16);
  EXPECT_EQ(h2o_ex->pass_needs(compacted).queries, 16);
}

struct ErrorCase {
  std::string spec;
  std::vector<std::string> message_has;
};

TEST(PolicySpec, ErrorsNameTheProblemAndWhatIsAllowed) {
  const std::vector<ErrorCase> cases = {
      {"lru",
       {"unknown KV policy 'lru'",
        "full, streaming, h2o, snapkv, pyramidkv, roco, cam, d2o, keydiff"}},
      {"D2O", {"unknown KV policy 'D2O'"}},
      {"d2o:foo=1",
       {"unknown key 'foo'",
        "ratio, budget, prefill, sinks, heavy_recent, beta, layers, merge, sim, ema, agg, scorer, "
        "merged_score, merge_keys, merge_decision, keep_edge_layers, proportional_attention, "
        "heads, floor, distinct_share, prompt_ranking, window, kernel, pool, prompt_merge, "
        "prompt_scores, future, value_weight, cold, cold_type, cold_size, recall, recall_ranking, "
        "recall_all_up_to, recall_reach, reading"}},
      {"d2o:merged_score=median", {"merged_score=median", "sum, keep, mean, max"}},
      {"d2o:merge_keys=both", {"merge_keys=both", "rotated, unrotated"}},
      {"d2o:mrope=both", {"mrope=both", "rotated, unrotated"}},
      {"d2o:merge_decision=layer", {"merge_decision=layer", "per_head, per_token"}},
      {"d2o:keep_edge_layers=all", {"keep_edge_layers=all", "off, on"}},
      {"d2o:proportional_attention=1", {"proportional_attention=1", "off, on"}},
      {"d2o:distinct_share=1.5", {"distinct_share=1.5", "[0, 1]"}},
      {"h2o:distinct=-0.1", {"distinct=-0.1", "[0, 1]"}},
      {"h2o:heads=ada,distinct_share=0.5", {"distinct_share= applies with heads=uniform"}},
      {"snapkv:distinct_share=0.5", {"unknown key 'distinct_share'"}},
      // An old name the preset does not take: its name today, and what the preset takes.
      {"snapkv:distinct=0.5",
       {"unknown key 'distinct' (the old name of 'distinct_share'; allowed: ratio, budget, "
        "prefill, window, kernel"}},
      {"h2o:hold_budget=on", {"unknown key 'hold_budget'"}},
      {"snapkv:hold_budget=yes", {"hold_budget=yes", "off, on"}},
      {"h2o:kernel=21", {"kernel= applies only with prompt_ranking=window"}},
      {"d2o:window=8,prompt_ranking=accumulated",
       {"window= applies only with prompt_ranking=window"}},
      {"h2o:prompt_ranking=snap", {"prompt_ranking=snap", "accumulated, window"}},
      {"d2o:prompt_ranking=window,kernel=4", {"kernel=4", "odd"}},
      {"h2o:heads=ada,prompt_ranking=window", {"prompt_ranking=window applies with heads=uniform"}},
      {"d2o:prompt_ranking=window,distinct_share=0.5", {"distinct_share= does not apply"}},
      // d2o's defaults compact the prompt by its window: the message says how to leave it.
      {"d2o:distinct_share=0.5",
       {"distinct_share= does not apply", "by default: add prompt_ranking=accumulated"}},
      {"d2o:heads=ada",
       {"prompt_ranking=window applies with heads=uniform",
        "by default: add prompt_ranking=accumulated"}},
      {"d2o:prompt=acc,heads=ada,decide=token",
       {"merge_decision=per_token", "use merge_decision=per_head"}},
      {"d2o:reading=paper,prompt_ranking=window,heads=ada",
       {"prompt_ranking=window applies with heads=uniform"}},
      {"d2o:reading=novel", {"reading=novel", "paper, research"}},
      {"h2o:prompt_merge=off", {"unknown key 'prompt_merge'"}},
      {"h2o:prompt_scores=window", {"prompt_scores= applies only with prompt_ranking=window"}},
      {"h2o:pscore=window", {"pscore= applies only with prompt_ranking=window"}},
      {"d2o:prompt_ranking=window,prompt_scores=pooled",
       {"prompt_scores=pooled", "accumulated, window"}},
      {"snapkv:prompt_scores=window", {"unknown key 'prompt_scores'"}},
      {"d2o:prompt_merge=no", {"prompt_merge=no", "off, on"}},
      {"h2o:proportional_attention=on", {"unknown key 'proportional_attention'"}},
      {"h2o:beta=0.5",
       {"unknown key 'beta'", "ratio, budget, prefill, sinks, heavy_recent, agg, scorer"}},
      {"streaming:window=8", {"unknown key 'window'", "sinks, positions"}},
      {"streaming:positions=shift2", {"positions=shift2", "original, shifted"}},
      {"d2o:ratio=0", {"ratio=0", "(0, 1]"}},
      {"d2o:ratio=1.5", {"ratio=1.5", "(0, 1]"}},
      {"d2o:ratio=-0.2", {"ratio=-0.2"}},
      {"d2o:ratio=abc", {"ratio=abc"}},
      {"d2o:ratio=nan", {"ratio=nan"}},
      {"d2o:ratio=", {"ratio="}},
      {"d2o:budget=7", {"budget=7", "smallest usable budget 8", "sinks + 4"}},
      {"d2o:budget=3,sinks=0", {"budget=3", "smallest usable budget 4"}},
      {"h2o:budget=3", {"budget=3", "smallest usable budget 4"}},
      {"streaming:budget=4", {"budget=4", "smallest usable budget 5", "sinks + 1"}},
      {"snapkv:budget=31", {"budget=31", "smallest usable budget 32", "window=32"}},
      {"pyramidkv:budget=10,window=16", {"budget=10", "16"}},
      {"d2o:budget=0", {"budget=0", "integer from 1"}},
      {"d2o:budget=12.5", {"budget=12.5"}},
      {"d2o:ratio=0.2,budget=64", {"either ratio= or budget=, not both"}},
      {"d2o:budget=64,ratio=0.2", {"either ratio= or budget=, not both"}},
      {"d2o:heavy_recent=3:0", {"heavy_recent=3:0", "two positive integers"}},
      {"d2o:heavy_recent=0:1", {"heavy_recent=0:1", "two positive integers"}},
      {"d2o:heavy_recent=3", {"heavy_recent=3", "N:M"}},
      {"d2o:nm=a:b", {"nm=a:b", "N:M"}},
      {"d2o:beta=0", {"beta=0", "(0, 1)"}},
      {"d2o:beta=1", {"beta=1", "(0, 1)"}},
      {"d2o:beta=1.2", {"beta=1.2", "(0, 1)"}},
      {"d2o:sinks=-1", {"sinks=-1", "integer from 0"}},
      {"d2o:layers=flat", {"layers=flat", "uniform, variance, reciprocal, exp, pyramid, research"}},
      {"d2o:merge=sum", {"merge=sum", "off, weighted, average, research"}},
      {"d2o:sim=query", {"sim=query", "key, value, kv"}},
      {"d2o:ema=fast", {"ema=fast", "paper, research"}},
      {"d2o:agg=median", {"agg=median", "sum, mean, max"}},
      {"d2o:norm=count",
       {"norm=count", "accumulated_attention, mean_attention, key_diversity, value_norm"}},
      {"h2o:scorer=query", {"scorer=query", "accumulated_attention, mean_attention"}},
      {"d2o:reading=mine", {"reading=mine", "paper, research"}},
      {"snapkv:kernel=4", {"kernel=4", "odd"}},
      {"snapkv:window=0", {"window=0"}},
      {"snapkv:pool=min", {"pool=min", "max, avg"}},
      {"pyramidkv:pyramid_beta=0.5", {"pyramid_beta=0.5", ">= 1"}},
      {"streaming:positions=rotated", {"positions=rotated", "original, shifted"}},
      {"cam:merge_targets=0", {"merge_targets=0", "'recent' or a positive integer"}},
      {"cam:seed=-3", {"seed=-3"}},
      {"keydiff:recent=-1", {"recent=-1", "integer from 0"}},
      {"keydiff:recent=x", {"recent=x"}},
      {"keydiff:window=8", {"unknown key 'window'", "ratio, budget, prefill, sinks, recent"}},
      {"keydiff:budget=5,sinks=2,recent=4",
       {"budget=5", "smallest usable budget 6", "sinks=2", "recent=4"}},
      {"h2o:recent=4", {"unknown key 'recent'"}},
      {"d2o:ratio=0.2,ratio=0.3", {"'ratio' is given twice"}},
      {"d2o:ratio", {"expected key=value", "'ratio'"}},
      {"d2o:ratio=0.2,", {"expected key=value"}},
      {"d2o:=0.2", {"expected key=value"}},
      {"full:ratio=0.2", {"'full' takes no keys"}},
      // Expected attention.
      {"h2o:future=64", {"future= applies only with expected attention"}},
      {"d2o:value_weight=none", {"value_weight= applies only with expected attention"}},
      {"h2o:scorer=expected_attention,future=0", {"future=0", "integer from 1 to 65536"}},
      {"h2o:scorer=expected_attention,future=70000", {"future=70000", "integer from 1 to 65536"}},
      {"h2o:scorer=expected_attention,future=x", {"future=x"}},
      {"h2o:scorer=expected_attention,value_weight=max", {"value_weight=max", "norm, none"}},
      {"h2o:scorer=expected_attention,window=0", {"window=0", "integer from 1"}},
      {"h2o:scorer=expected_attention,kernel=5",
       {"kernel= applies only with prompt_ranking=window, reconstruction or expected"}},
      {"h2o:window=8", {"window= applies only with", "or scorer=expected_attention"}},
      {"h2o:prompt_ranking=guess",
       {"prompt_ranking=guess", "accumulated, window, reconstruction, expected"}},
      {"d2o:prompt_ranking=expected,cold=memory", {"a cold tier needs", "prompt_ranking=window"}},
      {"h2o:heads=ada,prompt_ranking=expected",
       {"prompt_ranking=expected applies with heads=uniform"}},
      {"d2o:prompt_ranking=expected,distinct_share=0.5",
       {"prompt_ranking=expected", "distinct_share= does not apply"}},
      {"snapkv:future=8", {"unknown key 'future'"}},
      {"keydiff:value_weight=norm", {"unknown key 'value_weight'"}},
  };
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.spec);
    auto p = parse_kv_policy(c.spec);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    for (const std::string& m : c.message_has) {
      EXPECT_NE(p.status().message().find(m), std::string::npos)
          << "message: " << p.status().message();
    }
  }
}

}  // namespace
}  // namespace d2o
