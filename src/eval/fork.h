// Shared prefill for prompt-then-compress evaluations: run a prompt once, then give every policy
// its own copy of the prompt's KV cache, compacted by that policy exactly as the engine would
// have compacted it after the prompt pass.
//
// Why: the fidelity and needle protocols compare many policies (and ratios) on the same prompt.
// The prompt's forward pass does not depend on the policy (attention outputs are the same with
// or without statistics; the policy only acts after the pass), so running it once per prompt
// instead of once per policy divides the cost of a 20-policy comparison by about 20.
// Exactness: the one prefill asks the attention kernel for the statistics every policy of its
// group needs (accumulated scores with one aggregation, the largest observation window), then
// each copy is finished by Engine::finish_pass, the engine's own step after a pass (advance,
// compaction, trim), as if the prompt had been that sequence's pass. Policies whose statistics cannot be
// computed together (different aggregations, different non-zero windows or counts of recorded
// queries) get separate prefills.
// tests/unit/test_eval_fork.cpp checks that a forked sequence continues bit for bit like a
// sequence that ran the prompt through Engine::forward itself.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "d2o/status.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "runtime/engine.h"
#include "runtime/sequence.h"

namespace d2o::eval {

// Deep copy of a cache's contents (keys, values, positions, scores, window statistics, merge
// counts, recorded queries) into `dst`, which must have the same shape. dst's previous contents are dropped.
Status copy_cache(const KvCache& src, KvCache& dst);

// Groups policies whose statistics one prefill can compute together; returns the group index
// of each policy and, per group, the statistics to ask for.
struct PrefillGroups {
  std::vector<int> group_of;      // [n_policies]
  std::vector<StatsNeeds> needs;  // [n_groups]
};
PrefillGroups group_by_stats(std::span<const std::shared_ptr<const KvPolicy>> policies);

struct ForkedPrefill {
  // One sequence per policy, in the order given: the prompt processed, then compacted by that
  // policy (n_past = prompt length).
  std::vector<std::unique_ptr<Sequence>> seqs;
  // Logits of the prompt's last token, [n_vocab]. Computed before any compaction, hence the
  // same for every policy of one storage type (the first policy's).
  std::vector<float> last_logits;
  // The same per policy: storage types differ in what the prompt's attention read.
  std::vector<std::vector<float>> last_logits_of;
  int n_prefills = 0;  // forward passes over the prompt that were needed (groups)
};

Result<ForkedPrefill> prefill_forked(Engine& engine, std::span<const TokenId> prompt,
                                     std::span<const std::shared_ptr<const KvPolicy>> policies,
                                     KvType kv_type);
// Each policy with its own storage type (kv_types[i] for policies[i]): one prefill per storage
// type and statistics group, since the prompt's attention reads the stored (rounded) rows.
Result<ForkedPrefill> prefill_forked(Engine& engine, std::span<const TokenId> prompt,
                                     std::span<const std::shared_ptr<const KvPolicy>> policies,
                                     std::span<const KvType> kv_types);

// The same result, with the prompt fed to every policy's own sequence in passes of `chunk`
// tokens (prefill_chunks, each but the last announcing the rest, as generate() feeds a prompt),
// so that a fixed budget or prefill=bounded compacts between the passes: what `--chunk` asks of
// the evaluations. Nothing is shared (n_prefills = policies); the full cache and prefill=exact
// policies get the one pass's caches bit for bit. chunk <= 0: prefill_forked.
Result<ForkedPrefill> prefill_in_chunks(Engine& engine, std::span<const TokenId> prompt,
                                        std::span<const std::shared_ptr<const KvPolicy>> policies,
                                        std::span<const KvType> kv_types, int chunk);

}  // namespace d2o::eval
