// Chunked prefill at the policy seam: a prompt fed in announced chunks (BatchEntry::prompt_rest)
// is compressed once, after its last chunk, exactly as if it had been fed in one pass; and
// KvPolicy::peak_slots_for bounds what a sequence fed that way holds.
#include <gtest/gtest.h>

#include <cstring>

#include "common/kv_rows.h"
#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "policy_sim.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/tokenizer.h"
#include "unit/kv_test_access.h"

namespace d2o {
namespace {

using test::PolicySim;
using test::SimSetup;

// ---- peak_slots_for against a simulated sequence (synthetic statistics, no model) ----------

struct PeakCase {
  const char* spec;
  int n_prompt, n_total, chunk;
  bool exact;  // the bound is reached
  int n_head_kv = 2;
};

int64_t feed_announced(PolicySim& sim, const PeakCase& c) {
  int64_t peak = 0, fed = 0;
  auto pass = [&](int n, int64_t rest) {
    sim.feed(n);
    for (int il = 0; il < sim.setup.n_layer; ++il)
      peak = std::max<int64_t>(peak, sim.cache.layer(il).n_slot());
    PassInfo pi;
    pi.n_tokens = n;
    pi.n_past = sim.n_past;
    pi.prompt_rest = rest;
    pi.rope = &sim.rope;
    const Status s = sim.policy->compact(sim.cache, sim.state, pi);
    EXPECT_TRUE(s.ok()) << s.to_string();
  };
  while (fed < c.n_prompt) {
    const int n = static_cast<int>(std::min<int64_t>(c.chunk, c.n_prompt - fed));
    fed += n;
    pass(n, c.n_prompt - fed);
  }
  while (fed < c.n_total) {
    pass(1, 0);
    ++fed;
  }
  return peak;
}

TEST(ChunkedPrefill, PeakSlotsForBoundsAnnouncedChunkedFeeding) {
  const std::vector<PeakCase> cases = {
      {"h2o:ratio=0.5", 40, 100, 8, true},  // the prompt is held whole, then 20 + 1
      {"h2o:ratio=0.5", 40, 41, 16, true},
      {"d2o:ratio=0.3", 40, 100, 8, false},  // variable budgets: bounded by the prompt + 1
      {"cam:ratio=0.25", 40, 100, 8, true},
      {"roco:ratio=0.25", 37, 90, 5, true},
      {"streaming:ratio=0.25", 37, 90, 5, true},
      {"snapkv:ratio=0.5,window=4", 40, 100, 8, true},  // no compaction after the first: 20 + 60
      {"pyramidkv:ratio=0.5,window=4", 40, 100, 8, false},
      {"h2o:budget=20", 50, 120, 7, true},  // compacted during the prompt: 20 + 7
      {"h2o:budget=20", 10, 120, 4, true},  // first compaction while decoding: 20 + 1
      {"d2o:budget=20", 50, 120, 7, false},
      {"streaming:budget=20", 30, 30, 30, true},
      {"snapkv:budget=20,window=4", 40, 100, 8, false},
      {"d2o:ratio=0.3,layers=research", 40, 100, 8, true},
      {"h2o:budget=200", 40, 100, 8, true},
      // heads=ada: a head may hold what the other heads give up above their floors.
      {"h2o:budget=20,heads=ada", 50, 120, 7, false},
      {"h2o:budget=20,heads=ada", 50, 120, 7, false, 4},
      {"h2o:budget=20,heads=ada,floor=0", 10, 120, 4, false, 4},
      {"roco:ratio=0.25,heads=ada", 37, 90, 5, false, 4},
      {"snapkv:ratio=0.5,window=4,heads=ada", 40, 100, 8, false},
      {"d2o:reading=paper,budget=20,heads=ada", 50, 120, 7, false, 3},
  };
  for (const PeakCase& c : cases) {
    SCOPED_TRACE(std::string(c.spec) + " prompt " + std::to_string(c.n_prompt) + " chunk " +
                 std::to_string(c.chunk));
    SimSetup s;
    s.n_layer = 6;
    s.n_head_kv = c.n_head_kv;
    PolicySim sim(c.spec, s);
    const int64_t peak = feed_announced(sim, c);
    FeedPlan plan;
    plan.n_prompt = c.n_prompt;
    plan.n_total = c.n_total;
    plan.prompt_chunk = c.chunk;
    plan.decode_chunk = 1;
    plan.n_head_kv = c.n_head_kv;
    const int64_t bound = sim.policy->peak_slots_for(plan);
    EXPECT_LE(peak, bound);
    if (std::string(c.spec).find("heads=ada") != std::string::npos) {
      EXPECT_LT(bound, c.n_total);  // not the whole sequence
      plan.n_head_kv = 0;           // unknown: no bound but the sequence
      EXPECT_EQ(sim.policy->peak_slots_for(plan), c.n_total);
    }
    if (c.exact) {
      EXPECT_EQ(peak, bound);
    }
  }
  // The plain bound assumes the first chunk is compressed on its own: an announced prompt exceeds
  // it.
  SimSetup s;
  PolicySim sim("d2o:ratio=0.3,cold=none", s);
  const PeakCase c{"d2o:ratio=0.3,cold=none", 40, 100, 8, false};
  EXPECT_GT(feed_announced(sim, c), sim.policy->peak_slots(40, 100, 8));
  FeedPlan full_plan;
  full_plan.n_prompt = 10;
  full_plan.n_total = 100;
  EXPECT_EQ(parse_kv_policy("full").value()->peak_slots_for(full_plan), 100);
}

// heads=ada: when one KV head outscores the others everywhere it wins every joint pick, and holds
// exactly the bound peak_slots_for() reserves (its budget, what the other heads give up above
// their floors, and one pass).
TEST(ChunkedPrefill, PerHeadBudgetsReachTheirBoundWhenOneHeadWinsEverything) {
  for (const int G : {2, 3}) {
    SCOPED_TRACE("KV heads " + std::to_string(G));
    SimSetup s;
    s.n_layer = 2;
    s.n_head_kv = G;
    PolicySim sim("h2o:budget=20,heads=ada", s);
    int64_t peak = 0;
    auto pass = [&](int n, int64_t rest) {
      sim.feed(n);
      for (int il = 0; il < s.n_layer; ++il) {
        KvLayer& L = KvTestAccess::layer(sim.cache, il);
        for (int g = 0; g < G; ++g) {
          for (int j = 0; j < L.n_slot(g); ++j)
            KvTestAccess::score(L, g)[j] = g == 0 ? 1000.0f + static_cast<float>(j) : 0.001f;
        }
        peak = std::max<int64_t>(peak, L.n_slot());
      }
      PassInfo pi;
      pi.n_tokens = n;
      pi.n_past = sim.n_past;
      pi.prompt_rest = rest;
      pi.rope = &sim.rope;
      ASSERT_TRUE(sim.policy->compact(sim.cache, sim.state, pi).ok());
    };
    for (int fed = 0; fed < 49; fed += 7) ASSERT_NO_FATAL_FAILURE(pass(7, 49 - fed - 7));
    for (int i = 0; i < 30; ++i) ASSERT_NO_FATAL_FAILURE(pass(1, 0));
    FeedPlan plan;
    plan.n_prompt = 49;
    plan.n_total = 79;
    plan.prompt_chunk = 7;
    plan.n_head_kv = G;
    EXPECT_FALSE(sim.cache.layer(0).uniform());
    EXPECT_EQ(peak, sim.policy->peak_slots_for(plan));
  }
}

// ---- the engine: chunked prompt == one-pass prompt, bit for bit ------------------------------

class ChunkedPrefillModel : public test::RandomModelSuite<ChunkedPrefillModel> {
 public:
  static test::RandomModelConfig config() {
    test::RandomModelConfig cfg;
    cfg.n_layer = 3;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 21;
    return cfg;
  }
  static const char* file() { return "chunked_random.gguf"; }
};

// One decode step of `seq` on `token`.
Status decode_one(Engine& engine, Sequence& seq, TokenId token, const LogitsSink& sink) {
  TokenId one[1] = {token};
  BatchEntry be;
  be.seq = &seq;
  be.tokens = std::span<const TokenId>(one, 1);
  return engine.forward({&be, 1}, sink);
}

// Feeds `prompt` in the given chunks (announced or not), then decodes n greedy tokens.
std::vector<TokenId> run(Engine& engine, Sequence& seq, const std::vector<TokenId>& prompt,
                         const std::vector<int>& chunks, bool announce, int n) {
  const int n_vocab = engine.model().hparams().n_vocab;
  TokenId next = -1;
  auto sink = [&](int, int, const float* l) {
    next = static_cast<TokenId>(std::max_element(l, l + n_vocab) - l);
  };
  size_t at = 0;
  for (int len : chunks) {
    BatchEntry be;
    be.seq = &seq;
    be.tokens = std::span<const TokenId>(prompt.data() + at, static_cast<size_t>(len));
    at += static_cast<size_t>(len);
    be.prompt_rest = announce ? static_cast<int64_t>(prompt.size() - at) : 0;
    EXPECT_TRUE(engine.forward({&be, 1}, sink).ok());
  }
  std::vector<TokenId> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(next);
    EXPECT_TRUE(decode_one(engine, seq, next, sink).ok());
  }
  return out;
}

bool same_slots(const KvCache& a, const KvCache& b) {
  for (int il = 0; il < a.n_layer(); ++il) {
    const KvLayer& x = a.layer(il);
    const KvLayer& y = b.layer(il);
    if (x.n_slot() != y.n_slot()) return false;
    for (int g = 0; g < x.n_head_kv(); ++g) {
      const size_t n = static_cast<size_t>(x.n_slot()), m = n;
      if (test::compare_keys(x, y, g, n) != 0) return false;
      if (test::compare_values(x, y, g, n) != 0) return false;
      if (std::memcmp(x.pos(g), y.pos(g), m * 4) != 0) return false;
      if (std::memcmp(x.score(g), y.score(g), m * 4) != 0) return false;
    }
  }
  return true;
}

TEST_F(ChunkedPrefillModel, AnnouncedChunksCompressThePromptOnceLikeOnePass) {
  ThreadPool pool(1);
  Engine engine(*model_, pool, EngineOptions{});
  std::vector<TokenId> prompt;
  test::Xorshift rng(5);
  for (int i = 0; i < 64; ++i) prompt.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  // Chunks on 16-token boundaries (the attention kernel's query blocks), the last at least the
  // SnapKV window of 32.
  const std::vector<int> chunks = {16, 16, 32};
  int differs_unannounced = 0;
  for (const char* spec :
       {"full", "streaming:ratio=0.3", "h2o:ratio=0.3", "snapkv:ratio=0.3", "pyramidkv:ratio=0.3",
        "roco:ratio=0.3", "cam:ratio=0.3", "d2o:ratio=0.3"}) {
    SCOPED_TRACE(spec);
    std::shared_ptr<const KvPolicy> pol(parse_kv_policy(spec).value());
    Sequence whole(model_->hparams(), KvType::kF16, pol),
        chunked(model_->hparams(), KvType::kF16, pol), plain(model_->hparams(), KvType::kF16, pol);
    const auto a = run(engine, whole, prompt, {64}, true, 12);
    const auto b = run(engine, chunked, prompt, chunks, true, 12);
    EXPECT_EQ(a, b);
    EXPECT_TRUE(same_slots(whole.cache(), chunked.cache()));
    EXPECT_EQ(whole.policy_state().budgets, chunked.policy_state().budgets);
    EXPECT_EQ(whole.policy_state().n_compactions, chunked.policy_state().n_compactions);
    // Without the announcement the first chunk alone is compressed: a different cache.
    run(engine, plain, prompt, chunks, false, 12);
    if (!same_slots(whole.cache(), plain.cache())) ++differs_unannounced;
  }
  EXPECT_EQ(differs_unannounced, 7);  // every compressing policy
}

// The prompt's last compaction leaves each layer at its decoding size (one free slot), so the
// decode steps after it never reallocate the cache (each reallocation copies every layer's rows);
// a chunk with more of its prompt to come, or scored text, keeps room for a chunk like it.
TEST_F(ChunkedPrefillModel, ThePromptsLastCompactionLeavesTheDecodingSize) {
  std::vector<TokenId> prompt;
  test::Xorshift rng(9);
  for (int i = 0; i < 200; ++i) prompt.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  int compacted_mid = 0;
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    Engine engine(*model_, pool, EngineOptions{});
    for (const char* spec : {"h2o:ratio=0.3", "d2o:ratio=0.3", "h2o:budget=40"}) {
      SCOPED_TRACE(std::string(spec) + ", threads " + std::to_string(threads));
      std::shared_ptr<const KvPolicy> pol(parse_kv_policy(spec).value());
      // A first chunk with 136 tokens to come: a fixed budget compacts it and keeps room for a
      // chunk of 64.
      Sequence mid(model_->hparams(), KvType::kF16, pol);
      run(engine, mid, prompt, {64}, true, 0);
      const KvLayer& M = mid.cache().layer(0);
      if (M.n_slot() < 64) {
        EXPECT_EQ(M.capacity(), M.n_slot() + 64);
        ++compacted_mid;
      }
      // Scored text (logits for every token, as `eval ppl --chunk 64` feeds it) keeps room for
      // the next chunk too.
      Sequence scored(model_->hparams(), KvType::kF16, pol);
      BatchEntry text;
      text.seq = &scored;
      text.tokens = std::span<const TokenId>(prompt.data(), 64);
      text.logits_from = 0;
      ASSERT_TRUE(engine.forward({&text, 1}, nullptr).ok());
      const KvLayer& T = scored.cache().layer(0);
      ASSERT_LT(T.n_slot(), 64);
      EXPECT_EQ(T.capacity(), T.n_slot() + 64);
      Sequence seq(model_->hparams(), KvType::kF16, pol);
      run(engine, seq, prompt, {64, 64, 72}, true, 0);
      const KvCache& cache = seq.cache();
      std::vector<const uint8_t*> blocks;
      for (int il = 0; il < cache.n_layer(); ++il) {
        const KvLayer& L = cache.layer(il);
        ASSERT_LT(L.n_slot(), 200);
        EXPECT_EQ(L.capacity(), L.n_slot() + 1) << "layer " << il;
        blocks.push_back(L.key_base(0));
      }
      for (int step = 0; step < 6; ++step) ASSERT_TRUE(decode_one(engine, seq, 5, nullptr).ok());
      for (int il = 0; il < cache.n_layer(); ++il) {
        EXPECT_EQ(cache.layer(il).key_base(0), blocks[static_cast<size_t>(il)]) << "layer " << il;
        EXPECT_EQ(cache.layer(il).capacity(), cache.layer(il).n_slot() + 1) << "layer " << il;
      }
    }
  }
  EXPECT_EQ(compacted_mid, 2);  // h2o:budget=40, on 1 and 2 threads
}

