// Per-head budgets (heads=ada): the layer's S x G slots shared over its KV heads by score, with a
// floor per head. Against the naive re-implementation (policy_naive.h) on MHA / GQA / MQA and
// F32 / F16, with wrong variants the comparison must catch; attention over heads holding
// different slot counts against a double-precision reference; the cache operations that copy,
// count and account for such layers; the spec keys and their errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kv/attention.h"
#include "kv/kv_cache.h"
#include "ops/kernel_isa.h"
#include "unit/kv_test_access.h"
#include "unit/policy_sim.h"

namespace d2o {
namespace {

using test::PolicySim;
using test::SimSetup;

// A prompt of n_prompt tokens then `steps` passes of `chunk` tokens; the first disagreement with
// the naive reference ("" if none). `ragged` is set when some layer's heads held different counts
// after a compaction; every compacted layer must hold exactly G x S slots.
std::string run(PolicySim& sim, int n_prompt, int steps, int chunk, bool* ragged = nullptr) {
  for (int s = 0; s <= steps; ++s) {
    const std::string d = sim.pass(s == 0 ? n_prompt : chunk);
    if (!d.empty()) return "pass " + std::to_string(s) + ": " + d;
    for (int il = 0; il < sim.cache.n_layer(); ++il) {
      const KvLayer& L = sim.cache.layer(il);
      if (!L.uniform() && ragged) *ragged = true;
      const int S = sim.state.budgets_set ? sim.state.budgets[static_cast<size_t>(il)] : -1;
      if (S >= 0 && sim.ref_cfg.compacts_after_first() &&
          L.held_slots() > int64_t{S} * L.n_head_kv())
        return "layer " + std::to_string(il) + " holds more than its budget";
    }
  }
  return "";
}

void check_layouts(const std::string& spec, int n_prompt, int steps, int chunk, int n_head = 0) {
  for (int heads : {4, 2, 1}) {
    for (KvType type : {KvType::kF32, KvType::kF16}) {
      SCOPED_TRACE(spec + " " + test::layout_name(heads) + " " + kv_type_name(type));
      SimSetup s;
      s.n_layer = 5;
      s.n_head_kv = heads;
      s.type = type;
      s.n_head = n_head;
      s.head_dim = heads == 2 ? 20 : 16;
      s.seed = static_cast<uint32_t>(heads * 5 + (type == KvType::kF16 ? 1 : 0));
      PolicySim sim(spec, s);
      bool ragged = false;
      EXPECT_EQ(run(sim, n_prompt, steps, chunk, &ragged), "");
      // The test must exercise unequal counts wherever there is more than one head to share.
      if (heads > 1) {
        EXPECT_TRUE(ragged);
      }
    }
  }
}

TEST(PolicyHeads, MatchesNaiveReference) {
  for (const char* spec : {"h2o:ratio=0.3,heads=ada", "h2o:ratio=0.3,heads=ada,floor=0",
                           "h2o:ratio=0.3,heads=ada,floor=0.5,sinks=2,nm=3:1",
                           "roco:ratio=0.3,heads=ada", "d2o:reading=paper,ratio=0.3,heads=ada",
                           "d2o:reading=paper,ratio=0.3,heads=ada,mass=on,merge=sized,floor=0.1",
                           "snapkv:ratio=0.4,window=4,kernel=3,heads=ada",
                           "pyramidkv:ratio=0.4,window=4,pool=max,heads=ada"}) {
    check_layouts(spec, 40, 40, 1);
  }
}

TEST(PolicyHeads, BudgetModeInChunks) {
  for (const char* spec :
       {"h2o:budget=12,heads=ada", "d2o:reading=paper,budget=14,heads=ada,floor=0.3",
        "snapkv:budget=10,window=4,heads=ada"}) {
    check_layouts(spec, 5, 14, 7);
  }
}

TEST(PolicyHeads, WithAttentionStatistics) {
  for (const char* spec :
       {"h2o:ratio=0.3,heads=ada", "d2o:reading=paper,budget=20,heads=ada,agg=max",
        "snapkv:budget=16,window=4,heads=ada"}) {
    check_layouts(spec, 48, 20, 1, 4);
  }
}

// floor=1: every head keeps its own K best, nothing is shared: the uniform policy, bit for bit.
TEST(PolicyHeads, FloorOneIsTheUniformPolicy) {
  for (const char* base :
       {"h2o:ratio=0.3", "d2o:reading=paper,ratio=0.3", "snapkv:budget=10,window=4"}) {
    SCOPED_TRACE(base);
    SimSetup s;
    s.n_head_kv = 4;
    PolicySim a(base, s), b(std::string(base) + ",heads=ada,floor=1", s);
    for (int step = 0; step < 20; ++step) {
      ASSERT_EQ(a.pass(step == 0 ? 40 : 1), "");
      ASSERT_EQ(b.pass(step == 0 ? 40 : 1), "");
    }
    for (int il = 0; il < s.n_layer; ++il) {
      const KvLayer& x = a.cache.layer(il);
      const KvLayer& y = b.cache.layer(il);
      ASSERT_TRUE(y.uniform());
      ASSERT_EQ(x.n_slot(), y.n_slot());
      for (int g = 0; g < s.n_head_kv; ++g) {
        for (int j = 0; j < x.n_slot(); ++j) {
          EXPECT_EQ(x.pos(g)[j], y.pos(g)[j]);
          EXPECT_EQ(x.score(g)[j], y.score(g)[j]);
        }
      }
    }
  }
}

// The comparison must be able to fail: the naive side runs a deliberately different policy.
TEST(PolicyHeads, NaiveCatchesWrongVariants) {
  struct Wrong {
    std::string spec;
    std::function<void(PolicyConfig&)> change;
  };
  const std::vector<Wrong> wrongs = {
      {"h2o:ratio=0.3,heads=ada", [](PolicyConfig& c) { c.heads = HeadRule::kUniform; }},
      {"h2o:ratio=0.3,heads=ada,floor=0.8", [](PolicyConfig& c) { c.floor = 0.2; }},
      {"h2o:ratio=0.3,heads=ada,floor=0", [](PolicyConfig& c) { c.floor = 0.5; }},
      {"h2o:ratio=0.3", [](PolicyConfig& c) { c.heads = HeadRule::kAda; }},
      {"d2o:reading=paper,ratio=0.3,heads=ada", [](PolicyConfig& c) { c.nm_n = 1; }},
      {"snapkv:ratio=0.4,window=4,heads=ada", [](PolicyConfig& c) { c.kernel = 5; }},
  };
  for (const Wrong& w : wrongs) {
    SCOPED_TRACE(w.spec);
    SimSetup s;
    s.n_head_kv = 4;
    PolicySim sim(w.spec, s);
    w.change(sim.ref_cfg);
    EXPECT_NE(run(sim, 40, 20, 1), "");
  }
}

TEST(PolicyHeads, SpecKeys) {
  auto spec_of = [](const std::string& s) {
    auto p = parse_kv_policy(s);
    EXPECT_TRUE(p.ok()) << s << ": " << p.status().message();
    return p.ok() ? p.value()->spec() : std::string();
  };
  // The default prints as before (no heads= key); ada prints both keys and round-trips.
  EXPECT_EQ(spec_of("h2o:ratio=0.2"), "h2o:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum,scorer=accumulated_attention");
  EXPECT_EQ(spec_of("h2o:ratio=0.2,heads=uniform"), spec_of("h2o:ratio=0.2"));
  const std::string ada = spec_of("h2o:ratio=0.2,heads=ada");
  EXPECT_EQ(ada, "h2o:ratio=0.2,sinks=0,heavy_recent=1:1,agg=sum,scorer=accumulated_attention,heads=ada,floor=0.2");
  EXPECT_EQ(spec_of(ada), ada);
  EXPECT_NE(spec_of("snapkv:ratio=0.2,heads=ada,floor=0.5").find("floor=0.5"), std::string::npos);
  spec_of("pyramidkv:ratio=0.2,heads=ada");
  spec_of("roco:ratio=0.2,heads=ada");
  spec_of("d2o:reading=paper,ratio=0.2,heads=ada,floor=0");
  for (const char* bad :
       {"streaming:ratio=0.2,heads=ada", "cam:ratio=0.2,heads=ada", "keydiff:ratio=0.2,heads=ada",
        "streaming:ratio=0.2,floor=0.2", "h2o:ratio=0.2,floor=0.3", "h2o:ratio=0.2,heads=all",
        "h2o:ratio=0.2,heads=ada,floor=1.5", "h2o:ratio=0.2,heads=ada,floor=-0.1",
        "d2o:reading=paper,ratio=0.2,heads=ada,decide=token",
        "d2o:ratio=0.2,heads=ada,reading=research"}) {
    auto p = parse_kv_policy(bad);
    EXPECT_FALSE(p.ok()) << bad;
    if (!p.ok()) {
      EXPECT_FALSE(p.status().message().empty());
    }
  }
  auto p = parse_kv_policy("streaming:ratio=0.2,heads=ada");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("heads=ada works with"), std::string::npos);
}

// A state whose cache holds unequal counts cannot be compacted by a uniform policy: an error.
TEST(PolicyHeads, UniformPolicyRefusesUnequalCounts) {
  SimSetup s;
  s.n_head_kv = 4;
  PolicySim sim("h2o:ratio=0.3,heads=ada", s);
  bool ragged = false;
  ASSERT_EQ(run(sim, 40, 10, 1, &ragged), "");
  ASSERT_TRUE(ragged);
  auto h2o = parse_kv_policy("h2o:ratio=0.3");
  ASSERT_TRUE(h2o.ok());
  PolicyState st = sim.state;
  PassInfo pi;
  pi.n_tokens = 1;
  pi.n_past = sim.n_past;
  EXPECT_FALSE(h2o.value()->compact(sim.cache, st, pi).ok());
}

// ---- the cache and attention with unequal per-head counts ----------------------------------

// A one-layer cache of `total` random slots per head, then the per-head counts `n`.
KvCache ragged_cache(int G, int hd, KvType type, int total, const std::vector<int32_t>& n,
                     uint32_t seed) {
  KvCache cache(KvCacheConfig{1, G, hd, type});
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(total) * G * hd), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  std::vector<int32_t> pos(static_cast<size_t>(total));
  for (int i = 0; i < total; ++i) pos[static_cast<size_t>(i)] = i;
  EXPECT_TRUE(cache.reserve(0, total, true).ok());
  cache.append(0, k.data(), v.data(), pos.data(), total);
  KvLayer& L = KvTestAccess::layer(cache, 0);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < total; ++j) KvTestAccess::score(L, g)[j] = 0.5f * static_cast<float>(j % 3);
  KvTestAccess::set_head_slots(L, n.data());
  return cache;
}

