// The model and cache layout fuzz_session_file reads session files for, and a way to grow a
// conversation's cache without a model (make_seeds.cpp writes its seeds with it).
#pragma once

#include <vector>

#include "kv/policy.h"
#include "ops/ops.h"
#include "serve/session_file.h"

namespace d2o::fuzz {

inline serve::SessionFileContext session_context() {
  serve::SessionFileContext c;
  c.model = {123456, 0x5eed5eed5eed5eedull};
  c.cache = KvCacheConfig(2, 2, 32, KvType::kF16);
  c.n_vocab = 64;
  c.max_positions = 256;
  return c;
}

inline RopeParams session_rope() {
  RopeParams r;
  r.head_dim = 32;
  r.n_rot = 32;
  return r;
}

// One token at position n_past - pos_shift appended to every layer (keys and values `x`,
// attention statistics as if each slot was attended by 1 / n_slot), then the policy's
// compaction after that pass, as the engine runs it.
inline Status feed_token(const KvPolicy& policy, KvCache& cache, PolicyState& state,
                         int64_t& n_past, float x) {
  const KvCacheConfig& c = cache.config();
  std::vector<float> row(static_cast<size_t>(c.n_head_kv * c.head_dim), x);
  const int32_t pos = static_cast<int32_t>(n_past - state.pos_shift);
  for (int il = 0; il < c.n_layer; ++il) {
    const int n = cache.layer(il).n_slot() + 1;
    D2O_RETURN_IF_ERROR(cache.reserve(il, n, false));
    cache.append(il, row.data(), row.data(), &pos, 1);
    KvLayer& L = cache.layer_for_attention(il);
    for (int h = 0; h < c.n_head_kv; ++h)
      for (int j = 0; j < n; ++j) L.score_accum(h)[j] += 1.0f / static_cast<float>(n);
  }
  ++n_past;
  static const RopeParams rope = session_rope();
  PassInfo pass;
  pass.n_tokens = 1;
  pass.n_past = n_past;
  pass.first_pass = n_past == 1;
  pass.rope = &rope;
  return policy.compact(cache, state, pass);
}

}  // namespace d2o::fuzz
