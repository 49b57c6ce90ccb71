// distinct_share=F around any heavy-hitter scorer (select_keydiff.h, guard_distinct): the first
// F of the heavy-hitter places go to the candidates KeyDiff ranks most distinctive, the rest by
// the scorer it wraps.
#include "kv/policy/scorer.h"
#include "kv/policy/select_keydiff.h"

namespace d2o {

namespace {

class DistinctGuard final : public Scorer {
 public:
  DistinctGuard(const PolicyConfig& cfg, const Scorer* inner) : cfg_(cfg), inner_(inner) {}
  bool reads_accumulated() const override { return inner_->reads_accumulated(); }
  bool reads_window() const override { return inner_->reads_window(); }
  bool reads_queries() const override { return inner_->reads_queries(); }
  const float* score(const HeadView& h, int, int, SelectScratch& sc, float* out) const override {
    // Every slot's score: the guard copies the whole head's (its own candidates may lie anywhere
    // between the sinks and the recent window).
    const float* s = inner_->score(h, 0, h.n, sc, out);
    return guard_distinct(*h.layer, h.head, s, h.n, h.S, cfg_, sc);
  }

 private:
  PolicyConfig cfg_;
  const Scorer* inner_;
};

}  // namespace

std::unique_ptr<Scorer> make_distinct_guard(const PolicyConfig& cfg, const Scorer* inner) {
  return std::make_unique<DistinctGuard>(cfg, inner);
}

}  // namespace d2o
