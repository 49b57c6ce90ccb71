// A conversation cut back to a prefix (KvCache::intact_prefix / truncate, Sequence::truncate):
// what a server session does when a request's messages leave the tokens it holds after a common
// prefix. On synthetic caches: the prefix ends at the first slot a compaction evicted or merged,
// a sliding-window layer allows it only while its window holds what the prefix needs, and the
// cut leaves each kept slot its own row bytes in dense rows whatever order compactions left them
// in. On random-weight models (llama, and gemma3 with sliding-window layers): a sequence cut
// back and fed a different continuation gives bit for bit the logits of a sequence fed only the
// prefix and that continuation, with the full cache and with a compressing policy before its
// first compaction; after a compaction, a cold tier in use or renumbered positions it keeps no
// more than what is intact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/sequence.h"
#include "unit/kv_test_access.h"
#include "unit/unit_helpers.h"

namespace d2o {
namespace {

// ---- synthetic caches ----------------------------------------------------------------------

using TruncRows = std::map<std::pair<int, int32_t>, std::vector<uint8_t>>;  // (head, pos) -> row

// Appends n tokens at positions first.. to every layer (a sliding-window layer first drops what
// the pass would, as the attention does), with random keys and values; records their row bytes.
void trunc_append(KvCache& c, int first, int n, std::mt19937& rng, std::vector<TruncRows>& keys,
                  std::vector<TruncRows>& values) {
  const KvCacheConfig& cfg = c.config();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t kv_dim = static_cast<size_t>(cfg.n_head_kv) * cfg.head_dim;
  std::vector<float> k(static_cast<size_t>(n) * kv_dim), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) pos[static_cast<size_t>(t)] = first + t;
  keys.resize(static_cast<size_t>(cfg.n_layer));
  values.resize(static_cast<size_t>(cfg.n_layer));
  for (int il = 0; il < cfg.n_layer; ++il) {
    if (cfg.window(il) > 0) c.drop_oldest(il, n);
    const int before = c.layer(il).n_slot();
    ASSERT_TRUE(c.reserve(il, before + n, false).ok());
    c.append(il, k.data(), v.data(), pos.data(), n);
    const KvLayer& L = c.layer(il);
    for (int h = 0; h < L.n_head_kv(); ++h) {
      for (int j = L.n_slot(h) - n; j < L.n_slot(h); ++j) {
        keys[static_cast<size_t>(il)][{h, L.pos(h)[j]}].assign(L.key_row(h, j),
                                                               L.key_row(h, j) + L.key_row_bytes());
        values[static_cast<size_t>(il)][{h, L.pos(h)[j]}].assign(
            L.value_row(h, j), L.value_row(h, j) + L.value_row_bytes());
      }
    }
  }
}

// Every head of layer L holds positions first..first+n-1 in rows [0, n), each its own bytes.
void trunc_check(const KvLayer& L, int first, int n, const TruncRows& keys,
                 const TruncRows& values) {
  for (int h = 0; h < L.n_head_kv(); ++h) {
    ASSERT_EQ(L.n_slot(h), n) << "head " << h;
    std::vector<int32_t> rows(L.rows(h), L.rows(h) + n);
    std::sort(rows.begin(), rows.end());
    for (int j = 0; j < n; ++j) ASSERT_EQ(rows[static_cast<size_t>(j)], j) << "head " << h;
    for (int j = 0; j < n; ++j) {
      ASSERT_EQ(L.pos(h)[j], first + j) << "head " << h;
      const auto& k = keys.at({h, first + j});
      const auto& v = values.at({h, first + j});
      ASSERT_EQ(0, std::memcmp(L.key_row(h, j), k.data(), k.size())) << h << "," << j;
      ASSERT_EQ(0, std::memcmp(L.value_row(h, j), v.data(), v.size())) << h << "," << j;
    }
  }
}

// A plan for layer L under which head h keeps its slots at positions below `intact` and a
// random choice of the others, a different count per head (as heads=ada leaves them).
CompactionPlan trunc_plan(const KvLayer& L, int intact, std::mt19937& rng) {
  std::vector<std::vector<int32_t>> keep(static_cast<size_t>(L.n_head_kv()));
  std::vector<int32_t> counts;
  for (int h = 0; h < L.n_head_kv(); ++h) {
    std::vector<int32_t>& kh = keep[static_cast<size_t>(h)];
    for (int j = 0; j < L.n_slot(h); ++j) {
      if (j < intact || rng() % 3 != 0) kh.push_back(j);
    }
    if (kh.size() == static_cast<size_t>(L.n_slot(h))) kh.erase(kh.begin() + intact);
    counts.push_back(static_cast<int32_t>(kh.size()));
  }
  CompactionPlan plan;
  plan.reset_heads(L.n_head_kv(), counts.data());
  for (int h = 0; h < L.n_head_kv(); ++h)
    std::copy(keep[static_cast<size_t>(h)].begin(), keep[static_cast<size_t>(h)].end(),
              plan.keep_of(h));
  return plan;
}

TEST(KvTruncate, CutsEveryHeadToThePrefixWithItsOwnRows) {
  for (KvType type : {KvType::kF32, KvType::kF16, KvType::kQ8_0}) {
    SCOPED_TRACE(kv_type_name(type));
    std::mt19937 rng(5);
    KvCache c(KvCacheConfig{2, 3, 32, type});
    std::vector<TruncRows> keys, values;
    ASSERT_NO_FATAL_FAILURE(trunc_append(c, 0, 40, rng, keys, values));
    EXPECT_EQ(c.intact_prefix(40), 40);
    EXPECT_EQ(c.intact_prefix(100), 40);  // no more than the cache holds
    EXPECT_EQ(c.intact_prefix(17), 17);
    EXPECT_EQ(c.intact_prefix(0), 0);
    // Compactions that evict only slots at positions >= 25 (rows move into the holes, heads end
    // with different counts), and one more pass.
    for (int il = 0; il < 2; ++il) c.apply(il, trunc_plan(c.layer(il), 25, rng));
    ASSERT_NO_FATAL_FAILURE(trunc_append(c, 40, 6, rng, keys, values));
    for (int il = 0; il < 2; ++il) c.apply(il, trunc_plan(c.layer(il), 25, rng));
    ASSERT_FALSE(c.layer(0).uniform());
    EXPECT_EQ(c.intact_prefix(46), 25);
    EXPECT_EQ(c.intact_prefix(25), 25);
    EXPECT_EQ(c.intact_prefix(9), 9);
    c.truncate(21);
    for (int il = 0; il < 2; ++il) {
      EXPECT_TRUE(c.layer(il).uniform());
      ASSERT_NO_FATAL_FAILURE(trunc_check(c.layer(il), 0, 21, keys[static_cast<size_t>(il)],
                                          values[static_cast<size_t>(il)]));
    }
    // It goes on from there (new rows for positions 21..: what the tokens after the cut bring).
    ASSERT_NO_FATAL_FAILURE(trunc_append(c, 21, 5, rng, keys, values));
    EXPECT_EQ(c.intact_prefix(26), 26);
    for (int il = 0; il < 2; ++il)
      ASSERT_NO_FATAL_FAILURE(trunc_check(c.layer(il), 0, 26, keys[static_cast<size_t>(il)],
                                          values[static_cast<size_t>(il)]));
  }
}

TEST(KvTruncate, ThePrefixEndsAtTheFirstSlotEvictedOrMerged) {
  std::mt19937 rng(9);
  KvCache c(KvCacheConfig{2, 2, 16, KvType::kF16});
  std::vector<TruncRows> keys, values;
  ASSERT_NO_FATAL_FAILURE(trunc_append(c, 0, 30, rng, keys, values));
  // Head 1 of layer 1 lets go of position 12: the prefix ends there, whatever the other heads.
  CompactionPlan plan;
  plan.reset(2, 29);
  for (int h = 0; h < 2; ++h) {
    int o = 0;
    for (int j = 0; j < 30; ++j) {
      if (j != (h == 1 ? 12 : 20)) plan.keep_of(h)[o++] = j;
    }
  }
  c.apply(1, plan);
  EXPECT_EQ(c.intact_prefix(30), 12);
  // A slot something was merged into is not as appended either.
  KvTestAccess::merged(KvTestAccess::layer(c, 0), 0)[7] = 1;
  EXPECT_EQ(c.intact_prefix(30), 7);
  EXPECT_EQ(c.intact_prefix(5), 5);
}

TEST(KvTruncate, ASlidingWindowLayerMustStillHoldWhatThePrefixNeeds) {
  // Layer 0 global, layer 1 a sliding window of 8 (it keeps 7 slots plus the pass).
  std::mt19937 rng(3);
  KvCache c(KvCacheConfig{2, 2, 16, KvType::kF16, {0, 8}});
  std::vector<TruncRows> keys, values;
  ASSERT_NO_FATAL_FAILURE(trunc_append(c, 0, 100, rng, keys, values));
  // Nothing dropped yet: any prefix.
  EXPECT_EQ(c.intact_prefix(50), 50);
  // A one-token pass drops all but the last 7: the layer holds positions 93..100.
  ASSERT_NO_FATAL_FAILURE(trunc_append(c, 100, 1, rng, keys, values));
  ASSERT_EQ(c.layer(1).n_slot(), 8);
  ASSERT_EQ(c.layer(1).pos(0)[0], 93);
  EXPECT_EQ(c.intact_prefix(101), 101);
  EXPECT_EQ(c.intact_prefix(100), 100);  // a query at 100 sees 93..100
  EXPECT_EQ(c.intact_prefix(99), 0);     // one at 99 would need 92, which is gone
  c.truncate(100);
  ASSERT_NO_FATAL_FAILURE(trunc_check(c.layer(0), 0, 100, keys[0], values[0]));
  ASSERT_NO_FATAL_FAILURE(trunc_check(c.layer(1), 93, 7, keys[1], values[1]));
}

// ---- sequences on random-weight models -----------------------------------------------------

class SequenceTruncate : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    test::RandomModelConfig cfg;
    cfg.arch = GetParam();
    cfg.n_layer = 2;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 17;
    if (cfg.arch == "gemma3") {
      cfg.n_layer = 6;  // five sliding-window layers, then a global one
      cfg.sliding_window = 16;
    }
    model_ = test::load_random_model(cfg, std::string("trunc_") + GetParam() + ".gguf");
    ASSERT_NE(model_, nullptr);
    EngineOptions eo;
    eo.n_ubatch = 128;
    engine_ = std::make_unique<Engine>(*model_, pool_, eo);
  }

  static std::vector<TokenId> tokens(int n, uint32_t seed) {
    std::vector<TokenId> p;
    test::Xorshift rng(seed);
    for (int i = 0; i < n; ++i) p.push_back(3 + static_cast<TokenId>(rng.next() % 297));
    return p;
  }

  std::shared_ptr<Sequence> make(const std::string& spec) {
    std::shared_ptr<const KvPolicy> pol(test::policy_of(spec));
    return std::make_shared<Sequence>(model_->hparams(), KvType::kF16, pol);
  }

  // Feeds `toks` in passes of at most `chunk` tokens (later chunks announced, as a scheduler
  // feeds a prompt); returns the last token's logits.
  std::vector<float> feed(Sequence& seq, const std::vector<TokenId>& toks, int chunk) {
    std::vector<float> last;
    const int n_vocab = model_->hparams().n_vocab;
    auto sink = [&](int, int, const float* l) { last.assign(l, l + n_vocab); };
    for (size_t at = 0; at < toks.size();) {
      const size_t n = std::min(toks.size() - at, static_cast<size_t>(chunk));
      BatchEntry be;
      be.seq = &seq;
      be.tokens = std::span<const TokenId>(toks.data() + at, n);
      be.prompt_rest = static_cast<int64_t>(toks.size() - at - n);
      be.logits_from = be.prompt_rest > 0 ? BatchEntry::kNoLogits : -1;
      const Status s = engine_->forward({&be, 1}, sink);
      EXPECT_TRUE(s.ok()) << s.to_string();
      at += n;
    }
    return last;
  }

  // Greedy decoding of n tokens, one pass each, after logits `l`; returns them (the last fed
  // too, as a session's answer that ended at end-of-generation).
  std::vector<TokenId> decode(Sequence& seq, std::vector<float> l, int n) {
    std::vector<TokenId> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(static_cast<TokenId>(std::max_element(l.begin(), l.end()) - l.begin()));
      l = feed(seq, {out.back()}, 1);
    }
    return out;
  }

  ThreadPool pool_{1};
  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
};

