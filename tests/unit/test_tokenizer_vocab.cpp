// Tokenizer vs llama.cpp's reference tokenizations of its vocab test files.
//
// Each ggml-vocab-NAME.gguf comes with NAME.gguf.inp (test strings separated by lines
// "__ggml_vocab_test__") and NAME.gguf.out (the ids llama.cpp's tests/test-tokenizer-0 expects,
// one line per string). That test splits the .inp text at "\n__ggml_vocab_test__\n" (so a
// string's own trailing newlines before the separator line are kept, and the text after the last
// separator, empty here, is no string) and tokenizes each string with add_special = false and
// parse_special = false; this test does exactly the same, for every string of every file.
#include <gtest/gtest.h>

#include "gguf/gguf.h"
#include "runtime/tokenizer.h"
#include "tokenizer_test_util.h"

namespace d2o {
namespace {

struct VocabCase {
  std::string text;
  std::vector<TokenId> ids;
};

std::vector<VocabCase> read_cases(const std::string& base) {
  const std::string inp = test::read_file_bytes(base + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> strings;
  for (size_t pos = 0; pos < inp.size();) {
    const size_t next = inp.find(sep, pos);
    if (next == std::string::npos) {
      strings.push_back(inp.substr(pos));
      break;
    }
    strings.push_back(inp.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::vector<std::string> lines;
  std::istringstream out(test::read_file_bytes(base + ".out"));
  for (std::string line; std::getline(out, line);) lines.push_back(line);
  std::vector<VocabCase> cases;
  EXPECT_EQ(strings.size(), lines.size()) << base;
  for (size_t i = 0; i < strings.size() && i < lines.size(); ++i) {
    cases.push_back({strings[i], test::parse_ids(lines[i])});
  }
  return cases;
}

class VocabFiles : public ::testing::TestWithParam<const char*> {};

TEST_P(VocabFiles, MatchLlamaCppReference) {
  const std::string dir = test::vocab_dir();
  if (dir.empty()) {
    GTEST_SKIP() << "vocab test files not found: set D2O_VOCAB_DIR to the folder holding "
                    "ggml-vocab-*.gguf (shared/data/vocab)";
  }
  const std::string base = dir + "/ggml-vocab-" + GetParam() + ".gguf";
  auto file = GgufFile::open(base);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto tok = Tokenizer::from_gguf(**file);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::vector<VocabCase> cases = read_cases(base);
  ASSERT_GT(cases.size(), 30u);
  EncodeOptions opts;
  opts.add_special = false;
  opts.parse_special = false;
  int failures = 0;
  for (const VocabCase& c : cases) {
    auto ids = (*tok)->encode(c.text, opts);
    ASSERT_TRUE(ids.ok()) << ids.status().to_string();
    if (*ids != c.ids) ++failures;
    EXPECT_EQ(test::ids_to_string(*ids), test::ids_to_string(c.ids))
        << "text: '" << test::escaped(c.text) << "'";
  }
  EXPECT_EQ(failures, 0) << failures << " of " << cases.size() << " strings differ";
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, VocabFiles,
                         ::testing::Values("gpt-2", "llama-bpe", "qwen2", "llama-spm", "phi-3"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (c == '-') c = '_';
                           }
                           return n;
                         });

}  // namespace
}  // namespace d2o
