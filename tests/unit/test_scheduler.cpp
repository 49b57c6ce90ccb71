// Scheduler on a tiny random-weight model: outputs in a batch equal outputs alone and a plain
// one-pass-prompt decode loop, memory accounting holds at every step, FIFO admission, freeing,
// refusal of a request larger than the cap, EOS, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/alloc_counter.h"
#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "kv/policy/composed.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/scheduler.h"
#include "unit/unit_helpers.h"

namespace d2o {
namespace {

class SchedulerTest : public test::RandomModelSuite<SchedulerTest> {
 public:
  static test::RandomModelConfig config() {
    test::RandomModelConfig cfg;
    cfg.n_layer = 2;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;  // GQA
    cfg.n_vocab = 300;
    cfg.seed = 11;
    return cfg;
  }
  static const char* file() { return "sched_random.gguf"; }

 protected:
  static std::vector<TokenId> prompt(int n, uint32_t seed) {
    std::vector<TokenId> p;
    test::Xorshift rng(seed);
    for (int i = 0; i < n; ++i) p.push_back(3 + static_cast<TokenId>(rng.next() % 297));
    return p;
  }

  static SchedulerParams params(size_t cap) {
    SchedulerParams p;
    p.kv_mem_bytes = cap;
    p.prefill_chunk = 16;
    p.max_running = 8;
    p.kv_type = KvType::kF16;
    return p;
  }

  static Request request(std::vector<TokenId> p, int n_new) {
    Request r;
    r.prompt = std::move(p);
    r.max_new_tokens = n_new;
    r.stop_at_eog = false;
    return r;
  }

  // Runs the requests together and returns the results in submission order.
  static std::vector<RequestResult> run_all(Engine& engine, const SchedulerParams& sp,
                                            std::vector<Request> reqs) {
    auto s = Scheduler::create(engine, sp);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    if (!s.ok()) return {};
    Scheduler& sched = **s;
    for (Request& r : reqs) EXPECT_TRUE(sched.submit(std::move(r)).ok());
    EXPECT_TRUE(sched.run().ok());
    std::vector<RequestResult> out = sched.take_finished();
    std::sort(out.begin(), out.end(),
              [](const RequestResult& a, const RequestResult& b) { return a.id < b.id; });
    return out;
  }

  // Independent reference: the whole prompt in one pass, then one token per pass (greedy).
  static std::vector<TokenId> decode_alone(Engine& engine, const std::vector<TokenId>& p,
                                           int n_new) {
    Sequence seq(model_->hparams(), KvType::kF16, nullptr);
    const int n_vocab = model_->hparams().n_vocab;
    TokenId next = -1;
    auto sink = [&](int, int, const float* l) {
      next = static_cast<TokenId>(std::max_element(l, l + n_vocab) - l);
    };
    BatchEntry be;
    be.seq = &seq;
    be.tokens = p;
    EXPECT_TRUE(engine.forward({&be, 1}, sink).ok());
    std::vector<TokenId> out;
    for (int i = 0; i < n_new; ++i) {
      out.push_back(next);
      if (i + 1 == n_new) break;
      TokenId one[1] = {next};
      be.tokens = std::span<const TokenId>(one, 1);
      EXPECT_TRUE(engine.forward({&be, 1}, sink).ok());
    }
    return out;
  }
};

TEST_F(SchedulerTest, BatchedOutputsEqualAloneAndOnePassDecodingForEveryAttentionSplit) {
  const std::vector<int> lens = {5, 16, 17, 40, 3, 33, 64, 9};
  for (AttnSplit split :
       {AttnSplit::kAuto, AttnSplit::kWithinSequence, AttnSplit::kAcrossSequences}) {
    ThreadPool pool(2);
    EngineOptions eo;
    eo.n_ubatch = 64;
    eo.attn_split = split;
    Engine engine(*model_, pool, eo);
    std::vector<Request> reqs;
    for (size_t i = 0; i < lens.size(); ++i)
      reqs.push_back(request(prompt(lens[i], 100 + i), 12 + static_cast<int>(i)));
    const std::vector<RequestResult> together = run_all(engine, params(size_t{64} << 20), reqs);
    ASSERT_EQ(together.size(), lens.size());
    for (size_t i = 0; i < lens.size(); ++i) {
      SCOPED_TRACE("request " + std::to_string(i) + " split " + attn_split_name(split));
      EXPECT_TRUE(together[i].status.ok()) << together[i].status.to_string();
      EXPECT_EQ(together[i].stop_reason, "length");
      const std::vector<RequestResult> alone = run_all(engine, params(size_t{64} << 20), {reqs[i]});
      ASSERT_EQ(alone.size(), 1u);
      EXPECT_EQ(together[i].tokens, alone[0].tokens);
      EXPECT_EQ(together[i].tokens, decode_alone(engine, reqs[i].prompt, reqs[i].max_new_tokens));
    }
  }
}

// Every policy, mixed in one batch, chunked prompts (16-token chunks, some longer than the
// budgets): outputs equal each request alone, and no cache ever needs more than its reservation
// (the cache's slot limit would fail the step).
TEST_F(SchedulerTest, MixedPoliciesInOneBatchEqualAlone) {
  const std::vector<std::string> specs = {"full",
                                          "streaming:budget=12",
                                          "h2o:ratio=0.3",
                                          "snapkv:ratio=0.3,window=8",
                                          "pyramidkv:ratio=0.3,window=8",
                                          "roco:ratio=0.3",
                                          "cam:ratio=0.3",
                                          "d2o:reading=paper,ratio=0.3",
                                          "d2o:reading=paper,budget=20",
                                          "h2o:budget=16"};
  ThreadPool pool(2);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  std::vector<Request> reqs;
  for (size_t i = 0; i < specs.size(); ++i) {
    Request r = request(prompt(9 + 7 * static_cast<int>(i), 300 + static_cast<uint32_t>(i)), 24);
    r.kv_spec = specs[i];
    reqs.push_back(r);
  }
  SchedulerParams sp = params(size_t{64} << 20);
  sp.max_running = 12;
  auto s = Scheduler::create(engine, sp);
  ASSERT_TRUE(s.ok());
  for (const Request& r : reqs) ASSERT_TRUE((*s)->submit(r).ok());
  while (!(*s)->idle()) {
    ASSERT_TRUE((*s)->step().ok());
    EXPECT_LE((*s)->last_step().kv_allocated, (*s)->last_step().kv_reserved);
  }
  auto together = (*s)->take_finished();
  std::sort(together.begin(), together.end(),
            [](const auto& a, const auto& b) { return a.id < b.id; });
  ASSERT_EQ(together.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i]);
    EXPECT_TRUE(together[i].status.ok()) << together[i].status.to_string();
    EXPECT_LE(together[i].kv_peak_allocated, together[i].kv_reserved);
    const auto alone = run_all(engine, sp, {reqs[i]});
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(together[i].tokens, alone[0].tokens);
  }
}

