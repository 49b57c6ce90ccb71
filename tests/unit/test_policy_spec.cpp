// Policy spec strings: canonical round trips, defaults and readings, what each policy asks of the
// attention kernel, and every error with its message.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kv/policy.h"
#include "kv/policy/composed.h"

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
    "d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
    "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off,prompt=acc,"
    "pmerge=on";

TEST(PolicySpec, DefaultsAreTheBestMeasuredAndThePapers) {
  // d2o's defaults: F of docs/results.md (E without merging), printed as its reports recorded it.
  EXPECT_EQ(canonical("d2o"),
            "d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=off,sim=key,ema=paper,"
            "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,"
            "prompt=window,window=32,kernel=21,pool=avg,pmerge=off,pscore=window");
  EXPECT_EQ(canonical("d2o:mass=on,merge=off,layers=uniform,nm=1:1,norm=queries,prompt=window,"
                      "kernel=21,pmerge=off,pscore=window"),
            canonical("d2o"));
  // E, the default before it, as its reports recorded it: d2o with merges.
  EXPECT_EQ(canonical("d2o:merge=sized"),
            "d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=sized,sim=key,ema=paper,"
            "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,"
            "prompt=window,window=32,kernel=21,pool=avg,pmerge=off,pscore=window");
  EXPECT_EQ(canonical("d2o:mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries,prompt=window,"
                      "kernel=21,pmerge=off,pscore=window"),
            canonical("d2o:merge=sized"));
  EXPECT_EQ(canonical("d2o:reading=paper"), kPaperD2o);
  // The paper's keys, given one by one over d2o's defaults, are the paper's reading.
  EXPECT_EQ(canonical("d2o:nm=3:1,layers=variance,merge=weighted,mass=off,norm=none,prompt=acc,"
                      "pmerge=on"),
            kPaperD2o);
  // Keys that differ from the defaults are printed, those that do not apply are not: the paper's
  // prompt compaction with E's other keys keeps pmerge=off and drops the window keys.
  EXPECT_EQ(canonical("d2o:prompt=acc"),
            "d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=off,sim=key,ema=paper,"
            "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,"
            "prompt=acc,pmerge=off");
  EXPECT_EQ(canonical("d2o:pscore=acc"),
            canonical("d2o").substr(0, canonical("d2o").size() - 6) + "acc");
  EXPECT_TRUE(config_of(*parse_kv_policy("d2o:prompt=acc").value()) ==
              config_of(*parse_kv_policy(canonical("d2o:prompt=acc")).value()));
  EXPECT_EQ(canonical("h2o"), "h2o:ratio=0.2,sinks=0,nm=1:1,agg=sum,norm=none");
  EXPECT_EQ(canonical("streaming"), "streaming:ratio=0.2,sinks=4,pos=original");
  EXPECT_EQ(canonical("snapkv"), "snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum");
  EXPECT_EQ(canonical("pyramidkv"),
            "pyramidkv:ratio=0.2,window=32,kernel=7,pool=avg,pbeta=20,agg=sum");
  EXPECT_EQ(canonical("roco"), "roco:ratio=0.2,sinks=0,nm=1:1,agg=sum");
  EXPECT_EQ(canonical("cam"), "cam:ratio=0.2,sinks=4,mb=recent,seed=0,agg=sum");
  EXPECT_EQ(canonical("keydiff"), "keydiff:ratio=0.2,sinks=0,recent=0");
  // distinct= is printed only when set, so the specs above stay those of the paper.
  EXPECT_EQ(canonical("h2o:distinct=0.5"),
            "h2o:ratio=0.2,sinks=0,nm=1:1,agg=sum,norm=none,distinct=0.5");
  EXPECT_EQ(canonical("h2o:distinct=0"), canonical("h2o"));
  // So are prompt= (with the window keys it brings) and pmerge=.
  EXPECT_EQ(canonical("h2o:prompt=window"),
            "h2o:ratio=0.2,sinks=0,nm=1:1,agg=sum,norm=none,prompt=window,window=32,kernel=7,"
            "pool=avg");
  EXPECT_EQ(canonical("d2o:reading=paper,pmerge=off"),
            std::string(kPaperD2o).substr(0, std::string(kPaperD2o).size() - 2) + "off");
  EXPECT_EQ(canonical("d2o:reading=paper,pmerge=on"), kPaperD2o);
  EXPECT_EQ(canonical("roco:prompt=window,pscore=window"),
            canonical("roco:prompt=window") + ",pscore=window");
  EXPECT_EQ(canonical("h2o:prompt=window,pscore=acc"), canonical("h2o:prompt=window"));
  const StatsNeeds pw = parse_kv_policy("h2o:prompt=window,window=16").value()->needs();
  EXPECT_EQ(pw.window, 16);
  EXPECT_TRUE(pw.accumulate);
  EXPECT_EQ(parse_kv_policy("h2o").value()->needs().window, 0);
  EXPECT_EQ(canonical("full"), "full");
  EXPECT_EQ(canonical(""), "full");
  EXPECT_TRUE(parse_kv_policy("full").value()->is_full());
}