TEST_F(ChunkedPrefillModel, LastChunkShorterThanTheObservationWindowIsAnError) {
  ThreadPool pool(1);
  Engine engine(*model_, pool, EngineOptions{});
  std::shared_ptr<const KvPolicy> pol(parse_kv_policy("snapkv:ratio=0.3,window=8").value());
  Sequence seq(model_->hparams(), KvType::kF16, pol);
  std::vector<TokenId> prompt(20, 7);
  BatchEntry be;
  be.seq = &seq;
  be.tokens = std::span<const TokenId>(prompt.data(), 15);
  be.prompt_rest = 5;  // the last chunk would hold 5 < 8 tokens
  const Status s = engine.forward({&be, 1}, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("observation window of 8"), std::string::npos) << s.message();
  be.tokens = std::span<const TokenId>(prompt.data(), 12);
  be.prompt_rest = 8;
  EXPECT_TRUE(engine.forward({&be, 1}, nullptr).ok());
  EXPECT_EQ(seq.cache().layer(0).n_slot(), 12);  // not compressed yet
  be.tokens = std::span<const TokenId>(prompt.data() + 12, 8);
  be.prompt_rest = 0;
  EXPECT_TRUE(engine.forward({&be, 1}, nullptr).ok());
  EXPECT_EQ(seq.cache().layer(0).n_slot(), 8);  // 0.3 x 20 = 6, raised to the window of 8
}

