// `d2o bench` as a user drives it. The llama-bench-style pp/tg figures: clear errors for bad lists
// and tests that do not fit, a small real run with JSON. `d2o bench throughput`: clear errors for
// bad arguments, a small real run with JSON output, and a policy whose requests exceed the KV cap
// refused while another completes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/test_util.h"

namespace d2o {
namespace {

using test::run_d2o;

using test::has;

TEST(CliBenchPpTg, BadListsAndTestsThatDoNotFit) {
  struct Case {
    std::string args, needle;
    int code;
  };
  // Rejected before the model is loaded (-m points nowhere on purpose).
  const std::vector<Case> cases = {
      {"-d 0,x", "-d: 'x' is not a non-negative integer", 1},
      {"-p 8-4", "-p: '8-4' is a range whose end is below its start", 1},
      {"-n ''", "-n: empty list", 1},
      {"-p 0 -n 0", "no tests to run", 1},
      {"-r 0", "repetitions must be at least 1", 1},
      {"-c 4096 -d 4096 -p 0 -n 128", "tg128 @ d4096 needs 4224 tokens of context", 1},
      {"--kv nonsense", "unknown KV policy", 1},
      {"--kv-type q4", "expected f32, f16, q8_0 or q4_0", 1},
      {"--no-such-flag", "no-such-flag", 2},
  };
  for (const Case& c : cases) {
    auto r = run_d2o("bench -m /nonexistent.gguf " + c.args);
    EXPECT_EQ(r.exit_code, c.code) << c.args << "\n" << r.output;
    EXPECT_TRUE(has(r.output, c.needle)) << c.args << "\n" << r.output;
    EXPECT_FALSE(has(r.output, "internal invariant")) << r.output;
  }
}

TEST(CliBenchPpTg, SmallRunAtADepthPerPolicyWritesJson) {
  D2O_REQUIRE_MODEL(model);
  const std::string text = ::d2o::test::scratch_path("bench_pptg.txt");
  {
    std::FILE* f = std::fopen(text.c_str(), "w");
    ASSERT_NE(f, nullptr);
    for (int i = 0; i < 200; ++i)
      std::fprintf(f, "Line %d of a plain text that the benchmark reads for its depth.\n", i);
    std::fclose(f);
  }
  // A text that is too short for the depth is a clear error naming the file.
  auto r = run_d2o("bench -m " + model + " -f " + text + " -p 0 -n 4 -d 100000 -r 1 -t 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "give a longer file with -f")) << r.output;

  const std::string json = ::d2o::test::scratch_path("bench_pptg.json");
  r = run_d2o("bench -m " + model + " -f " + text +
              " -p 32 -n 4 -d 0,200 -r 2 -t 1 --kv full --kv d2o:ratio=0.2 --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "tg4 @ d200")) << r.output;
  EXPECT_TRUE(has(r.output, "d2o:ratio=0.2")) << r.output;
  const auto j = nlohmann::json::parse(test::read_file(json), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << test::read_file(json);
  // SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K + V) x 2 bytes (F16).
  EXPECT_EQ(j["kv_bytes_per_token"], 30 * 3 * 64 * 2 * 2);
  ASSERT_EQ(j["results"].size(), 8u);  // 2 policies x 2 depths x (pp, tg)
  for (const auto& x : j["results"]) {
    SCOPED_TRACE(x.dump());
    EXPECT_EQ(x["samples_s"].size(), 2u);
    EXPECT_GT(x["avg_ts"].get<double>(), 0.0);
    const int64_t depth = x["depth"], n = x["n"];
    EXPECT_EQ(x["kv_bytes_full"], 30 * 3 * (depth + n) * 64 * 2 * 2);
    if (x["kv"] == "full") {
      EXPECT_EQ(x["slots"], 30 * (depth + n));  // per KV head, summed over layers
    } else if (depth == 200) {
      // 20% of the depth's slots are kept (D2O varies the budget per layer; the total is fixed
      // within rounding), and decoding holds that budget.
      EXPECT_LT(x["slots_after_depth"].get<int64_t>(), 30 * 200 / 4);
      EXPECT_LT(x["slots"].get<int64_t>(), 30 * 200 / 4 + 30 * n);
    }
  }
  // Sequential runs: the ratio of mean rates, unpaired.
  ASSERT_EQ(j["ratios"].size(), 8u);
  EXPECT_FALSE(j["interleaved"].get<bool>());
  EXPECT_FALSE(j["ratios"][0]["paired"].get<bool>());

  // Interleaved: the same results per policy and test, ratios paired by round.
  const std::string json2 = ::d2o::test::scratch_path("bench_pptg_interleaved.json");
  r = run_d2o("bench -m " + model + " -f " + text +
              " -p 0 -n 4 -d 200 -r 3 -t 1 --kv full --kv h2o:ratio=0.2 --interleave --json " +
              json2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "t/s over full")) << r.output;
  EXPECT_TRUE(has(r.output, "per-round ratios")) << r.output;
  const auto k = nlohmann::json::parse(test::read_file(json2), nullptr, false);
  ASSERT_FALSE(k.is_discarded()) << test::read_file(json2);
  EXPECT_TRUE(k["interleaved"].get<bool>());
  ASSERT_EQ(k["results"].size(), 2u);
  EXPECT_EQ(k["results"][0]["kv"], "full");
  EXPECT_EQ(k["results"][1]["kv"], "h2o:ratio=0.2");
  EXPECT_EQ(k["results"][0]["slots"], 30 * 204);
  EXPECT_EQ(k["results"][1]["slots_after_depth"], 30 * 40);  // H2O keeps 20% of every layer
  ASSERT_EQ(k["ratios"].size(), 2u);
  for (const auto& x : k["ratios"]) {
    SCOPED_TRACE(x.dump());
    EXPECT_TRUE(x["paired"].get<bool>());
    ASSERT_EQ(x["ratio_samples"].size(), 3u);
    EXPECT_GT(x["ratio"].get<double>(), 0.0);
  }
  EXPECT_DOUBLE_EQ(k["ratios"][0]["ratio"].get<double>(), 1.0);
}

// --kv-mem-per-seq on the pp / tg rows: each policy at the budget that fits, the depth prefilled
// in passes; a spec that sets its own budget, or a memory too small for a slot, is refused.
TEST(CliBenchPpTg, KvMemoryPerSequenceSetsEveryBudget) {
  D2O_REQUIRE_MODEL(model);
  const std::string text = ::d2o::test::scratch_path("bench_mem.txt");
  {
    std::FILE* f = std::fopen(text.c_str(), "w");
    ASSERT_NE(f, nullptr);
    for (int i = 0; i < 200; ++i)
      std::fprintf(f, "Line %d of a plain text that the benchmark reads for its depth.\n", i);
    std::fclose(f);
  }
  const std::string json = ::d2o::test::scratch_path("bench_mem.json");
  auto r = run_d2o("bench -m " + model + " -f " + text +
                   " -p 16 -n 2 -d 300 -r 1 -t 1 --kv full --kv h2o --kv-mem-per-seq 1M --chunk "
                   "64 --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "--kv-mem-per-seq 1M: full runs whole")) << r.output;
  EXPECT_TRUE(has(r.output, "--kv-mem-per-seq 1M: h2o at budget=")) << r.output;
  EXPECT_TRUE(has(test::read_file(json), "h2o:budget=")) << r.output;
  r = run_d2o("bench -m " + model + " -f " + text + " -p 16 -n 2 -r 1 --kv h2o:budget=8 " +
              "--kv-mem-per-seq 1M");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "leave out its ratio= / budget=")) << r.output;
  r = run_d2o("bench -m " + model + " -f " + text + " -p 16 -n 2 -r 1 --kv h2o --kv-mem-per-seq 1K");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "holds no slot")) << r.output;
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
      {"--rounds 0", "--rounds must be in [1, 1000]", 1},
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
  auto r = run_d2o("bench throughput --no-such-flag");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string text = ::d2o::test::scratch_path("bench_text.txt");
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
  const std::string json = ::d2o::test::scratch_path("bench.json");
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
  // The full cache of 48 + 6 tokens: 30 layers x 3 KV heads x 54 slots x (256 + 20) bytes.
  EXPECT_EQ(j["runs"][0]["kv_bytes_per_request"], 30 * 3 * 54 * 276);
}

TEST(CliBench, MemoryPerSequenceCountsTheKeysValuesMetadataAndThePolicysOwnLists) {
  D2O_REQUIRE_MODEL(model);
  const std::string json = ::d2o::test::scratch_path("bench_mem.json");
  auto r = run_d2o("bench throughput -m " + model +
                   " --prompt 200 --gen 2 --requests 1 --kv-mem-per-seq 4M -t 1 --kv h2o --kv d2o:cold=none "
                   "--kv d2o "
                   "--json " +
                   json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(test::read_file(json), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << test::read_file(json);
  ASSERT_EQ(j["runs"].size(), 3u);
  // 4 MiB = 4,194,304 bytes; SmolLM2 has 30 layers x 3 KV heads, a slot 256 bytes of F16 key and
  // value rows and 20 of metadata, and each layer's plan lists a head's kept slots (4 bytes a
  // slot). H2O: 166 slots (90 x 166 x 280 = 4,183,200; 167 would not fit). D2O also keeps a key
  // norm per slot of every layer and head (90 x (B + 1) x 4 bytes), the probe's dots and keys of
  // one layer (3 x (B + 1 + 64) x 4), a decode step's merge terms (90 x 2 x 16), its armed slots
  // and thresholds (90 x 9): 163 slots (4,048,920 + 58,680 + 65,466 = 4,173,066; 164 would take
  // 4,198,638). With its cold tier on disk (d2o's default), the tier's staging tails and extent
  // lists (90 heads x (64 records of q8_0 rows and metadata, 148 bytes each, and 129 extents of
  // 16 bytes) = 1,038,240 bytes) and one layer's recall, lowered to the budget, count first:
  // 116 slots, recalling at most 116.
  EXPECT_EQ(j["runs"][0]["kv"], "h2o:budget=166");
  EXPECT_EQ(j["runs"][1]["kv"], "d2o:cold=none,budget=163");
  EXPECT_EQ(j["runs"][2]["kv"], "d2o:recall=116,recall_all_up_to=116,budget=116");
}

TEST(CliBench, RoundsAlternateTheOrderAndPairTheRatiosByRound) {
  D2O_REQUIRE_MODEL(model);
  const std::string json = ::d2o::test::scratch_path("bench_rounds.json");
  auto r = run_d2o("bench throughput -m " + model +
                   " --prompt 40 --gen 4 --requests 2 --kv-mem 64M --chunk 32 -t 1 --rounds 3 "
                   "--kv h2o:ratio=0.5 --kv d2o:ratio=0.5 --json " +
                   json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "gen tok/s over 1st")) << r.output;
  EXPECT_TRUE(has(r.output, "d2o:ratio=0.5 #3")) << r.output;
  // The run order on stderr: h2o d2o, then d2o h2o, then h2o d2o.
  const size_t a1 = r.output.find("h2o:ratio=0.5 (round 1)"),
               b1 = r.output.find("d2o:ratio=0.5 (round 1)"),
               a2 = r.output.find("h2o:ratio=0.5 (round 2)"),
               b2 = r.output.find("d2o:ratio=0.5 (round 2)");
  ASSERT_NE(a2, std::string::npos) << r.output;
  ASSERT_NE(b2, std::string::npos) << r.output;
  EXPECT_LT(a1, b1) << r.output;
  EXPECT_LT(b2, a2) << r.output;
  const auto j = nlohmann::json::parse(test::read_file(json), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << test::read_file(json);
  EXPECT_EQ(j["config"]["rounds"], 3);
  ASSERT_EQ(j["runs"].size(), 6u);
  // Runs in policy order, round by round; the ratios are the per-round quotients of the runs.
  ASSERT_EQ(j["ratios"].size(), 2u);
  for (int k = 0; k < 3; ++k) {
    const auto& base = j["runs"][k];
    const auto& run = j["runs"][3 + k];
    EXPECT_EQ(base["kv"], "h2o:ratio=0.5");
    EXPECT_EQ(run["kv"], "d2o:ratio=0.5");
    EXPECT_EQ(base["round"], k);
    EXPECT_EQ(run["round"], k);
    EXPECT_EQ(run["generated_tokens"], 8);
    const double want = run["tokens_per_s"].get<double>() / base["tokens_per_s"].get<double>();
    EXPECT_NEAR(j["ratios"][1]["tokens_per_s_ratio"]["samples"][k].get<double>(), want,
                1e-9 * want);
    EXPECT_EQ(j["ratios"][0]["tokens_per_s_ratio"]["samples"][k].get<double>(), 1.0);
  }
  EXPECT_EQ(j["ratios"][0]["tokens_per_s_ratio"]["se"].get<double>(), 0.0);
  EXPECT_EQ(j["ratios"][1]["policy_s_ratio"]["samples"].size(), 3u);
  EXPECT_GT(j["ratios"][1]["policy_s_ratio"]["mean"].get<double>(), 0.0);
}

TEST(CliBench, RequestsAboveTheCapAreRefusedWhileAnotherPolicyCompletes) {
  D2O_REQUIRE_MODEL(model);
  // A full-cache request of 200 + 40 tokens needs 30 x 3 x 240 x 276 bytes = 5.69 MiB; D2O at 10%
  // holds the 200-token prompt once (201 slots, 4.76 MiB, with 0.15 MiB reserved for its own
  // lists and plans: 4.91 MiB) -- so a 5.3M cap fits D2O only (without its cold tier, whose
  // recall and metadata take more).
  const std::string json = ::d2o::test::scratch_path("bench_refused.json");
  auto r = run_d2o("bench throughput -m " + model +
                   " --prompt 200 --gen 40 --requests 2 --kv-mem 5.3M --chunk 64 -t 1 --kv full "
                   "--kv d2o:ratio=0.1,cold=none "
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
  EXPECT_EQ(j["runs"][1]["generated_tokens"], 80);
}

}  // namespace
}  // namespace d2o
