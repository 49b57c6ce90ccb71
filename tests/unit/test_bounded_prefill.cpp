// prefill=bounded: a ratio policy whose budget is rho of the prompt's whole length (the tokens fed
// and announced, BatchEntry::prompt_rest) and which compacts to it between the prompt's chunks,
// so a chunked prefill holds the budget plus one chunk instead of the whole prompt. The spec key,
// the bound it keeps (simulated sequences and the engine), its equality with prefill=exact when
// the prompt comes in one pass, and a cold tier filled by the chunks' compactions and recalled
// from by the prompt's last chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "common/kv_rows.h"
#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "eval/fork.h"
#include "gguf/gguf.h"
#include "kv/cold_tier.h"
#include "kv/policy/composed.h"
#include "model/model.h"
#include "policy_sim.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/tokenizer.h"

namespace d2o {
namespace {

// Every preset with its ratio= form (the random model's layers are all global, so every one runs).
const std::vector<std::string>& bounded_bases() {
  static const std::vector<std::string> bases = {
      "streaming:ratio=0.25", "h2o:ratio=0.25",       "snapkv:ratio=0.25",
      "pyramidkv:ratio=0.25", "roco:ratio=0.25",      "cam:ratio=0.25",
      "d2o:ratio=0.25",       "d2o:ratio=0.25,reading=paper", "keydiff:ratio=0.25,recent=4",
      "snapkv:ratio=0.25,hold_budget=on", "h2o:ratio=0.25,heads=ada"};
  return bases;
}

const PolicyConfig& bounded_config_of(const KvPolicy& p) {
  return dynamic_cast<const ComposedPolicy&>(p).config();
}

// ---- the spec key ------------------------------------------------------------------------------

TEST(BoundedPrefillSpec, EveryPresetTakesItPrintsItAndReadsItBack) {
  for (const std::string& base : bounded_bases()) {
    SCOPED_TRACE(base);
    auto exact = parse_kv_policy(base);
    auto bounded = parse_kv_policy(base + ",prefill=bounded");
    auto said = parse_kv_policy(base + ",prefill=exact");
    ASSERT_TRUE(exact.ok() && bounded.ok() && said.ok())
        << (bounded.ok() ? "" : bounded.status().message());
    // prefill=exact is the default and is not printed: recorded specs read as before.
    EXPECT_EQ((*said)->spec(), (*exact)->spec());
    EXPECT_TRUE(bounded_config_of(**said) == bounded_config_of(**exact));
    EXPECT_EQ((*exact)->spec().find("prefill"), std::string::npos);
    // prefill=bounded is printed right after the ratio and parses back to the same policy.
    const std::string c = (*bounded)->spec();
    const size_t colon = c.find(':');
    const size_t comma = c.find(',');
    ASSERT_NE(comma, std::string::npos) << c;
    EXPECT_EQ(c.substr(comma, 16), ",prefill=bounded") << c;
    EXPECT_EQ(c.substr(colon + 1, 6), "ratio=") << c;
    auto again = parse_kv_policy(c);
    ASSERT_TRUE(again.ok()) << again.status().message();
    EXPECT_EQ((*again)->spec(), c);
    EXPECT_TRUE(bounded_config_of(**again) == bounded_config_of(**bounded));
    EXPECT_TRUE(bounded_config_of(**bounded).bounded_prefill());
    EXPECT_EQ(recorded_spec_today(c), c);
  }
  // The default ratio applies when none is given.
  EXPECT_EQ(parse_kv_policy("h2o:prefill=bounded").value()->spec(),
            "h2o:ratio=0.2,prefill=bounded,sinks=0,heavy_recent=1:1,agg=sum,"
            "scorer=accumulated_attention");
}

TEST(BoundedPrefillSpec, BadValuesAndCombinationsAreRefusedWithAReason) {
  struct Bad {
    const char* spec;
    const char* says;
  };
  const std::vector<Bad> bad = {
      {"d2o:prefill=chunked", "one of exact, bounded"},
      {"d2o:prefill=", "one of exact, bounded"},
      {"h2o:budget=64,prefill=bounded", "prefill= applies with ratio="},
      {"h2o:budget=64,prefill=exact", "prefill= applies with ratio="},
      {"d2o:prefill=bounded,prompt_ranking=reconstruction", "prefill=exact"},
      {"d2o:prefill=bounded,prompt_ranking=expected", "prompt_ranking=expected ranks the whole"},
      {"d2o:prefill=bounded,prefill=exact", "given twice"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.spec);
    auto p = parse_kv_policy(b.spec);
    ASSERT_FALSE(p.ok());
    EXPECT_NE(p.status().message().find(b.says), std::string::npos) << p.status().message();
  }
  EXPECT_FALSE(parse_kv_policy("full:prefill=bounded").ok());
}

// ---- simulated sequences: the budget from the whole prompt, the bound kept ---------------------

struct BoundedFeed {
  int64_t peak = 0;         // most slots any layer held, before any compaction of a pass
  int64_t prompt_peak = 0;  // the same while the prompt was fed
};

// Feeds the prompt in announced chunks, then single tokens up to n_total.
BoundedFeed feed_bounded(test::PolicySim& sim, int n_prompt, int n_total, int chunk) {
  BoundedFeed f;
  int64_t fed = 0;
  auto pass = [&](int n, int64_t rest) {
    sim.feed(n);
    for (int il = 0; il < sim.setup.n_layer; ++il)
      f.peak = std::max<int64_t>(f.peak, sim.cache.layer(il).n_slot());
    if (fed <= n_prompt) f.prompt_peak = f.peak;
    PassInfo pi;
    pi.n_tokens = n;
    pi.n_past = sim.n_past;
    pi.prompt_rest = rest;
    pi.rope = &sim.rope;
    const Status s = sim.policy->compact(sim.cache, sim.state, pi);
    EXPECT_TRUE(s.ok()) << s.to_string();
  };
  while (fed < n_prompt) {
    const int n = static_cast<int>(std::min<int64_t>(chunk, n_prompt - fed));
    fed += n;
    pass(n, n_prompt - fed);
  }
  while (fed < n_total) {
    ++fed;
    pass(1, 0);
  }
  return f;
}

TEST(BoundedPrefillSim, ThePromptHoldsItsBudgetPlusOneChunk) {
  const int n_prompt = 200, n_total = 230, chunk = 16;
  for (const std::string& base : bounded_bases()) {
    if (base.find("heads=ada") != std::string::npos) continue;  // a head may hold the layer's
    SCOPED_TRACE(base);
    test::SimSetup s;
    s.n_layer = 5;
    test::PolicySim bounded(base + ",prefill=bounded", s), exact(base, s);
    const BoundedFeed b = feed_bounded(bounded, n_prompt, n_total, chunk);
    const BoundedFeed e = feed_bounded(exact, n_prompt, n_total, chunk);
    // Exact: the whole prompt is held, then compressed once.
    EXPECT_EQ(e.prompt_peak, n_prompt);
    // Bounded: the budget is decided from the whole prompt (rho x 200 = 50 slots per layer on
    // average), and no layer holds more than its budget plus one chunk.
    ASSERT_TRUE(bounded.state.budgets_set);
    int most = 0;
    int64_t sum = 0;
    for (int b_l : bounded.state.budgets) {
      most = std::max(most, b_l);
      sum += b_l;
    }
    const PolicyConfig& cfg = bounded_config_of(*bounded.policy);
    if (cfg.layers == LayerRule::kUniform) {
      EXPECT_EQ(most, 50);
      EXPECT_EQ(bounded.state.budgets, exact.state.budgets);
    } else {
      EXPECT_LE(sum, int64_t{50} * s.n_layer + s.n_layer);  // rho of the prompt over the layers
    }
    EXPECT_LE(b.prompt_peak, most + chunk);
    EXPECT_GT(bounded.state.n_compactions, 5);  // compacted between the chunks
    // The bound the memory pool admits by (peak_slots_for) holds, and is below the prompt.
    FeedPlan plan;
    plan.n_prompt = n_prompt;
    plan.n_total = n_total;
    plan.prompt_chunk = chunk;
    plan.decode_chunk = 1;
    EXPECT_LE(b.peak, bounded.policy->peak_slots_for(plan));
    EXPECT_LT(bounded.policy->peak_slots_for(plan), n_prompt);
    EXPECT_LE(e.peak, exact.policy->peak_slots_for(plan));
    // SnapKV and PyramidKV without hold_budget=on append after the prompt, as with exact.
    if (!cfg.compacts_after_first()) {
      for (int il = 0; il < s.n_layer; ++il)
        EXPECT_EQ(bounded.cache.layer(il).n_slot(),
                  bounded.state.budgets[static_cast<size_t>(il)] + (n_total - n_prompt));
    }
  }
}

TEST(BoundedPrefillSim, AShortPromptOrOneWithinItsBudgetIsCompressedAtItsEnd) {
  test::SimSetup s;
  // ratio=1: the budget is the prompt; nothing is compacted before its end, then the budget holds.
  test::PolicySim all("h2o:ratio=1,prefill=bounded", s);
  const BoundedFeed f = feed_bounded(all, 64, 70, 16);
  EXPECT_EQ(f.prompt_peak, 64);
  EXPECT_EQ(all.state.budgets, std::vector<int>(4, 64));
  EXPECT_EQ(all.cache.layer(0).n_slot(), 64);
  // A prompt of one pass: the first compaction comes after it, as with exact.
  test::PolicySim one("d2o:ratio=0.25,prefill=bounded", s), ref("d2o:ratio=0.25", s);
  feed_bounded(one, 48, 48, 48);
  feed_bounded(ref, 48, 48, 48);
  EXPECT_EQ(one.state.budgets, ref.state.budgets);
  EXPECT_EQ(one.state.n_compactions, 1);
}

// ---- the engine ----------------------------------------------------------------------------------

class BoundedPrefillModel : public test::RandomModelSuite<BoundedPrefillModel> {
 public:
  static test::RandomModelConfig config() {
    test::RandomModelConfig cfg;
    cfg.n_layer = 3;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 27;
    return cfg;
  }
  static const char* file() { return "bounded_prefill_random.gguf"; }
};

std::vector<TokenId> bounded_tokens(int n, uint32_t seed) {
  std::vector<TokenId> p;
  test::Xorshift rng(seed);
  for (int i = 0; i < n; ++i) p.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  return p;
}

bool bounded_same_slots(const KvCache& a, const KvCache& b) {
  for (int il = 0; il < a.n_layer(); ++il) {
    const KvLayer& x = a.layer(il);
    const KvLayer& y = b.layer(il);
    for (int g = 0; g < x.n_head_kv(); ++g) {
      if (x.n_slot(g) != y.n_slot(g)) return false;
      const size_t n = static_cast<size_t>(x.n_slot(g));
      if (test::compare_keys(x, y, g, n) != 0 || test::compare_values(x, y, g, n) != 0)
        return false;
      if (std::memcmp(x.pos(g), y.pos(g), n * 4) != 0) return false;
      if (std::memcmp(x.score(g), y.score(g), n * 4) != 0) return false;
    }
  }
  return true;
}

// A prompt of one pass gives prefill=bounded exactly prefill=exact's result (the budget of the
// whole prompt, compacted once), and prefill=exact in chunks gives the one pass's, bit for bit.
TEST_F(BoundedPrefillModel, OnePassIsExactsResultAndExactIsUnchangedInChunks) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  auto gguf = GgufFile::open(test::scratch_path(BoundedPrefillModel::file()));
  ASSERT_TRUE(gguf.ok());
  auto tok = Tokenizer::from_gguf(**gguf);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::vector<TokenId> prompt = bounded_tokens(160, 13);
  GenerateParams gp;
  gp.n_predict = 10;
  gp.sampling.temperature = 0;
  gp.stop_at_eog = false;
  for (const std::string& base : bounded_bases()) {
    SCOPED_TRACE(base);
    std::shared_ptr<const KvPolicy> exact(parse_kv_policy(base).value());
    std::shared_ptr<const KvPolicy> bounded(parse_kv_policy(base + ",prefill=bounded").value());
    std::shared_ptr<const KvPolicy> said(parse_kv_policy(base + ",prefill=exact").value());
    Sequence a(model_->hparams(), KvType::kF16, exact), b(model_->hparams(), KvType::kF16, bounded),
        c(model_->hparams(), KvType::kF16, said);
    gp.prefill_chunk = 0;
    auto ra = generate(engine, **tok, a, prompt, gp, nullptr);
    auto rb = generate(engine, **tok, b, prompt, gp, nullptr);
    gp.prefill_chunk = 48;
    auto rc = generate(engine, **tok, c, prompt, gp, nullptr);
    ASSERT_TRUE(ra.ok() && rb.ok() && rc.ok());
    EXPECT_EQ(ra->tokens, rb->tokens);
    EXPECT_EQ(ra->tokens, rc->tokens);
    EXPECT_TRUE(bounded_same_slots(a.cache(), b.cache()));
    EXPECT_TRUE(bounded_same_slots(a.cache(), c.cache()));
    EXPECT_EQ(a.policy_state().budgets, b.policy_state().budgets);
  }
}

// In chunks, the cache never holds more than the budget (rho of the whole prompt) plus one pass:
// a slot limit of that much is enough for prefill=bounded, where prefill=exact, which holds the
// whole prompt, runs out of it.
TEST_F(BoundedPrefillModel, AChunkedPrefillStaysWithinTheBudgetPlusOnePass) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  auto gguf = GgufFile::open(test::scratch_path(BoundedPrefillModel::file()));
  ASSERT_TRUE(gguf.ok());
  auto tok = Tokenizer::from_gguf(**gguf);
  ASSERT_TRUE(tok.ok());
  const int n_prompt = 400, chunk = 48;
  const std::vector<TokenId> prompt = bounded_tokens(n_prompt, 17);
  GenerateParams gp;
  gp.n_predict = 8;
  gp.sampling.temperature = 0;
  gp.stop_at_eog = false;
  gp.prefill_chunk = chunk;
  for (const std::string& base : bounded_bases()) {
    if (base.find("heads=ada") != std::string::npos) continue;  // a head may hold the layer's
    SCOPED_TRACE(base);
    std::shared_ptr<const KvPolicy> bounded(parse_kv_policy(base + ",prefill=bounded").value());
    std::shared_ptr<const KvPolicy> exact(parse_kv_policy(base).value());
    const std::vector<int> passes = prefill_chunks(n_prompt, chunk, bounded->needs().window);
    const int longest = *std::max_element(passes.begin(), passes.end());
    // 0.25 x 400 = 100 slots per layer on average; D2O's paper reading shares the total by
    // variance, a layer at most 400 x 0.25 x 3 (the clamp is the slots held, <= 100 + a pass).
    const PolicyConfig& cfg = bounded_config_of(*bounded);
    const int budget = cfg.layers == LayerRule::kUniform ? 101 : 100 + longest;
    // A cold tier's recall (d2o's default) adds its slots to the last pass's, in one layer at a
    // time.
    const int recall =
        bounded->cold_tier().enabled() ? static_cast<int>(bounded->cold_tier().max_recall()) : 0;
    const int limit = budget + longest + gp.n_predict;
    Sequence b(model_->hparams(), KvType::kF16, bounded), e(model_->hparams(), KvType::kF16, exact);
    ASSERT_TRUE(b.cache().set_slot_limit(limit, recall).ok());
    ASSERT_TRUE(e.cache().set_slot_limit(limit, recall).ok());
    auto rb = generate(engine, **tok, b, prompt, gp, nullptr);
    EXPECT_TRUE(rb.ok()) << rb.status().to_string();
    EXPECT_FALSE(generate(engine, **tok, e, prompt, gp, nullptr).ok());
    // Compacted after every pass from the third on (two passes of 48 fit the 100 slots).
    EXPECT_GE(b.policy_state().n_compactions, static_cast<int64_t>(passes.size()) - 2);
    for (int il = 0; il < b.cache().n_layer(); ++il)
      EXPECT_LE(b.cache().layer(il).n_slot(), budget + gp.n_predict);
  }
}