// Once every prompt is in and the buffers have grown, a decode step over many sequences (engine,
// attention, compaction, sampling, bookkeeping) allocates nothing.
TEST_F(SchedulerTest, SteadyStateDecodeStepAllocatesNothing) {
  ThreadPool pool(1);  // everything on the calling thread, which the counter watches
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  auto s = Scheduler::create(engine, params(size_t{64} << 20));
  ASSERT_TRUE(s.ok());
  const std::vector<std::string> specs = {"full",
                                          "d2o:reading=paper,ratio=0.3",
                                          "h2o:budget=16",
                                          "snapkv:ratio=0.3,window=8",
                                          "streaming:budget=12",
                                          "cam:ratio=0.3"};
  for (size_t i = 0; i < specs.size(); ++i) {
    Request r = request(prompt(30, 900 + static_cast<uint32_t>(i)), 80);
    r.kv_spec = specs[i];
    ASSERT_TRUE((*s)->submit(r).ok());
  }
  for (int i = 0; i < 30; ++i) ASSERT_TRUE((*s)->step().ok());  // prompts in, buffers grown
  ASSERT_EQ((*s)->last_step().n_prefill_tokens, 0);
  ASSERT_EQ((*s)->last_step().n_decode, static_cast<int>(specs.size()));
  test::g_allocations = 0;
  test::g_count_allocations = true;
  for (int i = 0; i < 20; ++i) ASSERT_TRUE((*s)->step().ok());
  test::g_count_allocations = false;
  EXPECT_EQ(test::g_allocations.load(), 0);
  // The counter does see the engine's allocations (a new sequence's first pass).
  Sequence seq(model_->hparams(), KvType::kF16, nullptr);
  const std::vector<TokenId> p = prompt(5, 1);
  BatchEntry be;
  be.seq = &seq;
  be.tokens = p;
  test::g_count_allocations = true;
  ASSERT_TRUE(engine.forward({&be, 1}, nullptr).ok());
  test::g_count_allocations = false;
  EXPECT_GT(test::g_allocations.load(), 0);
}

TEST_F(SchedulerTest, RandomSamplingStreamsArePerRequest) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  std::vector<Request> reqs;
  for (int i = 0; i < 4; ++i) {
    Request r = request(prompt(10 + i, 7 + static_cast<uint32_t>(i)), 20);
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 1000 + static_cast<uint64_t>(i);
    reqs.push_back(r);
  }
  const auto together = run_all(engine, params(size_t{64} << 20), reqs);
  ASSERT_EQ(together.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    const auto alone = run_all(engine, params(size_t{64} << 20), {reqs[static_cast<size_t>(i)]});
    EXPECT_EQ(together[static_cast<size_t>(i)].tokens, alone[0].tokens) << i;
  }
}

