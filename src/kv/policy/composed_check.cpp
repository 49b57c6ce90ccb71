// ComposedPolicy::check: what a configuration refuses to compact, before anything is touched.
#include <string>

#include "kv/policy/composed.h"

namespace d2o {

Status ComposedPolicy::ragged_error() {
  return invalid_argument(
      "KV cache heads hold different slot counts (per-head budgets, heads=ada), which this "
      "policy cannot compact (a state belongs to one policy)");
}

Status ComposedPolicy::check(const KvCache& cache, const PolicyState& state,
                             const PassInfo& pass) const {
  const int L = cache.n_layer();
  const size_t nl = static_cast<size_t>(L);
  if (state.budgets_set && state.budgets.size() != nl) {
    return invalid_argument("KV policy state holds budgets for " +
                            std::to_string(state.budgets.size()) + " layers but the cache has " +
                            std::to_string(L) + " (a state belongs to one sequence)");
  }
  if (cfg_.pos == PosMode::kShift && cache.config().has_sliding()) {
    // Shifting positions would have to re-rotate the sliding-window layers' keys too, with their
    // own RoPE; not supported.
    return unsupported(
        "KV policy '" + cfg_.name +
        "' with positions=shifted cannot run on a model with sliding-window layers (use "
        "positions=original)");
  }
  if (cache.config().type.rot_k &&
      (cfg_.pos == PosMode::kShift ||
       (cfg_.merger == Merger::kD2o && cfg_.mspace == MergeSpace::kUnrotated))) {
    // RoPE applied to a stored key does not commute with the rotation of rotated storage.
    return unsupported(
        "KV policy '" + cfg_.name + "' with " +
        (cfg_.pos == PosMode::kShift ? "positions=shifted" : "merge_keys=unrotated") +
        " re-rotates stored keys by RoPE, which rotated key storage (" +
        kv_type_name(cache.config().type) +
        ") does not allow (use positions=original / merge_keys=rotated or a type without r)");
  }
  if (reads_queries(cfg_)) {
    // Recorded queries of another shape than the cache's heads (a cache filled elsewhere).
    for (int il = 0; il < L; ++il) {
      const QueryWindow& w = cache.queries(il);
      if (!w.empty() && (w.head_dim() != cache.config().head_dim ||
                         w.n_head() % cache.config().n_head_kv != 0)) {
        return invalid_argument(
            "KV policy '" + cfg_.name + "': layer " + std::to_string(il) + " recorded queries of " +
            std::to_string(w.n_head()) + " heads of " + std::to_string(w.head_dim()) +
            " elements, which do not fit the cache's " + std::to_string(cache.config().n_head_kv) +
            " KV heads of " + std::to_string(cache.config().head_dim));
      }
    }
  }
  if (cfg_.heads != HeadRule::kAda) {
    for (int il = 0; il < L; ++il)
      if (!cache.layer(il).uniform()) return ragged_error();
  }
  if (cfg_.pos == PosMode::kShift && !pass.rope) {
    return invalid_argument(
        "KV policy '" + cfg_.name +
        "' with positions=shifted needs the model's RoPE parameters (PassInfo::rope)");
  }
  if (cfg_.merger == Merger::kD2o && cfg_.mspace == MergeSpace::kUnrotated &&
      (!pass.rope || pass.rope->head_dim != cache.config().head_dim)) {
    return invalid_argument(
        "KV policy '" + cfg_.name +
        "' with merge_keys=unrotated needs the model's RoPE parameters (PassInfo::rope) "
        "for the cache's head size");
  }
  if (cfg_.pos == PosMode::kShift && pass.rope->head_dim != cache.config().head_dim) {
    return invalid_argument("KV policy '" + cfg_.name + "' with positions=shifted: RoPE head_dim " +
                            std::to_string(pass.rope->head_dim) + " does not match the cache's " +
                            std::to_string(cache.config().head_dim));
  }
  return {};
}

}  // namespace d2o
