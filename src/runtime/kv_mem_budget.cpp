#include "runtime/kv_mem_budget.h"

#include <algorithm>

#include "kv/cold_tier.h"
#include "kv/policy.h"
#include "runtime/kv_pool.h"

namespace d2o {

Result<std::string> spec_for_kv_mem(const std::string& spec, const std::string& bytes,
                                    const KvCacheConfig& cfg, int64_t n_ctx, int* slots) {
  auto cap = parse_byte_size(bytes);
  if (!cap.ok()) return cap.status().with_context("--kv-mem-per-seq");
  auto policy = parse_kv_policy(spec);
  if (!policy.ok()) return policy.status().with_context("--kv");
  // A cold tier's bytes in memory count too: on disk, its staging tails and extent lists; in
  // memory, what it may hold (cold_size= and its slack); and a turn's recall, which one layer at a
  // time may hold above the budget (as the server's pool reserves it, Scheduler::footprint).
  const ColdTierConfig cold = (*policy)->cold_tier();
  if (cold.enabled() && cold.place == ColdPlace::kMemory && cold.max_slots <= 0) {
    return invalid_argument("--kv-mem-per-seq " + bytes + " with --kv '" + spec +
                            "': a cold tier in memory grows with the conversation; bound it "
                            "with cold_size=, or keep it on disk (cold=disk)");
  }
  // A turn's recall is held by one layer at a time; under a memory cap it is at most the budget
  // (recall= and recall_all_up_to= are lowered to it when larger), so that the peak stays within
  // twice the budget in one layer whatever the tier holds.
  const int64_t want = cold.enabled() ? cold.max_recall() : 0;
  const size_t tier = (*policy)->cold_bytes(cfg, std::max<int64_t>(1, n_ctx));
  auto fixed = [&](int64_t n) {
    return tier + KvCache::bytes_for_one_layer(cfg, std::min(want, n));
  };
  // What a sequence reserves for `n` slots: the cache's rows and slot metadata, and the policy's
  // own per-slot state (D2O's key norms), with the tier's. It grows with n: the largest n that
  // fits, by bisection.
  auto reserved = [&](int64_t n) {
    return KvCache::bytes_for_slots(cfg, n) + (*policy)->state_bytes(cfg, n + std::min(want, n)) +
           fixed(n);
  };
  int64_t lo = 0, hi = int64_t{1} << 30;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (reserved(mid) <= *cap)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (lo < 1) {
    return invalid_argument(
        "--kv-mem-per-seq " + bytes + " holds no slot: one takes " + std::to_string(reserved(1)) +
        " bytes with --kv-type " + kv_type_name(cfg.type) +
        (want > 0
             ? " (of which " + std::to_string(fixed(1)) + " for the cold tier and a turn's recall)"
             : std::string()));
  }
  *slots = static_cast<int>(lo);
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  if (name == "full") return spec;
  if (colon != std::string::npos) {
    const std::string args = "," + spec.substr(colon + 1);
    if (args.find(",ratio=") != std::string::npos || args.find(",budget=") != std::string::npos) {
      return invalid_argument("--kv-mem-per-seq sets the budget of --kv '" + spec +
                              "': leave out its ratio= / budget=");
    }
    if (args.find(",prefill=") != std::string::npos) {
      return invalid_argument("--kv-mem-per-seq gives --kv '" + spec +
                              "' a fixed budget, which compacts between a prompt's passes "
                              "already: leave out its prefill=");
    }
  }
  std::string out = spec;
  if (want > lo) {
    // The recall lowered to the budget: the keys given are replaced.
    std::string kept;
    if (colon != std::string::npos) {
      std::string args = spec.substr(colon + 1);
      size_t at = 0;
      while (at <= args.size()) {
        const size_t end = std::min(args.find(',', at), args.size());
        const std::string item = args.substr(at, end - at);
        if (item.rfind("recall=", 0) != 0 && item.rfind("recall_all_up_to=", 0) != 0)
          kept += (kept.empty() ? "" : ",") + item;
        at = end + 1;
      }
    }
    out = name + (kept.empty() ? "" : ":" + kept);
    out += std::string(kept.empty() ? ":" : ",") +
           "recall=" + std::to_string(std::min<int64_t>(cold.recall, lo)) +
           ",recall_all_up_to=" + std::to_string(std::min<int64_t>(cold.recall_all_up_to, lo));
    return out + ",budget=" + std::to_string(lo);
  }
  return spec + (colon == std::string::npos ? ":" : ",") + "budget=" + std::to_string(lo);
}

std::string kv_mem_note(const std::string& bytes, KvType type, int slots, bool full_cap) {
  return "--kv-mem-per-seq " + bytes + " in " + kv_type_name(type) + ": " + std::to_string(slots) +
         " slots per KV head and layer fit (key and value rows, slot metadata and the "
         "policy's per-slot state, and a cold tier's bytes in memory with one layer's recall, at "
         "most "
         "the budget)" +
         (full_cap ? ", the full cache's cap" : ", the policy's budget=");
}

}  // namespace d2o
