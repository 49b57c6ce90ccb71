// The policy seam: how a KV-cache compression method plugs into the engine.
//
//   attention kernel --fills--> slot statistics (KvLayer::score / window)
//   KvPolicy::compact(cache, state, pass) --> per layer: budget, CompactionPlan --> KvCache::apply
//
// The engine calls compact() once per forward pass of a sequence, after every layer ran, for
// every pass alike (a whole prompt, a chunk of a long text, or one decoded token), so
// prompt-then-compress and streaming with a fixed capacity are one mechanism. A policy may also
// let the engine compact a layer right after that layer's attention in a one-token pass
// (compacts_per_layer / compact_layer), while the layer's slots are still in the CPU's caches;
// the result is the same as compacting it after the pass. Policies are const
// and stateless; everything that evolves per sequence (budgets once decided, EMA thresholds,
// counters) lives in the PolicyState the sequence owns: a common part, and the policy's own
// PolicyExtState.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/thread_pool.h"
#include "d2o/status.h"
#include "kv/attention.h"
#include "kv/cold_tier.h"
#include "kv/kv_cache.h"
#include "ops/ops.h"

namespace d2o {

// What the attention kernel must compute for a policy. Statistics not asked for cost nothing.
struct StatsNeeds {
  bool accumulate = false;        // accumulated attention per slot (H2O, D2O, RoCo, ...)
  ScoreAgg agg = ScoreAgg::kSum;  // aggregation over the query heads of a KV head
  int window = 0;                 // > 0: attention of the pass's last `window` queries (SnapKV)
  bool mass = false;              // proportional attention over merged slots (AttnStatsRequest)
  // > 0: the queries of the sequence's last `queries` tokens, per layer and query head, before
  // RoPE (KvCache::queries; expected attention reads them).
  int queries = 0;
};

// Describes the forward pass that just ran for a sequence.
struct PassInfo {
  int n_tokens = 0;         // tokens in this pass
  int64_t n_past = 0;       // tokens of the sequence processed so far, this pass included
  bool first_pass = false;  // the sequence's first pass (its prompt, in prompt-then-compress)
  // Chunked prefill: prompt tokens that later passes will still bring (0 when this pass ends the
  // prompt, or is a decode step). A ratio policy's first compaction (prompt-then-compress) waits
  // for the pass with prompt_rest == 0, so a prompt prefilled in chunks is compressed once, as a
  // whole, exactly like a prompt prefilled in one pass; with prefill=bounded its budget is the
  // ratio of the tokens held and announced, and it compacts between the chunks.
  int64_t prompt_rest = 0;
  // The pass recalled slots from the cache's cold tier (a new turn): its compaction ranks the
  // turn's slots, hot and recalled alike, as a prompt's compaction ranks a prompt's.
  bool recalled = false;
  const RopeParams* rope = nullptr;  // the model's RoPE (to re-rotate keys when shifting positions)
  // Optional: compact() plans layers in parallel on it, compact_layer() a layer's KV heads and
  // their slot moves (results never depend on the thread count). compact_layer() is given one
  // only outside the pool's own tasks.
  ThreadPool* pool = nullptr;
};

// How a sequence will be fed (KvPolicy::peak_slots_for).
struct FeedPlan {
  int64_t n_prompt = 0;  // prompt tokens
  int64_t n_total = 0;   // prompt + generated tokens
  int prompt_chunk = 1;  // longest prompt pass
  int decode_chunk = 1;  // longest pass after the prompt
  // KV heads per layer: per-head budgets (heads=ada) let one head hold more than the layer's
  // budget per head, by at most what the other heads give up, which depends on their number.
  // 0: unknown (such a policy is then bounded by n_total).
  int n_head_kv = 0;
};

// A policy's own per-sequence state, beside the common part of PolicyState: what only that
// policy reads (D2O's merge thresholds, how budgets were derived) and its per-thread scratch.
// The policy creates it on first use (PolicyState::ext_as) and is the only one to interpret it.
class PolicyExtState {
 public:
  virtual ~PolicyExtState() = default;
  // A copy for another sequence (Sequence::copy_from): the state; scratch may start empty.
  virtual std::unique_ptr<PolicyExtState> clone() const = 0;
  // Bytes the state holds between passes, its working scratch not counted (the KV report).
  virtual size_t bytes() const { return 0; }
};

// Owns a PolicyExtState; copying clones it, so PolicyState stays a copyable value.
class PolicyExtPtr {
 public:
  PolicyExtPtr() = default;
  PolicyExtPtr(const PolicyExtPtr& o) : p_(o.p_ ? o.p_->clone() : nullptr) {}
  PolicyExtPtr& operator=(const PolicyExtPtr& o) {
    if (this != &o) p_ = o.p_ ? o.p_->clone() : nullptr;
    return *this;
  }
  PolicyExtPtr(PolicyExtPtr&&) noexcept = default;
  PolicyExtPtr& operator=(PolicyExtPtr&&) noexcept = default;
  PolicyExtState* get() const { return p_.get(); }
  void reset(std::unique_ptr<PolicyExtState> p) { p_ = std::move(p); }

