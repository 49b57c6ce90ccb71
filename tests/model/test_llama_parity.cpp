// Exact inference: d2o's logits on the real SmolLM2-135M-Instruct against llama.cpp's, and on
// random-weight qwen2, qwen3, qwen3moe, qwen35, gemma3, gemma4, phi3, MHA llama and RoPE-scaled
// (Llama 3.1) llama models. llama.cpp is built from the llama-cpp-python source archive by
// scripts/setup.sh --test-data, which also stores its real-model outputs in
// <cache>/test-data/reference ($D2O_REFERENCE_DIR); the random models' logits are asked of it here,
// through scripts/gen_reference_fixtures.py. Without that build the tests skip with a message.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "common/logit_parity.h"
#include "common/random_model.h"
#include "common/reference.h"
#include "common/test_util.h"
#include "eval/perplexity.h"
#include "kv/policy.h"
#include "model/model.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

using test::all_logits;
using test::all_logits_chunked;
using test::compare;
using test::json_number;
using test::ParityStats;

std::string ref_path(const std::string& name) {
  return test::test_data_dir("D2O_REFERENCE_DIR", "reference") + "/" + name;
}

#define D2O_REQUIRE_REFERENCE(file)                                                     \
  if (!test::file_exists(ref_path(file))) {                                             \
    GTEST_SKIP() << "no llama.cpp reference " << ref_path(file)                         \
                 << ": run scripts/setup.sh --test-data (or set D2O_REFERENCE_DIR)";    \
  }

// The engine computes exactly what the model computes: with the weights dequantised to F32 (no
// activation quantisation on either side) d2o and llama.cpp agree to rounding.
TEST(LlamaParity, SmolLM2ExactArithmeticMatchesLlamaCpp) {
  D2O_REQUIRE_MODEL(model_path);
  D2O_REQUIRE_REFERENCE("smollm2_f32_logits.bin");
  test::ReferenceLogits ref;
  ASSERT_TRUE(test::read_reference_logits(ref_path("smollm2_f32_logits.bin"), &ref));
  ModelLoadOptions mo;
  mo.dequantize_to_f32 = true;
  auto model = Model::load(model_path, mo);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ThreadPool pool(2);
  Engine engine(**model, pool, EngineOptions{});
  const ParityStats st = compare(engine, ref, "F32 weights vs llama.cpp F32");
  EXPECT_LE(st.kl, 1e-6);
  EXPECT_GE(st.top1, 0.998);
}

// With the real Q4_1 weights both engines quantise activations to 8 bits, and any difference in
// rounding (llama.cpp's own flash-attention switch or F16 cache, too) decorrelates that noise over
// 30 layers. d2o must stay within llama.cpp's own spread between its settings, and its
// quantisation error against the exact computation must be no larger than llama.cpp's.
TEST(LlamaParity, SmolLM2Q41WithinLlamaCppsOwnSpread) {
  D2O_REQUIRE_MODEL(model_path);
  D2O_REQUIRE_REFERENCE("smollm2_logits.bin");
  test::ReferenceLogits ref, exact;
  ASSERT_TRUE(test::read_reference_logits(ref_path("smollm2_logits.bin"), &ref));
  ASSERT_TRUE(test::read_reference_logits(ref_path("smollm2_f32_logits.bin"), &exact));
  const std::string noise = test::read_file(ref_path("smollm2_noise.json"));
  const double fa_kl = json_number(noise, "ref_vs_flash_attn", "kl_mean");
  const double fa_top1 = json_number(noise, "ref_vs_flash_attn", "top1_mean");
  const double f16_kl = json_number(noise, "ref_vs_f16_cache", "kl_mean");
  const double f16_top1 = json_number(noise, "ref_vs_f16_cache", "top1_mean");
  const double q_kl = json_number(noise, "exact_vs_ref", "kl_mean");
  auto model = Model::load(model_path);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ThreadPool pool(2);
  Engine engine(**model, pool, EngineOptions{});
  const ParityStats st = compare(engine, ref, "Q4_1 vs llama.cpp Q4_1");
  const ParityStats qe = compare(engine, exact, "Q4_1 vs exact F32");
  std::printf("llama.cpp's own spread: flash attention on/off KL %.3e top-1 %.2f%%; F16/F32 cache KL %.3e "
              "top-1 %.2f%%; its Q4_1 vs exact KL %.3e\n",
              fa_kl, 100 * fa_top1, f16_kl, 100 * f16_top1, q_kl);
  const double floor_kl = std::max(fa_kl, f16_kl), floor_top1 = std::min(fa_top1, f16_top1);
  EXPECT_LE(st.kl, 1.25 * floor_kl);
  EXPECT_GE(st.top1, floor_top1 - 0.01);
  EXPECT_LE(qe.kl, 1.1 * q_kl);
}

