#include "kv/policy/select_heads.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "kv/policy/keeper.h"
#include "kv/policy/spec_keys.h"

namespace d2o {

void select_ada(const PolicyConfig& cfg, const float* score, const int32_t* off, const int32_t* n,
                int G, int S, int32_t* keep, int32_t* count, SelectScratch& sc) {
  const KeepShape shape = Keeper::of(cfg).shape(S);
  const int t = shape.sinks, r = shape.recent, k = shape.top;
  const int f = static_cast<int>(std::floor(cfg.floor * k));
  const size_t cells = static_cast<size_t>(off[G - 1]) + static_cast<size_t>(n[G - 1]);
  const size_t most = static_cast<size_t>(*std::max_element(n, n + G));
  if (sc.taken.size() < cells) sc.taken.resize(cells);
  if (sc.order.size() < most) sc.order.resize(most);
  if (sc.pool.capacity() < cells) sc.pool.reserve(cells);
  sc.pool.clear();
  int64_t joint = int64_t{G} * k;
  // Floors: each head's best min(f, candidates) candidates; the rest join the common pool.
  for (int g = 0; g < G; ++g) {
    const int ng = n[g], cand = ng - r - t;
    D2O_ASSERT(cand >= 0);
    const int fg = std::min(f, cand);
    int32_t* out = keep + off[g];
    uint8_t* taken = sc.taken.data() + off[g];
    const float* sg = score + off[g];
    std::fill_n(taken, ng, uint8_t{0});
    select_top(sg, t, cand, fg, out, sc.order.data());
    for (int i = 0; i < fg; ++i) taken[out[i]] = 1;
    for (int j = t; j < t + cand; ++j)
      if (!taken[j]) sc.pool.push_back({sg[j], g, j});
    joint -= fg;
  }
  D2O_ASSERT(joint >= 0 && joint <= static_cast<int64_t>(sc.pool.size()));
  auto better = [](const SelectScratch::Cand& a, const SelectScratch::Cand& b) {
    if (a.s != b.s) return a.s > b.s;
    return a.g != b.g ? a.g < b.g : a.j < b.j;
  };
  const auto mid = sc.pool.begin() + joint;
  if (mid != sc.pool.end()) std::nth_element(sc.pool.begin(), mid, sc.pool.end(), better);
  for (auto it = sc.pool.begin(); it != mid; ++it)
    sc.taken[static_cast<size_t>(off[it->g] + it->j)] = 1;
  // Kept: the protected slots and the picks, ascending.
  for (int g = 0; g < G; ++g) {
    const int ng = n[g];
    int32_t* out = keep + off[g];
    const uint8_t* taken = sc.taken.data() + off[g];
    int o = 0;
    for (int j = 0; j < ng; ++j)
      if (j < t || j >= ng - r || taken[j]) out[o++] = j;
    count[g] = o;
  }
}

}  // namespace d2o

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kHeadsWords = {"uniform", "ada"};

// Shown only away from the uniform per-head rule (added after specs were recorded).
bool ada_shown(const PolicyConfig& c) {
  return c.heads != HeadRule::kUniform;
}
}  // namespace

// The head shares' keys: uniform or shared by score (heads=), each head's floor (floor=), and the
// share of a head's budget kept for distinct keys (distinct_share=).
std::vector<KeyDef> head_keys() {
  return {
      word_def<&PolicyConfig::heads, kHeadsWords>("heads", ada_shown),
      {"floor",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         return share_key(c.name, key, v, &c.floor);
       },
       [](const PolicyConfig& c) { return fmt_f64(c.floor); }, ada_shown},
      {"distinct_share",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         return share_key(c.name, key, v, &c.distinct);
       },
       [](const PolicyConfig& c) { return fmt_f64(c.distinct); },
       [](const PolicyConfig& c) { return c.distinct != 0.0; }},
  };
}

}  // namespace d2o::spec_detail
