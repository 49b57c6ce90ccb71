// Properties every policy must hold, checked directly (no reference implementation needed):
// slots per layer equal the budget after every decode step, sinks and the recent window always
// survive, merge weights sum to 1, D2O budgets sum exactly to round(rho L n) within the clamps,
// a budget no smaller than the sequence leaves the cache untouched, peak_slots() bounds what a
// sequence really holds, positions stay contiguous with pos=shift, the SIMD similarity kernels
// agree with a double reference; plus the cost of a D2O decode step (printed, not asserted).
#include <gtest/gtest.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <random>
#include <tuple>

#include "common/kv_rows.h"
#include "core/fp16.h"
#include "core/thread_pool.h"
#include "kv/policy/budgets.h"
#include "kv/policy/merge_d2o.h"
#include "kv/policy/select.h"
#include "kv/policy/similarity.h"
#include "unit/policy_sim.h"

#include "common/alloc_counter.h"

using d2o::test::g_allocations;
using d2o::test::g_count_allocations;

namespace d2o {
namespace {

using test::PolicySim;
using test::SimSetup;

TEST(PolicyInvariants, SlotsEqualBudgetAfterEveryDecodeStep) {
  for (const char* spec : {"d2o:reading=paper,ratio=0.3", "d2o:reading=paper,budget=16",
                           "d2o:reading=paper,ratio=0.3,layers=research", "h2o:ratio=0.25",
                           "roco:budget=12", "streaming:budget=10,pos=shift", "cam:ratio=0.3",
                           "snapkv:budget=12,window=4", "pyramidkv:budget=12,window=4",
                           "keydiff:ratio=0.3", "keydiff:budget=12,sinks=2,recent=3",
                           "h2o:ratio=0.25,scorer=expected_attention,window=8",
                           "d2o:budget=16,prompt_ranking=expected,window=4"}) {
    for (int heads : {4, 2, 1}) {
      SCOPED_TRACE(std::string(spec) + " " + test::layout_name(heads));
      SimSetup s;
      s.n_layer = 6;
      s.n_head_kv = heads;
      PolicySim sim(spec, s);
      sim.feed(60);
      ASSERT_EQ(sim.compact(), "");
      ASSERT_TRUE(sim.state.budgets_set);
      const PolicyConfig& c = sim.ref_cfg;
      for (int step = 0; step < 50; ++step) {
        sim.feed(1);
        ASSERT_EQ(sim.compact(), "") << "step " << step;
        for (int il = 0; il < s.n_layer; ++il) {
          const KvLayer& L = sim.cache.layer(il);
          const int b = sim.state.budgets[static_cast<size_t>(il)];
          if (b == PolicyState::kNoBudget) {
            EXPECT_EQ(L.n_slot(), sim.n_past);  // never compressed
            continue;
          }
          ASSERT_EQ(L.n_slot(), b) << "layer " << il;
          // Sinks and the recent window survive in every head.
          int heavy = 0, recent = b - std::min(c.sinks, b);
          if (c.selector == Selector::kHeavyRecent)
            split_heavy_recent(b, c.sinks, c.nm_n, c.nm_m, &heavy, &recent);
          if (c.selector == Selector::kSnapWindow) recent = std::min(c.window, b);
          if (c.selector == Selector::kKeyDiff)
            recent = std::min(c.recent, b - std::min(c.sinks, b));
          const int64_t next = sim.n_past - sim.state.pos_shift;
          for (int g = 0; g < heads; ++g) {
            for (int j = 0; j < std::min(c.sinks, b); ++j) EXPECT_EQ(L.pos(g)[j], j);
            for (int r = 0; r < recent; ++r) {
              EXPECT_EQ(L.pos(g)[b - 1 - r], next - 1 - r);
            }
          }
        }
      }
    }
  }
}

TEST(PolicyInvariants, MergeWeightsSumToOne) {
  for (const char* spec :
       {"d2o:reading=paper,ratio=0.3", "d2o:reading=paper,ratio=0.3,merge=average",
        "d2o:reading=paper,ratio=0.3,sim=kv"}) {
    SCOPED_TRACE(spec);
    SimSetup s;
    s.head_dim = 4;  // small dimension: high similarities, many merges, some many-to-one
    PolicySim sim(spec, s);
    sim.state.ext_as<ComposedPolicyState>().keep_merges = true;  // read after each pass
    int groups = 0, many_to_one = 0;
    for (int step = 0; step < 30; ++step) {
      sim.feed(step == 0 ? 40 : 1);
      ASSERT_EQ(sim.compact(), "");
      // The plans of the layers compacted by this pass are still in the state.
      std::map<std::tuple<int, int, int>, std::vector<const MergeTerm*>> by_dst;
      for (const int il : sim.state.todo) {
        for (const MergeTerm& t : sim.state.plans[static_cast<size_t>(il)].merges) {
          by_dst[{il, t.head, t.dst}].push_back(&t);
        }
      }
      for (const auto& [key, terms] : by_dst) {
        ++groups;
        if (terms.size() > 2) ++many_to_one;
        EXPECT_EQ(terms.front()->src, std::get<2>(key));  // the retained slot comes first
        double sum = 0;
        for (const MergeTerm* t : terms) {
          sum += t->w;
          // The retained slot's self-similarity is 1: it keeps the largest weight.
          if (sim.ref_cfg.merge == MergeRule::kWeighted) {
            EXPECT_LE(t->w, terms.front()->w + 1e-7);
          }
        }
        EXPECT_NEAR(sum, 1.0, 1e-6);
      }
      for (const auto& w : sim.ref.last_groups) {
        double sum = 0;
        for (double x : w) sum += x;
        EXPECT_NEAR(sum, 1.0, 1e-12);
      }
    }
    EXPECT_GT(groups, 10);
    EXPECT_GT(many_to_one, 0);
  }
}

TEST(PolicyInvariants, D2oBudgetsSumExactlyWithinClamps) {
  for (double ratio : {0.05, 0.1, 0.2, 0.37, 0.5, 0.9, 1.0}) {
    for (int n_prompt : {13, 64, 301}) {
      for (const char* rule : {"variance", "reciprocal", "exp", "pyramid", "uniform"}) {
        SCOPED_TRACE(std::string(rule) + " ratio " + std::to_string(ratio) + " n " +
                     std::to_string(n_prompt));
        SimSetup s;
        s.n_layer = 8;
        s.head_dim = 4;
        PolicySim sim(
            "d2o:reading=paper,ratio=" + std::to_string(ratio) + ",merge=off,layers=" + rule, s);
        sim.feed(n_prompt);
        ASSERT_EQ(sim.compact(), "");
        const int64_t n = n_prompt, lo = std::min<int64_t>(8, n);
        const int64_t want = std::llround(ratio * 8 * static_cast<double>(n));
        int64_t sum = 0;
        for (int b : sim.state.budgets) {
          EXPECT_GE(b, lo);
          EXPECT_LE(b, n);
          sum += b;
        }
        if (want >= 8 * lo) {
          EXPECT_EQ(sum, want);
        } else {
          EXPECT_EQ(sum, 8 * lo);  // infeasible: the floor wins
        }
      }
    }
  }
}

TEST(PolicyInvariants, AllocatorProportionalClampedExact) {
  std::vector<double> scratch(32);
  std::vector<int32_t> order(16);
  std::vector<int> out(8);
  // Proportional when no clamp binds: weights 1..8, total 360 -> 10, 20, ..., 80.
  std::vector<double> w = {1, 2, 3, 4, 5, 6, 7, 8};
  allocate_proportional({w.data(), 8, 360, 1, 1000}, out.data(), scratch.data(), order.data());
  for (int l = 0; l < 8; ++l) EXPECT_EQ(out[static_cast<size_t>(l)], 10 * (l + 1));
  // Upper clamp binds: the excess goes to the others in proportion.
  allocate_proportional({w.data(), 8, 360, 1, 50}, out.data(), scratch.data(), order.data());
  int sum = 0;
  for (int l = 0; l < 8; ++l) {
    EXPECT_LE(out[static_cast<size_t>(l)], 50);
    sum += out[static_cast<size_t>(l)];
  }
  EXPECT_EQ(sum, 360);
  EXPECT_EQ(out[7], 50);
  EXPECT_EQ(out[6], 50);
  // Lower clamp binds on a tiny weight.
  std::vector<double> w2 = {1e-6, 1, 1, 1, 1, 1, 1, 1};
  allocate_proportional({w2.data(), 8, 100, 8, 1000}, out.data(), scratch.data(), order.data());
  sum = 0;
  for (int x : out) sum += x;
  EXPECT_EQ(out[0], 8);
  EXPECT_EQ(sum, 100);
  // Largest remainders get the rounding: weights equal, total 10 over 8 layers -> the first two.
  std::vector<double> w3(8, 1.0);
  allocate_proportional({w3.data(), 8, 10, 0, 100}, out.data(), scratch.data(), order.data());
  EXPECT_EQ(out, (std::vector<int>{2, 2, 1, 1, 1, 1, 1, 1}));
  // Infeasible totals: the clamps win.
  allocate_proportional({w3.data(), 8, 3, 1, 100}, out.data(), scratch.data(), order.data());
  EXPECT_EQ(out, std::vector<int>(8, 1));
  allocate_proportional({w3.data(), 8, 5000, 1, 100}, out.data(), scratch.data(), order.data());
  EXPECT_EQ(out, std::vector<int>(8, 100));
}

// A budget at least the sequence length keeps the cache bit for bit identical to the full cache.
TEST(PolicyInvariants, LargeBudgetLeavesCacheUntouched) {
  for (const char* spec : {"d2o:reading=paper,budget=80", "h2o:budget=80", "roco:budget=80",
                           "streaming:budget=80,pos=shift", "snapkv:budget=80,window=4",
                           "pyramidkv:budget=80,window=4", "cam:budget=80", "keydiff:budget=80",
                           "h2o:budget=80,scorer=expected_attention",
                           "d2o:budget=80,prompt_ranking=expected,window=4"}) {
    for (KvType type : {KvType::kF32, KvType::kF16}) {
      SCOPED_TRACE(spec);
      SimSetup s;
      s.type = type;
      PolicySim sim(spec, s), full("full", s);
      for (int step = 0; step < 31; ++step) {
        sim.feed(step == 0 ? 50 : 1);
        full.feed(step == 0 ? 50 : 1);
        PassInfo pi;
        pi.n_past = sim.n_past;
        pi.rope = &sim.rope;
        ASSERT_TRUE(sim.policy->compact(sim.cache, sim.state, pi).ok());
      }
      EXPECT_FALSE(sim.state.budgets_set);
      EXPECT_EQ(sim.state.pos_shift, 0);
      for (int il = 0; il < s.n_layer; ++il) {
        const KvLayer& a = sim.cache.layer(il);
        const KvLayer& b = full.cache.layer(il);
        ASSERT_EQ(a.n_slot(), 80);
        ASSERT_EQ(a.n_slot(), b.n_slot());
        for (int g = 0; g < s.n_head_kv; ++g) {
          EXPECT_EQ(test::compare_keys(a, b, g, 80), 0);
          EXPECT_EQ(test::compare_values(a, b, g, 80), 0);
          EXPECT_EQ(std::memcmp(a.pos(g), b.pos(g),
                                80 * sizeof(int32_t)),
                    0);
        }
      }
    }
  }
}

TEST(PolicyInvariants, PeakSlotsBoundsWhatASequenceHolds) {
  struct Case {
    const char* spec;
    int n_prompt, n_total, chunk;
    bool exact;  // the bound is reached
  };
  // exact: the bound is reached (the bound assumes a pass of max_chunk tokens may come at any time,
  // and bounds variable budgets by the slot count at the first compaction).
  const std::vector<Case> cases = {
      {"h2o:budget=20", 50, 120, 1, true},
      {"h2o:budget=20", 50, 120, 7, true},
      {"h2o:budget=20", 10, 120, 4, false},
      {"streaming:budget=20", 30, 30, 30, true},
      {"h2o:ratio=0.5", 40, 100, 40, false},
      {"cam:ratio=0.25", 40, 100, 40, false},
      {"keydiff:budget=20", 50, 120, 7, true},
      {"keydiff:ratio=0.3", 40, 100, 40, false},
      {"d2o:reading=paper,budget=20", 50, 120, 7, false},
      {"d2o:reading=paper,ratio=0.3", 40, 100, 40, false},
      {"snapkv:ratio=0.5,window=4", 40, 100, 40, true},
      {"snapkv:ratio=0.5,window=4,hold=on", 40, 100, 40, false},
      {"pyramidkv:ratio=0.5,window=4,hold=on", 30, 90, 5, false},
      {"snapkv:budget=20,window=4", 40, 100, 40, false},
      {"pyramidkv:budget=20,window=4", 30, 90, 5, false},
      {"d2o:reading=paper,ratio=0.3,layers=research", 40, 100, 40, true},
      {"h2o:budget=200", 40, 100, 40, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.spec) + " chunk " + std::to_string(c.chunk));
    SimSetup s;
    s.n_layer = 6;
    PolicySim sim(c.spec, s);
    int64_t peak = 0;
    auto feed = [&](int n) {
      sim.feed(n);
      for (int il = 0; il < s.n_layer; ++il)
        peak = std::max<int64_t>(peak, sim.cache.layer(il).n_slot());
      ASSERT_EQ(sim.compact(), "");
    };
    int64_t fed = 0;
    while (fed < c.n_prompt) {
      const int n = static_cast<int>(std::min<int64_t>(c.chunk, c.n_prompt - fed));
      feed(n);
      fed += n;
    }
    while (fed < c.n_total) {
      feed(1);
      ++fed;
    }
    const int64_t bound = sim.policy->peak_slots(c.n_prompt, c.n_total, c.chunk);
    EXPECT_LE(peak, bound);
    if (c.exact) {
      EXPECT_EQ(peak, bound);
    }
  }
  EXPECT_EQ(parse_kv_policy("full").value()->peak_slots(10, 100, 1), 100);
}

TEST(PolicyInvariants, ShiftedPositionsStayContiguous) {
  SimSetup s;
  PolicySim sim("streaming:budget=12,sinks=4,pos=shift", s);
  sim.tol = 1e-4;
  for (int step = 0; step < 40; ++step) {
    ASSERT_EQ(sim.pass(step == 0 ? 30 : 1), "");
    for (int il = 0; il < s.n_layer; ++il) {
      const KvLayer& L = sim.cache.layer(il);
      for (int g = 0; g < s.n_head_kv; ++g) {
        for (int j = 0; j < L.n_slot(); ++j) EXPECT_EQ(L.pos(g)[j], j);
      }
    }
    EXPECT_EQ(sim.n_past - sim.state.pos_shift, 12);  // the next token's position
  }
  // Without the model's RoPE the shift cannot be done: a clear error, not a crash.
  PolicySim bad("streaming:budget=12,pos=shift", s);
  bad.feed(20);
  PassInfo pi;
  pi.n_past = bad.n_past;
  const Status st = bad.policy->compact(bad.cache, bad.state, pi);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("RoPE"), std::string::npos);
  RopeParams wrong = bad.rope;
  wrong.head_dim = s.head_dim * 2;
  pi.rope = &wrong;
  const Status st2 = bad.policy->compact(bad.cache, bad.state, pi);
  EXPECT_EQ(st2.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st2.message().find("head_dim"), std::string::npos);
}

