// Tokenizer on small vocabularies written with GgufWriter: BPE and SentencePiece merges against
// naive re-implementations, pre-tokenizer splits against hand-derived expectations, Unicode
// classes, StreamDecoder on byte tokens, and the errors for bad input.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "runtime/pretokenizer.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"
#include "tokenizer_test_util.h"

namespace d2o {
namespace {

struct VocabSpec {
  std::string model = "gpt2";
  std::string pre = "gpt-2";
  std::vector<std::string> tokens;
  std::vector<int32_t> types;  // empty: all normal
  std::vector<float> scores;
  std::vector<std::string> merges;
  int32_t bos = -1, eos = -1;
  bool skip_model_key = false;
};

// Builds the GGUF in memory; the bytes must outlive the file.
struct MemGguf {
  std::vector<uint8_t> bytes;
  std::unique_ptr<GgufFile> file;
};

MemGguf make_gguf(const VocabSpec& s) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  if (!s.skip_model_key) w.add_string("tokenizer.ggml.model", s.model);
  if (!s.pre.empty()) w.add_string("tokenizer.ggml.pre", s.pre);
  w.add_string_array("tokenizer.ggml.tokens", s.tokens);
  if (!s.types.empty()) w.add_i32_array("tokenizer.ggml.token_type", s.types);
  if (!s.scores.empty()) w.add_f32_array("tokenizer.ggml.scores", s.scores);
  if (s.model == "gpt2" && !s.merges.empty()) w.add_string_array("tokenizer.ggml.merges", s.merges);
  if (s.bos >= 0) w.add_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(s.bos));
  if (s.eos >= 0) w.add_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(s.eos));
  MemGguf m;
  m.bytes = w.to_bytes();
  auto f = GgufFile::from_memory(m.bytes.data(), m.bytes.size(), "test.gguf");
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  m.file = std::move(f).value();
  return m;
}

// ---- byte-level BPE against a naive implementation ------------------------------------------

// Textbook BPE: merge the adjacent pair with the lowest rank, leftmost first, until none is left.
std::vector<std::string> naive_bpe(const std::string& word,
                                   const std::map<std::pair<std::string, std::string>, int>& rank) {
  std::vector<std::string> sym;
  for (char c : word) sym.push_back(unicode::byte_to_chars()[static_cast<uint8_t>(c)]);
  while (sym.size() > 1) {
    int best = -1, best_rank = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = rank.find({sym[i], sym[i + 1]});
      if (it != rank.end() && (best < 0 || it->second < best_rank)) {
        best = static_cast<int>(i);
        best_rank = it->second;
      }
    }
    if (best < 0) break;
    sym[best] += sym[best + 1];
    sym.erase(sym.begin() + best + 1);
  }
  return sym;
}

TEST(TokenizerBpe, MatchesNaiveBpeOnRandomMerges) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 20; ++trial) {
    VocabSpec s;
    for (int b = 0; b < 256; ++b) s.tokens.push_back(unicode::byte_to_chars()[b]);
    // Merges over a small alphabet so they apply often, including overlapping ones ("aa").
    std::vector<std::string> pieces;
    for (char c : std::string("abcdé")) pieces.push_back(unicode::byte_to_chars()[uint8_t(c)]);
    std::map<std::pair<std::string, std::string>, int> rank;
    for (int m = 0; m < 60; ++m) {
      const std::string l = pieces[rng() % pieces.size()];
      const std::string r = pieces[rng() % pieces.size()];
      if (rank.count({l, r})) continue;
      rank[{l, r}] = static_cast<int>(s.merges.size());
      s.merges.push_back(l + " " + r);
      if (std::find(s.tokens.begin(), s.tokens.end(), l + r) == s.tokens.end()) {
        s.tokens.push_back(l + r);
        pieces.push_back(l + r);
      }
    }
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    for (int w = 0; w < 50; ++w) {
      std::string word;
      const int len = 1 + static_cast<int>(rng() % 40);
      for (int k = 0; k < len; ++k) word += std::string("abcdé").substr(rng() % 4, 1);
      if (rng() % 5 == 0) word += "é";
      std::vector<TokenId> expected;
      for (const std::string& p : naive_bpe(word, rank)) expected.push_back(*(*tok)->find_token(p));
      auto ids = (*tok)->encode(word, EncodeOptions{});
      ASSERT_TRUE(ids.ok());
      EXPECT_EQ(*ids, expected) << "trial " << trial << " word " << word;
      EXPECT_EQ(*(*tok)->decode(*ids, false), word);
    }
  }
}

