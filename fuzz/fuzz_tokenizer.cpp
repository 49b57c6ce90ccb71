// Fuzz target: tokenize and detokenize arbitrary bytes with every pre-tokenizer.
//
// Input: byte 0 picks the vocabulary (one byte-level BPE per pre-tokenizer name, then a
// SentencePiece one and a Gemma 4 one; see fuzz_vocabs.h), byte 1 the encode options, the rest
// is the text.
// Checked besides "no crash": every id is in range, and for valid UTF-8 text encoded without
// special handling the round trip holds: the token pieces join to the text, decode() gives the
// text back exactly (checked for vocabularies that do not clean up spaces: " ," -> "," is
// decode's documented lossy step), and StreamDecoder's output is the text too.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_vocabs.h"
#include "gguf/gguf.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

namespace {

struct Loaded {
  std::string name;
  std::vector<uint8_t> bytes;
  std::unique_ptr<d2o::GgufFile> file;
  std::unique_ptr<d2o::Tokenizer> tok;
  bool clean_spaces = false;
};

std::vector<Loaded>& vocabs() {
  static std::vector<Loaded> v = [] {
    std::vector<Loaded> out;
    for (auto& [name, bytes] : d2o::fuzz::all_vocabs()) {
      Loaded l;
      l.name = name;
      l.bytes = std::move(bytes);
      auto f = d2o::GgufFile::from_memory(l.bytes.data(), l.bytes.size(), l.name);
      if (!f.ok()) {
        std::fprintf(stderr, "%s: %s\n", l.name.c_str(), f.status().to_string().c_str());
        std::abort();
      }
      l.file = std::move(f).value();
      auto t = d2o::Tokenizer::from_gguf(*l.file);
      if (!t.ok()) {
        std::fprintf(stderr, "%s: %s\n", l.name.c_str(), t.status().to_string().c_str());
        std::abort();
      }
      l.tok = std::move(t).value();
      // Whether decode() cleans up spaces: ask it ("a ," decodes to "a," when it does).
      auto ids = l.tok->encode("a ,", d2o::EncodeOptions{false, false});
      l.clean_spaces = ids.ok() && *l.tok->decode(*ids, false) == "a,";
      out.push_back(std::move(l));
    }
    return out;
  }();
  return v;
}

bool valid_utf8(std::string_view s) {
  while (!s.empty()) {
    const d2o::unicode::Utf8Step st = d2o::unicode::utf8_scan(s);
    if (!st.valid || st.length == 0) return false;
    s.remove_prefix(st.length);
  }
  return true;
}

[[noreturn]] void fail(const Loaded& l, const char* what, const std::string& text,
                       const std::string& got) {
  std::fprintf(stderr, "%s: %s\n  text (%zu bytes) and result (%zu bytes) differ\n",
               l.name.c_str(), what, text.size(), got.size());
  std::abort();
}

}  // namespace

// Builds the vocabularies once, before any input (and outside the per-input time limit).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  vocabs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  std::vector<Loaded>& all = vocabs();
  const Loaded& l = all[data[0] % all.size()];
  d2o::EncodeOptions opts;
  opts.add_special = data[1] & 1;
  opts.parse_special = data[1] & 2;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);

  auto ids = l.tok->encode(text, opts);
  if (!ids.ok()) return 0;
  for (d2o::TokenId id : *ids) {
    if (id < 0 || id >= l.tok->n_vocab()) std::abort();
  }
  for (bool render : {false, true}) {
    auto out = l.tok->decode(*ids, render);
    if (!out.ok()) std::abort();  // every id came from encode
  }
  d2o::StreamDecoder stream(*l.tok);
  std::string streamed;
  for (d2o::TokenId id : *ids) streamed += stream.push(id);
  streamed += stream.flush();
  if (!valid_utf8(streamed)) fail(l, "StreamDecoder output is not valid UTF-8", text, streamed);

  // The round-trip property, for valid UTF-8 encoded as plain text.
  if (opts.add_special || opts.parse_special || !valid_utf8(text)) return 0;
  std::string joined;
  for (d2o::TokenId id : *ids) joined += *l.tok->token_to_piece(id, true);
  const bool spm = l.tok->model() == "llama";
  // SentencePiece and Gemma 4 write spaces as U+2581, so a U+2581 in the text comes back as a
  // space (as in SentencePiece itself and llama.cpp); SentencePiece's pieces also carry the
  // prefix space encode adds.
  std::string want = text;
  if (spm || l.tok->model() == "gemma4") {
    for (size_t p = 0; (p = want.find("\xE2\x96\x81", p)) != std::string::npos;) {
      want.replace(p, 3, " ");
    }
  }
  const std::string expected_joined = spm && !want.empty() ? " " + want : want;
  if (joined != expected_joined) fail(l, "pieces do not join to the text", text, joined);
  if (!l.clean_spaces) {
    const std::string back = *l.tok->decode(*ids, false);
    if (back != want) fail(l, "decode(encode(text)) != text", text, back);
  }
  if (streamed != expected_joined) fail(l, "StreamDecoder output differs", text, streamed);
  return 0;
}
