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

// What d2o does with each vocabulary of llama.cpp's models/ folder that ships reference
// tokenizations (docs/ADDING_A_MODEL.md keeps the same table): tokenize every test string as
// llama.cpp does, or refuse the file at load time with kUnsupported and a message that contains
// `refusal`.
struct VocabExpectation {
  const char* name;
  const char* refusal;  // nullptr: must match llama.cpp exactly
};

const VocabExpectation kVocabs[] = {
    {"bert-bge", "tokenizer model 'bert' (WordPiece"},
    {"command-r", nullptr},
    {"deepseek-coder", nullptr},
    {"deepseek-llm", nullptr},
    {"falcon", nullptr},
    {"gemma-4", nullptr},
    {"gpt-2", nullptr},
    {"llama-bpe", nullptr},
    {"llama-spm", nullptr},
    {"mpt", nullptr},
    {"phi-3", nullptr},
    {"qwen2", nullptr},
    {"qwen35", nullptr},
    {"refact", nullptr},
    {"starcoder", nullptr},
};

class VocabFiles : public ::testing::TestWithParam<VocabExpectation> {};

TEST_P(VocabFiles, MatchLlamaCppOrRefuseClearly) {
  const VocabExpectation& want = GetParam();
  const std::string base = test::vocab_file(want.name);
  if (base.empty()) {
    GTEST_SKIP() << "ggml-vocab-" << want.name
                 << ".gguf not found: run scripts/setup.sh --test-data (it fills cache/vocab) "
                    "or set D2O_VOCAB_DIR to a folder holding the llama.cpp vocab test files";
  }
  auto file = GgufFile::open(base);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto tok = Tokenizer::from_gguf(**file);
  if (want.refusal) {
    ASSERT_FALSE(tok.ok()) << want.name << " loads, but is expected to be refused";
    EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported) << tok.status().to_string();
    EXPECT_NE(tok.status().message().find(want.refusal), std::string::npos)
        << tok.status().to_string();
    return;
  }
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

// The vocabularies that must match are not quietly dropped from the table.
TEST(VocabFilesTable, RequiredVocabulariesMatch) {
  for (const char* name : {"qwen35", "gemma-4", "phi-3", "command-r", "deepseek-llm", "gpt-2",
                           "llama-bpe", "qwen2", "llama-spm"}) {
    bool found = false;
    for (const VocabExpectation& v : kVocabs) {
      if (std::string(v.name) == name) {
        found = true;
        EXPECT_EQ(v.refusal, nullptr) << name;
      }
    }
    EXPECT_TRUE(found) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, VocabFiles, ::testing::ValuesIn(kVocabs), [](const auto& info) {
  std::string n = info.param.name;
  for (char& c : n) {
    if (c == '-') c = '_';
  }
  return n;
});

}  // namespace
}  // namespace d2o

