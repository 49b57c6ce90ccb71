// mean_attention: accumulated attention divided by the queries that have seen the slot (the slot
// at position p was seen by the queries at p .. next - 1): RoCo's score, the d2o default's. Old
// slots no longer win by age alone.
#include "kv/policy/scorer.h"
#include "kv/policy/similarity.h"

namespace d2o {

namespace {

class MeanAttention final : public Scorer {
 public:
  bool reads_accumulated() const override { return true; }
  const float* score(const HeadView& h, int first, int end, SelectScratch&,
                     float* out) const override {
    const KvLayer& L = *h.layer;
    mean_attention(L.score(h.head) + first, L.pos(h.head) + first, end - first, h.next,
                   out + first);
    return out;
  }
  // A decode step's eviction without storing the means (vectorised, as select_top's).
  int last_lowest(const HeadView& h, int first, int end) const override {
    const KvLayer& L = *h.layer;
    return first +
           last_min_mean_index(L.score(h.head) + first, L.pos(h.head) + first, end - first, h.next);
  }
};

}  // namespace

std::unique_ptr<Scorer> make_mean_attention(const PolicyConfig&) {
  return std::make_unique<MeanAttention>();
}

}  // namespace d2o