TEST_F(SchedulerTest, MemoryAccountingHoldsAtEveryStepAndAdmissionIsFifo) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const KvCacheConfig cfg{model_->hparams().n_layer, model_->hparams().n_head_kv,
                          model_->hparams().head_dim, KvType::kF16};
  // Room for the two largest requests at once, not three.
  const size_t one_big = KvCache::bytes_for_slots(cfg, 60 + 30);
  SchedulerParams sp = params(2 * one_big + one_big / 2);
  auto s = Scheduler::create(engine, sp);
  ASSERT_TRUE(s.ok());
  Scheduler& sched = **s;
  const std::vector<int> lens = {60, 60, 10, 60, 25, 5, 60, 12};
  for (size_t i = 0; i < lens.size(); ++i) {
    ASSERT_TRUE(sched.submit(request(prompt(lens[i], 50 + i), lens[i] == 60 ? 30 : 8)).ok());
  }
  int max_running = 0, steps = 0;
  size_t freed_seen = 0;
  while (!sched.idle()) {
    ASSERT_TRUE(sched.step().ok());
    const StepStats& st = sched.last_step();
    ++steps;
    EXPECT_LE(st.kv_reserved, sched.pool().cap());
    EXPECT_LE(st.kv_allocated, st.kv_reserved);
    EXPECT_LE(sched.kv_allocated(), sched.pool().reserved());
    EXPECT_LE(sched.pool().reserved(), sched.pool().cap());
    max_running = std::max(max_running, st.n_running);
    if (st.n_finished > 0) {
      EXPECT_LT(sched.pool().reserved(), st.kv_reserved);  // released
      ++freed_seen;
    }
    ASSERT_LT(steps, 10000);
  }
  EXPECT_EQ(sched.pool().reserved(), 0u);
  EXPECT_LE(sched.pool().peak_reserved(), sched.pool().cap());
  EXPECT_GE(max_running, 2);
  EXPECT_GT(freed_seen, 0u);
  auto res = sched.take_finished();
  ASSERT_EQ(res.size(), lens.size());
  std::sort(res.begin(), res.end(),
            [](const RequestResult& a, const RequestResult& b) { return a.id < b.id; });
  for (size_t i = 0; i < res.size(); ++i) {
    EXPECT_TRUE(res[i].status.ok());
    EXPECT_EQ(res[i].tokens.size(), lens[i] == 60 ? 30u : 8u);
    EXPECT_LE(res[i].kv_peak_allocated, res[i].kv_reserved);
    EXPECT_EQ(res[i].kv_reserved,
              KvCache::bytes_for_slots(cfg, lens[i] + (lens[i] == 60 ? 30 : 8)));
    if (i > 0) {
      EXPECT_LE(res[i - 1].t_admit, res[i].t_admit);  // FIFO
    }
    EXPECT_LE(res[i].t_submit, res[i].t_admit);
    EXPECT_LE(res[i].t_admit, res[i].t_first);
    EXPECT_LE(res[i].t_first, res[i].t_end);
    EXPECT_EQ(res[i].token_times.size(), res[i].tokens.size());
  }
  // The third 60-token request had to wait for memory, so it was admitted after one ended.
  const double first_end =
      std::min_element(res.begin(), res.end(), [](const auto& a, const auto& b) {
        return a.t_end < b.t_end;
      })->t_end;
  EXPECT_GE(res[3].t_admit, first_end);
}

TEST_F(SchedulerTest, RequestLargerThanTheCapIsRefusedAndTheOthersComplete) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const KvCacheConfig cfg{model_->hparams().n_layer, model_->hparams().n_head_kv,
                          model_->hparams().head_dim, KvType::kF16};
  auto s = Scheduler::create(engine, params(KvCache::bytes_for_slots(cfg, 100)));
  ASSERT_TRUE(s.ok());
  Scheduler& sched = **s;
  auto a = sched.submit(request(prompt(20, 1), 10));
  auto big = sched.submit(request(prompt(90, 2), 11));  // 101 slots > 100
  auto c = sched.submit(request(prompt(30, 3), 5));
  ASSERT_TRUE(a.ok() && big.ok() && c.ok());
  auto early = sched.take_finished();  // refused at once
  ASSERT_EQ(early.size(), 1u);
  EXPECT_EQ(early[0].id, *big);
  EXPECT_EQ(early[0].stop_reason, "refused");
  EXPECT_EQ(early[0].status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(early[0].status.message().find("more than the whole cap"), std::string::npos)
      << early[0].status.message();
  EXPECT_NE(early[0].status.message().find("request 2"), std::string::npos)
      << early[0].status.message();
  EXPECT_TRUE(early[0].tokens.empty());
  ASSERT_TRUE(sched.run().ok());
  auto rest = sched.take_finished();
  ASSERT_EQ(rest.size(), 2u);
  for (const auto& r : rest) {
    EXPECT_TRUE(r.status.ok());
    EXPECT_EQ(r.tokens.size(), r.id == *a ? 10u : 5u);
  }
}