 private:
  std::unique_ptr<PolicyExtState> p_;
};

// Per-sequence mutable policy state: the part every policy and the engine share. A policy's own
// fields live in `ext`.
struct PolicyState {
  // budgets[il] == kNoBudget: the layer is never compacted (D2O research reading: layers 0, 1
  // and L-1 keep everything).
  static constexpr int kNoBudget = -1;

  bool budgets_set = false;  // set at the sequence's first compaction, then kept
  // [n_layer] slots per KV head each layer may keep (heads=ada: budget x n_head_kv in all, shared
  // over the heads)
  std::vector<int> budgets;
  // Counters are slots summed over the layer's KV heads (every head evicts the same number of
  // slots per compaction, unless heads=ada; how many of them merge differs per head).
  std::vector<int64_t> evicted;  // [n_layer] slots evicted so far (merged or dropped)
  std::vector<int64_t> merged;   // [n_layer] evicted slots merged into kept ones
  int64_t n_compactions = 0;     // passes whose compaction removed at least one slot
  // A layer of the current pass was compacted by compact_layer(); compact() counts the pass.
  bool layer_compacted = false;
  // RoPE position of the next token = n_past - pos_shift. Common, not one policy's: the engine
  // reads it for every sequence to position new tokens (StreamingLLM with re-rotated keys raises
  // it by the positions it removes; any policy that renumbers positions would do the same).
  int64_t pos_shift = 0;
  // Reusable memory: the plans of the layers compacted by the last pass ([n_layer]; a layer's
  // plan is valid when it was compacted, its merge list only until it is released as the policy
  // says) and the layers to compact.
  std::vector<CompactionPlan> plans;
  std::vector<int32_t> todo;
  // The policy's own state (null until the policy creates it).
  PolicyExtPtr ext;

  // The policy's state as T, created (replacing any other kind) on first use. One dynamic_cast:
  // call it once per compaction, not per slot.
  template <class T>
  T& ext_as() {
    T* p = dynamic_cast<T*>(ext.get());
    if (!p) {
      auto made = std::make_unique<T>();
      p = made.get();
      ext.reset(std::move(made));
    }
    return *p;
  }
  // The policy's state as T, or null when there is none of that kind.
  template <class T>
  const T* ext_if() const {
    return dynamic_cast<const T*>(ext.get());
  }
  template <class T>
  T* ext_if() {
    return dynamic_cast<T*>(ext.get());
  }

  void reset() { *this = PolicyState(); }