TEST(PolicySpec, CanonicalFormRoundTrips) {
  const std::vector<std::string> specs = {
      "d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7",
      "d2o:budget=512,beta=0.55,layers=reciprocal,merge=average,sim=kv,ema=research,agg=max,norm="
      "queries",
      "d2o:reading=research",
      "d2o:reading=research,nm=2:1,merge=weighted",
      "d2o:ratio=0.125,layers=exp",
      "d2o:ratio=0.3333333333333333,layers=pyramid,merge=off",
      "d2o:budget=64,mscore=max,mrope=pre,decide=token,protect=edges,mass=on,merge=sized",
      " h2o : budget = 64 , sinks = 4 ",
      "streaming:budget=100,sinks=0,pos=shift",
      "snapkv:budget=300,window=16,kernel=5,pool=max,agg=mean",
      "pyramidkv:ratio=0.1,pbeta=8.5",
      "roco:ratio=1",
      "cam:budget=64,mb=16,seed=18446744073709551615",
      "keydiff:ratio=0.25",
      "keydiff:budget=64,sinks=4,recent=16",
      "keydiff: recent = 8 , budget = 8",
      "h2o:ratio=0.2,distinct=0.5",
      "d2o:ratio=0.2,nm=1:1,distinct=0.25,merge=off,prompt=acc",
      "d2o:reading=paper,ratio=0.2,nm=1:1,distinct=0.25,merge=off",
      "d2o:ratio=0.2,prompt=window,kernel=21,pool=max,window=16,pmerge=off",
      "d2o:reading=paper,ratio=0.2,prompt=window,kernel=21,pool=max,window=16,pmerge=off",
      "d2o",
      "d2o:reading=paper",
      "d2o:prompt=acc",
      "d2o:pscore=acc,pmerge=on,kernel=7",
      "d2o:reading=paper,heads=ada,floor=0.5",
      "d2o:prompt=acc,heads=ada",
      "roco:budget=64,prompt=window",
      "h2o:ratio=0.2,prompt=window,pscore=window,kernel=21",
      "d2o:ratio=0.2,prompt=window,pscore=window,pmerge=off,norm=queries",
      "snapkv:ratio=0.2,hold=on",
      "pyramidkv:ratio=0.1,hold=on,pbeta=8.5",
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
  }
  // Values survive exactly.
  auto exact = parse_kv_policy("d2o:ratio=0.3333333333333333,beta=0.123456789");
  ASSERT_TRUE(exact.ok());
  const PolicyConfig& c = config_of(**exact);
  EXPECT_EQ(c.ratio, 0.3333333333333333);
  EXPECT_EQ(c.beta, 0.123456789);
  EXPECT_EQ(canonical("cam:mb=16,seed=7"), "cam:ratio=0.2,sinks=4,mb=16,seed=7,agg=sum");
  EXPECT_EQ(canonical("keydiff:recent=32,budget=256,sinks=4"),
            "keydiff:budget=256,sinks=4,recent=32");
}

// hold=on keeps SnapKV's and PyramidKV's prompt budget through the decode steps in ratio mode; it
// prints only there and only when on, so the specs recorded without it read as before.
TEST(PolicySpec, HoldKeepsThePromptsBudgetInRatioMode) {
  EXPECT_EQ(canonical("snapkv:hold=on"),
            "snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum,hold=on");
  EXPECT_EQ(canonical("snapkv:hold=off"), canonical("snapkv"));
  EXPECT_EQ(canonical("snapkv:budget=64,hold=on"), canonical("snapkv:budget=64"));
  for (const char* spec :
       {"snapkv:hold=on", "pyramidkv:hold=on", "snapkv:budget=64", "snapkv:budget=64,hold=on"}) {
    auto p = parse_kv_policy(spec);
    ASSERT_TRUE(p.ok()) << spec;
    EXPECT_TRUE(config_of(**p).compacts_after_first()) << spec;
  }
  for (const char* spec : {"snapkv", "pyramidkv:ratio=0.3", "snapkv:hold=off"}) {
    auto p = parse_kv_policy(spec);
    ASSERT_TRUE(p.ok()) << spec;
    EXPECT_FALSE(config_of(**p).compacts_after_first()) << spec;
  }
}

