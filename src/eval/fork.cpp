#include "eval/fork.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "runtime/generator.h"

namespace d2o::eval {

namespace {

// Keeps everything but asks the attention kernel for the given statistics, so the cache after
// the prompt holds what any policy of the group would have seen just before its compaction.
class RecordingPolicy final : public KvPolicy {
 public:
  explicit RecordingPolicy(StatsNeeds needs) : needs_(needs) {}
  std::string spec() const override { return "eval-prefill-recorder"; }
  StatsNeeds needs() const override { return needs_; }
  Status compact(KvCache&, PolicyState&, const PassInfo&) const override { return {}; }
  int64_t peak_slots(int64_t, int64_t n_total, int) const override { return n_total; }
  int64_t peak_slots_for(const FeedPlan& plan) const override {
    return std::max(plan.n_prompt, plan.n_total);
  }

 private:
  StatsNeeds needs_;
};

// The statistics a policy does not ask for stay zero when it runs the prompt itself (append
// writes zeros, the kernel adds nothing); the shared prefill may have filled them for another
// policy of the group, so they are cleared to leave exactly the cache the policy's own pass would.
void clear_unused_stats(const KvPolicy& p, KvCache& cache) {
  const StatsNeeds n = p.is_full() ? StatsNeeds{} : p.needs();
  for (int il = 0; il < cache.n_layer(); ++il) {
    if (!n.accumulate) cache.reset_score_stats(il);
    if (n.window == 0) cache.reset_window_stats(il);
  }
  if (n.queries == 0) cache.drop_queries();
}

}  // namespace

Status copy_cache(const KvCache& src, KvCache& dst) {
  const KvCacheConfig &a = src.config(), &b = dst.config();
  if (a.n_layer != b.n_layer || a.n_head_kv != b.n_head_kv || a.head_dim != b.head_dim ||
      a.type != b.type) {
    return invalid_argument("copy_cache: the caches have different shapes or storage types");
  }
  // Exact capacity: the copy starts as compact as possible; appends grow it as usual.
  return dst.copy_slots_from(src);
}

PrefillGroups group_by_stats(std::span<const std::shared_ptr<const KvPolicy>> policies) {
  PrefillGroups g;
  g.group_of.assign(policies.size(), -1);
  // A group is (aggregation, window, recorded queries). The aggregation over a KV head's query
  // heads applies to both statistics (accumulated scores and window scores); a policy that needs
  // neither fits any aggregation, a policy without a window fits any window, one that records no
  // queries any count of them, and a full cache fits anything.
  struct Key {
    bool has_agg = false;
    bool accumulate = false;
    ScoreAgg agg = ScoreAgg::kSum;
    int window = 0;
    int queries = 0;
  };
  std::vector<Key> keys;
  for (size_t i = 0; i < policies.size(); ++i) {
    const KvPolicy& p = *policies[i];
    const StatsNeeds n = p.is_full() ? StatsNeeds{} : p.needs();
    int found = -1;
    for (size_t k = 0; k < keys.size() && found < 0; ++k) {
      const bool uses_agg = n.accumulate || n.window > 0;
      const bool agg_ok = !uses_agg || !keys[k].has_agg || keys[k].agg == n.agg;
      const bool win_ok = n.window == 0 || keys[k].window == 0 || keys[k].window == n.window;
      const bool q_ok = n.queries == 0 || keys[k].queries == 0 || keys[k].queries == n.queries;
      if (agg_ok && win_ok && q_ok) found = static_cast<int>(k);
    }
    if (found < 0) {
      keys.push_back({});
      found = static_cast<int>(keys.size() - 1);
    }
    Key& k = keys[static_cast<size_t>(found)];
    if (n.accumulate || n.window > 0) k.has_agg = true, k.agg = n.agg;
    if (n.accumulate) k.accumulate = true;
    if (n.window > 0) k.window = n.window;
    if (n.queries > 0) k.queries = n.queries;
    g.group_of[i] = found;
  }
  for (const Key& k : keys) {
    StatsNeeds n;
    n.accumulate = k.accumulate;
    n.agg = k.agg;
    n.window = k.window;
    n.queries = k.queries;
    g.needs.push_back(n);
  }
  return g;
}

Result<ForkedPrefill> prefill_forked(Engine& engine, std::span<const TokenId> prompt,
                                     std::span<const std::shared_ptr<const KvPolicy>> policies,
                                     KvType kv_type) {
  const std::vector<KvType> types(policies.size(), kv_type);
  return prefill_forked(engine, prompt, policies, types);
}

Result<ForkedPrefill> prefill_forked(Engine& engine, std::span<const TokenId> prompt,
                                     std::span<const std::shared_ptr<const KvPolicy>> policies,
                                     std::span<const KvType> kv_types) {
  if (prompt.empty()) return invalid_argument("the prompt is empty");
  if (policies.empty()) return invalid_argument("no policies to evaluate");
  if (kv_types.size() != policies.size())
    return invalid_argument("prefill_forked: one storage type per policy");
  const ModelHParams& hp = engine.model().hparams();
  ForkedPrefill out;
  out.seqs.resize(policies.size());
  out.last_logits_of.resize(policies.size());
  // One set of statistics groups per storage type, in order of first appearance.
  std::vector<KvType> types;
  for (const KvType& t : kv_types) {
    if (std::find(types.begin(), types.end(), t) == types.end()) types.push_back(t);
  }
  for (const KvType& kv_type : types) {
    std::vector<size_t> members;
    std::vector<std::shared_ptr<const KvPolicy>> ps;
    for (size_t i = 0; i < policies.size(); ++i) {
      if (!(kv_types[i] == kv_type)) continue;
      members.push_back(i);
      ps.push_back(policies[i]);
    }
    const PrefillGroups groups = group_by_stats(ps);
    for (size_t gi = 0; gi < groups.needs.size(); ++gi) {
      auto recorder = std::make_shared<RecordingPolicy>(groups.needs[gi]);
      Sequence pre(hp, kv_type, recorder);
      BatchEntry be;
      be.seq = &pre;
      be.tokens = prompt;
      be.logits_from = -1;
      std::vector<float> logits;
      D2O_RETURN_IF_ERROR(engine.forward(
          {&be, 1}, [&](int, int, const float* l) { logits.assign(l, l + hp.n_vocab); }));
      ++out.n_prefills;
      for (size_t m = 0; m < members.size(); ++m) {
        if (groups.group_of[m] != static_cast<int>(gi)) continue;
        const size_t i = members[m];
        out.last_logits_of[i] = logits;
        auto seq = std::make_unique<Sequence>(hp, kv_type, policies[i]);
        D2O_RETURN_IF_ERROR(copy_cache(pre.cache(), seq->cache()));
        clear_unused_stats(*policies[i], seq->cache());
        // What Engine::forward does after the prompt pass (the whole prompt, last-token logits).
        be.seq = seq.get();
        if (policies[i]->reconstruction_chunk(seq->policy_state()) > 0) {
          seq->prompt_tokens().assign(prompt.begin(), prompt.end());
          D2O_RETURN_IF_ERROR(engine.reconstruct(be));
          std::vector<int32_t>().swap(seq->prompt_tokens());
        }
        D2O_RETURN_IF_ERROR(engine.finish_pass(be, &engine.pool()));
        out.seqs[i] = std::move(seq);
      }
    }
  }
  out.last_logits = out.last_logits_of[0];
  return out;
}

Result<ForkedPrefill> prefill_in_chunks(Engine& engine, std::span<const TokenId> prompt,
                                        std::span<const std::shared_ptr<const KvPolicy>> policies,
                                        std::span<const KvType> kv_types, int chunk) {
  if (chunk <= 0) return prefill_forked(engine, prompt, policies, kv_types);
  if (prompt.empty()) return invalid_argument("the prompt is empty");
  if (policies.empty()) return invalid_argument("no policies to evaluate");
  if (kv_types.size() != policies.size())
    return invalid_argument("prefill_in_chunks: one storage type per policy");
  const ModelHParams& hp = engine.model().hparams();
  ForkedPrefill out;
  out.seqs.resize(policies.size());
  out.last_logits_of.resize(policies.size());
  for (size_t i = 0; i < policies.size(); ++i) {
    auto seq = std::make_unique<Sequence>(hp, kv_types[i], policies[i]);
    // The last pass holds the policy's observation window (BatchEntry::prompt_rest).
    const int window = policies[i]->is_full() ? 0 : policies[i]->needs().window;
    std::vector<float>& logits = out.last_logits_of[i];
    size_t at = 0;
    for (const int n : prefill_chunks(static_cast<int64_t>(prompt.size()), chunk, window)) {
      BatchEntry be;
      be.seq = seq.get();
      be.tokens = prompt.subspan(at, static_cast<size_t>(n));
      at += static_cast<size_t>(n);
      be.prompt_rest = static_cast<int64_t>(prompt.size() - at);
      be.logits_from = be.prompt_rest > 0 ? BatchEntry::kNoLogits : -1;
      D2O_RETURN_IF_ERROR(engine.forward(
          {&be, 1}, [&](int, int, const float* l) { logits.assign(l, l + hp.n_vocab); }));
    }
    ++out.n_prefills;
    out.seqs[i] = std::move(seq);
  }
  out.last_logits = out.last_logits_of[0];
  return out;
}

}  // namespace d2o::eval
