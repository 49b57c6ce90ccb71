// Scheduler: many generation requests served at once under a KV memory cap (continuous batching).
//
// Each request (prompt tokens, max new tokens, sampling, KV policy spec) becomes a Sequence that
// owns its compressed cache and policy state. One step() is one Engine::forward over
//   - one decode row for every running sequence that has finished its prompt, and
//   - at most one prompt chunk (prefill_chunk tokens) of the oldest sequence still prefilling,
// so the weights are read once for the whole batch and a long prompt never stalls the sequences
// that are decoding (their per-token latency grows by one chunk's work at most).
//
// Memory: a request is admitted (strict FIFO) when its peak KV footprint fits in the pool next to
// the running ones (runtime/kv_pool.h); its cache is capped at that footprint and released when it
// ends (EOS or max tokens), which lets the next waiting request in. A request whose peak exceeds
// the cap alone is refused at once (its result says why) and the others run.
//
// Peak footprint = KvCache::bytes_for_slots(cfg, policy.peak_slots_for({prompt, prompt + max_new,
// longest prompt chunk, 1, n_head_kv})): the full cache grows to prompt + max_new slots per
// layer; a compressing policy is bounded by its budget plus one pass (and by the prompt for
// prompt-then-compress, which holds the whole prompt once before compacting it; with per-head
// budgets, heads=ada, by the most one KV head can win from the others).
//
// Prompt chunks carry BatchEntry::prompt_rest, so ratio policies compress the prompt once, after
// its last chunk, exactly as if it had been prefilled in one pass (prefill=bounded: to the ratio
// of the whole prompt, between its chunks); the last chunk is made at
// least as long as the policy's query window (StatsNeeds::window). Outputs of a request do not depend on
// which other requests share its steps: a sequence's passes are the same whatever the batch, the
// matmuls do not depend on how rows are grouped, attention and compaction are per sequence.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "kv/policy.h"
#include "runtime/engine.h"
#include "runtime/kv_pool.h"
#include "runtime/sampler.h"

