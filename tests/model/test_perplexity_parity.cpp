// `d2o perplexity` on a fixed KJV passage (about 20K tokens, context 2048) against llama.cpp's
// perplexity tool on the same file and model (tests/data/reference/smollm2_ppl.json).
#include <gtest/gtest.h>

#include <cmath>
#include <regex>

#include "common/test_util.h"

namespace d2o {
namespace {

TEST(PerplexityParity, KjvWithinOnePercentOfLlamaCpp) {
  D2O_REQUIRE_MODEL(model);
  const std::string dir = std::string(D2O_TEST_DATA_DIR) + "/reference/";
  const std::string json = test::read_file(dir + "smollm2_ppl.json");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(json, m, std::regex("\"ppl\": ([0-9.]+)")));
  const double ref = std::stod(m[1].str());
  auto r = test::run_d2o("perplexity -m " + model + " -f " + dir + "kjv_ppl.txt -c 2048 -t 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("Final estimate: PPL = ([0-9.]+)"))) << r.output;
  const double ppl = std::stod(m[1].str());
  std::printf("d2o perplexity %.4f, llama.cpp %.4f (%+.3f%%)\n", ppl, ref, 100.0 * (ppl / ref - 1.0));
  EXPECT_LE(std::fabs(ppl / ref - 1.0), 0.01);
  EXPECT_NE(r.output.find("10 chunks of 2048"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace d2o
