// The decode step's policy kernels: the vectorised scan for the slot a one-slot eviction removes
// (same index as the scalar scan on every instruction-set level), the dots-only similarity pass
// (the bits of the pass with norms), and D2O's cached key norms (ComposedPolicyState::key_inv):
// a cached norm is the bits d2o_key_inv_norms forms from the key as it is now, and a state whose
// norms were dropped (a restored session) goes on to the same cache bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/fp16.h"
#include "kv/policy/merge_d2o.h"
#include "kv/policy/similarity.h"
#include "unit/policy_sim.h"

namespace d2o::test {
namespace {

TEST(DecodeStepKernels, LastMinIndexIsTheScalarScanOnEveryIsa) {
  std::mt19937 rng(9);
  // Few distinct values, so that ties are common; signed zeros, infinity and NaN among them.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> vals = {0.0f, -0.0f, 0.5f, 0.25f, 1.0f, 3.0f, inf, nan};
  std::uniform_int_distribution<size_t> pick(0, vals.size() - 1);
  std::uniform_int_distribution<int> len(1, 70);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int n = len(rng);
    std::vector<float> s(static_cast<size_t>(n));
    for (float& x : s) x = vals[pick(rng)];
    if (trial % 5 == 0) s[0] = vals[pick(rng) % 6];  // often a number first
    int want = 0;
    for (int j = 1; j < n; ++j)
      if (s[static_cast<size_t>(j)] <= s[static_cast<size_t>(want)]) want = j;
    for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
      if (!kernel_isa_available(isa)) continue;
      ASSERT_EQ(last_min_index_isa(isa, s.data(), n), want)
          << kernel_isa_name(isa) << " trial " << trial << " n " << n;
      ++checked;
    }
  }
  EXPECT_GE(checked, 3000);  // every trial ran (at least the scalar level)
}

// Mean attention (norm=queries): every level gives the bits of the definition, one division of the
// score by the count of queries as a float, counts past 2^24 (rounded to a float) and the clamp to
// 1 (a slot at or past `next`) included, at lengths around every vector width.
TEST(DecodeStepKernels, MeanAttentionIsTheDefinitionOnEveryIsa) {
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> score(0.0f, 40.0f);
  int checked = 0;
  for (int64_t next : {int64_t{1}, int64_t{300}, int64_t{70000}, int64_t{40000001},
                       int64_t{2147483647}, int64_t{3000000000}}) {
    for (int n : {0, 1, 7, 8, 9, 15, 16, 17, 33, 100}) {
      std::uniform_int_distribution<int64_t> at(0, std::min<int64_t>(next + 2, INT32_MAX));
      std::vector<float> s(static_cast<size_t>(n));
      std::vector<int32_t> pos(static_cast<size_t>(n));
      for (int j = 0; j < n; ++j) {
        s[static_cast<size_t>(j)] = j % 5 == 0 ? 0.0f : score(rng);
        pos[static_cast<size_t>(j)] = static_cast<int32_t>(at(rng));
      }
      std::vector<float> want(static_cast<size_t>(n));
      for (int j = 0; j < n; ++j) {
        const int64_t seen = std::max<int64_t>(1, next - pos[static_cast<size_t>(j)]);
        want[static_cast<size_t>(j)] = s[static_cast<size_t>(j)] / static_cast<float>(seen);
      }
      for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
        if (!kernel_isa_available(isa)) continue;
        std::vector<float> got(static_cast<size_t>(n) + 1, -1.0f);
        mean_attention_isa(isa, s.data(), pos.data(), n, next, got.data());
        if (n > 0) {
          EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
              << kernel_isa_name(isa) << " next " << next << " n " << n;
        }
        EXPECT_EQ(got[static_cast<size_t>(n)], -1.0f) << "wrote past n";
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 60);
}

// The fused index: last_min_index of what mean_attention writes, on every level, with ties (few
// distinct scores and positions), zeros, infinities, NaN, counts clamped to 1 and past 2^31.
TEST(DecodeStepKernels, LastMinMeanIndexIsTheIndexOfTheMeans) {
  std::mt19937 rng(21);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> vals = {0.0f, 0.5f, 1.0f, 2.0f, 3.0f, 6.0f, inf, nan};
  std::uniform_int_distribution<size_t> pick(0, vals.size() - 1);
  std::uniform_int_distribution<int> len(1, 70);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int n = len(rng);
    const int64_t next = trial % 7 == 0 ? int64_t{3000000000} : int64_t{40} + trial % 9;
    std::uniform_int_distribution<int32_t> at(30, 42);  // some at or past next: count 1
    std::vector<float> s(static_cast<size_t>(n)), mean(static_cast<size_t>(n));
    std::vector<int32_t> pos(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      s[static_cast<size_t>(j)] = vals[trial % 3 == 0 ? pick(rng) : pick(rng) % 6];
      pos[static_cast<size_t>(j)] = at(rng);
    }
    mean_attention_isa(KernelIsa::kScalar, s.data(), pos.data(), n, next, mean.data());
    const int want = last_min_index_isa(KernelIsa::kScalar, mean.data(), n);
    for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
      if (!kernel_isa_available(isa)) continue;
      ASSERT_EQ(last_min_mean_index_isa(isa, s.data(), pos.data(), n, next), want)
          << kernel_isa_name(isa) << " trial " << trial << " n " << n;
      ++checked;
    }
  }
  EXPECT_GE(checked, 3000);
}

