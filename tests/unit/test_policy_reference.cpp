// Every policy against the naive re-implementation (policy_naive.h) on synthetic caches with
// random keys, values and scores: MHA / GQA / MQA, F32 / F16, prompt-then-compress followed by
// 50 decode steps, and streaming with a fixed capacity fed in chunks. Kept slots, merged keys and
// values (1e-6 in F32), scores, budgets, thresholds and counters must agree at every pass. The
// last tests check that the comparison catches deliberately wrong variants.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/kv_rows.h"
#include "unit/policy_sim.h"

namespace d2o {
namespace {

using test::PolicySim;
using test::SimSetup;

// Runs a prompt of n_prompt tokens then `steps` passes of `chunk` tokens; returns the first
// disagreement ("" if none).
std::string run_policy(PolicySim& sim, int n_prompt, int steps, int chunk) {
  std::string d = sim.pass(n_prompt);
  if (!d.empty()) return "prompt: " + d;
  for (int s = 0; s < steps; ++s) {
    d = sim.pass(chunk);
    if (!d.empty()) return "pass " + std::to_string(s + 1) + ": " + d;
  }
  return "";
}

void check_all_layouts(const std::string& spec, int n_prompt, int steps, int chunk,
                       int n_layer = 4, double f32_tol = 0.0) {
  for (int heads : {4, 2, 1}) {
    for (KvType type : {KvType::kF32, KvType::kF16}) {
      SCOPED_TRACE(spec + " " + test::layout_name(heads) + " " + kv_type_name(type));
      SimSetup s;
      s.n_layer = n_layer;
      s.n_head_kv = heads;
      s.type = type;
      s.head_dim = heads == 2 ? 20 : 16;  // 20: SIMD tails
      s.seed = static_cast<uint32_t>(heads * 7 + (type == KvType::kF16 ? 1 : 0));
      PolicySim sim(spec, s);
      if (sim.ref_cfg.pos == PosMode::kShift || sim.ref_cfg.mspace == MergeSpace::kUnrotated)
        sim.tol = type == KvType::kF32 ? 1e-4 : 3e-3;
      if (f32_tol > 0.0 && type == KvType::kF32) sim.tol = f32_tol;
      EXPECT_EQ(run_policy(sim, n_prompt, steps, chunk), "");
      EXPECT_TRUE(sim.state.budgets_set);
    }
  }
}

// Prompt-then-compress: a 40-token prompt compacted at once, then 50 decode steps.
TEST(PolicyReference, D2oPaperDefaults) {
  check_all_layouts("d2o:reading=paper,ratio=0.3", 40, 50, 1);
  check_all_layouts("d2o:reading=paper,ratio=0.25", 90, 50, 1, 8);  // budgets away from the clamps
}
TEST(PolicyReference, D2oLayerRules) {
  for (const char* rule : {"uniform", "reciprocal", "exp", "pyramid", "research"}) {
    check_all_layouts(std::string("d2o:reading=paper,ratio=0.3,layers=") + rule, 40, 50, 1, 6);
  }
}
TEST(PolicyReference, D2oMergeAblations) {
  for (const char* m : {"merge=average", "merge=research", "merge=off", "sim=value", "sim=kv",
                        "ema=research", "nm=1:1,sinks=2", "norm=queries,agg=mean", "beta=0.5"}) {
    check_all_layouts(std::string("d2o:reading=paper,ratio=0.3,") + m, 40, 50, 1);
  }
}
// The keys that separate D2O's pieces (docs/research/results_full.md, "Why D2O loses"), alone and
// together.
TEST(PolicyReference, D2oDiagnosisKeys) {
  for (const char* m :
       {"mscore=keep", "mscore=mean", "mscore=max", "mrope=pre", "decide=token", "protect=edges",
        "merge=sized", "mass=on", "decide=token,ema=research,merge=research",
        "mrope=pre,merge=sized,mscore=mean,decide=token,sim=kv",
        "mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries"}) {
    check_all_layouts(std::string("d2o:reading=paper,ratio=0.3,") + m, 40, 50, 1, 6);
  }
}
TEST(PolicyReference, D2oResearchReading) {
  check_all_layouts("d2o:ratio=0.3,reading=research", 40, 50, 1, 6);
}
TEST(PolicyReference, H2oAndRoco) {
  check_all_layouts("h2o:ratio=0.3", 40, 50, 1);
  check_all_layouts("h2o:ratio=0.3,sinks=3,nm=3:1,norm=queries", 40, 50, 1);
  check_all_layouts("roco:ratio=0.3", 40, 50, 1);
}
TEST(PolicyReference, Streaming) {
  check_all_layouts("streaming:ratio=0.3", 40, 50, 1);
  check_all_layouts("streaming:ratio=0.3,pos=shift", 40, 50, 1);
}
TEST(PolicyReference, SnapKvAndPyramidKv) {
  check_all_layouts("snapkv:ratio=0.4,window=4,kernel=3", 40, 50, 1);
  check_all_layouts("snapkv:ratio=0.4,window=4,kernel=5,pool=max", 40, 50, 1);
  check_all_layouts("pyramidkv:ratio=0.4,window=4,kernel=3", 40, 50, 1, 6);
  // hold=on: the prompt's budget kept through the decode steps.
  check_all_layouts("snapkv:ratio=0.4,window=4,kernel=3,hold=on", 40, 50, 1);
  check_all_layouts("pyramidkv:ratio=0.4,window=4,kernel=3,hold=on", 40, 50, 1, 6);
}
TEST(PolicyReference, Cam) {
  check_all_layouts("cam:ratio=0.3", 40, 50, 1);
  check_all_layouts("cam:ratio=0.3,mb=3,seed=11,sinks=2", 40, 50, 1);
}

TEST(PolicyReference, KeyDiff) {
  check_all_layouts("keydiff:ratio=0.3", 40, 50, 1);
  check_all_layouts("keydiff:ratio=0.35", 37, 50, 1, 5);  // odd sizes
  check_all_layouts("keydiff:ratio=0.3,sinks=3,recent=5", 41, 50, 1);
  check_all_layouts("keydiff:ratio=0.1", 53, 20, 1, 3);  // budgets at the smallest (1)
}

// scorer=: each registered scorer ranking the heavy hitters (scorer.h), with uniform and shared
// head budgets, merging and not, against the naive ranking by the same score.
TEST(PolicyReference, Scorers) {
  for (const char* sc : {"value_norm", "key_diversity", "mean_attention", "expected_attention"}) {
    const std::string k = std::string("scorer=") + sc;
    check_all_layouts("h2o:ratio=0.3," + k, 40, 50, 1);
    check_all_layouts("h2o:ratio=0.3,heads=ada," + k, 40, 30, 1);
    check_all_layouts("d2o:reading=paper,ratio=0.3," + k, 40, 50, 1, 6);
    check_all_layouts("d2o:ratio=0.3," + k, 40, 50, 1);
    check_all_layouts("h2o:budget=24," + k, 8, 12, 5);  // streaming in chunks
  }
}

// Expected attention's own keys, and the prompt compacted by it (prompt_ranking=expected: the
// sinks, the last `window` slots, the rest by the pooled expected attention; prompt_scores=window
// carries it as attention per query, formed in float against the naive's double: 1e-4).
TEST(PolicyReference, ExpectedAttention) {
  check_all_layouts("h2o:ratio=0.3,scorer=expected_attention,future=3,window=5", 40, 50, 1);
  check_all_layouts("h2o:ratio=0.3,scorer=expected_attention,value_weight=none,window=1", 40, 30,
                    1);
  check_all_layouts("h2o:budget=24,scorer=expected_attention,window=7,sinks=2", 8, 12, 5);
  check_all_layouts("d2o:ratio=0.3,prompt_ranking=expected,window=5", 40, 50, 1, 4, 1e-4);
  check_all_layouts("h2o:ratio=0.3,prompt_ranking=expected,window=4,kernel=5", 40, 50, 1);
  check_all_layouts("roco:ratio=0.35,prompt_ranking=expected,window=3,value_weight=none", 37, 50,
                    1, 5);
  check_all_layouts(
      "d2o:ratio=0.3,prompt_ranking=expected,window=6,kernel=3,scorer=expected_attention,"
      "future=64",
      40, 50, 1, 4, 1e-4);
  check_all_layouts("d2o:reading=paper,ratio=0.3,prompt_ranking=expected,window=5,mass=on,"
                    "merge=sized",
                    40, 50, 1, 6);
}

// distinct=F: part of the heavy-hitter places by KeyDiff's score, the rest by attention.
TEST(PolicyReference, DistinctShare) {
  check_all_layouts("h2o:ratio=0.3,distinct=0.5", 40, 50, 1);
  check_all_layouts("h2o:ratio=0.3,nm=3:1,distinct=1", 40, 50, 1);
  check_all_layouts("d2o:reading=paper,ratio=0.3,distinct=0.25", 40, 50, 1, 6);
  check_all_layouts("d2o:reading=paper,ratio=0.3,distinct=1,layers=uniform,merge=off", 40, 50, 1);
  check_all_layouts("d2o:reading=paper,ratio=0.3,distinct=0.5,mass=on,merge=sized,nm=1:1", 40, 50,
                    1);
  check_all_layouts("h2o:ratio=0.3,distinct=0.5,norm=queries", 37, 50, 1, 5);
}

// prompt=window: the prompt's heavy hitters ranked by SnapKV's pooled window attention, later
// compactions by the accumulated score; pmerge=off: D2O's first compaction only evicts.
TEST(PolicyReference, PromptWindowAndPromptMerge) {
  check_all_layouts("h2o:ratio=0.3,prompt=window,kernel=5,window=4", 40, 50, 1);
  check_all_layouts("h2o:ratio=0.3,prompt=window,kernel=7,pool=max,window=6,norm=queries", 40, 50,
                    1);
  check_all_layouts("roco:ratio=0.35,prompt=window,window=3", 37, 50, 1, 5);
  check_all_layouts("d2o:reading=paper,ratio=0.3,prompt=window,kernel=21,window=5", 40, 50, 1, 6);
  check_all_layouts("d2o:reading=paper,ratio=0.3,prompt=window", 40, 50,
                    1);  // the window takes S - sinks
  check_all_layouts("d2o:reading=paper,ratio=0.3,pmerge=off", 40, 50, 1);
  check_all_layouts(
      "d2o:reading=paper,ratio=0.3,mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries,prompt="
      "window,"
      "kernel=21,pmerge=off,window=4",
      40, 50, 1);
  check_all_layouts("d2o:reading=paper,ratio=0.3,decide=token,pmerge=off,prompt=window,window=2",
                    40, 50, 1);
  check_all_layouts("d2o:reading=paper,ratio=0.3,heads=ada,pmerge=off", 40, 50, 1);
  // pscore=window: the prompt's slots carry the window's pooled scores into the decode steps.
  check_all_layouts("h2o:ratio=0.3,prompt=window,kernel=5,window=4,pscore=window", 40, 50, 1);
  check_all_layouts("roco:ratio=0.35,prompt=window,window=3,pscore=window,pool=max", 37, 50, 1, 5);
  check_all_layouts("d2o:reading=paper,ratio=0.3,prompt=window,kernel=7,window=5,pscore=window", 40,
                    50, 1, 6);
  check_all_layouts(
      "d2o:reading=paper,ratio=0.3,mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries,prompt="
      "window,"
      "kernel=21,pmerge=off,window=4,pscore=window",
      40, 50, 1);
  check_all_layouts(
      "d2o:reading=paper,ratio=0.3,decide=token,prompt=window,window=2,pscore=window,mscore=max",
      40, 50, 1);
  // d2o's defaults are the combination above without merges (F); merge=sized gives it back (E).
  check_all_layouts("d2o:ratio=0.3,window=4", 40, 50, 1);
  check_all_layouts("d2o:ratio=0.3", 40, 50, 1, 6);
  check_all_layouts("d2o:ratio=0.3,window=4,merge=sized", 40, 50, 1);
  check_all_layouts("d2o:ratio=0.3,merge=sized", 40, 50, 1, 6);
}

// Fed token by token, no compaction is the prompt's: the keys change nothing.
TEST(PolicyReference, PromptKeysDoNothingTokenByToken) {
  for (const char* spec :
       {"d2o:reading=paper,budget=14,prompt=window,pmerge=off,mass=on,merge=sized,nm=1:1",
        "h2o:budget=12,prompt=window,kernel=5,pscore=window"}) {
    SCOPED_TRACE(spec);
    SimSetup s;
    PolicySim sim(spec, s);
    sim.ref_cfg.prompt = PromptScore::kAccumulated;
    sim.ref_cfg.pscore = PromptScore::kAccumulated;
    sim.ref_cfg.prompt_merge = true;
    EXPECT_EQ(run_policy(sim, 1, 40, 1), "");
  }
}

// Streaming with a fixed capacity: chunks of 7 tokens, compaction whenever a layer overflows.
TEST(PolicyReference, BudgetModeInChunks) {
  for (const char* spec :
       {"d2o:reading=paper,budget=14", "d2o:reading=paper,budget=14,layers=research",
        "d2o:reading=paper,budget=14,mrope=pre,decide=token,merge=sized,protect=edges,mscore=max",
        "h2o:budget=12", "roco:budget=12", "streaming:budget=10", "streaming:budget=10,pos=shift",
        "snapkv:budget=10,window=4", "pyramidkv:budget=10,window=4,pool=max", "cam:budget=10",
        "cam:budget=10,mb=2", "keydiff:budget=11", "keydiff:budget=10,sinks=2,recent=3",
        "h2o:budget=12,distinct=0.5", "d2o:reading=paper,budget=14,distinct=0.5",
        "d2o:reading=paper,budget=14,mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries",
        "d2o:reading=paper,budget=14,prompt=window,window=4,kernel=3,pmerge=off",
        "d2o:reading=paper,budget=14,prompt=window,window=4,kernel=3,pmerge=off,pscore=window",
        "h2o:budget=12,prompt=window"}) {
    check_all_layouts(spec, 5, 14, 7, 6);
  }
}

// Statistics from the attention kernel itself (4 query heads over 4, 2 or 1 KV heads), as the
// engine produces them for each policy's needs().
TEST(PolicyReference, WithAttentionStatistics) {
  for (const char* spec :
       {"d2o:reading=paper,ratio=0.3", "d2o:reading=paper,budget=20,agg=max",
        "d2o:reading=paper,ratio=0.3,mass=on,merge=sized", "h2o:ratio=0.3,agg=mean",
        "roco:budget=16", "snapkv:budget=16,window=4", "pyramidkv:ratio=0.4,window=4",
        "snapkv:ratio=0.3,window=4,hold=on", "cam:ratio=0.3", "keydiff:ratio=0.3",
        "keydiff:budget=13,sinks=1", "d2o:reading=paper,ratio=0.3,distinct=0.5",
        "d2o:reading=paper,ratio=0.3,mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries",
        "d2o:reading=paper,ratio=0.3,mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries,prompt="
        "window,"
        "window=4,kernel=5,pmerge=off",
        "d2o:reading=paper,ratio=0.3,mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries,prompt="
        "window,"
        "window=4,kernel=5,pmerge=off,pscore=window",
        "d2o:ratio=0.3,window=4,kernel=5"}) {
    for (int heads : {4, 2, 1}) {
      for (KvType type : {KvType::kF32, KvType::kF16}) {
        SCOPED_TRACE(std::string(spec) + " " + test::layout_name(heads) + " " + kv_type_name(type));
        SimSetup s;
        s.n_head_kv = heads;
        s.n_head = 4;
        s.type = type;
        PolicySim sim(spec, s);
        EXPECT_EQ(run_policy(sim, 48, 30, 1), "");
      }
    }
  }
}

// Layers planned on a thread pool: same results as the naive reference, and bit-identical caches
// and states to the serial run.
TEST(PolicyReference, ThreadPoolGivesIdenticalResults) {
  ThreadPool pool(3);
  for (const char* spec :
       {"d2o:reading=paper,ratio=0.3", "d2o:reading=paper,budget=14,sim=kv", "cam:ratio=0.3",
        "h2o:budget=12", "streaming:budget=10,pos=shift", "snapkv:budget=10,window=4",
        "keydiff:budget=12", "d2o:reading=paper,ratio=0.3,distinct=0.5",
        "d2o:reading=paper,ratio=0.3,prompt=window,window=4,pmerge=off",
        "d2o:reading=paper,ratio=0.3,prompt=window,window=4,pscore=window",
        "h2o:budget=12,scorer=expected_attention,window=4",
        "d2o:ratio=0.3,prompt_ranking=expected,window=4"}) {
    for (KvType type : {KvType::kF32, KvType::kF16}) {
      SCOPED_TRACE(std::string(spec) + " " + kv_type_name(type));
      SimSetup s;
      s.n_layer = 6;
      s.type = type;
      PolicySim serial(spec, s), pooled(spec, s);
      pooled.pool = &pool;
      if (pooled.ref_cfg.pos == PosMode::kShift) pooled.tol = serial.tol = 3e-3;
      for (int step = 0; step < 30; ++step) {
        ASSERT_EQ(serial.pass(step == 0 ? 40 : 1), "");
        ASSERT_EQ(pooled.pass(step == 0 ? 40 : 1), "");
      }
      for (int il = 0; il < s.n_layer; ++il) {
        const KvLayer& a = serial.cache.layer(il);
        const KvLayer& b = pooled.cache.layer(il);
        ASSERT_EQ(a.n_slot(), b.n_slot());
        for (int g = 0; g < s.n_head_kv; ++g) {
          const size_t n = static_cast<size_t>(a.n_slot());
          EXPECT_EQ(test::compare_keys(a, b, g, n), 0);
          EXPECT_EQ(test::compare_values(a, b, g, n), 0);
          EXPECT_EQ(std::memcmp(a.score(g), b.score(g), sizeof(float) * a.n_slot()), 0);
        }
      }
      EXPECT_EQ(test::d2o_tau(serial.state), test::d2o_tau(pooled.state));
      EXPECT_EQ(serial.state.merged, pooled.state.merged);
    }
  }
}

// The comparison must be able to fail: the naive side runs a deliberately different policy.
TEST(PolicyReference, NaiveCatchesWrongVariants) {
  struct Wrong {
    std::string spec;
    std::function<void(PolicyConfig&)> change;
  };
  const std::vector<Wrong> wrongs = {
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.beta = 0.5; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.nm_n = 1; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.merge = MergeRule::kAverage; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.sim = SimOn::kValue; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.layers = LayerRule::kReciprocal; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.sinks = 3; }},
      {"d2o:reading=paper,ratio=0.3,ema=research",
       [](PolicyConfig& c) { c.ema = EmaRule::kPaper; }},
      {"d2o:reading=paper,ratio=0.3,layers=research",
       [](PolicyConfig& c) { c.layers = LayerRule::kVariance; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.mscore = MergedScore::kKeep; }},
      {"d2o:reading=paper,ratio=0.3,mscore=mean",
       [](PolicyConfig& c) { c.mscore = MergedScore::kMax; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.mspace = MergeSpace::kUnrotated; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.decide = MergeDecision::kToken; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.protect = ProtectRule::kEdges; }},
      {"d2o:reading=paper,ratio=0.3", [](PolicyConfig& c) { c.merge = MergeRule::kSized; }},
      {"h2o:ratio=0.3", [](PolicyConfig& c) { c.scorer = "mean_attention"; }},
      {"snapkv:ratio=0.4,window=4", [](PolicyConfig& c) { c.pool = PoolKind::kMax; }},
      {"snapkv:ratio=0.4,window=4", [](PolicyConfig& c) { c.kernel = 5; }},
      {"snapkv:ratio=0.4,window=4", [](PolicyConfig& c) { c.hold = true; }},
      {"snapkv:ratio=0.4,window=4,hold=on", [](PolicyConfig& c) { c.hold = false; }},
      {"pyramidkv:ratio=0.4,window=4", [](PolicyConfig& c) { c.pbeta = 4; }},
      {"streaming:ratio=0.3", [](PolicyConfig& c) { c.pos = PosMode::kShift; }},
      {"cam:ratio=0.3", [](PolicyConfig& c) { c.seed = 1; }},
      {"cam:ratio=0.3", [](PolicyConfig& c) { c.cam_targets = 2; }},
      {"keydiff:ratio=0.3", [](PolicyConfig& c) { c.sinks = 2; }},
      {"keydiff:ratio=0.3", [](PolicyConfig& c) { c.recent = 3; }},
      {"keydiff:ratio=0.3", [](PolicyConfig& c) { c.selector = Selector::kSinkRecent; }},
      {"h2o:ratio=0.3", [](PolicyConfig& c) { c.distinct = 0.5; }},
      {"h2o:ratio=0.3,distinct=0.5", [](PolicyConfig& c) { c.distinct = 0.25; }},
      {"d2o:reading=paper,ratio=0.3,distinct=1", [](PolicyConfig& c) { c.distinct = 0; }},
      {"h2o:ratio=0.3,prompt=window,window=4",
       [](PolicyConfig& c) { c.prompt = PromptScore::kAccumulated; }},
      {"h2o:ratio=0.3,prompt=window,window=4", [](PolicyConfig& c) { c.kernel = 3; }},
      {"d2o:reading=paper,ratio=0.3,pmerge=off", [](PolicyConfig& c) { c.prompt_merge = true; }},
      {"d2o:reading=paper,ratio=0.3,prompt=window,window=4", [](PolicyConfig& c) { c.sinks = 0; }},
      {"h2o:ratio=0.3,prompt=window,window=4,pscore=window",
       [](PolicyConfig& c) { c.pscore = PromptScore::kAccumulated; }},
      {"d2o:reading=paper,ratio=0.3,prompt=window,window=4,norm=queries",
       [](PolicyConfig& c) { c.pscore = PromptScore::kWindow; }},
      {"h2o:ratio=0.3,scorer=expected_attention", [](PolicyConfig& c) { c.future = 1; }},
      {"h2o:ratio=0.3,scorer=expected_attention",
       [](PolicyConfig& c) { c.value_weight = ValueWeight::kNone; }},
      {"h2o:ratio=0.3,scorer=expected_attention,value_weight=none",
       [](PolicyConfig& c) { c.scorer = "value_norm"; }},
      {"h2o:ratio=0.3,prompt_ranking=expected,window=4",
       [](PolicyConfig& c) { c.prompt = PromptScore::kWindow; }},
  };
  for (const Wrong& w : wrongs) {
    SCOPED_TRACE(w.spec);
    SimSetup s;
    s.n_layer = 6;
    PolicySim sim(w.spec, s);
    w.change(sim.ref_cfg);
    EXPECT_NE(run_policy(sim, 40, 20, 1), "");
  }
}

}  // namespace
}  // namespace d2o
