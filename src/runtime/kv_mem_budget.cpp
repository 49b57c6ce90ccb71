#include "runtime/kv_mem_budget.h"

#include "kv/policy.h"
#include "runtime/kv_pool.h"

namespace d2o {

Result<std::string> spec_for_kv_mem(const std::string& spec, const std::string& bytes,
                                    const KvCacheConfig& cfg, int* slots) {
  auto cap = parse_byte_size(bytes);
  if (!cap.ok()) return cap.status().with_context("--kv-mem-per-seq");
  auto policy = parse_kv_policy(spec);
  if (!policy.ok()) return policy.status().with_context("--kv");
  // What a sequence reserves for `n` slots: the cache's rows and slot metadata, and the policy's
  // own per-slot state (D2O's key norms). It grows with n: the largest n that fits, by bisection.
  auto reserved = [&](int64_t n) {
    return KvCache::bytes_for_slots(cfg, n) + (*policy)->state_bytes(cfg, n);
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
    return invalid_argument("--kv-mem-per-seq " + bytes + " holds no slot: one takes " +
                            std::to_string(reserved(1)) + " bytes with --kv-type " +
                            kv_type_name(cfg.type));
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
  return spec + (colon == std::string::npos ? ":" : ",") + "budget=" + std::to_string(lo);
}

std::string kv_mem_note(const std::string& bytes, KvType type, int slots, bool full_cap) {
  return "--kv-mem-per-seq " + bytes + " in " + kv_type_name(type) + ": " + std::to_string(slots) +
         " slots per KV head and layer fit (key and value rows, slot metadata and the "
         "policy's per-slot state)" +
         (full_cap ? ", the full cache's cap" : ", the policy's budget=");
}

}  // namespace d2o