// `rows` rows of `dim` elements, F16 or F32, row r at byte 1 + r * *rb (odd addresses, a gap
// after each row), element d of row r from gen(r, d).
template <class Gen>
std::vector<uint8_t> odd_rows(int rows, int dim, bool f16, size_t* rb, Gen gen) {
  *rb = static_cast<size_t>(dim) * (f16 ? 2 : 4) + 2;
  std::vector<uint8_t> buf(*rb * rows + 1);
  for (int r = 0; r < rows; ++r) {
    uint8_t* p = buf.data() + 1 + static_cast<size_t>(r) * *rb;
    for (int d = 0; d < dim; ++d) {
      const float x = gen(r, d);
      if (f16) {
        const uint16_t h = fp32_to_fp16(x);
        std::memcpy(p + 2 * d, &h, 2);
      } else {
        std::memcpy(p + 4 * d, &x, 4);
      }
    }
  }
  return buf;
}

// row_dots' arguments for rows idx[0..n) of an odd_rows buffer against q: dots into dot, inverse
// norms into inv (null: none).
RowDots odd_row_dots(const std::vector<uint8_t>& buf, size_t rb, bool f16, int dim,
                     const int32_t* idx, int n, const float* q, float* dot, float* inv) {
  RowDots a;
  a.base = buf.data() + 1;
  a.row_bytes = rb;
  a.f16 = f16;
  a.dim = dim;
  a.rows = idx;
  a.n = n;
  a.q = q;
  a.dot = dot;
  a.inv_norm = inv;
  return a;
}

TEST(D2oKeyNorms, DotsOnlyAreTheBitsOfThePassWithNorms) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    for (int dim : {7, 16, 20, 64, 67}) {
      for (bool f16 : {false, true}) {
        const int rows = 23;  // groups of eight, a group of four and a tail
        size_t rb = 0;
        const std::vector<uint8_t> buf =
            odd_rows(rows, dim, f16, &rb, [&](int, int) { return nd(rng); });
        std::vector<float> q(static_cast<size_t>(dim));
        for (float& x : q) x = nd(rng);
        for (int n = 1; n <= rows; ++n) {
          SCOPED_TRACE(std::string(kernel_isa_name(isa)) + " dim " + std::to_string(dim) +
                       (f16 ? " f16" : " f32") + " n " + std::to_string(n));
          std::vector<int32_t> idx(static_cast<size_t>(n));
          for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 7) % rows;
          std::vector<float> with(static_cast<size_t>(n)), inv(with.size()), only(with.size());
          RowDots a =
              odd_row_dots(buf, rb, f16, dim, idx.data(), n, q.data(), with.data(), inv.data());
          row_dots_isa(isa, a);
          a.dot = only.data();
          a.inv_norm = nullptr;
          row_dots_isa(isa, a);
          ASSERT_EQ(0, std::memcmp(with.data(), only.data(), sizeof(float) * with.size()));
        }
      }
    }
  }
}

