// value_norm: the L2 norm of the slot's value row, |v_j|, as stored (dequantised). A slot whose
// value is near zero adds little to any attention output, whatever attention it gets. Reads only
// the values: no attention statistics, no question.
#include <cmath>

#include "kv/policy/scorer.h"

namespace d2o {

namespace {

class ValueNorm final : public Scorer {
 public:
  const float* score(const HeadView& h, int first, int end, SelectScratch& sc,
                     float* out) const override {
    const int hd = h.layer->head_dim();
    if (sc.row.size() < static_cast<size_t>(hd)) sc.row.resize(static_cast<size_t>(hd));
    for (int j = first; j < end; ++j) {
      h.layer->load_value(h.head, j, sc.row.data());
      double s = 0.0;
      for (int d = 0; d < hd; ++d) s += static_cast<double>(sc.row[d]) * sc.row[d];
      out[j] = static_cast<float>(std::sqrt(s));
    }
    return out;
  }
};

}  // namespace

std::unique_ptr<Scorer> make_value_norm(const PolicyConfig&) {
  return std::make_unique<ValueNorm>();
}

}  // namespace d2o
