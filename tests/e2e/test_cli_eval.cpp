// `d2o eval ppl|fidelity|niah|ruler|ablate --quick` as a user (or CI) runs them: each subcommand
// runs end to end on the real model, writes JSON, Markdown and SVG files that parse, and the
// harness's invariants hold (the full cache has KL 0 against itself; a budget at least the
// context reproduces the full cache exactly; nothing differs before a capacity is reached).
// It does not check which policy wins. Bad paths, texts shorter than asked and grids larger than
// the model's context give clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/test_util.h"
#include "common/xml_check.h"

namespace d2o {
namespace {

using test::run_d2o;

using test::has;

// The default text of ppl / fidelity / ablate (fetched by scripts/setup.sh).
#define REQUIRE_DEFAULT_TEXT()                                                    \
  if (!test::file_exists(std::string(D2O_SOURCE_DIR) + "/cache/texts/kjv.txt")) { \
    GTEST_SKIP() << "cache/texts/kjv.txt not found: run scripts/setup.sh";        \
  }

std::string out_dir(const std::string& name) {
  const std::string d = ::d2o::test::scratch_path("d2o_eval_" + name);
  std::filesystem::remove_all(d);
  return d;
}

// Parses <dir>/<name>.json, checks the Markdown exists and every SVG in the directory is
// well-formed XML and referenced from the Markdown.
nlohmann::json check_outputs(const std::string& dir, const std::string& name, int min_svgs) {
  const std::string json_text = test::read_file(dir + "/" + name + ".json");
  EXPECT_FALSE(json_text.empty()) << dir;
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "invalid JSON in " << dir << "/" << name << ".json";
  const std::string md = test::read_file(dir + "/" + name + ".md");
  EXPECT_TRUE(has(md, "# ")) << md;
  int n_svg = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".svg") continue;
    ++n_svg;
    EXPECT_EQ(test::xml_problem(test::read_file(e.path().string())), "") << e.path();
    EXPECT_TRUE(has(md, e.path().filename().string()))
        << e.path() << " is not shown in the Markdown";
  }
  EXPECT_GE(n_svg, min_svgs) << dir;
  if (j.is_discarded()) return nlohmann::json::object();
  // Every report records what it ran on.
  EXPECT_TRUE(j.contains("meta"));
  EXPECT_FALSE(j["meta"]["model"]["path"].get<std::string>().empty());
  EXPECT_GT(j["meta"]["wall_seconds"].get<double>(), 0.0);
  EXPECT_TRUE(j["meta"].contains("seed"));
  return j;
}

TEST(CliEval, PplQuickRunsAndKeepsItsInvariants) {
  D2O_REQUIRE_MODEL(model);
  REQUIRE_DEFAULT_TEXT();
  const std::string dir = out_dir("ppl");
  auto r = run_d2o("eval ppl --quick -m " + model + " -t 1 -o " + dir +
                   " --policies 'full;streaming;h2o;d2o' " + "--capacities 96,100000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "eval ppl [")) << "no progress bar: " << r.output;
  EXPECT_TRUE(has(r.output, "nothing is evicted")) << r.output;  // the 100000 capacity
  const nlohmann::json j = check_outputs(dir, "ppl", 4);
  ASSERT_TRUE(j.contains("runs"));
  EXPECT_EQ(j["params"]["chunk"], 1);
  EXPECT_EQ(j["params"]["n_tokens"], 600);
  int n_full = 0;
  for (const auto& run : j["runs"]) {
    const int cap = run["capacity"];
    if (cap == 0) ++n_full;
    if (cap == 0 || cap == 100000) {
      EXPECT_TRUE(run["identical_to_full"].get<bool>()) << run["spec"];
      EXPECT_EQ(run["delta_nll"].get<double>(), 0.0) << run["spec"];
    } else {
      // Until the capacity is reached the policy has evicted nothing: the same numbers.
      EXPECT_EQ(run["max_abs_diff_before_capacity"].get<double>(), 0.0) << run["spec"];
      EXPECT_FALSE(run["identical_to_full"].get<bool>()) << run["spec"];
      EXPECT_GT(run["evicted"].get<int64_t>(), 0) << run["spec"];
    }
    EXPECT_GT(run["ppl"].get<double>(), 1.0);
  }
  EXPECT_EQ(n_full, 1);
}

TEST(CliEval, PplWithoutTheFullCacheSaysItHasNoDifference) {
  D2O_REQUIRE_MODEL(model);
  REQUIRE_DEFAULT_TEXT();
  const std::string dir = out_dir("ppl_nofull");
  auto r = run_d2o("eval ppl --quick -m " + model + " -t 1 -o " + dir +
                   " --policies 'h2o;d2o' --capacities 96");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "tail Δ - (no full cache in --policies)")) << r.output;
  EXPECT_FALSE(has(r.output, "nan")) << r.output;
  const nlohmann::json j = check_outputs(dir, "ppl", 1);
  ASSERT_TRUE(j.contains("comparisons"));
  EXPECT_FALSE(j["comparisons"].empty());  // the policies are still compared with each other
}

