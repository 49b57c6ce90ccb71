// window_attention: the attention of the pass's last `window` queries (the observation window,
// which holds the question when it is in the prompt), pooled over `kernel` neighbouring slots
// (pool=max|avg): SnapKV's and PyramidKV's score, and the d2o default's at the prompt's
// compaction (prompt_ranking=window). The window only exists for the pass that formed it.
#include "kv/policy/scorer.h"
#include "kv/policy/spec_keys.h"

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

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kPoolWords = {"max", "avg"};
const std::vector<const char*> kPromptScoreWords = {"accumulated", "window"};
const std::vector<const char*> kRankingWords = {"accumulated", "window", "reconstruction",
                                                "expected"};

// window= itself: also where expected attention reads the last `window` queries.
bool window_count_shown(const PolicyConfig& c) {
  return window_shown(c) || reads_queries(c);
}
}  // namespace

// The window attention's keys: how many last queries (window=), the pooling over neighbouring
// slots (kernel=, pool=), and what the prompt's compaction ranks by (prompt_ranking=) and leaves
// as the scores later steps start from (prompt_scores=).
std::vector<KeyDef> window_keys() {
  return {
      int_def<&PolicyConfig::window, 1, 1 << 20>("window", nullptr, window_count_shown),
      {"kernel",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         if (!parse_i64(v, &x) || x < 1 || x > 1001 || x % 2 == 0) {
           return bad_value(c.name, key, v, "an odd integer from 1 to 1001");
         }
         c.kernel = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.kernel); }, nullptr, window_shown},
      word_def<&PolicyConfig::pool, kPoolWords>("pool", nullptr, window_shown),
      word_def<&PolicyConfig::prompt, kRankingWords>(
          "prompt_ranking",
          [](const PolicyConfig& c) { return c.prompt != PromptScore::kAccumulated; }),
      word_def<&PolicyConfig::pscore, kPromptScoreWords>(
          "prompt_scores",
          [](const PolicyConfig& c) { return c.pscore != PromptScore::kAccumulated; },
          window_shown),
  };
}

}  // namespace d2o::spec_detail
