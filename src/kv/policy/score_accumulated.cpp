// accumulated_attention: the attention every query so far gave the slot, summed over the queries
// (and aggregated over the query heads of the KV head, agg=): H2O's heavy-hitter score, D2O's
// as the paper reads it.
#include "kv/policy/scorer.h"

namespace d2o {

namespace {

class AccumulatedAttention final : public Scorer {
 public:
  bool reads_accumulated() const override { return true; }
  const float* score(const HeadView& h, int, int, SelectScratch&, float*) const override {
    return h.layer->score(h.head);
  }
};

}  // namespace

std::unique_ptr<Scorer> make_accumulated_attention(const PolicyConfig&) {
  return std::make_unique<AccumulatedAttention>();
}

}  // namespace d2o
