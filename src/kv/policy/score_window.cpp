// window_attention: the attention of the pass's last `window` queries (the observation window,
// which holds the question when it is in the prompt), pooled over `kernel` neighbouring slots
// (pool=max|avg): SnapKV's and PyramidKV's score, and the d2o default's at the prompt's
// compaction (prompt_ranking=window). The window only exists for the pass that formed it.
#include "kv/policy/scorer.h"

namespace d2o {

namespace {

class WindowAttention final : public Scorer {
 public:
  WindowAttention(int kernel, PoolKind pool) : kernel_(kernel), pool_(pool) {}
  bool reads_window() const override { return true; }
  // Pooling pads at both ends of the prefix [0, end), as the original pools the slots before the
  // observation window: every slot of the prefix is scored, whatever `first` is.
  const float* score(const HeadView& h, int, int end, SelectScratch&, float* out) const override {
    pool_window(h.layer->window(h.head), end, kernel_, pool_, out);
    return out;
  }

 private:
  int kernel_;
  PoolKind pool_;
};

}  // namespace

std::unique_ptr<Scorer> make_window_attention(const PolicyConfig& cfg) {
  return std::make_unique<WindowAttention>(cfg.kernel, cfg.pool);
}

}  // namespace d2o