// After a few steps every buffer has its size: a decode step allocates nothing, whatever the
// policy.
TEST(PolicyInvariants, SteadyStateDecodeAllocatesNothing) {
  {  // the counter sees allocations
    g_allocations = 0;
    g_count_allocations = true;
    std::vector<int> probe(100);
    g_count_allocations = false;
    ASSERT_EQ(g_allocations.load(), 1);
    // The first compaction does allocate (budgets, plans, scratch).
    PolicySim sim("d2o:reading=paper,ratio=0.3", SimSetup{});
    sim.feed(40);
    PassInfo pi;
    pi.n_past = sim.n_past;
    g_allocations = 0;
    g_count_allocations = true;
    ASSERT_TRUE(sim.policy->compact(sim.cache, sim.state, pi).ok());
    g_count_allocations = false;
    EXPECT_GT(g_allocations.load(), 0);
  }
  for (const char* spec :
       {"d2o:reading=paper,ratio=0.3", "d2o:budget=20,sim=kv,reading=research",
        "h2o:budget=16,norm=queries", "streaming:budget=12,pos=shift", "snapkv:budget=16,window=4",
        "cam:ratio=0.3", "pyramidkv:budget=16,window=4", "keydiff:ratio=0.3",
        "keydiff:budget=16,recent=4", "h2o:budget=16,heads=ada",
        "d2o:reading=paper,ratio=0.3,heads=ada", "snapkv:budget=16,window=4,heads=ada",
        "h2o:budget=16,scorer=expected_attention,window=8",
        "h2o:ratio=0.3,scorer=expected_attention,heads=ada",
        "d2o:ratio=0.3,prompt_ranking=expected,window=4,scorer=expected_attention"}) {
    for (KvType type : {KvType::kF32, KvType::kF16}) {
      SCOPED_TRACE(spec);
      SimSetup s;
      s.type = type;
      PolicySim sim(spec, s);
      PassInfo pi;
      pi.rope = &sim.rope;
      int64_t allocations = 0;
      for (int step = 0; step < 60; ++step) {
        sim.feed(step == 0 ? 40 : 1);
        pi.n_past = sim.n_past;
        g_allocations = 0;
        g_count_allocations = true;
        const Status st = sim.policy->compact(sim.cache, sim.state, pi);
        g_count_allocations = false;
        ASSERT_TRUE(st.ok());
        if (step >= 20) allocations += g_allocations.load();
      }
      EXPECT_EQ(allocations, 0);
    }
  }
}

