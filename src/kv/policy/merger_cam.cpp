// The CaM merger part (merge_cam.h has the method): values of the evicted slots between the
// sinks and the recent window spread over the slots that follow them, written into the layer
// while planning (KvCache::replace_value), so the layer's heads are planned one after another.
#include <algorithm>

#include "kv/policy/composed.h"
#include "kv/policy/merge_cam.h"
#include "kv/policy/merger.h"
#include "kv/policy/spec_keys.h"

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

namespace d2o::spec_detail {

// CaM's merger's keys: which kept slots receive an evicted value (merge_targets=: the recent
// window or that many slots) and the seed of its random draws (seed=).
std::vector<KeyDef> cam_merger_keys() {
  return {
      {"merge_targets",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         if (v == "recent") {
           c.cam_targets = 0;
           return Status();
         }
         int64_t x = 0;
         if (!parse_i64(v, &x) || x < 1 || x > (1 << 20)) {
           return bad_value(c.name, key, v, "'recent' or a positive integer");
         }
         c.cam_targets = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) {
         return c.cam_targets == 0 ? std::string("recent") : std::to_string(c.cam_targets);
       }},
      {"seed",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         uint64_t x = 0;
         if (!parse_u64(v, &x)) return bad_value(c.name, key, v, "a non-negative integer");
         c.seed = x;
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.seed); }},
  };
}

}  // namespace d2o::spec_detail
