// D2O's decode-step search through the attention pass (AttnProbe): after each layer's compaction
// the policy arms the slot it expects the next step to evict, the next step's attention forms that
// key's dots with every key while it reads the keys for the scores, and the compaction takes them
// when the slot evicted is the one armed (and its key unchanged). The search then gives the bits
// it gives without the probe: same tokens, same caches, same merges; and the probe does serve
// the steps (a search that never used it would pass the first checks too).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/kv_rows.h"
#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "kv/policy/composed.h"
#include "model/model.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

class ProbeModel : public test::RandomModelSuite<ProbeModel> {
 public:
  static test::RandomModelConfig config() {
    // SmolLM2's head: 64 wide (the vector kernels; scale 1/8), 3 query heads per KV head (with
    // the probe, 4 rows per kernel call); 2 KV heads, planned on both threads.
    test::RandomModelConfig cfg;
    cfg.n_layer = 3;
    cfg.n_embd = 384;
    cfg.n_head = 6;
    cfg.n_head_kv = 2;
    cfg.seed = 33;
    return cfg;
  }
  static const char* file() { return "probe_random.gguf"; }
};

bool same_cache(const KvCache& a, const KvCache& b) {
  for (int il = 0; il < a.n_layer(); ++il) {
    const KvLayer& x = a.layer(il);
    const KvLayer& y = b.layer(il);
    if (x.n_slot() != y.n_slot()) return false;
    for (int g = 0; g < x.n_head_kv(); ++g) {
      const size_t n = static_cast<size_t>(x.n_slot());
      if (test::compare_keys(x, y, g, n) != 0 || test::compare_values(x, y, g, n) != 0)
        return false;
      if (std::memcmp(x.pos(g), y.pos(g), n * 4) != 0) return false;
      if (std::memcmp(x.score(g), y.score(g), n * 4) != 0) return false;
      if (std::memcmp(x.merged(g), y.merged(g), n * 4) != 0) return false;
    }
  }
  return true;
}

struct ProbeRun {
  std::vector<TokenId> tokens;
  int64_t used = 0, missed = 0, merged = 0;
};

// Two sequences fed alike (different prompts) and decoded in one batch, a 6-token pass in the
// middle of the decoding (a chat's next turn), with the policy's probe on or off.
ProbeRun run(int threads, const std::string& spec, bool probe, std::unique_ptr<Sequence> seqs[2]) {
  ThreadPool pool(threads);
  Engine engine(*ProbeModel::model_, pool, EngineOptions{});
  auto parsed = parse_kv_policy(spec);
  EXPECT_TRUE(parsed.ok());
  std::unique_ptr<KvPolicy> owned = std::move(parsed).value();
  auto* composed = dynamic_cast<ComposedPolicy*>(owned.get());
  EXPECT_NE(composed, nullptr);
  if (composed) composed->set_attention_probe(probe);
  std::shared_ptr<const KvPolicy> pol(std::move(owned));
  const int n_vocab = engine.model().hparams().n_vocab;
  TokenId next[2] = {-1, -1};
  auto sink = [&](int entry, int, const float* l) {
    next[entry] = static_cast<TokenId>(std::max_element(l, l + n_vocab) - l);
  };
  ProbeRun out;
  test::Xorshift rng(7);
  std::vector<TokenId> prompt[2];
  for (int s = 0; s < 2; ++s) {
    seqs[s] = std::make_unique<Sequence>(engine.model().hparams(), KvType::kF16, pol);
    for (int i = 0; i < 120 + 9 * s; ++i)
      prompt[s].push_back(3 + static_cast<TokenId>(rng.next() % 297));
  }
  auto step = [&](const std::vector<TokenId>* feed) {
    BatchEntry be[2];
    TokenId one[2];
    for (int s = 0; s < 2; ++s) {
      be[s].seq = seqs[s].get();
      if (feed) {
        be[s].tokens = std::span<const TokenId>(feed[s]);
      } else {
        one[s] = next[s];
        out.tokens.push_back(next[s]);
        be[s].tokens = std::span<const TokenId>(one + s, 1);
      }
    }
    EXPECT_TRUE(engine.forward({be, 2}, sink).ok());
  };
  step(prompt);
  for (int i = 0; i < 30; ++i) step(nullptr);
  std::vector<TokenId> turn[2];
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 6; ++i) turn[s].push_back(3 + static_cast<TokenId>(rng.next() % 297));
  step(turn);
  for (int i = 0; i < 30; ++i) step(nullptr);
  for (int s = 0; s < 2; ++s) {
    const PolicyState& st = seqs[s]->policy_state();
    const D2oMergeState* own = d2o_merge_state(st);
    EXPECT_NE(own, nullptr);
    if (own) {
      out.used += own->probe_used.load();
      out.missed += own->probe_missed.load();
    }
    for (int64_t m : st.merged) out.merged += m;
  }
  return out;
}

TEST_F(ProbeModel, TheSearchThroughTheAttentionPassGivesTheBitsOfTheSearchAlone) {
  for (int threads : {1, 2}) {
    for (const char* spec :
         {"d2o:ratio=0.3,merge=sized", "d2o:ratio=0.25,nm=1:1,mscore=keep,merge=sized",
          "d2o:ratio=0.3,mass=on,merge=sized,layers=uniform,nm=1:1,norm=queries"}) {
      SCOPED_TRACE(std::string(spec) + ", threads " + std::to_string(threads));
      std::unique_ptr<Sequence> on[2], off[2];
      const ProbeRun a = run(threads, spec, true, on);
      const ProbeRun b = run(threads, spec, false, off);
      EXPECT_EQ(a.tokens, b.tokens);
      for (int s = 0; s < 2; ++s) EXPECT_TRUE(same_cache(on[s]->cache(), off[s]->cache()));
      EXPECT_EQ(a.merged, b.merged);
      EXPECT_GT(a.merged, 0);  // the merges the searches decide are exercised
      // Every one-slot search of the decode steps goes one way or the other; with the probe, most
      // take the attention's dots (the prediction fails when a step's attention reorders the
      // lowest scores, and at the first step after the 6-token pass, which nothing armed).
      EXPECT_EQ(a.used + a.missed, b.missed);
      EXPECT_EQ(b.used, 0);
      EXPECT_GT(a.used, (a.used + a.missed) / 2) << "used " << a.used << " missed " << a.missed;
    }
  }
}

}  // namespace
}  // namespace d2o
