// The shared prefill of the evaluation harness (src/eval/fork.h) against the engine run
// directly: a sequence forked from one prompt pass must continue bit for bit like a sequence
// that ran the prompt through Engine::forward with its own policy (same logits at every decode
// step, same cache contents, same policy counters), for every preset and for policies whose
// statistics need separate prefills.
#include <gtest/gtest.h>

#include <cstring>

#include "common/kv_rows.h"
#include "common/random_model.h"
#include "common/test_util.h"
#include "eval/fork.h"
#include "kv/policy/composed.h"
#include "model/model.h"

namespace d2o {
namespace {

struct Fixture {
  std::unique_ptr<Model> model;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<Engine> engine;
};

Fixture load_gqa_model(int threads) {
  test::RandomModelConfig cfg;
  cfg.n_layer = 4;
  cfg.n_head = 4;
  cfg.n_head_kv = 2;
  cfg.seed = 11;
  const std::string path = ::d2o::test::scratch_path("eval_fork_gqa.gguf");
  EXPECT_TRUE(test::make_random_model(cfg).write(path).ok());
  Fixture f;
  auto m = Model::load(path);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  f.model = std::move(m).value();
  f.pool = std::make_unique<ThreadPool>(threads);
  f.engine = std::make_unique<Engine>(*f.model, *f.pool, EngineOptions{});
  return f;
}

std::shared_ptr<const KvPolicy> policy(const std::string& spec) {
  auto p = parse_kv_policy(spec);
  EXPECT_TRUE(p.ok()) << spec << ": " << p.status().to_string();
  return std::shared_ptr<const KvPolicy>(std::move(p).value());
}

void expect_same_cache(const KvCache& a, const KvCache& b, const std::string& what) {
  ASSERT_EQ(a.n_layer(), b.n_layer());
  for (int il = 0; il < a.n_layer(); ++il) {
    const KvLayer &A = a.layer(il), &B = b.layer(il);
    ASSERT_EQ(A.n_slot(), B.n_slot()) << what << " layer " << il;
    for (int h = 0; h < A.n_head_kv(); ++h) {
      const size_t n = static_cast<size_t>(A.n_slot());
      EXPECT_EQ(0, test::compare_keys(A, B, h, n)) << what << " keys " << il;
      EXPECT_EQ(0, test::compare_values(A, B, h, n)) << what << " values " << il;
      EXPECT_EQ(0, std::memcmp(A.pos(h), B.pos(h), n * 4))
          << what;
      EXPECT_EQ(0, std::memcmp(A.score(h), B.score(h), n * 4))
          << what;
    }
    // The recorded queries (expected attention) alike.
    const QueryWindow &qa = a.queries(il), &qb = b.queries(il);
    ASSERT_EQ(qa.count(), qb.count()) << what << " recorded queries " << il;
    for (int i = 0; i < qa.count(); ++i)
      for (int h = 0; h < qa.n_head(); ++h)
        EXPECT_EQ(0, std::memcmp(qa.query(h, i), qb.query(h, i), sizeof(float) * qa.head_dim()))
            << what << " recorded query " << il;
  }
}

TEST(EvalFork, GroupsPoliciesByStatistics) {
  std::vector<std::shared_ptr<const KvPolicy>> ps = {policy("full"),
                                                     policy("d2o:ratio=0.3"),
                                                     policy("snapkv:ratio=0.3"),
                                                     policy("h2o:ratio=0.3,agg=mean"),
                                                     policy("snapkv:ratio=0.3,window=16"),
                                                     policy("streaming:ratio=0.3")};
  const eval::PrefillGroups g = eval::group_by_stats(ps);
  ASSERT_EQ(g.group_of.size(), ps.size());
  EXPECT_EQ(g.group_of[0], 0);
  EXPECT_EQ(g.group_of[1], 0);  // sum aggregation joins the full cache's group
  EXPECT_EQ(g.group_of[2], 0);  // window 32 fits a group without window
  EXPECT_EQ(g.group_of[3], 1);  // mean aggregation needs its own prefill
  EXPECT_NE(g.group_of[4], 0);  // window 16 differs from 32
  EXPECT_EQ(g.group_of[5], 0);
  EXPECT_TRUE(g.needs[0].accumulate);
  EXPECT_EQ(g.needs[0].window, 32);
  EXPECT_EQ(g.needs[1].agg, ScoreAgg::kMean);
}

// Every preset, in ratio and budget mode, continues after the forked prefill exactly as after
// its own prompt pass.
TEST(EvalFork, ForkedSequencesContinueLikeDirectOnes) {
  for (int threads : {1, 2}) {
    Fixture f = load_gqa_model(threads);
    const auto tokens = test::random_model_tokens(140, f.model->hparams().n_vocab);
    const std::span<const TokenId> prompt(tokens.data(), 100);
    std::vector<std::string> specs = {"full",
                                      "streaming:ratio=0.3",
                                      "h2o:ratio=0.3",
                                      "h2o:ratio=0.3,agg=max",
                                      "snapkv:ratio=0.4",
                                      "snapkv:ratio=0.5,window=16,pool=max",
                                      "pyramidkv:ratio=0.5",
                                      "roco:ratio=0.3",
                                      "cam:ratio=0.3",
                                      "d2o:ratio=0.3",
                                      "d2o:ratio=0.3,prompt_ranking=reconstruction",
                                      "d2o:ratio=0.3,prompt_ranking=expected",
                                      "h2o:ratio=0.3,scorer=expected_attention",
                                      "d2o:ratio=0.3,reading=research",
                                      "d2o:budget=40",
                                      "streaming:budget=40,pos=shift"};
    std::vector<std::shared_ptr<const KvPolicy>> ps;
    for (const auto& s : specs) ps.push_back(policy(s));
    auto forked = eval::prefill_forked(*f.engine, prompt, ps, KvType::kF16);
    ASSERT_TRUE(forked.ok()) << forked.status().to_string();
    EXPECT_EQ(forked->n_prefills, 3);  // {sum, window 32}, {max}, {window 16}
    const int nv = f.model->hparams().n_vocab;
    for (size_t i = 0; i < specs.size(); ++i) {
      SCOPED_TRACE(specs[i] + " threads " + std::to_string(threads));
      Sequence direct(f.model->hparams(), KvType::kF16, ps[i]);
      BatchEntry be{&direct, prompt, -1};
      std::vector<float> direct_logits;
      ASSERT_TRUE(f.engine
                      ->forward({&be, 1},
                                [&](int, int, const float* l) { direct_logits.assign(l, l + nv); })
                      .ok());
      EXPECT_EQ(0,
                std::memcmp(direct_logits.data(), forked->last_logits.data(), sizeof(float) * nv));
      Sequence& fs = *forked->seqs[i];
      expect_same_cache(direct.cache(), fs.cache(), "after prompt");
      EXPECT_EQ(direct.policy_state().budgets, fs.policy_state().budgets);
      // Decode 40 tokens (past the prompt's budget, so eviction and merging run every step).
      for (size_t t = 100; t < tokens.size(); ++t) {
        std::vector<float> a, b;
        BatchEntry e1{&direct, {&tokens[t], 1}, -1}, e2{&fs, {&tokens[t], 1}, -1};
        ASSERT_TRUE(
            f.engine->forward({&e1, 1}, [&](int, int, const float* l) { a.assign(l, l + nv); })
                .ok());
        ASSERT_TRUE(
            f.engine->forward({&e2, 1}, [&](int, int, const float* l) { b.assign(l, l + nv); })
                .ok());
        ASSERT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * nv)) << "step " << t;
      }
      expect_same_cache(direct.cache(), fs.cache(), "after decoding");
      EXPECT_EQ(direct.policy_state().evicted, fs.policy_state().evicted);
      EXPECT_EQ(direct.policy_state().merged, fs.policy_state().merged);
      const D2oMergeState* da = d2o_merge_state(direct.policy_state());
      const D2oMergeState* fa = d2o_merge_state(fs.policy_state());
      ASSERT_EQ(da == nullptr, fa == nullptr);
      if (da) {
        EXPECT_EQ(da->tau, fa->tau);
      }
      EXPECT_EQ(direct.policy_state().pos_shift, fs.policy_state().pos_shift);
    }
  }
}

