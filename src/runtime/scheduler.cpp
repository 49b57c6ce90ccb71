#include "runtime/scheduler.h"

#include <algorithm>
#include <limits>

#include "core/assert.h"
#include "core/timer.h"

namespace d2o {

// A request from submission to its end.
struct Scheduler::Active {
  RequestId id = 0;
  Request req;
  std::shared_ptr<const KvPolicy> policy;
  Footprint fp;
  std::vector<int> chunks;  // how the prompt is cut into passes
  size_t next_chunk = 0;
  int64_t prefilled = 0;          // prompt tokens fed so far
  std::shared_ptr<Sequence> seq;  // created (or taken from Request::resume) at admission
  std::vector<TokenId> history;   // prompt + generated (repetition penalty; the token to feed)
  uint64_t rng = 0;
  bool has_next = false;  // history.back() is a generated token still to be fed
  bool sampled = false;   // the last pass produced logits for it
  TokenId sample = -1;
  TokenLogprob sample_lp;  // Request::logprobs >= 0: the sampled token's
  bool done = false;
  bool defer = false;  // compactions deferred (Request::defer_compaction, taken)
  RequestResult result;
};

Scheduler::Scheduler(Engine& engine, const SchedulerParams& params)
    : engine_(engine),
      params_(params),
      pool_(params.kv_mem_bytes),
      queue_(pool_),
      t0_ns_(now_ns()),
      sampler_(SamplerParams{}, engine.model().hparams().n_vocab) {
  const ModelHParams& h = engine.model().hparams();
  cache_cfg_ = kv_cache_config(h, params.kv_type);
  is_eog_.assign(static_cast<size_t>(h.n_vocab), 0);
  for (TokenId t : params.eog_tokens) is_eog_[static_cast<size_t>(t)] = 1;
  const size_t max_entries = static_cast<size_t>(params.max_running);
  batch_.reserve(max_entries);
  entry_owner_.reserve(max_entries);
  admitted_ids_.reserve(max_entries);
  running_.reserve(max_entries);
  sink_ = [this](int entry, int token, const float* logits) { on_logits(entry, token, logits); };
}

Scheduler::~Scheduler() = default;

Result<std::unique_ptr<Scheduler>> Scheduler::create(Engine& engine, const SchedulerParams& p) {
  if (p.kv_mem_bytes == 0) return invalid_argument("the KV memory cap must be positive");
  if (p.prefill_chunk < 1) return invalid_argument("the prefill chunk must be at least 1 token");
  if (p.max_running < 1) return invalid_argument("max running sequences must be at least 1");
  const int ub = engine.options().n_ubatch;
  if (static_cast<int64_t>(p.max_running) + p.prefill_chunk > ub) {
    return invalid_argument("the engine's micro-batch of " + std::to_string(ub) +
                            " rows cannot hold a scheduler step of " +
                            std::to_string(p.max_running) + " decode rows + a prefill chunk of " +
                            std::to_string(p.prefill_chunk) +
                            " tokens; raise --ubatch or lower the batch size or the chunk");
  }
  const int n_vocab = engine.model().hparams().n_vocab;
  for (TokenId t : p.eog_tokens) {
    if (t < 0 || t >= n_vocab) {
      return invalid_argument("end-of-generation token " + std::to_string(t) + " is out of range");
    }
  }
  return std::unique_ptr<Scheduler>(new Scheduler(engine, p));
}

double Scheduler::now() const {
  return static_cast<double>(now_ns() - t0_ns_) * 1e-9;
}

std::vector<int> Scheduler::split_prompt(int64_t n, int chunk, int min_last) {
  std::vector<int> out;
  if (n <= 0) return out;
  chunk = std::max(1, chunk);
  const int64_t n_chunks = (n + chunk - 1) / chunk;
  for (int64_t c = 0; c < n_chunks; ++c)
    out.push_back(static_cast<int>(std::min<int64_t>(chunk, n - c * chunk)));
  const int want = static_cast<int>(std::min<int64_t>(std::max(1, min_last), n));
  if (out.size() > 1 && out.back() < want) {
    const int move = std::min(want - out.back(), out[out.size() - 2] - 1);
    out[out.size() - 2] -= move;
    out.back() += move;
  }
  return out;
}

Scheduler::Footprint Scheduler::footprint(const KvCacheConfig& cfg, const KvPolicy& policy,
                                          int64_t n_prompt, int64_t n_new, int max_chunk) {
  Footprint f;
  FeedPlan plan;
  plan.n_prompt = n_prompt;
  plan.n_total = n_prompt + n_new;
  plan.prompt_chunk = std::max(1, max_chunk);
  plan.decode_chunk = 1;  // one token per step after the prompt
  plan.n_head_kv = cfg.n_head_kv;
  f.slots = std::max<int64_t>(1, policy.peak_slots_for(plan));
  f.layer_extra = policy.one_layer_extra_for(plan);
  f.bytes = KvCache::bytes_for_slots(cfg, f.slots, plan.prompt_chunk, plan.n_total) +
            KvCache::bytes_for_one_layer(cfg, f.layer_extra) +
            policy.state_bytes(cfg, f.slots + f.layer_extra) + policy.cold_bytes(cfg, plan.n_total);
  return f;
}

Scheduler::Footprint Scheduler::deferred_footprint(const KvCacheConfig& cfg, const KvPolicy& policy,
                                                   int64_t held, int64_t n_new, int64_t n_total) {
  Footprint f;
  const ColdTierConfig cold = policy.cold_tier();
  const int64_t recall = cold.enabled() ? cold.max_recall() : 0;
  f.slots = std::max<int64_t>(1, std::min(held + n_new + recall, n_total));
  f.bytes = KvCache::bytes_for_slots(cfg, f.slots) + policy.state_bytes(cfg, f.slots) +
            policy.cold_bytes(cfg, n_total);
  return f;
}

Result<bool> Scheduler::compress_step(Sequence& seq) {
  PassInfo pass;
  pass.n_tokens = 1;
  pass.n_past = seq.n_past();
  pass.rope = &engine_.rope();
  pass.pool = &engine_.pool();
  auto r = seq.policy().compress_step(seq.cache(), seq.policy_state(), pass);
  if (!r.ok() || !*r) return r;
  D2O_RETURN_IF_ERROR(seq.cache().shrink_to_fit(0));
  return true;
}

void Scheduler::choose_defer(Active& a, int64_t held_slots, int64_t n_new, int64_t n_total) {
  a.defer = false;
  if (!a.req.defer_compaction || a.policy->is_full()) return;
  // Full while it runs: its layers hold what they held and every new token.
  const Footprint full = deferred_footprint(cache_cfg_, *a.policy, held_slots, n_new, n_total);
  if (full.bytes <= pool_.cap() || a.fp.bytes > pool_.cap()) {
    a.fp = full;
    a.defer = true;
  }
}

int Scheduler::give_up_waiting(size_t bytes) {
  if (!running_.empty()) return 0;
  int n = 0;
  const std::vector<uint64_t> ids = queue_.waiting_ids();
  for (size_t i = ids.size(); i-- > 1 && pool_.available() < bytes;) {
    auto it = waiting_.find(ids[i]);
    if (it == waiting_.end()) continue;
    Active& a = *it->second;
    Request& req = a.req;
    if (!req.resume || req.rebuild_prompt.empty() || req.context_end > 0) continue;
    const int64_t n_total =
        static_cast<int64_t>(req.rebuild_prompt.size()) + int64_t{req.max_new_tokens};
    const int window = a.policy->is_full() ? 0 : a.policy->needs().window;
    std::vector<int> chunks = split_prompt(static_cast<int64_t>(req.rebuild_prompt.size()),
                                           params_.prefill_chunk, window);
    const int max_chunk = *std::max_element(chunks.begin(), chunks.end());
    Active fresh_plan;
    fresh_plan.req.defer_compaction = req.defer_compaction;
    fresh_plan.policy = a.policy;
    fresh_plan.fp =
        footprint(cache_cfg_, *a.policy, static_cast<int64_t>(req.rebuild_prompt.size()),
                  req.max_new_tokens, max_chunk);
    choose_defer(fresh_plan, 0, n_total, n_total);
    if (fresh_plan.fp.bytes > pool_.cap()) continue;  // it could never run again: keep it as is
    queue_.remove(a.id);                              // its held bytes go back to the pool
    req.resume.reset();
    req.resume_held = 0;
    req.prompt = std::move(req.rebuild_prompt);
    req.rebuild_prompt.clear();
    a.chunks = std::move(chunks);
    a.fp = fresh_plan.fp;
    a.defer = fresh_plan.defer;
    a.result.n_prompt = static_cast<int>(req.prompt.size());
    a.result.kv_slot_limit = a.fp.slots;
    a.result.resume_given_up = true;
    const Status pushed = queue_.push(a.id, a.fp.bytes, 0);
    D2O_ASSERT(pushed.ok());  // (within the cap, checked above)
    ++n;
  }
  return n;
}

Scheduler::Compressed Scheduler::compress_waiting(size_t bytes) {
  Compressed c;
  const std::vector<uint64_t> ids = queue_.waiting_ids();
  for (size_t i = ids.size(); i-- > 1 && pool_.available() < bytes;) {
    auto it = waiting_.find(ids[i]);
    if (it == waiting_.end() || !it->second->defer || !it->second->req.resume) continue;
    Active& a = *it->second;
    while (pool_.available() < bytes) {
      auto r = compress_step(*a.req.resume);
      if (!r.ok() || !*r) break;
      ++c.steps;
      const size_t now = idle_bytes(*a.req.resume);
      const size_t held = std::min(a.req.resume_held, a.fp.bytes);
      if (now >= held) break;  // (a cold tier in memory that took as much as it gave)
      queue_.give_back(a.id, held - now);
      a.req.resume_held = now;
      c.freed += held - now;
    }
  }
  return c;
}

Result<std::shared_ptr<const KvPolicy>> Scheduler::policy_for(const std::string& spec) {
  auto it = policies_.find(spec);
  if (it != policies_.end()) return it->second;
  auto parsed = parse_kv_policy(spec);
  if (!parsed.ok()) return parsed.status();
  std::shared_ptr<const KvPolicy> p(std::move(parsed).value());
  policies_.emplace(spec, p);
  return p;
}

Result<RequestId> Scheduler::submit(Request req) {
  const ModelHParams& h = engine_.model().hparams();
  if (req.prompt.empty()) return invalid_argument("the request's prompt is empty");
  if (req.max_new_tokens < 0 || (req.max_new_tokens == 0 && !req.prompt_logprobs))
    return invalid_argument("a request must generate at least 1 token");
  if (req.logprobs > kMaxTopLogprobs) {
    return invalid_argument("at most " + std::to_string(kMaxTopLogprobs) +
                            " alternatives per token can be asked for");
  }
  if (req.context_end < 0 || req.context_end >= static_cast<int64_t>(req.prompt.size()))
    return invalid_argument("the context's end must lie inside the prompt");
  for (TokenId t : req.prompt) {
    if (t < 0 || t >= h.n_vocab) {
      return invalid_argument("prompt token id " + std::to_string(t) +
                              " is out of range (vocabulary size " + std::to_string(h.n_vocab) +
                              ")");
    }
  }
  D2O_RETURN_IF_ERROR(req.sampling.validate());
  const int64_t n_prompt = static_cast<int64_t>(req.prompt.size());
  // A continued conversation: its tokens so far come first (positions, and the footprint, which
  // is bounded as if the whole conversation were the prompt).
  const int64_t n_prior = req.resume ? req.resume->n_past() : 0;
  const int64_t n_total = n_prior + n_prompt + req.max_new_tokens;
  if (params_.max_positions > 0 && n_total > params_.max_positions) {
    return invalid_argument(
        (n_prior > 0 ? std::to_string(n_prior) + " tokens already in the conversation + " : "") +
        "prompt (" + std::to_string(n_prompt) + " tokens) + max new tokens (" +
        std::to_string(req.max_new_tokens) + ") exceed the context of " +
        std::to_string(params_.max_positions) + " tokens");
  }
  if (n_total > std::numeric_limits<int32_t>::max() / 2)
    return invalid_argument("the request is too long");
  auto pol = policy_for(req.kv_spec);
  if (!pol.ok()) return pol.status().with_context("KV policy of the request");
  auto a = std::make_unique<Active>();
  a->policy = *pol;
  if (req.resume && &req.resume->policy() != a->policy.get()) {
    return invalid_argument("the conversation to continue uses KV policy " +
                            req.resume->policy().spec() + ", the request " + a->policy->spec());
  }
  const int window = a->policy->is_full() ? 0 : a->policy->needs().window;
  if (window > params_.prefill_chunk) {
    return invalid_argument("the KV policy's observation window of " + std::to_string(window) +
                            " tokens is longer than the prefill chunk of " +
                            std::to_string(params_.prefill_chunk) + "; use a larger chunk");
  }
  a->chunks =
      split_prompt(req.context_end > 0 ? req.context_end : n_prompt, params_.prefill_chunk, window);
  if (req.context_end > 0) {  // the rest, a prompt of its own
    for (int c : split_prompt(n_prompt - req.context_end, params_.prefill_chunk, window))
      a->chunks.push_back(c);
  }
  const int max_chunk = *std::max_element(a->chunks.begin(), a->chunks.end());
  a->fp = footprint(cache_cfg_, *a->policy, n_prior + n_prompt, req.max_new_tokens, max_chunk);
  if (req.resume) {
    // Its layers hold up to their slots or their budget (decided by an earlier request, possibly
    // above what this request's bound assumes), and take one more pass before a compaction.
    int64_t held_slots = 0;
    for (int il = 0; il < cache_cfg_.n_layer; ++il)
      held_slots = std::max<int64_t>(held_slots, req.resume->cache().layer(il).n_slot());
    for (int b : req.resume->policy_state().budgets) held_slots = std::max<int64_t>(held_slots, b);
    held_slots = std::min(held_slots + max_chunk, n_total);
    if (held_slots > a->fp.slots) {
      a->fp.slots = held_slots;
      a->fp.bytes = KvCache::bytes_for_slots(cache_cfg_, held_slots) +
                    KvCache::bytes_for_one_layer(cache_cfg_, a->fp.layer_extra) +
                    a->policy->state_bytes(cache_cfg_, held_slots + a->fp.layer_extra) +
                    a->policy->cold_bytes(cache_cfg_, n_total);
    }
  }
  a->req.defer_compaction = req.defer_compaction;
  int64_t held_slots = 0;
  for (int il = 0; req.resume && il < cache_cfg_.n_layer; ++il)
    held_slots = std::max<int64_t>(held_slots, req.resume->cache().layer(il).n_slot());
  choose_defer(*a, held_slots, n_prompt + req.max_new_tokens, n_total);
  const size_t held = std::min(req.resume_held, a->fp.bytes);
  if (a->fp.slots + a->fp.layer_extra > std::numeric_limits<int>::max())
    return invalid_argument("the request is too long");

  a->id = next_id_++;
  RequestResult& r = a->result;
  r.id = a->id;
  r.kv_spec = a->policy->spec();
  r.n_prompt = static_cast<int>(n_prompt);
  r.kv_slot_limit = a->fp.slots;
  r.t_submit = now();
  a->req = std::move(req);
  if (a->req.resume_held > held) pool_.release(a->req.resume_held - held);  // more than it needs
  if (Status s = queue_.push(a->id, a->fp.bytes, held); !s.ok()) {
    if (held > 0) pool_.release(held);
    r.status = s.with_context("request " + std::to_string(a->id) + " (" + std::to_string(n_prompt) +
                              " + " + std::to_string(a->req.max_new_tokens) +
                              " tokens, KV policy " + r.kv_spec + ") refused");
    r.stop_reason = "refused";
    r.t_end = r.t_submit;
    finished_.push_back(std::move(r));
    return a->id;
  }
  const RequestId id = a->id;
  waiting_.emplace(id, std::move(a));
  return id;
}

Status Scheduler::admit() {
  if (running_.size() >= static_cast<size_t>(params_.max_running)) return {};
  admitted_ids_.clear();
  queue_.admit(params_.max_running - static_cast<int>(running_.size()), admitted_ids_);
  // Nothing runs and the head does not fit: the bytes it waits for are held by requests behind
  // it (the conversations they continue), which nothing else would ever release.
  if (running_.empty() && admitted_ids_.empty()) queue_.admit_first_fitting(admitted_ids_);
  for (RequestId id : admitted_ids_) {
    auto it = waiting_.find(id);
    D2O_ASSERT(it != waiting_.end());
    std::unique_ptr<Active> a = std::move(it->second);
    waiting_.erase(it);
    a->result.t_admit = now();
    running_.push_back(std::move(a));
    Active& r = *running_.back();
    // The cache gets its whole footprint now (untouched pages cost no RSS) and can never grow
    // past it, so decode steps never reallocate it.
    Status s;
    try {
      if (r.req.resume) {
        r.seq = std::move(r.req.resume);
        s = r.seq->cache().shrink_to_fit(0);  // under the new limit before it is set
      } else {
        r.seq = std::make_shared<Sequence>(engine_.model().hparams(), params_.kv_type, r.policy);
      }
      r.seq->set_compaction_deferred(r.defer);
      if (s.ok())
        s = r.seq->cache().set_slot_limit(static_cast<int>(r.fp.slots),
                                          static_cast<int>(r.fp.layer_extra));
      for (int il = 0; s.ok() && il < cache_cfg_.n_layer; ++il) {
        s = r.seq->cache().reserve(il, static_cast<int>(r.fp.slots), /*exact=*/true);
      }
      const size_t n_prompt = r.req.prompt.size(),
                   n_new = static_cast<size_t>(r.req.max_new_tokens);
      r.history.reserve(n_prompt + n_new);
      r.history.assign(r.req.prompt.begin(), r.req.prompt.end());
      r.result.tokens.reserve(n_new);
      if (r.req.logprobs >= 0) r.result.logprobs.reserve(n_new);
      if (r.req.prompt_logprobs) r.result.prompt_logprobs.resize(n_prompt - 1);
      r.result.token_times.reserve(n_new);
    } catch (const std::bad_alloc&) {
      s = resource_exhausted("out of memory setting up the request");
    }
    r.rng = Sampler::initial_rng_state(r.req.sampling.seed);
    r.result.kv_reserved = r.fp.bytes;
    if (r.seq) {
      r.result.kv_peak_allocated =
          r.seq->cache().bytes_held();
    }
    if (!s.ok()) finish(running_.size() - 1, "error", s);  // could not be set up
  }
  std::erase_if(running_, [](const std::unique_ptr<Active>& a) { return a->done; });
  return {};
}

void Scheduler::finish(size_t index, std::string reason, Status status) {
  Active& a = *running_[index];
  a.done = true;
  a.has_next = false;
  a.result.stop_reason = std::move(reason);
  a.result.status = std::move(status);
  a.result.t_end = now();
  const bool keep = a.req.keep_sequence && a.result.status.ok() &&
                    a.next_chunk == a.chunks.size() && a.result.stop_reason != "cancelled";
  if (keep) a.result.sequence = std::move(a.seq);
  a.seq.reset();  // frees the cache (unless it is kept)
  queue_.release(a.id);
  finished_.push_back(std::move(a.result));
}

void Scheduler::on_logits(int entry, int token, const float* logits) {
  Active& a = *entry_owner_[static_cast<size_t>(entry)];
  const int n_vocab = engine_.model().hparams().n_vocab;
  if (entry == prefill_entry_) {
    const int64_t n_prompt = std::ssize(a.req.prompt);
    const int64_t pos = a.prefilled + token;  // the prompt token whose logits these are
    if (pos + 1 < n_prompt) {
      if (a.req.prompt_logprobs) {
        log_probs(logits, n_vocab, a.req.prompt[static_cast<size_t>(pos + 1)],
                  std::max(0, a.req.logprobs), a.result.prompt_logprobs[static_cast<size_t>(pos)]);
      }
      return;
    }
    if (a.req.max_new_tokens == 0) return;  // scored only
  }
  sampler_.set_stream(a.req.sampling, a.rng);
  a.sample = sampler_.sample(logits, a.history);
  a.rng = sampler_.rng_state();
  a.sampled = true;
  if (a.req.logprobs >= 0) log_probs(logits, n_vocab, a.sample, a.req.logprobs, a.sample_lp);
}

size_t Scheduler::kv_allocated() const {
  size_t b = 0;
  for (const auto& a : running_) {
    if (a->seq) b += a->seq->cache().bytes_held();
  }
  return b;
}

Status Scheduler::step() {
  const int64_t t_start = now_ns();
  last_ = StepStats{};
  D2O_RETURN_IF_ERROR(admit());
  last_.n_running = static_cast<int>(running_.size());
  last_.n_waiting = static_cast<int>(queue_.n_waiting());
  if (running_.empty()) return {};

  // The batch: a decode row for every sequence past its prompt, then one prompt chunk.
  batch_.clear();
  entry_owner_.clear();
  for (auto& a : running_) {
    if (!a->has_next) continue;
    BatchEntry be;
    be.seq = a->seq.get();
    be.tokens = std::span<const TokenId>(&a->history.back(), 1);
    batch_.push_back(be);
    entry_owner_.push_back(a.get());
  }
  last_.n_decode = static_cast<int>(batch_.size());
  Active* prefill = nullptr;
  prefill_entry_ = -1;
  for (auto& a : running_) {
    if (a->next_chunk < a->chunks.size()) {
      prefill = a.get();
      break;
    }
  }
  if (prefill) {
    const int len = prefill->chunks[prefill->next_chunk];
    BatchEntry be;
    be.seq = prefill->seq.get();
    be.tokens = std::span<const TokenId>(prefill->req.prompt.data() + prefill->prefilled,
                                         static_cast<size_t>(len));
    const int64_t n_prompt = std::ssize(prefill->req.prompt);
    const int64_t ce = prefill->req.context_end;
    // A chunk before the context's end belongs to the first of the two prompts.
    be.prompt_rest = (ce > 0 && prefill->prefilled < ce ? ce : n_prompt) - prefill->prefilled - len;
    const bool ends_prompt = prefill->prefilled + len == n_prompt;
    be.logits_from = prefill->req.prompt_logprobs ? 0 : ends_prompt ? -1 : BatchEntry::kNoLogits;
    prefill_entry_ = static_cast<int>(batch_.size());
    batch_.push_back(be);
    entry_owner_.push_back(prefill);
    last_.n_prefill_tokens = len;
  }
  last_.n_entries = static_cast<int>(batch_.size());
  D2O_ASSERT(!batch_.empty());
  for (Active* a : entry_owner_) a->sampled = false;

  const Status s = engine_.forward(batch_, sink_);
  last_.kv_reserved = pool_.reserved();
  if (!s.ok()) {
    for (size_t i = 0; i < running_.size(); ++i) {
      if (std::find(entry_owner_.begin(), entry_owner_.end(), running_[i].get()) !=
          entry_owner_.end()) {
        finish(i, "error", s);
      }
    }
    std::erase_if(running_, [](const std::unique_ptr<Active>& a) { return a->done; });
    return s;
  }
  last_.kv_allocated = kv_allocated();

  const double t = now();
  if (prefill) {
    prefill->prefilled += prefill->chunks[prefill->next_chunk];
    ++prefill->next_chunk;
  }
  for (size_t i = 0; i < running_.size(); ++i) {
    Active& a = *running_[i];
    if (a.req.max_new_tokens == 0 && a.next_chunk == a.chunks.size()) {
      finish(i, "length", {});  // the prompt scored, nothing to generate
      continue;
    }
    if (!a.sampled) continue;
    a.sampled = false;
    const size_t alloc =
        a.seq->cache().bytes_held();
    a.result.kv_peak_allocated = std::max(a.result.kv_peak_allocated, alloc);
    if (a.req.stop_at_eog && is_eog_[static_cast<size_t>(a.sample)]) {
      if (a.req.logprobs >= 0) {  // the token that ended the answer is scored too
        a.result.logprobs.push_back(a.sample_lp);
        if (a.req.on_logprob) a.req.on_logprob(a.result.logprobs.back());
      }
      finish(i, "eog", {});
      continue;
    }
    if (a.result.tokens.empty()) a.result.t_first = t;
    a.result.tokens.push_back(a.sample);
    a.result.token_times.push_back(t);
    a.history.push_back(a.sample);
    a.has_next = true;
    if (a.req.logprobs >= 0) {
      a.result.logprobs.push_back(a.sample_lp);
      if (a.req.on_logprob) a.req.on_logprob(a.result.logprobs.back());
    }
    if (a.req.on_token && !a.req.on_token(a.sample)) {
      finish(i, "stopped", {});
      continue;
    }
    if (static_cast<int>(a.result.tokens.size()) >= a.req.max_new_tokens) finish(i, "length", {});
  }
  const size_t before = running_.size();
  std::erase_if(running_, [](const std::unique_ptr<Active>& a) { return a->done; });
  last_.n_finished = static_cast<int>(before - running_.size());
  last_.seconds = static_cast<double>(now_ns() - t_start) * 1e-9;
  return {};
}

Status Scheduler::run() {
  while (!idle()) D2O_RETURN_IF_ERROR(step());
  return {};
}

bool Scheduler::cancel(RequestId id) {
  if (auto it = waiting_.find(id); it != waiting_.end()) {
    queue_.remove(id);
    RequestResult& r = it->second->result;
    r.stop_reason = "cancelled";
    r.t_end = now();
    finished_.push_back(std::move(r));
    waiting_.erase(it);
    return true;
  }
  for (size_t i = 0; i < running_.size(); ++i) {
    if (running_[i]->id != id || running_[i]->done) continue;
    finish(i, "cancelled", {});
    running_.erase(running_.begin() + static_cast<ptrdiff_t>(i));
    return true;
  }
  return false;
}

std::vector<RequestResult> Scheduler::take_finished() {
  std::vector<RequestResult> out;
  out.swap(finished_);
  return out;
}

}  // namespace d2o