// With a cold tier, what the chunks' compactions evict goes cold, and the prompt's last chunk
// recalls from it (a pass of several tokens that ends a prompt of a started sequence); every
// token stays in exactly one tier. prefill=exact fills the tier only at the prompt's end.
TEST_F(BoundedPrefillModel, ChunkEvictionsGoColdAndTheLastChunkRecalls) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  const std::string cold =
      ",window=8,kernel=3,cold=memory,cold_type=f16,recall=6,recall_all_up_to=0";
  std::shared_ptr<const KvPolicy> bounded(
      parse_kv_policy("d2o:ratio=0.25,prefill=bounded" + cold).value());
  std::shared_ptr<const KvPolicy> exact(parse_kv_policy("d2o:ratio=0.25" + cold).value());
  const std::vector<TokenId> prompt = bounded_tokens(192, 19);
  const std::vector<int> passes = {48, 48, 48, 48};
  for (const auto& pol : {bounded, exact}) {
    const bool is_bounded = pol == bounded;
    SCOPED_TRACE(pol->spec());
    Sequence s(model_->hparams(), KvType::kF16, pol);
    const ColdTier* tier = s.cache().cold();
    ASSERT_NE(tier, nullptr);
    size_t at = 0;
    for (size_t i = 0; i < passes.size(); ++i) {
      BatchEntry be;
      be.seq = &s;
      be.tokens = std::span<const TokenId>(prompt.data() + at, static_cast<size_t>(passes[i]));
      at += static_cast<size_t>(passes[i]);
      be.prompt_rest = static_cast<int64_t>(prompt.size() - at);
      be.logits_from = be.prompt_rest > 0 ? BatchEntry::kNoLogits : -1;
      ASSERT_TRUE(engine.forward({&be, 1}, nullptr).ok());
      if (be.prompt_rest > 0) {
        // 0.25 x 192 = 48: bounded compacts from the second chunk on, sending what it evicts cold.
        EXPECT_EQ(tier->total_slots() > 0, is_bounded && i >= 1) << "pass " << i;
        EXPECT_EQ(s.cache().layer(0).n_slot(), is_bounded ? std::min<int>(48, static_cast<int>(at))
                                                          : static_cast<int>(at));
      }
    }
    EXPECT_EQ(tier->recall_turns(), is_bounded ? 1 : 0);
    EXPECT_EQ(tier->recalled_slots(), is_bounded ? int64_t{6} * 3 * 2 : 0);  // 6 x layers x heads
    for (int il = 0; il < s.cache().n_layer(); ++il) {
      for (int g = 0; g < 2; ++g) {
        EXPECT_EQ(s.cache().layer(il).n_slot(g), 48);
        EXPECT_EQ(s.cache().layer(il).n_slot(g) + tier->n_slots(il, g), 192) << il << " " << g;
      }
    }
  }
}