TEST(D2oKeyNorms, OneRowNormIsTheFourRowLoopBitsOnEveryIsa) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    for (int dim : {1, 7, 8, 16, 20, 33, 64, 67, 128}) {
      for (bool f16 : {false, true}) {
        // Rows 0-3 random, 4 zero, 5 tiny (a squared norm below 1e-30 in F32), 6-7 random.
        constexpr int kRows = 8;
        size_t rb = 0;
        const std::vector<uint8_t> buf = odd_rows(kRows, dim, f16, &rb, [&](int r, int) {
          const float x = r == 4 ? 0.0f : nd(rng);
          return r == 5 ? (f16 ? 1e-3f : 1e-17f) * x : x;
        });
        SCOPED_TRACE(std::string(kernel_isa_name(isa)) + " dim " + std::to_string(dim) +
                     (f16 ? " f16" : " f32"));
        std::vector<float> q(static_cast<size_t>(dim), 0.0f), dot(kRows), inv(kRows);
        std::vector<int32_t> idx = {3, 1, 4, 0, 5, 7, 2, 6};  // two groups of four, any order
        const RowDots a =
            odd_row_dots(buf, rb, f16, dim, idx.data(), kRows, q.data(), dot.data(), inv.data());
        row_dots_isa(isa, a);
        for (int r = 0; r < kRows; ++r) {
          const float one = row_inv_norm_isa(isa, a, r);
          EXPECT_EQ(0, std::memcmp(&one, &inv[static_cast<size_t>(r)], sizeof(float)))
              << "row " << idx[static_cast<size_t>(r)] << ": " << one << " vs " << inv[r];
        }
        EXPECT_EQ(row_inv_norm_isa(isa, a, 2), 0.0f);  // the zero row
      }
    }
  }
}

TEST(D2oKeyNorms, NormOfASlotIsTheFourRowPassBitsWhereverItSits) {
  for (KvType type : {KvType::kF32, KvType::kF16, KvType::kQ8_0}) {
    SCOPED_TRACE(kv_type_name(type));
    SimSetup s;
    s.n_layer = 1;
    s.n_head_kv = 2;
    s.head_dim = 64;
    s.type = type;
    PolicySim sim("h2o:budget=100", s);
    sim.feed(13);
    const KvLayer& L = sim.cache.layer(0);
    for (int g = 0; g < 2; ++g) {
      // row_dots forms the norms of rows 0..11 in its four-row loop.
      std::vector<float> zero(64, 0.0f), dot(12), inv(12), all(13), one(1);
      RowDots a;
      a.base = L.key_base(g);
      a.map = L.rows(g);
      a.row_bytes = L.key_row_bytes();
      a.f16 = type == KvType::kF16;
      if (kv_quantized(type.k)) a.quant = kv_ggml_type(type.k);
      a.dim = 64;
      a.n = 12;
      a.q = zero.data();
      a.dot = dot.data();
      a.inv_norm = inv.data();
      row_dots(a);
      d2o_key_inv_norms(L, g, 0, 13, all.data());
      for (int j = 0; j < 12; ++j) {
        d2o_key_inv_norms(L, g, j, 1, one.data());
        EXPECT_EQ(0, std::memcmp(&inv[static_cast<size_t>(j)], &one[0], sizeof(float))) << j;
        EXPECT_EQ(0, std::memcmp(&inv[static_cast<size_t>(j)], &all[static_cast<size_t>(j)],
                                 sizeof(float)))
            << j;
        EXPECT_GT(one[0], 0.0f);
      }
    }
  }
}

// Every cached list holds the norms of the keys its head holds now (of its first slots: a head
// that evicted nothing in the last compaction, heads=ada, has new slots its list does not cover
// yet); returns how many lists were checked.
int check_cached_norms(const PolicySim& sim) {
  const D2oMergeState* own = d2o_merge_state(sim.state);
  if (!own) return 0;
  int checked = 0;
  const size_t G = static_cast<size_t>(sim.cache.config().n_head_kv);
  for (size_t i = 0; i < own->key_inv.size(); ++i) {
    const KvLayer& L = sim.cache.layer(static_cast<int>(i / G));
    const int g = static_cast<int>(i % G);
    const std::vector<float>& inv = own->key_inv[i];
    if (inv.empty()) continue;
    EXPECT_LE(static_cast<int>(inv.size()), L.n_slot(g));
    if (static_cast<int>(inv.size()) > L.n_slot(g)) continue;
    std::vector<float> want(inv.size());
    d2o_key_inv_norms(L, g, 0, static_cast<int>(inv.size()), want.data());
    EXPECT_EQ(0, std::memcmp(want.data(), inv.data(), sizeof(float) * want.size())) << "list " << i;
    ++checked;
  }
  return checked;
}

