// Fuzz target: vocabulary loading from GGUF metadata, then tokenizing and detokenizing with it.
//
// Input: a 4-byte little-endian length L, then L bytes of GGUF (a writer-made tokenizer in the
// seeds), then the text to encode. Whatever the metadata says, from_gguf either refuses it with
// a Status or yields a tokenizer whose encode/decode are safe on any text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gguf/gguf.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t len = 0;
  std::memcpy(&len, data, 4);
  data += 4;
  size -= 4;
  if (len > size) len = static_cast<uint32_t>(size);
  const std::string text(reinterpret_cast<const char*>(data + len), size - len);
  auto file = d2o::GgufFile::from_memory(data, len, "fuzz.gguf");
  if (!file.ok()) return 0;
  (void)d2o::ChatTemplate::from_gguf(**file);  // reads the vocabulary's BOS/EOS texts too
  auto tok = d2o::Tokenizer::from_gguf(**file);
  if (!tok.ok()) return 0;
  const d2o::Tokenizer& t = **tok;
  for (int opt = 0; opt < 4; ++opt) {
    auto ids = t.encode(text, d2o::EncodeOptions{(opt & 1) != 0, (opt & 2) != 0});
    if (!ids.ok()) continue;
    for (d2o::TokenId id : *ids) {
      if (id < 0 || id >= t.n_vocab()) std::abort();
    }
    if (!t.decode(*ids, opt & 1).ok()) std::abort();
    d2o::StreamDecoder stream(t);
    for (d2o::TokenId id : *ids) (void)stream.push(id);
    (void)stream.flush();
  }
  for (d2o::TokenId id : t.eog_tokens()) {
    if (!t.token_to_piece(id, true).ok()) std::abort();
  }
  return 0;
}
