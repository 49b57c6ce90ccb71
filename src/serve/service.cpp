#include "serve/service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "kv/cold_tier.h"
#include "serve/api_keys.h"

namespace d2o::serve {

namespace {

ApiError engine_error(const Status& s) {
  ApiError e;
  e.message = s.message();
  if (s.code() == StatusCode::kInvalidArgument) {
    e.code = s.message().find("context") != std::string::npos ? "context_length_exceeded"
                                                              : "invalid_value";
    return e;
  }
  if (s.code() == StatusCode::kResourceExhausted) {  // can never fit under the cap
    e.code = "kv_memory_exceeded";
    return e;
  }
  e.http_status = 500;
  e.type = "server_error";
  e.code = "internal_error";
  return e;
}

}  // namespace

Result<std::unique_ptr<Service>> Service::create(Engine& engine, const Tokenizer& tok,
                                                 const ServiceParams& params) {
  if (params.max_queue < 1) return invalid_argument("the request queue must hold at least 1");
  auto pol = parse_kv_policy(params.default_kv);
  if (!pol.ok()) return pol.status().with_context("--kv");
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> sched,
                       Scheduler::create(engine, params.scheduler));
  std::optional<SessionDir> dir;
  if (!params.session_dir.empty()) {
    const ModelHParams& hp = engine.model().hparams();
    SessionFileContext ctx;
    ctx.model = params.model_identity;
    ctx.cache = kv_cache_config(hp, params.scheduler.kv_type);
    ctx.n_vocab = hp.n_vocab;
    ctx.max_positions =
        params.scheduler.max_positions > 0 ? params.scheduler.max_positions : hp.n_ctx_train;
    D2O_ASSIGN_OR_RETURN(SessionDir d,
                         SessionDir::open(params.session_dir, ctx, params.session_dir_max));
    if (d.strays_removed() > 0)
      std::fprintf(stderr, "d2o serve: removed %lld unfinished session file(s) from %s\n",
                   static_cast<long long>(d.strays_removed()), params.session_dir.c_str());
    dir.emplace(std::move(d));
  }
  return std::unique_ptr<Service>(
      new Service(engine, tok, params, std::move(sched), std::move(dir)));
}

Service::Service(Engine& engine, const Tokenizer& tok, const ServiceParams& params,
                 std::unique_ptr<Scheduler> sched, std::optional<SessionDir> dir)
    : engine_(engine),
      tok_(tok),
      params_(params),
      sched_(std::move(sched)),
      dir_(std::move(dir)),
      sessions_(*sched_) {
  if (dir_) sessions_.set_dir(&*dir_, params.save_every_turn);
  sessions_.set_compress(params.compress);
  metrics_.kv_cap = params.scheduler.kv_mem_bytes;
  counters_.kv_cap = params.scheduler.kv_mem_bytes;
  for (const std::string& name : params.key_names) {
    counters_.by_key[name];
    metrics_.by_key[name];
  }
  thread_ = std::thread([this] { loop(); });
}

Service::~Service() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::optional<ApiError> Service::submit(std::shared_ptr<Job> job) {
  std::lock_guard<std::mutex> lock(mu_);
  ApiError busy;
  busy.http_status = 503;
  busy.type = "server_error";
  if (stop_) {
    busy.message = "the server is shutting down";
    busy.code = "shutting_down";
    return busy;
  }
  if (inbox_.size() + waiting_ >= params_.max_queue) {
    busy.message = "the server is busy: " + std::to_string(params_.max_queue) +
                   " requests are already waiting; retry later";
    busy.code = "queue_full";
    return busy;
  }
  inbox_.push_back(std::move(job));
  cv_.notify_all();
  return std::nullopt;
}

bool Service::wait_events(Job& job, std::string& text, int timeout_ms) {
  std::unique_lock<std::mutex> lock(job.mu);
  job.cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                  [&] { return job.done || !job.text.empty(); });
  text = std::move(job.text);
  job.text.clear();
  return job.done && job.text.empty();
}

bool Service::wait_events(Job& job, std::string& text, std::vector<TokenLogprob>& lps,
                          int timeout_ms) {
  std::unique_lock<std::mutex> lock(job.mu);
  job.cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                  [&] { return job.done || !job.text.empty() || !job.lps.empty(); });
  text = std::move(job.text);
  job.text.clear();
  lps = std::move(job.lps);
  job.lps.clear();
  return job.done;
}

