// A model file whose tokenizer is one of the newer kinds loads and runs the way every model does
// (Model::load, Tokenizer::from_gguf, Engine, generate): a random-weight llama model carrying
// DeepSeek LLM's vocabulary (a llama-architecture model with its own pre-tokenizer), and the
// same model carrying a tokenizer kind this build does not have, which must be refused by name.
#include <gtest/gtest.h>

#include "common/random_model.h"
#include "common/test_util.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "kv/policy/composed.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/tokenizer.h"
#include "tokenizer_test_util.h"

namespace d2o {
namespace {

// Copies the tokenizer.* metadata of `from` into `w` (the key types the vocab files use).
Status copy_tokenizer_keys(const GgufFile& from, GgufWriter& w) {
  for (const auto& [key, v] : from.metadata()) {
    if (key.rfind("tokenizer.", 0) != 0 || key.rfind("tokenizer.chat_template", 0) == 0) continue;
    if (v.type == GgufType::kString) {
      w.add_string(key, v.str);
    } else if (v.type == GgufType::kBool) {
      w.add_bool(key, v.i != 0);
    } else if (v.is_integer()) {
      w.add_u32(key, static_cast<uint32_t>(v.i));
    } else if (v.type == GgufType::kArray && v.array_type == GgufType::kString) {
      w.add_string_array(key, v.strings);
    } else if (v.type == GgufType::kArray && v.array_type == GgufType::kFloat32) {
      D2O_ASSIGN_OR_RETURN(std::vector<float> f, from.get_float_array(key));
      w.add_f32_array(key, f);
    } else if (v.type == GgufType::kArray) {
      D2O_ASSIGN_OR_RETURN(std::vector<int64_t> i, from.get_int_array(key));
      w.add_i32_array(key, std::vector<int32_t>(i.begin(), i.end()));
    }
  }
  return Status();
}

// A one-layer llama model as small as a 100k-token embedding allows, with `vocab`'s tokenizer.
std::string write_model_with_vocab(const std::string& vocab, const std::string& out_name) {
  auto vf = GgufFile::open(test::vocab_file(vocab));
  EXPECT_TRUE(vf.ok()) << vf.status().to_string();
  if (!vf.ok()) return "";
  test::RandomModelConfig cfg;
  cfg.n_layer = 1;
  cfg.n_embd = 16;
  cfg.n_head = 2;
  cfg.n_head_kv = 1;
  cfg.n_ff = 16;
  cfg.n_vocab = static_cast<int>((*vf)->find("tokenizer.ggml.tokens")->array_size);
  cfg.synthetic_tokenizer = false;
  GgufWriter w = test::make_random_model(cfg);
  EXPECT_TRUE(copy_tokenizer_keys(**vf, w).ok());
  const std::string path = test::scratch_path(out_name);
  EXPECT_TRUE(w.write(path).ok());
  return path;
}

TEST(TokenizerModelFile, LlamaModelWithDeepseekVocabularyLoadsAndGenerates) {
  if (test::vocab_file("deepseek-llm").empty()) {
    GTEST_SKIP() << "ggml-vocab-deepseek-llm.gguf not found: run scripts/setup.sh --test-data";
  }
  const std::string path = write_model_with_vocab("deepseek-llm", "tok_deepseek_llama.gguf");
  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto model = Model::load(**file);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  auto tok = Tokenizer::from_gguf(**file);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ((*tok)->pre_tokenizer(), "deepseek-llm");
  EXPECT_EQ((*tok)->n_vocab(), (*model)->hparams().n_vocab);

  auto prompt = (*tok)->encode("Hello world! 3.14", EncodeOptions{});
  ASSERT_TRUE(prompt.ok());
  EXPECT_EQ(prompt->front(), (*tok)->bos());  // DeepSeek asks for BOS
  EXPECT_EQ(*(*tok)->decode(*prompt, false), "Hello world! 3.14");
  ThreadPool pool(1);
  Engine engine(**model, pool, EngineOptions{});
  Sequence seq((*model)->hparams(), KvType::kF16,
               std::shared_ptr<const KvPolicy>(parse_kv_policy("full").value()));
  GenerateParams gp;
  gp.n_predict = 4;
  gp.sampling.temperature = 0;
  gp.stop_at_eog = false;
  auto out = generate(engine, **tok, seq, *prompt, gp, nullptr);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->tokens.size(), 4u);
}

TEST(TokenizerModelFile, UnknownTokenizerKindIsRefusedByName) {
  test::RandomModelConfig cfg;
  cfg.n_layer = 1;
  cfg.n_embd = 16;
  cfg.n_head = 2;
  cfg.n_head_kv = 1;
  cfg.n_ff = 16;
  cfg.n_vocab = 8;
  cfg.synthetic_tokenizer = false;
  GgufWriter w = test::make_random_model(cfg);
  w.add_string("tokenizer.ggml.model", "t5");
  w.add_string_array("tokenizer.ggml.tokens", {"<pad>", "</s>", "<unk>", "a", "b", "c", "d", "e"});
  const std::string path = test::scratch_path("tok_t5_llama.gguf");
  ASSERT_TRUE(w.write(path).ok());
  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  ASSERT_TRUE(Model::load(**file).ok());
  auto tok = Tokenizer::from_gguf(**file);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(tok.status().message().find("tokenizer model 't5' (SentencePiece Unigram"),
            std::string::npos)
      << tok.status().message();
}

}  // namespace
}  // namespace d2o
