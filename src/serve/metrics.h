// What the server measures, and its Prometheus text exposition (GET /metrics).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "serve/conn_limits.h"

namespace d2o::serve {

// What one API key's requests asked for (GET /metrics labels it with the key's name).
struct KeyMetrics {
  std::map<std::string, int64_t> requests;  // by outcome, as Metrics::requests
  int64_t prompt_tokens = 0;
  int64_t prefilled_tokens = 0;
  int64_t generated_tokens = 0;
};

struct Metrics {
  // Counters since start.
  std::map<std::string, int64_t> requests;   // by outcome: ok, cancelled, invalid, rejected, error
  std::map<std::string, int64_t> by_policy;  // generation requests by canonical KV policy spec
  int64_t prompt_tokens = 0;                 // rendered prompt tokens of generation requests
  int64_t prefilled_tokens = 0;              // of those, fed to the model (not in a kept cache)
  int64_t generated_tokens = 0;
  // The same per API key name (empty on a server without keys: no per-key series then).
  std::map<std::string, KeyMetrics> by_key;
  int64_t steps = 0;  // engine steps
  int64_t sessions_evicted = 0;
  // --compress when-needed: compression steps of idle sessions under pressure and the bytes they
  // gave back; sessions that left memory with their file written (of sessions_evicted).
  int64_t session_compress_steps = 0;
  size_t session_compress_freed = 0;
  int64_t sessions_written_out = 0;
  // Requests whose kept session did not simply continue: rebuilt from the messages, by reason
  // (kSessionRebuildReasons), or cut back to the prefix the messages share with it (with the
  // tokens that kept and those it let go).
  std::map<std::string, int64_t> session_rebuilds;
  int64_t session_truncations = 0;
  int64_t session_truncation_kept_tokens = 0;
  int64_t session_truncation_dropped_tokens = 0;
  // --session-dir: session files written and read back, failures (writes, refused files), and
  // the seconds the engine thread spent writing and reading them.
  int64_t sessions_saved = 0;
  int64_t sessions_loaded = 0;
  int64_t session_file_errors = 0;
  int64_t session_save_failures = 0;  // of those, writes that failed (full disk, read-only, ...)
  double session_save_seconds = 0;
  double session_load_seconds = 0;
  uint64_t session_dir_bytes = 0;     // what the session files hold
  int64_t session_files_removed = 0;  // removed to keep --session-dir-max
  // Cold tiers (KV policies with cold=memory): turns that recalled, slots recalled, seconds.
  int64_t cold_recall_turns = 0;
  int64_t cold_recalled_slots = 0;
  double cold_recall_seconds = 0;
  // The HTTP front's connections (serve/conn_limits.h; filled by it, zero elsewhere).
  ConnStats connections;
  // Gauges (the engine thread's view after its last step).
  int64_t running = 0;
  int64_t queued = 0;
  int64_t sessions = 0;        // kept conversations (idle or in use)
  int64_t sessions_idle_full = 0;        // idle, in memory, never compressed under pressure
  int64_t sessions_idle_compressed = 0;  // idle, in memory, compressed under pressure
  size_t kv_cap = 0;           // --kv-mem
  size_t kv_reserved = 0;      // pool reservations: running requests + idle sessions
  size_t kv_allocated = 0;     // bytes the running caches have allocated
  size_t session_bytes = 0;    // bytes idle sessions hold (their cold tiers included)
  size_t cold_bytes = 0;       // of those, what their cold tiers hold
  size_t full_equivalent = 0;  // what the same tokens would take in full caches
};

// Why a session is rebuilt: another policy than its cache's; no prefix in common with the new
// prompt; a prefix in common that its cache no longer holds intact (compacted below its end, a
// sliding window moved past it, a cold tier in use); a model whose recurrent state cannot be
// rewound to the prefix (qwen35); its file refused, of another policy, or not read for want of
// room; lost (it left memory while its file could not be written).
inline constexpr const char* kSessionRebuildReasons[] = {
    "policy", "no_common_prefix", "prefix_not_held", "recurrent_state", "file", "lost", "pressure"};

std::string prometheus_text(const Metrics& m);

}  // namespace d2o::serve
