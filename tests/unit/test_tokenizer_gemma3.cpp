// Gemma 3's SentencePiece vocabulary (262144 tokens, no prefix space, <0xNN> byte fallback,
// user-defined whitespace runs and HTML tags, control turn markers) against llama.cpp.
//
// The references are llama.cpp's own llama_tokenize / llama_detokenize of the tokenizer corpus
// (tests/data/tokenizer/corpus_*.txt) and of gemma3_extra.txt, made by scripts/gen_gemma3_tokens.py
// when scripts/setup.sh --test-data runs ($D2O_CACHE_DIR/test-data/tokenizer/gemma3, or
// $D2O_GEMMA3_TOKENS_DIR). Only the vocabulary is read from the model file: d2o's model code does
// not run Gemma 3, the tokenizer does not need it to. For every chunk: the ids equal llama.cpp's,
// decoding them gives llama.cpp's detokenized text, and (special tokens rendered or not, as they
// were parsed) the chunk itself back; StreamDecoder gives the same text token by token.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/test_util.h"
#include "gguf/gguf.h"
#include "runtime/tokenizer.h"
#include "tokenizer_test_util.h"

namespace d2o {
namespace {

const std::string kCorpusDir = std::string(D2O_TEST_DATA_DIR) + "/tokenizer";
const std::string kSep = "\n@@@@ d2o chunk @@@@\n";

std::vector<std::string> split_chunks(const std::string& text) {
  std::vector<std::string> chunks;
  size_t pos = 0;
  for (size_t next; (next = text.find(kSep, pos)) != std::string::npos; pos = next + kSep.size()) {
    chunks.push_back(text.substr(pos, next - pos));
  }
  chunks.push_back(text.substr(pos));
  return chunks;
}

std::vector<std::vector<TokenId>> read_id_lines(const std::string& path) {
  std::vector<std::vector<TokenId>> out;
  std::istringstream in(test::read_file_bytes(path));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '#') continue;
    out.push_back(test::parse_ids(line));
  }
  return out;
}

std::string refs_dir() {
  return test::test_data_dir("D2O_GEMMA3_TOKENS_DIR", "tokenizer/gemma3");
}

struct Gemma {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Tokenizer> tok;
};

// Loaded once per process (262144 tokens); null (with the reason in *why) when absent.
const Gemma* gemma(std::string* why) {
  static std::unique_ptr<Gemma> g;
  static std::string reason;
  static bool tried = false;
  if (!tried) {
    tried = true;
    const std::string path = test::gemma_path();
    if (path.empty()) {
      reason = "Gemma 3 model not found: run scripts/setup.sh --gemma3 (or set D2O_GEMMA_MODEL)";
    } else if (!std::filesystem::exists(refs_dir() + "/meta.json")) {
      reason = "llama.cpp's Gemma 3 token ids not found in " + refs_dir() +
               ": run scripts/setup.sh --test-data (or set D2O_GEMMA3_TOKENS_DIR)";
    } else {
      auto file = GgufFile::open(path);
      if (!file.ok()) {
        reason = file.status().to_string();
      } else {
        auto tok = Tokenizer::from_gguf(**file);
        if (!tok.ok()) {
          reason = tok.status().to_string();
        } else {
          g = std::make_unique<Gemma>(Gemma{std::move(file).value(), std::move(tok).value()});
        }
      }
      // A model that is present must load: that is a failure, not a skip.
      EXPECT_TRUE(g) << reason;
    }
  }
  *why = reason;
  return g.get();
}

#define SKIP_WITHOUT_GEMMA(tok)              \
  std::string why_skipped;                   \
  const Gemma* gemma_ = gemma(&why_skipped); \
  if (!gemma_) GTEST_SKIP() << why_skipped;  \
  const Tokenizer* tok = gemma_->tok.get()

struct CorpusRun {
  const char* name;    // <name>.ids / .detok in the references
  const char* source;  // the text file in tests/data/tokenizer
  bool special;        // special tokens parsed (and rendered when decoding)
};
const CorpusRun kRuns[] = {
    {"corpus_bible", "corpus_bible.txt", false},
    {"corpus_austen", "corpus_austen.txt", false},
    {"corpus_code", "corpus_code.txt", false},
    {"corpus_numbers", "corpus_numbers.txt", false},
    {"corpus_whitespace", "corpus_whitespace.txt", false},
    {"corpus_scripts", "corpus_scripts.txt", false},
    {"corpus_emoji", "corpus_emoji.txt", false},
    {"corpus_edge", "corpus_edge.txt", false},
    {"corpus_edge.special", "corpus_edge.txt", true},
    {"gemma3_extra", "gemma3_extra.txt", false},
    {"gemma3_extra.special", "gemma3_extra.txt", true},
    {"bytes_invalid_utf8", "bytes_invalid_utf8.txt", false},
};

class Gemma3Corpus : public ::testing::TestWithParam<CorpusRun> {};