TEST(PolicyInvariants, StateFromAnotherCacheIsRejected) {
  SimSetup s;
  PolicySim sim("d2o:reading=paper,ratio=0.3", s);
  ASSERT_EQ(sim.pass(30), "");
  KvCache other(KvCacheConfig{s.n_layer + 1, s.n_head_kv, s.head_dim, s.type});
  PassInfo pi;
  pi.n_past = 30;
  const Status st = sim.policy->compact(other, sim.state, pi);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("layers"), std::string::npos);
}

TEST(PolicyInvariants, SimilarityKernelsMatchDoubleReference) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    for (int dim : {1, 7, 16, 20, 64, 67}) {
      for (bool f16 : {false, true}) {
        SCOPED_TRACE(std::string(kernel_isa_name(isa)) + " dim " + std::to_string(dim) +
                     (f16 ? " f16" : " f32"));
        const int rows = 9;
        const size_t rb =
            static_cast<size_t>(dim) * (f16 ? 2 : 4) + 6;  // odd stride: misaligned rows
        std::vector<uint8_t> buf(rb * rows + 3);
        uint8_t* base = buf.data() + 1;
        std::vector<float> ref(static_cast<size_t>(rows) * dim), q(static_cast<size_t>(dim));
        for (float& x : q) x = nd(rng);
        for (int r = 0; r < rows; ++r) {
          for (int d = 0; d < dim; ++d) {
            const float x = r == 3 ? 0.0f : nd(rng);  // row 3 is a zero row
            uint8_t* p = base + static_cast<size_t>(r) * rb;
            if (f16) {
              const uint16_t h = fp32_to_fp16(x);
              std::memcpy(p + 2 * d, &h, 2);
              ref[static_cast<size_t>(r) * dim + d] = fp16_to_fp32(h);
            } else {
              std::memcpy(p + 4 * d, &x, 4);
              ref[static_cast<size_t>(r) * dim + d] = x;
            }
          }
        }
        const std::vector<int32_t> idx = {8, 0, 3, 3, 5};
        std::vector<float> dot(idx.size()), inv(idx.size());
        RowDots a;
        a.base = base;
        a.row_bytes = rb;
        a.f16 = f16;
        a.dim = dim;
        a.rows = idx.data();
        a.n = static_cast<int>(idx.size());
        a.q = q.data();
        a.dot = dot.data();
        a.inv_norm = inv.data();
        row_dots_isa(isa, a);
        for (size_t i = 0; i < idx.size(); ++i) {
          double want = 0, want_n = 0;
          for (int d = 0; d < dim; ++d) {
            const double x = ref[static_cast<size_t>(idx[i]) * dim + d];
            want += q[static_cast<size_t>(d)] * x;
            want_n += x * x;
          }
          EXPECT_NEAR(dot[i], want, 1e-5 * std::max(1.0, std::sqrt(want_n) * dim));
          EXPECT_NEAR(inv[i], want_n > 0 ? 1.0 / std::sqrt(want_n) : 0.0,
                      1e-5 / std::max(1e-3, std::sqrt(want_n)));
        }
      }
    }
  }
}

