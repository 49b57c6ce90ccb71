// Compression under memory pressure (serve/sessions.h, CompressWhen::kWhenNeeded): sequences run
// with their compactions deferred and stay full; when room is needed the least recently used idle
// session is compressed step by step (half its slots a step, never below its policy's budget)
// before any session is dropped; the pool never holds more than its cap. kAlways is unchanged.
#include <gtest/gtest.h>

#include "common/random_model.h"
#include "common/test_util.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "serve/sessions.h"

namespace d2o::serve {
namespace {

constexpr const char* kSpec = "h2o:budget=8";

class SessionPressureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    d2o::test::RandomModelConfig cfg;
    cfg.n_layer = 2;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 7;
    const std::string path = d2o::test::scratch_path("pressure_random.gguf");
    ASSERT_TRUE(d2o::test::make_random_model(cfg).write(path).ok());
    auto m = Model::load(path);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model_ = std::move(m).value();
    pool_ = std::make_unique<ThreadPool>(1);
    engine_ = std::make_unique<Engine>(*model_, *pool_, EngineOptions{});
    SchedulerParams sp;
    sp.kv_mem_bytes = size_t{8} << 20;
    sp.prefill_chunk = 16;
    sp.max_running = 4;
    auto s = Scheduler::create(*engine_, sp);
    ASSERT_TRUE(s.ok());
    sched_ = std::move(s).value();
  }

  // A sequence of policy kSpec that has seen n tokens, fed in one pass; deferred: its
  // compactions deferred (its cache stays full).
  std::shared_ptr<Sequence> sequence(int n, bool deferred) {
    auto pol = sched_->policy(kSpec);
    EXPECT_TRUE(pol.ok());
    auto seq = std::make_shared<Sequence>(model_->hparams(), KvType::kF16, *pol);
    seq->set_compaction_deferred(deferred);
    std::vector<TokenId> toks;
    for (int i = 0; i < n; ++i) toks.push_back(3 + (i * 7) % 200);
    BatchEntry be;
    be.seq = seq.get();
    be.tokens = toks;
    be.logits_from = BatchEntry::kNoLogits;
    EXPECT_TRUE(engine_->forward({&be, 1}, [](int, int, const float*) {}).ok());
    return seq;
  }

  // Ends a request of session `id` with a deferred sequence of n tokens.
  void keep(SessionStore& store, const std::string& id, int n) {
    store.begin(id);
    store.end(id, sequence(n, true), std::vector<TokenId>(static_cast<size_t>(n), 1), kSpec);
  }

  static int slots(const SessionStore& store, const std::string& id) {
    const Session* s = const_cast<SessionStore&>(store).find(id);
    return s && s->seq ? s->seq->cache().layer(0).n_slot() : -1;
  }

