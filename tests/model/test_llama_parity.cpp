// Exact inference: d2o's logits on the real SmolLM2-135M-Instruct against llama.cpp's (computed by
// scripts/gen_reference_fixtures.py), and on random-weight qwen2 / MHA llama models.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "common/random_model.h"
#include "common/reference.h"
#include "common/test_util.h"
#include "eval/perplexity.h"
#include "model/model.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

std::string ref_path(const std::string& name) { return std::string(D2O_TEST_DATA_DIR) + "/reference/" + name; }

// Runs `tokens` as one chunk on a fresh full-cache sequence and returns all logits.
std::vector<float> all_logits(Engine& engine, const std::vector<int32_t>& tokens) {
  const int n_vocab = engine.model().hparams().n_vocab;
  std::vector<float> out(tokens.size() * static_cast<size_t>(n_vocab));
  Sequence seq(engine.model().hparams(), KvType::kF16, nullptr);
  BatchEntry be;
  be.seq = &seq;
  be.tokens = tokens;
  be.logits_from = 0;
  Status s = engine.forward({&be, 1}, [&](int, int t, const float* l) {
    std::copy(l, l + n_vocab, out.begin() + static_cast<ptrdiff_t>(t) * n_vocab);
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
  return out;
}

void log_softmax(const float* x, int n, std::vector<double>* out) {
  out->resize(static_cast<size_t>(n));
  const double m = *std::max_element(x, x + n);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(x[i] - m);
  const double lse = m + std::log(s);
  for (int i = 0; i < n; ++i) (*out)[static_cast<size_t>(i)] = x[i] - lse;
}

TEST(LlamaParity, SmolLM2LogitsMatchLlamaCpp) {
  D2O_REQUIRE_MODEL(model_path);
  test::ReferenceLogits ref;
  ASSERT_TRUE(test::read_reference_logits(ref_path("smollm2_logits.bin"), &ref));
  auto model = Model::load(model_path);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ASSERT_EQ(static_cast<uint32_t>((*model)->hparams().n_vocab), ref.n_vocab);
  ThreadPool pool(2);
  Engine engine(**model, pool, EngineOptions{});
  const int n_vocab = static_cast<int>(ref.n_vocab);
  int64_t agree = 0, total = 0;
  double kl_sum = 0;
  std::vector<double> lq;
  for (uint32_t p = 0; p < ref.n_prompts; ++p) {
    const auto logits = all_logits(engine, ref.tokens[p]);
    int64_t agree_p = 0;
    double kl_p = 0;
    for (uint32_t t = 0; t < ref.n_pos; ++t) {
      const float* row = logits.data() + static_cast<size_t>(t) * n_vocab;
      log_softmax(row, n_vocab, &lq);
      const test::TopK& top = ref.top[p][t];
      const int argmax = static_cast<int>(std::max_element(row, row + n_vocab) - row);
      agree_p += argmax == top.id[0];
      // KL(llama.cpp || d2o) over llama.cpp's top-k tokens plus one bucket for the rest (a
      // slightly coarser measure than the full sum, never larger than it).
      double kl = 0, p_top = 0, q_top = 0;
      for (uint32_t i = 0; i < ref.k; ++i) {
        const double lp = top.logp[i];
        const double lqi = lq[top.id[i]];
        kl += std::exp(lp) * (lp - lqi);
        p_top += std::exp(lp);
        q_top += std::exp(lqi);
      }
      const double p_rest = std::max(1e-12, 1.0 - p_top), q_rest = std::max(1e-12, 1.0 - q_top);
      kl += p_rest * std::log(p_rest / q_rest);
      kl_p += kl;
    }
    std::printf("prompt %u: top-1 agreement %.2f%%, mean KL %.2e\n", p, 100.0 * agree_p / ref.n_pos,
                kl_p / ref.n_pos);
    agree += agree_p;
    kl_sum += kl_p;
    total += ref.n_pos;
  }
  const double agreement = static_cast<double>(agree) / total, mean_kl = kl_sum / total;
  std::printf("overall: top-1 agreement %.2f%%, mean KL(llama.cpp || d2o) %.3e over %lld positions\n",
              100 * agreement, mean_kl, static_cast<long long>(total));
  EXPECT_GE(agreement, 0.98);
  EXPECT_LE(mean_kl, 2e-3);
}

void check_random_model(const test::RandomModelConfig& cfg, const std::string& fixture) {
  test::ReferenceFullLogits ref;
  ASSERT_TRUE(test::read_reference_full_logits(ref_path(fixture), &ref));
  const std::string path = ::testing::TempDir() + "/" + fixture + ".gguf";
  ASSERT_TRUE(test::make_random_model(cfg).write(path).ok());
  auto model = Model::load(path);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ASSERT_EQ(static_cast<uint32_t>((*model)->hparams().n_vocab), ref.n_vocab);
  EXPECT_EQ(ref.tokens, test::random_model_tokens(static_cast<int>(ref.tokens.size()), cfg.n_vocab));
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    Engine engine(**model, pool, EngineOptions{});
    const auto logits = all_logits(engine, ref.tokens);
    double max_err = 0, max_ref = 0;
    int agree = 0;
    const size_t nv = ref.n_vocab;
    for (size_t t = 0; t < ref.tokens.size(); ++t) {
      const float* a = logits.data() + t * nv;
      const float* b = ref.logits.data() + t * nv;
      for (size_t i = 0; i < nv; ++i) {
        max_err = std::max(max_err, static_cast<double>(std::fabs(a[i] - b[i])));
        max_ref = std::max(max_ref, static_cast<double>(std::fabs(b[i])));
      }
      agree += std::max_element(a, a + nv) - a == std::max_element(b, b + nv) - b;
    }
    std::printf("%s (%d threads): max |logit diff| %.3g (max |logit| %.3g), argmax agreement %d/%zu\n",
                fixture.c_str(), threads, max_err, max_ref, agree, ref.tokens.size());
    EXPECT_LE(max_err, 2e-3 * max_ref);
    EXPECT_GE(agree, static_cast<int>(ref.tokens.size()) - 1);
  }
}

TEST(LlamaParity, RandomQwen2WithQkvBiasMatchesLlamaCpp) {
  check_random_model(test::random_qwen2_config(), "random_qwen2.bin");
}

TEST(LlamaParity, RandomMhaLlamaMatchesLlamaCpp) {
  check_random_model(test::random_llama_mha_config(), "random_llama-mha.bin");
}

}  // namespace
}  // namespace d2o
