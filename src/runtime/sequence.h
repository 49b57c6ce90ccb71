// Sequence: one stream of tokens being processed (a prompt and its continuation, a chat, a long
// text fed in chunks). It owns its KV cache and the mutable state of its KV policy, so many
// sequences with different policies can share one Engine and be advanced in one batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/cold_tier.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "model/layer_desc.h"

namespace d2o {

class Sequence {
 public:
  Sequence(const ModelHParams& hp, KvType kv_type, std::shared_ptr<const KvPolicy> policy)
      : cache_(kv_cache_config(hp, kv_type)),
        policy_(policy ? std::move(policy) : std::make_shared<FullPolicy>()) {
    cache_.enable_cold(policy_->cold_tier());
  }

  KvCache& cache() { return cache_; }
  const KvCache& cache() const { return cache_; }
  const KvPolicy& policy() const { return *policy_; }
  PolicyState& policy_state() { return state_; }
  const PolicyState& policy_state() const { return state_; }
  // Tokens processed so far; the next token's position.
  int64_t n_past() const { return n_past_; }
  void advance(int64_t n) { n_past_ += n; }
  bool started() const { return n_past_ > 0; }
  // Chunked prefill: prompt tokens the last pass announced as still to come (BatchEntry::
  // prompt_rest); 0 when no prompt is in progress. Set by the engine.
  int64_t prompt_pending() const { return prompt_pending_; }
  void set_prompt_pending(int64_t n) { prompt_pending_ = n; }

  // Compactions deferred (a server that compresses only under memory pressure, `serve
  // --compress when-needed`): the engine still collects the statistics the policy reads, but
  // never compacts or reconstructs this sequence, whose cache stays full (what a turn recalls
  // from a cold tier stays in it too); the server compresses it later, idle, with
  // KvPolicy::compress_step. Set by the scheduler.
  bool compaction_deferred() const { return compaction_deferred_; }
  void set_compaction_deferred(bool on) { compaction_deferred_ = on; }

  // The prompt's tokens so far, kept only while the policy will reconstruct the prompt before
  // its first compaction (KvPolicy::reconstruction_chunk); set by the engine.
  const std::vector<int32_t>& prompt_tokens() const { return prompt_tokens_; }
  std::vector<int32_t>& prompt_tokens() { return prompt_tokens_; }
  // Becomes a copy of `other`'s cache, policy state and position (the policies must be the same
  // object: a policy state only means something to its policy).
  Status copy_from(const Sequence& other) {
    if (other.policy_ != policy_) return invalid_argument("Sequence copy: the sequences use different KV policies");
    D2O_RETURN_IF_ERROR(cache_.copy_from(other.cache_));
    state_ = other.state_;
    n_past_ = other.n_past_;
    prompt_tokens_ = other.prompt_tokens_;
    return {};
  }

  // How many of the tokens seen so far, at most n, this sequence can be cut back to and go on
  // from exactly as a sequence fed only them would attend (KvCache::intact_prefix): none while a
  // prompt is in progress, after positions were renumbered (PolicyState::pos_shift), or once a
  // cold tier has taken anything (a recalled slot comes back re-quantised); else the prefix
  // before the first slot a compaction evicted or merged, and for a sliding-window layer only
  // while its window still holds what that prefix needs. A model with recurrent layers (qwen35)
  // cannot be cut back at all: its state holds every token seen (cut_back_refusal says so).
  int64_t reusable_prefix(int64_t n) const {
    n = std::min(n, n_past_);
    if (n <= 0 || prompt_pending_ > 0 || state_.pos_shift != 0) return 0;
    if (const ColdTier* cold = cache_.cold();
        cold && (state_.n_compactions > 0 || cold->total_slots() > 0 || cold->recalled_slots() > 0))
      return 0;
    return cache_.intact_prefix(n);
  }
  // Why this sequence cannot be cut back to a prefix whatever the policy did, or null: its model
  // keeps a recurrent state (linear-attention layers), which cannot be rewound; it is rebuilt.
  const char* cut_back_refusal() const {
    return cache_.config().has_recurrent()
               ? "the model's recurrent (linear-attention) state cannot be rewound to a prefix"
               : nullptr;
  }

  // Cuts the sequence back to its first n tokens (reusable_prefix(n) must be n): the cache drops
  // every slot at a later position, the position becomes n, and the policy state starts again as
  // a sequence's that was never compacted (budgets are decided at the next compaction, as for a
  // new prompt). The kept slots' accumulated attention statistics stay as gathered (the removed
  // tokens' queries included). Errors: n out of range or not a reusable prefix (nothing changed).
  Status truncate(int64_t n) {
    if (n < 0 || n > n_past_)
      return invalid_argument("Sequence truncate: " + std::to_string(n) +
                              " tokens is outside [0, " + std::to_string(n_past_) + "]");
    if (n == n_past_) return {};
    if (const char* why = cut_back_refusal(); why && n > 0)
      return unsupported(std::string("Sequence truncate: ") + why +
                         "; feed the sequence again from the start");
    if (n > 0 && reusable_prefix(n) != n)
      return invalid_argument("Sequence truncate: the cache does not hold its first " +
                              std::to_string(n) + " tokens intact");
    if (n == 0) {
      reset();
      return {};
    }
    cache_.truncate(n);
    state_.reset();
    n_past_ = n;
    std::vector<int32_t>().swap(prompt_tokens_);
    return {};
  }

  // Forgets everything (cache, policy state, position).
  void reset() {
    cache_.clear();
    state_.reset();
    n_past_ = 0;
    prompt_pending_ = 0;
    std::vector<int32_t>().swap(prompt_tokens_);
  }

 private:
  KvCache cache_;
  std::shared_ptr<const KvPolicy> policy_;
  PolicyState state_;
  int64_t n_past_ = 0;
  int64_t prompt_pending_ = 0;
  bool compaction_deferred_ = false;
  std::vector<int32_t> prompt_tokens_;
};

}  // namespace d2o
