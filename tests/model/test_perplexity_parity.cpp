// `d2o perplexity` on a fixed KJV passage (about 6.5K tokens, context 2048) against llama.cpp's
// perplexity tool on the same file and model (smollm2_ppl.json in the reference folder that
// scripts/setup.sh --test-data fills: <cache>/test-data/reference or $D2O_REFERENCE_DIR).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "common/test_util.h"

namespace d2o {
namespace {

TEST(PerplexityParity, KjvWithinOnePercentOfLlamaCpp) {
  D2O_REQUIRE_MODEL(model);
  const std::string dir = test::test_data_dir("D2O_REFERENCE_DIR", "reference") + "/";
  if (!test::file_exists(dir + "smollm2_ppl.json")) {
    GTEST_SKIP() << "no llama.cpp perplexity in " << dir << ": run scripts/setup.sh --test-data";
  }
  const std::string json = test::read_file(dir + "smollm2_ppl.json");
  const double ref = test::number_after(json, "\"ppl\":");
  const double chunks = test::number_after(json, "\"chunks\":");
  ASSERT_FALSE(std::isnan(ref));
  ASSERT_FALSE(std::isnan(chunks));
  auto r = test::run_d2o("perplexity -m " + model + " -f " + dir + "kjv_ppl.txt -c 2048 -t 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double ppl = test::number_after(r.output, "Final estimate: PPL =");
  ASSERT_FALSE(std::isnan(ppl)) << r.output;
  std::printf("d2o perplexity %.4f, llama.cpp %.4f (%+.3f%%)\n", ppl, ref, 100.0 * (ppl / ref - 1.0));
  EXPECT_LE(std::fabs(ppl / ref - 1.0), 0.01);
  // The same chunks as llama.cpp's.
  EXPECT_NE(r.output.find(std::to_string(static_cast<int>(chunks)) + " chunks of 2048"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace d2o
