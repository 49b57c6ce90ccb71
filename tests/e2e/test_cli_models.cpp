// Models by name: `-m smollm2` / `-m gemma3` (and $D2O_MODEL) resolve to the files scripts/setup.sh
// fetches into $D2O_CACHE_DIR/models; an unknown name fails with a message that lists the names;
// `d2o inspect gemma3` describes Gemma 3 270M even while its architecture cannot run.
#include <gtest/gtest.h>

#include <filesystem>

#include "common/test_util.h"

namespace d2o {
namespace {

namespace fs = std::filesystem;

using test::has;

// A cache folder holding only the default model (linked), so that gemma3 is certainly absent.
std::string smollm_only_cache(const std::string& model) {
  const fs::path cache = fs::path(test::scratch_path("names_cache"));
  fs::create_directories(cache / "models");
  const fs::path link = cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(link)) fs::create_symlink(fs::absolute(model), link);
  return cache.string();
}

test::CommandResult d2o_with_cache(const std::string& cache, const std::string& args) {
  return test::run_command("D2O_CACHE_DIR='" + cache + "' D2O_MODEL= " + D2O_CLI_PATH + " " + args);
}

TEST(CliModels, NamesResolveToTheCachedFiles) {
  D2O_REQUIRE_MODEL(model);
  const std::string cache = smollm_only_cache(model);
  for (const std::string args : {"inspect smollm2 --no-tensors", "inspect -m smollm2 --no-tensors",
                                 "inspect --no-tensors"}) {
    auto r = d2o_with_cache(cache, args);
    ASSERT_EQ(r.exit_code, 0) << args << ": " << r.output;
    EXPECT_TRUE(has(r.output, cache + "/models/SmolLM2-135M-Instruct.Q4_1.gguf")) << r.output;
    EXPECT_TRUE(has(r.output, "architecture  llama")) << r.output;
  }
  // $D2O_MODEL takes a name too.
  auto env = test::run_command("D2O_CACHE_DIR='" + cache + "' D2O_MODEL=smollm2 " + D2O_CLI_PATH +
                               " inspect --no-tensors");
  ASSERT_EQ(env.exit_code, 0) << env.output;
  EXPECT_TRUE(has(env.output, "architecture  llama")) << env.output;
  // A model that runs: the name works wherever -m is accepted.
  auto run = d2o_with_cache(cache, "run -m smollm2 -p 'The sky is' -n 2 -c 64");
  EXPECT_EQ(run.exit_code, 0) << run.output;
}

TEST(CliModels, UnknownNamesAndMissingModelsAreExplained) {
  D2O_REQUIRE_MODEL(model);
  const std::string cache = smollm_only_cache(model);
  for (const std::string args :
       {"inspect no-such-model", "run -m no-such-model -p hi -n 1",
        "perplexity -m no-such-model -f /dev/null", "bench -m no-such-model -p 8 -n 0"}) {
    auto r = d2o_with_cache(cache, args);
    EXPECT_EQ(r.exit_code, 1) << args << ": " << r.output;
    EXPECT_TRUE(has(r.output, "'no-such-model' is neither a file nor a model name")) << r.output;
    EXPECT_TRUE(has(r.output, "smollm2 (")) << r.output;
    EXPECT_TRUE(has(r.output, "gemma3 (")) << r.output;
  }
  // A known name whose file is not fetched says how to fetch it.
  auto r = d2o_with_cache(cache, "inspect gemma3");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "model 'gemma3' is not in the cache")) << r.output;
  EXPECT_TRUE(has(r.output, "scripts/setup.sh --gemma3")) << r.output;
  // Paths keep their own error.
  auto path = d2o_with_cache(cache, "inspect /nonexistent/gemma3");
  EXPECT_EQ(path.exit_code, 1) << path.output;
  EXPECT_TRUE(has(path.output, "cannot open")) << path.output;
}

#define D2O_REQUIRE_GEMMA3(path_var)                                             \
  const std::string path_var = ::d2o::test::gemma3_model_path();                 \
  if (!::d2o::test::file_exists(path_var)) {                                     \
    GTEST_SKIP() << "Gemma 3 not found at '" << path_var                         \
                 << "': run scripts/setup.sh --gemma3 (or set D2O_GEMMA_MODEL)"; \
  }

// The figures are those of the GGUF file (data.md; llama.cpp's loader prints the same).
TEST(CliModels, InspectGemma3) {
  D2O_REQUIRE_GEMMA3(gemma);
  const fs::path cache = fs::path(test::scratch_path("gemma_cache"));
  fs::create_directories(cache / "models");
  fs::create_symlink(fs::absolute(gemma), cache / "models" / "gemma-3-270m-q4_k_m.gguf");
  auto r = d2o_with_cache(cache.string(), "inspect gemma3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"architecture  gemma3", "layers        18", "embedding     640",
                        "heads         4", "kv heads      1", "head_dim      256",
                        "context       32768", "vocab         262144", "tokenizer     llama",
                        "chat template no", "d2o tokenizer supported (262144 tokens, BOS 2, EOS 1)",
                        "Q8_0 x10", "Q5_0 x81", "Q4_K x27", "Q6_K x9", "F32 x109",
                        "268098176 parameters", "token_embd.weight", "blk.17.ffn_down.weight"}) {
    EXPECT_TRUE(has(r.output, s)) << s << "\n" << r.output;
  }
  // The model code may not run this architecture yet; then inspect says so, and run fails cleanly.
  ASSERT_TRUE(has(r.output, "d2o model     ")) << r.output;
  if (!has(r.output, "d2o model     supported")) {
    EXPECT_TRUE(has(r.output, "not supported by this build: model architecture 'gemma3'"))
        << r.output;
    auto run = d2o_with_cache(cache.string(), "run -m gemma3 -p hi -n 1");
    EXPECT_EQ(run.exit_code, 1) << run.output;
    EXPECT_TRUE(has(run.output, "d2o: error: unsupported:")) << run.output;
    EXPECT_TRUE(has(run.output, "'gemma3' is not supported")) << run.output;
  }
}

}  // namespace
}  // namespace d2o