TEST(TokenizerBpe, Llama3TakesWholeWordTokensAndAddsBos) {
  VocabSpec s;
  s.pre = "llama-bpe";
  for (int b = 0; b < 256; ++b) s.tokens.push_back(unicode::byte_to_chars()[b]);
  s.tokens.push_back("hello");  // a token no merge produces
  s.tokens.push_back("<|begin_of_text|>");
  s.types.assign(s.tokens.size(), 1);
  s.types.back() = 3;
  s.bos = static_cast<int32_t>(s.tokens.size() - 1);
  s.merges = {"h e"};
  s.tokens.push_back("he");
  s.types.push_back(1);
  MemGguf g = make_gguf(s);
  auto tok = Tokenizer::from_gguf(*g.file);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_TRUE((*tok)->add_bos());
  auto ids = (*tok)->encode("hello help", EncodeOptions{});
  ASSERT_TRUE(ids.ok());
  // Token b is byte b; "hello" is taken whole, " help" is merged: ' ', "he", 'l', 'p'.
  EXPECT_EQ(*ids, (std::vector<TokenId>{257, 256, ' ', 258, 'l', 'p'}));
  // The BOS is a control token: rendered only on request.
  EXPECT_EQ(*(*tok)->decode(*ids, false), "hello help");
  EXPECT_EQ(*(*tok)->decode(*ids, true), "<|begin_of_text|>hello help");
  // parse_special turns the marker in text into the token.
  EncodeOptions o;
  o.add_special = false;
  o.parse_special = true;
  EXPECT_EQ(*(*tok)->encode("<|begin_of_text|>he", o), (std::vector<TokenId>{s.bos, 258}));
  o.parse_special = false;
  EXPECT_NE((*(*tok)->encode("<|begin_of_text|>", o)).size(), 1u);
}

// ---- SentencePiece against a naive implementation -------------------------------------------

std::vector<std::string> naive_spm(const std::string& text,
                                   const std::map<std::string, float>& score) {
  std::vector<std::string> sym;
  for (size_t i = 0; i < text.size();) {
    const size_t n = unicode::utf8_len_from_lead(static_cast<uint8_t>(text[i]));
    sym.push_back(text.substr(i, n));
    i += n;
  }
  while (true) {
    int best = -1;
    float best_score = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = score.find(sym[i] + sym[i + 1]);
      if (it != score.end() && (best < 0 || it->second > best_score)) {
        best = static_cast<int>(i);
        best_score = it->second;
      }
    }
    if (best < 0) break;
    sym[best] += sym[best + 1];
    sym.erase(sym.begin() + best + 1);
  }
  return sym;
}

