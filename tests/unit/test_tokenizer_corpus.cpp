// Tokenizer vs llama.cpp on a ~330 KB corpus (tests/data/tokenizer, see
// scripts/gen_tokenizer_corpus.py and scripts/gen_tokenizer_fixtures.sh).
//
//  - SmolLM2 (the default model): every chunk's ids equal llama-tokenize's, and decoding them
//    gives the chunk back byte for byte; also with special tokens parsed, and on bytes that are
//    not UTF-8 (ids only).
//  - The five llama.cpp vocab files and, when present, Gemma 3 270M (D2O_GEMMA_MODEL): every
//    chunk's token count and id hash equal llama-tokenize's.
//  - StreamDecoder fed token by token never emits part of a UTF-8 character and produces the
//    same text as decode().
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <thread>

#include "gguf/gguf.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"
#include "tokenizer_test_util.h"

namespace d2o {
namespace {

const std::string kDataDir = std::string(D2O_TEST_DATA_DIR) + "/tokenizer";
const char* kCorpora[] = {"bible",      "austen",  "code",  "numbers",
                          "whitespace", "scripts", "emoji", "edge"};

std::vector<std::string> read_chunks(const std::string& path) {
  const std::string text = test::read_file_bytes(path);
  const std::string sep = "\n@@@@ d2o chunk @@@@\n";
  std::vector<std::string> chunks;
  size_t pos = 0;
  for (size_t next; (next = text.find(sep, pos)) != std::string::npos; pos = next + sep.size()) {
    chunks.push_back(text.substr(pos, next - pos));
  }
  chunks.push_back(text.substr(pos));
  return chunks;
}

std::vector<std::vector<TokenId>> read_ids(const std::string& path) {
  std::vector<std::vector<TokenId>> out;
  std::istringstream in(test::read_file_bytes(path));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '#') continue;
    out.push_back(test::parse_ids(line));
  }
  return out;
}