// llama.cpp's logits of the random model `cfg` (written to a scratch file as `name`.gguf) for
// the fixed tokens test::random_model_tokens, computed now by the llama.cpp build that setup
// made. Skips the test without that build; callers stop on a skip or a fatal failure.
void random_model_reference(const test::RandomModelConfig& cfg, const std::string& name,
                            test::ReferenceFullLogits* ref) {
  const std::string cache = test::cache_dir();
  const std::string lib = cache + "/llama.cpp/build/bin/libllama.so";
  if (!test::file_exists(lib)) {
    GTEST_SKIP() << "no llama.cpp build at " << lib << ": run scripts/setup.sh --test-data";
  }
  const std::string path = test::scratch_path(name + ".gguf");
  const std::string out = test::scratch_path(name + ".logits");
  ASSERT_TRUE(test::make_random_model(cfg).write(path).ok());
  const test::CommandResult gen = test::run_command(
      "D2O_CACHE_DIR='" + cache + "' PYTHONPATH='" + cache + "/pylib' python3 '" +
      std::string(D2O_SOURCE_DIR) + "/scripts/gen_reference_fixtures.py' full-logits '" + path +
      "' '" + out + "'");
  ASSERT_EQ(gen.exit_code, 0) << gen.output;
  ASSERT_TRUE(test::read_reference_full_logits(out, ref)) << gen.output;
  ASSERT_EQ(ref->tokens,
            test::random_model_tokens(static_cast<int>(ref->tokens.size()), cfg.n_vocab));
}

// Largest |logit difference| over all positions and the largest |logit| of the reference, and on
// how many positions the argmax agrees.
struct LogitDiff {
  double max_err = 0, max_ref = 0;
  int agree = 0;
};
LogitDiff diff_logits(const std::vector<float>& logits, const test::ReferenceFullLogits& ref) {
  LogitDiff d;
  const size_t nv = ref.n_vocab;
  for (size_t t = 0; t < ref.tokens.size(); ++t) {
    const float* a = logits.data() + t * nv;
    const float* b = ref.logits.data() + t * nv;
    for (size_t i = 0; i < nv; ++i) {
      d.max_err = std::max(d.max_err, static_cast<double>(std::fabs(a[i] - b[i])));
      d.max_ref = std::max(d.max_ref, static_cast<double>(std::fabs(b[i])));
    }
    d.agree += std::max_element(a, a + nv) - a == std::max_element(b, b + nv) - b;
  }
  return d;
}

// d2o's logits of the random model `cfg` must agree with llama.cpp's (max error at most 2e-3 of
// the largest logit, argmax on all but one position) with 1 and 2 threads, the tokens in one pass
// and in passes of each length in `chunks`.
void check_random_model(const test::RandomModelConfig& cfg, const std::string& name,
                        std::vector<size_t> chunks = {}) {
  test::ReferenceFullLogits ref;
  random_model_reference(cfg, name, &ref);
  if (::testing::Test::HasFatalFailure() || ::testing::Test::IsSkipped()) return;
  auto model = Model::load(test::scratch_path(name + ".gguf"));
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ASSERT_EQ(static_cast<uint32_t>((*model)->hparams().n_vocab), ref.n_vocab);
  chunks.insert(chunks.begin(), 0);  // 0: the whole sequence in one pass
  for (const size_t chunk : chunks)
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    Engine engine(**model, pool, EngineOptions{});
    const auto logits =
        chunk == 0 ? all_logits(engine, ref.tokens) : all_logits_chunked(engine, ref.tokens, chunk);
    const LogitDiff d = diff_logits(logits, ref);
    std::printf("%s (%d threads, passes of %zu): max |logit diff| %.3g (max |logit| %.3g), argmax "
                "agreement %d/%zu\n",
                name.c_str(), threads, chunk == 0 ? ref.tokens.size() : chunk, d.max_err,
                d.max_ref, d.agree, ref.tokens.size());
    EXPECT_LE(d.max_err, 2e-3 * d.max_ref);
    EXPECT_GE(d.agree, static_cast<int>(ref.tokens.size()) - 1);
  }
}

