// Mergers: the part of a policy that says what becomes of a KV head's evicted slots once the
// keeper chose the kept ones. Without a merger they are dropped.
//   D2O (merge_d2o.h)  each evicted key folds into its most similar kept one when the similarity
//                      beats a running threshold: merge terms in the layer's CompactionPlan
//   CaM (merge_cam.h)  evicted values spread over the following slots, written while planning
//
// A merger sees one layer's compaction through a LayerJob; its per-sequence state is its own
// MergerState, held by ComposedPolicyState::merger.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "kv/policy/config.h"

namespace d2o {

class ComposedPolicyState;
struct ComposedScratch;

// A merger's per-sequence state (ComposedPolicyState::merger), made by its size_state().
class MergerState {
 public:
  virtual ~MergerState() = default;
  // The state a copied sequence continues from (no scratch).
  virtual std::unique_ptr<MergerState> clone() const = 0;
  virtual size_t bytes() const = 0;
};

// One layer's compaction in progress (ComposedPolicy::plan_layer).
struct LayerJob {
  KvCache* cache = nullptr;
  const KvLayer* layer = nullptr;
  int il = 0;
  int n = 0;  // slots each head holds (heads=ada: the most any head holds)
  int G = 0;  // KV heads
  int S = 0;  // the layer's budget per head
  CompactionPlan* plan = nullptr;
  ComposedPolicyState* own = nullptr;
  const PassInfo* pass = nullptr;
  int64_t next = 0;          // the RoPE position of the next token
  bool prompt_pass = false;  // the sequence's first compaction, after a pass of several tokens
  bool ada = false;          // per-head budgets: the heads keep different counts
  bool merging = false;      // the merger merges at this compaction
};

class MergerPart {
 public:
  virtual ~MergerPart() = default;
  // Whether the merger merges at this compaction (D2O with prompt_merge=off: not the prompt's).
  virtual bool merges(const LayerJob& job) const = 0;
  // Makes or sizes the merger's per-sequence state (own.merger) for the cache.
  virtual void size_state(const KvCache& cache, ComposedPolicyState& own) const {
    (void)cache, (void)own;
  }
  // After KvCache::apply ran layer il's plan (state kept in step with the slots).
  virtual void after_apply(const KvCache& cache, int il, const CompactionPlan& plan,
                           ComposedPolicyState& own) const {
    (void)cache, (void)il, (void)plan, (void)own;
  }
  // Per-layer set-up after the plan's shape is known (reserves, the rope of unrotated keys).
  virtual void begin_layer(LayerJob& job) const { (void)job; }
  // Whether the layer's heads may be planned in parallel (each writes only its own terms).
  virtual bool heads_in_parallel(const LayerJob& job) const {
    (void)job;
    return true;
  }
  // Grows one thread's scratch for the layer.
  virtual void size_scratch(const LayerJob& job, ComposedScratch& sc) const { (void)job, (void)sc; }
  // Head g, whose kept slots the plan holds: its merges appended to `terms`; returns how many
  // evicted slots merged.
  virtual int64_t plan_head(const LayerJob& job, int g, ComposedScratch& sc,
                            std::vector<MergeTerm>& terms) const = 0;
  // After every head (merges decided over all heads together); returns how many merged.
  virtual int64_t end_layer(const LayerJob& job, ComposedScratch& sc) const {
    (void)job, (void)sc;
    return 0;
  }
};

// The mergers (merger_d2o.cpp, merger_cam.cpp).
std::unique_ptr<MergerPart> make_d2o_merger(const PolicyConfig& cfg);
std::unique_ptr<MergerPart> make_cam_merger(const PolicyConfig& cfg);

}  // namespace d2o