void Service::fail_job(Job& job, ApiError e) {
  if (!job.session.empty()) {
    if (Session* s = sessions_.find(job.store_id); s && s->busy) sessions_.drop(job.store_id);
  }
  count_job(job, e.http_status >= 500 ? "error" : "invalid");
  publish_metrics();
  {
    std::lock_guard<std::mutex> lock(job.mu);
    job.error = std::move(e);
  }
  release(job);
}

void Service::count_job(const Job& job, const char* outcome) {
  ++counters_.requests[outcome];
  if (job.key_counts) ++job.key_counts->requests[outcome];
}

// Counted and published before the job is marked done: a client that reads /metrics after its
// answer sees its request there.
void Service::release(Job& job) {
  {
    std::lock_guard<std::mutex> lock(job.mu);
    job.done = true;
  }
  job.cv.notify_all();
}

void Service::start_job(const std::shared_ptr<Job>& job) {
  Request req;
  req.max_new_tokens = job->max_tokens;
  req.sampling = job->sampling;
  req.kv_spec = job->kv_spec;
  req.stop_at_eog = !job->ignore_eos;
  req.logprobs = job->logprobs;
  req.prompt_logprobs = job->prompt_logprobs;
  req.context_end = job->context_end;
  // context_end asks for the context to be compressed at its end: such a request never defers.
  req.defer_compaction = params_.compress == CompressWhen::kWhenNeeded && job->context_end == 0;
  job->out.emplace(tok_, job->stops);
  job->completion.usage.prompt_tokens = static_cast<int>(job->prompt.size());
  if (!job->key_name.empty()) job->key_counts = &counters_.by_key[job->key_name];
  size_t skip = 0;
  if (!job->session.empty()) {
    // Looked up in the namespace of the request's key: another key's session of the same id is,
    // for this one, an id never used (the same code runs, so the answer cannot tell them apart).
    job->store_id = scoped_session_id(job->key_name, job->session);
    Session* existing = sessions_.find(job->store_id);
    if (existing && existing->busy) {
      ApiError e;
      e.http_status = 409;
      e.code = "session_busy";
      e.param = "session";
      e.message = "session '" + job->session + "' is answering another request; wait for it";
      count_job(*job, "invalid");
      publish_metrics();
      {
        std::lock_guard<std::mutex> lock(job->mu);
        job->error = std::move(e);
      }
      release(*job);
      return;
    }
    // Not in memory: its file, if it has one (read before begin(), which creates it). A session
    // that had to leave memory while its file could not be written is rebuilt, unless an
    // earlier state in its file continues it.
    const bool lost = sessions_.take_lost(job->store_id);
    const bool refused = !existing && dir_ && !restore_session(job->store_id, job->kv_spec);
    Session& s = sessions_.begin(job->store_id);
    SessionInfo info;
    info.id = job->session;
    // Under the same policy, the kept conversation goes on from the tokens it shares with the
    // new prompt: all of them when the prompt extends it; else, like a prompt cache, the longest
    // common prefix its cache still holds as a fresh prefill would (Sequence::reusable_prefix),
    // the rest cut off. The prompt's last token is always fed: its logits begin the answer.
    auto canonical = parse_kv_policy(job->kv_spec);
    const std::string spec = canonical.ok() ? (*canonical)->spec() : job->kv_spec;
    int64_t kept = -1;  // kept tokens the request goes on from; -1: built again
    const char* reason = refused ? "file" : lost ? "lost" : nullptr;  // why it is rebuilt
    if (s.seq && s.kv_spec != spec) {
      reason = "policy";
    } else if (s.seq && !job->prompt.empty()) {
      const size_t most = std::min(s.tokens.size(), job->prompt.size() - 1);
      const size_t common = static_cast<size_t>(
          std::mismatch(s.tokens.begin(), s.tokens.begin() + static_cast<ptrdiff_t>(most),
                        job->prompt.begin())
              .first -
          s.tokens.begin());
      if (common == s.tokens.size()) {
        kept = static_cast<int64_t>(common);
      } else if (common == 0) {
        reason = "no_common_prefix";
      } else if (s.seq->cut_back_refusal()) {
        reason = "recurrent_state";  // a recurrent state cannot be rewound: built again
      } else if (const int64_t p = s.seq->reusable_prefix(static_cast<int64_t>(common));
                 p > 0 && s.seq->truncate(p).ok()) {
        kept = p;
        info.truncated = true;
        info.dropped_tokens = std::ssize(s.tokens) - p;
        ++counters_.session_truncations;
        counters_.session_truncation_kept_tokens += p;
        counters_.session_truncation_dropped_tokens += info.dropped_tokens;
        s.tokens.resize(static_cast<size_t>(p));
      } else {
        reason = "prefix_not_held";
      }
    }
    if (kept >= 0) {
      skip = static_cast<size_t>(kept);
      req.resume = sessions_.take(s, req.resume_held);
      // Should nothing else free the memory the queue waits for, it may be fed again whole.
      req.rebuild_prompt = job->prompt;
    } else {
      info.rebuilt = s.seq != nullptr || refused || lost;
      info.dropped_tokens = std::ssize(s.tokens);
      if (info.rebuilt) ++counters_.session_rebuilds[reason ? reason : "no_common_prefix"];
      sessions_.clear(s);
    }
    req.keep_sequence = true;
    job->completion.session = info;
  }
  job->n_cached = static_cast<int>(skip);
  job->completion.usage.cached_tokens = job->n_cached;
  req.prompt.assign(job->prompt.begin() + static_cast<ptrdiff_t>(skip), job->prompt.end());
  Job* raw = job.get();
  req.on_token = [this, raw](TokenId t) { return on_token(*raw, t); };
  if (job->stream_logprobs) {
    // Chat answers list only the tokens of the message (as OpenAI's do), not the
    // end-of-generation token that ended it; completions list it (a prompt scored with
    // max_tokens 1 then always has one value after it).
    const bool chat = job->completion.endpoint == Endpoint::kChat && !job->ignore_eos;
    req.on_logprob = [this, raw, chat](const TokenLogprob& lp) {
      if (chat && tok_.is_eog(lp.token)) return;
      std::lock_guard<std::mutex> lock(raw->mu);
      raw->lps.push_back(lp);
    };
  }
  const size_t held = req.resume_held;
  auto id = sched_->submit(std::move(req));
  if (!id.ok()) {
    if (held > 0) sched_->release_held(held);  // a failed submit leaves them with us
    fail_job(*job, engine_error(id.status()));
    return;
  }
  job->id = *id;
  job->submitted = true;
  active_[job->id] = job;
  counters_.prompt_tokens += static_cast<int64_t>(job->prompt.size());
  counters_.prefilled_tokens += static_cast<int64_t>(job->prompt.size() - skip);
  if (job->key_counts) {
    job->key_counts->prompt_tokens += static_cast<int64_t>(job->prompt.size());
    job->key_counts->prefilled_tokens += static_cast<int64_t>(job->prompt.size() - skip);
  }
}

