// D2O token-level merging (method.md, "merging evicted tokens"), for one KV head of one layer.
//
// For the evicted slots E and the kept slots C of the head:
//   u_{e,c} = cos(k_e, k_c) (or on values, or the mean of both cosines for sim=kv);
//   c*(e) = argmax_c u_{e,c} (ties: the older kept slot), m_e = u_{e,c*};
//   threshold tau (one per layer and KV head), decisions in slot (chronological) order:
//     first compaction that evicts from this head: tau = mean_E m_e, merge iff m_e >= tau;
//     paper EMA, later:    for each e: merge iff m_e >= tau, then tau = beta m_e + (1-beta) tau
//                          (comparing before or after the update decides the same for beta < 1);
//     research EMA, later: tau = 0.5 tau + 0.5 mean_E m_e once, then merge iff m_e >= tau;
//   merged e's that chose c form one merge group into c (many-to-one), emitted as MergeTerms
//   (dst c first, then its sources ascending) with weights
//     weighted  w_c = e / Z, w_e = exp(u_e) / Z, Z = e + sum exp(u_e)   (sum to 1)
//     average   1 / (1 + |E_c|) each
//     research  w_c = 1 / (1 + |E_c|), w_e = u_e / (1 + |E_c|)
//   Keys and values share the weights; KvCache::apply sums the merged scores into c and keeps c's
//   position (CompactionPlan::merged_score; merged_score= picks another rule).
// Zero vectors have cosine 0 with everything.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kv/attention.h"
#include "kv/kv_cache.h"
#include "kv/policy/config.h"
#include "kv/policy/merger.h"
#include "kv/policy/nearest.h"

namespace d2o {

struct RopeParams;  // ops/ops.h

// Scratch of D2O merging for one thread of a compaction. Buffers only grow, so a steady-state
// decode step allocates nothing.
struct D2oScratch {
  std::vector<float> sim;      // per kept slot: summed similarities, dots, inverse norms; a row
  std::vector<float> kept;     // unit kept rows [n_keep, dim] then four evicted rows
  PackedRows packed;           // the unit kept rows, packed for nearest_rows (prefill merges)
  std::vector<int32_t> group;  // merge groups per kept slot (d2o_emit)
  // Per evicted slot (of one head, or [n_head_kv, n_evicted] of a layer for
  // merge_decision=per_token, plus the per-index means): best similarity, nearest kept index, merge
  // flag, evicted slots.
  std::vector<float> best_sim;
  std::vector<int32_t> best;
  std::vector<uint8_t> merge;
  std::vector<int32_t> evicted;
};

// D2O's per-sequence state (ComposedPolicyState::merger; merger_d2o.cpp).
class D2oMergeState final : public MergerState {
 public:
  // EMA similarity thresholds and whether each was initialised, [n_layer * n_head_kv].
  std::vector<float> tau;
  std::vector<uint8_t> tau_ready;
  // With key similarity: 1 / |key| of every slot of each layer and KV head ([n_layer *
  // n_head_kv] lists in slot order, d2o_key_inv_norms), kept in step with the slots so that a
  // decode step's search forms dots only, and the position of the last slot each list covers. A
  // list that does not match its head (length, last position) is formed again from the keys.
  std::vector<std::vector<float>> key_inv;
  std::vector<int32_t> key_inv_last;
  // Decoding: the slot each layer's heads are expected to evict at the next step and the
  // attention's dots of its key (KvPolicy::attention_probe); how many one-slot searches took
  // their dots from it, and how many formed them (the slot evicted was another one, or the pass
  // formed none).
  AttnProbe probe;
  std::atomic<int64_t> probe_used{0}, probe_missed{0};