TEST(LlamaParity, RandomQwen2WithQkvBiasMatchesLlamaCpp) {
  check_random_model(test::random_qwen2_config(), "random_qwen2");
}

// Gemma 3's layer: sliding windows shorter than the sequence (in one pass, in passes of 5 tokens,
// of 11 and 19 (longer than the window of 8) and token by token, so the windowed layers drop
// slots between passes), QK-norm, sandwich norms, GeGLU, scaled embeddings.
TEST(LlamaParity, RandomGemma3MatchesLlamaCpp) {
  check_random_model(test::random_gemma3_config(), "random_gemma3", {5, 1, 11, 19});
}

// Qwen 3's layer (QK-norm, NeoX RoPE, no biases, head size 32 with n_embd / n_head 16), in one
// pass, in passes of 5 and token by token.
TEST(LlamaParity, RandomQwen3MatchesLlamaCpp) {
  check_random_model(test::random_qwen3_config(), "random_qwen3", {5, 1});
}

// Qwen 3 MoE: Qwen 3's attention with a mixture of 8 experts, 2 per token, whose router leaves a
// clear gap between chosen and left-out experts on every token and layer
// (ModelForward.Qwen3MoeParityFixtureRoutesWithClearMargins), in one pass (the rows grouped by
// expert), in passes of 5 and token by token (each step reads only its tokens' experts).
TEST(LlamaParity, RandomQwen3MoeMatchesLlamaCpp) {
  check_random_model(test::random_qwen3moe_config(), "random_qwen3moe", {5, 1});
}

// Qwen 3.5: linear-attention layers (a gated delta rule over a recurrent state carried from pass
// to pass) between gated full-attention layers with multi-section RoPE on part of each head, in
// one pass, in passes of 5 and token by token.
// Then the same weights with sections {2, 1, 1, 0}, which turn every pair: d2o's logits must then
// be far from llama.cpp's, or the fixture would not show that the unturned pair is left alone.
TEST(LlamaParity, RandomQwen35MatchesLlamaCpp) {
  const test::RandomModelConfig cfg = test::random_qwen35_config();
  check_random_model(cfg, "random_qwen35", {5, 1});
  if (HasFailure() || IsSkipped()) return;
  test::ReferenceFullLogits ref;
  ASSERT_TRUE(test::read_reference_full_logits(test::scratch_path("random_qwen35.logits"), &ref));
  test::RandomModelConfig all_turn = cfg;
  all_turn.rope_sections = {2, 1, 1, 0};
  const std::string path = test::scratch_path("random_qwen35_all_turn.gguf");
  ASSERT_TRUE(test::make_random_model(all_turn).write(path).ok());
  auto model = Model::load(path);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ThreadPool pool(2);
  Engine engine(**model, pool, EngineOptions{});
  const LogitDiff d = diff_logits(all_logits(engine, ref.tokens), ref);
  std::printf("every pair turned: max |logit diff| %.3g (max |logit| %.3g)\n", d.max_err,
              d.max_ref);
  EXPECT_GT(d.max_err, 50 * 2e-3 * d.max_ref);
}

