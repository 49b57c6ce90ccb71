// PolicyConfig: everything a KV-cache compression policy is made of, as plain data.
//
// Every preset (streaming, h2o, snapkv, pyramidkv, roco, cam, d2o, keydiff) is one composition of
//   a budget mode     ratio=r (rho = r of the tokens seen at the first compaction, or with
//                     prefill=bounded of the whole prompt, compacted between its chunks) or
//                     budget=B (B slots per KV head and layer on average, a fixed capacity);
//   a layer rule      how the total is split over layers (uniform, D2O variance, pyramid, ...);
//   a selector        which slots of a KV head survive (sinks + heavy hitters + recent window,
//                     sinks + recent window, SnapKV pooled window attention + observation window,
//                     KeyDiff: the keys least similar to the head's mean key);
//   a merger          what happens to the evicted slots (dropped, D2O nearest-neighbour merge,
//                     CaM value merge).
// The spec string ("d2o:ratio=0.2,sinks=4,...") is parsed into this struct (spec.cpp) and printed
// back from it; ComposedPolicy (composed.h) executes it.
#pragma once

#include <cstdint>
#include <string>

#include "kv/attention.h"
#include "kv/cold_tier.h"

namespace d2o {

enum class BudgetMode { kRatio, kBudget };

// How a ratio policy treats a prompt fed in several passes (announced chunks,
// PassInfo::prompt_rest).
enum class PrefillMode {
  kExact,    // the whole prompt is held, then compressed once after its last pass (the result of
             // a one-pass prefill, bit for bit)
  kBounded,  // the budget is rho of the prompt's whole length (the tokens fed and announced),
             // known at its first pass; the cache is compacted to it between passes as a fixed
             // budget is, so the prompt's peak is the budget plus one pass, not the prompt
};

// How the total budget is split over layers.
enum class LayerRule {
  kUniform,     // every layer the same (H2O, StreamingLLM, SnapKV, ...)
  kVariance,    // D2O: softmax(-min-max normalised column-sum variance)
  kReciprocal,  // D2O ablation: proportional to 1 / variance
  kExpDecay,    // D2O ablation: exp(-2 l / (L-1)), denser early layers
  kPyramid,     // PyramidKV: linear decrease over depth
  kResearch,    // D2O research code: per-layer ratios clamped to [0.01, 1], layers 0, 1, L-1 full
};

// How a layer's slots are shared over its KV heads.
enum class HeadRule {
  kUniform,  // every head keeps the layer's budget S
  kAda,      // Ada-KV: the layer keeps S x n_head_kv slots; past each head's protected slots
             // (sinks, recent or observation window, as the selector protects them) and its floor
             // (its top floor x K scored slots, K = the scored slots a uniform head keeps), the
             // rest go to the best scores over all heads of the layer jointly
};

// Which slots of a KV head are kept.
enum class Selector {
  kSinkRecent,   // T sinks + the most recent slots (StreamingLLM, CaM)
  kHeavyRecent,  // T sinks + N highest-score slots + M most recent (H2O, RoCo, D2O)
  kSnapWindow,   // top-k pooled window attention + the last w slots (SnapKV, PyramidKV)
  kKeyDiff,      // T sinks + the keys least similar to the mean key + R recent (KeyDiff)
};

enum class PoolKind { kMax, kAvg };

// H2O / RoCo / D2O: what ranks the heavy hitters at the prompt's compaction (the sequence's first,
// when the pass that triggers it holds more than one token).
enum class PromptScore {
  kAccumulated,  // the score every compaction ranks by (accumulated or mean attention)
  kWindow,       // the compaction is SnapKV's with the sinks kept: the sinks, the last `window`
                 // slots, the rest by the pass's last `window` queries' attention pooled over
                 // `kernel` slots (pool=); later compactions rank by the usual score
  kReconstruction,  // as kWindow, with the attention that a reconstruction of the prompt gives
                    // each slot instead of its last queries' (KvPolicy::reconstruction_chunk):
                    // the prompt fed again after itself, teacher-forced, in chunks, its own KV
                    // dropped after each chunk. Needs no question (ratio mode only).
  kExpected,  // as kWindow, with each slot's score the attention the next `future` queries are
              // expected to give it (expected attention, scorer.h), estimated from the pass's
              // last `window` queries
};

// Expected attention: what a slot's expected attention is multiplied by.
enum class ValueWeight {
  kNorm,  // the L2 norm of its value, relative to the head's expected-attention-weighted mean
  kNone,  // nothing: the expected attention alone
};

// What happens to evicted slots.
enum class Merger { kNone, kD2o, kCam };

// D2O merge weights.
enum class MergeRule {
  kOff,       // evicted slots are dropped (the "no merging" ablation)
  kWeighted,  // paper: w_c = e / Z, w_e = exp(u_e) / Z, Z = e + sum exp(u_e)
  kAverage,   // ablation: equal weights 1 / (1 + |E_c|)
  kResearch,  // research code: (k_c + sum u_e k_e) / (1 + |E_c|), weights do not sum to 1
  kSized,     // weighted, each slot counted by the tokens it stands for (s = 1 + merged):
              // w_c = s_c e / Z, w_e = s_e exp(u_e) / Z, Z = s_c e + sum s_e exp(u_e)
};

// What the D2O similarity is measured on.
enum class SimOn { kKey, kValue, kKeyValue };

// D2O threshold update.
enum class EmaRule {
  kPaper,     // per evicted token: tau = beta * m_e + (1 - beta) * tau
  kResearch,  // per compaction: tau = 0.5 * tau + 0.5 * mean(m_e)
};

// Positions of kept slots (StreamingLLM).
enum class PosMode { kOriginal, kShift };

// D2O: the space keys are compared and merged in (spec key merge_keys=rotated|unrotated).
enum class MergeSpace {
  kRotated,    // keys as cached, after RoPE at their own positions (paper, research code)
  kUnrotated,  // keys rotated back to position 0 before the cosine and the weighted sum; the
               // merged key is rotated again for the retained slot's position
};

// D2O: who decides whether an evicted slot is merged.
enum class MergeDecision {
  kHead,   // each KV head compares its own evicted slots with its own threshold (paper)
  kToken,  // research code: the i-th evicted slot of every head of a layer is merged or dropped
           // together, by the mean over the heads of its best similarity against one threshold
           // per layer (heads evict different tokens: the "token" is an index, as there)
};

// D2O: layers kept whole.
enum class ProtectRule {
  kNone,   // every layer compressible (paper text)
  kEdges,  // layers 0, 1 and L-1 keep every slot they hold at the first compaction, charged to
           // the total: the other layers share what is left (research code keeps those layers,
           // uncharged: layers=research)
};

struct PolicyConfig {
  std::string name;  // preset name ("d2o", "h2o", ...)

