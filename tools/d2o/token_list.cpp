// --prompt-tokens: a comma-separated list of token ids. Kept apart from common.cpp so the fuzz
// target of this parser (fuzz/fuzz_prompt_tokens.cpp) links without the model code.
#include <algorithm>
#include <string>
#include <vector>

#include "common.h"

namespace d2o::cli {

Result<std::vector<TokenId>> parse_token_list(const std::string& s, int n_vocab) {
  // Strict: each id is plain decimal digits; no signs, spaces or empty items ("1,,2", "1,2,"),
  // so that a list that was cut or mistyped is refused rather than read differently.
  std::vector<TokenId> ids;
  size_t start = 0;
  while (true) {
    const size_t end = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, end - start);
    if (item.empty()) {
      return invalid_argument(s.empty() ? std::string("no token ids given")
                                        : "empty token id at character " + std::to_string(start + 1) +
                                              " of the list (ids are digits separated by single commas)");
    }
    if (item.size() > 10 || item.find_first_not_of("0123456789") != std::string::npos) {
      return invalid_argument("'" + item + "' is not a token id (plain decimal digits, no signs or spaces)");
    }
    const long long v = std::stoll(item);
    if (v >= n_vocab) {
      return invalid_argument("token id " + item + " is out of range (vocabulary size " + std::to_string(n_vocab) + ")");
    }
    ids.push_back(static_cast<TokenId>(v));
    if (end == s.size()) break;
    start = end + 1;
  }
  return ids;
}

}  // namespace d2o::cli