TEST(D2oKeyNorms, CachedNormsFollowEvictionsAndMerges) {
  for (const char* spec :
       {"d2o:reading=paper,budget=12", "d2o:reading=paper,ratio=0.3,decide=token",
        "d2o:reading=paper,budget=10,nm=1:1", "d2o:reading=paper,budget=12,heads=ada"}) {
    for (KvType type : {KvType::kF32, KvType::kF16}) {
      SCOPED_TRACE(std::string(spec) + " " + kv_type_name(type));
      SimSetup s;
      s.n_layer = 3;
      s.n_head_kv = 2;
      s.head_dim = 20;
      s.type = type;
      PolicySim sim(spec, s);
      ASSERT_EQ(sim.pass(40), "");
      int checked = 0;
      for (int step = 0; step < 40; ++step) {
        // Mostly one token (the decode step), sometimes two or three (a few evictions at once).
        ASSERT_EQ(sim.pass(step % 9 == 4 ? 3 : step % 7 == 3 ? 2 : 1), "") << "step " << step;
        checked += check_cached_norms(sim);
      }
      EXPECT_GT(checked, 0);  // the decode steps did keep norms
      int64_t merged = 0;
      for (int64_t m : sim.state.merged) merged += m;
      EXPECT_GT(merged, 0);
    }
  }
}

TEST(D2oKeyNorms, DroppedNormsGiveTheSameCache) {
  SimSetup s;
  s.n_layer = 3;
  s.n_head_kv = 2;
  s.head_dim = 64;
  s.type = KvType::kF16;
  PolicySim a("d2o:reading=paper,budget=16", s), b("d2o:reading=paper,budget=16", s);
  ASSERT_EQ(a.pass(48), "");
  ASSERT_EQ(b.pass(48), "");
  for (int step = 0; step < 30; ++step) {
    ASSERT_EQ(a.pass(1), "");
    if (step % 10 == 5) {  // as a state read back from a session file: no norms kept
      auto& merger = *b.state.ext_as<ComposedPolicyState>().merger;
      for (std::vector<float>& inv : d2o_merge_state(&merger)->key_inv) inv.clear();
    }
    ASSERT_EQ(b.pass(1), "");
    for (int il = 0; il < s.n_layer; ++il) {
      const KvLayer& x = a.cache.layer(il);
      const KvLayer& y = b.cache.layer(il);
      for (int g = 0; g < x.n_head_kv(); ++g) {
        ASSERT_EQ(x.n_slot(g), y.n_slot(g));
        const size_t n = static_cast<size_t>(x.n_slot(g));
        ASSERT_EQ(0, std::memcmp(x.key_row(g, 0), y.key_row(g, 0), x.key_row_bytes() * n));
        ASSERT_EQ(0, std::memcmp(x.value_row(g, 0), y.value_row(g, 0), x.value_row_bytes() * n));
        ASSERT_EQ(0, std::memcmp(x.pos(g), y.pos(g), sizeof(int32_t) * n));
      }
    }
    ASSERT_EQ(test::d2o_tau(a.state), test::d2o_tau(b.state));
  }
}

// The D2oState tests' cache: three layers of two F16 KV heads of 64.
SimSetup three_layer_f16() {
  SimSetup s;
  s.n_layer = 3;
  s.n_head_kv = 2;
  s.head_dim = 64;
  s.type = KvType::kF16;
  return s;
}

// A prompt's compaction plans a merge term per merged slot and searches with the unit rows of
// every kept key; what a sequence holds afterwards must not stay sized by its prompt.
TEST(D2oState, APromptsCompactionLeavesNothingSizedByThePrompt) {
  const SimSetup s = three_layer_f16();
  PolicySim sim("d2o:reading=paper,budget=16", s);
  ASSERT_EQ(sim.pass(600), "");  // 584 evicted per head, merged into 16 slots
  ASSERT_GT(sim.state.merged[0], 64);
  const ComposedPolicyState* own = composed_state(sim.state);
  ASSERT_NE(own, nullptr);
  EXPECT_TRUE(own->scratch.empty());
  for (const CompactionPlan& p : sim.state.plans) EXPECT_EQ(p.merges.capacity(), 0u);
  // Decoding goes on (and its small scratch is formed again), with the reference.
  for (int step = 0; step < 5; ++step) ASSERT_EQ(sim.pass(1), "");
}

