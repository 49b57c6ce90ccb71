// gemma4 files as d2o reads them: the hyper-parameters llama.cpp reads (the per-layer sliding
// pattern, each kind's head width, the layers that reuse earlier layers' keys and values, the
// per-layer embedding width), and files that get them wrong refused with a message naming what.
#include <gtest/gtest.h>

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

// The full cache runs; a compressing policy is refused with a message naming the policy and why
// (the shared layers' slots belong to the layers they read), rather than compacting them.
TEST(Gemma4Load, CompressingPolicyIsRefused) {
  auto m = load(test::make_random_model(test::random_gemma4_config()).to_bytes());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  ThreadPool pool(1);
  Engine engine(**m, pool, EngineOptions{});
  const std::vector<TokenId> tokens = test::random_model_tokens(12, 300);
  auto feed = [&](std::shared_ptr<const KvPolicy> pol) {
    Sequence seq((*m)->hparams(), KvType::kF32, std::move(pol));
    BatchEntry be;
    be.seq = &seq;
    be.tokens = tokens;
    be.logits_from = static_cast<int>(tokens.size()) - 1;
    return engine.forward({&be, 1}, [](int, int, const float*) {});
  };
  EXPECT_TRUE(feed(nullptr).ok());
  auto pol = parse_kv_policy("h2o:ratio=0.5");
  ASSERT_TRUE(pol.ok()) << pol.status().to_string();
  const Status st = feed(std::shared_ptr<const KvPolicy>(std::move(pol).value()));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  EXPECT_NE(st.message().find("gemma4"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace d2o