namespace d2o {

using RequestId = uint64_t;

struct Request {
  std::vector<TokenId> prompt;
  int max_new_tokens = 128;  // >= 1
  SamplerParams sampling;    // greedy by default
  std::string kv_spec = "full";
  bool stop_at_eog = true;  // false: always generate max_new_tokens (benchmarks)
  // Called on the scheduler's thread, inside step(), with every generated token once it is part
  // of the result; returning false ends the request there ("stopped": a stop string, a client
  // that went away).
  std::function<bool(TokenId)> on_token;
  // A kept conversation to continue (a RequestResult::sequence of an earlier request with the
  // same policy): `prompt` holds only the new tokens, positions go on from its n_past, and its
  // compressed cache is the context. The request owns it while it runs.
  std::shared_ptr<Sequence> resume;
  // Bytes the caller holds in the pool for `resume` (hold()): part of the request's reservation
  // from submission on; returned to the caller's hold only if submit() fails.
  size_t resume_held = 0;
  // With `resume`: the whole conversation's tokens (what `resume` holds, then `prompt`). While the
  // request waits, it may give its conversation up to be fed again from these
  // (Scheduler::give_up_waiting; RequestResult::resume_given_up). Empty: it never does.
  std::vector<TokenId> rebuild_prompt;
  // Hand the sequence back in RequestResult::sequence when the request ends with its prompt fed
  // and no error, instead of freeing it (a conversation kept for its next turn).
  bool keep_sequence = false;
  // >= 0: each generated token's log-probability and its `logprobs` most likely alternatives
  // (0..kMaxTopLogprobs; log-softmax of the raw logits), in RequestResult::logprobs and, before
  // on_token, through on_logprob.
  int logprobs = -1;
  std::function<void(const TokenLogprob&)> on_logprob;
  // Also the prompt's tokens' (from its second on; `logprobs` alternatives, at least 0): every
  // prompt chunk then gives logits for all its tokens. With it max_new_tokens may be 0 (the
  // prompt scored, nothing generated; the request ends as "length").
  bool prompt_logprobs = false;
  // 0 < context_end < prompt length: the first context_end tokens are fed as a prompt of their
  // own (a ratio policy compresses them at their end, as at the end of a conversation's turn),
  // then the rest as the next one, on the compressed cache.
  int64_t context_end = 0;
  // Compress only under memory pressure (`serve --compress when-needed`): the sequence runs with
  // its compactions deferred (Sequence::compaction_deferred), its cache full, and is reserved a
  // full cache's footprint. Ignored (the policy compacts as usual) for the full cache, and when
  // that footprint exceeds the cap while the policy's own fits.
  bool defer_compaction = false;
};

struct RequestResult {
  RequestId id = 0;
  Status status;            // OK, or why the request was refused / failed
  std::string stop_reason;  // "eog", "length", "stopped", "cancelled", "refused" or "error"
  std::string kv_spec;      // canonical spec of its policy
  int n_prompt = 0;
  std::vector<TokenId> tokens;   // generated (an EOG token that stopped it excluded)
  // Request::logprobs >= 0: one per generated token (and one for an end-of-generation token
  // that ended the request). Request::prompt_logprobs: one per prompt
  // token from the second on ([i] is prompt token i + 1's).
  std::vector<TokenLogprob> logprobs;
  std::vector<TokenLogprob> prompt_logprobs;
  size_t kv_reserved = 0;        // bytes reserved for its cache while it ran
  size_t kv_peak_allocated = 0;  // largest allocation of its cache (KV + slot metadata)
  int64_t kv_slot_limit = 0;     // slots per KV head and layer its cache was capped at
  // Its conversation (Request::resume) was given up while it waited and its whole conversation
  // fed again (Request::rebuild_prompt).
  bool resume_given_up = false;
  // Seconds on the scheduler's clock (from its creation): submitted, admitted, first generated
  // token, end. token_times[i]: when tokens[i] was produced (the end of its step).
  double t_submit = 0, t_admit = 0, t_first = 0, t_end = 0;
  std::vector<double> token_times;
  // Request::keep_sequence: the sequence, holding everything fed so far (the last generated
  // token is fed only when the request ended at an end-of-generation token); null otherwise.
  std::shared_ptr<Sequence> sequence;
};

struct SchedulerParams {
  size_t kv_mem_bytes = 0;  // the KV memory cap (> 0)
  int prefill_chunk = 256;  // prompt tokens per pass (>= 1)
  int max_running = 64;     // sequences admitted at once (>= 1)
  KvType kv_type = KvType::kF16;
  int64_t max_positions = 0;        // > 0: prompt + max_new_tokens may not exceed it
  std::vector<TokenId> eog_tokens;  // end-of-generation ids (for Request::stop_at_eog)
};

// What the last step did (for reports and tests).
struct StepStats {
  int n_entries = 0;         // sequences advanced (batch size)
  int n_decode = 0;          // decode rows
  int n_prefill_tokens = 0;  // prompt tokens of the prefill chunk (0 if none)
  int n_running = 0;         // sequences holding a reservation during the step
  int n_waiting = 0;         // requests queued after admission
  int n_finished = 0;        // requests that ended with this step
  size_t kv_reserved = 0;    // pool reservations during the step
  size_t kv_allocated = 0;   // bytes the running caches had allocated after the pass
  double seconds = 0;        // wall time of the step (forward + sampling + bookkeeping)
};

class Scheduler {
 public:
  // Errors: a zero cap, chunk or max_running; an engine whose micro-batch cannot hold a whole
  // step (max_running + prefill_chunk rows: a chunk split over micro-batches would make a
  // sequence's statistics depend on the batch).
  static Result<std::unique_ptr<Scheduler>> create(Engine& engine, const SchedulerParams& params);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request and returns its id. Errors (nothing queued): empty prompt, max_new_tokens
  // < 1, a bad policy spec or sampling parameter, prompt + max_new_tokens above max_positions, a
  // policy window longer than the prefill chunk. A request whose peak KV footprint exceeds the
  // cap gets an id and finishes at once as "refused" (see take_finished()).
  Result<RequestId> submit(Request request);

  // One engine pass (see the top of the file); a no-op when idle. An engine error fails the
  // sequences of the batch (their results carry it) and is returned.
  Status step();
  // Steps until idle.
  Status run();
  bool idle() const { return running_.empty() && queue_.n_waiting() == 0; }

  // Ends a waiting or running request at once ("cancelled"; its reservation is returned and its
  // result comes with take_finished()). False when the id is not waiting or running.
  bool cancel(RequestId id);

  // Memory kept outside running requests (idle conversations' caches) counts against the cap
  // too: hold() takes `bytes` if they fit (false: nothing taken), release_held() returns them.
  bool hold(size_t bytes) { return pool_.try_reserve(bytes); }
  void release_held(size_t bytes) { pool_.release(bytes); }
  // Bytes the first waiting request still needs from the pool before it can be admitted (0 when
  // none waits): what a caller holding memory would have to give back.
  size_t head_needs() const { return queue_.head_needs(); }

