// Qwen 3 MoE through the engine under a compressing KV policy: its attention layers are ordinary
// global layers, so a policy's budget applies as on any model. The prompt's logits (computed
// before the first compaction) equal the full cache's bit for bit, and decoding past the budget
// completes with the cache held to it.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <span>

#include "common/random_model.h"
#include "gguf/gguf.h"
#include "kv/policy.h"
#include "model/model.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

// A 48-token prompt in one pass, then the remaining tokens one at a time; every logit row.
Status moe_feed(Engine& engine, Sequence& seq, const std::vector<TokenId>& toks,
                std::vector<float>* logits) {
  const int n_vocab = engine.model().hparams().n_vocab;
  auto sink = [&](int, int, const float* l) { logits->insert(logits->end(), l, l + n_vocab); };
  BatchEntry be;
  be.seq = &seq;
  be.tokens = std::span<const TokenId>(toks.data(), 48);
  be.logits_from = 0;  // every prompt row
  D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
  for (size_t i = 48; i < toks.size(); ++i) {
    be.tokens = std::span<const TokenId>(toks.data() + i, 1);
    D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
  }
  return {};
}

TEST(MoeEngine, Qwen3MoeUnderAD2oBudgetKeepsThePromptsLogits) {
  const test::RandomModelConfig c = test::random_qwen3moe_config();
  const std::vector<uint8_t> bytes = test::make_random_model(c).to_bytes();
  auto file = GgufFile::from_memory(bytes.data(), bytes.size(), "qwen3moe.gguf");
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto model = Model::load(**file);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ThreadPool pool(2);
  Engine engine(**model, pool, EngineOptions{});
  const std::vector<TokenId> toks = test::random_model_tokens(64, c.n_vocab);

  std::shared_ptr<const KvPolicy> full(parse_kv_policy("full").value());
  auto parsed = parse_kv_policy("d2o:budget=16");
  ASSERT_TRUE(parsed.ok()) << parsed.status().message();
  std::shared_ptr<const KvPolicy> d2o(std::move(parsed).value());
  Sequence a((*model)->hparams(), KvType::kF32, full), b((*model)->hparams(), KvType::kF32, d2o);
  std::vector<float> la, lb;
  ASSERT_TRUE(moe_feed(engine, a, toks, &la).ok());
  const Status st = moe_feed(engine, b, toks, &lb);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(la.size(), toks.size() * static_cast<size_t>(c.n_vocab));
  ASSERT_EQ(la.size(), lb.size());
  const size_t prompt = 48 * static_cast<size_t>(c.n_vocab);
  for (size_t i = 0; i < prompt; ++i) ASSERT_EQ(la[i], lb[i]) << "prompt logit " << i;
  bool differs = false;
  for (size_t i = prompt; i < lb.size(); ++i) {
    ASSERT_TRUE(std::isfinite(lb[i]));
    differs = differs || la[i] != lb[i];
  }
  EXPECT_TRUE(differs);  // the budget did drop or merge slots
  for (int il = 0; il < c.n_layer; ++il) {
    EXPECT_EQ(a.cache().layer(il).n_slot(), 64);
    EXPECT_LE(b.cache().layer(il).n_slot(), 17) << il;
  }
}

}  // namespace
}  // namespace d2o