// Policies in different storage types (equal-bytes comparisons): one prefill per type, and each
// forked sequence continues like one that ran the prompt in its own type, in one mixed batch.
TEST(EvalFork, MixedStorageTypesForkLikeDirectOnes) {
  test::RandomModelConfig cfg;
  cfg.n_layer = 2;
  cfg.n_embd = 128;
  cfg.n_head = 2;
  cfg.n_head_kv = 1;
  cfg.seed = 5;  // head_dim 64: every quantized and rotated type fits
  const std::string path = ::d2o::test::scratch_path("eval_fork_types.gguf");
  ASSERT_TRUE(test::make_random_model(cfg).write(path).ok());
  auto m = Model::load(path);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  ThreadPool pool(2);
  Engine engine(**m, pool, EngineOptions{});
  const int nv = (*m)->hparams().n_vocab;
  const auto tokens = test::random_model_tokens(110, nv);
  const std::span<const TokenId> prompt(tokens.data(), 90);
  const std::vector<std::pair<std::string, std::string>> cases = {{"full", "f16"},
                                                                  {"h2o:ratio=0.3", "q8_0"},
                                                                  {"d2o:ratio=0.3", "q4_0r"},
                                                                  {"full", "q8_0"},
                                                                  {"snapkv:ratio=0.4", "f16"},
                                                                  {"h2o:ratio=0.3,scorer=expected_attention", "q4_0r"},
                                                                  {"d2o:ratio=0.3,prompt_ranking=expected", "q4_0"}};
  std::vector<std::shared_ptr<const KvPolicy>> ps;
  std::vector<KvType> types;
  for (const auto& [spec, type] : cases) {
    ps.push_back(policy(spec));
    auto t = parse_kv_type(type);
    ASSERT_TRUE(t.ok());
    types.push_back(*t);
  }
  auto forked = eval::prefill_forked(engine, prompt, ps, types);
  ASSERT_TRUE(forked.ok()) << forked.status().to_string();
  EXPECT_EQ(forked->n_prefills, 4);  // one per storage type
  std::vector<std::unique_ptr<Sequence>> direct;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].first + " in " + cases[i].second);
    EXPECT_EQ(forked->seqs[i]->cache().config().type, types[i]);
    direct.push_back(std::make_unique<Sequence>((*m)->hparams(), types[i], ps[i]));
    BatchEntry be{direct.back().get(), prompt, -1};
    std::vector<float> logits;
    ASSERT_TRUE(
        engine.forward({&be, 1}, [&](int, int, const float* l) { logits.assign(l, l + nv); }).ok());
    ASSERT_EQ(forked->last_logits_of[i].size(), static_cast<size_t>(nv));
    EXPECT_EQ(0, std::memcmp(logits.data(), forked->last_logits_of[i].data(), sizeof(float) * nv));
    expect_same_cache(direct.back()->cache(), forked->seqs[i]->cache(), "after prompt");
  }
  // Decoding: every forked sequence in one mixed-type batch, each direct one alone.
  for (size_t t = 90; t < tokens.size(); ++t) {
    std::vector<BatchEntry> batch;
    for (auto& s : forked->seqs) batch.push_back({s.get(), {&tokens[t], 1}, -1});
    std::vector<std::vector<float>> got(cases.size());
    ASSERT_TRUE(
        engine
            .forward(batch, [&](int e, int,
                                const float* l) { got[static_cast<size_t>(e)].assign(l, l + nv); })
            .ok());
    for (size_t i = 0; i < cases.size(); ++i) {
      std::vector<float> want;
      BatchEntry be{direct[i].get(), {&tokens[t], 1}, -1};
      ASSERT_TRUE(
          engine.forward({&be, 1}, [&](int, int, const float* l) { want.assign(l, l + nv); }).ok());
      ASSERT_EQ(0, std::memcmp(want.data(), got[i].data(), sizeof(float) * nv))
          << cases[i].first << " in " << cases[i].second << " token " << t;
    }
  }
}