// Several queries a row load (row_dots_queries, the cold tier's scoring) give each dot the bits
// row_dots gives it for its query alone, times the scale: the recall ranks the same slots either
// way. Row counts around the blocks (fewer than four, not a multiple of four or eight), query
// counts around them, head sizes the blocked loops take and ones they leave to row_dots.
TEST(PolicyInvariants, SeveralQueriesGiveEachDotRowDotsBits) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    for (int dim : {8, 24, 64, 256}) {
      for (int rows : {1, 3, 4, 13, 64}) {
        for (int n_q : {1, 2, 5, 9}) {
          SCOPED_TRACE(std::string(kernel_isa_name(isa)) + " dim " + std::to_string(dim) +
                       " rows " + std::to_string(rows) + " queries " + std::to_string(n_q));
          std::vector<float> keys(static_cast<size_t>(rows) * dim);
          std::vector<float> qs(static_cast<size_t>(n_q) * dim);
          for (float& x : keys) x = nd(rng);
          for (float& x : qs) x = nd(rng);
          const float scale = 0.125f * (1.0f + 0.01f * static_cast<float>(dim));
          RowDots a;
          a.base = reinterpret_cast<const uint8_t*>(keys.data());
          a.row_bytes = sizeof(float) * static_cast<size_t>(dim);
          a.dim = dim;
          a.n = rows;
          const size_t ld = static_cast<size_t>(rows) + 3;  // rows of the output apart
          std::vector<float> got(static_cast<size_t>(n_q) * ld, -1.0f);
          row_dots_queries_isa(isa, a, qs.data(), static_cast<size_t>(dim), n_q, scale, got.data(),
                               ld);
          std::vector<float> want(static_cast<size_t>(rows));
          for (int j = 0; j < n_q; ++j) {
            RowDots one = a;
            one.q = qs.data() + static_cast<size_t>(j) * dim;
            one.dot = want.data();
            row_dots_isa(isa, one);
            for (int r = 0; r < rows; ++r) {
              const float w = want[static_cast<size_t>(r)] * scale;
              const float g = got[static_cast<size_t>(j) * ld + r];
              ASSERT_EQ(std::memcmp(&w, &g, sizeof w), 0)
                  << "query " << j << " row " << r << ": " << g << " against " << w;
            }
            for (size_t r = static_cast<size_t>(rows); r < ld; ++r)
              EXPECT_EQ(got[static_cast<size_t>(j) * ld + r], -1.0f);  // nothing beyond the rows
          }
        }
      }
    }
  }
}

