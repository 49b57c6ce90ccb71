// Decode-step compactions of one KV policy on the SmolLM2-135M cache shape (30 layers, 3 KV heads
// of 64, F16), as bench_policy runs them (append one token to every layer, a stand-in for
// attention, then KvPolicy::compact_layer per layer and KvPolicy::compact), for a fixed number of
// steps: a deterministic workload for instruction counts. Under callgrind only the policy calls
// are collected:
//
//   valgrind --tool=callgrind --collect-atstart=no build/bench/bench_policy_steps SPEC 512 200
//
// Natively it prints the policy's wall time per step (steady clock around the policy calls).
// args: SPEC N_PROMPT STEPS [WARMUP (300)]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy.h"

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define D2O_COLLECT() CALLGRIND_TOGGLE_COLLECT
#else
#define D2O_COLLECT() \
  do {                \
  } while (0)
#endif

namespace d2o {
namespace {

constexpr int kLayers = 30, kHeadsKv = 3, kHeadDim = 64;

// The same synthetic statistics as bench_policy: each slot has a fixed log-normal attention
// weight (kept in its otherwise unused `window` entry so that it moves with the slot); a step
// adds w / n to every slot's score.
struct Sim {
  KvCache cache{KvCacheConfig{kLayers, kHeadsKv, kHeadDim, KvType::kF16}};
  std::unique_ptr<KvPolicy> policy;
  PolicyState state;
  std::mt19937 rng{7};
  std::normal_distribution<float> nd{0.0f, 1.0f};
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  int64_t n_past = 0;

  void append(int n) {
    const size_t kv_dim = static_cast<size_t>(kHeadsKv) * kHeadDim;
    k.resize(static_cast<size_t>(n) * kv_dim);
    v.resize(k.size());
    pos.resize(static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(n_past + t);
    for (int il = 0; il < kLayers; ++il) {
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
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
  void attend(int il, int n_tok) {
    KvLayer& L = cache.layer_for_attention(il);
    const float f = static_cast<float>(n_tok) / static_cast<float>(L.n_slot());
    uint64_t sum = 0;
    for (int g = 0; g < kHeadsKv; ++g) {
      float* score = L.score_accum(g);
      const float* window = L.window(g);
      for (int j = 0; j < L.n_slot(); ++j) score[j] += f * window[j];
      const size_t words = L.key_row_bytes() * static_cast<size_t>(L.n_slot()) / 8;
      for (const uint8_t* base : {L.key_row(g, 0), L.value_row(g, 0)}) {
        const auto* w = reinterpret_cast<const uint64_t*>(base);
        for (size_t i = 0; i < words; ++i) sum += w[i];
      }
    }
    if (sum == 1) std::puts("");  // keeps the reads
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
  // One decode step; returns the seconds spent in the policy calls.
  double step(bool collect) {
    using Clock = std::chrono::steady_clock;
    append(1);
    const PassInfo pass = pass_info(1);
    Clock::duration t{};
    for (int il = 0; il < kLayers; ++il) {
      attend(il, 1);
      if (collect) D2O_COLLECT();
      const auto t0 = Clock::now();
      if (!policy->compact_layer(cache, state, pass, il).ok()) std::abort();
      t += Clock::now() - t0;
      if (collect) D2O_COLLECT();
    }
    if (collect) D2O_COLLECT();
    const auto t0 = Clock::now();
    compact(1);
    t += Clock::now() - t0;
    if (collect) D2O_COLLECT();
    return std::chrono::duration<double>(t).count();
  }
};

int run(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s SPEC N_PROMPT STEPS [WARMUP]\n", argv[0]);
    return 2;
  }
  Sim sim;
  auto p = parse_kv_policy(argv[1]);
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().message().c_str());
    return 2;
  }
  sim.policy = std::move(p).value();
  const int n_prompt = std::atoi(argv[2]), steps = std::atoi(argv[3]);
  const int warmup = argc > 4 ? std::atoi(argv[4]) : 300;
  if (n_prompt < 1 || steps < 1 || warmup < 0) {
    std::fprintf(stderr, "N_PROMPT and STEPS must be positive, WARMUP not negative\n");
    return 2;
  }
  sim.append(n_prompt);
  for (int il = 0; il < kLayers; ++il) sim.attend(il, n_prompt);
  sim.compact(n_prompt);
  for (int i = 0; i < warmup; ++i) sim.step(false);
  if (!sim.policy->compacts_per_layer(sim.state)) {
    std::fprintf(stderr, "the policy does not compact layer by layer\n");
    return 1;
  }
  double secs = 0;
  for (int i = 0; i < steps; ++i) secs += sim.step(true);
  std::printf("%s: %d steps, %.1f slots per layer and head, %.2f us of policy per step\n", argv[1],
              steps, static_cast<double>(sim.cache.total_slots()) / kLayers, 1e6 * secs / steps);
  return 0;
}

}  // namespace
}  // namespace d2o

int main(int argc, char** argv) {
  return d2o::run(argc, argv);
}
