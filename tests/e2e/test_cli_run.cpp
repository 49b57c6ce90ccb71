// `d2o run` and `d2o perplexity` as a user drives them: a real generation, and clear errors for
// bad input (never a crash).
#include <gtest/gtest.h>

#include "common/random_model.h"
#include "common/test_util.h"
#include "gguf/gguf_writer.h"

namespace d2o {
namespace {

using test::run_d2o;

using test::has;

TEST(CliRun, GeneratesAndReportsSpeedAndMemory) {
  D2O_REQUIRE_MODEL(model);
  auto r = run_d2o("run -m " + model + " -p 'The capital of France is' -n 8 -t 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "The capital of France is")) << r.output;
  EXPECT_TRUE(has(r.output, "Paris")) << r.output;
  EXPECT_TRUE(has(r.output, "tok/s")) << r.output;
  EXPECT_TRUE(has(r.output, "peak RSS")) << r.output;
  EXPECT_TRUE(has(r.output, "weights")) << r.output;
}

// The KV report compares a quantized cache with a full cache of its own storage type and with a
// full F16 cache, each labelled: h2o:budget=4 over 11 tokens (8 prompt tokens, 3 of the 4
// generated fed back) keeps 4 of 11 slots per layer, and q4_0 rows are 18 / 64 of F16's.
TEST(CliRun, KvReportSharesOfSameTypeAndF16) {
  D2O_REQUIRE_MODEL(model);
  auto r = run_d2o("run -m " + model +
                   " --prompt-tokens 1,2,3,4,5,6,7,8 -n 4 -t 1 --kv h2o:budget=4 --kv-type q4_0 "
                   "--kv-report");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "= 36.4% of a full q4_0 cache")) << r.output;  // 4 / 11
  EXPECT_TRUE(has(r.output, ", 10.2% of a full F16 cache")) << r.output;   // 4 / 11 x 18 / 64
  EXPECT_TRUE(has(r.output, "KV bytes allocated")) << r.output;
}

// prefill=bounded on the real model, its prompt in passes of 64: the budget comes from the
// whole prompt and the report says how it was set, what was chosen, every byte held and the
// hot cache's peak, which stays far below the whole prompt's (300 tokens x 30 layers x 3 KV heads
// x 2 x 64 x 2 bytes = 6.6 MiB of rows alone with prefill=exact).
TEST(CliRun, BoundedPrefillReportsItsBudgetBytesAndPeak) {
  D2O_REQUIRE_MODEL(model);
  std::string ids;
  for (int i = 0; i < 300; ++i) ids += (i ? "," : "") + std::to_string(100 + (i * 37) % 900);
  const std::string base = "run -m " + model + " --prompt-tokens " + ids + " -n 4 -t 2 --chunk 64";
  auto r = run_d2o(base + " --kv d2o:ratio=0.2,prefill=bounded --kv-report");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "budget: ratio=0.2 of the prompt's 300 tokens (prefill=bounded"))
      << r.output;
  EXPECT_TRUE(has(r.output, "chosen: 60.0 slots per KV head on average")) << r.output;
  EXPECT_TRUE(has(r.output, "bytes held in memory: hot key and value rows")) << r.output;
  EXPECT_TRUE(has(r.output, "KV policy state")) << r.output;
  EXPECT_TRUE(has(r.output, "peak: ")) << r.output;
  auto e = run_d2o(base + " --kv d2o:ratio=0.2 --kv-report");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_TRUE(has(e.output, "(prefill=exact: the whole prompt held")) << e.output;
  // --kv-mem-per-seq: the report says where the budget came from.
  auto m = run_d2o(base + " --kv h2o --kv-mem-per-seq 1M --kv-report");
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_TRUE(has(m.output, "budget: budget=")) << m.output;
  EXPECT_TRUE(has(m.output, "from --kv-mem-per-seq 1M in f16: ")) << m.output;
}

// prompt_ranking=reconstruction on the real model: the prompt fed again after itself before its
// compaction, its time reported; the cache kept at the ratio.
TEST(CliRun, ReconstructionRanksThePromptAndReportsItsTime) {
  D2O_REQUIRE_MODEL(model);
  std::string ids;
  for (int i = 0; i < 300; ++i) ids += (i ? "," : "") + std::to_string(100 + (i * 37) % 900);
  auto r = run_d2o("run -m " + model + " --prompt-tokens " + ids +
                   " -n 4 -t 2 --chunk 0 --kv d2o:ratio=0.2,prompt_ranking=reconstruction "
                   "--kv-report --timings");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "prompt_ranking=reconstruction")) << r.output;
  EXPECT_TRUE(has(r.output, "of which the prompt's reconstruction")) << r.output;
  EXPECT_TRUE(has(r.output, "300 rows")) << r.output;  // the whole prompt fed again
}