TEST(ChunkedPrefill, PrefillChunksStartOnQueryBlocksAndEndWithTheWindow) {
  EXPECT_EQ(prefill_chunks(100, 0, 32), std::vector<int>({100}));  // one pass
  EXPECT_EQ(prefill_chunks(30, 48, 32), std::vector<int>({30}));   // shorter than a chunk
  EXPECT_EQ(prefill_chunks(100, 48, 0), std::vector<int>({48, 48, 4}));
  EXPECT_EQ(prefill_chunks(100, 48, 32), std::vector<int>({48, 52}));    // the window in one pass
  EXPECT_EQ(prefill_chunks(100, 50, 0), std::vector<int>({48, 48, 4}));  // 50 -> 48
  EXPECT_EQ(prefill_chunks(40, 5, 0), std::vector<int>({16, 16, 8}));    // at least 16
}

// generate() with prefill_chunk: the full cache and ratio policies answer exactly as with one
// pass, holding the same slots; a fixed budget compacts between the chunks, so it runs within a
// slot limit of budget + two chunks, where the one-pass prefill, which holds the whole prompt
// first, does not fit.
TEST_F(ChunkedPrefillModel, GenerateInChunksKeepsRatioResultsAndBoundsAFixedBudget) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  auto gguf = GgufFile::open(test::scratch_path(ChunkedPrefillModel::file()));
  ASSERT_TRUE(gguf.ok());
  auto tok = Tokenizer::from_gguf(**gguf);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  std::vector<TokenId> prompt;
  test::Xorshift rng(11);
  for (int i = 0; i < 200; ++i) prompt.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  GenerateParams gp;
  gp.n_predict = 12;
  gp.sampling.temperature = 0;
  gp.stop_at_eog = false;
  for (const char* spec : {"full", "h2o:ratio=0.3", "snapkv:ratio=0.3", "d2o:ratio=0.3",
                           "d2o:ratio=0.3,merge=sized"}) {
    SCOPED_TRACE(spec);
    std::shared_ptr<const KvPolicy> pol(parse_kv_policy(spec).value());
    Sequence whole(model_->hparams(), KvType::kF16, pol),
        chunked(model_->hparams(), KvType::kF16, pol);
    gp.prefill_chunk = 0;
    auto a = generate(engine, **tok, whole, prompt, gp, nullptr);
    gp.prefill_chunk = 48;
    auto b = generate(engine, **tok, chunked, prompt, gp, nullptr);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->tokens, b->tokens);
    EXPECT_TRUE(same_slots(whole.cache(), chunked.cache()));
  }
  // A prompt longer than budget + two chunks.
  std::vector<TokenId> long_prompt = prompt;
  for (int i = 0; i < 100; ++i) long_prompt.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  for (const char* spec : {"h2o:budget=40", "d2o:budget=40", "snapkv:budget=40"}) {
    SCOPED_TRACE(spec);
    std::shared_ptr<const KvPolicy> pol(parse_kv_policy(spec).value());
    for (int chunk : {48, 0}) {
      Sequence seq(model_->hparams(), KvType::kF16, pol);
      // A cold tier's recall (d2o's default) adds its slots to the last chunk's, in one layer at
      // a time.
      const int recall =
          pol->cold_tier().enabled() ? static_cast<int>(pol->cold_tier().max_recall()) : 0;
      ASSERT_TRUE(seq.cache().set_slot_limit(40 + 2 * 48, recall).ok());
      gp.prefill_chunk = chunk;
      auto r = generate(engine, **tok, seq, long_prompt, gp, nullptr);
      EXPECT_EQ(r.ok(), chunk > 0) << (r.ok() ? "" : r.status().to_string());
    }
  }
}

}  // namespace
}  // namespace d2o