// heads=ada shares a layer's slots over its KV heads by score, so one head may hold more than the
// budget: at most what the other heads give up above their floors. Admission reserves that bound
// plus one pass, not the whole sequence as for the full cache: under a cap of exactly that, the
// request is admitted and runs to its end within its slot limit (a head past it would fail the
// cache's reservation), while the full cache of the same request is refused.
TEST_F(SchedulerTest, PerHeadBudgetsReserveTheirBoundNotTheWholeSequence) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const KvCacheConfig cfg{model_->hparams().n_layer, model_->hparams().n_head_kv,
                          model_->hparams().head_dim, KvType::kF16};
  const int n_prompt = 120, n_new = 80, chunk = 16;
  const std::string ada = "h2o:budget=24,heads=ada";
  auto pa = test::policy_of(ada);
  auto pu = test::policy_of("h2o:budget=24");
  auto pf = test::policy_of("full");
  const Scheduler::Footprint fa = Scheduler::footprint(cfg, *pa, n_prompt, n_new, chunk);
  const Scheduler::Footprint fu = Scheduler::footprint(cfg, *pu, n_prompt, n_new, chunk);
  const Scheduler::Footprint ff = Scheduler::footprint(cfg, *pf, n_prompt, n_new, chunk);
  const auto* composed = dynamic_cast<const ComposedPolicy*>(pa.get());
  ASSERT_NE(composed, nullptr);
  const int64_t head = composed->head_peak_after_compaction(24, cfg.n_head_kv);
  EXPECT_GT(head, 24);  // a head may win slots from the other
  EXPECT_LT(head, 2 * 24);
  EXPECT_EQ(fa.slots, head + chunk);
  EXPECT_EQ(fu.slots, 24 + chunk);
  EXPECT_EQ(ff.slots, n_prompt + n_new);
  EXPECT_LT(fa.bytes, ff.bytes / 3);
  std::printf(
      "[ reserved ] %d + %d tokens, 2 KV heads: h2o:budget=24 %lld slots, with "
      "heads=ada %lld, full %lld\n",
      n_prompt, n_new, static_cast<long long>(fu.slots), static_cast<long long>(fa.slots),
      static_cast<long long>(ff.slots));

  auto s = Scheduler::create(engine, params(fa.bytes));
  ASSERT_TRUE(s.ok());
  Scheduler& sched = **s;
  Request r = request(prompt(n_prompt, 7), n_new);
  r.kv_spec = ada;
  auto id = sched.submit(std::move(r));
  ASSERT_TRUE(id.ok());
  auto full = sched.submit(request(prompt(n_prompt, 7), n_new));
  ASSERT_TRUE(full.ok());
  ASSERT_TRUE(sched.run().ok());
  auto res = sched.take_finished();
  ASSERT_EQ(res.size(), 2u);
  for (const RequestResult& x : res) {
    if (x.id == *full) {
      EXPECT_EQ(x.stop_reason, "refused");
      continue;
    }
    EXPECT_TRUE(x.status.ok()) << x.status.to_string();
    EXPECT_EQ(x.stop_reason, "length");
    EXPECT_EQ(x.tokens.size(), static_cast<size_t>(n_new));
    EXPECT_EQ(x.kv_reserved, fa.bytes);
    EXPECT_EQ(x.kv_slot_limit, fa.slots);
    EXPECT_LE(x.kv_peak_allocated, x.kv_reserved);
  }
  EXPECT_LE(sched.pool().peak_reserved(), sched.pool().cap());
}

TEST_F(SchedulerTest, EndOfGenerationStopsARequestAndFreesIt) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const std::vector<TokenId> p = prompt(12, 77);
  const std::vector<TokenId> ref = decode_alone(engine, p, 10);
  // Make the first token that does not occur before it an end-of-generation token.
  size_t k = 1;
  while (k < ref.size() && std::find(ref.begin(), ref.begin() + static_cast<ptrdiff_t>(k),
                                     ref[k]) != ref.begin() + static_cast<ptrdiff_t>(k)) {
    ++k;
  }
  ASSERT_LT(k, ref.size());
  SchedulerParams sp = params(size_t{16} << 20);
  sp.eog_tokens = {ref[k]};
  auto s = Scheduler::create(engine, sp);
  ASSERT_TRUE(s.ok());
  Request r = request(p, 10);
  r.stop_at_eog = true;
  ASSERT_TRUE((*s)->submit(r).ok());
  r.stop_at_eog = false;
  ASSERT_TRUE((*s)->submit(r).ok());
  ASSERT_TRUE((*s)->run().ok());
  auto res = (*s)->take_finished();
  ASSERT_EQ(res.size(), 2u);
  std::sort(res.begin(), res.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  EXPECT_EQ(res[0].stop_reason, "eog");
  EXPECT_EQ(res[0].tokens,
            std::vector<TokenId>(ref.begin(), ref.begin() + static_cast<ptrdiff_t>(k)));
  EXPECT_EQ(res[1].stop_reason, "length");
  EXPECT_EQ(res[1].tokens, ref);
  EXPECT_EQ((*s)->pool().reserved(), 0u);
}