  // Bytes held between passes: the plans' lists, budgets and counters, and the policy's own
  // state (PolicyExtState::bytes). The KV report prints it.
  size_t held_bytes() const {
    size_t b = budgets.capacity() * sizeof(int) +
               (evicted.capacity() + merged.capacity()) * sizeof(int64_t) +
               todo.capacity() * sizeof(int32_t) + plans.capacity() * sizeof(CompactionPlan);
    for (const CompactionPlan& p : plans) {
      b += (p.keep.capacity() + p.head_keep.capacity() + p.head_off.capacity()) * sizeof(int32_t) +
           p.merges.capacity() * sizeof(MergeTerm);
    }
    return b + (ext.get() ? ext.get()->bytes() : 0);
  }
};

class KvPolicy {
 public:
  virtual ~KvPolicy() = default;
  // The canonical spec string ("d2o:ratio=0.2,sinks=4,heavy_recent=3:1,beta=0.7,..."): parsing
  // it gives back an identical policy.
  virtual std::string spec() const = 0;
  virtual StatsNeeds needs() const = 0;
  // The statistics the next pass must collect in `state`: needs() (the most any pass asks for,
  // which chunking and validation plan by) or less. A prompt_ranking=window policy asks for the
  // window only until its first compaction and for a turn that recalls from the cold tier
  // (`recalls`: the compactions that read it).
  virtual StatsNeeds pass_needs(const PolicyState& state, bool recalls = false) const {
    (void)state;
    (void)recalls;
    return needs();
  }
  // True when the policy never removes anything (the engine then skips statistics entirely).
  virtual bool is_full() const { return false; }
  // Compacts the cache after a forward pass (no-op when within budget).
  virtual Status compact(KvCache& cache, PolicyState& state, const PassInfo& pass) const = 0;
  // Compression under memory pressure, for a sequence whose compactions were deferred while
  // memory was free (Sequence::compaction_deferred): one step compacts every compressible layer
  // to half the slots it holds, but never below the budgets the policy gives it (decided at the
  // first step, as at a first compaction: its ratio of what the layers hold, or its budget).
  // What is evicted goes to the cache's cold tier when it has one. `pass` describes the sequence
  // as it stands (n_past, no tokens announced). Returns false when nothing was evicted: the
  // policy allows no more (the full cache never compresses).
  virtual Result<bool> compress_step(KvCache& cache, PolicyState& state,
                                     const PassInfo& pass) const {
    (void)cache;
    (void)state;
    (void)pass;
    return false;
  }
  // True when, in this state, the compaction after a one-token pass may be done layer by layer:
  // compact_layer(il) right after layer il's attention, for every layer, then compact() as
  // usual. Layer il's compaction must then depend only on layer il and per-layer state, so that
  // the result is the one compact() would give.
  virtual bool compacts_per_layer(const PolicyState&) const { return false; }
  // Compacts layer il of a one-token pass described by `pass` (n_past counting the pass).
  virtual Status compact_layer(KvCache&, PolicyState&, const PassInfo&, int /*il*/) const {
    return {};
  }
  // Dot products the next one-token pass should form while it reads each layer's keys (armed by
  // compact_layer, read back by the next one; AttnProbe), or null. The engine hands it to the
  // attention of passes it compacts layer by layer.
  virtual AttnProbe* attention_probe(PolicyState&) const { return nullptr; }
  // The most slots per KV head and layer this policy can hold for a sequence of n_total tokens
  // (prompt + generation) fed in passes of at most max_chunk tokens: admission control and
  // memory reports use it. The full cache returns n_total.
  // Tokens per pass of the prompt's reconstruction before the sequence's first compaction, or 0
  // (none, the default). Otherwise the engine, once the prompt is whole, feeds it again after
  // itself in passes of that many tokens (teacher-forced, positions after the prompt), sums the
  // attention every one of their queries gives each slot into the window statistics
  // (KvLayer::window, scaled to the queries a window of StatsNeeds::window holds), and drops the
  // passes' own slots: the compaction then ranks the prompt by what reconstructing it attends
  // to, whatever question comes later. Peak: the prompt's slots plus one pass's.
  // Where the slots it evicts go (kv/cold_tier.h): no cold tier unless the policy has one. A
  // sequence's cache gets its tier when the sequence is made.
  virtual ColdTierConfig cold_tier() const { return {}; }
  virtual int reconstruction_chunk(const PolicyState& state) const {
    (void)state;
    return 0;
  }
  virtual int64_t peak_slots(int64_t n_prompt, int64_t n_total, int max_chunk) const = 0;
  // The same for a sequence fed as a scheduler feeds it: the prompt in passes of at most
  // plan.prompt_chunk tokens, each but the last announcing the rest (PassInfo::prompt_rest, so
  // prompt-then-compress compacts the whole prompt once), then passes of at most
  // plan.decode_chunk tokens (1 for plain decoding). Tighter than peak_slots() when decoding
  // token by token after a chunked prompt.
  virtual int64_t peak_slots_for(const FeedPlan& plan) const = 0;
  // Slots per KV head that one layer at a time may hold beyond peak_slots_for(plan): a turn's
  // recall from a cold tier where each layer hands its recalled slots back (compacts) before the
  // next layer recalls (KvCache::set_slot_limit's one_layer_extra). 0: none.
  virtual int64_t one_layer_extra_for(const FeedPlan& /*plan*/) const { return 0; }
  // Bytes of the policy's per-sequence state kept for a sequence's life that grow with the slots
  // it holds (at most `slots` per KV head and layer), beyond the cache's rows and slot metadata
  // (KvCache::bytes_for_slots): a memory pool reserves both. Also what the policy has the cache
  // keep whatever the slots (the queries it asks the attention pass to record,
  // StatsNeeds::queries). Working scratch of one compaction (bounded by one layer's slots per
  // thread) is not counted. 0: nothing kept per slot.
  virtual size_t state_bytes(const KvCacheConfig& /*cfg*/, int64_t /*slots*/) const { return 0; }
  // Bytes its cold tier (cold_tier()) may hold for a sequence of n_total tokens: the evicted
  // slots' rows and metadata, in memory. 0 without a tier.
  size_t cold_bytes(const KvCacheConfig& cfg, int64_t n_total) const;
};

// The full cache: keeps everything.
class FullPolicy final : public KvPolicy {
 public:
  std::string spec() const override { return "full"; }
  StatsNeeds needs() const override { return {}; }
  bool is_full() const override { return true; }
  Status compact(KvCache&, PolicyState&, const PassInfo&) const override { return {}; }
  int64_t peak_slots(int64_t, int64_t n_total, int) const override { return n_total; }
  int64_t peak_slots_for(const FeedPlan& plan) const override {
    return std::max(plan.n_prompt, plan.n_total);
  }
};

// Parses a policy spec such as "full", "h2o:ratio=0.2", "d2o:budget=512,beta=0.7". Errors name
// the bad key or value and list what is allowed. Implemented in src/kv/policy/spec.cpp.
Result<std::unique_ptr<KvPolicy>> parse_kv_policy(std::string_view spec);

// A canonical d2o spec of the time d2o's defaults were the paper's, which today's grammar reads
// as another policy (that form leaves out prompt=acc, pmerge=on and pscore=acc, today
// prompt_ranking=accumulated, prompt_merge=on and prompt_scores=accumulated, where they held;
// it may use the key names of before they were made readable or today's): the same policy in
// today's canonical form (d2o:reading=paper,...). "" for any other string. Session files and
// the results page read specs recorded then through it.
std::string paper_era_d2o_spec(const std::string& spec);

// Today's canonical form of a spec recorded as canonical at any time: as written, with the key
// names of before they were made readable (nm=, mrope=post, ...; the same policy), or of the
// time d2o's defaults were the paper's (paper_era_d2o_spec), of d2o before its cold tier (read as
// cold=none) or of a cold tier before recall_ranking= was printed (read as recall_ranking=max)
// or before recall_all_up_to= was (read as recall_all_up_to=0).
// "" for a spec that was never canonical. Session files read their specs through it.
std::string recorded_spec_today(const std::string& spec);

}  // namespace d2o