// The conversation: a first turn and its answer, then a second turn; the second turn is then
// edited after its 5th token. Cut back to the common prefix, the sequence answers the edited
// turn with the logits (bit for bit) and greedy tokens of a sequence fed only the edited
// conversation.
TEST_P(SequenceTruncate, CutBackAndFedAnEditEqualsAFreshSequence) {
  for (const char* spec :
       {"full", "h2o:budget=120", "d2o:budget=120", "snapkv:ratio=0.5,window=8"}) {
    SCOPED_TRACE(spec);
    const bool ratio = std::string(spec).find("ratio") != std::string::npos;
    auto seq = make(spec);
    std::vector<TokenId> conv = tokens(30, 1);
    std::vector<TokenId> ans = decode(*seq, feed(*seq, conv, 128), 4);
    conv.insert(conv.end(), ans.begin(), ans.end());
    std::vector<TokenId> turn2 = tokens(12, 2);
    std::vector<TokenId> with2 = conv;
    with2.insert(with2.end(), turn2.begin(), turn2.end());
    decode(*seq, feed(*seq, turn2, 128), 3);
    ASSERT_EQ(seq->n_past(), 30 + 4 + 12 + 3);
    // A ratio policy compressed the first prompt: only what that compaction left intact.
    const int64_t common = std::ssize(conv) + 5;
    const int64_t p = seq->reusable_prefix(common);
    if (ratio) {
      EXPECT_LT(p, 30);
      continue;
    }
    ASSERT_EQ(p, common);
    ASSERT_TRUE(seq->truncate(p).ok());
    EXPECT_EQ(seq->n_past(), p);
    EXPECT_FALSE(seq->policy_state().budgets_set);
    std::vector<TokenId> edit = tokens(9, 3);
    std::vector<float> got = feed(*seq, edit, 128);
    const std::vector<TokenId> got_tokens = decode(*seq, got, 4);

    auto fresh = make(spec);
    std::vector<TokenId> whole(with2.begin(), with2.begin() + p);
    whole.insert(whole.end(), edit.begin(), edit.end());
    std::vector<float> want = feed(*fresh, whole, 128);
    EXPECT_EQ(got, want);
    EXPECT_EQ(got_tokens, decode(*fresh, want, 4));
  }
}