// Gemma 4 (dense): per-layer embeddings, sliding layers of head size 32 (window 8, shorter than
// the sequence) and global ones of 64 with proportional RoPE (half their pairs turned), the last
// two layers attending over layers 3 and 4's keys and values, V RMS-normalised, each layer's
// output scaled, soft-capped logits; in one pass, in passes of 5 and token by token.
// Then under a compressing policy (d2o) whose budget the 64 tokens do not reach, prompt of 24 and
// steps of one: the policy runs on the layers that hold keys and the logits stay llama.cpp's.
TEST(LlamaParity, RandomGemma4MatchesLlamaCpp) {
  check_random_model(test::random_gemma4_config(), "random_gemma4", {5, 1});
  if (HasFailure() || IsSkipped()) return;
  test::ReferenceFullLogits ref;
  ASSERT_TRUE(test::read_reference_full_logits(test::scratch_path("random_gemma4.logits"), &ref));
  auto model = Model::load(test::scratch_path("random_gemma4.gguf"));
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  auto pol = parse_kv_policy("d2o:budget=128");
  ASSERT_TRUE(pol.ok()) << pol.status().to_string();
  ThreadPool pool(2);
  Engine engine(**model, pool, EngineOptions{});
  Sequence seq((*model)->hparams(), KvType::kF32,
               std::shared_ptr<const KvPolicy>(std::move(pol).value()));
  const size_t nv = ref.n_vocab;
  std::vector<float> logits(ref.tokens.size() * nv);
  for (size_t t0 = 0; t0 < ref.tokens.size(); t0 += t0 == 0 ? 24 : 1) {
    BatchEntry be;
    be.seq = &seq;
    be.tokens = std::span<const TokenId>(ref.tokens.data() + t0, t0 == 0 ? 24 : 1);
    be.logits_from = 0;
    ASSERT_TRUE(engine
                    .forward({&be, 1},
                             [&](int, int t, const float* l) {
                               std::copy(l, l + nv, logits.begin() + (t0 + t) * nv);
                             })
                    .ok());
  }
  const LogitDiff d = diff_logits(logits, ref);
  std::printf("under d2o:budget=128: max |logit diff| %.3g (max |logit| %.3g), argmax %d/%zu\n",
              d.max_err, d.max_ref, d.agree, ref.tokens.size());
  EXPECT_LE(d.max_err, 2e-3 * d.max_ref);
  EXPECT_GE(d.agree, static_cast<int>(ref.tokens.size()) - 1);
}

// Llama 3.1's RoPE scaling: the rope_freqs.weight factors (1, two blends, then 8) over 64 tokens,
// twice the "original context" the factors were computed for, in one pass, in passes of 5 and
// token by token. Then the same weights without the factors: d2o's logits must then be far from
// llama.cpp's, or the fixture would not show that they are applied.
TEST(LlamaParity, RandomLlama31RopeScalingMatchesLlamaCpp) {
  const test::RandomModelConfig cfg = test::random_llama31_config();
  check_random_model(cfg, "random_llama31", {5, 1});
  if (HasFailure() || IsSkipped()) return;
  test::ReferenceFullLogits ref;
  ASSERT_TRUE(test::read_reference_full_logits(test::scratch_path("random_llama31.logits"), &ref));
  test::RandomModelConfig plain = cfg;
  plain.rope_freqs.clear();
  const std::string path = test::scratch_path("random_llama31_plain.gguf");
  ASSERT_TRUE(test::make_random_model(plain).write(path).ok());
  auto model = Model::load(path);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ThreadPool pool(2);
  Engine engine(**model, pool, EngineOptions{});
  const LogitDiff d = diff_logits(all_logits(engine, ref.tokens), ref);
  std::printf("without the frequency factors: max |logit diff| %.3g (max |logit| %.3g), argmax "
              "agreement %d/%zu\n",
              d.max_err, d.max_ref, d.agree, ref.tokens.size());
  EXPECT_GT(d.max_err, 50 * 2e-3 * d.max_ref);
}

// Phi-3's layer (fused Q/K/V and gate/up tensors split at load, NeoX RoPE, GQA), in one pass,
// in passes of 5 and token by token.
TEST(LlamaParity, RandomPhi3MatchesLlamaCpp) {
  check_random_model(test::random_phi3_config(), "random_phi3", {5, 1});
}

TEST(LlamaParity, RandomMhaLlamaMatchesLlamaCpp) {
  check_random_model(test::random_llama_mha_config(), "random_llama-mha");
}

}  // namespace
}  // namespace d2o
