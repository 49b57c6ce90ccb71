// Kept conversations: a session id -> the sequence (compressed cache, policy state, position) a
// finished request handed back, and the tokens it has seen, so that the next request of the same
// conversation prefills only its new turn.
//
// Memory: an idle session's cache is shrunk to the slots it uses and those bytes are held in the
// scheduler's pool (Scheduler::hold), so kept conversations and running requests share the one
// --kv-mem cap. When a waiting request needs room, the least recently used idle sessions are
// dropped. A session in use belongs to its request (its bytes are part of that reservation).
// Used by the service's engine thread only (no locking).
#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/scheduler.h"

namespace d2o::serve {

struct Session {
  std::string id;
  std::string kv_spec;            // canonical spec of its policy
  std::shared_ptr<Sequence> seq;  // null while a request runs with it
  std::vector<TokenId> tokens;    // what seq has seen (seq->n_past() of them)
  size_t held = 0;                // bytes held in the pool while idle
  bool busy = false;              // a request is running with it
};

class SessionStore {
 public:
  explicit SessionStore(Scheduler& sched) : sched_(sched) {}
  ~SessionStore();

  Session* find(const std::string& id);
  // Starts a request with session `id` (created when absent): marks it busy. The caller then
  // either take()s its sequence (continuing it) or clear()s it (building it again).
  Session& begin(const std::string& id);
  // Moves the sequence and its held bytes out of the session (to Request::resume / resume_held).
  std::shared_ptr<Sequence> take(Session& s, size_t& held);
  // Frees the session's sequence and returns its held bytes (the session stays, busy).
  void clear(Session& s);
  // A request with the session ended: keeps `seq` (shrunk, held in the pool) with its tokens, or
  // drops the session when seq is null or the pool has no room for it.
  void end(const std::string& id, std::shared_ptr<Sequence> seq, std::vector<TokenId> tokens,
           std::string kv_spec);
  // Forgets a session (returns its held bytes).
  void drop(const std::string& id);
  // Drops least recently used idle sessions until the pool has `bytes` available or none is
  // left; returns how many were dropped.
  int make_room(size_t bytes);

  size_t n_sessions() const { return sessions_.size(); }
  size_t n_idle() const { return lru_.size(); }
  size_t held_bytes() const { return held_; }
  int64_t n_evicted() const { return n_evicted_; }
  // Full-cache bytes of the idle sessions' tokens (what they would hold uncompressed).
  size_t full_equivalent_bytes() const;

 private:
  void unlink_lru(const std::string& id);

  Scheduler& sched_;
  std::map<std::string, Session> sessions_;
  std::list<std::string> lru_;  // idle sessions, least recently used first
  size_t held_ = 0;
  int64_t n_evicted_ = 0;
};

}  // namespace d2o::serve