namespace d2o {
namespace {

std::unique_ptr<Tokenizer> load_vocab_tokenizer(const std::string& name,
                                                std::unique_ptr<GgufFile>& file) {
  auto f = GgufFile::open(test::vocab_file(name));
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  if (!f.ok()) return nullptr;
  file = std::move(f).value();
  auto tok = Tokenizer::from_gguf(*file);
  EXPECT_TRUE(tok.ok()) << tok.status().to_string();
  return tok.ok() ? std::move(tok).value() : nullptr;
}

// decode() is llama_detokenize: GPT-2 and Llama 3 vocabularies clean up tokenization spaces
// (" ," -> ",", " 's" -> "'s", " ' " -> "'", but " 't", " 'd", " 'll" stay), Qwen2 does not,
// SentencePiece drops the prefix space. Expected strings follow those rules by hand.
TEST(VocabDecode, CleanUpSpacesAndPrefixSpace) {
  if (test::vocab_dir().empty()) GTEST_SKIP() << "vocab test files not found: set D2O_VOCAB_DIR";
  const std::string text =
      "Hello , world ! Really ? Yes . I 'm sure it 's fine , they 're here , we 've won ; "
      "don 't you 'd he 'll a ' b";
  const std::string cleaned =
      "Hello, world! Really? Yes. I'm sure it's fine, they're here, we've won ; "
      "don 't you 'd he 'll a'b";
  EncodeOptions no_special;
  no_special.add_special = false;
  for (const char* name : {"gpt-2", "llama-bpe", "qwen2", "llama-spm", "phi-3"}) {
    std::unique_ptr<GgufFile> file;
    auto tok = load_vocab_tokenizer(name, file);
    ASSERT_NE(tok, nullptr);
    auto ids = tok->encode(text, no_special);
    ASSERT_TRUE(ids.ok());
    auto out = tok->decode(*ids, false);
    ASSERT_TRUE(out.ok());
    const std::string n = name;
    EXPECT_EQ(*out, (n == "gpt-2" || n == "llama-bpe") ? cleaned : text) << name;
    // With the model's BOS (SentencePiece, Llama 3) the pieces are joined as they are, except
    // that SentencePiece keeps the prefix space once a BOS came first.
    auto with_bos = tok->encode(" x", EncodeOptions{});
    ASSERT_TRUE(with_bos.ok());
    const std::string expect_bos = n == "llama-spm" || n == "phi-3" ? "  x" : " x";
    EXPECT_EQ(*tok->decode(*with_bos, false), expect_bos) << name;
  }
}

TEST(VocabDecode, SpecialTokensAndByteTokens) {
  if (test::vocab_dir().empty()) GTEST_SKIP() << "vocab test files not found: set D2O_VOCAB_DIR";
  std::unique_ptr<GgufFile> file;
  auto spm = load_vocab_tokenizer("llama-spm", file);
  ASSERT_NE(spm, nullptr);
  EXPECT_EQ(spm->bos(), 1);
  EXPECT_EQ(spm->eos(), 2);
  EXPECT_TRUE(spm->is_eog(2));
  EXPECT_FALSE(spm->is_eog(1));
  EXPECT_EQ(*spm->token_to_piece(13, false), "\n");  // <0x0A>
  EXPECT_EQ(*spm->token_to_piece(1, false), "");
  EXPECT_EQ(*spm->token_to_piece(1, true), "<s>");
  // Text that needs byte fallback comes back whole.
  auto ids = spm->encode("\xF0\x9F\xA6\x99 llama", EncodeOptions{});
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*spm->decode(std::vector<TokenId>(ids->begin() + 1, ids->end()), false),
            "\xF0\x9F\xA6\x99 llama");

  std::unique_ptr<GgufFile> file3;
  auto llama3 = load_vocab_tokenizer("llama-bpe", file3);
  ASSERT_NE(llama3, nullptr);
  EXPECT_TRUE(llama3->add_bos());
  const TokenId eot = *llama3->find_token("<|eot_id|>");
  EXPECT_TRUE(llama3->is_eog(eot));
  EXPECT_EQ(llama3->eot(), eot);
  EXPECT_TRUE(llama3->is_control(eot));
  EncodeOptions parse;
  parse.add_special = false;
  parse.parse_special = true;
  auto chat = llama3->encode("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", parse);
  ASSERT_TRUE(chat.ok());
  EXPECT_EQ(chat->front(), *llama3->find_token("<|start_header_id|>"));
  EXPECT_EQ(chat->back(), eot);
  EXPECT_EQ(*llama3->decode(*chat, false), "user\n\nHi");

  std::unique_ptr<GgufFile> fileq;
  auto qwen = load_vocab_tokenizer("qwen2", fileq);
  ASSERT_NE(qwen, nullptr);
  // "</s>" is an ordinary token in Qwen2's vocabulary that llama.cpp turns into a control,
  // end-of-generation token; d2o does the same.
  const TokenId s_end = *qwen->find_token("</s>");
  EXPECT_TRUE(qwen->is_eog(s_end));
  EXPECT_EQ(*qwen->token_to_piece(s_end, false), "");
  EXPECT_TRUE(qwen->is_eog(*qwen->find_token("<|im_end|>")));
  EXPECT_FALSE(qwen->is_eog(*qwen->find_token("<|im_start|>")));
}

}  // namespace
}  // namespace d2o
