// The RULER-style task generators (src/eval/ruler.h) with the real tokenizer and chat template,
// checked on the decoded prompt text, independently of how the generator assembled it:
//  - the same seed gives the same prompt and answers, another seed another trial;
//  - a prompt fits its length less the answer budget (niah and vt exactly);
//  - every expected string is in the prompt, and for niah and vt where the recorded depth says
//    (the needle or statement found by searching the decoded context);
//  - niah_multikey's distractors are there too; cwe's 10 words are the most frequent of the
//    numbered list (counted in the text); fwe's 3 answers are the 2nd-4th most frequent words;
//  - the answer prefix closes the prompt, in the assistant's turn.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "common/test_util.h"
#include "eval/ruler.h"
#include "gguf/gguf.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"

namespace d2o {
namespace {

struct Tok {
  std::unique_ptr<Tokenizer> tok;
  std::optional<ChatTemplate> chat;
};

Tok load_tok(const std::string& path) {
  Tok t;
  auto file = GgufFile::open(path);
  EXPECT_TRUE(file.ok()) << file.status().to_string();
  auto tk = Tokenizer::from_gguf(**file);
  EXPECT_TRUE(tk.ok());
  t.tok = std::move(tk).value();
  if (auto c = ChatTemplate::from_gguf(**file); c.ok()) t.chat = *c;
  return t;
}

#define REQUIRE_KJV_TEXT()                                                                    \
  if (!test::file_exists(test::text_dir() + "/kjv.txt")) {                                    \
    GTEST_SKIP() << "KJV text not found in " << test::text_dir() << ": run scripts/setup.sh"; \
  }

std::string decode(const Tokenizer& tok, const std::vector<TokenId>& ids) {
  auto s = tok.decode(ids, /*render_special=*/true);
  EXPECT_TRUE(s.ok());
  return s.ok() ? *s : std::string();
}

size_t count(const std::string& s, const std::string& sub) {
  size_t n = 0;
  for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + 1)) ++n;
  return n;
}

// The context: between the last instruction line and the question (the decoded prompt).
std::string context_of(const std::string& text, const std::string& after,
                       const std::string& before) {
  const size_t b = text.rfind(before);
  const size_t a = text.rfind(after, b);
  EXPECT_NE(a, std::string::npos) << after;
  EXPECT_NE(b, std::string::npos) << before;
  if (a == std::string::npos || b == std::string::npos) return "";
  return text.substr(a + after.size(), b - a - after.size());
}

class RulerGen : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = test::default_model_path();
    if (!test::file_exists(path)) GTEST_SKIP() << "model not found: " << path;
    if (!test::file_exists(test::text_dir() + "/kjv.txt")) GTEST_SKIP() << "no KJV text";
    t_ = load_tok(path);
    hay_ = test::read_file(test::text_dir() + "/kjv.txt").substr(100000, 160000);
    auto b = eval::RulerBuilder::create(*t_.tok, t_.chat ? &*t_.chat : nullptr, hay_);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    b_.emplace(std::move(b).value());
  }
  Tok t_;
  std::string hay_;
  std::optional<eval::RulerBuilder> b_;
};

TEST_F(RulerGen, SameSeedSameTrialAndPromptsFitTheirLength) {
  for (eval::RulerTask task : eval::all_ruler_tasks()) {
    for (int len : {1024, 2048}) {
      auto a = b_->build(task, len, 7);
      ASSERT_TRUE(a.ok()) << eval::ruler_task_name(task) << ": " << a.status().to_string();
      auto again = b_->build(task, len, 7);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(again->prompt, a->prompt);
      EXPECT_EQ(again->expected, a->expected);
      auto other = b_->build(task, len, 8);
      ASSERT_TRUE(other.ok());
      EXPECT_NE(other->expected, a->expected) << eval::ruler_task_name(task);
      const int budget = len - eval::ruler_max_new(task);
      EXPECT_EQ(a->max_new, eval::ruler_max_new(task));
      EXPECT_LE(static_cast<int>(a->prompt.size()), budget);
      if (task == eval::RulerTask::kCwe || task == eval::RulerTask::kFwe) {
        EXPECT_GE(static_cast<int>(a->prompt.size()), budget - 40) << eval::ruler_task_name(task);
      } else {
        EXPECT_EQ(static_cast<int>(a->prompt.size()), budget) << eval::ruler_task_name(task);
      }
      EXPECT_FALSE(a->expected.empty());
      const std::string text = decode(*t_.tok, a->prompt);
      for (const std::string& e : a->expected) {
        EXPECT_NE(text.find(e), std::string::npos) << eval::ruler_task_name(task) << ": " << e;
      }
      if (t_.chat) {
        // The answer prefix in the assistant's turn closes the prompt.
        const size_t asst = text.rfind("<|im_start|>assistant");
        ASSERT_NE(asst, std::string::npos);
        EXPECT_EQ(text.find("<|im_end|>", asst), std::string::npos);
        EXPECT_GT(text.size() - asst, 30u);
      }
    }
  }
}

