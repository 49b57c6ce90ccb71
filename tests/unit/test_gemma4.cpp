// gemma4 files as d2o reads them: the hyper-parameters llama.cpp reads (the per-layer sliding
// pattern, each kind's head width, the layers that reuse earlier layers' keys and values, the
// per-layer embedding width), and files that get them wrong refused with a message naming what.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <span>

#include "common/random_model.h"
#include "gguf/gguf.h"
#include "kv/policy.h"
#include "model/hparams.h"
#include "model/model.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

Result<ModelHParams> hparams_of(const GgufWriter& w) {
  const std::vector<uint8_t> bytes = w.to_bytes();
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f,
                       GgufFile::from_memory(bytes.data(), bytes.size(), "test.gguf"));
  return ModelHParams::from_gguf(*f);
}

TEST(Gemma4Load, HParamsAsLlamaCppReadsThem) {
  auto hp = hparams_of(test::make_random_model(test::random_gemma4_config()));
  ASSERT_TRUE(hp.ok()) << hp.status().to_string();
  EXPECT_EQ(hp->arch, ModelArch::kGemma4);
  EXPECT_EQ(hp->n_layer, 7);
  EXPECT_EQ(hp->head_dim, 64);
  EXPECT_EQ(hp->head_dim_swa, 32);
  EXPECT_EQ(hp->n_rot_swa, 32);
  EXPECT_EQ(hp->sliding_window, 8);
  EXPECT_EQ(hp->n_embd_per_layer, 16);
  EXPECT_EQ(hp->n_kv_shared, 2);
  EXPECT_FLOAT_EQ(hp->final_logit_softcap, 30.0f);
  const bool sliding[7] = {true, true, false, true, false, true, false};
  for (int il = 0; il < 7; ++il) {
    EXPECT_EQ(hp->is_sliding(il), sliding[il]) << il;
    EXPECT_EQ(hp->layer_head_dim(il), sliding[il] ? 32 : 64) << il;
  }
  // Layers 5 (sliding) and 6 (global) read the last earlier layer of their kind.
  for (int il = 0; il < 5; ++il) EXPECT_EQ(hp->kv_source(il), il);
  EXPECT_EQ(hp->kv_source(5), 3);
  EXPECT_EQ(hp->kv_source(6), 4);
}

TEST(Gemma4Load, BadKeysAreRefusedNamingThem) {
  test::RandomModelConfig c = test::random_gemma4_config();
  c.swa_layers.pop_back();  // one flag short
  auto hp = hparams_of(test::make_random_model(c));
  ASSERT_FALSE(hp.ok());
  EXPECT_NE(hp.status().message().find("attention.sliding_window_pattern"), std::string::npos)
      << hp.status().to_string();

  // Every layer before the shared ones is global: the sliding shared layer has no source.
  c = test::random_gemma4_config();
  c.swa_layers = {false, false, false, false, false, true, false};
  hp = hparams_of(test::make_random_model(c));
  ASSERT_FALSE(hp.ok());
  EXPECT_NE(hp.status().message().find("layer 5 shares"), std::string::npos)
      << hp.status().to_string();

  c = test::random_gemma4_config();
  c.n_kv_shared = 7;
  hp = hparams_of(test::make_random_model(c));
  ASSERT_FALSE(hp.ok());
  EXPECT_NE(hp.status().message().find("attention.shared_kv_layers"), std::string::npos)
      << hp.status().to_string();
}

Result<std::unique_ptr<Model>> load(const std::vector<uint8_t>& bytes) {
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f,
                       GgufFile::from_memory(bytes.data(), bytes.size(), "test.gguf"));
  return Model::load(*f);  // copies every tensor: the bytes may go
}

// Each layer's weights have its kind's head width; the layers that read an earlier layer's keys
// and values have no K or V projection; the per-layer embeddings and output scales load.
TEST(Gemma4Load, LayersLoadWithTheirOwnShapes) {
  auto m = load(test::make_random_model(test::random_gemma4_config()).to_bytes());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const Model& model = **m;
  for (int il = 0; il < 7; ++il) {
    const LayerWeights& L = model.layer(il);
    const int hd = model.hparams().layer_head_dim(il);
    EXPECT_EQ(L.wq.n_rows(), 4 * hd) << il;
    EXPECT_EQ(L.attn_q_norm.size(), static_cast<size_t>(hd)) << il;
    EXPECT_EQ(L.wk.n_rows(), il < 5 ? 2 * hd : 0) << il;
    EXPECT_EQ(model.desc().layers[static_cast<size_t>(il)].rope.head_dim, hd) << il;
    EXPECT_EQ(L.ple_gate.n_rows(), 16) << il;
    EXPECT_GT(L.out_scale, 0.5f) << il;
    EXPECT_NE(L.out_scale, 1.0f) << il;
  }
  EXPECT_EQ(model.per_layer_embd().token.n_cols(), 7 * 16);
  const KvCacheConfig c = kv_cache_config(model.hparams(), KvType::kF32);
  EXPECT_EQ(c.head_dim_of(0), 32);
  EXPECT_EQ(c.head_dim_of(2), 64);
  EXPECT_EQ(c.kv_source(5), 3);
  EXPECT_EQ(c.kv_source(6), 4);
  EXPECT_FALSE(c.layer_compressible(6));  // reads layer 4's slots
  EXPECT_TRUE(c.layer_compressible(4));
  EXPECT_EQ(c.n_compressible(), 2);  // layers 2 and 4
}

