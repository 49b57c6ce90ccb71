// Kept conversations (serve/sessions.h): idle sessions hold their shrunk caches in the
// scheduler's pool, the least recently used go first when room is needed, and every byte held is
// returned when a session is dropped or the store ends.
#include <gtest/gtest.h>

#include "common/random_model.h"
#include "common/test_util.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "serve/sessions.h"

namespace d2o::serve {
namespace {

class SessionStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    d2o::test::RandomModelConfig cfg;
    cfg.n_layer = 2;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 5;
    const std::string path = d2o::test::scratch_path("sessions_random.gguf");
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

  // A sequence that has seen n tokens (full cache: n slots per layer and head).
  std::shared_ptr<Sequence> sequence(int n) {
    auto seq = std::make_shared<Sequence>(model_->hparams(), KvType::kF16, nullptr);
    std::vector<TokenId> toks;
    for (int i = 0; i < n; ++i) toks.push_back(3 + i % 200);
    BatchEntry be;
    be.seq = seq.get();
    be.tokens = toks;
    be.logits_from = BatchEntry::kNoLogits;
    EXPECT_TRUE(engine_->forward({&be, 1}, [](int, int, const float*) {}).ok());
    return seq;
  }

  size_t bytes_of(int n) const {
    return KvCache::bytes_for_slots(kv_cache_config(model_->hparams(), KvType::kF16), n);
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Scheduler> sched_;
};

TEST_F(SessionStoreTest, IdleSessionsHoldTheirShrunkCachesAndLeastRecentlyUsedGoFirst) {
  {
    SessionStore store(*sched_);
    for (const char* id : {"a", "b", "c"}) {
      store.begin(id);
      store.end(id, sequence(20), std::vector<TokenId>(20, 1), "full");
    }
    EXPECT_EQ(store.n_idle(), 3u);
    EXPECT_EQ(store.held_bytes(), 3 * bytes_of(20));
    EXPECT_EQ(sched_->pool().reserved(), store.held_bytes());
    EXPECT_EQ(store.full_equivalent_bytes(), 3 * KvCache(kv_cache_config(model_->hparams(),
                                                                     KvType::kF16))
                                                     .full_kv_bytes(20));

    // "a" is used again: "b" becomes the least recently used.
    Session& a = store.begin("a");
    size_t held = 0;
    std::shared_ptr<Sequence> seq = store.take(a, held);
    EXPECT_EQ(held, bytes_of(20));
    EXPECT_EQ(store.held_bytes(), 2 * bytes_of(20));
    // The request took the bytes over: the pool still counts them until it returns them.
    EXPECT_EQ(sched_->pool().reserved(), 3 * bytes_of(20));
    sched_->release_held(held);
    store.end("a", std::move(seq), std::vector<TokenId>(20, 1), "full");
    EXPECT_EQ(sched_->pool().reserved(), 3 * bytes_of(20));

    // Room for one more session's bytes beyond what is free: exactly one is dropped, "b".
    const size_t want = sched_->pool().available() + 1;
    EXPECT_EQ(store.make_room(want), 1);
    EXPECT_EQ(store.find("b"), nullptr);
    EXPECT_NE(store.find("a"), nullptr);
    EXPECT_NE(store.find("c"), nullptr);
    EXPECT_EQ(store.n_evicted(), 1);

    // A session ended without a sequence is forgotten; dropping returns its bytes.
    store.begin("c");
    store.end("c", nullptr, {}, "full");
    EXPECT_EQ(store.find("c"), nullptr);
    EXPECT_EQ(sched_->pool().reserved(), bytes_of(20));
    EXPECT_EQ(sched_->pool().reserved(), store.held_bytes());
    // Busy sessions are never dropped for room.
    store.begin("a");
    EXPECT_EQ(store.make_room(sched_->pool().cap()), 0);
    store.drop("a");
    EXPECT_EQ(sched_->pool().reserved(), 0u);
    store.begin("d");
    store.end("d", sequence(8), std::vector<TokenId>(8, 1), "full");
    EXPECT_EQ(sched_->pool().reserved(), bytes_of(8));
  }
  EXPECT_EQ(sched_->pool().reserved(), 0u);  // the store returned everything
}

TEST_F(SessionStoreTest, ASessionThatDoesNotFitIsDropped) {
  SessionStore store(*sched_);
  ASSERT_TRUE(sched_->hold(sched_->pool().cap() - 10));  // almost everything taken
  store.begin("x");
  store.end("x", sequence(20), std::vector<TokenId>(20, 1), "full");
  EXPECT_EQ(store.find("x"), nullptr);
  EXPECT_EQ(store.held_bytes(), 0u);
  sched_->release_held(sched_->pool().cap() - 10);
}

}  // namespace
}  // namespace d2o::serve