TEST_F(RulerGen, NiahNeedlesAreWhereTheDepthsSay) {
  for (eval::RulerTask task :
       {eval::RulerTask::kNiahSingle, eval::RulerTask::kNiahMultikey,
        eval::RulerTask::kNiahMultivalue, eval::RulerTask::kNiahMultiquery}) {
    for (uint64_t seed : {1, 2, 3}) {
      auto t = b_->build(task, 2048, seed);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      const std::string text = decode(*t_.tok, t->prompt);
      const std::string ctx =
          context_of(text, "afterwards.\n",
                     "\nWhat " + std::string(t->expected.size() == 1 ? "is" : "are all"));
      ASSERT_FALSE(ctx.empty());
      // One value asked for (single, multikey), or four (multivalue, multiquery).
      const size_t want =
          task == eval::RulerTask::kNiahMultivalue || task == eval::RulerTask::kNiahMultiquery ? 4
                                                                                               : 1;
      EXPECT_EQ(t->expected.size(), want);
      ASSERT_EQ(t->depths.size(), t->expected.size());
      // Every needle, distractors included, is in the context once.
      const size_t n_needles = task == eval::RulerTask::kNiahSingle ? 1 : 4;
      EXPECT_EQ(t->inserted.size(), n_needles);
      EXPECT_EQ(count(ctx, "One of the special magic numbers for "), n_needles);
      for (const std::string& n : t->inserted) EXPECT_EQ(count(ctx, n), 1u) << n;
      for (size_t i = 0; i < t->expected.size(); ++i) {
        // The needle holding the value: its key is asked, and it sits at the recorded depth
        // (measured in characters of the decoded context, so within a few percent).
        const std::string& v = t->expected[i];
        const size_t at = ctx.find(" is: " + v + ".");
        ASSERT_NE(at, std::string::npos) << v;
        const size_t start = ctx.rfind("One of the special magic numbers for ", at);
        const double depth = static_cast<double>(start) / static_cast<double>(ctx.size());
        EXPECT_NEAR(depth, t->depths[i], 0.05) << eval::ruler_task_name(task) << " " << v;
        const std::string key = ctx.substr(start + 37, at - start - 37);
        EXPECT_NE(t->query.find(key), std::string::npos) << key << " not asked: " << t->query;
      }
      if (task == eval::RulerTask::kNiahMultikey) {
        // Three distractor keys are in the context and not in the question.
        int distractors = 0;
        for (const std::string& n : t->inserted)
          distractors += n.find(t->query) == std::string::npos;
        EXPECT_EQ(distractors, 3);
      }
      if (task == eval::RulerTask::kNiahMultiquery) {
        EXPECT_EQ(count(t->query, ", "), 3u);  // "a, b, c, and d"
        EXPECT_NE(t->query.find(", and "), std::string::npos);
      }
    }
  }
}

TEST_F(RulerGen, VariableTrackingChainIsInOrderAtTheDepths) {
  for (uint64_t seed : {4, 5}) {
    auto t = b_->build(eval::RulerTask::kVt, 2048, seed);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    const std::string text = decode(*t_.tok, t->prompt);
    ASSERT_EQ(t->expected.size(), 5u);
    ASSERT_EQ(t->depths.size(), 5u);
    const std::string ctx = context_of(text, "in the following text.\n\n", "\nQuestion: Find all");
    ASSERT_FALSE(ctx.empty());
    // The chain: the first name holds the value, each next one the previous name.
    size_t prev = 0;
    for (size_t i = 0; i < 5; ++i) {
      const std::string st = "VAR " + t->expected[i] + " = " +
                             (i == 0 ? t->query : "VAR " + t->expected[i - 1]) + "\n";
      const size_t at = ctx.find(st);
      ASSERT_NE(at, std::string::npos) << st;
      EXPECT_EQ(count(ctx, "VAR " + t->expected[i] + " = "), 1u);
      EXPECT_GE(at, prev);
      prev = at;
      EXPECT_NEAR(static_cast<double>(at) / static_cast<double>(ctx.size()), t->depths[i], 0.03);
      const std::string& name = t->expected[i];
      EXPECT_TRUE(name.size() == 5 && std::all_of(name.begin(), name.end(),
                                                  [](char ch) { return ch >= 'A' && ch <= 'Z'; }))
          << name;
    }
    EXPECT_EQ(count(ctx, "VAR "), 5u + 4u);  // 5 statements, 4 of them "= VAR"
    EXPECT_NE(text.find("5 variables are assigned the value " + t->query + ", they are:"),
              std::string::npos);
  }
}

