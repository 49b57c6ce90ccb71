// Scorers: the part of a policy that says how much each slot of a KV head is worth keeping.
//
// A policy keeps, per KV head, its protected slots (the keeper's sinks and recent window,
// keeper.h) and the best-scored candidates between them. A scorer writes the candidates' scores;
// it reads what it needs of the layer (attention statistics the attention pass accumulated,
// the window's attention, keys, values) and says which statistics those are (needs()).
//
// Adding a scorer: one file with its class and a make_*() function, its naive reference test,
// and one line in scorer_defs() (scorers.cpp). The spec key scorer= of the heavy-hitter presets
// then takes its name (docs/ADDING_A_POLICY.md, "Adding a scorer").
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/policy/config.h"
#include "kv/policy/select.h"

namespace d2o {

// One KV head at a compaction, as a scorer sees it.
struct HeadView {
  const KvLayer* layer = nullptr;
  int il = 0;        // layer index
  int head = 0;      // KV head
  int n = 0;         // slots the head holds
  int S = 0;         // slots it keeps
  int64_t next = 0;  // the RoPE position of the next token (n_past - pos_shift)
  // The layer's recorded queries (KvCache::queries), for a scorer that reads them; may be null.
  const QueryWindow* queries = nullptr;
};

class Scorer {
 public:
  virtual ~Scorer() = default;
  // Whether the scorer reads the accumulated attention (KvLayer::score) or the attention of the
  // pass's last queries (KvLayer::window): the attention pass forms them only when asked.
  virtual bool reads_accumulated() const { return false; }
  virtual bool reads_window() const { return false; }
  // Whether it reads the layer's recorded queries (HeadView::queries, StatsNeeds::queries).
  virtual bool reads_queries() const { return false; }
  // The scores of slots [first, end) of the head (higher keeps): out[j] for j in [first, end),
  // or a pointer to stored scores indexed by slot. Other entries of out may be left as they are.
  // A scorer whose scores depend on the range (window pooling pads at `end`) says so in its file.
  virtual const float* score(const HeadView& h, int first, int end, SelectScratch& sc,
                             float* out) const = 0;
  // Optional: the slot one eviction among candidates [first, end) removes (the last lowest
  // score, as select_top ranks), found without storing the scores; -1 when the scorer has no
  // faster way than score().
  virtual int last_lowest(const HeadView& h, int first, int end) const {
    (void)h, (void)first, (void)end;
    return -1;
  }
};

// A registered scorer: its spec word (scorer=NAME), what it scores, and how it is made.
struct ScorerDef {
  const char* name;
  const char* what;  // one line for help and docs
  std::unique_ptr<Scorer> (*make)(const PolicyConfig& cfg);
  // It reads the recorded queries (the keys window=, future= and value_weight= set it up).
  bool reads_queries = false;
};

// Every scorer the heavy-hitter presets can rank by (scorer=), in registration order.
const std::vector<ScorerDef>& scorer_defs();
// The scorer called `name`, or null.
const ScorerDef* find_scorer(std::string_view name);
// Whether a configuration reads the recorded queries: a heavy-hitter policy ranking by expected
// attention (scorer=expected_attention) or compacting its prompt by it (prompt_ranking=expected).
bool reads_queries(const PolicyConfig& cfg);

// The scorers of scorer_defs() and the ones presets use on their own (scorers.cpp and one file
// each).
std::unique_ptr<Scorer> make_accumulated_attention(const PolicyConfig& cfg);
std::unique_ptr<Scorer> make_mean_attention(const PolicyConfig& cfg);
std::unique_ptr<Scorer> make_key_diversity(const PolicyConfig& cfg);
std::unique_ptr<Scorer> make_value_norm(const PolicyConfig& cfg);
// The attention the next `future` queries are expected to give each slot, from the mean and
// covariance of the layer's recorded queries turned by the mean RoPE rotation of those positions
// (Devoto et al. 2025, "Expected Attention"; score_expected.cpp), times the value's relative
// norm with value_weight=norm. The scores do not depend on the range.
std::unique_ptr<Scorer> make_expected_attention(const PolicyConfig& cfg);
// The same pooled over `kernel` slots (pool=) as window attention is: the prompt's compaction of
// prompt_ranking=expected. Pooling pads at `end`, as make_window_attention's.
std::unique_ptr<Scorer> make_expected_attention_pooled(const PolicyConfig& cfg);
// The attention of the pass's last `window` queries, pooled over `kernel` slots (pool=): the
// observation-window score of SnapKV, PyramidKV and prompt_ranking=window. Pooling pads at the
// end of the range, so the scores of [first, end) are those of the prefix [0, end).
std::unique_ptr<Scorer> make_window_attention(const PolicyConfig& cfg);
// distinct_share=F: `inner` with the most distinctive candidates raised (score_distinct.cpp).
// Keeps a pointer to inner, which must outlive it.
std::unique_ptr<Scorer> make_distinct_guard(const PolicyConfig& cfg, const Scorer* inner);

}  // namespace d2o
