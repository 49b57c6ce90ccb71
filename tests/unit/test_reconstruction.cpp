// The prompt's reconstruction before its first compaction (Engine::reconstruct,
// KvPolicy::reconstruction_chunk): the window statistics it leaves against a naive computation
// (each chunk fed to a copy of the prompt's sequence on its own), the cache left as it was
// (keys, values, positions, scores; a sliding-window layer as the next pass would leave it), and
// the preset built on it (prompt_ranking=reconstruction) fed in chunks as in one pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "common/kv_rows.h"
#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "kv/policy/composed.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

// Compacts nothing; records the window statistics of every compressible layer at each pass, and
// reconstructs the prompt in chunks of `chunk` tokens when asked.
class WindowRecorder final : public KvPolicy {
 public:
  WindowRecorder(int window, int chunk) : window_(window), chunk_(chunk) {}
  std::string spec() const override { return "recorder"; }
  StatsNeeds needs() const override {
    StatsNeeds n;
    n.window = window_;
    return n;
  }
  int reconstruction_chunk(const PolicyState& s) const override {
    return s.n_compactions == 0 ? chunk_ : 0;
  }
  Status compact(KvCache& cache, PolicyState& state, const PassInfo&) const override {
    {
      recorded.clear();
      for (int il = 0; il < cache.n_layer(); ++il) {
        if (!cache.config().layer_compressible(il)) continue;
        const KvLayer& L = cache.layer(il);
        for (int g = 0; g < L.n_head_kv(); ++g)
          recorded.emplace_back(L.window(g), L.window(g) + L.n_slot());
      }
    }
    ++state.n_compactions;  // (the reconstruction is the first pass's only)
    return {};
  }
  int64_t peak_slots(int64_t, int64_t n_total, int) const override { return n_total; }
  int64_t peak_slots_for(const FeedPlan& f) const override {
    return std::max(f.n_prompt, f.n_total);
  }
  mutable std::vector<std::vector<float>> recorded;  // [compressible layer x head][slot]

 private:
  int window_, chunk_;
};

class Reconstruction : public ::testing::TestWithParam<const char*> {
 protected:
  static test::RandomModelConfig config(const std::string& arch) {
    test::RandomModelConfig cfg;
    cfg.arch = arch;
    cfg.n_layer = 3;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 33;
    if (arch == "gemma3") {
      cfg.n_layer = 7;  // layers 0-4 slide, layer 5 is global, layer 6 slides
      cfg.head_dim = 16;
      cfg.sliding_window = 16;
    }
    return cfg;
  }
};

std::vector<TokenId> random_prompt(int n, uint32_t seed) {
  std::vector<TokenId> p;
  test::Xorshift rng(seed);
  for (int i = 0; i < n; ++i) p.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  return p;
}

Status feed(Engine& engine, Sequence& seq, std::span<const TokenId> tokens,
            std::vector<float>* logits, int n_vocab) {
  BatchEntry be;
  be.seq = &seq;
  be.tokens = tokens;
  return engine.forward({&be, 1}, [&](int, int, const float* l) {
    if (logits) logits->assign(l, l + n_vocab);
  });
}