// Seconds of CPU time of this thread: unaffected by other processes taking the (shared) cores.
double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The cost of one D2O decode step on a SmolLM2-135M-shaped cache (30 layers, 3 KV heads,
// head_dim 64, 1638 slots per head on average). "bookkeeping" is the policy's own work per head
// (selection of the slot to evict, cosine similarity of the evicted key to every kept key, the
// threshold and the merge plan); "compact" adds KvCache::apply (the merge and the gather that
// closes the gap). Printed for the report; timing is never asserted.
TEST(PolicyInvariants, D2oDecodeStepCost) {
  ThreadPool pool(2);
  for (KvType type : {KvType::kF16, KvType::kF32}) {
    SimSetup s;
    s.n_layer = 30;
    s.n_head_kv = 3;
    s.head_dim = 64;
    s.type = type;
    PolicySim sim("d2o:reading=paper,budget=1638", s);
    sim.feed(1639);
    PassInfo pi;
    pi.n_past = sim.n_past;
    ASSERT_TRUE(sim.policy->compact(sim.cache, sim.state, pi).ok());
    const PolicyConfig& cfg = sim.ref_cfg;
    const int steps = 20;
    std::vector<double> book, compact_cpu, compact_wall, pooled_wall;
    std::vector<int32_t> keep(4096), scratch(4096), evicted(4096);
    // The bookkeeping alone runs on its own buffers and a copy of the thresholds.
    D2oScratch sc;
    CompactionPlan plan;
    std::vector<float> tau;
    std::vector<uint8_t> ready;
    for (int step = 0; step < 2 * steps; ++step) {
      sim.feed(1);
      pi.n_past = sim.n_past;
      pi.pool = step < steps ? nullptr : &pool;
      tau = test::d2o_tau(sim.state);
      ready = test::d2o_tau_ready(sim.state);
      double t0 = thread_seconds();
      for (int il = 0; il < s.n_layer && step < steps; ++il) {
        const KvLayer& L = sim.cache.layer(il);
        const int S = sim.state.budgets[static_cast<size_t>(il)];
        if (L.n_slot() <= S) continue;
        plan.merges.clear();
        for (int g = 0; g < L.n_head_kv(); ++g) {
          select_heavy_recent(L.score(g), L.n_slot(), S, cfg, keep.data(),
                              scratch.data());
          int ne = 0;
          for (int j = 0, k = 0; j < L.n_slot(); ++j) {
            if (k < S && keep[static_cast<size_t>(k)] == j) {
              ++k;
            } else {
              evicted[static_cast<size_t>(ne++)] = j;
            }
          }
          D2oHeadMerge h;
          h.cfg = &cfg;
          h.layer = &L;
          h.head = g;
          h.keep = keep.data();
          h.n_keep = S;
          h.evicted = evicted.data();
          h.n_evicted = ne;
          h.tau = &tau[static_cast<size_t>(il * L.n_head_kv() + g)];
          h.tau_ready = &ready[static_cast<size_t>(il * L.n_head_kv() + g)];
          plan_d2o_merges(h, sc, plan.merges);
        }
      }
      if (step < steps) book.push_back(thread_seconds() - t0);
      t0 = thread_seconds();
      const auto w0 = std::chrono::steady_clock::now();
      ASSERT_TRUE(sim.policy->compact(sim.cache, sim.state, pi).ok());
      const double wall =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      if (step < steps) {
        compact_cpu.push_back(thread_seconds() - t0);
        compact_wall.push_back(wall);
      } else {
        pooled_wall.push_back(wall);
      }
    }
    auto median_ms = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return 1e3 * v[v.size() / 2];
    };
    std::printf(
        "[ perf ] D2O decode step, %s cache, 30 layers x 3 KV heads x ~1638 slots, %s, median per "
        "step: bookkeeping %.3f ms CPU; compact (with KvCache::apply) %.3f ms CPU, %.3f ms wall; "
        "compact with a 2-thread pool %.3f ms wall\n",
        kv_type_name(type), kernel_isa_name(best_kernel_isa()), median_ms(book),
        median_ms(compact_cpu), median_ms(compact_wall), median_ms(pooled_wall));
  }
}