bool Service::restore_session(const std::string& id, const std::string& kv_spec) {
  SessionFileStats& files = sessions_.file_stats();
  const auto t0 = std::chrono::steady_clock::now();
  auto loaded = dir_->load(id);
  files.load_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!loaded.ok()) {
    ++files.errors;
    std::fprintf(stderr, "d2o serve: session '%s': its file is refused (%s); rebuilding it\n",
                 id.c_str(), loaded.status().message().c_str());
    return false;
  }
  if (!*loaded) return true;
  SessionData& d = **loaded;
  // The sequence must run with the policy object the scheduler gives this job's spec (as the
  // job spells it); a session saved under another policy is rebuilt, as in memory.
  auto pol = sched_->policy(kv_spec);
  if (!pol.ok() || (*pol)->spec() != d.kv_spec) return false;
  auto seq = std::make_shared<Sequence>(engine_.model().hparams(), params_.scheduler.kv_type,
                                        *pol);
  seq->cache() = std::move(*d.cache);
  seq->policy_state() = std::move(d.state);
  seq->advance(d.n_past);
  if (!sessions_.adopt(id, std::move(seq), std::move(d.tokens), d.kv_spec)) {
    std::fprintf(stderr, "d2o serve: session '%s': no room under --kv-mem to read it back; "
                 "rebuilding it\n", id.c_str());
    return false;
  }
  ++files.loaded;
  return true;
}

bool Service::on_token(Job& job, TokenId t) {
  ++counters_.generated_tokens;
  if (job.key_counts) ++job.key_counts->generated_tokens;
  ++job.n_generated;
  std::string delta = job.out->push(t);
  if (!delta.empty()) {
    {
      std::lock_guard<std::mutex> lock(job.mu);
      job.text += delta;
    }
    job.cv.notify_all();
  }
  return !job.out->stopped() && !job.cancel.load();
}

