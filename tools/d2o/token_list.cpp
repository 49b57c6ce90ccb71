// --prompt-tokens: a comma-separated list of token ids. Kept apart from common.cpp so the fuzz
// target of this parser (fuzz/fuzz_prompt_tokens.cpp) links without the model code.
#include <sstream>
#include <string>
#include <vector>

#include "common.h"

namespace d2o::cli {

Result<std::vector<TokenId>> parse_token_list(const std::string& s, int n_vocab) {
  std::vector<TokenId> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size()) return invalid_argument("'" + item + "' is not a token id");
    if (v < 0 || v >= n_vocab) {
      return invalid_argument("token id " + item + " is out of range (vocabulary size " + std::to_string(n_vocab) + ")");
    }
    ids.push_back(static_cast<TokenId>(v));
  }
  if (ids.empty()) return invalid_argument("no token ids given");
  return ids;
}

}  // namespace d2o::cli
