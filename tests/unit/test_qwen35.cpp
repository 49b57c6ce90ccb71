// Qwen 3.5 (qwen35) through the engine: only its attention layers hold keys and values, so a KV
// policy compresses those and leaves the linear-attention layers' recurrent state alone; the
// recurrent state goes from pass to pass, is saved and restored with a session (the continuation
// after a restore is the uninterrupted one), and a sequence holding one refuses to be cut back to
// a prefix. Its multi-section RoPE re-rotates keys consistently (positions=shift,
// merge_keys=unrotated work on it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <thread>

#include "common/random_model.h"
#include "common/test_util.h"
#include "gguf/gguf.h"
#include "kv/policy.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/sequence.h"
#include "serve/session_file.h"
#include "serve_fixture.h"

namespace d2o {
namespace {

class Qwen35Test : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = test::scratch_path("qwen35_unit.gguf");
    ASSERT_TRUE(test::make_random_model(test::random_qwen35_config()).write(path_).ok());
    auto m = Model::load(path_);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model_ = std::move(m).value();
    pool_ = std::make_unique<ThreadPool>(2);
    engine_ = std::make_unique<Engine>(*model_, *pool_, EngineOptions{});
  }

  std::shared_ptr<const KvPolicy> policy(const std::string& spec) {
    auto p = parse_kv_policy(spec);
    EXPECT_TRUE(p.ok()) << p.status().message();
    return std::shared_ptr<const KvPolicy>(std::move(p).value());
  }