// The evaluations' chunked prefill (eval/fork.h, `--chunk`): each policy fed its own passes; the
// full cache and prefill=exact get the shared one-pass prefill's caches and logits bit for bit,
// prefill=bounded the cache a chunked prompt gives it.
TEST_F(BoundedPrefillModel, TheEvaluationsChunkedPrefillFeedsEachPolicyItsPasses) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  const std::vector<TokenId> prompt = bounded_tokens(200, 23);
  std::vector<std::shared_ptr<const KvPolicy>> ps;
  for (const char* spec : {"full", "d2o:ratio=0.25", "snapkv:ratio=0.25", "h2o:ratio=0.25",
                           "d2o:ratio=0.25,prefill=bounded", "h2o:budget=50"})
    ps.emplace_back(parse_kv_policy(spec).value());
  const std::vector<KvType> types(ps.size(), KvType::kF16);
  auto shared = eval::prefill_in_chunks(engine, prompt, ps, types, 0);
  auto chunked = eval::prefill_in_chunks(engine, prompt, ps, types, 64);
  ASSERT_TRUE(shared.ok() && chunked.ok());
  EXPECT_LT(shared->n_prefills, static_cast<int>(ps.size()));
  EXPECT_EQ(chunked->n_prefills, static_cast<int>(ps.size()));
  for (size_t i = 0; i < 4; ++i) {  // full and prefill=exact
    SCOPED_TRACE(ps[i]->spec());
    EXPECT_TRUE(bounded_same_slots(shared->seqs[i]->cache(), chunked->seqs[i]->cache()));
    EXPECT_EQ(shared->last_logits_of[i], chunked->last_logits_of[i]);
  }
  for (size_t i = 4; i < ps.size(); ++i) {  // compacted between the passes: the whole-prompt
    SCOPED_TRACE(ps[i]->spec());           // cache differs, the direct chunked feed's does not
    EXPECT_FALSE(bounded_same_slots(shared->seqs[i]->cache(), chunked->seqs[i]->cache()));
    Sequence direct(model_->hparams(), KvType::kF16, ps[i]);
    size_t at = 0;
    for (const int n : prefill_chunks(200, 64, ps[i]->needs().window)) {
      BatchEntry be;
      be.seq = &direct;
      be.tokens = std::span<const TokenId>(prompt.data() + at, static_cast<size_t>(n));
      at += static_cast<size_t>(n);
      be.prompt_rest = static_cast<int64_t>(prompt.size() - at);
      be.logits_from = be.prompt_rest > 0 ? BatchEntry::kNoLogits : -1;
      ASSERT_TRUE(engine.forward({&be, 1}, nullptr).ok());
    }
    EXPECT_TRUE(bounded_same_slots(direct.cache(), chunked->seqs[i]->cache()));
    EXPECT_GT(direct.policy_state().n_compactions, 1);
  }
}

}  // namespace
}  // namespace d2o
