#include "serve/text_output.h"

namespace d2o::serve {

std::string TextOutput::push(TokenId id) {
  if (stopped_) return {};
  pending_ += dec_.push(id);
  size_t cut = std::string::npos;  // the earliest stop string wins
  for (const std::string& s : stops_) {
    const size_t at = pending_.find(s);
    if (at != std::string::npos && at < cut) cut = at;
  }
  std::string out;
  if (cut != std::string::npos) {
    stopped_ = true;
    out = pending_.substr(0, cut);
    pending_.clear();
    return out;
  }
  const size_t hold = stop_string_holdback(pending_, stops_);
  out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string TextOutput::flush() {
  if (stopped_) return {};
  std::string out = std::move(pending_) + dec_.flush();
  pending_.clear();
  return out;
}

}  // namespace d2o::serve