uint64_t fnv1a64(const std::vector<TokenId>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (TokenId id : ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xFF;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

// Keeps the GGUF mapping alive as long as the tokenizer is used.
struct LoadedCorpus {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Tokenizer> tok;
};

const LoadedCorpus* load_cached(const std::string& path) {
  static std::map<std::string, std::unique_ptr<LoadedCorpus>> cache;
  auto it = cache.find(path);
  if (it != cache.end()) return it->second.get();
  auto file = GgufFile::open(path);
  EXPECT_TRUE(file.ok()) << file.status().to_string();
  if (!file.ok()) return nullptr;
  auto tok = Tokenizer::from_gguf(**file);
  EXPECT_TRUE(tok.ok()) << tok.status().to_string();
  if (!tok.ok()) return nullptr;
  auto l =
      std::make_unique<LoadedCorpus>(LoadedCorpus{std::move(file).value(), std::move(tok).value()});
  return (cache[path] = std::move(l)).get();
}

const Tokenizer* smollm() {
  const std::string path = test::smollm_path();
  if (path.empty()) return nullptr;
  const LoadedCorpus* l = load_cached(path);
  return l ? l->tok.get() : nullptr;
}

#define SKIP_WITHOUT_SMOLLM(tok)                                                                 \
  const Tokenizer* tok = smollm();                                                               \
  if (!tok) {                                                                                    \
    GTEST_SKIP() << "SmolLM2 model not found: set D2O_MODEL to SmolLM2-135M-Instruct.Q4_1.gguf"; \
  }

// The text decode() can give back: SmolLM2's vocabulary has no token for a few byte values
// (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D and lead bytes that never occur in UTF-8 text), so those
// bytes are dropped, by llama.cpp too (the ids match). Everything else must round-trip.
std::string representable(const Tokenizer& tok, const std::string& text) {
  std::string out;
  for (char c : text) {
    if (tok.find_token(unicode::byte_to_chars()[static_cast<uint8_t>(c)])) out.push_back(c);
  }
  return out;
}

class SmolCorpus : public ::testing::TestWithParam<const char*> {};

TEST_P(SmolCorpus, IdsMatchLlamaCppAndDecodeRoundTrips) {
  SKIP_WITHOUT_SMOLLM(tok);
  const std::string name = GetParam();
  const auto chunks = read_chunks(kDataDir + "/corpus_" + name + ".txt");
  const auto expected = read_ids(kDataDir + "/corpus_" + name + ".ids");
  ASSERT_EQ(chunks.size(), expected.size()) << "fixtures out of date: rerun the scripts";
  EXPECT_EQ(tok->add_bos(), false);
  EncodeOptions opts;  // the model's defaults: add_special on (SmolLM2 adds nothing), no parsing
  for (size_t k = 0; k < chunks.size(); ++k) {
    auto ids = tok->encode(chunks[k], opts);
    ASSERT_TRUE(ids.ok()) << ids.status().to_string();
    EXPECT_EQ(test::ids_to_string(*ids), test::ids_to_string(expected[k]))
        << name << " chunk " << k << ": '" << test::escaped(chunks[k]) << "'";
    auto text = tok->decode(*ids, false);
    ASSERT_TRUE(text.ok()) << text.status().to_string();
    EXPECT_TRUE(*text == representable(*tok, chunks[k]))
        << name << " chunk " << k << " does not round-trip: '" << test::escaped(*text) << "'";
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, SmolCorpus, ::testing::ValuesIn(kCorpora));

TEST(SmolCorpusSpecial, ParsedSpecialTokensMatchLlamaCpp) {
  SKIP_WITHOUT_SMOLLM(tok);
  const auto chunks = read_chunks(kDataDir + "/corpus_edge.txt");
  const auto expected = read_ids(kDataDir + "/corpus_edge.special.ids");
  ASSERT_EQ(chunks.size(), expected.size());
  EncodeOptions opts;
  opts.parse_special = true;
  bool saw_special = false;
  for (size_t k = 0; k < chunks.size(); ++k) {
    auto ids = tok->encode(chunks[k], opts);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(test::ids_to_string(*ids), test::ids_to_string(expected[k])) << "chunk " << k;
    for (TokenId id : *ids) saw_special |= tok->is_control(id);
    // With the special tokens rendered, the text comes back too.
    auto text = tok->decode(*ids, true);
    ASSERT_TRUE(text.ok());
    EXPECT_TRUE(*text == representable(*tok, chunks[k])) << "chunk " << k;
  }
  EXPECT_TRUE(saw_special);
}

TEST(SmolCorpusInvalidUtf8, IdsMatchLlamaCpp) {
  SKIP_WITHOUT_SMOLLM(tok);
  const auto chunks = read_chunks(kDataDir + "/bytes_invalid_utf8.txt");
  const auto expected = read_ids(kDataDir + "/bytes_invalid_utf8.ids");
  ASSERT_EQ(chunks.size(), expected.size());
  for (size_t k = 0; k < chunks.size(); ++k) {
    auto ids = tok->encode(chunks[k], EncodeOptions{});
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(test::ids_to_string(*ids), test::ids_to_string(expected[k])) << "chunk " << k;
  }
}

TEST(VocabCorpus, IdHashesMatchLlamaCpp) {
  const std::string dir = test::vocab_dir();
  if (dir.empty()) GTEST_SKIP() << "vocab test files not found: set D2O_VOCAB_DIR";
  std::istringstream in(test::read_file_bytes(kDataDir + "/vocab_hashes.txt"));
  std::map<std::string, std::vector<std::string>> chunk_cache;
  size_t checked = 0, skipped_gemma = 0;
  const std::string gemma = test::gemma_path();
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string vocab, corpus, hash_hex;
    size_t k = 0, n_tokens = 0;
    fields >> vocab >> corpus >> k >> n_tokens >> hash_hex;
    const bool special = corpus.size() > 8 && corpus.substr(corpus.size() - 8) == ".special";
    const std::string base = special ? corpus.substr(0, corpus.size() - 8) : corpus;
    auto& chunks = chunk_cache[base];
    if (chunks.empty()) chunks = read_chunks(kDataDir + "/" + base + ".txt");
    ASSERT_LT(k, chunks.size()) << line;
    if (vocab == "gemma3" && gemma.empty()) {
      ++skipped_gemma;
      continue;
    }
    const LoadedCorpus* l =
        load_cached(vocab == "gemma3" ? gemma : dir + "/ggml-vocab-" + vocab + ".gguf");
    ASSERT_NE(l, nullptr);
    EncodeOptions opts;
    opts.parse_special = special;
    auto ids = l->tok->encode(chunks[k], opts);
    ASSERT_TRUE(ids.ok());
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fnv1a64(*ids)));
    EXPECT_EQ(ids->size(), n_tokens) << vocab << " " << corpus << " chunk " << k;
    EXPECT_EQ(std::string(hex), hash_hex)
        << vocab << " " << corpus << " chunk " << k << ": '" << test::escaped(chunks[k], 80) << "'";
    ++checked;
  }
  EXPECT_GT(checked, 500u);
  if (skipped_gemma > 0) {
    std::printf("note: %zu Gemma 3 rows skipped (set D2O_GEMMA_MODEL to check them)\n",
                skipped_gemma);
  }
}