TEST(PolicyHeads, AttentionWithUnequalCountsMatchesDoubleReference) {
  struct Case {
    int H, G, hd, n_tok;
    std::vector<int32_t> n;
  };
  const std::vector<Case> cases = {
      {4, 4, 16, 1, {300, 40, 517, 256}},   // MHA, a decode step, several tiles per head
      {4, 4, 16, 20, {300, 40, 517, 257}},  // a chunk: per-block tasks
      {6, 2, 32, 3, {600, 21}},             // GQA
      {4, 1, 16, 5, {333}},                 // MQA (one head: uniform)
  };
  for (const Case& c : cases) {
    for (KvType type : {KvType::kF32, KvType::kF16}) {
      SCOPED_TRACE("H=" + std::to_string(c.H) + " G=" + std::to_string(c.G) +
                   " tok=" + std::to_string(c.n_tok) + " " + kv_type_name(type));
      const int total = *std::max_element(c.n.begin(), c.n.end());
      const int grp = c.H / c.G;
      std::mt19937 rng(5);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      std::vector<float> q(static_cast<size_t>(c.n_tok) * c.H * c.hd);
      for (float& x : q) x = 2.0f * nd(rng);
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.hd));
      // Reference in double: query t of head h sees its KV head's first n_g - n_tok + t + 1 slots.
      KvCache ref = ragged_cache(c.G, c.hd, type, total, c.n, 9);
      const KvLayer& R = ref.layer(0);
      std::vector<double> want(q.size()), want_score(static_cast<size_t>(c.G) * total, 0.0);
      std::vector<float> row(static_cast<size_t>(c.hd));
      for (int t = 0; t < c.n_tok; ++t) {
        for (int h = 0; h < c.H; ++h) {
          const int g = h / grp, n_vis = c.n[static_cast<size_t>(g)] - c.n_tok + t + 1;
          const float* qr = q.data() + (static_cast<size_t>(t) * c.H + h) * c.hd;
          std::vector<double> p(static_cast<size_t>(n_vis));
          double m = -INFINITY, z = 0.0;
          for (int j = 0; j < n_vis; ++j) {
            R.load_key(g, j, row.data());
            double s = 0.0;
            for (int d = 0; d < c.hd; ++d)
              s += static_cast<double>(qr[d]) * row[static_cast<size_t>(d)];
            p[static_cast<size_t>(j)] = s * scale;
            m = std::max(m, p[static_cast<size_t>(j)]);
          }
          for (double& x : p) z += (x = std::exp(x - m));
          double* o = want.data() + (static_cast<size_t>(t) * c.H + h) * c.hd;
          for (int j = 0; j < n_vis; ++j) {
            R.load_value(g, j, row.data());
            const double w = p[static_cast<size_t>(j)] / z;
            for (int d = 0; d < c.hd; ++d) o[d] += w * row[static_cast<size_t>(d)];
            want_score[static_cast<size_t>(g) * total + j] += w;
          }
        }
      }
      AttnStatsRequest req;
      req.accumulate = true;
      req.window_first = c.n_tok - 1;
      for (int run = 0; run < 9; ++run) {
        const int threads = 1 + run % 3;
        const KernelIsa isa = run < 3   ? KernelIsa::kScalar
                              : run < 6 ? KernelIsa::kAvx2
                                        : KernelIsa::kAvx512;
        if (!kernel_isa_available(isa)) continue;
        SCOPED_TRACE(std::to_string(threads) + " threads, " + kernel_isa_name(isa));
        KvCache cache = ragged_cache(c.G, c.hd, type, total, c.n, 9);
        ThreadPool pool(threads);
        AttnScratch sc;
        std::vector<float> out(q.size());
        AttnInput in{q.data(), out.data(), c.n_tok, c.H, scale};
        attention_forward_isa(in, cache.layer_for_attention(0), req, pool, sc, isa);
        for (size_t i = 0; i < out.size(); ++i)
          ASSERT_NEAR(out[i], want[i], 2e-5 * (1.0 + std::fabs(want[i]))) << i;
        const KvLayer& L = cache.layer(0);
        for (int g = 0; g < c.G; ++g) {
          for (int j = 0; j < total; ++j) {
            // Slots past a head's count are not its slots: left as they were.
            const double prior = 0.5 * (j % 3);
            const double w = j < c.n[static_cast<size_t>(g)]
                                 ? prior + want_score[static_cast<size_t>(g) * total + j]
                                 : prior;
            ASSERT_NEAR(L.score(g)[j], w, 2e-5 * (1.0 + w)) << g << "," << j;
          }
        }
      }
      // The library's own reference agrees too.
      KvCache cache = ragged_cache(c.G, c.hd, type, total, c.n, 9);
      std::vector<float> out(q.size());
      AttnInput in{q.data(), out.data(), c.n_tok, c.H, scale};
      attention_reference(in, cache.layer_for_attention(0), req);
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_NEAR(out[i], want[i], 2e-5 * (1.0 + std::fabs(want[i]))) << i;
    }
  }
}