// A compaction below the cut, a cold tier that took slots, renumbered positions: the sequence
// keeps no more than the prefix it holds intact, and refuses to be cut past it.
TEST_P(SequenceTruncate, KeepsNoMoreThanWhatIsIntact) {
  const std::vector<TokenId> conv = tokens(60, 4);
  {
    auto seq = make("h2o:budget=24");
    feed(*seq, conv, 128);
    ASSERT_GT(seq->policy_state().n_compactions, 0);
    // The first position a compressible layer's head is missing (or holds merged) ends it.
    int64_t first_gap = seq->n_past();
    for (int il = 0; il < seq->cache().n_layer(); ++il) {
      if (!seq->cache().config().layer_compressible(il)) continue;
      const KvLayer& L = seq->cache().layer(il);
      for (int h = 0; h < L.n_head_kv(); ++h) {
        int64_t j = 0;
        while (j < L.n_slot(h) && L.pos(h)[j] == j) ++j;
        first_gap = std::min(first_gap, j);
      }
    }
    ASSERT_LT(first_gap, 59);
    EXPECT_EQ(seq->reusable_prefix(59), first_gap);
    const Status s = seq->truncate(first_gap + 1);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(seq->n_past(), 60);  // unchanged
    EXPECT_FALSE(seq->truncate(61).ok());
    EXPECT_FALSE(seq->truncate(-1).ok());
  }
  std::vector<std::string> specs = {"d2o:budget=24,cold=memory,cold_type=f16"};
  if (std::string(GetParam()) == "llama")  // (not with sliding-window layers)
    specs.push_back("streaming:budget=24,positions=shifted");
  for (const std::string& spec : specs) {
    SCOPED_TRACE(spec);
    auto seq = make(spec);
    feed(*seq, conv, 128);
    ASSERT_GT(seq->policy_state().n_compactions, 0);
    EXPECT_EQ(seq->reusable_prefix(59), 0);
    EXPECT_FALSE(seq->truncate(3).ok());
    // Cutting everything is always possible: a new conversation.
    ASSERT_TRUE(seq->truncate(0).ok());
    EXPECT_EQ(seq->n_past(), 0);
  }
  {
    // Before its first compaction a cold tier holds nothing: the prefix is kept.
    auto seq = make("d2o:budget=100,cold=memory,cold_type=f16");
    feed(*seq, conv, 128);
    ASSERT_EQ(seq->policy_state().n_compactions, 0);
    EXPECT_EQ(seq->reusable_prefix(40), 40);
  }
}

