// gemma4 files as d2o reads them: the hyper-parameters llama.cpp reads (the per-layer sliding
// pattern, each kind's head width, the layers that reuse earlier layers' keys and values, the
// per-layer embedding width), and files that get them wrong refused with a message naming what.
// The forward pass is not in this build: loading the model is refused, naming what it lacks.
#include <gtest/gtest.h>

#include "common/random_model.h"
#include "gguf/gguf.h"
#include "model/hparams.h"
#include "model/model.h"

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

// What this build does not run is refused when the model loads, named (and not a crash).
TEST(Gemma4Load, ForwardNotYetRunIsRefusedNamingWhat) {
  const std::vector<uint8_t> bytes =
      test::make_random_model(test::random_gemma4_config()).to_bytes();
  auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "test.gguf");
  ASSERT_TRUE(f.ok());
  auto m = Model::load(**f);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnsupported) << m.status().to_string();
  for (const char* needle : {"gemma4", "per-layer token embeddings (16 wide)",
                             "sliding (32) and global (64)", "shared by the last 2 layers"}) {
    EXPECT_NE(m.status().message().find(needle), std::string::npos) << m.status().to_string();
  }
}

}  // namespace
}  // namespace d2o