TEST(PolicySpec, ReadingsSetTheirDefaultsAndKeysOverride) {
  EXPECT_EQ(canonical("d2o:reading=research"),
            "d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=research,merge=research,sim=key,ema="
            "research,agg=sum,norm=none,mscore=sum,mrope=post,decide=token,protect=none,mass=off,"
            "prompt=acc,pmerge=on");
  // Explicit keys win whatever their position.
  EXPECT_EQ(canonical("d2o:nm=3:1,reading=research"),
            "d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=research,merge=research,sim=key,ema="
            "research,agg=sum,norm=none,mscore=sum,mrope=post,decide=token,protect=none,mass=off,"
            "prompt=acc,pmerge=on");
  EXPECT_EQ(canonical("d2o:reading=research,decide=head"),
            "d2o:ratio=0.2,sinks=4,nm=1:1,beta=0.7,layers=research,merge=research,sim=key,ema="
            "research,agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off,"
            "prompt=acc,pmerge=on");
  EXPECT_EQ(canonical("d2o:mass=on,reading=paper"),
            std::string(kPaperD2o).replace(std::string(kPaperD2o).find("mass=off"), 8, "mass=on"));
  // Over the paper's reading, the window keys of the defaults come back with prompt=window.
  EXPECT_EQ(
      canonical("d2o:reading=paper,prompt=window"),
      "d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
      "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off,"
      "prompt=window,window=32,kernel=7,pool=avg,pmerge=on,pscore=acc");
}

// Specs recorded while d2o's defaults were the paper's: read as the same policy, in today's form.
TEST(PolicySpec, PaperEraSpecsReadAsThePapersPolicy) {
  for (const char* keys : {"", ",mass=on,nm=1:3", ",prompt=window,kernel=21,pmerge=off"}) {
    const std::string today = canonical(std::string("d2o:reading=paper") + keys);
    std::string then = today;
    for (const char* drop : {",prompt=acc", ",pmerge=on", ",pscore=acc"}) {
      const size_t at = then.find(drop);
      if (at != std::string::npos) then.erase(at, std::strlen(drop));
    }
    SCOPED_TRACE(then);
    ASSERT_NE(then, today);
    EXPECT_EQ(paper_era_d2o_spec(then), today);
  }
  // The paper's D2O as its reports recorded it.
  EXPECT_EQ(paper_era_d2o_spec("d2o:ratio=0.2,sinks=4,nm=3:1,beta=0.7,layers=variance,merge="
                               "weighted,sim=key,ema=paper,agg=sum,norm=none,mscore=sum,mrope=post,"
                               "decide=head,protect=none,mass=off"),
            kPaperD2o);
  // Not such a spec: today's canonical form, one canonical in neither era, another preset.
  EXPECT_EQ(paper_era_d2o_spec(canonical("d2o")), "");
  EXPECT_EQ(paper_era_d2o_spec(kPaperD2o), "");
  EXPECT_EQ(paper_era_d2o_spec("d2o:budget=32,nm=3:1"), "");
  EXPECT_EQ(paper_era_d2o_spec(canonical("h2o")), "");
  EXPECT_EQ(paper_era_d2o_spec("d2o"), "");
}

