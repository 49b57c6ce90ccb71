// CaM value merging (Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference",
// ICML 2024; authors' code github.com/zyxxmu/cam), for one KV head, on top of StreamingLLM
// eviction (T sinks + recent window; the evicted slots are the ones between them).
//
// Evicted slots are processed in chronological order, as the original does one eviction per
// generated token: the slot e leaving the window is merged with probability
//   p_e = A_e / max(A_j : j < T (the sinks) or e <= j <= e + R (the recent window R))
// (A = accumulated attention score; 0/0 -> 0; p_e <= 1 since e is among the j): the reference of
// the authors' lm-eval code, the maximum over the sinks and the window the slot leaves. When the
// Bernoulli draw says so, v_e / m is added to the value of each of its m targets,
// the slots e+1 .. e+m (which may themselves be evicted later and pass their value on: the
// cascade of the original's sequential loop). Keys are never changed; the evicted key is dropped.
// m = cfg.cam_targets, 0 meaning the recent window (the original lm-eval code's merge budget),
// capped by the recent window so every merge has m targets.
// The draw is deterministic: u = splitmix64(seed ^ (il << 48) ^ (head << 32) ^ position) / 2^64
// (top 53 bits), merge iff u < p_e; the same sequence merges the same way on every run.
//
// Why the maximum and not the mean over the m targets (paper Eq. 14 as the kvpress port reads it):
// an evicted slot is older than its targets, so its accumulated score is larger and p_e = 1
// almost always; every value is then passed on in full and the recent window accumulates the sum
// of all evicted values, growing linearly with the stream (SmolLM2-135M, capacity 256, 1024
// tokens: PPL 27.3 against StreamingLLM's 4.05). With the sinks in the reference, whose score grows
// with every query, merges become rare as the stream goes on and values stay bounded (PolicyCam
// tests).
//
// Simplifications (documented in docs/ADDING_A_POLICY.md): A is the score accumulated up to this
// compaction (the original divides by the query count, the same for every slot), and in
// prompt-then-compress the whole prompt's evictions are replayed at once with these scores.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy/config.h"

namespace d2o {

// Scratch of CaM merging for one thread of a compaction (only grows).
struct CamScratch {
  std::vector<double> acc;   // acc[hd] cur[hd] ring[m][hd]: merged sources of the sliding window
  std::vector<int32_t> idx;  // ring_used[m] deque[n - first]
  std::vector<float> row;    // [hd]
};

struct CamHeadMerge {
  const PolicyConfig* cfg = nullptr;
  KvCache* cache = nullptr;  // layer il of it
  int il = 0;
  int head = 0;
  int first_evicted = 0;  // evicted slots are [first_evicted, end_evicted)
  int end_evicted = 0;    // == n - recent window
};

// Replaces the values of the head's kept slots that received merges (KvCache::replace_value,
// before KvCache::apply drops the evicted slots); returns how many evicted slots were merged.
int cam_merge_values(const CamHeadMerge& h, CamScratch& scratch);

// The deterministic uniform draw in [0, 1) for a slot (exposed for tests and docs).
double cam_uniform(uint64_t seed, int il, int head, int32_t pos);

}  // namespace d2o