TEST(TokenizerSpm, MatchesNaiveSentencePieceWithByteFallback) {
  std::mt19937 rng(7);
  const std::vector<std::string> alphabet = {"a", "b", "c", "\xE2\x96\x81"};  // U+2581
  for (int trial = 0; trial < 20; ++trial) {
    VocabSpec s;
    s.model = "llama";
    s.pre = "";
    s.tokens = {"<unk>", "<s>", "</s>"};
    s.types = {2, 3, 3};
    s.scores = {0, 0, 0};
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      s.tokens.push_back(name);
      s.types.push_back(6);
      s.scores.push_back(0);
    }
    std::map<std::string, float> score;
    for (const char* a : {"a", "b", "\xE2\x96\x81"}) {  // "c" only via byte fallback
      score[a] = -100;
      s.tokens.push_back(a);
      s.types.push_back(1);
      s.scores.push_back(-100);
    }
    for (int k = 0; k < 40; ++k) {
      std::string t;
      const int len = 2 + static_cast<int>(rng() % 4);
      for (int i = 0; i < len; ++i) t += alphabet[rng() % alphabet.size()];
      if (score.count(t)) continue;
      const float sc = static_cast<float>(static_cast<int>(rng() % 9)) - 8.0f;  // ties happen
      score[t] = sc;
      s.tokens.push_back(t);
      s.types.push_back(1);
      s.scores.push_back(sc);
    }
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    EXPECT_TRUE((*tok)->add_bos());
    for (int w = 0; w < 40; ++w) {
      std::string text;
      const int len = 1 + static_cast<int>(rng() % 30);
      for (int i = 0; i < len; ++i) text += "abc "[rng() % 4];
      std::string escaped = "\xE2\x96\x81";  // the prefix space
      for (char c : text) escaped += c == ' ' ? std::string("\xE2\x96\x81") : std::string(1, c);
      std::vector<TokenId> expected = {1};  // BOS
      for (const std::string& p : naive_spm(escaped, score)) {
        if (auto id = (*tok)->find_token(p)) {
          expected.push_back(*id);
        } else {
          for (unsigned char c : p) expected.push_back(3 + c);  // <0xNN>
        }
      }
      auto ids = (*tok)->encode(text, EncodeOptions{});
      ASSERT_TRUE(ids.ok());
      EXPECT_EQ(*ids, expected) << "text '" << text << "'";
      // decode drops the prefix space (and renders nothing for the BOS)
      EXPECT_EQ(*(*tok)->decode(*ids, false), " " + text);
      std::vector<TokenId> no_bos(ids->begin() + 1, ids->end());
      EXPECT_EQ(*(*tok)->decode(no_bos, false), text);
    }
  }
}

// Word-by-word merging (an optimisation) must not change results when some tokens glue a
// character to a following space ("x▁y" here) and others do not.
TEST(TokenizerSpm, SpaceGlueTokensMatchNaive) {
  const std::string sp = "\xE2\x96\x81";
  VocabSpec s;
  s.model = "llama";
  s.pre = "";
  std::map<std::string, float> score;
  const std::vector<std::pair<std::string, float>> toks = {
      {"<unk>", 0},   {"<s>", 0},     {"</s>", 0},
      {sp, -1},       {"x", -1},      {"y", -1},
      {"z", -1},      {sp + "y", -2}, {"x" + sp + "y", -0.5f},
      {sp + "x", -3}, {sp + "z", -3}, {sp + sp, -4},
      {"zz", -2},     {sp + "zz", -1}};
  for (const auto& [t, sc] : toks) {
    s.tokens.push_back(t);
    s.scores.push_back(sc);
    s.types.push_back(s.tokens.size() <= 3 ? 3 : 1);
    if (s.tokens.size() > 3) score[t] = sc;
  }
  MemGguf g = make_gguf(s);
  auto tok = Tokenizer::from_gguf(*g.file);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EncodeOptions o;
  o.add_special = false;
  for (const std::string text : {"x y x y", "z y  x y zz x", "x  y", "zx yx y", "  x y"}) {
    std::string escaped = sp;
    for (char c : text) escaped += c == ' ' ? sp : std::string(1, c);
    std::vector<TokenId> expected;
    for (const std::string& p : naive_spm(escaped, score))
      expected.push_back(*(*tok)->find_token(p));
    EXPECT_EQ(*(*tok)->encode(text, o), expected) << text;
  }
}

// ---- pre-tokenizers ---------------------------------------------------------------------------