TEST_F(RulerGen, CommonWordsAreTheMostFrequentOfTheList) {
  for (int len : {1024, 4096}) {
    auto t = b_->build(eval::RulerTask::kCwe, len, 11);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_EQ(t->expected.size(), 10u);
    const std::string text = decode(*t_.tok, t->prompt);
    // The last list (the example's comes first).
    const std::string ctx =
        context_of(text, "Memorize the ones that appear most often.\n", "\nQuestion: What are");
    std::map<std::string, int> freq;
    std::istringstream in(ctx);
    std::string num, word;
    int n = 0;
    while (in >> num >> word) {
      ++n;
      EXPECT_EQ(num, std::to_string(n) + ".");
      ++freq[word];
    }
    EXPECT_EQ(n, t->n_items);
    const int cw = len < 4096 ? 6 : 30, ucw = len < 4096 ? 1 : 3;
    for (const auto& [w, f] : freq) {
      const bool common = std::find(t->expected.begin(), t->expected.end(), w) != t->expected.end();
      EXPECT_EQ(f, common ? cw : ucw) << w;
    }
    for (const std::string& e : t->expected) EXPECT_EQ(freq[e], cw) << e;
    EXPECT_GT(freq.size(), 20u);  // the list fills the length with rare words
  }
}

TEST_F(RulerGen, FrequentWordsAreTheSecondToFourthMostFrequent) {
  auto t = b_->build(eval::RulerTask::kFwe, 2048, 3);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->expected.size(), 3u);
  const std::string text = decode(*t_.tok, t->prompt);
  const std::string ctx = context_of(text, "coded words.", "\nQuestion: Do not");
  std::map<std::string, int> freq;
  std::istringstream in(ctx);
  std::string w;
  while (in >> w) ++freq[w];
  std::vector<std::pair<int, std::string>> by;
  for (const auto& [k, f] : freq) by.push_back({f, k});
  std::sort(by.rbegin(), by.rend());
  ASSERT_GE(by.size(), 5u);
  EXPECT_EQ(by[0].second, "....");
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(by[i + 1].second, t->expected[i]);
    EXPECT_GT(by[i + 1].first, by[i + 2].first);  // strictly ordered
  }
}

TEST_F(RulerGen, TooShortLengthsAreRefused) {
  for (eval::RulerTask task : eval::all_ruler_tasks()) {
    auto t = b_->build(task, 60, 1);
    ASSERT_FALSE(t.ok()) << eval::ruler_task_name(task);
    EXPECT_NE(t.status().message().find("too short"), std::string::npos) << t.status().message();
  }
  // A haystack shorter than a niah context.
  auto small = eval::RulerBuilder::create(*t_.tok, nullptr, hay_.substr(0, 20000));
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  auto t = small->build(eval::RulerTask::kNiahSingle, 8192, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("haystack has"), std::string::npos);
  EXPECT_FALSE(eval::RulerBuilder::create(*t_.tok, nullptr, "a tiny text of few words").ok());
}

