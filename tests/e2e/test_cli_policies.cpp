// `d2o policies` as a user runs it: the presets with their parts and keys, one preset's keys, a
// spec in its canonical form, and what it refuses.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/test_util.h"

namespace d2o {
namespace {

using test::run_d2o;

TEST(CliPolicies, ListsEveryPresetWithItsParts) {
  auto r = run_d2o("policies");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto has = [&](const std::string& s) { return r.output.find(s) != std::string::npos; };
  for (const char* name :
       {"full", "streaming", "h2o", "snapkv", "pyramidkv", "roco", "cam", "d2o", "keydiff"}) {
    EXPECT_TRUE(has(std::string("\n") + name + "\n") || r.output.rfind(name, 0) == 0) << name;
  }
  EXPECT_TRUE(has("default: snapkv:ratio=0.2,window=32,kernel=7,pool=avg,agg=sum")) << r.output;
  EXPECT_TRUE(has("- merger: D2O's")) << r.output;
  EXPECT_TRUE(has("- cold tier: evicted slots kept on disk")) << r.output;

  auto j = run_d2o("policies --json");
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const auto doc = nlohmann::json::parse(j.output);
  ASSERT_EQ(doc.size(), 9u);
  EXPECT_EQ(doc[0]["name"], "full");
  EXPECT_TRUE(doc[0]["parts"].empty());
  for (size_t i = 1; i < doc.size(); ++i) EXPECT_FALSE(doc[i]["parts"].empty()) << doc[i]["name"];
}

TEST(CliPolicies, OnePresetsKeysAndCanonicalSpecs) {
  auto r = run_d2o("policies keydiff");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("recent "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("\nd2o\n"), std::string::npos) << r.output;
  // Old spellings read as today's.
  auto s = run_d2o("policies --spec h2o:nm=3:1,ratio=0.5");
  ASSERT_EQ(s.exit_code, 0) << s.output;
  EXPECT_EQ(s.output,
            "h2o:ratio=0.5,sinks=0,heavy_recent=3:1,agg=sum,scorer=accumulated_attention\n");
}

TEST(CliPolicies, RefusesWhatItDoesNotKnow) {
  auto bad = run_d2o("policies --spec d2o:no_such_key=1");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("unknown key 'no_such_key'"), std::string::npos) << bad.output;
  auto name = run_d2o("policies nope");
  EXPECT_EQ(name.exit_code, 1);
  EXPECT_NE(name.output.find("unknown KV policy 'nope'"), std::string::npos) << name.output;
  EXPECT_EQ(run_d2o("policies --no-such-flag").exit_code, 2);
}

}  // namespace
}  // namespace d2o