  BudgetMode mode = BudgetMode::kRatio;
  double ratio = 0.2;  // rho, in (0, 1]
  int64_t budget = 0;  // slots per KV head and layer on average (budget mode)
  // Ratio mode: a prompt fed in chunks compressed once at its end, or compacted between chunks
  // to rho of its whole length (prefill=exact|bounded). kExact in budget mode, which always
  // compacts between chunks.
  PrefillMode prefill = PrefillMode::kExact;
  bool bounded_prefill() const {
    return mode == BudgetMode::kRatio && prefill == PrefillMode::kBounded;
  }

  LayerRule layers = LayerRule::kUniform;
  // True (D2O and its ablations): the budgets of all layers sum to round(rho * L * n) (B * L)
  // exactly (allocate_proportional). False (baselines with uniform budgets): every layer keeps
  // round(rho * n) (B).
  bool exact_total = false;
  Selector selector = Selector::kHeavyRecent;
  int sinks = 0;           // T
  int nm_n = 1, nm_m = 1;  // N:M split of S - T between heavy hitters and the recent window

  // Attention statistics.
  ScoreAgg agg = ScoreAgg::kSum;
  // What ranks the heavy hitters (scorer=, a name of scorer_defs(), scorer.h):
  // accumulated_attention (H2O, D2O paper reading), mean_attention (accumulated attention divided
  // by the queries that saw the slot: RoCo, the d2o default), ... The other selectors have their
  // own scorer (SnapKV: window attention; KeyDiff: key diversity) and leave this as it is.
  std::string scorer = "accumulated_attention";

  // SnapKV / PyramidKV.
  int window = 32;  // observation window w (last w queries score, last w slots kept)
  int kernel = 7;   // pooling kernel (odd)
  PoolKind pool = PoolKind::kAvg;
  double pbeta = 20.0;  // PyramidKV beta: the last layer gets 1/beta of the average top-k budget
  // SnapKV / PyramidKV in ratio mode (hold_budget=on): the prompt's compaction sets the budget, and
  // the cache then stays at it (one eviction per later token, as in budget mode), so that it holds
  // what a decode-time policy at the same ratio holds. Off in budget mode, where it is implied.
  bool hold = false;

  // StreamingLLM.
  PosMode pos = PosMode::kOriginal;

