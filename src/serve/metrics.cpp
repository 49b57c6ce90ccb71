#include "serve/metrics.h"

#include <algorithm>

namespace d2o::serve {

namespace {

void metric(std::string& out, const char* name, const char* type, const char* help) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void value(std::string& out, const std::string& name, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, " %.17g\n", v);
  out += name + buf;
}

// Prometheus label values escape backslash, quote and newline.
std::string label(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

void connection_metrics(std::string& o, const ConnStats& c) {
  metric(o, "d2o_connections_open", "gauge", "HTTP connections open.");
  value(o, "d2o_connections_open", static_cast<double>(c.open));
  metric(o, "d2o_connections_idle", "gauge",
         "Idle kept-alive HTTP connections waiting for their next request.");
  value(o, "d2o_connections_idle", static_cast<double>(c.idle));
  metric(o, "d2o_connections_accepted_total", "counter", "HTTP connections taken.");
  value(o, "d2o_connections_accepted_total", static_cast<double>(c.accepted));
  metric(o, "d2o_connections_refused_total", "counter",
         "HTTP connections refused or given up on, by reason (503 per_address, max_conn, "
         "waiting_full; 408 header_timeout, body_timeout; 431 header_too_large; 413 "
         "body_too_large; 411 length_required; 400 bad_request; 429 rate_limited).");
  for (size_t r = 0; r < c.refused.size(); ++r) {
    value(o,
          std::string("d2o_connections_refused_total{reason=\"") +
              conn_refusal_name(static_cast<ConnRefusal>(r)) + "\"}",
          static_cast<double>(c.refused[r]));
  }
  metric(o, "d2o_connections_shed_total", "counter",
         "Idle kept-alive connections closed to make room under --max-conn.");
  value(o, "d2o_connections_shed_total", static_cast<double>(c.shed));
}

}  // namespace

std::string prometheus_text(const Metrics& m) {
  std::string o;
  metric(o, "d2o_requests_total", "counter", "Requests by outcome.");
  for (const char* k : {"ok", "cancelled", "invalid", "rejected", "error"}) {
    auto it = m.requests.find(k);
    value(o, std::string("d2o_requests_total{outcome=\"") + k + "\"}",
          it == m.requests.end() ? 0.0 : static_cast<double>(it->second));
  }
  metric(o, "d2o_policy_requests_total", "counter", "Generation requests by KV policy.");
  for (const auto& [spec, n] : m.by_policy) {
    value(o, "d2o_policy_requests_total{policy=\"" + label(spec) + "\"}", static_cast<double>(n));
  }
  metric(o, "d2o_prompt_tokens_total", "counter", "Prompt tokens of generation requests.");
  value(o, "d2o_prompt_tokens_total", static_cast<double>(m.prompt_tokens));
  metric(o, "d2o_prefilled_tokens_total", "counter",
         "Prompt tokens fed to the model (the rest were in a kept session cache).");
  value(o, "d2o_prefilled_tokens_total", static_cast<double>(m.prefilled_tokens));
  metric(o, "d2o_generated_tokens_total", "counter", "Generated tokens.");
  value(o, "d2o_generated_tokens_total", static_cast<double>(m.generated_tokens));
  metric(o, "d2o_cold_recall_turns_total", "counter",
         "Turns of sessions that recalled slots from their cold tier.");
  value(o, "d2o_cold_recall_turns_total", static_cast<double>(m.cold_recall_turns));
  metric(o, "d2o_cold_recalled_slots_total", "counter",
         "Slots recalled from cold tiers (per KV head and layer).");
  value(o, "d2o_cold_recalled_slots_total", static_cast<double>(m.cold_recalled_slots));
  metric(o, "d2o_cold_recall_seconds_total", "counter", "Seconds spent recalling cold slots.");
  value(o, "d2o_cold_recall_seconds_total", m.cold_recall_seconds);
  metric(o, "d2o_cold_bytes", "gauge", "Bytes the cold tiers of idle sessions hold.");
  value(o, "d2o_cold_bytes", static_cast<double>(m.cold_bytes));
  if (!m.by_key.empty()) {  // only on a server with API keys
    metric(o, "d2o_key_requests_total", "counter", "Requests by API key name and outcome.");
    for (const auto& [name, k] : m.by_key) {
      for (const char* outcome : {"ok", "cancelled", "invalid", "rejected", "error"}) {
        auto it = k.requests.find(outcome);
        value(o, "d2o_key_requests_total{key=\"" + label(name) + "\",outcome=\"" + outcome + "\"}",
              it == k.requests.end() ? 0.0 : static_cast<double>(it->second));
      }
    }
    const struct {
      const char* name;
      const char* help;
      int64_t KeyMetrics::*field;
    } per_key[] = {
        {"d2o_key_prompt_tokens_total", "Prompt tokens of generation requests, by API key name.",
         &KeyMetrics::prompt_tokens},
        {"d2o_key_prefilled_tokens_total",
         "Prompt tokens fed to the model (not in a kept session cache), by API key name.",
         &KeyMetrics::prefilled_tokens},
        {"d2o_key_generated_tokens_total", "Generated tokens, by API key name.",
         &KeyMetrics::generated_tokens},
    };
    for (const auto& f : per_key) {
      metric(o, f.name, "counter", f.help);
      for (const auto& [name, k] : m.by_key) {
        value(o, std::string(f.name) + "{key=\"" + label(name) + "\"}",
              static_cast<double>(k.*(f.field)));
      }
    }
  }
  metric(o, "d2o_engine_steps_total", "counter", "Batched engine steps.");
  value(o, "d2o_engine_steps_total", static_cast<double>(m.steps));
  metric(o, "d2o_sessions_evicted_total", "counter", "Idle sessions dropped to make room.");
  value(o, "d2o_sessions_evicted_total", static_cast<double>(m.sessions_evicted));
  metric(
      o, "d2o_sessions_written_out_total", "counter",
      "Of the idle sessions dropped to make room, those whose file was written (--session-dir).");
  value(o, "d2o_sessions_written_out_total", static_cast<double>(m.sessions_written_out));
  metric(o, "d2o_session_compress_steps_total", "counter",
         "Compression steps of idle sessions to make room (--compress when-needed): each halves "
         "what a session's layers hold, down to its policy's budgets.");
  value(o, "d2o_session_compress_steps_total", static_cast<double>(m.session_compress_steps));
  metric(o, "d2o_session_compress_freed_bytes_total", "counter",
         "KV bytes those compression steps gave back to the pool.");
  value(o, "d2o_session_compress_freed_bytes_total", static_cast<double>(m.session_compress_freed));
  metric(o, "d2o_session_rebuilds_total", "counter",
         "Sessions built again from their messages (nothing kept used), by reason.");
  for (const char* k : kSessionRebuildReasons) {
    auto it = m.session_rebuilds.find(k);
    value(o, std::string("d2o_session_rebuilds_total{reason=\"") + k + "\"}",
          it == m.session_rebuilds.end() ? 0.0 : static_cast<double>(it->second));
  }
  metric(o, "d2o_session_truncations_total", "counter",
         "Sessions cut back to the prefix their new messages share with them (not rebuilt).");
  value(o, "d2o_session_truncations_total", static_cast<double>(m.session_truncations));
  metric(o, "d2o_session_truncation_kept_tokens_total", "counter",
         "Tokens those cuts kept (not prefilled again).");
  value(o, "d2o_session_truncation_kept_tokens_total",
        static_cast<double>(m.session_truncation_kept_tokens));
  metric(o, "d2o_session_truncation_dropped_tokens_total", "counter",
         "Kept tokens those cuts let go (past the common prefix).");
  value(o, "d2o_session_truncation_dropped_tokens_total",
        static_cast<double>(m.session_truncation_dropped_tokens));
  metric(o, "d2o_sessions_saved_total", "counter", "Session files written (--session-dir).");
  value(o, "d2o_sessions_saved_total", static_cast<double>(m.sessions_saved));
  metric(o, "d2o_sessions_loaded_total", "counter", "Sessions read back from their files.");
  value(o, "d2o_sessions_loaded_total", static_cast<double>(m.sessions_loaded));
  metric(o, "d2o_session_file_errors_total", "counter",
         "Session files that could not be written, or were refused when read.");
  value(o, "d2o_session_file_errors_total", static_cast<double>(m.session_file_errors));
  metric(o, "d2o_session_save_failures_total", "counter",
         "Session files that could not be written (the session stays in memory, or is rebuilt "
         "if it had to leave).");
  value(o, "d2o_session_save_failures_total", static_cast<double>(m.session_save_failures));
  metric(o, "d2o_session_save_seconds_total", "counter", "Seconds spent writing session files.");
  value(o, "d2o_session_save_seconds_total", m.session_save_seconds);
  metric(o, "d2o_session_load_seconds_total", "counter",
         "Seconds spent reading session files (read and checked).");
  value(o, "d2o_session_load_seconds_total", m.session_load_seconds);
  metric(o, "d2o_session_dir_bytes", "gauge", "Bytes the session files hold (--session-dir).");
  value(o, "d2o_session_dir_bytes", static_cast<double>(m.session_dir_bytes));
  metric(o, "d2o_session_files_removed_total", "counter",
         "Least recently used session files removed to keep --session-dir-max.");
  value(o, "d2o_session_files_removed_total", static_cast<double>(m.session_files_removed));
  connection_metrics(o, m.connections);
  metric(o, "d2o_sequences_running", "gauge", "Sequences admitted and running.");
  value(o, "d2o_sequences_running", static_cast<double>(m.running));
  metric(o, "d2o_sequences_queued", "gauge", "Requests waiting for admission.");
  value(o, "d2o_sequences_queued", static_cast<double>(m.queued));
  metric(o, "d2o_sessions", "gauge", "Kept conversations.");
  value(o, "d2o_sessions", static_cast<double>(m.sessions));
  metric(o, "d2o_sessions_idle", "gauge",
         "Idle sessions in memory by stage: full (never compressed under pressure) or compressed.");
  value(o, "d2o_sessions_idle{stage=\"full\"}", static_cast<double>(m.sessions_idle_full));
  value(o, "d2o_sessions_idle{stage=\"compressed\"}",
        static_cast<double>(m.sessions_idle_compressed));
  metric(o, "d2o_kv_cap_bytes", "gauge", "KV memory cap (--kv-mem).");
  value(o, "d2o_kv_cap_bytes", static_cast<double>(m.kv_cap));
  metric(o, "d2o_kv_reserved_bytes", "gauge",
         "KV bytes reserved: running requests' peak footprints and idle sessions' caches.");
  value(o, "d2o_kv_reserved_bytes", static_cast<double>(m.kv_reserved));
  metric(o, "d2o_kv_allocated_bytes", "gauge",
         "KV bytes allocated: running caches and idle sessions' caches.");
  value(o, "d2o_kv_allocated_bytes", static_cast<double>(m.kv_allocated + m.session_bytes));
  metric(o, "d2o_kv_session_bytes", "gauge", "KV bytes held by idle sessions.");
  value(o, "d2o_kv_session_bytes", static_cast<double>(m.session_bytes));
  const size_t used = m.kv_allocated + m.session_bytes;
  metric(o, "d2o_kv_saved_bytes", "gauge",
         "KV bytes saved against full caches of the same tokens (running and idle).");
  value(o, "d2o_kv_saved_bytes",
        static_cast<double>(m.full_equivalent > used ? m.full_equivalent - used : 0));
  return o;
}

}  // namespace d2o::serve
