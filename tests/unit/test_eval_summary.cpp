// `d2o eval summary`: which row its verdicts are about, and the note on reports recorded while
// d2o's defaults were the paper's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/test_util.h"
#include "eval/summary.h"

namespace d2o::eval {
namespace {

using nlohmann::json;

// A niah report with three policies: `labels[i]` found the needle in `correct[i]` of 4 trials.
json niah_report(const std::vector<std::string>& labels, const std::vector<std::string>& specs,
                 const std::vector<int>& correct) {
  json j;
  j["meta"] = {{"model", {{"name", "m.gguf"}}}, {"text", {{"name", "t"}}}, {"kv_type", "f16"}};
  j["params"] = {{"lengths", {1024}}, {"tasks", {"needle"}}, {"compression", "budget=64"}};
  j["policies"] = json::array();
  for (size_t i = 0; i < labels.size(); ++i)
    j["policies"].push_back({{"label", labels[i]}, {"spec", specs[i]}});
  j["trials"] = json::array();
  for (int t = 0; t < 4; ++t) {
    json c = json::array();
    for (int n : correct) c.push_back(t < n ? 1.0 : 0.0);
    j["trials"].push_back({{"task", "needle"}, {"correct", c}});
  }
  j["summary"] = json::array();
  return j;
}

std::string page_of(const json& report, const std::string& name) {
  const std::string dir = test::scratch_path(name);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/niah.json") << report.dump();
  std::ofstream(dir + "/niah.md") << "## Needle\n\nThe report.\n";
  SummaryOptions o;
  o.dir = dir;
  auto md = build_results_markdown(o);
  EXPECT_TRUE(md.ok()) << md.status().message();
  return md.ok() ? *md : "";
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

const char* const kOldPaper =
    "d2o:budget=64,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
    "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off";
const char* const kNewPaper =
    "d2o:budget=64,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,ema=paper,"
    "agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,mass=off,prompt=acc,"
    "pmerge=on";
// The same policy as recorded since the keys have readable names.
const char* const kRenamedPaper =
    "d2o:budget=64,sinks=4,heavy_recent=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,"
    "ema=paper,agg=sum,norm=none,merged_score=sum,merge_keys=rotated,merge_decision=per_head,"
    "keep_edge_layers=off,proportional_attention=off,prompt_ranking=accumulated,prompt_merge=on";

TEST(EvalSummary, VerdictsAreAboutD2oOrThePapersReading) {
  // Recorded under the paper's defaults: `d2o` is the row, and the report carries the note.
  const std::string old_page = page_of(
      niah_report({"full", "h2o", "d2o"}, {"full", "h2o:budget=64", kOldPaper}, {4, 1, 3}), "old");
  EXPECT_TRUE(has(old_page, "| niah needle, budget=64 at 1K | h2o | accuracy, D2O − other = 50.0"))
      << old_page;
  EXPECT_TRUE(has(old_page, "## Needle\n\n*Recorded while `d2o`'s defaults were the paper's"))
      << old_page;
  // The same run today: the paper's D2O is `d2o:reading=paper`, and no note.
  const std::string new_page = page_of(niah_report({"full", "h2o", "d2o:reading=paper"},
                                                   {"full", "h2o:budget=64", kNewPaper}, {4, 1, 3}),
                                       "new");
  EXPECT_TRUE(has(new_page, "| niah needle, budget=64 at 1K | h2o | accuracy, D2O − other = 50.0"))
      << new_page;
  EXPECT_FALSE(has(new_page, "Recorded while")) << new_page;
  const std::string renamed_page =
      page_of(niah_report({"full", "h2o", "d2o:reading=paper"},
                          {"full", "h2o:budget=64", kRenamedPaper}, {4, 1, 3}),
              "renamed");
  EXPECT_TRUE(
      has(renamed_page, "| niah needle, budget=64 at 1K | h2o | accuracy, D2O − other = 50.0"))
      << renamed_page;
  EXPECT_FALSE(has(renamed_page, "Recorded while")) << renamed_page;
  // With both, `d2o` (E today) is the row, and the paper's reading is one of its rivals.
  const std::string both_page =
      page_of(niah_report({"d2o:reading=paper", "h2o", "d2o"},
                          {kNewPaper, "h2o:budget=64", "d2o:budget=64,prompt=window"}, {3, 1, 4}),
              "both");
  EXPECT_TRUE(has(both_page,
                  "| niah needle, budget=64 at 1K | d2o:reading=paper | accuracy, D2O "
                  "− other = 25.0"))
      << both_page;
  // Without either, no D2O row: no verdict rows.
  const std::string none_page = page_of(
      niah_report({"full", "h2o", "d2o:nm=1:1"}, {"full", "h2o:budget=64", kNewPaper}, {4, 1, 3}),
      "none");
  EXPECT_FALSE(has(none_page, "| niah needle")) << none_page;
}

}  // namespace
}  // namespace d2o::eval
