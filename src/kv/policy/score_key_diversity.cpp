// key_diversity: KeyDiff's score (select_keydiff.h), the negated cosine of the slot's key with
// the mean of the head's normalised keys: distinctive keys rank high. Reads only the keys.
#include "kv/policy/scorer.h"
#include "kv/policy/select_keydiff.h"

namespace d2o {

namespace {

class KeyDiversity final : public Scorer {
 public:
  // Every slot of the head is scored (the anchor averages them all).
  const float* score(const HeadView& h, int, int, SelectScratch& sc, float* out) const override {
    const size_t hd = static_cast<size_t>(h.layer->head_dim());
    if (sc.row.size() < hd) sc.row.resize(hd);
    if (sc.anchor.size() < hd) sc.anchor.resize(hd);
    keydiff_scores(*h.layer, h.head, out, sc.row.data(), sc.anchor.data());
    return out;
  }
};

}  // namespace

std::unique_ptr<Scorer> make_key_diversity(const PolicyConfig&) {
  return std::make_unique<KeyDiversity>();
}

}  // namespace d2o