  // Feeds `tokens` in one pass; every row's logits appended to *logits (if given); returns the
  // last row's argmax.
  TokenId feed(Sequence& seq, std::span<const TokenId> tokens, std::vector<float>* logits) {
    const int nv = model_->hparams().n_vocab;
    TokenId best = -1;
    BatchEntry be;
    be.seq = &seq;
    be.tokens = tokens;
    be.logits_from = 0;
    const Status s = engine_->forward({&be, 1}, [&](int, int, const float* l) {
      if (logits) logits->insert(logits->end(), l, l + nv);
      best = static_cast<TokenId>(std::max_element(l, l + nv) - l);
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
    return best;
  }

  // n greedy tokens after `first` (fed one at a time).
  std::vector<TokenId> greedy(Sequence& seq, TokenId first, int n) {
    std::vector<TokenId> out;
    TokenId t = first;
    for (int i = 0; i < n; ++i) {
      t = feed(seq, std::span<const TokenId>(&t, 1), nullptr);
      out.push_back(t);
    }
    return out;
  }

  std::string path_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(Qwen35Test, OnlyTheAttentionLayersHoldKeysAndAreCompressible) {
  const ModelDesc& d = model_->desc();
  ASSERT_EQ(d.layers.size(), 4u);
  const KvCacheConfig cc = kv_cache_config(model_->hparams(), KvType::kF16);
  for (int il = 0; il < 4; ++il) {
    const bool attn = il % 2 == 1;  // full_attention_interval 2
    EXPECT_EQ(d.layers[static_cast<size_t>(il)].kind,
              attn ? LayerKind::kGlobal : LayerKind::kRecurrent);
    EXPECT_EQ(cc.layer_compressible(il), attn) << il;
    EXPECT_EQ(cc.recurrent(il), !attn) << il;
  }
  EXPECT_EQ(cc.n_compressible(), 2);
  // The e section's pairs (3 and 7 of 8 with sections {1, 1, 1, 1}) do not turn.
  const std::vector<float>& ff = model_->rope_freq_factors();
  ASSERT_EQ(ff.size(), 8u);
  for (size_t i = 0; i < ff.size(); ++i) EXPECT_EQ(std::isinf(ff[i]), i % 4 == 3) << i;
}

// The prompt's logits under a compressing policy equal the full cache's bit for bit (nothing is
// evicted before the prompt's logits), decoding past the budget completes, the attention layers
// are held to the budget and the recurrent layers hold no slots.
TEST_F(Qwen35Test, UnderAD2oBudgetTheAttentionLayersAreCompressed) {
  const std::vector<TokenId> toks = test::random_model_tokens(64, model_->hparams().n_vocab);
  Sequence a(model_->hparams(), KvType::kF32, policy("full"));
  Sequence b(model_->hparams(), KvType::kF32, policy("d2o:budget=16"));
  std::vector<float> la, lb;
  for (Sequence* s : {&a, &b}) {
    std::vector<float>& l = s == &a ? la : lb;
    feed(*s, std::span<const TokenId>(toks.data(), 40), &l);
    for (size_t i = 40; i < toks.size(); ++i) feed(*s, std::span<const TokenId>(&toks[i], 1), &l);
  }
  ASSERT_EQ(la.size(), lb.size());
  const size_t prompt = 40 * static_cast<size_t>(model_->hparams().n_vocab);
  for (size_t i = 0; i < prompt; ++i) ASSERT_EQ(la[i], lb[i]) << "prompt logit " << i;
  for (float x : lb) ASSERT_TRUE(std::isfinite(x));
  for (int il = 0; il < 4; ++il) {
    if (il % 2 == 0) {
      EXPECT_EQ(b.cache().layer(il).n_slot(), 0) << il;
    } else {
      EXPECT_LE(b.cache().layer(il).n_slot(), 17) << il;
      EXPECT_EQ(a.cache().layer(il).n_slot(), 64) << il;
    }
  }
  EXPECT_EQ(a.cache().recurrent().n_tokens, 64);
  EXPECT_EQ(b.cache().recurrent().n_tokens, 64);
}

// A budget above the sequence's length reproduces the full cache bit for bit, prompt and steps.
TEST_F(Qwen35Test, ABudgetAboveTheLengthIsTheFullCache) {
  const std::vector<TokenId> toks = test::random_model_tokens(64, model_->hparams().n_vocab);
  std::vector<std::vector<float>> out;
  for (const char* spec : {"full", "d2o:budget=128", "h2o:budget=128", "snapkv:budget=128"}) {
    Sequence s(model_->hparams(), KvType::kF16, policy(spec));
    std::vector<float> l;
    feed(s, std::span<const TokenId>(toks.data(), 24), &l);
    for (size_t i = 24; i < toks.size(); ++i) feed(s, std::span<const TokenId>(&toks[i], 1), &l);
    out.push_back(std::move(l));
    EXPECT_EQ(out.back(), out.front()) << spec;
  }
}

// Keys re-rotated by a position delta (positions=shift) and compared rotated back to position 0
// (merge_keys=unrotated) go through the multi-section RoPE's frequency factors: both policies run
// and give finite logits, and a rotation by -d after one to p is the one to p - d.
TEST_F(Qwen35Test, ReRotatingPoliciesWorkWithTheSectionedRope) {
  const RopeParams& rope = model_->desc().policy_rope;
  std::vector<float> x(32), y(32);
  for (int i = 0; i < 32; ++i)
    x[static_cast<size_t>(i)] = std::sin(0.7f * static_cast<float>(i) + 0.3f);
  y = x;
  rope_apply(rope, 10.0f, 1, x.data());
  rope_apply(rope, -4.0f, 1, x.data());
  rope_apply(rope, 6.0f, 1, y.data());
  for (int i = 0; i < 32; ++i)
    EXPECT_NEAR(x[static_cast<size_t>(i)], y[static_cast<size_t>(i)], 1e-5f) << i;
  const std::vector<TokenId> toks = test::random_model_tokens(48, model_->hparams().n_vocab);
  for (const char* spec : {"streaming:budget=12,sinks=2,pos=shift", "d2o:budget=16,mrope=pre"}) {
    Sequence s(model_->hparams(), KvType::kF32, policy(spec));
    std::vector<float> l;
    feed(s, std::span<const TokenId>(toks.data(), 24), &l);
    for (size_t i = 24; i < toks.size(); ++i) feed(s, std::span<const TokenId>(&toks[i], 1), &l);
    for (float v : l) ASSERT_TRUE(std::isfinite(v)) << spec;
    EXPECT_LE(s.cache().layer(1).n_slot(), 17) << spec;
  }
}

// A conversation saved after its prompt and read back goes on with the tokens the uninterrupted
// one produces (the recurrent state is in the file); a file without it, or with a state of
// another length, is refused.
TEST_F(Qwen35Test, SessionRestoreContinuesAsTheUninterruptedSequence) {
  auto id = serve::model_identity(path_);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  serve::SessionFileContext ctx;
  ctx.model = *id;
  ctx.cache = kv_cache_config(model_->hparams(), KvType::kF16);
  ctx.n_vocab = model_->hparams().n_vocab;
  ctx.max_positions = 512;
  auto pol = policy("d2o:budget=24");
  const std::vector<TokenId> prompt = test::random_model_tokens(40, model_->hparams().n_vocab);
  Sequence a(model_->hparams(), KvType::kF16, pol);
  const TokenId first = feed(a, prompt, nullptr);
  std::string bytes;
  const Status enc = serve::encode_session(ctx, "q", pol->spec(), prompt, a.n_past(), a.cache(),
                                           a.policy_state(), bytes);
  ASSERT_TRUE(enc.ok()) << enc.to_string();
  const std::vector<TokenId> straight = greedy(a, first, 24);

  auto d = serve::decode_session(ctx, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->cache->recurrent().n_tokens, 40);
  Sequence b(model_->hparams(), KvType::kF16, pol);
  b.cache() = std::move(*d->cache);
  b.policy_state() = std::move(d->state);
  b.advance(d->n_past);
  EXPECT_EQ(greedy(b, first, 24), straight);

  // A fresh state in place of the saved one gives another continuation: the state matters.
  Sequence c(model_->hparams(), KvType::kF16, pol);
  auto d2 =
      serve::decode_session(ctx, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE(d2.ok());
  c.cache() = std::move(*d2->cache);
  c.cache().recurrent_for_update().reset();
  c.policy_state() = std::move(d2->state);
  c.advance(d2->n_past);
  EXPECT_NE(greedy(c, first, 24), straight);

  // The same file read for a model without recurrent layers' state: refused.
  serve::SessionFileContext other = ctx;
  other.cache.layer_recurrent.clear();
  auto bad =
      serve::decode_session(other, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("recurrent state"), std::string::npos)
      << bad.status().message();
}

// Sequences batched in one pass (prompts of different lengths, then decode steps together, one
// with a compressing policy) get the logits each gets alone: each carries its own state.
TEST_F(Qwen35Test, BatchedSequencesKeepTheirOwnStates) {
  const int nv = model_->hparams().n_vocab;
  const std::vector<TokenId> pa = test::random_model_tokens(30, nv);
  std::vector<TokenId> pb = test::random_model_tokens(50, nv);
  std::reverse(pb.begin(), pb.end());
  const std::vector<std::string> specs = {"full", "d2o:budget=16"};
  // Alone: prompt then 10 steps of token 7; the last row's logits of each pass.
  std::vector<std::vector<float>> alone(2);
  for (int i = 0; i < 2; ++i) {
    Sequence s(model_->hparams(), KvType::kF32, policy(specs[static_cast<size_t>(i)]));
    std::vector<float> all;
    const std::vector<TokenId>& p = i == 0 ? pa : pb;
    feed(s, p, &all);
    alone[static_cast<size_t>(i)].assign(all.end() - nv, all.end());
    const TokenId t = 7;
    for (int k = 0; k < 10; ++k) {
      all.clear();
      feed(s, std::span<const TokenId>(&t, 1), &all);
      alone[static_cast<size_t>(i)].insert(alone[static_cast<size_t>(i)].end(), all.begin(),
                                           all.end());
    }
  }
  Sequence a(model_->hparams(), KvType::kF32, policy(specs[0]));
  Sequence b(model_->hparams(), KvType::kF32, policy(specs[1]));
  std::vector<std::vector<float>> together(2);
  const TokenId t = 7;
  for (int k = 0; k <= 10; ++k) {
    BatchEntry be[2];
    be[0].seq = &a;
    be[1].seq = &b;
    be[0].tokens = k == 0 ? std::span<const TokenId>(pa) : std::span<const TokenId>(&t, 1);
    be[1].tokens = k == 0 ? std::span<const TokenId>(pb) : std::span<const TokenId>(&t, 1);
    const Status st = engine_->forward({be, 2}, [&](int e, int, const float* l) {
      together[static_cast<size_t>(e)].insert(together[static_cast<size_t>(e)].end(), l, l + nv);
    });
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  EXPECT_EQ(together[0], alone[0]);
  EXPECT_EQ(together[1], alone[1]);
}

// A file without a linear-attention tensor, or whose value heads do not divide over the key
// heads, is refused with a message naming what is wrong.
TEST(Qwen35Load, MalformedFilesAreRefusedWithAReason) {
  test::RandomModelConfig c = test::random_qwen35_config();
  c.omit_tensor = "blk.2.ssm_a";
  std::vector<uint8_t> bytes = test::make_random_model(c).to_bytes();
  auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "q35.gguf");
  ASSERT_TRUE(f.ok());
  auto m = Model::load(**f);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("blk.2.ssm_a"), std::string::npos) << m.status().message();
  c = test::random_qwen35_config();
  c.ssm_n_v_head = 3;  // not a multiple of the 2 key heads
  bytes = test::make_random_model(c).to_bytes();
  f = GgufFile::from_memory(bytes.data(), bytes.size(), "q35.gguf");
  ASSERT_TRUE(f.ok());
  m = Model::load(**f);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("ssm.time_step_rank"), std::string::npos)
      << m.status().message();
}

// A recurrent state cannot be rewound: the sequence refuses to be cut back to a prefix, saying
// why, and vouches for no prefix shorter than what it has seen.
TEST_F(Qwen35Test, ASequenceWithRecurrentStateRefusesToBeCutBack) {
  Sequence s(model_->hparams(), KvType::kF16, policy("full"));
  const std::vector<TokenId> toks = test::random_model_tokens(20, model_->hparams().n_vocab);
  feed(s, toks, nullptr);
  ASSERT_NE(s.cut_back_refusal(), nullptr);
  EXPECT_EQ(s.reusable_prefix(10), 0);
  const Status st = s.truncate(10);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("recurrent"), std::string::npos) << st.message();
  EXPECT_EQ(s.n_past(), 20);
  EXPECT_TRUE(s.truncate(0).ok());  // starting over is always possible
  EXPECT_EQ(s.cache().recurrent().n_tokens, 0);
  for (const auto& dl : s.cache().recurrent().delta)
    for (float v : dl) ASSERT_EQ(v, 0.0f);
}

// One greedy turn of `session` on the service: the answer's text, what was kept, the session info.
struct Q35Turn {
  std::string text;
  int cached = 0;
  std::optional<serve::SessionInfo> session;
  bool failed = false;
};
Q35Turn q35_turn(serve::Service& s, const std::vector<TokenId>& prompt, const std::string& id) {
  auto job = std::make_shared<serve::Job>();
  job->prompt = prompt;
  job->max_tokens = 6;
  job->sampling.temperature = 0;
  job->sampling.top_k = 0;
  job->kv_spec = "full";
  job->session = id;
  job->completion.endpoint = serve::Endpoint::kCompletion;
  Q35Turn t;
  if (s.submit(job)) {
    t.failed = true;
    return t;
  }
  std::string piece;
  while (!serve::Service::wait_events(*job, piece, 1000)) t.text += piece;
  t.text += piece;
  std::lock_guard<std::mutex> lock(job->mu);
  t.failed = job->error.has_value();
  t.cached = job->completion.usage.cached_tokens;
  t.session = job->completion.session;
  return t;
}

bool q35_wait_saved(const serve::Service& s, int64_t n) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (s.metrics().sessions_saved < n) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// A server restarted between two turns reads the session's file (recurrent state included) and
// answers the second turn as the server that kept the session in memory.
TEST(Qwen35Serve, ASessionReadBackAfterARestartAnswersAsTheUninterruptedOne) {
  const std::vector<TokenId> p1 = serve::test::random_prompt(20, 31);
  std::vector<TokenId> extra = serve::test::random_prompt(5, 32);
  std::string uninterrupted, restarted;
  int64_t n_past_1 = 0;
  for (const bool restart : {false, true}) {
    const std::string dir = test::scratch_path(restart ? "q35_sessions_b" : "q35_sessions_a");
    std::filesystem::remove_all(dir);
    auto stack = std::make_unique<serve::test::ServeStack>();
    stack->model_config = test::random_qwen35_config();
    stack->session_dir = dir;
    ASSERT_NO_FATAL_FAILURE(stack->start("serve_qwen35", size_t{4} << 20, 2, 8));
    const Q35Turn one = q35_turn(*stack->service, p1, "r");
    ASSERT_FALSE(one.failed);
    ASSERT_TRUE(q35_wait_saved(*stack->service, 1));
    n_past_1 = one.session->n_past;
    std::vector<TokenId> p2 = p1;
    for (size_t p = 0; (p = one.text.find('t', p)) != std::string::npos;) {
      size_t end = p + 1;
      while (end < one.text.size() && std::isdigit(static_cast<unsigned char>(one.text[end])))
        ++end;
      p2.push_back(std::stoi(one.text.substr(p + 1, end - p - 1)));
      p = end;
    }
    p2.insert(p2.end(), extra.begin(), extra.end());
    if (restart) {
      stack->service.reset();
      stack = std::make_unique<serve::test::ServeStack>();
      stack->model_config = test::random_qwen35_config();
      stack->session_dir = dir;
      ASSERT_NO_FATAL_FAILURE(stack->start("serve_qwen35", size_t{4} << 20, 2, 8));
    }
    const Q35Turn two = q35_turn(*stack->service, p2, "r");
    ASSERT_FALSE(two.failed);
    ASSERT_TRUE(two.session);
    EXPECT_FALSE(two.session->rebuilt) << restart;
    EXPECT_EQ(two.cached, n_past_1) << restart;
    (restart ? restarted : uninterrupted) = two.text;
    stack->service.reset();
    std::filesystem::remove_all(dir);
  }
  EXPECT_FALSE(uninterrupted.empty());
  EXPECT_EQ(restarted, uninterrupted);
}

}  // namespace
}  // namespace d2o