// Special ids as llama.cpp reports them for SmolLM2 (llama-tokenize -v: BOS 1, EOS 2, EOG 0 2 4;
// <reponame> is end-of-generation as a FIM repository marker).
TEST(SmolSpecialTokens, MatchLlamaCpp) {
  SKIP_WITHOUT_SMOLLM(tok);
  EXPECT_EQ(tok->n_vocab(), 49152);
  EXPECT_EQ(tok->bos(), 1);
  EXPECT_EQ(tok->eos(), 2);
  EXPECT_EQ(tok->eog_tokens(), (std::vector<TokenId>{0, 2, 4}));
  EXPECT_FALSE(tok->add_bos());
  EXPECT_EQ(tok->pre_tokenizer(), "smollm");
  for (TokenId id = 0; id < 17; ++id) EXPECT_TRUE(tok->is_control(id)) << id;
  EXPECT_FALSE(tok->is_control(17));
}

// encode() is const and keeps no shared state: two threads give the serial results.
TEST(SmolCorpusThreads, ConcurrentEncodeMatchesSerial) {
  SKIP_WITHOUT_SMOLLM(tok);
  const auto chunks = read_chunks(kDataDir + "/corpus_scripts.txt");
  std::vector<std::vector<TokenId>> serial;
  for (const std::string& c : chunks) serial.push_back(*tok->encode(c, EncodeOptions{}));
  std::vector<std::vector<TokenId>> a(chunks.size()), b(chunks.size());
  std::thread ta([&] {
    for (size_t k = 0; k < chunks.size(); ++k) a[k] = *tok->encode(chunks[k], EncodeOptions{});
  });
  std::thread tb([&] {
    for (size_t k = chunks.size(); k-- > 0;) b[k] = *tok->encode(chunks[k], EncodeOptions{});
  });
  ta.join();
  tb.join();
  EXPECT_EQ(a, serial);
  EXPECT_EQ(b, serial);
}

// Every piece a StreamDecoder returns is complete, valid UTF-8.
bool complete_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unicode::Utf8Step st = unicode::utf8_scan(std::string_view(s).substr(i));
    if (!st.valid) return false;
    i += st.length;
  }
  return true;
}

TEST(StreamDecoder, NeverSplitsCharactersOnSmolLM2) {
  SKIP_WITHOUT_SMOLLM(tok);
  size_t split_tokens = 0;  // tokens that end inside a character: the case under test
  for (const char* name : {"emoji", "scripts"}) {
    for (const std::string& chunk : read_chunks(kDataDir + "/corpus_" + name + ".txt")) {
      auto ids = tok->encode(chunk, EncodeOptions{});
      ASSERT_TRUE(ids.ok());
      StreamDecoder dec(*tok);
      std::string streamed;
      for (TokenId id : *ids) {
        const std::string piece = *tok->token_to_piece(id, false);
        if (!complete_utf8(piece)) ++split_tokens;
        const std::string out = dec.push(id);
        ASSERT_TRUE(complete_utf8(out))
            << "partial character emitted: '" << test::escaped(out) << "'";
        streamed += out;
      }
      streamed += dec.flush();
      EXPECT_TRUE(streamed == chunk) << name << ": '" << test::escaped(streamed) << "'";
    }
  }
  EXPECT_GT(split_tokens, 100u);  // the corpus does exercise multi-token characters
}

}  // namespace
}  // namespace d2o
