// The serving core: one engine thread runs the Scheduler (continuous batching under the KV cap)
// for every HTTP handler thread. A handler renders and tokenizes its request into a Job, hands it
// over with submit(), and waits on the Job for text (wait_events()); the engine thread admits
// jobs, steps all running sequences together, appends each new token's text to its Job, and
// finishes it with a Completion or an ApiError.
//
//   handler threads --submit(Job)--> inbox --engine thread--> Scheduler::submit / step
//          ^                                        |  on_token: TextOutput -> Job::text
//          +-------- Job (mutex + condvar) <--------+  take_finished: Job::done
//
// Bounded: more than max_queue jobs waiting (inbox + scheduler queue) is refused (503). A job
// whose client went away (Job::cancel) is cancelled at the start of the next step, freeing its
// sequence and reservation. Sessions (serve/sessions.h) live on the engine thread; with a session
// directory, a request naming a session that is not in memory reads it from its file, and the
// engine thread writes the idle sessions when it stops.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/scheduler.h"
#include "runtime/tokenizer.h"
#include "serve/api.h"
#include "serve/format.h"
#include "serve/metrics.h"
#include "serve/sessions.h"
#include "serve/text_output.h"

namespace d2o::serve {

struct Job {
  // Set by the handler before submit().
  std::vector<TokenId> prompt;  // the whole rendered prompt (with a session: the conversation)
  int max_tokens = 1;
  SamplerParams sampling;
  std::string kv_spec;  // the policy (the server's --kv when the request names none)
  std::vector<std::string> stops;
  std::string session;
  // The name of the API key the request came with ("" on a server without keys): its session
  // is looked up in that name's namespace (scoped_session_id, serve/api_keys.h), and /metrics
  // counts its requests and tokens under the name.
  std::string key_name;
  bool ignore_eos = false;  // true: only max_tokens, stop strings and a cancel end the answer
  int logprobs = -1;        // Request::logprobs
  bool prompt_logprobs = false;  // Request::prompt_logprobs (echo with logprobs)
  int64_t context_end = 0;       // Request::context_end
  bool stream_logprobs = false;  // streamed: each token's log-probabilities go to `lps` too
  Completion completion;    // id, created, model, endpoint; the rest is filled at the end

  // Set by the handler: the client is gone (checked before every step).
  std::atomic<bool> cancel{false};

  // Shared, under mu: text not yet taken by the handler; the end.
  std::mutex mu;
  std::condition_variable cv;
  std::string text;
  std::vector<TokenLogprob> lps;  // stream_logprobs: not yet taken by the handler
  bool done = false;
  std::optional<ApiError> error;

  // Engine thread only.
  RequestId id = 0;
  std::string store_id;              // the session as kept: scoped_session_id(key_name, session)
  KeyMetrics* key_counts = nullptr;  // the key name's counters (null without a name)
  std::optional<TextOutput> out;
  int n_cached = 0;     // prompt tokens taken from the session
  int n_generated = 0;  // tokens generated so far
  bool submitted = false;
};

struct ServiceParams {
  SchedulerParams scheduler;  // cap, max running, context (max_positions), EOG tokens
  size_t max_queue = 64;      // jobs waiting for admission before 503
  std::string default_kv;     // policy when a request names none
  // Sessions written to files (serve/session_dir.h) in this directory; "": memory only.
  std::string session_dir;
  uint64_t session_dir_max = 0;  // --session-dir-max: the most its files hold (0: no bound)
  // When sessions are compressed (serve/sessions.h): by their policy after every pass, or only
  // under memory pressure (then requests run with their compactions deferred).
  CompressWhen compress = CompressWhen::kAlways;
  bool save_every_turn = true;  // write a session when each request ends (else: on eviction
                                // and at shutdown only)
  ModelIdentity model_identity;  // what session files are checked against
  // Called on the engine thread each time the last running or waiting request has ended (the
  // answers are out, before the metrics say so). `d2o serve` hands the memory the requests
  // freed back to the system there (malloc_trim), or the resident set would stay at the peak.
  std::function<void()> on_drained;
  // The API keys' names: /metrics counts requests and tokens per name, every name listed from
  // the start (a job's key_name outside the list is counted under it from its first request).
  std::vector<std::string> key_names;
};

class Service {
 public:
  static Result<std::unique_ptr<Service>> create(Engine& engine, const Tokenizer& tok,
                                                 const ServiceParams& params);
  ~Service();  // stops the engine thread (jobs still waiting end with an error)
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Hands a job to the engine thread. Errors: the queue is full (503, the caller adds
  // Retry-After) or the service is stopping (503).
  std::optional<ApiError> submit(std::shared_ptr<Job> job);

  // Waits until the job has new text or is done (or `timeout_ms` passed); moves the new text
  // into `text`. Returns true when the job is done (its error or completion final).
  static bool wait_events(Job& job, std::string& text, int timeout_ms);
  // The same, also moving the new tokens' log-probabilities (Job::stream_logprobs) into `lps`.
  static bool wait_events(Job& job, std::string& text, std::vector<TokenLogprob>& lps,
                          int timeout_ms);

  Metrics metrics() const;
  // Counts a request that never reached the engine (invalid, rejected) for /metrics, also under
  // `key_name` when it is not empty.
  void count_outcome(const std::string& outcome, const std::string& key_name = "");

  const SchedulerParams& scheduler_params() const { return params_.scheduler; }
  // The session directory (null without one); tests make its writes fail through it.
  const SessionDir* session_dir() const { return dir_ ? &*dir_ : nullptr; }

 private:
  Service(Engine& engine, const Tokenizer& tok, const ServiceParams& params,
          std::unique_ptr<Scheduler> sched, std::optional<SessionDir> dir);
  void loop();
  void start_job(const std::shared_ptr<Job>& job);
  void finish_job(Job& job, RequestResult& r);
  void fail_job(Job& job, ApiError e);
  bool on_token(Job& job, TokenId t);
  // Counts a job's outcome (ok, cancelled, invalid, error), also under its key name.
  void count_job(const Job& job, const char* outcome);
  void release(Job& job);  // marks it done and wakes its handler
  // Reads session `id` from its file into the store for a job with policy `kv_spec`. False
  // when a file exists but cannot be used (refused, another policy, no room): the job then
  // rebuilds the session. True otherwise (read, or no file).
  bool restore_session(const std::string& id, const std::string& kv_spec);
  void publish_metrics();

  Engine& engine_;
  const Tokenizer& tok_;
  ServiceParams params_;
  std::unique_ptr<Scheduler> sched_;
  std::optional<SessionDir> dir_;
  SessionStore sessions_;
  std::map<RequestId, std::shared_ptr<Job>> active_;  // submitted to the scheduler

  std::mutex mu_;  // inbox_, stop_, waiting_
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> inbox_;
  bool stop_ = false;
  size_t waiting_ = 0;  // scheduler queue length after the last step
  bool stepped_ = false;  // engine thread: a step ran since on_drained was last called

  mutable std::mutex metrics_mu_;
  Metrics metrics_;
  Metrics counters_;  // engine thread's running counters (copied into metrics_)
  std::map<std::string, int64_t> extern_requests_;  // handler-side outcomes (under metrics_mu_)
  std::map<std::string, std::map<std::string, int64_t>> extern_by_key_;  // the same per key name
  std::thread thread_;
};

}  // namespace d2o::serve
