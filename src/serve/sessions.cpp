#include "serve/sessions.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "kv/cold_tier.h"

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
    bytes = bytes_of(*seq);
    keep = keep && sched_.hold(bytes);
  }
  if (seq) {
    s.seq = std::move(seq);
    s.tokens = std::move(tokens);
    s.kv_spec = std::move(kv_spec);
    s.saved = false;
    s.compress_steps = 0;
    s.at_floor = false;
  }
  if (!keep) {
    // No room in memory: only its file keeps it (when there is a directory).
    if (!save(s, /*leaving=*/true)) mark_lost(id);
    sessions_.erase(it);
    return;
  }
  s.held = bytes;
  held_ += bytes;
  lru_.push_back(id);
  if (save_every_turn_ && dir_) pending_.push_back(id);
}

int SessionStore::save_pending() {
  int tried = 0;
  for (const std::string& id : pending_) {
    Session* s = find(id);
    if (!s || s->busy || s->saved || !s->seq) continue;  // busy: written when next idle
    save(*s, /*leaving=*/false);
    ++tried;
  }
  pending_.clear();
  return tried;
}

bool SessionStore::save(Session& s, bool leaving) {
  if (!dir_ || !s.seq || s.saved) return true;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = dir_->save(s.id, s.kv_spec, s.tokens, s.seq->n_past(), s.seq->cache(),
                      s.seq->policy_state());
  files_.save_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!r.ok()) {
    ++files_.errors;
    ++files_.save_failures;
    std::fprintf(stderr, "d2o serve: cannot save session '%s': %s; %s\n", s.id.c_str(),
                 r.status().message().c_str(),
                 leaving ? "what it held since its last write is lost (rebuilt if it comes back)"
                         : "it stays in memory, and is written again when it leaves");
    return false;
  }
  ++files_.saved;
  files_.bytes_saved += *r;
  s.saved = true;
  return true;
}

void SessionStore::mark_lost(const std::string& id) {
  if (!lost_.insert(id).second) return;
  lost_order_.push_back(id);
  while (lost_order_.size() > kMaxLost) {
    lost_.erase(lost_order_.front());
    lost_order_.pop_front();
  }
}

bool SessionStore::take_lost(const std::string& id) {
  if (lost_.erase(id) == 0) return false;
  lost_order_.erase(std::find(lost_order_.begin(), lost_order_.end(), id));
  return true;
}

bool SessionStore::adopt(const std::string& id, std::shared_ptr<Sequence> seq,
                         std::vector<TokenId> tokens, std::string kv_spec) {
  if (!seq || sessions_.count(id) || !seq->cache().shrink_to_fit(0).ok()) return false;
  const int steps = compress_in(*seq);
  const size_t bytes = bytes_of(*seq);
  if (!sched_.hold(bytes)) {
    // Idle sessions leave only when that makes enough room.
    if (bytes > sched_.pool().available() + held_) return false;
    make_room(bytes);
    if (!sched_.hold(bytes)) return false;
  }
  Session& s = sessions_[id];
  s.id = id;
  s.seq = std::move(seq);
  s.tokens = std::move(tokens);
  s.kv_spec = std::move(kv_spec);
  s.held = bytes;
  s.saved = true;  // (its file may hold it fuller: the same conversation)
  s.compress_steps = steps;
  held_ += bytes;
  lru_.push_back(id);
  return true;
}

int SessionStore::compress_in(Sequence& seq) {
  if (compress_ != CompressWhen::kWhenNeeded) return 0;
  int steps = 0;
  size_t bytes = bytes_of(seq);
  while (bytes > sched_.pool().available() + held_) {
    auto r = sched_.compress_step(seq);
    if (!r.ok() || !*r) break;
    ++steps;
    ++n_compress_steps_;
    const size_t now = bytes_of(seq);
    if (now >= bytes) break;
    bytes = now;
  }
  return steps;
}

int SessionStore::save_all() {
  int n = 0;
  for (const std::string& id : lru_) {
    Session& s = sessions_.at(id);
    if (s.saved) continue;
    save(s, /*leaving=*/true);  // at shutdown
    n += s.saved ? 1 : 0;
  }
  return n;
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

size_t SessionStore::bytes_of(const Sequence& seq) {
  return Scheduler::idle_bytes(seq);
}

bool SessionStore::compress_one(Session& s) {
  if (s.at_floor || !s.seq) return false;
  auto r = sched_.compress_step(*s.seq);
  if (!r.ok()) {
    std::fprintf(stderr, "d2o serve: cannot compress session '%s': %s\n", s.id.c_str(),
                 r.status().message().c_str());
  }
  if (r.ok() && *r) {
    ++s.compress_steps;
    ++n_compress_steps_;
  }
  const size_t now = bytes_of(*s.seq);
  if (now > s.held && !sched_.hold(now - s.held)) {
    // Its cold tier took more than its hot cache gave back, and the pool cannot hold the
    // difference: it leaves memory (written out first when it can be).
    if (!save(s, /*leaving=*/true)) mark_lost(s.id);
    n_written_out_ += s.saved && dir_ ? 1 : 0;
    ++n_evicted_;
    drop(s.id);
    return false;
  }
  if (now > s.held) {
    held_ += now - s.held;
    s.held = now;
  }
  const bool freed = now < s.held;
  if (freed) {
    sched_.release_held(s.held - now);
    compress_freed_ += s.held - now;
    held_ -= s.held - now;
    s.held = now;
  }
  if (!r.ok() || !*r || !freed) s.at_floor = true;
  return freed;
}

void SessionStore::compress_for(size_t bytes) {
  // Least recently used first: each session down to its policy's floor before the next one.
  const std::vector<std::string> order(lru_.begin(), lru_.end());
  for (const std::string& id : order) {
    while (sched_.pool().available() < bytes) {
      Session* s = find(id);
      if (!s || !compress_one(*s)) break;
    }
    if (sched_.pool().available() >= bytes) return;
  }
}

int SessionStore::make_room(size_t bytes) {
  if (compress_ == CompressWhen::kWhenNeeded) compress_for(bytes);
  int n = 0;
  while (sched_.pool().available() < bytes && !lru_.empty()) {
    const std::string id = lru_.front();
    if (!save(sessions_.at(id), /*leaving=*/true)) mark_lost(id);
    n_written_out_ += sessions_.at(id).saved && dir_ ? 1 : 0;
    drop(id);
    ++n_evicted_;
    ++n;
  }
  return n;
}

size_t SessionStore::cold_bytes() const {
  size_t b = 0;
  for (const std::string& id : lru_) {
    const Session& s = sessions_.at(id);
    if (s.seq && s.seq->cache().cold()) b += s.seq->cache().cold()->bytes();
  }
  return b;
}

size_t SessionStore::full_equivalent_bytes() const {
  size_t b = 0;
  for (const std::string& id : lru_) {
    const Session& s = sessions_.at(id);
    if (s.seq) b += s.seq->cache().full_kv_bytes(s.seq->n_past());
  }
  return b;
}

SessionPressureStats SessionStore::pressure_stats() const {
  SessionPressureStats p;
  p.compress_steps = n_compress_steps_;
  p.compress_freed = compress_freed_;
  p.written_out = n_written_out_;
  for (const std::string& id : lru_) {
    const Session& s = sessions_.at(id);
    (s.compress_steps > 0 ? p.idle_compressed : p.idle_full) += 1;
  }
  return p;
}

}  // namespace d2o::serve