TEST_F(SchedulerTest, CancelFreesWaitingAndRunningRequests) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const KvCacheConfig cfg = kv_cache_config(model_->hparams(), KvType::kF16);
  const size_t one = KvCache::bytes_for_slots(cfg, 20 + 8);
  auto s = Scheduler::create(engine, params(one + one / 2));  // room for one at a time
  ASSERT_TRUE(s.ok());
  Scheduler& sched = **s;
  auto a = sched.submit(request(prompt(20, 1), 8));
  auto b = sched.submit(request(prompt(20, 2), 8));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(sched.step().ok());
  EXPECT_EQ(sched.n_running(), 1u);
  EXPECT_EQ(sched.n_waiting(), 1u);
  EXPECT_EQ(sched.head_needs(), one);
  EXPECT_TRUE(sched.cancel(*b));
  EXPECT_EQ(sched.n_waiting(), 0u);
  EXPECT_EQ(sched.pool().reserved(), one);
  EXPECT_TRUE(sched.cancel(*a));
  EXPECT_FALSE(sched.cancel(*a));
  EXPECT_TRUE(sched.idle());
  EXPECT_EQ(sched.pool().reserved(), 0u);
  auto res = sched.take_finished();
  ASSERT_EQ(res.size(), 2u);
  for (const auto& r : res) EXPECT_EQ(r.stop_reason, "cancelled");
}

TEST_F(SchedulerTest, OnTokenCanEndARequest) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const std::vector<TokenId> p = prompt(12, 5);
  const std::vector<TokenId> ref = decode_alone(engine, p, 10);
  auto s = Scheduler::create(engine, params(size_t{16} << 20));
  ASSERT_TRUE(s.ok());
  Request r = request(p, 10);
  std::vector<TokenId> seen;
  r.on_token = [&](TokenId t) {
    seen.push_back(t);
    return seen.size() < 4;
  };
  ASSERT_TRUE((*s)->submit(std::move(r)).ok());
  ASSERT_TRUE((*s)->run().ok());
  auto res = (*s)->take_finished();
  ASSERT_EQ(res.size(), 1u);
  EXPECT_EQ(res[0].stop_reason, "stopped");
  EXPECT_EQ(res[0].tokens, std::vector<TokenId>(ref.begin(), ref.begin() + 4));
  EXPECT_EQ(seen, res[0].tokens);
  EXPECT_EQ((*s)->pool().reserved(), 0u);
}

// A kept sequence continued with only the new tokens generates what one pass over the whole
// conversation generates (full cache), and its held bytes move into the request's reservation.
TEST_F(SchedulerTest, ContinuingAKeptSequenceEqualsTheWholeConversation) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  auto s = Scheduler::create(engine, params(size_t{16} << 20));
  ASSERT_TRUE(s.ok());
  Scheduler& sched = **s;
  const std::vector<TokenId> p1 = prompt(21, 9);
  Request r1 = request(p1, 5);
  r1.keep_sequence = true;
  ASSERT_TRUE(sched.submit(std::move(r1)).ok());
  ASSERT_TRUE(sched.run().ok());
  auto res1 = sched.take_finished();
  ASSERT_EQ(res1.size(), 1u);
  ASSERT_TRUE(res1[0].sequence);
  std::shared_ptr<Sequence> seq = res1[0].sequence;
  // "length": the last generated token was sampled but not fed.
  EXPECT_EQ(seq->n_past(), 21 + 5 - 1);
  EXPECT_EQ(sched.pool().reserved(), 0u);
  std::vector<TokenId> conv = p1;
  conv.insert(conv.end(), res1[0].tokens.begin(), res1[0].tokens.end());
  const std::vector<TokenId> extra = prompt(19, 10);
  conv.insert(conv.end(), extra.begin(), extra.end());
  const std::vector<TokenId> want = decode_alone(engine, conv, 6);

  ASSERT_TRUE(seq->cache().shrink_to_fit(0).ok());
  ASSERT_TRUE(seq->cache().set_slot_limit(0).ok());
  const size_t held = seq->cache().kv_bytes_allocated() + seq->cache().meta_bytes_allocated();
  ASSERT_TRUE(sched.hold(held));
  Request r2 = request(std::vector<TokenId>(conv.begin() + seq->n_past(), conv.end()), 6);
  r2.resume = seq;
  r2.resume_held = held;
  seq.reset();
  ASSERT_TRUE(sched.submit(std::move(r2)).ok());
  EXPECT_GE(sched.pool().reserved(), held);
  ASSERT_TRUE(sched.run().ok());
  auto res2 = sched.take_finished();
  ASSERT_EQ(res2.size(), 1u);
  EXPECT_EQ(res2[0].tokens, want);
  EXPECT_FALSE(res2[0].sequence);
  EXPECT_EQ(sched.pool().reserved(), 0u);  // held bytes went with the request's reservation

  // A different policy cannot continue it; the caller keeps its hold then.
  Request r3 = request(prompt(4, 3), 2);
  r3.resume = std::make_shared<Sequence>(model_->hparams(), KvType::kF16, nullptr);
  r3.kv_spec = "h2o:budget=8";
  EXPECT_FALSE(sched.submit(std::move(r3)).ok());
}