// compact_layer() for every layer after a one-token pass, then compact(), leaves exactly the
// cache and state that compact() alone leaves (the engine compacts decode steps of batched
// sequences layer by layer, right after each layer's attention), with a pool (a sequence decoding
// alone: the layer's heads planned and gathered in parallel) as without.
TEST(PolicyInvariants, LayerwiseCompactionEqualsWholePass) {
  ThreadPool pool(2);
  for (const char* spec :
       {"d2o:reading=paper,ratio=0.3", "d2o:reading=paper,budget=16",
        "d2o:reading=paper,ratio=0.3,layers=research", "h2o:ratio=0.25", "roco:budget=12",
        "cam:ratio=0.3", "streaming:budget=10", "snapkv:budget=12,window=4",
        "snapkv:ratio=0.3,window=4,hold=on", "keydiff:budget=12,sinks=1",
        "d2o:reading=paper,budget=16,heads=ada", "snapkv:budget=12,window=4,heads=ada",
        "d2o:reading=paper,budget=16,decide=token",
        "d2o:reading=paper,ratio=0.3,mass=on,merge=sized,nm=1:1",
        "d2o:reading=paper,budget=16,sim=kv", "h2o:budget=12,scorer=expected_attention,window=6",
        "d2o:ratio=0.3,prompt_ranking=expected,window=4,scorer=expected_attention"}) {
    SCOPED_TRACE(spec);
    SimSetup s;
    s.n_layer = 5;
    s.n_head_kv = 3;  // three heads on two threads
    s.n_head = 6;     // statistics from real attention
    PolicySim a(spec, s), b(spec, s), c(spec, s);
    for (PolicySim* x : {&a, &b, &c}) {
      x->feed(40);
      ASSERT_EQ(x->compact(), "");
    }
    ASSERT_TRUE(b.policy->compacts_per_layer(b.state));
    auto same = [&](const PolicySim& p, const PolicySim& q, int step) {
      for (int il = 0; il < s.n_layer; ++il) {
        const KvLayer& x = p.cache.layer(il);
        const KvLayer& y = q.cache.layer(il);
        ASSERT_EQ(x.n_slot(), y.n_slot()) << "step " << step << " layer " << il;
        for (int g = 0; g < x.n_head_kv(); ++g) {
          ASSERT_EQ(x.n_slot(g), y.n_slot(g));
          const size_t n = static_cast<size_t>(x.n_slot(g));
          ASSERT_EQ(0, test::compare_keys(x, y, g, n));
          ASSERT_EQ(0, test::compare_values(x, y, g, n));
          for (int j = 0; j < x.n_slot(g); ++j) {
            ASSERT_EQ(x.pos(g)[j], y.pos(g)[j]);
            ASSERT_EQ(x.score(g)[j], y.score(g)[j]);
            ASSERT_EQ(x.merged(g)[j], y.merged(g)[j]);
          }
        }
      }
      ASSERT_EQ(p.state.evicted, q.state.evicted);
      ASSERT_EQ(p.state.merged, q.state.merged);
      ASSERT_EQ(test::d2o_tau(p.state), test::d2o_tau(q.state));
      ASSERT_EQ(p.state.n_compactions, q.state.n_compactions);
    };
    for (int step = 0; step < 30; ++step) {
      for (PolicySim* x : {&a, &b, &c}) x->feed(1);
      ASSERT_EQ(a.compact(), "") << "step " << step;
      for (PolicySim* x : {&b, &c}) {
        PassInfo pi;
        pi.n_tokens = 1;
        pi.n_past = x->n_past;
        pi.rope = &x->rope;
        pi.pool = x == &c ? &pool : nullptr;
        for (int il = 0; il < s.n_layer; ++il)
          ASSERT_TRUE(x->policy->compact_layer(x->cache, x->state, pi, il).ok());
        pi.pool = nullptr;
        ASSERT_TRUE(x->policy->compact(x->cache, x->state, pi).ok());
      }
      same(a, b, step);
      same(a, c, step);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  // Position shifting moves every layer's positions once per pass: never layer by layer.
  PolicySim sh("streaming:budget=10,pos=shift", SimSetup{});
  sh.feed(40);
  ASSERT_EQ(sh.compact(), "");
  EXPECT_FALSE(sh.policy->compacts_per_layer(sh.state));
  PassInfo pi;
  pi.n_past = sh.n_past;
  EXPECT_FALSE(sh.policy->compact_layer(sh.cache, sh.state, pi, 0).ok());
  // Before the first compaction (budgets not decided) neither.
  PolicySim fresh("d2o:reading=paper,ratio=0.3", SimSetup{});
  fresh.feed(10);
  EXPECT_FALSE(fresh.policy->compacts_per_layer(fresh.state));
}

}  // namespace
}  // namespace d2o
