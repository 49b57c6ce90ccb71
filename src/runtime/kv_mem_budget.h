// KV memory per sequence as the one setting of a policy's size (`--kv-mem-per-seq BYTES`, the
// Python package's `kv_mem_per_seq=`): the most slots per KV head and layer whose bytes fit, and
// the policy spec with that budget (the full cache keeps its spec and is capped at those slots
// by its caller instead).
#pragma once

#include <string>

#include "d2o/status.h"
#include "kv/kv_cache.h"

namespace d2o {

// The most slots per KV head and layer whose keys, values and slot metadata, with the policy's
// per-slot state (KvPolicy::state_bytes: D2O's key norms), fit in `bytes` (a byte size such as
// "20M", parse_byte_size) for cache configuration `cfg` (KvCache::bytes_for_slots, so the storage
// type decides), in *slots; returns `spec` with that budget. Errors: a bad byte size or spec, a
// size that holds no slot, a spec that sets ratio=, budget= or prefill= (the messages name
// --kv-mem-per-seq and --kv, as the command line gives them). "full" stays "full": the caller
// caps its slots at *slots instead.
// A policy with a cold tier (cold=) has the tier's bytes in memory counted before the slots
// (KvPolicy::cold_bytes for a conversation of n_ctx tokens: on disk its staging tails and extent
// lists, in memory what cold_size= lets it hold; a tier in memory without cold_size= is refused,
// as it grows with the conversation), and one layer's recall (ColdTierConfig::max_recall slots
// of every KV head, KvCache::bytes_for_one_layer), as the server's pool counts them. Under the cap
// a turn recalls at most the budget: a larger recall= or recall_all_up_to= (d2o's 512 and 2,048)
// is lowered to it in the returned spec, so that the peak is the budget in every layer and twice
// it in one.
Result<std::string> spec_for_kv_mem(const std::string& spec, const std::string& bytes,
                                    const KvCacheConfig& cfg, int64_t n_ctx, int* slots);

// How the budget was chosen, in words, for a KV report: "--kv-mem-per-seq 20M in f16: N slots
// per KV head and layer fit (...), the policy's budget=" (or ", the full cache's cap").
std::string kv_mem_note(const std::string& bytes, KvType type, int slots, bool full_cap);

}  // namespace d2o