// D2O's variable budgets are decided once, from the slots layers hold at the first compaction,
// so a kept sequence may hold a layer budget above what a short next turn's own bound assumes:
// the next turn's limit must cover that budget plus its pass.
TEST_F(SchedulerTest, AKeptSequenceWithLargeLayerBudgetsContinuesWithinItsLimit) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  auto s = Scheduler::create(engine, params(size_t{16} << 20));
  ASSERT_TRUE(s.ok());
  Scheduler& sched = **s;
  Request r1 = request(prompt(48, 4), 3);
  r1.kv_spec = "d2o:reading=paper,budget=16";
  r1.keep_sequence = true;
  ASSERT_TRUE(sched.submit(std::move(r1)).ok());
  ASSERT_TRUE(sched.run().ok());
  auto res1 = sched.take_finished();
  ASSERT_EQ(res1.size(), 1u);
  ASSERT_TRUE(res1[0].sequence);
  std::shared_ptr<Sequence> seq = res1[0].sequence;
  const std::vector<int>& budgets = seq->policy_state().budgets;
  ASSERT_EQ(budgets.size(), 2u);
  // The premise: one layer's budget is above the bound of a 2-token turn (budget + 2 + 2).
  ASSERT_GT(std::max(budgets[0], budgets[1]), 20) << budgets[0] << ", " << budgets[1];
  ASSERT_TRUE(seq->cache().shrink_to_fit(0).ok());
  ASSERT_TRUE(seq->cache().set_slot_limit(0).ok());
  Request r2 = request(prompt(2, 5), 3);
  r2.kv_spec = "d2o:reading=paper,budget=16";
  r2.resume = seq;
  seq.reset();
  ASSERT_TRUE(sched.submit(std::move(r2)).ok());
  ASSERT_TRUE(sched.run().ok());
  auto res2 = sched.take_finished();
  ASSERT_EQ(res2.size(), 1u);
  EXPECT_TRUE(res2[0].status.ok()) << res2[0].status.to_string();
  EXPECT_EQ(res2[0].stop_reason, "length");
  EXPECT_EQ(sched.pool().reserved(), 0u);
}

TEST_F(SchedulerTest, BadRequestsAndParametersAreErrors) {
  ThreadPool pool(1);
  EngineOptions eo;
  eo.n_ubatch = 16;
  Engine engine(*model_, pool, eo);
  SchedulerParams sp = params(size_t{1} << 20);
  auto too_small = Scheduler::create(engine, sp);  // 8 + 16 rows > 16
  ASSERT_FALSE(too_small.ok());
  EXPECT_NE(too_small.status().message().find("micro-batch"), std::string::npos);
  sp.max_running = 4;
  sp.prefill_chunk = 12;
  sp.kv_mem_bytes = 0;
  EXPECT_FALSE(Scheduler::create(engine, sp).ok());
  sp.kv_mem_bytes = size_t{1} << 20;
  sp.eog_tokens = {300};
  EXPECT_FALSE(Scheduler::create(engine, sp).ok());
  sp.eog_tokens = {};
  sp.max_positions = 50;
  auto s = Scheduler::create(engine, sp);
  ASSERT_TRUE(s.ok());
  Scheduler& sched = **s;
  auto expect_error = [&](Request r, const std::string& needle) {
    auto id = sched.submit(std::move(r));
    ASSERT_FALSE(id.ok()) << needle;
    EXPECT_NE(id.status().message().find(needle), std::string::npos) << id.status().message();
  };
  expect_error(request({}, 4), "empty");
  expect_error(request(prompt(4, 1), 0), "at least 1 token");
  expect_error(request({5, 300}, 4), "out of range");
  expect_error(request(prompt(40, 1), 11), "exceed the context");
  Request bad_spec = request(prompt(4, 1), 4);
  bad_spec.kv_spec = "nonsense";
  expect_error(bad_spec, "unknown KV policy");
  Request bad_temp = request(prompt(4, 1), 4);
  bad_temp.sampling.temperature = -1;
  expect_error(bad_temp, "temperature");
  EXPECT_TRUE(sched.idle());
}