void Service::finish_job(Job& job, RequestResult& r) {
  // Filled here, published under job.mu (the handler reads them once the job is done).
  std::optional<SessionInfo> session = job.completion.session;
  std::string finish_reason;
  ++counters_.by_policy[r.kv_spec];
  std::string tail;
  std::optional<ApiError> error;
  if (r.stop_reason == "eog" || r.stop_reason == "length") {
    tail = job.out->flush();
    finish_reason = r.stop_reason == "eog" ? "stop" : "length";
  } else if (r.stop_reason == "stopped" && job.out->stopped()) {
    finish_reason = "stop";
  } else if (r.stop_reason == "stopped" || r.stop_reason == "cancelled") {
    ApiError e;
    e.http_status = 499;
    e.code = "cancelled";
    e.message = "the request was cancelled (the client went away)";
    error = e;
  } else {  // refused or error
    error = engine_error(r.status);
  }
  if (!job.session.empty()) {
    if (r.resume_given_up && session) {  // it gave its conversation up while it waited
      session->rebuilt = true;
      ++counters_.session_rebuilds["pressure"];
    }
    if (r.sequence && !error) {
      if (ColdTier* cold = r.sequence->cache().cold()) {
        const ColdTier::Counts c = cold->take_unreported();
        counters_.cold_recall_turns += c.turns;
        counters_.cold_recalled_slots += c.slots;
        counters_.cold_recall_seconds += c.seconds;
      }
      const int64_t n_past = r.sequence->n_past();
      std::vector<TokenId> seen = job.prompt;
      seen.insert(seen.end(), r.tokens.begin(), r.tokens.end());
      seen.resize(static_cast<size_t>(std::min<int64_t>(n_past, std::ssize(seen))));
      SessionInfo& info = *session;
      info.n_past = n_past;
      const KvCache& kv = r.sequence->cache();
      info.full_kv_bytes = kv.full_kv_bytes(n_past);
      sessions_.end(job.store_id, std::move(r.sequence), std::move(seen), r.kv_spec);
      const Session* s = sessions_.find(job.store_id);
      info.kv_bytes = s && s->seq ? s->seq->cache().kv_bytes_allocated() : 0;
    } else {
      sessions_.drop(job.store_id);
    }
  }
  if (error) {
    const char* outcome = error->code == "cancelled"  ? "cancelled"
                          : error->http_status >= 500 ? "error"
                                                      : "invalid";
    count_job(job, outcome);
    std::lock_guard<std::mutex> lock(job.mu);
    job.error = std::move(error);
    return;
  }
  count_job(job, "ok");
  std::lock_guard<std::mutex> lock(job.mu);
  job.text += tail;
  job.completion.finish_reason = std::move(finish_reason);
  job.completion.usage.completion_tokens = static_cast<int>(r.tokens.size());
  if (r.resume_given_up) {
    job.n_cached = 0;
    job.completion.usage.cached_tokens = 0;
  }
  job.completion.lps = std::move(r.logprobs);
  if (job.completion.endpoint == Endpoint::kChat && r.stop_reason == "eog" &&
      job.completion.lps.size() > r.tokens.size())
    job.completion.lps.pop_back();  // the end-of-generation token (see start_job)
  job.completion.prompt_lps = std::move(r.prompt_logprobs);
  job.completion.session = std::move(session);
}