std::vector<std::string> words(const std::string& pre, const std::string& text) {
  auto pt = PreTokenizer::create(pre);
  EXPECT_TRUE(pt.ok()) << pt.status().to_string();
  PreTokenized out;
  EXPECT_TRUE((*pt)->split(text, out).ok());
  std::vector<std::string> w;
  uint32_t begin = 0;
  for (uint32_t end : out.word_ends) {
    w.push_back(out.text.substr(begin, end - begin));
    begin = end;
  }
  return w;
}
using Words = std::vector<std::string>;

TEST(PreTokenizer, Gpt2) {
  EXPECT_EQ(words("gpt-2", "Hello world"), (Words{"Hello", " world"}));
  EXPECT_EQ(words("gpt-2", "a   b"), (Words{"a", "  ", " b"}));  // \s+(?!\S)
  EXPECT_EQ(words("gpt-2", "x\t\ty "), (Words{"x", "\t", "\t", "y", " "}));
  EXPECT_EQ(words("gpt-2", "it's 'S x2y"), (Words{"it", "'s", " '", "S", " x", "2", "y"}));
  EXPECT_EQ(words("gpt-2", "naïve café!?"), (Words{"naïve", " café", "!?"}));
  EXPECT_EQ(words("gpt-2", "a\u3000b\u0085c"), (Words{"a", "\u3000", "b", "\u0085", "c"}));
  // Thai: a letter, then two combining marks (neither letter nor space).
  EXPECT_EQ(words("gpt-2", "\u0e17\u0e35\u0e48"), (Words{"\u0e17", "\u0e35\u0e48"}));
  // Letters new in Unicode 15.1 (CJK Extension I) are letters, whatever PCRE2's version.
  EXPECT_EQ(words("gpt-2", "a\U0002EBF0b c"), (Words{"a\U0002EBF0b", " c"}));
}

TEST(PreTokenizer, Llama3) {
  EXPECT_EQ(words("llama-bpe", "1234567"), (Words{"123", "456", "7"}));
  EXPECT_EQ(words("llama-bpe", "a\n\n b"), (Words{"a", "\n\n", " b"}));
  EXPECT_EQ(words("llama-bpe", "I'M HE'LL"), (Words{"I", "'M", " HE", "'LL"}));
  EXPECT_EQ(words("llama-bpe", "  \n  x"), (Words{"  \n", " ", " x"}));
  EXPECT_EQ(words("llama-bpe", "(foo)\n\nbar"), (Words{"(foo", ")\n\n", "bar"}));
}

TEST(PreTokenizer, Qwen2SmolLMDefault) {
  EXPECT_EQ(words("qwen2", "1234 ab"), (Words{"1", "2", "3", "4", " ab"}));
  EXPECT_EQ(words("smollm", "abc123 def"), (Words{"abc", "1", "2", "3", " def"}));
  EXPECT_EQ(words("smollm", "x ٣٤"), (Words{"x", " ", "٣", "٤"}));
  EXPECT_EQ(words("default", "Hello, world!!! 12345"),
            (Words{"Hello", ",", " world", "!!!", " ", "123", "45"}));
}

TEST(PreTokenizer, InvalidUtf8BecomesReplacementCharacters) {
  // Each undecodable byte turns into U+FFFD, as llama.cpp does before BPE.
  EXPECT_EQ(words("gpt-2", "a\x80\xE4\xBD"), (Words{"a", "\uFFFD\uFFFD\uFFFD"}));
  EXPECT_EQ(words("gpt-2", "\xC0\xAF"), (Words{"/"}));  // overlong: accepted like llama.cpp
}