  // Merging.
  Merger merger = Merger::kNone;
  MergeRule merge = MergeRule::kOff;            // D2O
  SimOn sim = SimOn::kKey;                      // D2O
  EmaRule ema = EmaRule::kPaper;                // D2O
  double beta = 0.7;                            // D2O EMA weight of the newest similarity
  MergedScore mscore = MergedScore::kSum;       // D2O
  MergeSpace mspace = MergeSpace::kRotated;     // D2O
  MergeDecision decide = MergeDecision::kHead;  // D2O
  ProtectRule protect = ProtectRule::kNone;     // D2O
  // D2O: a merged slot stands for 1 + merged tokens; with mass on, attention adds
  // log(1 + merged) to its logit (proportional attention), so the group keeps the attention mass
  // its tokens had together instead of that of one token.
  bool mass = false;
  int cam_targets = 0;  // CaM: values spread over this many following slots (0 = the recent window)
  uint64_t seed = 0;    // CaM: Bernoulli sampling seed

  // KeyDiff.
  int recent = 0;  // the last `recent` slots are always kept
  // H2O / D2O: the share of the heavy-hitter places that go to the candidates KeyDiff ranks
  // highest (distinct_share=F; 0 = none, every place by attention score).
  double distinct = 0.0;
  PromptScore prompt = PromptScore::kAccumulated;
  // With prompt_ranking=window: the scores the prompt's compaction leaves (prompt_scores=).
  // kAccumulated: every slot keeps its accumulated attention. kWindow: every slot between the sinks
  // and the last `window` slots takes the window's pooled attention per window query times the
  // queries that have seen it (so mean attention reads the pooled score), before any merge combines
  // scores: later compactions rank the prompt's slots as its compaction did, until new attention
  // moves them.
  PromptScore pscore = PromptScore::kAccumulated;
  // D2O: false (prompt_merge=off): the prompt's compaction (as for `prompt`) evicts without
  // merging; the merges start with the next compaction.
  bool prompt_merge = true;

  // Expected attention (scorer=expected_attention, prompt_ranking=expected): the future
  // positions whose mean RoPE rotation the query statistics are turned by (future=), and what
  // the expected attention is multiplied by (value_weight=). Its queries: the last `window`.
  int future = 512;
  ValueWeight value_weight = ValueWeight::kNorm;

  // Where evicted slots go instead of away, for a later turn to recall (cold=memory, cold_type=,
  // cold_size=, recall=; kv/cold_tier.h). Its window is the policy's `window`.
  ColdTierConfig cold;

  // Per-head budgets (heads=ada, floor=alpha).
  HeadRule heads = HeadRule::kUniform;
  double floor = 0.2;

  // Statistics the attention kernel must produce.
  bool needs_accumulate() const {
    return selector == Selector::kHeavyRecent || merger == Merger::kCam;
  }
  // False: only the first compaction evicts (SnapKV / PyramidKV in ratio mode without
  // hold_budget=on: decode tokens are appended without eviction, as in the original).
  bool compacts_after_first() const {
    return selector != Selector::kSnapWindow || mode == BudgetMode::kBudget || hold;
  }
  bool needs_window() const {
    return selector == Selector::kSnapWindow || cold.enabled() ||
           (selector == Selector::kHeavyRecent &&
            (prompt == PromptScore::kWindow || prompt == PromptScore::kReconstruction));
  }
  // The prompt's compaction has a phase of its own (prompt_ranking= other than accumulated):
  // the sinks, the last `window` slots, the rest by a pooled ranking.
  bool prompt_phase() const {
    return selector == Selector::kHeavyRecent && prompt != PromptScore::kAccumulated;
  }

  bool operator==(const PolicyConfig&) const = default;

  // Smallest per-layer budget the selector can work with (slots per KV head).
  int min_budget() const {
    switch (selector) {
      case Selector::kSinkRecent:
        return sinks + 1;  // at least the newest slot
      case Selector::kHeavyRecent:
        return sinks + kMinBody;
      case Selector::kSnapWindow:
        return window;  // the observation window, top-k may be 0
      case Selector::kKeyDiff:
        return sinks + recent > 0 ? sinks + recent : 1;  // the protected slots, top-k may be 0
    }
    return 1;
  }
  // Slots beyond the sinks that a heavy-hitter layer keeps at least: 3 heavy + 1 recent at N:M =
  // 3:1, 2 + 2 at 1:1, so the newest token always survives.
  static constexpr int kMinBody = 4;
};

}  // namespace d2o