// Gemma 3: a prompt longer than the slack leaves its sliding-window layers holding their last
// W - 1 positions (KvCache::settle_sliding), so a cut is possible only where those still cover
// the window of the first token after it; there it equals a fresh sequence. (Llama: anywhere.)
TEST_P(SequenceTruncate, SlidingWindowLayersAllowACutOnlyWhereTheyHoldItsWindow) {
  const bool sliding = std::string(GetParam()) == "gemma3";
  auto seq = make("full");
  const std::vector<TokenId> prompt = tokens(100, 5);
  const std::vector<TokenId> ans = decode(*seq, feed(*seq, prompt, 128), 3);
  // Window 16: the sliding layers hold positions 85.. (15 before the prompt's last token).
  EXPECT_EQ(seq->reusable_prefix(99), sliding ? 0 : 99);
  EXPECT_EQ(seq->reusable_prefix(50), sliding ? 0 : 50);
  EXPECT_EQ(seq->reusable_prefix(100), 100);
  ASSERT_EQ(seq->reusable_prefix(101), 101);
  ASSERT_TRUE(seq->truncate(101).ok());
  const std::vector<TokenId> edit = tokens(7, 6);
  const std::vector<float> got = feed(*seq, edit, 128);
  auto fresh = make("full");
  std::vector<TokenId> whole = prompt;
  whole.push_back(ans[0]);
  whole.insert(whole.end(), edit.begin(), edit.end());
  EXPECT_EQ(got, feed(*fresh, whole, 128));
}

INSTANTIATE_TEST_SUITE_P(Archs, SequenceTruncate, ::testing::Values("llama", "gemma3"));

}  // namespace
}  // namespace d2o