// So does a pass that evicts more than a decode step and fewer than a prompt (a new turn of a
// conversation): its merge terms and its search over the unit rows of the kept keys.
TEST(D2oState, ANewTurnsCompactionLeavesNothingSizedByIt) {
  const SimSetup s = three_layer_f16();
  PolicySim sim("d2o:reading=paper,budget=16", s);
  ASSERT_EQ(sim.pass(48), "");
  for (int step = 0; step < 3; ++step) ASSERT_EQ(sim.pass(1), "");
  const int64_t merged = sim.state.merged[0];
  ASSERT_EQ(sim.pass(12), "");  // 12 evicted per head: more than a decode step's few
  ASSERT_GT(sim.state.merged[0], merged);
  const ComposedPolicyState* own = composed_state(sim.state);
  ASSERT_NE(own, nullptr);
  EXPECT_TRUE(own->scratch.empty());
  for (const CompactionPlan& p : sim.state.plans) {
    EXPECT_LE(p.merges.capacity(), ComposedPolicy::kKeptTermsPerHead * s.n_head_kv);
  }
  for (int step = 0; step < 5; ++step) ASSERT_EQ(sim.pass(1), "");
}

// What a memory pool reserves for a policy's own lists (KvPolicy::state_bytes) covers what the
// state holds while decoding: every composed policy's plans (kept slots, a decode step's merge
// terms), and D2O's key norms, probe and thresholds.
size_t plans_held(const PolicyState& state) {
  size_t b = 0;
  for (const CompactionPlan& p : state.plans) {
    b += (p.keep.capacity() + p.head_keep.capacity() + p.head_off.capacity()) * sizeof(int32_t);
    b += p.merges.capacity() * sizeof(MergeTerm);
  }
  return b;
}

TEST(D2oState, ItsPerSlotListsFitWhatItReserves) {
  const SimSetup s = three_layer_f16();
  PolicySim sim("d2o:reading=paper,budget=16", s);
  ASSERT_EQ(sim.pass(48), "");
  for (int step = 0; step < 20; ++step) ASSERT_EQ(sim.pass(1), "");
  const D2oMergeState* own = d2o_merge_state(sim.state);
  ASSERT_NE(own, nullptr);
  size_t held = own->tau.capacity() * sizeof(float) + own->tau_ready.capacity();
  size_t norms = 0;
  for (const std::vector<float>& inv : own->key_inv) norms += inv.capacity() * sizeof(float);
  ASSERT_GT(norms, 0u);  // the decode steps kept norms
  held += norms + own->probe.slot.capacity() * sizeof(int32_t) +
          (own->probe.dot.capacity() + own->probe.key.capacity()) * sizeof(float);
  ASSERT_GT(sim.state.merged[0], 0);  // the decode steps merged: their plans hold merge terms
  const size_t plans = plans_held(sim.state);
  ASSERT_GT(plans, 0u);
  held += plans;
  const size_t reserved = sim.policy->state_bytes(sim.cache.config(), 16);
  EXPECT_LE(held, reserved);
  EXPECT_GE(reserved, static_cast<size_t>(s.n_layer * s.n_head_kv * 17) * sizeof(float));
}

TEST(D2oState, EveryComposedPolicysPlansFitWhatItReserves) {
  const SimSetup s = three_layer_f16();
  for (const char* spec : {"h2o:budget=16", "streaming:budget=16", "snapkv:budget=16,window=4",
                           "h2o:budget=16,heads=ada", "keydiff:budget=16"}) {
    SCOPED_TRACE(spec);
    PolicySim sim(spec, s);
    ASSERT_EQ(sim.pass(48), "");
    for (int step = 0; step < 20; ++step) ASSERT_EQ(sim.pass(1), "");
    const size_t held = plans_held(sim.state);
    ASSERT_GT(held, 0u);
    EXPECT_LE(held, sim.policy->state_bytes(sim.cache.config(), 16));
  }
}

}  // namespace
}  // namespace d2o::test