TEST_P(Gemma3Corpus, IdsAndTextMatchLlamaCpp) {
  SKIP_WITHOUT_GEMMA(tok);
  const CorpusRun run = GetParam();
  const auto chunks = split_chunks(test::read_file_bytes(kCorpusDir + "/" + run.source));
  const auto expected = read_id_lines(refs_dir() + "/" + run.name + ".ids");
  const auto detok = split_chunks(test::read_file_bytes(refs_dir() + "/" + run.name + ".detok"));
  ASSERT_EQ(chunks.size(), expected.size())
      << "references out of date: rerun scripts/setup.sh --test-data";
  ASSERT_EQ(chunks.size(), detok.size());
  EncodeOptions opts;  // the model's defaults: BOS added
  opts.parse_special = run.special;
  const bool utf8 = std::string(run.name) != "bytes_invalid_utf8";
  size_t tokens = 0, mismatched_chunks = 0;
  for (size_t k = 0; k < chunks.size(); ++k) {
    auto ids = tok->encode(chunks[k], opts);
    ASSERT_TRUE(ids.ok()) << ids.status().to_string();
    tokens += expected[k].size();
    if (*ids != expected[k]) ++mismatched_chunks;
    EXPECT_EQ(test::ids_to_string(*ids), test::ids_to_string(expected[k]))
        << run.name << " chunk " << k << ": '" << test::escaped(chunks[k]) << "'";
    ASSERT_FALSE(ids->empty());
    EXPECT_EQ((*ids)[0], tok->bos());
    // Decoding llama.cpp's ids gives llama.cpp's text ...
    auto text = tok->decode(expected[k], run.special);
    ASSERT_TRUE(text.ok()) << text.status().to_string();
    EXPECT_TRUE(*text == detok[k])
        << run.name << " chunk " << k << ": d2o '" << test::escaped(*text) << "' llama.cpp '"
        << test::escaped(detok[k]) << "'";
    // ... and the chunk itself (byte fallback makes every byte representable), except that a
    // U+2581 in the text comes back as a space (SentencePiece writes spaces as U+2581) and that
    // text which is not UTF-8 is only compared with llama.cpp (the U+2581 of a space can join a
    // truncated character and come back as bytes). With special tokens rendered, the BOS added
    // in front renders too.
    if (!utf8) continue;
    std::string want = run.special ? tok->token_text(tok->bos()) : std::string();
    for (size_t i = 0; i < chunks[k].size(); ++i) {
      if (chunks[k].compare(i, 3, "\xE2\x96\x81") == 0) {
        want += ' ';
        i += 2;
      } else {
        want += chunks[k][i];
      }
    }
    EXPECT_TRUE(*text == want) << run.name << " chunk " << k << " does not round-trip: '"
                               << test::escaped(*text) << "'";
    StreamDecoder dec(*tok, run.special);
    std::string streamed;
    for (TokenId id : expected[k]) streamed += dec.push(id);
    streamed += dec.flush();
    EXPECT_TRUE(streamed == want) << run.name << " chunk " << k << " streamed: '"
                                  << test::escaped(streamed) << "'";
  }
  std::printf("%s: %zu chunks, %zu tokens compared, %zu chunks differ\n", run.name, chunks.size(),
              tokens, mismatched_chunks);
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, Gemma3Corpus, ::testing::ValuesIn(kRuns),
                         [](const ::testing::TestParamInfo<CorpusRun>& info) {
                           std::string n = info.param.name;
                           for (char& c : n) {
                             if (c == '.') c = '_';
                           }
                           return n;
                         });

// The vocabulary's flags and special ids as llama.cpp reports them (meta.json).
TEST(Gemma3Vocab, SpecialTokensMatchLlamaCpp) {
  SKIP_WITHOUT_GEMMA(tok);
  const auto meta = nlohmann::json::parse(test::read_file_bytes(refs_dir() + "/meta.json"));
  EXPECT_EQ(tok->n_vocab(), meta["n_vocab"].get<int>());
  EXPECT_EQ(tok->bos(), meta["bos"].get<int>());
  EXPECT_EQ(tok->eos(), meta["eos"].get<int>());
  EXPECT_EQ(tok->eot(), meta["eot"].get<int>());
  EXPECT_EQ(tok->add_bos(), meta["add_bos"].get<bool>());
  EXPECT_EQ(tok->add_eos(), meta["add_eos"].get<bool>());
  EXPECT_EQ(tok->eog_tokens(), meta["eog"].get<std::vector<TokenId>>());
  EXPECT_EQ(tok->model(), "llama");
  EXPECT_EQ(tok->token_text(105), "<start_of_turn>");
  EXPECT_TRUE(tok->is_control(105));
  EXPECT_TRUE(tok->is_control(106));
  // No prefix space: " x" and "x" differ, and decode keeps a leading space.
  auto a = tok->encode("Hello", EncodeOptions{false, false});
  auto b = tok->encode(" Hello", EncodeOptions{false, false});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_EQ(*tok->decode(*b, false), " Hello");
}

}  // namespace
}  // namespace d2o
