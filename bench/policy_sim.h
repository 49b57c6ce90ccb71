// A stand-in for the engine's decode loop on the SmolLM2-135M cache shape (30 layers, 3 KV heads
// of 64, F16), shared by bench_policy and bench_policy_steps. Synthetic statistics: each slot has a
// fixed attention weight w (log-normal, drawn when its token arrives, kept in the slot's otherwise
// unused `window` entry so that it moves with the slot); a step adds w / n to every slot's score,
// so old heavy slots keep winning and a new slot with a small weight is evicted soon after it
// leaves the recent window, as in a real cache.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv/attention.h"
#include "kv/attention_kernels.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"

namespace d2o::bench {

constexpr int kLayers = 30, kHeadsKv = 3, kHeadDim = 64;

struct PolicySim {
  KvCache cache{KvCacheConfig{kLayers, kHeadsKv, kHeadDim, KvType::kF16}};
  std::unique_ptr<KvPolicy> policy;
  PolicyState state;
  std::mt19937 rng{7};
  std::normal_distribution<float> nd{0.0f, 1.0f};
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  int64_t n_past = 0;
  volatile uint64_t sink = 0;  // keeps the reads of attend()

  PolicySim() = default;
  explicit PolicySim(const std::string& spec) {
    auto p = parse_kv_policy(spec);
    if (!p.ok()) std::abort();
    policy = std::move(p).value();
  }
  // Appends n tokens to every layer, with a fresh weight per slot and head.
  void append(int n) {
    const size_t kv_dim = static_cast<size_t>(kHeadsKv) * kHeadDim;
    k.resize(static_cast<size_t>(n) * kv_dim);
    v.resize(k.size());
    pos.resize(static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(n_past + t);
    for (int il = 0; il < kLayers; ++il) {
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      // The benchmark stands in for the attention kernel: its per-slot weights are window
      // statistics, written through the kernel's door.
      KvLayer& L = cache.layer_for_attention(il);
      if (!cache.reserve(il, L.n_slot() + n, /*exact=*/false).ok()) std::abort();
      const int first = L.n_slot();
      cache.append(il, k.data(), v.data(), pos.data(), n);
      for (int g = 0; g < kHeadsKv; ++g) {
        for (int j = first; j < L.n_slot(); ++j) L.window_accum(g)[j] = std::exp(2 * nd(rng));
      }
    }
    n_past += n;
  }
  // One query's attention per token of the pass: score += w / n_slot; reads every key and value.
  void attend(int il, int n_tok) {
    KvLayer& L = cache.layer_for_attention(il);
    const float f = static_cast<float>(n_tok) / static_cast<float>(L.n_slot());
    uint64_t sum = 0;
    for (int g = 0; g < kHeadsKv; ++g) {
      float* score = L.score_accum(g);
      const float* window = L.window(g);
      for (int j = 0; j < L.n_slot(); ++j) score[j] += f * window[j];
      const size_t words = L.key_row_bytes() * static_cast<size_t>(L.n_slot()) / 8;
      for (const uint8_t* base : {L.key_base(g), L.value_base(g)}) {
        const auto* w = reinterpret_cast<const uint64_t*>(base);
        for (size_t i = 0; i < words; ++i) sum += w[i];
      }
    }
    sink = sum;
  }
  // What the engine's one-token attention does for a policy that arms an AttnProbe (D2O): the
  // armed slot's key scored against every key of its head, as an extra query row of scale 1/8.
  void probe(int il) {
    AttnProbe* P = policy->attention_probe(state);
    if (!P) return;
    P->dot_layer = -1;
    const KvLayer& L = cache.layer(il);
    const int n = L.n_slot();
    const size_t base = static_cast<size_t>(il) * kHeadsKv;
    if (P->n_head_kv != kHeadsKv || P->slot.size() < base + kHeadsKv) return;
    P->formed.assign(kHeadsKv, 0);
    P->key.resize(static_cast<size_t>(kHeadsKv) * kHeadDim);
    if (P->dot.size() < static_cast<size_t>(kHeadsKv) * n)
      P->dot.resize(static_cast<size_t>(kHeadsKv) * n);
    constexpr float kScale = 0.125f;
    for (int g = 0; g < kHeadsKv; ++g) {
      const int32_t s = P->slot[base + static_cast<size_t>(g)];
      if (s < 0 || s >= n) continue;
      float* key = P->key.data() + static_cast<size_t>(g) * kHeadDim;
      L.load_key(g, s, key);
      attn::KvRows k;
      k.base = L.key_base(g);
      k.row_bytes = L.key_row_bytes();
      k.type = L.type().k;
      k.idx = L.rows(g);
      const float* q[1] = {key};
      float* out[1] = {P->dot.data() + static_cast<size_t>(g) * n};
      attn::best_kernels().scores(q, 1, k, n, kHeadDim, kScale, out);
      P->formed[static_cast<size_t>(g)] = 1;
    }
    P->dot_layer = il;
    P->dot_n = n;
    P->dot_scale = kScale;
  }
  void attend(int n_tok) {
    for (int il = 0; il < kLayers; ++il) attend(il, n_tok);
  }
  PassInfo pass_info(int n_tok) const {
    PassInfo pass;
    pass.n_tokens = n_tok;
    pass.n_past = n_past;
    pass.first_pass = n_past == n_tok;
    return pass;
  }
  void compact(int n_tok) {
    if (!policy->compact(cache, state, pass_info(n_tok)).ok()) std::abort();
  }
};

}  // namespace d2o::bench