  // Thresholds and key norms (not the probe, which the next pass arms again).
  std::unique_ptr<MergerState> clone() const override;
  size_t bytes() const override;
};

// The D2O state a merger state is, or null.
inline D2oMergeState* d2o_merge_state(MergerState* s) {
  return dynamic_cast<D2oMergeState*>(s);
}
inline const D2oMergeState* d2o_merge_state(const MergerState* s) {
  return dynamic_cast<const D2oMergeState*>(s);
}

struct D2oHeadMerge {
  const PolicyConfig* cfg = nullptr;
  const KvLayer* layer = nullptr;
  int head = 0;
  const int32_t* keep = nullptr;  // [n_keep] kept slots, ascending
  int n_keep = 0;
  const int32_t* evicted = nullptr;  // [n_evicted] evicted slots, ascending
  int n_evicted = 0;
  float* tau = nullptr;  // this head's threshold
  uint8_t* tau_ready = nullptr;
  // Non-null (merge_keys=unrotated): keys are compared rotated back to position 0.
  const RopeParams* rope = nullptr;
  // Non-null (only where d2o_uses_kept_norms): [n_keep] 1 / |key| of the kept slots, in keep
  // order, and [n_evicted] of the evicted ones (the policy's cached norms, d2o_key_inv_norms), so
  // that the search forms dots only.
  const float* kept_inv = nullptr;
  const float* evicted_inv = nullptr;
  // Non-null (only with kept_inv, one evicted slot e, keys stored unrotated): [n_keep + 1] the
  // dots of e's key with the key of every slot of the head (e's own included), times
  // all_dots_scale (a power of two), as the attention kernels' scores() forms them: the
  // attention pass formed them (AttnProbe). Null there: d2o_nearest forms them the same way.
  const float* all_dots = nullptr;
  float all_dots_scale = 1.0f;
};

// With more evicted slots than this (the prefill compaction), the kept rows are normalised and
// packed once and the evicted rows matched four at a time; below it (a decode step), each evicted
// row is matched against the stored rows directly.
constexpr int kD2oFewEvicted = 4;
// Whether the nearest-slot search of n_evicted slots can take the keys' inverse norms from the
// caller (key similarity, keys compared as stored, at most kD2oFewEvicted evictions).
bool d2o_uses_kept_norms(const PolicyConfig& cfg, int n_evicted, bool unrotated);
// Whether such a search of one evicted slot takes its dots from the attention kernels' scores()
// (D2oHeadMerge::all_dots): keys stored unrotated, head_dim at most kD2oMaxHeadDim.
constexpr int kD2oMaxHeadDim = 1024;
bool d2o_decode_dots(const PolicyConfig& cfg, const KvLayer& L, int n_evicted, bool unrotated);
// out[i] = 1 / |key of slot first + i| of `head` (0 for a zero key), i < count, as row_dots'
// four-row loop forms it (the same bits wherever the slot sits).
void d2o_key_inv_norms(const KvLayer& L, int head, int first, int count, float* out);

// The three steps, for callers that decide over several heads at once (merge_decision=per_token):
// 1. the nearest kept slot cstar[i] (an index into keep) of every evicted slot i and its
//    similarity m_e[i]. Uses scratch.sim, kept and packed.
void d2o_nearest(const D2oHeadMerge& h, D2oScratch& scratch, int32_t* cstar, float* m_e);
// 2. merge[i] = whether evicted slot i merges, from the similarities m[0..E) in slot order and
//    the threshold *tau (initialised by this call when *tau_ready is 0); returns the count.
int d2o_decide(const PolicyConfig& cfg, const float* m, int E, float* tau, uint8_t* tau_ready,
               uint8_t* merge);
// 3. appends the head's merge groups (the slots with merge[i] set) to `terms` (a plan's merges,
//    CompactionPlan::merges, or one head's share of them). Uses scratch.group.
void d2o_emit(const D2oHeadMerge& h, D2oScratch& scratch, const int32_t* cstar,
              const float* m_e, const uint8_t* merge, std::vector<MergeTerm>& terms);

// All three for one head with its own threshold (merge_decision=per_head): appends the head's merge
// groups to `terms`; returns how many evicted slots merged. Uses scratch.best_sim, best and merge
// besides what the steps use.
int plan_d2o_merges(const D2oHeadMerge& h, D2oScratch& scratch, std::vector<MergeTerm>& terms);

}  // namespace d2o