// A file whose layer with its own keys lacks one of its tensors is refused naming it.
TEST(Gemma4Load, MissingTensorIsRefusedNamingIt) {
  for (const char* name : {"blk.4.attn_k.weight", "per_layer_model_proj.weight",
                           "blk.6.inp_gate.weight", "blk.1.attn_q_norm.weight"}) {
    test::RandomModelConfig c = test::random_gemma4_config();
    c.omit_tensor = name;
    auto m = load(test::make_random_model(c).to_bytes());
    ASSERT_FALSE(m.ok()) << name;
    EXPECT_NE(m.status().message().find(name), std::string::npos) << m.status().to_string();
  }
}

class Gemma4Test : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = load(test::make_random_model(test::random_gemma4_config()).to_bytes());
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
  // A 24-token prompt in one pass, then the rest of 64 tokens one at a time; every row's logits.
  std::vector<float> run(Sequence& seq) {
    const int nv = model_->hparams().n_vocab;
    const std::vector<TokenId> toks = test::random_model_tokens(64, nv);
    std::vector<float> out;
    for (size_t t0 = 0; t0 < toks.size(); t0 += t0 == 0 ? 24 : 1) {
      BatchEntry be;
      be.seq = &seq;
      be.tokens = std::span<const TokenId>(toks.data() + t0, t0 == 0 ? 24 : 1);
      be.logits_from = 0;
      const Status s = engine_->forward(
          {&be, 1}, [&](int, int, const float* l) { out.insert(out.end(), l, l + nv); });
      EXPECT_TRUE(s.ok()) << s.to_string();
    }
    return out;
  }
  std::unique_ptr<Model> model_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Engine> engine_;
};

// A policy decides once per shared cache: it compacts the global layers that hold their own keys
// (2 and 4), and the layer that reads layer 4's (6) sees what it kept; the sliding layers keep
// their window and the shared ones hold nothing. Before any eviction the logits are the full
// cache's bit for bit; after, they stay finite.
TEST_F(Gemma4Test, APolicyCompressesTheLayersThatHoldKeys) {
  Sequence full(model_->hparams(), KvType::kF32, policy("full"));
  Sequence d2o(model_->hparams(), KvType::kF32, policy("d2o:budget=16"));
  const std::vector<float> a = run(full), b = run(d2o);
  ASSERT_EQ(a.size(), b.size());
  const size_t prompt = 24 * static_cast<size_t>(model_->hparams().n_vocab);
  for (size_t i = 0; i < prompt; ++i) ASSERT_EQ(a[i], b[i]) << "prompt logit " << i;
  for (float x : b) ASSERT_TRUE(std::isfinite(x));
  EXPECT_NE(a, b);  // the evictions changed something
  for (int il : {2, 4}) {
    EXPECT_LE(d2o.cache().layer(il).n_slot(), 17) << il;
    EXPECT_EQ(full.cache().layer(il).n_slot(), 64) << il;
  }
  for (int il : {5, 6}) {
    EXPECT_EQ(d2o.cache().layer(il).n_slot(), 0) << il;
    EXPECT_EQ(full.cache().layer(il).n_slot(), 0) << il;
  }
}

// A budget above the sequence's length reproduces the full cache bit for bit, prompt and steps.
TEST_F(Gemma4Test, ABudgetAboveTheLengthIsTheFullCache) {
  std::vector<std::vector<float>> out;
  for (const char* spec : {"full", "d2o:budget=128", "h2o:budget=128", "snapkv:budget=128"}) {
    Sequence s(model_->hparams(), KvType::kF32, policy(spec));
    out.push_back(run(s));
    EXPECT_EQ(out.back(), out.front()) << spec;
  }
}

}  // namespace
}  // namespace d2o