// Sequences advanced together in one batch give the same logits as each advanced alone (the
// harness feeds all policies of a comparison in one forward pass).
TEST(EvalFork, BatchedSequencesMatchSingleOnes) {
  Fixture f = load_gqa_model(2);
  const auto tokens = test::random_model_tokens(90, f.model->hparams().n_vocab);
  const int nv = f.model->hparams().n_vocab;
  const std::vector<std::string> specs = {"full", "h2o:budget=24", "d2o:budget=24",
                                          "snapkv:budget=40"};
  std::vector<std::unique_ptr<Sequence>> batched, single;
  for (const auto& s : specs) {
    batched.push_back(std::make_unique<Sequence>(f.model->hparams(), KvType::kF16, policy(s)));
    single.push_back(std::make_unique<Sequence>(f.model->hparams(), KvType::kF16, policy(s)));
  }
  for (size_t t = 0; t < tokens.size(); ++t) {
    std::vector<BatchEntry> batch;
    for (auto& s : batched) batch.push_back({s.get(), {&tokens[t], 1}, -1});
    std::vector<std::vector<float>> got(specs.size());
    ASSERT_TRUE(
        f.engine
            ->forward(batch, [&](int e, int,
                                 const float* l) { got[static_cast<size_t>(e)].assign(l, l + nv); })
            .ok());
    for (size_t i = 0; i < specs.size(); ++i) {
      std::vector<float> want;
      BatchEntry be{single[i].get(), {&tokens[t], 1}, -1};
      ASSERT_TRUE(
          f.engine->forward({&be, 1}, [&](int, int, const float* l) { want.assign(l, l + nv); })
              .ok());
      ASSERT_EQ(0, std::memcmp(want.data(), got[i].data(), sizeof(float) * nv))
          << specs[i] << " token " << t;
    }
  }
}

TEST(EvalFork, CopyCacheRejectsShapeMismatch) {
  KvCache a(KvCacheConfig{2, 2, 8, KvType::kF16}), b(KvCacheConfig{2, 2, 8, KvType::kF32});
  EXPECT_FALSE(eval::copy_cache(a, b).ok());
}

}  // namespace
}  // namespace d2o
