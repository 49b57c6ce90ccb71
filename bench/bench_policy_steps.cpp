// Decode-step compactions of one KV policy on the SmolLM2-135M cache shape (30 layers, 3 KV heads
// of 64, F16), as bench_policy runs them (append one token to every layer, a stand-in for
// attention, then KvPolicy::compact_layer per layer and KvPolicy::compact), for a fixed number of
// steps: a deterministic workload for instruction counts. Under callgrind only the policy calls
// are collected:
//
//   valgrind --tool=callgrind --collect-atstart=no build/bench/bench_policy_steps SPEC 512 200
//
// Natively it prints the prompt's compaction time (one run) and the policy's wall time per step
// (steady clock around the policy calls).
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
#include "policy_sim.h"

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

using bench::kLayers;

// One decode step; returns the seconds spent in the policy calls.
double step(bench::PolicySim& sim, bool collect) {
  using Clock = std::chrono::steady_clock;
  sim.append(1);
  const PassInfo pass = sim.pass_info(1);
  Clock::duration t{};
  for (int il = 0; il < kLayers; ++il) {
    sim.attend(il, 1);
    sim.probe(il);
    if (collect) D2O_COLLECT();
    const auto t0 = Clock::now();
    if (!sim.policy->compact_layer(sim.cache, sim.state, pass, il).ok()) std::abort();
    t += Clock::now() - t0;
    if (collect) D2O_COLLECT();
  }
  if (collect) D2O_COLLECT();
  const auto t0 = Clock::now();
  sim.compact(1);
  t += Clock::now() - t0;
  if (collect) D2O_COLLECT();
  return std::chrono::duration<double>(t).count();
}

int run(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s SPEC N_PROMPT STEPS [WARMUP]\n", argv[0]);
    return 2;
  }
  bench::PolicySim sim;
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
  const auto t_prompt = std::chrono::steady_clock::now();
  sim.compact(n_prompt);
  const double prompt_secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_prompt).count();
  for (int i = 0; i < warmup; ++i) step(sim, false);
  if (!sim.policy->compacts_per_layer(sim.state)) {
    std::fprintf(stderr, "the policy does not compact layer by layer\n");
    return 1;
  }
  double secs = 0;
  for (int i = 0; i < steps; ++i) secs += step(sim, true);
  std::printf(
      "%s: prompt of %d compacted in %.3f ms; %d steps, %.1f slots per layer and head, %.2f us of "
      "policy per step\n",
      argv[1], n_prompt, 1e3 * prompt_secs, steps,
      static_cast<double>(sim.cache.total_slots()) / kLayers, 1e6 * secs / steps);
  return 0;
}

}  // namespace
}  // namespace d2o

int main(int argc, char** argv) {
  return d2o::run(argc, argv);
}
