// A simulated sequence for the policy tests: a real KvCache + PolicyState driven by a policy, and
// the naive re-implementation (policy_naive.h) fed the same inputs at every pass.
//
// Each pass appends n_tok tokens with random keys and values to every layer, adds random
// attention mass to every slot's accumulated score (heavier-tailed in deeper layers, so layers
// differ in density), draws fresh window statistics (SnapKV), then compacts both and compares.
// With n_head > 0 the statistics come from the real attention kernel (attention_reference) run
// with random queries for n_head query heads, as the engine asks for them (policy->needs()).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>

#include "core/thread_pool.h"
#include "kv/attention.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "kv/policy/composed.h"
#include "ops/ops.h"
#include "unit/kv_test_access.h"
#include "unit/policy_naive.h"

namespace d2o::test {

struct SimSetup {
  int n_layer = 4;
  int n_head_kv = 2;
  int head_dim = 16;
  KvType type = KvType::kF32;
  uint32_t seed = 1;
  int n_head = 0;  // > 0: statistics from attention with this many query heads
};

// D2O's merge thresholds of a sequence's state (empty without a D2O merger state).
inline std::vector<float> d2o_tau(const PolicyState& s) {
  const D2oMergeState* d = d2o_merge_state(s);
  return d ? d->tau : std::vector<float>{};
}
inline std::vector<uint8_t> d2o_tau_ready(const PolicyState& s) {
  const D2oMergeState* d = d2o_merge_state(s);
  return d ? d->tau_ready : std::vector<uint8_t>{};
}

inline const char* layout_name(int n_head_kv) {
  return n_head_kv == 1 ? "MQA" : n_head_kv == 2 ? "GQA" : "MHA";
}

class PolicySim {
 public:
  PolicySim(const std::string& spec, const SimSetup& s)
      : setup(s), cache(KvCacheConfig{s.n_layer, s.n_head_kv, s.head_dim, s.type}), rng(s.seed) {
    auto p = parse_kv_policy(spec);
    EXPECT_TRUE(p.ok()) << p.status().message();
    if (p.ok()) policy = std::move(p).value();
    if (auto* cp = dynamic_cast<const ComposedPolicy*>(policy.get())) ref_cfg = cp->config();
    rope.type = RopeType::kNorm;
    rope.head_dim = s.head_dim;
    rope.n_rot = s.head_dim;
    rope.freq_base = 10000.0f;
    // F16 storage rounds merged rows to 11 significant bits.
    tol = s.type == KvType::kF32 ? 1e-6 : 2e-3;
  }

  // Appends n_tok tokens and fresh statistics to the real cache (not compacted yet).
  void feed(int n_tok) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::exponential_distribution<float> ex(1.0f);
    std::uniform_real_distribution<float> un(0.0f, 1.0f);
    const int kv_dim = setup.n_head_kv * setup.head_dim;
    std::vector<float> k(static_cast<size_t>(n_tok) * kv_dim), v(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    std::vector<int32_t> pos(static_cast<size_t>(n_tok));
    for (int t = 0; t < n_tok; ++t)
      pos[static_cast<size_t>(t)] = static_cast<int32_t>(n_past - state.pos_shift + t);
    // Recorded queries (expected attention), as the attention pass records them: the pass's last
    // min(w, n_tok) queries, before RoPE (here: drawn as such).
    const int w_q = policy->pass_needs(state).queries;
    for (int il = 0; il < setup.n_layer; ++il) {
      ASSERT_TRUE(cache.reserve(il, cache.layer(il).n_slot() + n_tok, false).ok());
      cache.append(il, k.data(), v.data(), pos.data(), n_tok);
      if (w_q > 0) {
        const int nq = query_heads();
        QueryWindow& qw = cache.queries_for_attention(il);
        qw.configure(nq, setup.head_dim, w_q, 1.0f / std::sqrt(static_cast<float>(setup.head_dim)),
                     rope);
        const int m = std::min(w_q, n_tok);
        std::vector<float> q(static_cast<size_t>(m) * nq * setup.head_dim);
        // (From their own generator: the other draws stay those of a policy without them.)
        for (float& x : q) x = 0.5f + nd(qrng);  // a mean away from 0, as real queries have
        qw.push(q.data(), m);
      }
      KvLayer& L = KvTestAccess::layer(cache, il);
      if (setup.n_head > 0) {
        attend(L, n_tok, nd);
        continue;
      }
      const float tail = 1.0f + 0.4f * static_cast<float>(il);
      for (int g = 0; g < L.n_head_kv(); ++g) {
        for (int j = 0; j < L.n_slot(g); ++j) {
          KvTestAccess::score(L, g)[j] += std::pow(ex(rng), tail) * static_cast<float>(n_tok);
          KvTestAccess::window(L, g)[j] = un(rng);
        }
      }
    }
    n_past += n_tok;
    ++passes;
  }

