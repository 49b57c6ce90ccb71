// `d2o inspect` as a user runs it: on the real model and on malformed files.
#include <gtest/gtest.h>

#include "common/test_util.h"
#include "gguf/gguf_writer.h"

namespace d2o {
namespace {

using test::run_d2o;

TEST(CliInspect, RealModelSummary) {
  D2O_REQUIRE_MODEL(model);
  auto r = run_d2o("inspect " + model);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto has = [&](const std::string& s) { return r.output.find(s) != std::string::npos; };
  EXPECT_TRUE(has("architecture  llama")) << r.output;
  EXPECT_TRUE(has("layers        30"));
  EXPECT_TRUE(has("heads         9"));
  EXPECT_TRUE(has("kv heads      3"));
  EXPECT_TRUE(has("head_dim      64"));
  EXPECT_TRUE(has("context       8192"));
  EXPECT_TRUE(has("vocab         49152"));
  EXPECT_TRUE(has("tokenizer     gpt2, pre-tokenizer smollm"));
  EXPECT_TRUE(has("Q4_1 x210"));
  EXPECT_TRUE(has("Q8_0 x1"));
  EXPECT_TRUE(has("F32 x61"));
  EXPECT_TRUE(has("token_embd.weight"));
  // What d2o runs of it.
  EXPECT_TRUE(has("d2o model     supported"));
  EXPECT_TRUE(has("d2o layers    30 global attention layers, every one compressed"));
  EXPECT_TRUE(has("Q4_1: packed kernels"));
}

std::string write_temp(const std::vector<uint8_t>& bytes, const std::string& name) {
  const std::string path = ::d2o::test::scratch_path(name);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  return path;
}

std::vector<uint8_t> small_file() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  std::vector<uint8_t> data(64, 1);
  w.add_tensor("t", GgmlType::kF32, {16}, data);
  return w.to_bytes();
}

TEST(CliInspect, MalformedFilesExitNonZeroWithAMessage) {
  auto good = small_file();
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string needle;
  };
  std::vector<Case> cases;
  cases.push_back({"truncated.gguf", std::vector<uint8_t>(good.begin(), good.begin() + 30), "truncated"});
  auto magic = good;
  magic[1] = 'X';
  cases.push_back({"magic.gguf", magic, "bad magic"});
  auto version = good;
  version[4] = 9;
  cases.push_back({"version.gguf", version, "version 9"});
  auto past = good;
  past.resize(past.size() - 8);
  cases.push_back({"past_end.gguf", past, "past the end"});
  for (const Case& c : cases) {
    auto r = run_d2o("inspect " + write_temp(c.bytes, c.name));
    EXPECT_EQ(r.exit_code, 1) << c.name << ": " << r.output;
    EXPECT_NE(r.output.find("d2o: error:"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.name << ": " << r.output;
  }
  auto ok = run_d2o("inspect " + write_temp(good, "good.gguf"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

TEST(CliInspect, UsageErrors) {
  auto r = run_d2o("inspect --no-such-flag");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  auto none = run_d2o("");
  EXPECT_NE(none.exit_code, 0);
  auto missing = run_d2o("inspect /nonexistent/model.gguf");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace d2o
