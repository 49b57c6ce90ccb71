// KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
// Inference in Resource-Constrained Environments", 2025): a selector that reads only the keys, no
// attention statistics.
//
// Per KV head, over the n slots it holds at the compaction:
//   anchor  a = (1/n) sum_j k_j / |k_j|          (the mean of the normalised keys; a zero key
//                                                 contributes 0)
//   score   s_j = -cos(k_j, a) = -(k_j . a) / (|k_j| |a|)   (0 when k_j or a is zero)
// and the slots with the highest scores (the keys least similar to the anchor, the most
// distinctive) are kept: ties keep the older slot, as every selector (select.h). As in the paper
// and kvpress's KeyDiffPress, nothing is protected by default; `sinks=T` keeps the first T slots
// and `recent=R` the last R whatever their scores (the anchor still averages all n keys).
// Scores are computed in double and ranked as float.
#pragma once

#include <cstdint>

#include "kv/kv_cache.h"
#include "kv/policy/config.h"
#include "kv/policy/select.h"

namespace d2o {

// score[j] = -cos(k_j, anchor) for the n slots of head `head` (float, ranked as such).
// row: head_dim floats, anchor: head_dim doubles of scratch.
void keydiff_scores(const KvLayer& L, int head, float* score, float* row, double* anchor);

// H2O / D2O with distinct_share=F (F > 0): of the N heavy-hitter places of a head keeping S of its
// n slots (split_heavy_recent), the first round-half-up(F x N) go to the candidates (the slots
// between the sinks and the recent window) with the highest KeyDiff scores, ties to the older
// slot; the other places go by `score` as before. Returns `score` with those candidates raised to
// +infinity (in scratch.guarded), for select_heavy_recent; `score` itself when no candidate is
// evicted.
const float* guard_distinct(const KvLayer& L, int head, const float* score, int n, int S,
                            const PolicyConfig& cfg, SelectScratch& scratch);

}  // namespace d2o
