// Kept conversations: a session id -> the sequence (compressed cache, policy state, position) a
// finished request handed back, and the tokens it has seen, so that the next request of the same
// conversation prefills only its new turn.
//
// Memory: an idle session's cache is shrunk to the slots it uses and those bytes (its cold tier in
// memory and its policy state included) are held in the scheduler's pool (Scheduler::hold), so
// kept conversations and running requests share the one --kv-mem cap. When a waiting request
// needs room, the least recently used idle sessions are dropped. A session in use belongs to its
// request (its bytes are part of that reservation).
// Compression under pressure (CompressWhen::kWhenNeeded, `--compress when-needed`): sessions run
// with their compactions deferred and stay full; when room is needed, the least recently used
// idle session is first compressed step by step (Scheduler::compress_step: each layer to half
// what it holds, never below its policy's budgets; evicted slots to its cold tier), then the
// next one; then the service has the scheduler compress the conversations that waiting requests
// continue (Scheduler::compress_waiting), and only when none can give more are sessions written
// out and dropped.
// With a session directory (set_dir, `--session-dir`), a session leaving memory is written to
// its file first (serve/session_dir.h), and every idle session not yet written is written by
// save_all() at shutdown; with save_every_turn each session is also written after every request
// with it (end() queues it, save_pending() writes it: the service calls that once the step's
// answers are out, so no client waits for a write), so that a crash loses nothing either. A
// session's file is read back by the service when a request names a session that is not in
// memory (adopt()).
// Used by the service's engine thread only (no locking).
#pragma once

#include <cstddef>
#include <list>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/scheduler.h"
#include "serve/session_dir.h"

namespace d2o::serve {

// When sessions are compressed: by their policy after every pass (kAlways), or only when the cap
// needs room (kWhenNeeded, see the top of the file).
enum class CompressWhen { kAlways, kWhenNeeded };

struct Session {
  std::string id;
  std::string kv_spec;            // canonical spec of its policy
  std::shared_ptr<Sequence> seq;  // null while a request runs with it
  std::vector<TokenId> tokens;    // what seq has seen (seq->n_past() of them)
  size_t held = 0;                // bytes held in the pool while idle
  bool busy = false;              // a request is running with it
  bool saved = false;             // its file holds this state (--session-dir)
  int compress_steps = 0;         // compression steps under pressure since it was last full
  bool at_floor = false;          // its policy allows no further step (until its next request)
};

// Compression under pressure (CompressWhen::kWhenNeeded) and where idle sessions stand.
struct SessionPressureStats {
  int64_t compress_steps = 0;   // steps taken
  size_t compress_freed = 0;    // bytes they gave back to the pool
  int64_t written_out = 0;      // sessions that left memory with their file current
  int64_t idle_full = 0;        // idle sessions in memory, never compressed under pressure
  int64_t idle_compressed = 0;  // idle sessions in memory compressed by one step or more
};

// Session files written, read and refused, and the time spent writing and reading them.
struct SessionFileStats {
  int64_t saved = 0;
  int64_t loaded = 0;
  int64_t errors = 0;         // writes that failed, files refused
  int64_t save_failures = 0;  // of those, writes that failed
  size_t bytes_saved = 0;
  double save_seconds = 0;
  double load_seconds = 0;
};

class SessionStore {
 public:
  explicit SessionStore(Scheduler& sched) : sched_(sched) {}
  ~SessionStore();

  // Writes sessions to `dir` (null: sessions live in memory only; dir must outlive the store).
  void set_dir(const SessionDir* dir, bool save_every_turn) {
    dir_ = dir;
    save_every_turn_ = save_every_turn;
  }
  const SessionDir* dir() const { return dir_; }
  void set_compress(CompressWhen when) { compress_ = when; }
  CompressWhen compress() const { return compress_; }

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
  // Forgets a session (returns its held bytes). Its file, if any, stays: it holds an earlier
  // state of the same conversation, which a later request may still continue.
  void drop(const std::string& id);
  // Keeps a session read from its file, idle, as end() keeps a finished one (making room as
  // make_room() does; kWhenNeeded: compressed itself first when that alone cannot make room);
  // false (nothing kept) when the pool cannot hold it.
  bool adopt(const std::string& id, std::shared_ptr<Sequence> seq, std::vector<TokenId> tokens,
             std::string kv_spec);
  // Writes every idle session whose file is not current; returns how many were written.
  int save_all();
  // save_every_turn: writes the sessions whose requests ended since the last call; returns how
  // many writes were tried.
  int save_pending();
  // Drops least recently used idle sessions (writing them to their files first when there is a
  // session directory) until the pool has `bytes` available or none is left; returns how many
  // were dropped. kWhenNeeded: compresses them first (see the top of the file).
  int make_room(size_t bytes);
  // Compresses least recently used idle sessions until the pool has `bytes` available or none
  // can give more.
  void compress_for(size_t bytes);
  SessionPressureStats pressure_stats() const;
  // Counts compression steps taken outside the store (Scheduler::compress_waiting) with its own.
  void count_steps(const Scheduler::Compressed& c) {
    n_compress_steps_ += c.steps;
    compress_freed_ += c.freed;
  }

  size_t n_sessions() const { return sessions_.size(); }
  size_t n_idle() const { return lru_.size(); }
  size_t held_bytes() const { return held_; }
  int64_t n_evicted() const { return n_evicted_; }
  SessionFileStats& file_stats() { return files_; }
  const SessionFileStats& file_stats() const { return files_; }
  // Full-cache bytes of the idle sessions' tokens (what they would hold uncompressed).
  size_t full_equivalent_bytes() const;
  // What the idle sessions' cold tiers hold (part of held_bytes()).
  size_t cold_bytes() const;
  // Whether session `id` left memory because there was no room while its file could not be
  // written (full disk, read-only directory): what it held is lost, and the request coming back
  // for it rebuilds it and says so. Forgets the mark.
  bool take_lost(const std::string& id);

 private:
  void unlink_lru(const std::string& id);
  // What an idle sequence holds in memory: its cache (cold tier in memory included) and its
  // policy state.
  static size_t bytes_of(const Sequence& seq);
  // One compression step of idle session `s`, its held bytes updated; false when it gave
  // nothing back (its policy allows no more; it is then marked at_floor).
  bool compress_one(Session& s);
  // kWhenNeeded: a session read back from its file (adopt) that would not fit even if every idle
  // session left is compressed first, step by step down to its policy's budget, rather than
  // rebuilt; returns the steps taken.
  int compress_in(Sequence& seq);
  // Writes an idle session to its file (errors are logged and counted, the session stays);
  // false when a write was tried and failed. `leaving`: it leaves memory after this (the log
  // line says what is lost).
  bool save(Session& s, bool leaving);
  // Notes that `id` left memory unwritten (the oldest marks go past kMaxLost).
  void mark_lost(const std::string& id);
  static constexpr size_t kMaxLost = 4096;

  Scheduler& sched_;
  std::map<std::string, Session> sessions_;
  std::list<std::string> lru_;  // idle sessions, least recently used first
  size_t held_ = 0;
  int64_t n_evicted_ = 0;
  CompressWhen compress_ = CompressWhen::kAlways;
  int64_t n_compress_steps_ = 0;
  size_t compress_freed_ = 0;
  int64_t n_written_out_ = 0;
  const SessionDir* dir_ = nullptr;
  bool save_every_turn_ = false;
  std::vector<std::string> pending_;  // ended since the last save_pending()
  SessionFileStats files_;
  std::set<std::string> lost_;
  std::deque<std::string> lost_order_;  // oldest first (some may be taken already)
};

}  // namespace d2o::serve
