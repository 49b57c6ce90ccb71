// The CaM merger part (merge_cam.h has the method): values of the evicted slots between the
// sinks and the recent window spread over the slots that follow them, written into the layer
// while planning (KvCache::replace_value), so the layer's heads are planned one after another.
#include <algorithm>

#include "kv/policy/composed.h"
#include "kv/policy/merge_cam.h"
#include "kv/policy/merger.h"

namespace d2o {

namespace {

class CamMerger final : public MergerPart {
 public:
  explicit CamMerger(const PolicyConfig& cfg) : cfg_(cfg) {}
  bool merges(const LayerJob&) const override { return true; }
  bool heads_in_parallel(const LayerJob&) const override { return false; }
  int64_t plan_head(const LayerJob& job, int g, ComposedScratch& hs,
                    std::vector<MergeTerm>&) const override {
    const int t = std::min(cfg_.sinks, job.S);
    CamHeadMerge h;
    h.cfg = &cfg_;
    h.cache = job.cache;
    h.il = job.il;
    h.head = g;
    h.first_evicted = t;
    h.end_evicted = job.n - (job.S - t);
    return cam_merge_values(h, hs.cam);
  }

 private:
  PolicyConfig cfg_;
};

}  // namespace

std::unique_ptr<MergerPart> make_cam_merger(const PolicyConfig& cfg) {
  return std::make_unique<CamMerger>(cfg);
}

}  // namespace d2o