TEST_P(Reconstruction, SumsEveryChunksAttentionAndLeavesTheCacheAsItWas) {
  const std::string arch = GetParam();
  auto model = test::load_random_model(config(arch), "reconstruct_" + arch + ".gguf");
  ASSERT_NE(model, nullptr);
  const int n_vocab = model->hparams().n_vocab;
  ThreadPool pool(2);
  Engine engine(*model, pool, EngineOptions{});
  const std::vector<TokenId> prompt = random_prompt(70, 4);
  const int kChunk = 24, kWindow = 8;  // chunks of 24, 24 and 22 tokens

  auto rec = std::make_shared<WindowRecorder>(kWindow, kChunk);
  Sequence a(model->hparams(), KvType::kF16, rec);
  std::vector<float> la;
  ASSERT_TRUE(feed(engine, a, prompt, &la, n_vocab).ok());
  const std::vector<std::vector<float>> got = rec->recorded;
  EXPECT_GT(engine.timings().reconstruct_rows, 0);
  EXPECT_TRUE(a.prompt_tokens().empty());

  // Naive: each chunk fed token by token to a copy of the prompt's sequence (a one-token pass's
  // window is that query's attention); the most any query of any chunk gives each slot, scaled
  // to the queries of the policy's window.
  auto plain = std::make_shared<WindowRecorder>(1000, 0);
  Sequence base(model->hparams(), KvType::kF16, plain);
  std::vector<float> lb;
  ASSERT_TRUE(feed(engine, base, prompt, &lb, n_vocab).ok());
  EXPECT_EQ(la, lb);  // the prompt's own pass is untouched
  std::vector<std::vector<float>> want(got.size(), std::vector<float>(prompt.size(), 0.0f));
  for (size_t c0 = 0; c0 < prompt.size(); c0 += kChunk) {
    Sequence c(model->hparams(), KvType::kF16, plain);
    ASSERT_TRUE(c.copy_from(base).ok());
    const size_t n = std::min<size_t>(kChunk, prompt.size() - c0);
    for (size_t t = c0; t < c0 + n; ++t) {
      ASSERT_TRUE(feed(engine, c, std::span<const TokenId>(&prompt[t], 1), nullptr, n_vocab).ok());
      ASSERT_EQ(plain->recorded.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i)
        for (size_t j = 0; j < prompt.size(); ++j)
          want[i][j] = std::max(want[i][j], plain->recorded[i][j]);
    }
  }
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), prompt.size());
    for (size_t j = 0; j < prompt.size(); ++j)
      EXPECT_NEAR(got[i][j], want[i][j] * kWindow, 1e-5f * std::max(1.0f, want[i][j] * kWindow))
          << i << " " << j;
  }

  // The cache as the prompt left it: the same next-token logits, decode step after decode step.
  for (TokenId t : {TokenId{5}, TokenId{77}, TokenId{150}}) {
    std::vector<float> x, y;
    ASSERT_TRUE(feed(engine, a, std::span<const TokenId>(&t, 1), &x, n_vocab).ok());
    ASSERT_TRUE(feed(engine, base, std::span<const TokenId>(&t, 1), &y, n_vocab).ok());
    EXPECT_EQ(x, y);
  }
  for (int il = 0; il < a.cache().n_layer(); ++il) {
    const KvLayer& x = a.cache().layer(il);
    const KvLayer& y = base.cache().layer(il);
    if (a.cache().config().window(il) > 0) {
      // A sliding-window layer: the chunks' passes dropped its oldest slots, which the next pass
      // would drop, or a later one; it attends to the same last slots (the logits above).
      EXPECT_LE(x.n_slot(), y.n_slot()) << il;
      EXPECT_GE(x.n_slot(), a.cache().config().window(il) - 1) << il;
      continue;
    }
    ASSERT_EQ(x.n_slot(), y.n_slot()) << il;
    for (int g = 0; g < x.n_head_kv(); ++g) {
      const size_t n = static_cast<size_t>(x.n_slot());
      EXPECT_EQ(test::compare_keys(x, y, g, n), 0);
      EXPECT_EQ(test::compare_values(x, y, g, n), 0);
      EXPECT_EQ(std::memcmp(x.pos(g), y.pos(g), n * 4), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, Reconstruction, ::testing::Values("llama", "gemma3"));

// The preset: a prompt fed in announced chunks is reconstructed once, whole, as in one pass; the
// ranking differs from the prompt's window's.
TEST(ReconstructionPolicy, ChunkedPromptAsOnePassAndItsOwnRanking) {
  test::RandomModelConfig cfg;
  cfg.n_layer = 3;
  cfg.n_head_kv = 2;
  cfg.seed = 8;
  auto model = test::load_random_model(cfg, "reconstruct_policy.gguf");
  ASSERT_NE(model, nullptr);
  ThreadPool pool(1);
  Engine engine(*model, pool, EngineOptions{});
  const std::vector<TokenId> prompt = random_prompt(96, 12);
  auto run = [&](const char* spec, const std::vector<int>& chunks) {
    std::shared_ptr<const KvPolicy> pol(parse_kv_policy(spec).value());
    auto seq = std::make_unique<Sequence>(model->hparams(), KvType::kF16, pol);
    size_t at = 0;
    for (int len : chunks) {
      BatchEntry be;
      be.seq = seq.get();
      be.tokens = std::span<const TokenId>(prompt.data() + at, static_cast<size_t>(len));
      at += static_cast<size_t>(len);
      be.prompt_rest = static_cast<int64_t>(prompt.size() - at);
      EXPECT_TRUE(engine.forward({&be, 1}, [](int, int, const float*) {}).ok());
    }
    return seq;
  };
  const char* rec = "d2o:ratio=0.3,window=8,prompt_ranking=reconstruction";
  const auto whole = run(rec, {96});
  const auto chunked = run(rec, {32, 32, 32});
  const auto window = run("d2o:ratio=0.3,window=8", {96});
  bool differs = false;
  for (int il = 0; il < whole->cache().n_layer(); ++il) {
    const KvLayer& x = whole->cache().layer(il);
    const KvLayer& y = chunked->cache().layer(il);
    const KvLayer& z = window->cache().layer(il);
    ASSERT_EQ(x.n_slot(), y.n_slot());
    ASSERT_EQ(x.n_slot(), z.n_slot());
    for (int g = 0; g < x.n_head_kv(); ++g) {
      const size_t n = static_cast<size_t>(x.n_slot());
      EXPECT_EQ(std::memcmp(x.pos(g), y.pos(g), n * 4), 0);
      EXPECT_EQ(test::compare_keys(x, y, g, n), 0);
      differs = differs || std::memcmp(x.pos(g), z.pos(g), n * 4) != 0;
    }
  }
  EXPECT_TRUE(differs);
  // Refused where it cannot apply.
  EXPECT_FALSE(parse_kv_policy("d2o:budget=64,prompt_ranking=reconstruction").ok());
  EXPECT_FALSE(parse_kv_policy("d2o:prompt_ranking=reconstruction,heads=ada").ok());
}

}  // namespace
}  // namespace d2o