TEST(CliEval, FidelityQuickFullCacheHasZeroKl) {
  D2O_REQUIRE_MODEL(model);
  REQUIRE_DEFAULT_TEXT();
  const std::string dir = out_dir("fidelity");
  auto r = run_d2o("eval fidelity --quick -m " + model + " -t 1 -o " + dir +
                   " --policies 'full;snapkv;d2o;d2o:budget=100000' --ratios 0.2,0.5 --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = check_outputs(dir, "fidelity", 2);
  ASSERT_TRUE(j.contains("cases"));
  EXPECT_EQ(j["cases"].size(), 6u);  // full, 2 x snapkv, 2 x d2o, d2o budget
  for (const auto& c : j["cases"]) {
    const std::string spec = c["spec"];
    if (spec == "full" || has(spec, "budget=100000")) {
      EXPECT_EQ(c["kl"].get<double>(), 0.0) << spec;
      EXPECT_EQ(c["top1"].get<double>(), 1.0) << spec;
      EXPECT_EQ(c["delta_nll"].get<double>(), 0.0) << spec;
    } else {
      EXPECT_GT(c["kl"].get<double>(), 0.0) << spec;
      EXPECT_GT(c["evicted"].get<int64_t>(), 0) << spec;
    }
    EXPECT_GE(c["kl_se"].get<double>(), 0.0);
  }
  const std::string md = test::read_file(dir + "/fidelity.md");
  EXPECT_TRUE(has(md, "ρ = 0.2")) << md;
  EXPECT_TRUE(has(md, " ± ")) << md;
}

// Equal KV bytes: each (policy, storage type) gets the budget its bytes allow, full caches hold
// what they hold, and every method runs on the same samples.
TEST(CliEval, FidelityQuickBytesSizesBudgetsByStorageType) {
  D2O_REQUIRE_MODEL(model);
  REQUIRE_DEFAULT_TEXT();
  const std::string dir = out_dir("fidelity_bytes");
  auto r = run_d2o("eval fidelity --quick -m " + model + " -t 1 -o " + dir +
                   " --policies 'full;h2o;streaming@q4_0' --kv-types f16,q4_0r --bytes 0.2,0.4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = check_outputs(dir, "fidelity_bytes", 3);  // 2 KL-per-step + bytes
  ASSERT_TRUE(j.contains("cases") && j.contains("bytes"));
  // full x 2 types, h2o x 2 types x 2 bytes, streaming in q4_0 x 2 bytes.
  ASSERT_EQ(j["cases"].size(), 8u);
  const double kv_per_token = j["meta"]["model"]["n_layer"].get<double>() *
                              j["meta"]["model"]["n_head_kv"].get<double>() *
                              j["meta"]["model"]["head_dim"].get<double>();  // elements
  const double f16_prompt = 256 * kv_per_token * 2 * 2;  // keys and values, 2 bytes each
  for (const auto& c : j["cases"]) {
    const std::string row = c["row"], type = c["kv_type"];
    const double bytes = c["kv_bytes_end"];
    if (row == "full [f16]") {
      EXPECT_EQ(c["kl"].get<double>(), 0.0);
    } else if (row == "full [q4_0r]") {
      // 18 bytes per 32 elements against 64: 28.125% of F16 for any context.
      EXPECT_DOUBLE_EQ(bytes / j["f16_full_bytes_end"].get<double>(), 18.0 / 64.0);
      EXPECT_GT(c["kl"].get<double>(), 0.0);
    } else {
      const double share = c["share"];
      ASSERT_GT(share, 0.0) << row;
      const double bytes_per_slot = kv_per_token * 2 * (type == "f16" ? 2.0 : 18.0 / 32.0);
      // The largest budget whose bytes fit the share of the F16 cache for the prompt.
      EXPECT_EQ(c["budget"].get<int64_t>(),
                static_cast<int64_t>(share * f16_prompt / bytes_per_slot + 1e-9))
          << row << " " << share;
      // Measured: the policy holds its budget in every layer (the whole context of 256 + 16
      // tokens when the budget is larger: q4_0 at 40% allows 364 slots), and one more slot would
      // not fit.
      const double budget = c["budget"].get<double>();
      const double held = std::min(budget, 272.0);
      EXPECT_DOUBLE_EQ(bytes, held * bytes_per_slot) << row;
      EXPECT_LE(bytes, share * f16_prompt) << row;
      EXPECT_GT((budget + 1) * bytes_per_slot, share * f16_prompt) << row;
      EXPECT_EQ(c["evicted"].get<int64_t>() > 0, budget < 272) << row;
    }
    EXPECT_EQ(c["per_sample"]["kl"].size(), 2u) << row;
  }
  const auto& values = j["bytes"]["values"];
  ASSERT_EQ(values.size(), 2u);
  // full q4_0r (28%) is compared at 40% only; h2o in both types and streaming in q4_0 at both.
  EXPECT_EQ(values[0]["methods"].size(), 3u);
  EXPECT_EQ(values[1]["methods"].size(), 4u);
  // A budget that evicts nothing is no combination: in q4_0 / q4_0r at 40% both policies keep
  // everything, so no combination runs there; at 20% one of the two q4 methods is the best.
  for (const auto& m : values[1]["methods"]) {
    if (m["row"] != "h2o [f16]") {
      EXPECT_EQ(m["kind"], "no eviction (quantization only)") << m["row"];
    }
  }
  EXPECT_EQ(values[1]["best_combination"], "");
  const std::string best = values[0]["best_combination"];
  EXPECT_TRUE(best == "h2o [q4_0r]" || best == "streaming [q4_0]") << best;
  const std::string md = test::read_file(dir + "/fidelity_bytes.md");
  EXPECT_TRUE(has(md, "At equal KV bytes")) << md;
  EXPECT_TRUE(has(md, "bytes = 0.2")) << md;
  EXPECT_TRUE(has(md, "fidelity_bytes_bytes.svg")) << md;
  // Bytes and ratios are two axes; one run takes one.
  auto both =
      run_d2o("eval fidelity --quick -m " + model + " -o " + dir + " --bytes 0.2 --ratios 0.2");
  EXPECT_NE(both.exit_code, 0);
  EXPECT_TRUE(has(both.output, "not both")) << both.output;
}

TEST(CliEval, NiahQuickRunsAndLargeBudgetMatchesFull) {
  D2O_REQUIRE_MODEL(model);
  const std::string dir = out_dir("niah");
  auto r = run_d2o("eval niah --quick -m " + model + " -t 1 -o " + dir +
                   " --policies 'full;d2o;h2o:budget=100000'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = check_outputs(dir, "niah", 6);  // 2 tasks x 3 policies
  ASSERT_TRUE(j.contains("trials"));
  EXPECT_EQ(j["trials"].size(), 2u * 2u * 3u);  // tasks x lengths x depths
  for (const auto& t : j["trials"]) {
    EXPECT_EQ(t["answers"][0], t["answers"][2])
        << "budget >= context must answer like the full cache";
    EXPECT_EQ(t["correct"][0], t["correct"][2]);
  }
  EXPECT_FALSE(j["haystack"]["needle_task"].get<std::string>().empty());
  EXPECT_EQ(j["params"]["compression"], "ratio=0.2");
  const std::string md = test::read_file(dir + "/niah.md");
  EXPECT_TRUE(has(md, "95%")) << md;
}

TEST(CliEval, NiahFallsBackToKjvAndSaysSo) {
  D2O_REQUIRE_MODEL(model);
  const std::string kjv = test::text_dir() + "/kjv.txt";
  if (!test::file_exists(kjv)) GTEST_SKIP() << "no KJV text";
  // A cache directory with the KJV text but no Paul Graham essays.
  const std::string cache = out_dir("fallback_cache");
  std::filesystem::create_directories(cache + "/texts");
  std::filesystem::copy_file(kjv, cache + "/texts/kjv.txt");
  const std::string dir = out_dir("niah_fallback");
  auto r = test::run_command("D2O_CACHE_DIR=" + cache + " " + D2O_CLI_PATH +
                             " eval niah --quick --tasks needle -m " + model + " -t 1 -o " + dir +
                             " --policies full --lengths 256 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "fallback")) << r.output;
  const nlohmann::json j = check_outputs(dir, "niah", 1);
  EXPECT_TRUE(has(j["haystack"]["needle_task"].get<std::string>(), "King James")) << j["haystack"];
  EXPECT_TRUE(has(j["haystack"]["note"].get<std::string>(), "fallback")) << j["haystack"];
}

// Ruler at equal KV bytes: each policy in each storage type keeps the share of the prompt its
// rows allow (q4_0r rows are 18 / 64 of F16's: 0.2 of the bytes is 0.711 of the slots).
TEST(CliEval, RulerQuickBytesKeepsWhatEachTypeAllows) {
  D2O_REQUIRE_MODEL(model);
  const std::string dir = out_dir("ruler_bytes");
  auto r = run_d2o("eval ruler --quick -m " + model + " -t 1 -o " + dir +
                   " --policies 'full;h2o' --bytes 0.2 --kv-types f16,q4_0r");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = check_outputs(dir, "ruler", 2);  // scores heatmap + bytes chart
  ASSERT_EQ(j["policies"].size(), 4u);  // full (F16 reference), full [q4_0r], h2o x 2 types
  ASSERT_TRUE(j.contains("bytes"));
  for (const auto& m : j["bytes"]["methods"]) {
    const std::string label = m["label"];
    const double kept = m["kept"], share = m["share"];
    if (label == "h2o [f16]") {
      EXPECT_NEAR(kept, 0.2, 1.0 / 480) << label;  // to the nearest slot of a 480-token prompt
      EXPECT_NEAR(share, 0.2, 1.0 / 480) << label;
    } else if (label == "h2o [q4_0r]") {
      EXPECT_NEAR(kept, 0.2 * 64 / 18, 1.0 / 480) << label;
      EXPECT_NEAR(share, 0.2, 1.0 / 480) << label;
      EXPECT_EQ(m["kind"], "eviction + quantization");
    } else if (label == "full [q4_0r]") {
      EXPECT_DOUBLE_EQ(share, 18.0 / 64.0);
    }
  }
  EXPECT_EQ(j["bytes"]["best_combination"], "h2o [q4_0r]");
  EXPECT_TRUE(has(test::read_file(dir + "/ruler.md"), "At equal KV bytes"));
}

// --kv-mem-per-seq and --chunk: every policy's budget is what fits the memory, contexts go in
// passes (512 unless --chunk says), and the report says so; prefill=exact in chunks answers as in
// one pass.
TEST(CliEval, RulerQuickAtAKvMemoryAndInChunks) {
  D2O_REQUIRE_MODEL(model);
  const std::string dir = out_dir("ruler_mem");
  auto r = run_d2o("eval ruler --quick -m " + model + " -t 1 -o " + dir +
                   " --policies 'full;h2o;d2o' --kv-mem-per-seq 2M --chunk 128");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = check_outputs(dir, "ruler", 1);
  EXPECT_EQ(j["params"]["compression"], "kv-mem-per-seq=2M");
  EXPECT_EQ(j["params"]["chunk"], 128);
  for (const auto& p : j["policies"]) {
    const std::string spec = p["spec"];
    if (spec != "full") {
      EXPECT_TRUE(has(spec, "budget=")) << spec;
    }
  }
  EXPECT_TRUE(has(test::read_file(dir + "/ruler.md"), "in passes of 128 tokens")) << r.output;
  // The same trials in one pass and in passes of 128: prefill=exact and the full cache answer
  // alike; the JSON holds every answer.
  const std::string one = out_dir("ruler_one"), chunks = out_dir("ruler_chunks");
  auto a = run_d2o("eval ruler --quick -m " + model + " -t 1 -o " + one + " --policies 'full;d2o'");
  auto b = run_d2o("eval ruler --quick -m " + model + " -t 1 -o " + chunks +
                   " --policies 'full;d2o' --chunk 128");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const nlohmann::json ja = check_outputs(one, "ruler", 1), jb = check_outputs(chunks, "ruler", 1);
  ASSERT_EQ(ja["trials"].size(), jb["trials"].size());
  for (size_t i = 0; i < ja["trials"].size(); ++i)
    EXPECT_EQ(ja["trials"][i]["answers"], jb["trials"][i]["answers"]) << i;
}

TEST(CliEval, RulerQuickRunsIsDeterministicAndSummaryPicksItUp) {
  D2O_REQUIRE_MODEL(model);
  // The CI configuration: one task and length, two trials, the full cache and d2o.
  const std::string dir = out_dir("ruler");
  auto r = run_d2o("eval ruler --quick -m " + model + " -t 1 -o " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "eval ruler [")) << "no progress bar: " << r.output;
  const nlohmann::json j = check_outputs(dir, "ruler", 1);
  ASSERT_TRUE(j.contains("trials"));
  EXPECT_EQ(j["params"]["tasks"], nlohmann::json::array({"niah_single"}));
  EXPECT_EQ(j["params"]["lengths"], nlohmann::json::array({512}));
  EXPECT_EQ(j["params"]["compression"], "ratio=0.2");
  ASSERT_EQ(j["policies"].size(), 2u);
  EXPECT_EQ(j["policies"][0]["label"], "full");
  ASSERT_EQ(j["trials"].size(), 2u);
  for (const auto& t : j["trials"]) {
    EXPECT_EQ(t["prompt_tokens"], 512 - 32);
    EXPECT_EQ(t["expected"].size(), 1u);
    EXPECT_EQ(t["kept"][0], 1.0);  // the full cache keeps everything
    // d2o at ratio 0.2 keeps about a fifth of the prompt.
    EXPECT_GT(t["kept"][1].get<double>(), 0.1);
    EXPECT_LT(t["kept"][1].get<double>(), 0.3);
    for (size_t i = 0; i < 2; ++i) {
      const double s = t["scores"][i];
      EXPECT_TRUE(s == 0.0 || s == 1.0) << s;  // one value per trial
      const bool found = has(t["answers"][i].get<std::string>(), t["expected"][0]);
      EXPECT_EQ(s, found ? 1.0 : 0.0);
    }
  }
  for (const auto& s : j["summary"]) {
    // The full cache's share of its own score is 1 (undefined, null, when it scores 0).
    if (s["policy"] == "full" && s["score"].get<double>() > 0) {
      EXPECT_EQ(s["share_of_full"], 1.0);
    }
    EXPECT_NEAR(s["kvpress_compression_ratio"].get<double>(), 1.0 - s["kept"].get<double>(), 1e-12);
  }
  const std::string md = test::read_file(dir + "/ruler.md");
  EXPECT_TRUE(has(md, "kvpress compression_ratio")) << md;
  EXPECT_TRUE(has(md, "Paired differences against d2o")) << md;
  // Same seed, same numbers; a budget above the prompt answers as the full cache does.
  const std::string a = out_dir("ruler_a"), b = out_dir("ruler_b");
  const std::string args = "eval ruler --quick --tasks vt --lengths 640 --trials 1 -m " + model +
                           " -t 1 --quiet --policies 'full;d2o;h2o:budget=100000' --seed 4 -o ";
  ASSERT_EQ(run_d2o(args + a).exit_code, 0);
  ASSERT_EQ(run_d2o(args + b).exit_code, 0);
  const auto ja = nlohmann::json::parse(test::read_file(a + "/ruler.json"));
  const auto jb = nlohmann::json::parse(test::read_file(b + "/ruler.json"));
  EXPECT_EQ(ja["trials"], jb["trials"]);
  EXPECT_EQ(ja["summary"], jb["summary"]);
  ASSERT_EQ(ja["trials"].size(), 1u);
  for (const auto& t : ja["trials"]) {
    EXPECT_EQ(t["expected"].size(), 5u);
    EXPECT_EQ(t["answers"][0], t["answers"][2]) << "budget >= context must answer like full";
    EXPECT_EQ(t["scores"][0], t["scores"][2]);
    EXPECT_EQ(t["kept"][2], 1.0);
  }
  // The summary page has a ruler section: d2o against the other compressed policy.
  auto s = run_d2o("eval summary --dir " + a);
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const std::string page = test::read_file(a + "/summary.md");
  EXPECT_TRUE(has(page, "| ruler vt, ratio=0.2 | h2o:budget=100000 |")) << page;
  EXPECT_TRUE(has(page, "| ruler, all tasks, ratio=0.2 | h2o:budget=100000 |")) << page;
  EXPECT_FALSE(has(page, "| ruler vt, ratio=0.2 | full |")) << page;
  EXPECT_TRUE(has(page, "RULER-style synthetic tasks")) << page;
  // An equal-bytes run beside it (its own report name): the page adds its row to the equal-bytes
  // table and embeds it after the ratio run, under its own title.
  const std::string bytes_args =
      "eval ruler --quick --tasks vt --lengths 640 --trials 1 -m " + model +
      " -t 1 --quiet --policies 'full;h2o;snapkv' --bytes 0.5 --kv-types f16,q8_0 --seed 4 "
      "--name ruler_bytes -o " +
      a;
  auto rb = run_d2o(bytes_args);
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  // SnapKV holds the prompt's budget while it answers (hold_budget=on), as the other policies do.
  const std::string bytes_md = test::read_file(a + "/ruler_bytes.md");
  EXPECT_TRUE(
      has(bytes_md, "`snapkv:ratio=0.5,window=32,kernel=7,pool=avg,agg=sum,hold_budget=on`"))
      << bytes_md;
  // A policy told not to hold would grow past its bytes: refused, saying why.
  auto no_hold = run_d2o("eval ruler --quick --tasks vt --lengths 640 --trials 1 -m " + model +
                         " -t 1 --quiet --policies 'full;snapkv:hold_budget=off' --bytes 0.5 -o " +
                         out_dir("ruler_no_hold"));
  EXPECT_NE(no_hold.exit_code, 0);
  EXPECT_TRUE(has(no_hold.output, "holds every policy at its bytes")) << no_hold.output;
  s = run_d2o("eval summary --dir " + a);
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const std::string page2 = test::read_file(a + "/summary.md");
  EXPECT_TRUE(has(page2, "| ruler (score), bytes=0.5 of the F16 full cache | `h2o [q8_0]` |"))
      << page2;
  const size_t ratio_at = page2.find("## RULER-style synthetic tasks, ");
  const size_t bytes_at = page2.find(
      "## RULER-style synthetic tasks at equal KV bytes (`d2o eval ruler --bytes`, bytes=0.5");
  EXPECT_NE(ratio_at, std::string::npos) << page2;
  EXPECT_NE(bytes_at, std::string::npos) << page2;
  EXPECT_LT(ratio_at, bytes_at);
  // A run at another length (its own report name, ruler_*): embedded after the first ratio run,
  // before the equal-bytes runs, its length in its title.
  auto rl = run_d2o("eval ruler --quick --tasks vt --lengths 704 --trials 1 -m " + model +
                    " -t 1 --quiet --policies 'full;h2o' --seed 4 --name ruler_long -o " + a);
  ASSERT_EQ(rl.exit_code, 0) << rl.output;
  s = run_d2o("eval summary --dir " + a);
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const std::string page3 = test::read_file(a + "/summary.md");
  const size_t first_at =
      page3.find("## RULER-style synthetic tasks, 640 tokens (`d2o eval ruler`)");
  const size_t long_at =
      page3.find("## RULER-style synthetic tasks, 704 tokens (`d2o eval ruler`)");
  const size_t bytes3_at = page3.find("## RULER-style synthetic tasks at equal KV bytes");
  ASSERT_NE(first_at, std::string::npos) << page3;
  ASSERT_NE(long_at, std::string::npos) << page3;
  ASSERT_NE(bytes3_at, std::string::npos) << page3;
  EXPECT_LT(first_at, long_at);
  EXPECT_LT(long_at, bytes3_at);
}

// The question-after setting, end to end: the report says which setting ran; every trial's
// context turn is shorter than its prompt and the follow-up questions are answered and scored;
// a budget above the prompt answers as the full cache does in both settings (the harness adds
// nothing of its own); niah and fidelity take the setting too (a budget above the prompt: KL 0).
TEST(CliEval, QuestionAfterCompressionRuns) {
  D2O_REQUIRE_MODEL(model);
  const std::string dir = out_dir("ruler_after");
  auto r = run_d2o("eval ruler --quick -m " + model + " -t 1 --quiet -o " + dir +
                   " --question after --questions 2 --policies 'full;d2o;h2o:budget=100000'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = check_outputs(dir, "ruler", 1);
  EXPECT_EQ(j["params"]["question"], "after");
  EXPECT_EQ(j["params"]["questions"], 2);
  ASSERT_EQ(j["trials"].size(), 2u);
  for (const auto& t : j["trials"]) {
    EXPECT_LT(t["context_tokens"].get<int>(), t["prompt_tokens"].get<int>());
    ASSERT_EQ(t["more_queries"].size(), 1u);
    EXPECT_NE(t["more_queries"][0], t["query"]);
    ASSERT_EQ(t["more_answers"].size(), 1u);
    ASSERT_EQ(t["more_answers"][0].size(), 3u);
    EXPECT_EQ(t["answers"][2], t["answers"][0]);  // no eviction: the full cache's answer
    EXPECT_EQ(t["more_answers"][0][2], t["more_answers"][0][0]);
    for (size_t i = 0; i < 3; ++i) {
      // The trial's score is the mean over its two questions.
      const double s = t["scores"][i], s2 = t["more_scores"][0][i];
      const bool found = has(t["answers"][i].get<std::string>(), t["expected"][0]);
      EXPECT_DOUBLE_EQ(s, ((found ? 1.0 : 0.0) + s2) / 2);
    }
  }
  EXPECT_TRUE(has(test::read_file(dir + "/ruler.md"), "question after compression"));
  const std::string nd = out_dir("niah_after");
  r = run_d2o("eval niah --quick -m " + model + " -t 1 --quiet -o " + nd +
              " --question after --tasks needle --lengths 512 --depths 50");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(check_outputs(nd, "niah", 1)["params"]["question"], "after");
  const std::string fd = out_dir("fidelity_turn");
  r = run_d2o("eval fidelity --quick -m " + model + " -t 1 --quiet -o " + fd +
              " --continue-turn --samples 1 --policies 'h2o:budget=100000'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json f = nlohmann::json::parse(test::read_file(fd + "/fidelity.json"));
  ASSERT_TRUE(f["params"].contains("continue_turn"));
  for (const auto& c : f["cases"]) EXPECT_EQ(c["kl"].get<double>(), 0.0) << c["row"];
  // The next turn in one pass, as a server feeds it: a cold tier recalls for it (one token a pass
  // recalls nothing), so the tier's d2o reads the turn closer to the full cache than without.
  const std::string fo = out_dir("fidelity_turn_one_pass");
  r = run_d2o("eval fidelity --quick -m " + model + " -t 1 --quiet -o " + fo +
              " --continue-turn --continue-in-one-pass --samples 1 --ratios 0.2 --policies "
              "'h2o:budget=100000;d2o:cold=none;d2o:cold=memory'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json g = nlohmann::json::parse(test::read_file(fo + "/fidelity.json"));
  EXPECT_EQ(g["params"]["continue_in_one_pass"], true);
  ASSERT_EQ(g["cases"].size(), 3u);
  EXPECT_EQ(g["cases"][0]["kl"].get<double>(), 0.0);  // nothing evicted: the full cache's
  const double none = g["cases"][1]["kl"], tier = g["cases"][2]["kl"];
  EXPECT_GT(none, 0.0);
  EXPECT_LT(tier, none);
}

TEST(CliEval, AblateQuickRuns) {
  D2O_REQUIRE_MODEL(model);
  REQUIRE_DEFAULT_TEXT();
  const std::string dir = out_dir("ablate");
  auto r =
      run_d2o("eval ablate --quick -m " + model + " -t 1 -o " + dir + " --samples 1 --continue 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = check_outputs(dir, "ablate", 1);
  ASSERT_TRUE(j.contains("variants"));
  // 20 ablations, 31 diagnosis rows (7 groups, 4 baselines at the same ratio, combinations).
  EXPECT_EQ(j["variants"].size(), 51u);
  int n_h2o = 0;
  for (const auto& v : j["variants"]) {
    const std::string spec = v["spec"].get<std::string>();
    if (v["group"] == "baselines" && v["value"] != "d2o (paper)") {
      EXPECT_TRUE(has(spec, ":ratio=0.2") && !has(spec, "d2o:")) << spec;
    } else {
      EXPECT_TRUE(has(spec, "d2o:ratio=0.2")) << spec;
    }
    // Every row carries its paired difference to H2O; H2O's own is 0.
    ASSERT_TRUE(v.contains("delta_kl_vs_h2o")) << spec;
    if (v["value"] == "h2o") {
      ++n_h2o;
      EXPECT_EQ(v["delta_kl_vs_h2o"].get<double>(), 0.0);
    }
    // The default appears in several groups: the same numbers each time.
    if (v["value"].get<std::string>().find("(paper)") != std::string::npos) {
      EXPECT_EQ(v["delta_kl_vs_default"].get<double>(), 0.0) << v["value"];
    }
  }
  EXPECT_EQ(n_h2o, 1);
  EXPECT_TRUE(j.contains("verdicts"));
}

TEST(CliEval, SameSeedSameNumbers) {
  D2O_REQUIRE_MODEL(model);
  const std::string a = out_dir("det_a"), b = out_dir("det_b");
  const std::string args = "eval niah --quick --tasks passkey --lengths 300 -m " + model +
                           " -t 1 --quiet --policies 'full;h2o' --seed 9 -o ";
  ASSERT_EQ(run_d2o(args + a).exit_code, 0);
  ASSERT_EQ(run_d2o(args + b).exit_code, 0);
  const auto ja = nlohmann::json::parse(test::read_file(a + "/niah.json"));
  const auto jb = nlohmann::json::parse(test::read_file(b + "/niah.json"));
  EXPECT_EQ(ja["trials"], jb["trials"]);
  EXPECT_EQ(test::read_file(a + "/niah_passkey_full.svg"),
            test::read_file(b + "/niah_passkey_full.svg"));
}

TEST(CliEval, BadInputGivesClearErrors) {
  D2O_REQUIRE_MODEL(model);
  const std::string short_text = ::d2o::test::scratch_path("eval_short.txt");
  {
    std::FILE* f = std::fopen(short_text.c_str(), "w");
    std::fputs("In the beginning God created the heaven and the earth.", f);
    std::fclose(f);
  }
  const std::string kjv = test::text_dir() + "/kjv.txt";
  const std::string m = " -m " + model + " -t 1 --quiet -o " + out_dir("errors");
  struct Case {
    std::string args, needle;
    int code;
  };
  std::vector<Case> cases = {
      {"eval ppl -m /nonexistent.gguf -f " + short_text, "cannot open", 1},
      {"eval ppl" + m + " -f /nonexistent.txt", "does not exist", 1},
      {"eval fidelity" + m + " -f /nonexistent.txt", "does not exist", 1},
      {"eval ablate" + m + " -f /nonexistent.txt", "does not exist", 1},
      {"eval niah" + m + " -f /nonexistent_dir", "does not exist", 1},
      {"eval ppl" + m + " -f " + short_text + " --tokens 100", "fewer than the 100 asked for", 1},
      {"eval fidelity" + m + " -f " + short_text, "fewer than one sample needs", 1},
      {"eval ablate" + m + " -f " + short_text + " --quick", "fewer than one sample needs", 1},
      {"eval niah" + m + " -f " + short_text + " --quick --tasks needle", "haystack has", 1},
      {"eval niah" + m + " --lengths 9000 --tasks passkey", "exceeds the model's trained context",
       1},
      {"eval niah" + m + " --lengths 20 --tasks passkey", "too short", 1},
      {"eval niah" + m + " --depths 150", "percentage", 1},
      {"eval niah" + m + " --ratio 0.2 --budget 100", "not both", 1},
      {"eval niah" + m + " --tasks haystacks", "unknown task", 1},
      {"eval ruler" + m + " --tasks niah_double", "unknown task", 1},
      {"eval ruler" + m + " --tasks vt --lengths 9000", "exceeds the model's trained context", 1},
      {"eval ruler" + m + " --tasks vt --lengths 60", "too short", 1},
      {"eval ruler" + m + " --ratio 0.2 --budget 100", "not both", 1},
      {"eval ruler" + m + " --ratio 0.2 --kv-mem-per-seq 2M", "not two", 1},
      {"eval ruler" + m + " --kv-mem-per-seq 1K --tasks niah_single --lengths 512 --trials 1",
       "holds no slot", 1},
      {"eval ruler" + m + " --kv-mem-per-seq much", "not a byte size", 1},
      {"eval ruler" + m + " --chunk -5", "--chunk", 2},
      {"eval niah" + m + " --budget 100 --kv-mem-per-seq 2M", "not both", 1},
      {"eval ruler" + m + " --budget 100 --policies 'd2o:prefill=bounded' --quick",
       "prefill= applies with ratio=", 1},
      {"eval ruler" + m + " -f /nonexistent_dir", "does not exist", 1},
      {"eval ruler" + m + " -f " + short_text, "distinct lowercase words", 1},
      {"eval fidelity" + m + " --prompt 9000", "exceeds the model's trained context", 1},
      {"eval ppl" + m + " --policies 'd2o:ratio=0.3' --tokens 300", "sets ratio= or budget= itself",
       1},
      {"eval ppl" + m + " --policies 'nonsense' --tokens 300", "unknown KV policy", 1},
      {"eval ppl" + m + " --capacities 0 --tokens 300", "capacities must be positive", 1},
      {"eval ppl" + m + " --capacities abc", "not an integer", 1},
      {"eval fidelity" + m + " --ratios 1.5", "not in (0, 1]", 1},
      {"eval ablate" + m + " --policies full", "does not apply", 1},
      {"eval ppl" + m + " --no-such-flag", "no-such-flag", 2},
      {"eval", "subcommand", 2},
      {"eval ruler" + m + " --question sideways", "unknown setting 'sideways'", 1},
      {"eval ruler" + m + " --questions 2", "needs --question after", 1},
      {"eval niah" + m + " --question during", "unknown setting 'during'", 1},
      {"eval niah" + m + " --questions 2 --question before", "needs --question after", 1},
      {"eval fidelity" + m + " --chat-format gemma", "needs --continue-turn", 1},
      {"eval fidelity" + m + " --continue-turn --chat-format nonsense", "--chat-format", 1},
  };
  if (test::file_exists(kjv)) {
    cases.push_back({"eval ppl" + m + " -f " + kjv + " --tokens 9000",
                     "beyond the model's trained context", 1});
  }
  for (const Case& c : cases) {
    auto r = run_d2o(c.args);
    EXPECT_EQ(r.exit_code, c.code) << c.args << "\n" << r.output;
    EXPECT_TRUE(has(r.output, c.needle)) << c.args << "\n" << r.output;
    EXPECT_FALSE(has(r.output, "internal invariant")) << r.output;
  }
}

}  // namespace
}  // namespace d2o
