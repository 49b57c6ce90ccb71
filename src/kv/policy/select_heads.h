// Layer level within a layer: Ada-KV's per-head budgets (heads=ada). The layer keeps S x G slots
// (G KV heads, S the layer's budget per head), shared over its heads by score instead of S each.
//
// Per head g holding n_g slots, as the uniform selector would see it:
//   protected  the first t and the last R slots (heavy hitters: t = min(sinks, S), R the recent
//              part of the N:M split of S; SnapKV: t = 0, R = min(window, S), the observation
//              window); K = S - t - R scored slots a uniform head would keep;
//   candidates slots [t, n_g - R), ranked by the selector's score (accumulated or mean attention;
//              pooled window attention);
//   floor      f = floor(alpha x K) (Ada-KV's safeguard, alpha = floor=): head g first keeps its
//              best min(f, candidates) candidates;
//   joint      the remaining G x K - sum of the floors go to the best remaining candidates of all
//              heads together (ties: the lower head, then the older slot).
// A head keeps t + R + its floor + its joint picks; the layer keeps G x S slots in all, the same
// bytes as the uniform policy.
#pragma once

#include <cstdint>

#include "kv/policy/config.h"
#include "kv/policy/select.h"

namespace d2o {

// Per-head selection of one layer whose head g holds n[g] slots. Per-head arrays are packed:
// head g's part starts at off[g] = n[0] + ... + n[g - 1]. Head g's candidate scores are at
// score + off[g], indexed by slot (SnapKV: the pooled prefix [n[g] - R]). Writes head g's kept
// slots, ascending, from keep + off[g], and their count to count[g]. Requires sum_g n[g] > G x S.
void select_ada(const PolicyConfig& cfg, const float* score, const int32_t* off, const int32_t* n,
                int G, int S, int32_t* keep, int32_t* count, SelectScratch& sc);

}  // namespace d2o