  // Compacts both and returns "" when they agree (cache contents, budgets, thresholds, counters).
  std::string compact() {
    naive::Cache ref_cache = naive::snapshot(cache);
    PassInfo pi;
    pi.n_tokens = last_pass;
    pi.n_past = n_past;
    pi.first_pass = passes == 1;
    pi.rope = &rope;
    pi.pool = pool;
    const Status s = policy->compact(cache, state, pi);
    if (!s.ok()) return "compact failed: " + s.message();
    naive::compact(ref_cfg, ref_cache, ref, n_past, rope.freq_base, last_pass);
    std::string diff = naive::compare(cache, ref_cache, tol);
    if (!diff.empty()) return diff;
    if (state.budgets_set != ref.budgets_set) return "budgets_set differs";
    if (state.budgets_set && state.budgets != ref.budgets) {
      std::string a, b;
      for (int x : state.budgets) a += std::to_string(x) + " ";
      for (int x : ref.budgets) b += std::to_string(x) + " ";
      return "budgets differ: " + a + "vs " + b;
    }
    if (state.pos_shift != ref.pos_shift) return "pos_shift differs";
    if (!ref.evicted.empty() && (state.evicted != ref.evicted || state.merged != ref.merged)) {
      return "eviction/merge counters differ";
    }
    // D2O thresholds (only a D2O merger keeps them: none means none initialised).
    const D2oMergeState* own = d2o_merge_state(state);
    const size_t n_tau = own ? own->tau_ready.size() : 0;
    for (size_t i = 0; i < ref.tau_ready.size(); ++i) {
      const bool ready = i < n_tau && own->tau_ready[i];
      if (ready != ref.tau_ready[i]) return "tau_ready differs at " + std::to_string(i);
      if (ready && std::fabs(own->tau[i] - ref.tau[i]) > 1e-6) {
        return "tau differs at " + std::to_string(i) + ": " + std::to_string(own->tau[i]) +
               " vs " + std::to_string(ref.tau[i]);
      }
    }
    return "";
  }

  // Statistics as the engine produces them: window cleared, then attention of the new queries.
  void attend(KvLayer& L, int n_tok, std::normal_distribution<float>& nd) {
    const StatsNeeds needs = policy->pass_needs(state);
    AttnStatsRequest req;
    req.accumulate = needs.accumulate;
    req.agg = needs.agg;
    if (needs.window > 0) {
      for (int g = 0; g < L.n_head_kv(); ++g)
        std::fill_n(KvTestAccess::window(L, g), L.n_slot(), 0.0f);
      req.window_first = std::max(0, n_tok - needs.window);
    }
    std::vector<float> q(static_cast<size_t>(n_tok) * setup.n_head * setup.head_dim), out(q.size());
    for (float& x : q) x = 2.0f * nd(rng);
    AttnInput in;
    in.q = q.data();
    in.out = out.data();
    in.n_tok = n_tok;
    in.n_head = setup.n_head;
    in.scale = 1.0f / std::sqrt(static_cast<float>(setup.head_dim));
    attention_reference(in, L, req);
  }

  // Query heads of the recorded queries: the attention's when it runs, else two per KV head.
  int query_heads() const { return setup.n_head > 0 ? setup.n_head : 2 * setup.n_head_kv; }

  std::string pass(int n_tok) {
    last_pass = n_tok;
    feed(n_tok);
    if (::testing::Test::HasFatalFailure()) return "feed failed";
    return compact();
  }

  SimSetup setup;
  KvCache cache;
  PolicyState state;
  std::unique_ptr<KvPolicy> policy;
  PolicyConfig ref_cfg;  // what the naive implementation runs (tests may alter it)
  naive::State ref;
  RopeParams rope;
  std::mt19937 rng;
  std::mt19937 qrng{setup.seed * 7919u + 1u};  // recorded queries
  int64_t n_past = 0;
  int passes = 0;
  int last_pass = 1;           // tokens of the last pass (PassInfo::n_tokens)
  ThreadPool* pool = nullptr;  // optional: layers planned in parallel
  double tol = 1e-6;
};

}  // namespace d2o::test