TEST(PolicySpec, NeedsMatchThePolicy) {
  auto needs = [](const std::string& s) { return parse_kv_policy(s).value()->needs(); };
  EXPECT_TRUE(needs("d2o").accumulate);
  EXPECT_EQ(needs("d2o").window, 32);
  EXPECT_EQ(needs("d2o:reading=paper").window, 0);
  EXPECT_EQ(needs("d2o:prompt=acc").window, 0);
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
  // A pass asks for the window only while a compaction may still read it: prompt=window until
  // the sequence's first compaction, SnapKV always (a fixed capacity compacts again).
  PolicyState fresh, compacted;
  compacted.n_compactions = 1;
  for (const char* spec : {"h2o:prompt=window,window=16", "d2o:prompt=window,window=16,pmerge=off",
                           "snapkv:window=16"}) {
    SCOPED_TRACE(spec);
    auto p = parse_kv_policy(spec).value();
    EXPECT_EQ(p->pass_needs(fresh).window, 16);
    EXPECT_EQ(p->pass_needs(compacted).window, spec[0] == 's' ? 16 : 0);
    EXPECT_EQ(p->pass_needs(compacted).accumulate, p->needs().accumulate);
  }
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
        "ratio, budget, sinks, nm, beta, layers, merge, sim, ema, agg, norm, mscore, mrope, "
        "decide, protect, mass, heads, floor, distinct, prompt, window, kernel, pool, pmerge, "
        "pscore, reading"}},
      {"d2o:mscore=median", {"mscore=median", "sum, keep, mean, max"}},
      {"d2o:mrope=both", {"mrope=both", "post, pre"}},
      {"d2o:decide=layer", {"decide=layer", "head, token"}},
      {"d2o:protect=all", {"protect=all", "none, edges"}},
      {"d2o:mass=1", {"mass=1", "off, on"}},
      {"d2o:distinct=1.5", {"distinct=1.5", "[0, 1]"}},
      {"h2o:distinct=-0.1", {"distinct=-0.1", "[0, 1]"}},
      {"h2o:heads=ada,distinct=0.5", {"distinct= applies with heads=uniform"}},
      {"snapkv:distinct=0.5", {"unknown key 'distinct'"}},
      {"h2o:hold=on", {"unknown key 'hold'"}},
      {"snapkv:hold=yes", {"hold=yes", "off, on"}},
      {"h2o:kernel=21", {"kernel= applies only with prompt=window"}},
      {"d2o:window=8,prompt=acc", {"window= applies only with prompt=window"}},
      {"h2o:prompt=snap", {"prompt=snap", "acc, window"}},
      {"d2o:prompt=window,kernel=4", {"kernel=4", "odd"}},
      {"h2o:heads=ada,prompt=window", {"prompt=window applies with heads=uniform"}},
      {"d2o:prompt=window,distinct=0.5", {"distinct= does not apply"}},
      // d2o's defaults compact the prompt by its window: the message says how to leave it.
      {"d2o:distinct=0.5", {"distinct= does not apply", "by default: add prompt=acc"}},
      {"d2o:heads=ada", {"prompt=window applies with heads=uniform", "by default: add prompt=acc"}},
      {"d2o:reading=paper,prompt=window,heads=ada", {"prompt=window applies with heads=uniform"}},
      {"d2o:reading=novel", {"reading=novel", "paper, research"}},
      {"h2o:pmerge=off", {"unknown key 'pmerge'"}},
      {"h2o:pscore=window", {"pscore= applies only with prompt=window"}},
      {"d2o:prompt=window,pscore=pooled", {"pscore=pooled", "acc, window"}},
      {"snapkv:pscore=window", {"unknown key 'pscore'"}},
      {"d2o:pmerge=no", {"pmerge=no", "off, on"}},
      {"h2o:mass=on", {"unknown key 'mass'"}},
      {"h2o:beta=0.5", {"unknown key 'beta'", "ratio, budget, sinks, nm, agg, norm"}},
      {"streaming:window=8", {"unknown key 'window'", "sinks, pos"}},
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
      {"d2o:nm=3:0", {"nm=3:0", "two positive integers"}},
      {"d2o:nm=0:1", {"nm=0:1", "two positive integers"}},
      {"d2o:nm=3", {"nm=3", "N:M"}},
      {"d2o:nm=a:b", {"nm=a:b"}},
      {"d2o:beta=0", {"beta=0", "(0, 1)"}},
      {"d2o:beta=1", {"beta=1", "(0, 1)"}},
      {"d2o:beta=1.2", {"beta=1.2", "(0, 1)"}},
      {"d2o:sinks=-1", {"sinks=-1", "integer from 0"}},
      {"d2o:layers=flat", {"layers=flat", "uniform, variance, reciprocal, exp, pyramid, research"}},
      {"d2o:merge=sum", {"merge=sum", "off, weighted, average, research"}},
      {"d2o:sim=query", {"sim=query", "key, value, kv"}},
      {"d2o:ema=fast", {"ema=fast", "paper, research"}},
      {"d2o:agg=median", {"agg=median", "sum, mean, max"}},
      {"d2o:norm=count", {"norm=count", "none, queries"}},
      {"d2o:reading=mine", {"reading=mine", "paper, research"}},
      {"snapkv:kernel=4", {"kernel=4", "odd"}},
      {"snapkv:window=0", {"window=0"}},
      {"snapkv:pool=min", {"pool=min", "max, avg"}},
      {"pyramidkv:pbeta=0.5", {"pbeta=0.5", ">= 1"}},
      {"streaming:pos=rotated", {"pos=rotated", "original, shift"}},
      {"cam:mb=0", {"mb=0", "'recent' or a positive integer"}},
      {"cam:seed=-3", {"seed=-3"}},
      {"keydiff:recent=-1", {"recent=-1", "integer from 0"}},
      {"keydiff:recent=x", {"recent=x"}},
      {"keydiff:window=8", {"unknown key 'window'", "ratio, budget, sinks, recent"}},
      {"keydiff:budget=5,sinks=2,recent=4",
       {"budget=5", "smallest usable budget 6", "sinks=2", "recent=4"}},
      {"h2o:recent=4", {"unknown key 'recent'"}},
      {"d2o:ratio=0.2,ratio=0.3", {"'ratio' is given twice"}},
      {"d2o:ratio", {"expected key=value", "'ratio'"}},
      {"d2o:ratio=0.2,", {"expected key=value"}},
      {"d2o:=0.2", {"expected key=value"}},
      {"full:ratio=0.2", {"'full' takes no keys"}},
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