void Service::publish_metrics() {
  counters_.running = static_cast<int64_t>(sched_->n_running());
  counters_.queued = static_cast<int64_t>(sched_->n_waiting());
  counters_.sessions = static_cast<int64_t>(sessions_.n_sessions());
  counters_.sessions_evicted = sessions_.n_evicted();
  const SessionPressureStats pressure = sessions_.pressure_stats();
  counters_.session_compress_steps = pressure.compress_steps;
  counters_.session_compress_freed = pressure.compress_freed;
  counters_.sessions_written_out = pressure.written_out;
  counters_.sessions_idle_full = pressure.idle_full;
  counters_.sessions_idle_compressed = pressure.idle_compressed;
  const SessionFileStats& files = sessions_.file_stats();
  counters_.sessions_saved = files.saved;
  counters_.sessions_loaded = files.loaded;
  counters_.session_file_errors = files.errors;
  counters_.session_save_failures = files.save_failures;
  counters_.session_save_seconds = files.save_seconds;
  counters_.session_load_seconds = files.load_seconds;
  if (const SessionDir* d = sessions_.dir()) {
    counters_.session_dir_bytes = d->bytes_held();
    counters_.session_files_removed = d->files_removed();
  }
  counters_.kv_reserved = sched_->pool().reserved();
  counters_.kv_allocated = sched_->kv_allocated();
  counters_.session_bytes = sessions_.held_bytes();
  counters_.cold_bytes = sessions_.cold_bytes();
  // Full caches of the same tokens: idle sessions, and each running job's tokens so far.
  size_t full = sessions_.full_equivalent_bytes();
  const KvCacheConfig cfg = kv_cache_config(engine_.model().hparams(), params_.scheduler.kv_type);
  for (const auto& [id, job] : active_) {
    full += KvCache::bytes_for_slots(cfg, std::ssize(job->prompt) + job->n_generated);
  }
  counters_.full_equivalent = full;
  std::lock_guard<std::mutex> lock(metrics_mu_);
  Metrics m = counters_;
  for (auto& [k, v] : extern_requests_) m.requests[k] += v;
  for (auto& [name, outcomes] : extern_by_key_) {
    for (auto& [k, v] : outcomes) m.by_key[name].requests[k] += v;
  }
  metrics_ = std::move(m);
}

Metrics Service::metrics() const {
  std::lock_guard<std::mutex> lock(metrics_mu_);
  return metrics_;
}

void Service::count_outcome(const std::string& outcome, const std::string& key_name) {
  std::lock_guard<std::mutex> lock(metrics_mu_);
  ++extern_requests_[outcome];
  ++metrics_.requests[outcome];
  if (!key_name.empty()) {
    ++extern_by_key_[key_name][outcome];
    ++metrics_.by_key[key_name].requests[outcome];
  }
}

void Service::loop() {
  std::vector<std::shared_ptr<Job>> fresh;
  std::vector<std::shared_ptr<Job>> ended;  // finished this step, released once counted
  while (true) {
    bool exiting = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !inbox_.empty() || !sched_->idle(); });
      exiting = stop_ && active_.empty() && inbox_.empty();
      fresh.assign(inbox_.begin(), inbox_.end());
      inbox_.clear();
      // They wait in the scheduler's queue now: counted there until the step recounts, so that
      // submit() never sees them in neither place and lets the queue grow past its bound.
      waiting_ += fresh.size();
    }
    if (exiting) {
      if (dir_) {  // the idle sessions whose files are not current yet
        const int n = sessions_.save_all();
        std::fprintf(stderr, "d2o serve: sessions saved to %s (%d written at exit)\n",
                     dir_->dir().c_str(), n);
      }
      break;
    }
    for (const auto& job : fresh) start_job(job);
    fresh.clear();
    for (const auto& [id, job] : active_) {
      if (job->cancel.load()) sched_->cancel(id);
    }
    // Idle sessions give way to the request at the head of the queue. Under --compress
    // when-needed so do the conversations that requests behind it continue, compressed (they
    // wait holding their bytes; a client's next turn usually takes its session back before an
    // idle moment).
    if (const size_t need = sched_->head_needs(); need > 0) {
      if (params_.compress == CompressWhen::kWhenNeeded) {
        sessions_.compress_for(need);  // idle sessions first, least recently used first
        if (sched_->pool().available() < need)
          sessions_.count_steps(sched_->compress_waiting(need));
      }
      sessions_.make_room(need);
      // Nothing runs and nothing else freed enough: the conversations of the requests behind
      // the head hold what it waits for; they give them up and are fed again whole.
      if (sched_->pool().available() < need) sched_->give_up_waiting(need);
    }
    if (!sched_->idle()) {
      (void)sched_->step();  // an engine error ends the batch's requests with it (below)
      ++counters_.steps;
      stepped_ = true;
    }
    for (RequestResult& r : sched_->take_finished()) {
      auto it = active_.find(r.id);
      if (it == active_.end()) continue;
      ended.push_back(std::move(it->second));
      active_.erase(it);
      finish_job(*ended.back(), r);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_ = sched_->n_waiting();
    }
    if (stepped_ && sched_->idle()) {
      stepped_ = false;
      if (params_.on_drained) params_.on_drained();
    }
    publish_metrics();
    for (const auto& job : ended) release(*job);  // the answers go out with their counts shown
    ended.clear();
    // After the answers are out; the counters then show the writes (and failed ones).
    if (sessions_.save_pending() > 0) publish_metrics();
  }
}

}  // namespace d2o::serve
