// Fuzz target: --prompt-tokens lists (comma-separated token ids) as the d2o tool parses them.
//
// Input: 2 bytes of vocabulary size, then the list. A list is refused with a Status or parsed
// into ids that are all inside the vocabulary, one per comma-separated item of nothing but
// digits (no signs, spaces or empty items).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int n_vocab = data[0] | (data[1] << 8);
  const std::string list(reinterpret_cast<const char*>(data + 2), size - 2);
  auto ids = d2o::cli::parse_token_list(list, n_vocab);
  if (!ids.ok()) return 0;
  if (ids->empty()) std::abort();
  size_t items = 1;
  for (char c : list) {
    if (c == ',') ++items;
    else if (c < '0' || c > '9') std::abort();
  }
  if (items != ids->size()) std::abort();
  for (d2o::TokenId id : *ids) {
    if (id < 0 || id >= n_vocab) std::abort();
  }
  return 0;
}
