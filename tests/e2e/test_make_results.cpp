// CI smoke test of the results report: `scripts/make_results.sh --quick` runs every protocol end
// to end on the real model with all policies, writes JSON, Markdown and SVG files that parse, and
// the harness's invariants hold (the full cache has KL 0 against itself, a budget at least the
// context reproduces the full cache exactly). It never checks which policy wins.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/test_util.h"
#include "common/xml_check.h"

namespace d2o {
namespace {

using test::has;

nlohmann::json parse_json(const std::string& path) {
  const std::string text = test::read_file(path);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "invalid JSON: " << path;
  return j.is_discarded() ? nlohmann::json::object() : j;
}

TEST(MakeResults, QuickRunsEndToEndAndKeepsItsInvariants) {
  D2O_REQUIRE_MODEL(model);
  if (!test::file_exists(std::string(D2O_SOURCE_DIR) + "/cache/texts/kjv.txt")) {
    GTEST_SKIP() << "cache/texts/kjv.txt not found: run scripts/setup.sh";
  }
  const std::string root = ::d2o::test::scratch_path("d2o_make_results");
  std::filesystem::remove_all(root);
  const std::string out = root + "/results";
  // One thread: the machine may be shared; the numbers do not depend on the thread count.
  auto r = test::run_command("D2O=" + std::string(D2O_CLI_PATH) + " MODEL=" + model +
                             " THREADS=1 " + std::string(D2O_SOURCE_DIR) +
                             "/scripts/make_results.sh --quick --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  // Every protocol's report, and the page.
  for (const char* name : {"ppl", "fidelity", "niah", "ruler", "ablate"}) {
    const nlohmann::json j = parse_json(out + "/" + name + ".json");
    EXPECT_TRUE(j.contains("meta")) << name;
    EXPECT_FALSE(test::read_file(out + "/" + std::string(name) + ".md").empty()) << name;
  }
  const std::string page = test::read_file(root + "/results.md");
  EXPECT_TRUE(has(page, "## Where D2O wins, ties or loses")) << page;
  EXPECT_TRUE(has(page, "## Direction of each result against the paper's claim")) << page;
  int n_svg = 0;
  for (const auto& e : std::filesystem::directory_iterator(out)) {
    if (e.path().extension() != ".svg") continue;
    ++n_svg;
    EXPECT_EQ(test::xml_problem(test::read_file(e.path().string())), "") << e.path();
    // Linked from the page, relative to it.
    EXPECT_TRUE(has(page, "results/" + e.path().filename().string())) << e.path();
  }
  EXPECT_GE(n_svg, 2 + 2 * 6 + 1);  // ppl charts, niah heatmaps (2 tasks x 6 policies), ablation

  // ppl: all eleven policies (eight presets, KeyDiff and two D2O combinations); the full cache
  // once; capacity 100000 (> the text) identical to it.
  const nlohmann::json ppl = parse_json(out + "/ppl.json");
  int n_identical = 0;
  for (const auto& run : ppl["runs"]) {
    if (run["capacity"] == 100000 || run["capacity"] == 0) {
      EXPECT_TRUE(run["identical_to_full"].get<bool>()) << run["spec"];
      ++n_identical;
    }
  }
  EXPECT_EQ(n_identical, 1 + 10);
  // fidelity: the full cache and a budget above the prompt have KL 0, top-1 agreement 1.
  const nlohmann::json fid = parse_json(out + "/fidelity.json");
  int n_zero = 0;
  for (const auto& c : fid["cases"]) {
    const std::string spec = c["spec"];
    if (spec == "full" || has(spec, "budget=100000")) {
      EXPECT_EQ(c["kl"].get<double>(), 0.0) << spec;
      EXPECT_EQ(c["top1"].get<double>(), 1.0) << spec;
      ++n_zero;
    }
  }
  EXPECT_EQ(n_zero, 2);
  // niah: every trial answered by every policy; accuracies within [0, 1] with an interval.
  const nlohmann::json niah = parse_json(out + "/niah.json");
  ASSERT_FALSE(niah["trials"].empty());
  for (const auto& t : niah["trials"]) EXPECT_EQ(t["answers"].size(), 6u);
  for (const auto& s : niah["summary"]) {
    EXPECT_LE(s["ci95"][0].get<double>(), s["accuracy"].get<double>());
    EXPECT_GE(s["ci95"][1].get<double>(), s["accuracy"].get<double>());
  }
  // ruler: every trial answered by the four policies, the full cache keeping the whole prompt;
  // the page compares d2o with the three others.
  const nlohmann::json ruler = parse_json(out + "/ruler.json");
  ASSERT_FALSE(ruler["trials"].empty());
  for (const auto& t : ruler["trials"]) {
    EXPECT_EQ(t["answers"].size(), 4u);
    EXPECT_EQ(t["kept"][0], 1.0);
  }
  EXPECT_TRUE(has(page, "| ruler, all tasks, ratio=0.2 | streaming |")) << page;
}

// --only: the listed reports are run again, the others are left as they are, and the page is
// built from every report in the folder; an unknown name is refused before anything runs.
TEST(MakeResults, OnlyRunsTheListedReports) {
  D2O_REQUIRE_MODEL(model);
  const std::string root = ::d2o::test::scratch_path("d2o_make_results_only");
  std::filesystem::remove_all(root);
  const std::string out = root + "/results";
  const std::string script = "D2O=" + std::string(D2O_CLI_PATH) + " MODEL=" + model +
                             " THREADS=1 " + std::string(D2O_SOURCE_DIR) +
                             "/scripts/make_results.sh";
  auto bad = test::run_command(script + " --quick --only ruler,nonesuch --out " + out);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(has(bad.output, "unknown report 'nonesuch'")) << bad.output;
  EXPECT_FALSE(std::filesystem::exists(out + "/ruler.json"));

  auto r = test::run_command(script + " --quick --only ruler --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::file_exists(out + "/ruler.json"));
  for (const char* name : {"ppl", "fidelity", "niah", "ablate", "fidelity_bytes"}) {
    EXPECT_FALSE(std::filesystem::exists(out + "/" + std::string(name) + ".json")) << name;
  }
  const std::string page = test::read_file(root + "/results.md");
  EXPECT_TRUE(has(page, "| ruler, all tasks, ratio=0.2 | streaming |")) << page;
}

}  // namespace
}  // namespace d2o
