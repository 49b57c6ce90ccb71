#include "serve/sessions.h"

#include <algorithm>

namespace d2o::serve {

SessionStore::~SessionStore() {
  for (auto& [id, s] : sessions_) {
    if (s.held > 0) sched_.release_held(s.held);
  }
}

Session* SessionStore::find(const std::string& id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

void SessionStore::unlink_lru(const std::string& id) {
  auto it = std::find(lru_.begin(), lru_.end(), id);
  if (it != lru_.end()) lru_.erase(it);
}

Session& SessionStore::begin(const std::string& id) {
  Session& s = sessions_[id];
  s.id = id;
  unlink_lru(id);
  s.busy = true;
  return s;
}

std::shared_ptr<Sequence> SessionStore::take(Session& s, size_t& held) {
  held = s.held;
  held_ -= s.held;
  s.held = 0;
  s.tokens.clear();
  return std::move(s.seq);
}

void SessionStore::clear(Session& s) {
  if (s.held > 0) {
    sched_.release_held(s.held);
    held_ -= s.held;
    s.held = 0;
  }
  s.seq.reset();
  s.tokens.clear();
}

void SessionStore::end(const std::string& id, std::shared_ptr<Sequence> seq,
                       std::vector<TokenId> tokens, std::string kv_spec) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session& s = it->second;
  s.busy = false;
  if (s.held > 0) {  // the request did not take them over (it failed before submission)
    sched_.release_held(s.held);
    held_ -= s.held;
    s.held = 0;
  }
  bool keep = seq != nullptr;
  size_t bytes = 0;
  if (keep) {
    // Idle, the cache needs only the slots it uses; the next request sets its own limit.
    keep = seq->cache().shrink_to_fit(0).ok() && seq->cache().set_slot_limit(0).ok();
    bytes = seq->cache().kv_bytes_allocated() + seq->cache().meta_bytes_allocated();
    keep = keep && sched_.hold(bytes);
  }
  if (!keep) {
    sessions_.erase(it);
    return;
  }
  s.seq = std::move(seq);
  s.tokens = std::move(tokens);
  s.kv_spec = std::move(kv_spec);
  s.held = bytes;
  held_ += bytes;
  lru_.push_back(id);
}

void SessionStore::drop(const std::string& id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  if (it->second.held > 0) {
    sched_.release_held(it->second.held);
    held_ -= it->second.held;
  }
  unlink_lru(id);
  sessions_.erase(it);
}

int SessionStore::make_room(size_t bytes) {
  int n = 0;
  while (sched_.pool().available() < bytes && !lru_.empty()) {
    const std::string id = lru_.front();
    drop(id);
    ++n_evicted_;
    ++n;
  }
  return n;
}

size_t SessionStore::full_equivalent_bytes() const {
  size_t b = 0;
  for (const std::string& id : lru_) {
    const Session& s = sessions_.at(id);
    if (s.seq) b += s.seq->cache().full_kv_bytes(s.seq->n_past());
  }
  return b;
}

}  // namespace d2o::serve
