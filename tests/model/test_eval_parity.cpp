// The evaluation harness on real weights against the engine used directly (no harness artefact):
//  - `ppl`'s full-cache NLLs equal a plain token-by-token loop over Engine::forward, and with
//    one pass per context they equal perplexity() (what `d2o perplexity` reports);
//  - a capacity at least the text length reproduces the full cache exactly;
//  - `niah`'s greedy answers (shared prefill, all policies in one batch) equal generate()'s, for
//    the full cache and for compressed policies;
//  - needle prompts have exactly the asked length and contain the key at the asked depth.
#include <gtest/gtest.h>

#include <cmath>

#include "common/test_util.h"
#include "eval/answer.h"
#include "eval/fidelity.h"
#include "eval/niah.h"
#include "eval/perplexity.h"
#include "eval/stream_ppl.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "runtime/chat_template.h"
#include "runtime/generator.h"
#include "runtime/tokenizer.h"

namespace d2o {
namespace {

struct Real {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::optional<ChatTemplate> chat;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<Engine> engine;
};

Real load_real(const std::string& path) {
  Real r;
  auto file = GgufFile::open(path);
  EXPECT_TRUE(file.ok()) << file.status().to_string();
  auto m = Model::load(**file);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  r.model = std::move(m).value();
  auto t = Tokenizer::from_gguf(**file);
  EXPECT_TRUE(t.ok());
  r.tok = std::move(t).value();
  if (auto c = ChatTemplate::from_gguf(**file); c.ok()) r.chat = *c;
  // One thread: the machine is shared, and results do not depend on the thread count.
  r.pool = std::make_unique<ThreadPool>(1);
  r.engine = std::make_unique<Engine>(*r.model, *r.pool, EngineOptions{});
  return r;
}

std::vector<TokenId> kjv_tokens(const Tokenizer& tok, size_t n) {
  const std::string text = test::read_file(test::text_dir() + "/kjv.txt").substr(200000, 40000);
  EncodeOptions enc;
  auto ids = tok.encode(text, enc);
  EXPECT_TRUE(ids.ok());
  EXPECT_GE(ids->size(), n);
  ids->resize(n);
  return *ids;
}

#define REQUIRE_KJV()                                                                         \
  if (!test::file_exists(test::text_dir() + "/kjv.txt")) {                                    \
    GTEST_SKIP() << "KJV text not found in " << test::text_dir() << ": run scripts/setup.sh"; \
  }

TEST(EvalParity, PplFullCacheEqualsTheEngineAndPerplexity) {
  D2O_REQUIRE_MODEL(path);
  REQUIRE_KJV();
  Real r = load_real(path);
  const int n = 256;
  const auto tokens = kjv_tokens(*r.tok, n);
  const int nv = r.model->hparams().n_vocab;

  // Harness, one token per pass, full cache plus a capacity >= the text and a small one.
  eval::StreamPplParams p;
  p.policies = {"full", "d2o", "h2o"};
  p.capacities = {n, 64};
  p.n_tokens = n;
  p.chunk = 1;
  p.n_ctx_train = r.model->hparams().n_ctx_train;
  auto res = eval::run_stream_ppl(*r.engine, tokens, p, nullptr);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  ASSERT_EQ(res->runs[0].capacity, 0);
  const std::vector<float>& full = res->runs[0].nll;

  // The engine directly: one sequence, one token per pass.
  Sequence seq(r.model->hparams(), KvType::kF16, nullptr);
  std::vector<float> direct(n - 1);
  for (int i = 0; i + 1 < n; ++i) {
    BatchEntry be{&seq, {&tokens[static_cast<size_t>(i)], 1}, -1};
    ASSERT_TRUE(r.engine
                    ->forward({&be, 1},
                              [&](int, int, const float* l) {
                                direct[static_cast<size_t>(i)] = static_cast<float>(
                                    -log_prob(l, nv, tokens[static_cast<size_t>(i) + 1]));
                              })
                    .ok());
  }
  for (int i = 0; i + 1 < n; ++i)
    ASSERT_EQ(full[static_cast<size_t>(i)], direct[static_cast<size_t>(i)]) << i;

  // Budgets >= the text: identical to the full cache; the small budget: identical before the
  // capacity is reached, different after.
  for (const auto& run : res->runs) {
    if (run.capacity == n) {
      EXPECT_EQ(run.nll, full) << run.spec;
    }
    if (run.capacity == 64) {
      for (int i = 0; i < 64; ++i)
        ASSERT_EQ(run.nll[static_cast<size_t>(i)], full[static_cast<size_t>(i)]) << run.spec;
      EXPECT_NE(run.nll, full) << run.spec;
    }
  }

  // perplexity() (d2o perplexity) scores the second half of one pass over the context. The
  // harness with the whole text in one pass gives exactly its figures; one token per pass agrees
  // to float rounding of the attention (different query blocking).
  PerplexityParams pp;
  pp.n_ctx = n;
  auto ref = perplexity(*r.engine, tokens, pp, nullptr);
  ASSERT_TRUE(ref.ok());
  p.policies = {"full"};
  p.chunk = n;
  auto one_pass = eval::run_stream_ppl(*r.engine, tokens, p, nullptr);
  ASSERT_TRUE(one_pass.ok());
  double sum_pass = 0, sum_tok = 0;
  for (int i = n / 2; i + 1 < n; ++i) {
    sum_pass += one_pass->runs[0].nll[static_cast<size_t>(i)];
    sum_tok += full[static_cast<size_t>(i)];
  }
  const double nd = static_cast<double>(ref->n_scored);
  EXPECT_NEAR(sum_pass / nd, ref->nll_sum / nd, 1e-6);  // float storage of the per-token NLLs
  EXPECT_NEAR(sum_tok / nd, ref->nll_sum / nd, 1e-3);
  std::printf(
      "mean NLL of the second half: perplexity() %.6f, harness one pass %.6f, token by token "
      "%.6f\n",
      ref->nll_sum / nd, sum_pass / nd, sum_tok / nd);
}

TEST(EvalParity, FidelityFullCacheHasZeroKlAgainstItself) {
  D2O_REQUIRE_MODEL(path);
  REQUIRE_KJV();
  Real r = load_real(path);
  const auto tokens = kjv_tokens(*r.tok, 400);
  eval::FidelityParams p;
  auto full = eval::make_policy("full", "full");
  auto big = eval::make_policy("d2o:budget=100000", "d2o big");
  auto small = eval::make_policy("d2o:ratio=0.2", "d2o");
  ASSERT_TRUE(full.ok() && big.ok() && small.ok());
  p.cases = {{"full", "-", *full}, {"d2o big", "-", *big}, {"d2o", "0.2", *small}};
  p.prompt_len = 160;
  p.n_samples = 2;
  p.n_continue = 12;
  p.n_ctx_train = r.model->hparams().n_ctx_train;
  auto res = eval::run_fidelity(*r.engine, tokens, p, nullptr);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  for (int c : {0, 1}) {
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(res->cases[c].kl[s], 0.0);
      EXPECT_EQ(res->cases[c].top1[s], 1.0);
      EXPECT_EQ(res->cases[c].nll[s], res->cases[c].nll_full[s]);
    }
  }
  EXPECT_GT(res->cases[2].kl[0], 0.0);
}

// With bos set, every window starts with that token: the same as the text with the window's
// first token overwritten, and (another token there) not the same as the text as it is.
TEST(EvalParity, FidelityWindowsStartWithBosWhenAsked) {
  D2O_REQUIRE_MODEL(path);
  REQUIRE_KJV();
  Real r = load_real(path);
  const auto tokens = kjv_tokens(*r.tok, 200);
  auto full = eval::make_policy("full", "full");
  auto small = eval::make_policy("h2o:ratio=0.3", "h2o");
  ASSERT_TRUE(full.ok() && small.ok());
  eval::FidelityParams p;
  p.cases = {{"full", "-", *full}, {"h2o", "0.3", *small}};
  p.prompt_len = 48;
  p.n_samples = 2;
  p.n_continue = 4;
  p.n_ctx_train = r.model->hparams().n_ctx_train;
  const TokenId bos = r.tok->bos() >= 0 && r.tok->bos() != tokens[0] ? r.tok->bos() : 1;
  p.bos = bos;
  auto with_bos = eval::run_fidelity(*r.engine, tokens, p, nullptr);
  ASSERT_TRUE(with_bos.ok()) << with_bos.status().to_string();
  std::vector<TokenId> edited = tokens;
  for (int64_t off : with_bos->offsets) edited[static_cast<size_t>(off)] = bos;
  p.bos = -1;
  auto by_hand = eval::run_fidelity(*r.engine, edited, p, nullptr);
  auto as_is = eval::run_fidelity(*r.engine, tokens, p, nullptr);
  ASSERT_TRUE(by_hand.ok() && as_is.ok());
  ASSERT_EQ(with_bos->offsets, by_hand->offsets);
  for (size_t c = 0; c < 2; ++c) {
    EXPECT_EQ(with_bos->cases[c].nll_full, by_hand->cases[c].nll_full);
    EXPECT_EQ(with_bos->cases[c].kl, by_hand->cases[c].kl);
  }
  EXPECT_NE(with_bos->cases[0].nll_full, as_is->cases[0].nll_full);
}

TEST(EvalParity, NiahPromptHasTheAskedLengthAndNeedle) {
  D2O_REQUIRE_MODEL(path);
  REQUIRE_KJV();
  Real r = load_real(path);
  const std::string hay = test::read_file(test::text_dir() + "/kjv.txt").substr(0, 200000);
  auto b = eval::NiahBuilder::create(*r.tok, r.chat ? &*r.chat : nullptr, hay);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  for (auto task : {eval::NiahTask::kNeedle, eval::NiahTask::kPasskey}) {
    for (double depth : {0.0, 0.5, 1.0}) {
      auto t = b->build(task, 700, depth, 99);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      EXPECT_EQ(t->prompt.size(), 700u);
      auto text = r.tok->decode(t->prompt, /*render_special=*/true);
      ASSERT_TRUE(text.ok());
      const size_t key_at = text->find(t->key);
      ASSERT_NE(key_at, std::string::npos);
      EXPECT_NEAR(t->depth_used, depth, 0.15);
      if (r.chat) {
        EXPECT_NE(text->find("<|im_start|>assistant"), std::string::npos);
      }
      // Same seed, same trial; another seed, another key.
      EXPECT_EQ(b->build(task, 700, depth, 99)->prompt, t->prompt);
      EXPECT_NE(b->build(task, 700, depth, 100)->key, t->key);
    }
  }
  EXPECT_FALSE(b->build(eval::NiahTask::kNeedle, 20, 0.5, 1).ok());
}

// The harness's answers (src/eval/answer.h) are what a user gets from generate(): in the before
// setting, the prompt then greedy decoding; in the after setting, as a session does it, the
// context turn in one pass (compacted after it), then the question turn fed to the same sequence
// by generate(), for each of two questions about one context.
TEST(EvalParity, NiahGreedyAnswersEqualGenerate) {
  D2O_REQUIRE_MODEL(path);
  REQUIRE_KJV();
  Real r = load_real(path);
  const std::string hay = test::read_file(test::text_dir() + "/kjv.txt").substr(0, 200000);
  std::vector<eval::PolicyUnderTest> pols;
  for (const char* s :
       {"full", "d2o:ratio=0.2", "h2o:ratio=0.3", "snapkv:ratio=0.3", "streaming:budget=100"}) {
    auto t = eval::make_policy(s, s);
    ASSERT_TRUE(t.ok());
    pols.push_back(*t);
  }
  const int max_new = 10;
  for (auto setting : {eval::QuestionSetting::kBefore, eval::QuestionSetting::kAfter}) {
    SCOPED_TRACE(eval::question_setting_name(setting));
    eval::QuestionShape shape;
    shape.setting = setting;
    shape.questions = setting == eval::QuestionSetting::kAfter ? 2 : 1;
    auto b = eval::NiahBuilder::create(*r.tok, r.chat ? &*r.chat : nullptr, hay, shape);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    int full_correct = 0;
    // After: the needle task, whose two questions exercise the copies (passkey asks once).
    const std::vector<eval::NiahTask> tasks =
        setting == eval::QuestionSetting::kAfter
            ? std::vector<eval::NiahTask>{eval::NiahTask::kNeedle}
            : std::vector<eval::NiahTask>{eval::NiahTask::kNeedle, eval::NiahTask::kPasskey};
    for (auto task : tasks) {
      auto t = b->build(task, 400, 0.5, 5);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      const std::span<const TokenId> prompt(t->prompt);
      eval::AnswerRequest req;
      req.context = prompt.first(static_cast<size_t>(t->context_end));
      std::vector<std::span<const TokenId>> turns;
      std::vector<std::string> keys = {t->key};
      if (setting == eval::QuestionSetting::kAfter) {
        ASSERT_LT(t->context_end, static_cast<int64_t>(t->prompt.size()));
        turns.push_back(prompt.subspan(static_cast<size_t>(t->context_end)));
        for (const auto& f : t->more) {
          turns.push_back(f.tokens);
          keys.push_back(f.key);
        }
        EXPECT_EQ(turns.size(), 2u);  // two needles, two questions
      } else {
        ASSERT_EQ(t->context_end, static_cast<int64_t>(t->prompt.size()));
      }
      req.questions = turns;
      req.policies = pols;
      req.max_new = max_new;
      auto answers = eval::answer_questions(*r.engine, *r.tok, req);
      ASSERT_TRUE(answers.ok()) << answers.status().to_string();
      ASSERT_EQ(answers->tokens.size(), std::max<size_t>(1, turns.size()));
      for (size_t q = 0; q < answers->tokens.size(); ++q)
        full_correct += eval::answer_matches(answers->text[q][0], keys[q]);
      for (size_t i = 0; i < pols.size(); ++i) {
        GenerateParams gp;
        gp.n_predict = max_new;
        gp.sampling.temperature = 0;
        gp.stop_at_eog = true;
        if (turns.empty()) {
          Sequence seq(r.model->hparams(), KvType::kF16, pols[i].policy);
          auto g = generate(*r.engine, *r.tok, seq, t->prompt, gp, nullptr);
          ASSERT_TRUE(g.ok());
          EXPECT_EQ(answers->tokens[0][i], g->tokens)
              << pols[i].spec << ": harness '" << answers->text[0][i] << "' vs generate '"
              << g->text << "'";
          continue;
        }
        // After: the full cache and the window policies (d2o, snapkv), whose ranking the
        // question's absence changes; the others took the same path in the before setting.
        if (i == 2 || i == 4) continue;
        for (size_t q = 0; q < turns.size(); ++q) {
          Sequence seq(r.model->hparams(), KvType::kF16, pols[i].policy);
          BatchEntry be;
          be.seq = &seq;
          be.tokens = req.context;
          be.logits_from = BatchEntry::kNoLogits;
          ASSERT_TRUE(r.engine->forward({&be, 1}, [](int, int, const float*) {}).ok());
          auto g = generate(*r.engine, *r.tok, seq, turns[q], gp, nullptr);
          ASSERT_TRUE(g.ok());
          EXPECT_EQ(answers->tokens[q][i], g->tokens)
              << pols[i].spec << " question " << q << ": harness '" << answers->text[q][i]
              << "' vs generate '" << g->text << "'";
        }
      }
    }
    // The full cache finds every key at this length.
    EXPECT_EQ(full_correct, 2);
  }
}

}  // namespace
}  // namespace d2o