  // One step of compression under memory pressure for an idle sequence whose compactions were
  // deferred (KvPolicy::compress_step), its cache then shrunk to the slots it holds; false when
  // its policy allows no more.
  Result<bool> compress_step(Sequence& seq);
  // Compression steps taken and the bytes they gave back.
  struct Compressed {
    int64_t steps = 0;
    size_t freed = 0;
  };
  // Compresses the conversations that waiting requests continue (Request::resume, their bytes
  // held in the pool), step by step, the request farthest from admission first, each down to
  // its policy's budget before the next, until the pool has `bytes` available; the head of the
  // queue is left alone (what it would give back it would need again). Only sequences whose
  // compactions are deferred are compressed.
  Compressed compress_waiting(size_t bytes);
  // When nothing runs and the head of the queue waits for `bytes` that the conversations of the
  // requests behind it hold (nothing else would ever free them: a stall), those requests give
  // their conversations up, the one farthest from admission first, until the pool has `bytes`
  // available: each returns the bytes it held and waits again, at the back, as a request over
  // its whole conversation (Request::rebuild_prompt; those without one keep theirs). Returns
  // how many gave theirs up.
  int give_up_waiting(size_t bytes);
  // What a sequence kept idle holds in memory: its cache (cold tier included) and policy state.
  static size_t idle_bytes(const Sequence& seq) {
    return seq.cache().bytes_held() + seq.policy_state().held_bytes();
  }

  // The policy object requests with this spec (as given) run with: a sequence built outside
  // (a conversation read back from a file) must use it to be a Request::resume.
  Result<std::shared_ptr<const KvPolicy>> policy(const std::string& spec) {
    return policy_for(spec);
  }

  // Results of the requests that ended since the last call, in the order they ended.
  std::vector<RequestResult> take_finished();

  const StepStats& last_step() const { return last_; }
  const KvMemoryPool& pool() const { return pool_; }
  size_t n_running() const { return running_.size(); }
  size_t n_waiting() const { return queue_.n_waiting(); }
  // Bytes the running caches have allocated now (KV + slot metadata).
  size_t kv_allocated() const;
  // Seconds since creation (the clock of RequestResult).
  double now() const;

  // The peak KV footprint (bytes) and slot limit of a request with this policy and these sizes.
  struct Footprint {
    int64_t slots = 0;        // per KV head and layer
    int64_t layer_extra = 0;  // per KV head, one layer at a time (a turn's recall)
    size_t bytes = 0;
  };
  static Footprint footprint(const KvCacheConfig& cfg, const KvPolicy& policy, int64_t n_prompt,
                             int64_t n_new, int max_chunk);
  // The same with compactions deferred (Request::defer_compaction): `held` slots a continued
  // conversation's layers hold at most, plus every new token and what a turn may recall from a
  // cold tier, up to n_total.
  static Footprint deferred_footprint(const KvCacheConfig& cfg, const KvPolicy& policy,
                                      int64_t held, int64_t n_new, int64_t n_total);
  // How a prompt of n tokens is cut into passes: chunks of `chunk` tokens, except that the last
  // holds at least min(min_last, n) tokens (taken from the one before it).
  static std::vector<int> split_prompt(int64_t n, int chunk, int min_last);

 private:
  struct Active;
  Scheduler(Engine& engine, const SchedulerParams& params);
  Result<std::shared_ptr<const KvPolicy>> policy_for(const std::string& spec);
  Status admit();
  // Decides whether a request's compactions are deferred (Request::defer_compaction): a full
  // cache while it runs when that fits the cap, its footprint then.
  void choose_defer(Active& a, int64_t held_slots, int64_t n_new, int64_t n_total);
  void finish(size_t index, std::string reason, Status status);
  void on_logits(int entry, int token, const float* logits);

  Engine& engine_;
  SchedulerParams params_;
  KvCacheConfig cache_cfg_;
  KvMemoryPool pool_;
  AdmissionQueue queue_;
  int64_t t0_ns_ = 0;
  RequestId next_id_ = 1;
  std::map<std::string, std::shared_ptr<const KvPolicy>> policies_;  // by spec as given
  std::map<RequestId, std::unique_ptr<Active>> waiting_;             // submitted, not admitted
  std::vector<std::unique_ptr<Active>> running_;                     // in admission order
  std::vector<RequestResult> finished_;
  std::vector<uint8_t> is_eog_;  // [n_vocab]
  // Per-step buffers, reused (a steady-state step allocates nothing).
  std::vector<BatchEntry> batch_;
  std::vector<Active*> entry_owner_;
  int prefill_entry_ = -1;  // the batch entry of this step's prompt chunk (-1: none)
  std::vector<uint64_t> admitted_ids_;
  Sampler sampler_;  // one workspace; each request's random stream is swapped in
  LogitsSink sink_;
  StepStats last_;
};

}  // namespace d2o