  // Takes everything free in the pool but `left` bytes (returned by the caller).
  size_t fill_pool(size_t left) {
    const size_t take = sched_->pool().available() - left;
    EXPECT_TRUE(sched_->hold(take));
    return take;
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Scheduler> sched_;
};

TEST_F(SessionPressureTest, DeferredSequencesStayFullAndSessionsStayFullWhileThereIsRoom) {
  EXPECT_EQ(sequence(64, false)->cache().layer(0).n_slot(), 8);  // compacted as usual
  SessionStore store(*sched_);
  store.set_compress(CompressWhen::kWhenNeeded);
  keep(store, "a", 64);
  keep(store, "b", 64);
  EXPECT_EQ(slots(store, "a"), 64);
  EXPECT_EQ(store.make_room(sched_->pool().available()), 0);
  EXPECT_EQ(slots(store, "a"), 64);
  EXPECT_EQ(slots(store, "b"), 64);
  const SessionPressureStats p = store.pressure_stats();
  EXPECT_EQ(p.compress_steps, 0);
  EXPECT_EQ(p.idle_full, 2);
  EXPECT_EQ(p.idle_compressed, 0);
  EXPECT_EQ(sched_->pool().reserved(), store.held_bytes());
}

TEST_F(SessionPressureTest, TheLeastRecentlyUsedIsCompressedStepByStepBeforeAnyIsDropped) {
  SessionStore store(*sched_);
  store.set_compress(CompressWhen::kWhenNeeded);
  for (const char* id : {"a", "b", "c"}) keep(store, id, 64);
  const size_t full = store.find("a")->held;
  const size_t other = fill_pool(0);
  // A little room: one step of "a" (64 -> 32 slots a layer) gives it.
  EXPECT_EQ(store.make_room(1), 0);
  EXPECT_EQ(slots(store, "a"), 32);
  EXPECT_EQ(slots(store, "b"), 64);
  EXPECT_EQ(slots(store, "c"), 64);
  SessionPressureStats p = store.pressure_stats();
  EXPECT_EQ(p.compress_steps, 1);
  EXPECT_GT(p.compress_freed, 0u);
  EXPECT_EQ(p.compress_freed, full - store.find("a")->held);
  EXPECT_EQ(p.idle_compressed, 1);
  EXPECT_EQ(p.idle_full, 2);
  EXPECT_LE(sched_->pool().reserved(), sched_->pool().cap());
  EXPECT_EQ(sched_->pool().reserved(), other + store.held_bytes());

  // More: "a" goes down to its budget (32 -> 16 -> 8) before "b" gives anything, and nothing
  // is dropped while compression finds the room.
  // (The next steps of "a" give about a half and a quarter of what its first gave.)
  const size_t need = sched_->pool().available() + (full - store.find("a")->held);
  EXPECT_EQ(store.make_room(need), 0);
  EXPECT_EQ(slots(store, "a"), 8);
  EXPECT_EQ(slots(store, "b"), 32);
  EXPECT_EQ(slots(store, "c"), 64);
  EXPECT_EQ(store.n_evicted(), 0);
  EXPECT_GE(sched_->pool().available(), need);

  // Everything: every session down to its budget, then they are dropped, least recent first.
  const int64_t steps = store.pressure_stats().compress_steps;
  EXPECT_EQ(store.make_room(sched_->pool().cap() - other), 3);
  EXPECT_GT(store.pressure_stats().compress_steps, steps);
  EXPECT_EQ(store.n_idle(), 0u);
  EXPECT_EQ(sched_->pool().reserved(), other);
  sched_->release_held(other);
}

TEST_F(SessionPressureTest, AResumedSessionIsFullAgainAndCanBeCompressedAgain) {
  SessionStore store(*sched_);
  store.set_compress(CompressWhen::kWhenNeeded);
  keep(store, "a", 64);
  const size_t other = fill_pool(0);
  store.make_room(1);
  ASSERT_EQ(slots(store, "a"), 32);
  sched_->release_held(other);
  // Its next request: 16 more tokens, deferred, on the compressed cache.
  Session& s = store.begin("a");
  size_t held = 0;
  std::shared_ptr<Sequence> seq = store.take(s, held);
  sched_->release_held(held);
  std::vector<TokenId> toks(16, 9);
  BatchEntry be;
  be.seq = seq.get();
  be.tokens = toks;
  be.logits_from = BatchEntry::kNoLogits;
  ASSERT_TRUE(engine_->forward({&be, 1}, [](int, int, const float*) {}).ok());
  EXPECT_EQ(seq->cache().layer(0).n_slot(), 48);  // nothing compacted
  store.end("a", std::move(seq), std::vector<TokenId>(80, 1), kSpec);
  EXPECT_EQ(store.pressure_stats().idle_full, 1);  // full since its last request
  const size_t other2 = fill_pool(0);
  store.make_room(1);
  EXPECT_EQ(slots(store, "a"), 24);
  sched_->release_held(other2);
}

TEST_F(SessionPressureTest, AlwaysDropsWithoutCompressing) {
  SessionStore store(*sched_);
  ASSERT_EQ(store.compress(), CompressWhen::kAlways);
  for (const char* id : {"a", "b"}) {
    store.begin(id);
    store.end(id, sequence(64, false), std::vector<TokenId>(64, 1), kSpec);
  }
  EXPECT_EQ(slots(store, "a"), 8);
  const size_t other = fill_pool(0);
  EXPECT_EQ(store.make_room(1), 1);
  EXPECT_EQ(store.find("a"), nullptr);
  EXPECT_EQ(slots(store, "b"), 8);
  EXPECT_EQ(store.pressure_stats().compress_steps, 0);
  sched_->release_held(other);
}

// The scheduler runs a deferred request full, reserving a full cache's footprint, and hands the
// sequence back uncompacted; a request without it is compacted as always.
TEST_F(SessionPressureTest, SchedulerDefersCompactionOfARequestThatAsks) {
  for (const bool defer : {false, true}) {
    Request r;
    for (int i = 0; i < 60; ++i) r.prompt.push_back(3 + i % 100);
    r.max_new_tokens = 4;
    r.kv_spec = kSpec;
    r.keep_sequence = true;
    r.defer_compaction = defer;
    ASSERT_TRUE(sched_->submit(std::move(r)).ok());
    ASSERT_TRUE(sched_->run().ok());
    auto done = sched_->take_finished();
    ASSERT_EQ(done.size(), 1u);
    ASSERT_TRUE(done[0].sequence);
    const int n = done[0].sequence->cache().layer(0).n_slot();
    EXPECT_EQ(n, defer ? done[0].sequence->n_past() : 8) << defer;
    EXPECT_EQ(done[0].kv_slot_limit, defer ? 64 : done[0].kv_slot_limit);
  }
  EXPECT_EQ(sched_->pool().reserved(), 0u);
}

// A session read back from its file that would not fit even if every idle session left is
// compressed itself rather than rebuilt; under kAlways it is refused.
TEST_F(SessionPressureTest, ASessionReadBackCompressesItselfToFit) {
  std::shared_ptr<Sequence> full = sequence(64, true);
  ASSERT_TRUE(full->cache().shrink_to_fit(0).ok());
  const size_t bytes = Scheduler::idle_bytes(*full);
  const size_t other = fill_pool(bytes / 2);  // room for half of it
  {
    SessionStore always(*sched_);
    EXPECT_FALSE(always.adopt("a", sequence(64, true), std::vector<TokenId>(64, 1), kSpec));
  }
  SessionStore store(*sched_);
  store.set_compress(CompressWhen::kWhenNeeded);
  EXPECT_TRUE(store.adopt("a", full, std::vector<TokenId>(64, 1), kSpec));
  EXPECT_LT(slots(store, "a"), 64);
  EXPECT_GE(slots(store, "a"), 8);
  EXPECT_GE(store.pressure_stats().compress_steps, 1);
  EXPECT_EQ(store.pressure_stats().idle_compressed, 1);
  EXPECT_LE(sched_->pool().reserved(), sched_->pool().cap());
  store.drop("a");
  sched_->release_held(other);
}

// A request waiting behind the head holds the conversation it continues: compress_waiting
// compresses that conversation for the head (the head's own is left alone), and both then run.
TEST_F(SessionPressureTest, WaitingRequestsGiveTheirConversationsBytesToTheHead) {
  std::shared_ptr<Sequence> seq = sequence(64, true);
  ASSERT_TRUE(seq->cache().shrink_to_fit(0).ok());  // as a kept session is
  const size_t held = Scheduler::idle_bytes(*seq);
  ASSERT_TRUE(sched_->hold(held));
  const size_t other = fill_pool(0);
  auto request = [&](int n, std::shared_ptr<Sequence> resume) {
    Request r;
    for (int i = 0; i < n; ++i) r.prompt.push_back(5 + i);
    r.max_new_tokens = 2;
    r.kv_spec = kSpec;
    r.defer_compaction = true;
    r.resume_held = resume ? held : 0;
    r.resume = std::move(resume);
    return r;
  };
  ASSERT_TRUE(sched_->submit(request(40, nullptr)).ok());  // the head: no room
  ASSERT_TRUE(sched_->submit(request(4, seq)).ok());
  const size_t need = sched_->head_needs();
  ASSERT_GT(need, sched_->pool().available());
  const Scheduler::Compressed c = sched_->compress_waiting(need);
  EXPECT_GE(c.steps, 1);
  EXPECT_GT(c.freed, 0u);
  EXPECT_LT(seq->cache().layer(0).n_slot(), 64);
  EXPECT_GE(seq->cache().layer(0).n_slot(), 8);  // not below its budget
  EXPECT_EQ(sched_->pool().reserved(), other + held - c.freed);
  EXPECT_LE(sched_->pool().reserved(), sched_->pool().cap());
  sched_->release_held(other);
  ASSERT_TRUE(sched_->run().ok());
  for (const RequestResult& r : sched_->take_finished()) EXPECT_TRUE(r.status.ok());
  EXPECT_EQ(sched_->pool().reserved(), 0u);
}

// The stall of a full queue: nothing runs, the head waits for bytes the conversations of the
// requests behind it hold, and none of them can be compressed (a full cache). The one behind it
// gives its conversation up and is fed again whole; both then finish.
TEST_F(SessionPressureTest, WaitingRequestsGiveTheirConversationsUpWhenNothingElseFrees) {
  auto pol = sched_->policy("full");
  ASSERT_TRUE(pol.ok());
  std::vector<TokenId> history;
  for (int i = 0; i < 48; ++i) history.push_back(3 + (i * 11) % 200);
  auto seq = std::make_shared<Sequence>(model_->hparams(), KvType::kF16, *pol);
  BatchEntry be;
  be.seq = seq.get();
  be.tokens = history;
  be.logits_from = BatchEntry::kNoLogits;
  ASSERT_TRUE(engine_->forward({&be, 1}, [](int, int, const float*) {}).ok());
  ASSERT_TRUE(seq->cache().shrink_to_fit(0).ok());  // as a kept session is
  const size_t held = Scheduler::idle_bytes(*seq);
  ASSERT_TRUE(sched_->hold(held));
  auto request = [&](int n, std::shared_ptr<Sequence> resume) {
    Request r;
    for (int i = 0; i < n; ++i) r.prompt.push_back(5 + i);
    r.max_new_tokens = 2;
    r.kv_spec = "full";
    r.defer_compaction = true;
    if (resume) {
      r.rebuild_prompt = history;
      r.rebuild_prompt.insert(r.rebuild_prompt.end(), r.prompt.begin(), r.prompt.end());
      r.resume_held = held;
      r.resume = std::move(resume);
      r.keep_sequence = true;
    }
    return r;
  };
  // The head: a fresh request that fits only once the conversation's bytes are back.
  Request head = request(200, nullptr);
  const Scheduler::Footprint fp = Scheduler::footprint(seq->cache().config(), **pol, 200, 2, 16);
  ASSERT_LT(held, fp.bytes);
  const size_t other = fill_pool(fp.bytes - held / 2);
  auto head_id = sched_->submit(std::move(head));
  ASSERT_TRUE(head_id.ok());
  auto cont_id = sched_->submit(request(4, seq));
  ASSERT_TRUE(cont_id.ok());
  seq.reset();
  const size_t need = sched_->head_needs();
  ASSERT_GT(need, sched_->pool().available());
  EXPECT_EQ(sched_->compress_waiting(need).steps, 0);  // a full cache: nothing to compress
  EXPECT_EQ(sched_->give_up_waiting(need), 1);
  EXPECT_GE(sched_->pool().available(), need);
  EXPECT_LE(sched_->pool().reserved(), sched_->pool().cap());
  EXPECT_EQ(sched_->give_up_waiting(need), 0);  // enough now: nothing more given up
  ASSERT_TRUE(sched_->run().ok());
  int done = 0;
  for (RequestResult& r : sched_->take_finished()) {
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_EQ(r.resume_given_up, r.id == *cont_id);
    if (r.id == *cont_id) {
      ASSERT_NE(r.sequence, nullptr);
      EXPECT_EQ(r.n_prompt, 52);  // the whole conversation, fed again
      EXPECT_EQ(r.sequence->n_past(), 52 + 1);
    }
    ++done;
  }
  EXPECT_EQ(done, 2);
  sched_->release_held(other);
  EXPECT_EQ(sched_->pool().reserved(), 0u);
}

}  // namespace
}  // namespace d2o::serve