TEST(Unicode, CharClasses) {
  using unicode::CharClass;
  EXPECT_EQ(unicode::char_class('A'), CharClass::kLetter);
  EXPECT_EQ(unicode::char_class('_'), CharClass::kPunctuation);
  EXPECT_EQ(unicode::char_class('`'), CharClass::kSymbol);
  EXPECT_EQ(unicode::char_class(0x1C), CharClass::kOther);       // not White_Space
  EXPECT_EQ(unicode::char_class(0x85), CharClass::kWhitespace);  // NEL is
  EXPECT_EQ(unicode::char_class(0x180E), CharClass::kOther);     // no longer whitespace
  EXPECT_EQ(unicode::char_class(0x3000), CharClass::kWhitespace);
  EXPECT_EQ(unicode::char_class(0x0301), CharClass::kMark);
  EXPECT_EQ(unicode::char_class(0x00B2), CharClass::kNumber);
  EXPECT_EQ(unicode::char_class(0x1D2C0), CharClass::kNumber);  // Kaktovik (Unicode 15.0)
  EXPECT_EQ(unicode::char_class(0x11F04), CharClass::kLetter);  // Kawi (15.0)
  EXPECT_EQ(unicode::char_class(0x2EBF0), CharClass::kLetter);  // CJK Ext. I (15.1)
  EXPECT_EQ(unicode::char_class(0x1C89), CharClass::kOther);    // assigned only in 16.0
  EXPECT_EQ(unicode::char_class(0x1F600), CharClass::kSymbol);
  EXPECT_EQ(unicode::char_class(0xE000), CharClass::kOther);
  EXPECT_EQ(unicode::char_class(0x110000), CharClass::kOther);
}

// ---- streaming ------------------------------------------------------------------------------

TEST(StreamDecoder, HoldsIncompleteCharactersAndReplacesInvalidBytes) {
  VocabSpec s;
  s.model = "llama";
  s.pre = "";
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    s.tokens.push_back(name);
    s.types.push_back(6);
  }
  s.tokens.push_back("\xE2\x96\x81hi");  // "▁hi"
  s.types.push_back(1);
  MemGguf g = make_gguf(s);
  auto tok = Tokenizer::from_gguf(*g.file);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  StreamDecoder d(**tok);
  // 日 = E6 97 A5, 😀 = F0 9F 98 80
  EXPECT_EQ(d.push(0xE6), "");
  EXPECT_EQ(d.push(0x97), "");
  EXPECT_EQ(d.push(0xA5), "\u65e5");
  EXPECT_EQ(d.push(0xF0), "");
  EXPECT_EQ(d.push(0x9F), "");
  EXPECT_EQ(d.push(0x98), "");
  EXPECT_EQ(d.push(0x80), "\U0001F600");
  EXPECT_EQ(d.push(256), " hi");
  EXPECT_EQ(d.push(0xFF), "\uFFFD");  // can never start a character
  EXPECT_EQ(d.push(0xE6), "");
  EXPECT_EQ(d.push('A'),
            "\uFFFD"
            "A");  // E6 cut short
  EXPECT_EQ(d.push(0xED), "");
  EXPECT_EQ(d.push(0xA0), "\uFFFD\uFFFD");  // a surrogate: ED then A0 are invalid
  EXPECT_EQ(d.push(0xC3), "");
  EXPECT_EQ(d.flush(), "\uFFFD");  // left incomplete at the end
  EXPECT_EQ(d.flush(), "");
  EXPECT_EQ(d.push(100000), "\uFFFD");  // invalid id
}

// ---- errors ---------------------------------------------------------------------------------

VocabSpec small_bpe() {
  VocabSpec s;
  for (int b = 0; b < 256; ++b) s.tokens.push_back(unicode::byte_to_chars()[b]);
  s.merges = {"a b"};
  s.tokens.push_back("ab");
  return s;
}

TEST(TokenizerErrors, OutOfRangeIds) {
  MemGguf g = make_gguf(small_bpe());
  auto tok = Tokenizer::from_gguf(*g.file);
  ASSERT_TRUE(tok.ok());
  const Tokenizer& t = **tok;
  EXPECT_EQ(t.n_vocab(), 257);
  for (TokenId bad : {-1, 257, 1 << 30}) {
    auto p = t.token_to_piece(bad, false);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find("out of range"), std::string::npos);
    EXPECT_FALSE(t.decode({65, bad}, false).ok());
    EXPECT_EQ(t.token_text(bad), "");
    EXPECT_FALSE(t.is_eog(bad));
  }
  EXPECT_EQ(t.bos(), -1);
  EXPECT_EQ(t.eos(), -1);
  EXPECT_EQ(t.model(), "gpt2");
  EXPECT_EQ(t.pre_tokenizer(), "gpt-2");
  EXPECT_FALSE(t.find_token("nonexistent").has_value());
}