// The engine's chunked-prefill contract: a chunk must carry on the count the previous announced.
TEST_F(SchedulerTest, EngineRejectsInconsistentPromptChunks) {
  ThreadPool pool(1);
  Engine engine(*model_, pool, EngineOptions{});
  Sequence seq(model_->hparams(), KvType::kF16, nullptr);
  const std::vector<TokenId> p = prompt(20, 5);
  BatchEntry be;
  be.seq = &seq;
  be.tokens = std::span<const TokenId>(p.data(), 8);
  be.prompt_rest = 12;
  be.logits_from = BatchEntry::kNoLogits;
  int calls = 0;
  ASSERT_TRUE(engine.forward({&be, 1}, [&](int, int, const float*) { ++calls; }).ok());
  EXPECT_EQ(calls, 0);  // no logits for a chunk that is not the prompt's last
  EXPECT_EQ(seq.prompt_pending(), 12);
  be.tokens = std::span<const TokenId>(p.data() + 8, 8);
  be.prompt_rest = 0;  // 8 + 0 != 12
  const Status s = engine.forward({&be, 1}, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("does not match"), std::string::npos) << s.message();
  be.prompt_rest = 4;
  ASSERT_TRUE(engine.forward({&be, 1}, nullptr).ok());
  be.tokens = std::span<const TokenId>(p.data() + 16, 4);
  be.prompt_rest = 0;
  be.logits_from = -1;
  ASSERT_TRUE(engine.forward({&be, 1}, [&](int, int, const float*) { ++calls; }).ok());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seq.prompt_pending(), 0);
  EXPECT_EQ(seq.n_past(), 20);
}

// Log-probabilities: log-softmax of the raw logits, computed here naively (a full sort, double)
// from one whole-prompt pass of the engine; the scheduler's come from chunked prompts.
struct NaiveLogprobs {
  std::vector<std::vector<double>> rows;  // per prompt token: log-softmax of its logits
};

NaiveLogprobs naive_prompt_logprobs(Engine& engine, const ModelHParams& hp,
                                    const std::vector<TokenId>& p) {
  NaiveLogprobs out;
  out.rows.resize(p.size());
  Sequence seq(hp, KvType::kF16, nullptr);
  auto sink = [&](int, int token, const float* l) {
    double mx = l[0];
    for (int v = 0; v < hp.n_vocab; ++v) mx = std::max(mx, static_cast<double>(l[v]));
    double sum = 0;
    for (int v = 0; v < hp.n_vocab; ++v) sum += std::exp(static_cast<double>(l[v]) - mx);
    auto& row = out.rows[static_cast<size_t>(token)];
    for (int v = 0; v < hp.n_vocab; ++v) row.push_back(l[v] - mx - std::log(sum));
  };
  BatchEntry be;
  be.seq = &seq;
  be.tokens = p;
  be.logits_from = 0;
  EXPECT_TRUE(engine.forward({&be, 1}, sink).ok());
  return out;
}

