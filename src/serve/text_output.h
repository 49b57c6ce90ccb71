// Generated tokens to response text, token by token: complete UTF-8 characters only
// (StreamDecoder), stop strings cut out, and text that may still turn into a stop string held
// back until the next tokens decide (as generate() does for the command line).
#pragma once

#include <string>
#include <vector>

#include "runtime/generator.h"
#include "runtime/tokenizer.h"

namespace d2o::serve {

class TextOutput {
 public:
  TextOutput(const Tokenizer& tok, std::vector<std::string> stops)
      : dec_(tok), stops_(std::move(stops)) {}

  // Adds one generated token; returns the text that became final. stopped() turns true when a
  // stop string appeared (the text before it is returned, the rest never is).
  std::string push(TokenId id);
  // The end of generation (not after a stop): what was held back.
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  StreamDecoder dec_;
  std::vector<std::string> stops_;
  std::string pending_;  // decoded, not yet returned
  bool stopped_ = false;
};

}  // namespace d2o::serve
