// `d2o bench throughput` as a user drives it: clear errors for bad arguments, a small real run
// with JSON output, and a policy whose requests exceed the KV cap refused while another completes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/test_util.h"

namespace d2o {
namespace {

using test::run_d2o;

bool has(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

TEST(CliBench, BadArgumentsGiveClearErrors) {
  struct Case {
    std::string args, needle;
    int code;
  };
  // These are rejected before the model is loaded (-m points nowhere on purpose).
  const std::vector<Case> cases = {
      {"--kv-mem 12Q", "not a byte size", 1},
      {"--kv-mem 0", "at least 1 byte", 1},
      {"--kv-mem -5M", "not a byte size", 1},
      {"--prompt 0", "--prompt must be at least 1", 1},
      {"--gen 0", "--gen must be at least 1", 1},
      {"--requests 0", "--requests must be at least 1", 1},
      {"--chunk 0", "--chunk must be at least 1", 1},
      {"--max-batch 0", "--max-batch must be at least 1", 1},
      {"--kv nonsense", "unknown KV policy", 1},
      {"--kv full --kv h2o:ratio=2", "ratio must be in (0, 1]", 1},
      {"--attn-split sideways", "--attn-split must be auto, within or across", 1},
      {"--temp -1", "temperature", 1},
      {"--text /nonexistent/text.txt", "cannot read the prompt text", 1},
      {"--no-such-flag", "no-such-flag", 2},
  };
  for (const Case& c : cases) {
    auto r = run_d2o("bench throughput -m /nonexistent.gguf " + c.args);
    EXPECT_EQ(r.exit_code, c.code) << c.args << "\n" << r.output;
    EXPECT_TRUE(has(r.output, c.needle)) << c.args << "\n" << r.output;
    EXPECT_FALSE(has(r.output, "internal invariant")) << r.output;
  }
  auto r = run_d2o("bench");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "subcommand is required")) << r.output;
  const std::string text = ::testing::TempDir() + "/bench_text.txt";
  std::FILE* f = std::fopen(text.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("In the beginning was a short text.\n", f);
  std::fclose(f);
  r = run_d2o("bench throughput -m /nonexistent.gguf --kv full --text " + text);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "cannot open")) << r.output;
}

TEST(CliBench, ContextTooSmallForPromptPlusGeneration) {
  D2O_REQUIRE_MODEL(model);
  auto r = run_d2o("bench throughput -m " + model + " --prompt 100 --gen 40 -c 128 --kv full -t 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "exceed the context of 128")) << r.output;
}

TEST(CliBench, SmallRunReportsEveryPolicyAndWritesJson) {
  D2O_REQUIRE_MODEL(model);
  const std::string json = ::testing::TempDir() + "/bench.json";
  auto r = run_d2o(
      "bench throughput -m " + model +
      " --prompt 48 --gen 6 --requests 3 --kv-mem 64M --chunk 32 --max-batch 4 -t 1 --kv full "
      "--kv d2o:ratio=0.5 --json " +
      json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "every request generates exactly --gen tokens")) << r.output;
  EXPECT_TRUE(has(r.output, "gen tok/s")) << r.output;
  EXPECT_TRUE(has(r.output, "d2o:ratio=0.5")) << r.output;
  const auto j = nlohmann::json::parse(test::read_file(json), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << test::read_file(json);
  EXPECT_EQ(j["config"]["prompt_tokens"], 48);
  ASSERT_EQ(j["runs"].size(), 2u);
  for (const auto& run : j["runs"]) {
    EXPECT_EQ(run["completed"], 3);
    EXPECT_EQ(run["refused"], 0);
    EXPECT_EQ(run["generated_tokens"], 18);
    EXPECT_GE(run["batch_max"].get<int>(), 1);
    EXPECT_LE(run["batch_max"].get<int>(), 3);
    EXPECT_LE(run["kv_peak_allocated"].get<double>(), run["kv_peak_reserved"].get<double>());
    EXPECT_LE(run["kv_peak_reserved"].get<double>(), 64.0 * 1024 * 1024);
    EXPECT_GT(run["rss_peak"].get<double>(), 0.0);
  }
  // The full cache of 48 + 6 tokens: 30 layers x 3 KV heads x 54 slots x (256 + 16) bytes.
  EXPECT_EQ(j["runs"][0]["kv_bytes_per_request"], 30 * 3 * 54 * 272);
}

TEST(CliBench, RequestsAboveTheCapAreRefusedWhileAnotherPolicyCompletes) {
  D2O_REQUIRE_MODEL(model);
  // A full-cache request of 200 + 8 tokens needs 30 x 3 x 208 x 272 bytes = 4.9 MiB; D2O at 10%
  // holds the 200-token prompt once (201 slots, 4.7 MiB) -- so a 4.8M cap fits D2O only.
  const std::string json = ::testing::TempDir() + "/bench_refused.json";
  auto r = run_d2o("bench throughput -m " + model +
                   " --prompt 200 --gen 8 --requests 2 --kv-mem 4.8M --chunk 64 -t 1 --kv full "
                   "--kv d2o:ratio=0.1 "
                   "--json " +
                   json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "refused")) << r.output;
  EXPECT_TRUE(has(r.output, "more than the whole cap")) << r.output;
  const auto j = nlohmann::json::parse(test::read_file(json), nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["runs"][0]["refused"], 2);
  EXPECT_EQ(j["runs"][0]["completed"], 0);
  EXPECT_EQ(j["runs"][1]["refused"], 0);
  EXPECT_EQ(j["runs"][1]["completed"], 2);
  EXPECT_EQ(j["runs"][1]["generated_tokens"], 16);
}

}  // namespace
}  // namespace d2o