TEST(TokenizerErrors, EmptyTokenTextIsRenamed) {
  VocabSpec s = small_bpe();
  s.tokens.push_back("");  // as llama.cpp: "[EMPTY_<id>]"
  MemGguf g = make_gguf(s);
  auto tok = Tokenizer::from_gguf(*g.file);
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ((*tok)->token_text(257), "[EMPTY_257]");
}

TEST(TokenizerErrors, MissingOrUnknownMetadata) {
  {
    VocabSpec s = small_bpe();
    s.skip_model_key = true;
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), StatusCode::kNotFound);
    EXPECT_NE(tok.status().message().find("no tokenizer"), std::string::npos);
  }
  {
    VocabSpec s = small_bpe();
    s.model = "bert";
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(tok.status().message().find("'bert'"), std::string::npos);
    EXPECT_NE(tok.status().message().find("gpt2"), std::string::npos);
  }
  {
    VocabSpec s = small_bpe();
    s.pre = "nonesuch";
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(tok.status().message().find("'nonesuch'"), std::string::npos);
    EXPECT_NE(tok.status().message().find("smollm"), std::string::npos);
  }
  {
    VocabSpec s = small_bpe();
    s.merges.clear();
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_FALSE(tok.ok());
    EXPECT_NE(tok.status().message().find("merges"), std::string::npos);
  }
  {
    // A GGUF with no metadata at all.
    GgufWriter w;
    w.add_string("general.architecture", "llama");
    auto bytes = w.to_bytes();
    auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "bare.gguf");
    ASSERT_TRUE(f.ok());
    auto tok = Tokenizer::from_gguf(**f);
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), StatusCode::kNotFound);
  }
}

TEST(TokenizerErrors, MalformedArrays) {
  {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_i32_array("tokenizer.ggml.tokens", {1, 2, 3});
    auto bytes = w.to_bytes();
    auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "bad.gguf");
    ASSERT_TRUE(f.ok());
    auto tok = Tokenizer::from_gguf(**f);
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), StatusCode::kFormatError);
  }
  {
    VocabSpec s = small_bpe();
    s.types = {1, 1};  // fewer types than tokens
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), StatusCode::kFormatError);
    EXPECT_NE(tok.status().message().find("token_type"), std::string::npos);
  }
  {
    VocabSpec s = small_bpe();
    s.scores = {0.5f};
    MemGguf g = make_gguf(s);
    auto tok = Tokenizer::from_gguf(*g.file);
    ASSERT_FALSE(tok.ok());
    EXPECT_NE(tok.status().message().find("scores"), std::string::npos);
  }
  {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string_array("tokenizer.ggml.tokens", {"<unk>", "a"});
    w.add_bool("tokenizer.ggml.add_bos_token", true);
    w.add_u32("tokenizer.ggml.bos_token_id", 7);  // out of range: ignored, the default 1 stays
    auto bytes = w.to_bytes();
    auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "spm.gguf");
    ASSERT_TRUE(f.ok());
    auto tok = Tokenizer::from_gguf(**f);
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    EXPECT_EQ((*tok)->bos(), 1);
  }
  {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string_array("tokenizer.ggml.tokens", {"a", "b"});
    w.add_string_array("tokenizer.ggml.merges", {"a b"});
    w.add_bool("tokenizer.ggml.add_bos_token", true);
    auto bytes = w.to_bytes();
    auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "nobos.gguf");
    ASSERT_TRUE(f.ok());
    auto tok = Tokenizer::from_gguf(**f);
    ASSERT_FALSE(tok.ok());
    EXPECT_NE(tok.status().message().find("BOS"), std::string::npos);
  }
}

}  // namespace
}  // namespace d2o