// The generated text: what comes before the statistics block.
std::string text_of(const std::string& out) { return out.substr(0, out.find("\n[kv ")); }

TEST(CliRun, SameSeedSameText) {
  D2O_REQUIRE_MODEL(model);
  const std::string cmd = "run -m " + model + " -p 'Once upon a time' -n 24 --temp 0.9 --seed 7 -t 2";
  auto a = run_d2o(cmd), b = run_d2o(cmd);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(text_of(a.output), text_of(b.output));
  auto c = run_d2o("run -m " + model + " -p 'Once upon a time' -n 24 --temp 0.9 --seed 8 -t 2");
  EXPECT_NE(text_of(a.output), text_of(c.output));
}

TEST(CliRun, BadInputGivesClearErrors) {
  D2O_REQUIRE_MODEL(model);
  struct Case {
    std::string args, needle;
    int code;
  };
  const std::vector<Case> cases = {
      {"-p hi -n 0", "-n must be at least 1", 1},
      {"-p hi --no-such-flag", "no-such-flag", 2},
      {"-p \"$(printf 'word %.0s' $(seq 1 300))\" -c 64", "more than the context", 1},
      {"-p hi --temp -1", "temperature", 1},
      {"-p hi --kv nonsense", "unknown KV policy", 1},
      {"-p hi --kv d2o:prefill=maybe", "one of exact, bounded", 1},
      {"-p hi --kv h2o:budget=64,prefill=bounded", "prefill= applies with ratio=", 1},
      {"-p hi --kv d2o:prefill=bounded --kv-mem-per-seq 4M", "leave out its prefill=", 1},
      {"-p hi --kv d2o --kv-mem-per-seq 1K", "holds no slot", 1},
      {"-p hi --kv d2o --kv-mem-per-seq lots", "not a byte size", 1},
      {"-p hi --kv-type q9", "kv-type", 1},
      {"-p hi --prompt-tokens 5,49152", "out of range", 1},
      {"--prompt-tokens ' 5'", "' 5' is not a token id", 1},
      {"--prompt-tokens +5", "'+5' is not a token id", 1},
      {"--prompt-tokens 1,2,", "empty token id at character 5", 1},
      {"--prompt-tokens 1,,2", "empty token id at character 3", 1},
      {"", "no prompt", 1},
  };
  for (const Case& c : cases) {
    auto r = run_d2o("run -m " + model + " " + c.args + " -t 2");
    EXPECT_EQ(r.exit_code, c.code) << c.args << "\n" << r.output;
    EXPECT_TRUE(has(r.output, c.needle)) << c.args << "\n" << r.output;
    EXPECT_FALSE(has(r.output, "internal invariant")) << r.output;
  }
}

TEST(CliRun, UnsupportedArchitectureAndMissingFiles) {
  auto cfg = test::random_llama_mha_config();
  GgufWriter w = test::make_random_model(cfg);
  w.add_string("general.architecture", "gpt2");  // a second value for the key: rejected as malformed
  const std::string dup = ::d2o::test::scratch_path("dup_arch.gguf");
  ASSERT_TRUE(w.write(dup).ok());
  auto r = run_d2o("run -m " + dup + " -p hi -n 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "duplicate metadata key")) << r.output;

  cfg.arch = "gpt2";
  const std::string gpt2 = ::d2o::test::scratch_path("gpt2_arch.gguf");
  ASSERT_TRUE(test::make_random_model(cfg).write(gpt2).ok());
  r = run_d2o("run -m " + gpt2 + " -p hi -n 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "architecture 'gpt2' is not supported")) << r.output;

  r = run_d2o("run -m /nonexistent.gguf -p hi -n 1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.output, "cannot open")) << r.output;
  r = run_d2o("perplexity -m /nonexistent.gguf -f /nonexistent.txt");
  EXPECT_EQ(r.exit_code, 1);
}

TEST(CliPerplexity, TextShorterThanTheContextIsAnError) {
  D2O_REQUIRE_MODEL(model);
  const std::string path = ::d2o::test::scratch_path("short.txt");
  std::FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("Only a few words here.", f);
  std::fclose(f);
  auto r = run_d2o("perplexity -m " + model + " -f " + path + " -c 128");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "fewer than one context")) << r.output;
}

}  // namespace
}  // namespace d2o