TEST_F(SchedulerTest, PromptAndGeneratedLogprobsAreLogSoftmaxOfTheLogits) {
  ThreadPool pool(2);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const ModelHParams& hp = model_->hparams();
  const std::vector<TokenId> p = prompt(40, 77);  // three 16-token chunks
  const NaiveLogprobs ref = naive_prompt_logprobs(engine, hp, p);

  Request r = request(p, 4);
  r.prompt_logprobs = true;
  r.logprobs = 5;
  const std::vector<RequestResult> res = run_all(engine, params(size_t{16} << 20), {r});
  ASSERT_EQ(res.size(), 1u);
  ASSERT_TRUE(res[0].status.ok()) << res[0].status.to_string();
  ASSERT_EQ(res[0].prompt_logprobs.size(), p.size() - 1);
  for (size_t i = 0; i + 1 < p.size(); ++i) {
    SCOPED_TRACE("prompt token " + std::to_string(i + 1));
    const TokenLogprob& t = res[0].prompt_logprobs[i];
    const std::vector<double>& row = ref.rows[i];
    EXPECT_EQ(t.token, p[i + 1]);
    // The same weights and cache type; only the chunking differs (f32 sums in another order).
    EXPECT_NEAR(t.logprob, row[static_cast<size_t>(p[i + 1])], 2e-4);
    std::vector<int> order(row.size());
    for (size_t v = 0; v < row.size(); ++v) order[v] = static_cast<int>(v);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
    ASSERT_EQ(t.top.size(), 5u);
    for (size_t k = 0; k < 5; ++k) {
      EXPECT_NEAR(t.top[k].second, row[static_cast<size_t>(order[k])], 2e-4);
      if (k > 0) {
        EXPECT_GE(t.top[k - 1].second, t.top[k].second);
      }
    }
    EXPECT_EQ(t.top[0].first, order[0]);
  }
  // Greedy: each generated token is its row's most likely, with the same value.
  ASSERT_EQ(res[0].logprobs.size(), res[0].tokens.size());
  ASSERT_EQ(res[0].tokens.size(), 4u);
  for (size_t k = 0; k < res[0].tokens.size(); ++k) {
    const TokenLogprob& t = res[0].logprobs[k];
    EXPECT_EQ(t.token, res[0].tokens[k]);
    ASSERT_FALSE(t.top.empty());
    EXPECT_EQ(t.top[0].first, t.token);
    EXPECT_EQ(t.top[0].second, t.logprob);
    EXPECT_LE(t.logprob, 0.0f);
  }
  EXPECT_NEAR(res[0].logprobs[0].logprob, ref.rows.back()[static_cast<size_t>(res[0].tokens[0])],
              2e-4);

  // Scored only: nothing generated, the same values.
  Request z = request(p, 0);
  z.prompt_logprobs = true;
  z.logprobs = 0;
  const std::vector<RequestResult> zres = run_all(engine, params(size_t{16} << 20), {z});
  ASSERT_EQ(zres.size(), 1u);
  EXPECT_TRUE(zres[0].status.ok());
  EXPECT_EQ(zres[0].stop_reason, "length");
  EXPECT_TRUE(zres[0].tokens.empty());
  ASSERT_EQ(zres[0].prompt_logprobs.size(), p.size() - 1);
  for (size_t i = 0; i + 1 < p.size(); ++i) {
    EXPECT_EQ(zres[0].prompt_logprobs[i].logprob, res[0].prompt_logprobs[i].logprob);
    EXPECT_TRUE(zres[0].prompt_logprobs[i].top.empty());
  }
  // Without prompt_logprobs a request must generate.
  Request bad = request(p, 0);
  auto s = Scheduler::create(engine, params(size_t{16} << 20));
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE((*s)->submit(bad).ok());
  Request many = request(p, 1);
  many.logprobs = kMaxTopLogprobs + 1;
  EXPECT_FALSE((*s)->submit(many).ok());
  Request past = request(p, 1);
  past.context_end = std::ssize(p);
  EXPECT_FALSE((*s)->submit(past).ok());
}

// context_end: with a ratio policy the context is compressed at its end, so the tokens after it
// are scored against the compressed cache; before it, and under the full cache, nothing changes.
TEST_F(SchedulerTest, ContextEndCompressesTheContextBeforeTheRestIsScored) {
  ThreadPool pool(2);
  EngineOptions eo;
  eo.n_ubatch = 64;
  Engine engine(*model_, pool, eo);
  const std::vector<TokenId> p = prompt(48, 78);
  const int64_t ce = 30;
  auto scored = [&](const std::string& kv, int64_t context_end) {
    Request r = request(p, 0);
    r.prompt_logprobs = true;
    r.logprobs = 0;
    r.kv_spec = kv;
    r.context_end = context_end;
    std::vector<RequestResult> res = run_all(engine, params(size_t{16} << 20), {r});
    EXPECT_EQ(res.size(), 1u);
    EXPECT_TRUE(res[0].status.ok()) << res[0].status.to_string();
    std::vector<float> v;
    for (const TokenLogprob& t : res[0].prompt_logprobs) v.push_back(t.logprob);
    return v;
  };
  const std::vector<float> full = scored("full", 0);
  const std::vector<float> full_ce = scored("full", ce);
  const std::vector<float> ratio = scored("h2o:ratio=0.3", 0);
  const std::vector<float> ratio_ce = scored("h2o:ratio=0.3", ce);
  ASSERT_EQ(full.size(), p.size() - 1);
  ASSERT_EQ(ratio_ce.size(), p.size() - 1);
  double max_after = 0;
  for (size_t i = 0; i + 1 < p.size(); ++i) {
    EXPECT_NEAR(full_ce[i], full[i], 2e-4) << i;
    EXPECT_NEAR(ratio[i], full[i], 2e-4) << i;  // compressed only at the prompt's end
    if (static_cast<int64_t>(i) + 1 < ce) {
      EXPECT_NEAR(ratio_ce[i], full[i], 2e-4) << i;  // the context itself: not yet compressed
    } else {
      max_after = std::max(max_after, std::fabs(static_cast<double>(ratio_ce[i]) - full[i]));
    }
  }
  EXPECT_GT(max_after, 1e-3);  // the rest saw 30% of the context
}

}  // namespace
}  // namespace d2o
