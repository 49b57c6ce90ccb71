// `d2o chat` driven through stdin as a user would type: two turns, the /kv report, /reset, /quit.
#include <gtest/gtest.h>

#include "common/test_util.h"

namespace d2o {
namespace {

using test::has;

int count(const std::string& s, const std::string& needle) {
  int n = 0;
  for (size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) ++n;
  return n;
}

TEST(CliChat, TwoTurnsWithACompressedCache) {
  D2O_REQUIRE_MODEL(model);
  const std::string q = "What is the capital of France?";
  auto r = test::run_command("printf '" + q + "\\nAnd of Italy?\\n/kv\\n/reset\\n/quit\\n' | " +
                             std::string(D2O_CLI_PATH) + " chat -m " + model + " -n 24 -t 2 --kv d2o:budget=64");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "chatml")) << r.output;
  EXPECT_EQ(count(r.output, "[24 tokens"), 2) << r.output;  // two replies of the requested length
  EXPECT_TRUE(has(r.output, "KV report")) << r.output;
  EXPECT_TRUE(has(r.output, "conversation reset")) << r.output;
  EXPECT_TRUE(has(r.output, "peak RSS")) << r.output;
  // The first reply is what `run --chat` generates for the same question (greedy; the 64-slot
  // budget is not reached before the reply ends).
  auto one = test::run_d2o("run --chat -m " + model + " -p '" + q + "' -n 24 -t 2 --kv d2o:budget=64");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string reply = one.output.substr(0, one.output.find("\n"));
  ASSERT_FALSE(reply.empty());
  EXPECT_TRUE(has(r.output, "> " + reply)) << "chat:\n" << r.output << "\nrun:\n" << one.output;
}

TEST(CliChat, EndOfInputEndsTheSessionCleanly) {
  D2O_REQUIRE_MODEL(model);
  auto r = test::run_command("printf 'Hi\\n' | " + std::string(D2O_CLI_PATH) + " chat -m " + model + " -n 8 -t 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto bad = test::run_command("printf 'Hi\\n' | " + std::string(D2O_CLI_PATH) + " chat -m " + model +
                               " --template klingon");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_TRUE(has(bad.output, "chatml")) << bad.output;  // the error lists the supported formats
}

}  // namespace
}  // namespace d2o
