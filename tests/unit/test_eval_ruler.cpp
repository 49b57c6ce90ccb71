// RULER scoring (string_match_all) on hand-made answers, and the task names.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "eval/ruler.h"

namespace d2o::eval {
namespace {

TEST(EvalRuler, ScoreIsTheShareOfExpectedStringsFound) {
  const std::vector<std::string> one = {"4719283"};
  EXPECT_EQ(ruler_score(" 4719283.", one), 1.0);
  EXPECT_EQ(ruler_score("The number is 4719283, as stated", one), 1.0);
  EXPECT_EQ(ruler_score(" 471928.", one), 0.0);  // a prefix is not the value
  EXPECT_EQ(ruler_score("", one), 0.0);
  const std::vector<std::string> four = {"1111111", "2222222", "3333333", "4444444"};
  EXPECT_EQ(ruler_score("1111111, 2222222, 3333333 and 4444444", four), 1.0);
  EXPECT_EQ(ruler_score("4444444 and 2222222", four), 0.5);       // order does not matter
  EXPECT_EQ(ruler_score("3333333 3333333 3333333", four), 0.25);  // repeats count once
  // Case-insensitive, as RULER compares lowercased strings.
  const std::vector<std::string> vars = {"QWERT", "ASDFG", "ZXCVB"};
  EXPECT_NEAR(ruler_score(" qwert, Asdfg", vars), 2.0 / 3.0, 1e-12);
  const std::vector<std::string> words = {"garden", "river"};
  EXPECT_EQ(ruler_score("1. GARDEN 2. rivers", words), 1.0);  // substring match, as RULER's
  EXPECT_EQ(ruler_score("anything", std::vector<std::string>{}), 0.0);
}

TEST(EvalRuler, TaskNamesRoundTrip) {
  EXPECT_EQ(all_ruler_tasks().size(), 7u);
  for (RulerTask t : all_ruler_tasks()) {
    auto p = parse_ruler_task(ruler_task_name(t));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, t);
    EXPECT_GT(ruler_max_new(t), 0);
  }
  auto bad = parse_ruler_task("niah_double");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("niah_single"), std::string::npos);
  EXPECT_EQ(ruler_max_new(RulerTask::kVt), 30);    // RULER's tokens_to_generate
  EXPECT_EQ(ruler_max_new(RulerTask::kCwe), 120);  // idem
  EXPECT_EQ(ruler_max_new(RulerTask::kFwe), 50);   // idem
}

}  // namespace
}  // namespace d2o::eval