TEST(PolicyHeads, CacheOperationsKeepPerHeadCounts) {
  const std::vector<int32_t> n = {30, 7, 19};
  KvCache c = ragged_cache(3, 16, KvType::kF16, 30, n, 3);
  const KvLayer& L = c.layer(0);
  ASSERT_FALSE(L.uniform());
  EXPECT_EQ(L.n_slot(), 30);
  EXPECT_EQ(L.held_slots(), 56);
  EXPECT_EQ(c.total_slots(), 56 / 3);
  EXPECT_EQ(c.kv_bytes_used(), 56 * (L.key_row_bytes() + L.value_row_bytes()));
  // Appending: every head after its own last slot.
  std::vector<float> k(2 * 3 * 16, 1.0f), v(k.size(), 2.0f);
  const int32_t pos[2] = {100, 101};
  ASSERT_TRUE(c.reserve(0, L.n_slot() + 2, false).ok());
  c.append(0, k.data(), v.data(), pos, 2);
  for (int g = 0; g < 3; ++g) {
    ASSERT_EQ(L.n_slot(g), n[static_cast<size_t>(g)] + 2);
    EXPECT_EQ(L.pos(g)[n[static_cast<size_t>(g)]], 100);
    EXPECT_EQ(L.pos(g)[n[static_cast<size_t>(g)] + 1], 101);
  }
  // Copies (eval forks, saved states) keep the counts and the slots.
  KvCache a(c.config()), b(c.config());
  ASSERT_TRUE(a.copy_slots_from(c).ok());
  ASSERT_TRUE(b.copy_from(c).ok());
  for (const KvCache* x : {&a, &b}) {
    for (int g = 0; g < 3; ++g) {
      ASSERT_EQ(x->layer(0).n_slot(g), L.n_slot(g));
      for (int j = 0; j < L.n_slot(g); ++j) EXPECT_EQ(x->layer(0).pos(g)[j], L.pos(g)[j]);
    }
  }
  EXPECT_EQ(a.layer(0).capacity(), 32);
  // A plan with equal per-head counts makes the layer uniform again.
  CompactionPlan plan;
  const int32_t five[3] = {5, 5, 5};
  plan.reset_heads(3, five);
  for (int g = 0; g < 3; ++g)
    for (int i = 0; i < 5; ++i) plan.keep_of(g)[i] = i;
  c.apply(0, plan);
  EXPECT_TRUE(c.layer(0).uniform());
  EXPECT_EQ(c.layer(0).n_slot(), 5);
}

}  // namespace
}  // namespace d2o