// The after setting (src/eval/turns.h): the context turn ends with the assistant's turn opened
// (the compaction point); the question turn starts with the fixed acknowledgement, closes the
// assistant's turn and opens a new user turn. Everything the answers need is in the context
// turn. With K questions, niah and vt hold one needle set or chain per question, each asked by a
// follow-up that fits the length; cwe and fwe ask once.
TEST_F(RulerGen, QuestionAfterCompressionIsTheNextTurn) {
  if (!t_.chat) GTEST_SKIP() << "the default model has no chat template";
  for (int k : {1, 3}) {
    eval::QuestionShape shape;
    shape.setting = eval::QuestionSetting::kAfter;
    shape.questions = k;
    auto b = eval::RulerBuilder::create(*t_.tok, &*t_.chat, hay_, shape);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    for (eval::RulerTask task : eval::all_ruler_tasks()) {
      SCOPED_TRACE(std::string(eval::ruler_task_name(task)) + " K=" + std::to_string(k));
      auto t = b->build(task, 2048, 7);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      const int budget = 2048 - t->max_new;
      ASSERT_GT(t->context_end, 0);
      ASSERT_LT(t->context_end, static_cast<int64_t>(t->prompt.size()));
      EXPECT_LE(static_cast<int>(t->prompt.size()), budget);
      const std::vector<TokenId> ctx_ids(t->prompt.begin(), t->prompt.begin() + t->context_end);
      const std::vector<TokenId> q_ids(t->prompt.begin() + t->context_end, t->prompt.end());
      const std::string ctx = decode(*t_.tok, ctx_ids);
      const std::string q = decode(*t_.tok, q_ids);
      const std::string open = "<|im_end|>\n<|im_start|>assistant\n";
      ASSERT_GE(ctx.size(), open.size());
      EXPECT_EQ(ctx.substr(ctx.size() - open.size()), open);
      EXPECT_EQ(q.rfind(std::string(eval::kAcknowledgement) + "<|im_end|>\n<|im_start|>user\n", 0),
                0u)
          << q.substr(0, 120);
      EXPECT_EQ(count(ctx, "<|im_start|>user"), 1u);
      EXPECT_EQ(count(q, "<|im_start|>assistant"), 1u);
      for (const std::string& e : t->expected) EXPECT_NE(ctx.find(e), std::string::npos) << e;
      const bool many = task != eval::RulerTask::kCwe && task != eval::RulerTask::kFwe;
      ASSERT_EQ(t->more.size(), many ? static_cast<size_t>(k - 1) : 0u);
      if (k == 1 && many) {
        EXPECT_EQ(static_cast<int>(t->prompt.size()), budget);
      }
      std::vector<std::string> queries = {t->query};
      for (const auto& f : t->more) {
        EXPECT_LE(t->context_end + static_cast<int64_t>(f.tokens.size()), budget);
        EXPECT_EQ(decode(*t_.tok, f.tokens).rfind(eval::kAcknowledgement, 0), 0u);
        EXPECT_EQ(f.expected.size(), t->expected.size());
        EXPECT_EQ(f.depths.size(), f.expected.size());
        for (const std::string& e : f.expected) {
          EXPECT_NE(ctx.find(e), std::string::npos) << e;
          EXPECT_EQ(std::find(t->expected.begin(), t->expected.end(), e), t->expected.end()) << e;
        }
        EXPECT_NE(decode(*t_.tok, f.tokens).find(f.query), std::string::npos) << f.query;
        queries.push_back(f.query);
      }
      std::sort(queries.begin(), queries.end());
      EXPECT_EQ(std::unique(queries.begin(), queries.end()), queries.end())
          << "a repeated question";
    }
  }
  // Several questions need the after setting.
  eval::QuestionShape bad;
  bad.questions = 2;
  auto b = eval::RulerBuilder::create(*t_.tok, &*t_.chat, hay_, bad);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("--question after"), std::string::npos);
}

// Without a chat template the two settings give the same tokens: only the compaction point
// moves, to the end of the context, before the question.
TEST_F(RulerGen, PlainTextAfterSettingMovesOnlyTheCompactionPoint) {
  eval::QuestionShape after;
  after.setting = eval::QuestionSetting::kAfter;
  auto before_b = eval::RulerBuilder::create(*t_.tok, nullptr, hay_);
  auto after_b = eval::RulerBuilder::create(*t_.tok, nullptr, hay_, after);
  ASSERT_TRUE(before_b.ok() && after_b.ok());
  for (eval::RulerTask task : eval::all_ruler_tasks()) {
    auto x = before_b->build(task, 1024, 3);
    auto y = after_b->build(task, 1024, 3);
    ASSERT_TRUE(x.ok() && y.ok()) << eval::ruler_task_name(task);
    EXPECT_EQ(x->prompt, y->prompt) << eval::ruler_task_name(task);
    EXPECT_EQ(x->context_end, static_cast<int64_t>(x->prompt.size()));
    ASSERT_LT(y->context_end, static_cast<int64_t>(y->prompt.size()));
    const std::string q =
        decode(*t_.tok, std::vector<TokenId>(y->prompt.begin() + y->context_end, y->prompt.end()));
    EXPECT_EQ(q.rfind("\n", 0), 0u) << eval::ruler_task_name(task) << ": " << q.substr(0, 60);
  }
}

}  // namespace
}  // namespace d2o
