// Model::load on writer-made files of the llama family's variants: Qwen 3's QK-norm tensors,
// Qwen 3 MoE's experts and Llama 3.1's RoPE frequency factors load, and files that get them wrong
// (missing or misshapen norms or expert tensors, more experts per token than experts, a
// rope_freqs tensor of the wrong shape or with unusable values, or in an architecture that has
// none) are refused with a message naming what is wrong; the RoPE scaling keys are read as
// llama.cpp reads them, and those d2o cannot honour are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/random_model.h"
#include "gguf/gguf.h"
#include "model/model.h"

namespace d2o {
namespace {

Result<std::unique_ptr<Model>> load(const GgufWriter& w) {
  const std::vector<uint8_t> bytes = w.to_bytes();
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f,
                       GgufFile::from_memory(bytes.data(), bytes.size(), "test.gguf"));
  return Model::load(*f);  // copies every tensor: the bytes may go
}

// Expects `w` to be refused with `code` and a message containing every needle.
void expect_refused(const GgufWriter& w, StatusCode code,
                    std::initializer_list<std::string> needles) {
  auto m = load(w);
  ASSERT_FALSE(m.ok()) << "expected an error";
  EXPECT_EQ(m.status().code(), code) << m.status().to_string();
  for (const std::string& n : needles)
    EXPECT_NE(m.status().message().find(n), std::string::npos) << m.status().to_string();
}

std::vector<uint8_t> f32_bytes(size_t n, float v) {
  return test::f32_bytes(std::vector<float>(n, v));
}

TEST(ModelLoad, Qwen3AndLlama31FixturesLoad) {
  auto q = load(test::make_random_model(test::random_qwen3_config()));
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  EXPECT_EQ((*q)->hparams().arch, ModelArch::kQwen3);
  EXPECT_EQ((*q)->hparams().head_dim, 32);
  auto l = load(test::make_random_model(test::random_llama31_config()));
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ((*l)->rope_freq_factors(), test::random_llama31_config().rope_freqs);
}

TEST(ModelLoad, Qwen3WithoutItsQkNormsIsRefused) {
  for (const char* name : {"blk.0.attn_q_norm.weight", "blk.2.attn_k_norm.weight"}) {
    test::RandomModelConfig c = test::random_qwen3_config();
    c.omit_tensor = name;
    expect_refused(test::make_random_model(c), StatusCode::kNotFound,
                   {"test.gguf", std::string("tensor '") + name + "' is missing"});
  }
  // One of head_dim + 2 values.
  test::RandomModelConfig c = test::random_qwen3_config();
  c.omit_tensor = "blk.1.attn_k_norm.weight";
  GgufWriter w = test::make_random_model(c);
  w.add_tensor(c.omit_tensor, GgmlType::kF32, {c.head_dim + 2}, f32_bytes(34, 1.0f));
  expect_refused(w, StatusCode::kFormatError,
                 {"tensor 'blk.1.attn_k_norm.weight' has shape [34]", "expected 32 elements"});
}

// Phi-3's fused tensors: the parts of attn_qkv and ffn_up are the rows of the separate tensors
// (checked against llama.cpp in LlamaParity.RandomPhi3MatchesLlamaCpp); a fused tensor of the
// wrong shape and the LongRoPE factors of the 128K models are refused with messages.
TEST(ModelLoad, Phi3FusedTensorsLoadAndLongRopeIsRefused) {
  const test::RandomModelConfig c = test::random_phi3_config();
  auto m = load(test::make_random_model(c));
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ((*m)->hparams().arch, ModelArch::kPhi3);
  const int hd = c.n_embd / c.n_head;
  EXPECT_EQ((*m)->layer(0).wk.n_rows(), c.n_head_kv * hd);
  EXPECT_EQ((*m)->layer(0).w_up.n_rows(), c.n_ff);
  {
    test::RandomModelConfig bad = c;
    bad.omit_tensor = "blk.1.attn_qkv.weight";
    GgufWriter w = test::make_random_model(bad);
    const int rows = c.n_embd + 2 * c.n_head_kv * hd - 1;
    w.add_tensor(bad.omit_tensor, GgmlType::kF32, {c.n_embd, rows},
                 f32_bytes(static_cast<size_t>(c.n_embd) * rows, 0.1f));
    expect_refused(w, StatusCode::kFormatError, {"tensor 'blk.1.attn_qkv.weight' has shape"});
  }
  for (const char* name : {"rope_factors_long.weight", "rope_factors_short.weight"}) {
    GgufWriter w = test::make_random_model(c);
    w.add_tensor(name, GgmlType::kF32, {hd / 2}, f32_bytes(static_cast<size_t>(hd / 2), 1.0f));
    expect_refused(w, StatusCode::kUnsupported, {name, "LongRoPE"});
  }
}

// Qwen 3 MoE: the expert keys are read and checked, and a missing or misshapen expert tensor is
// refused with a message naming it.
TEST(ModelLoad, Qwen3MoeKeysAndExpertTensorsAreChecked) {
  auto m = load(test::make_random_model(test::random_qwen3moe_config()));
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ((*m)->hparams().arch, ModelArch::kQwen3Moe);
  for (const char* name :
       {"blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
        "blk.1.ffn_down_exps.weight", "blk.1.attn_k_norm.weight"}) {
    test::RandomModelConfig c = test::random_qwen3moe_config();
    c.omit_tensor = name;
    expect_refused(test::make_random_model(c), StatusCode::kNotFound,
                   {"test.gguf", std::string("tensor '") + name + "' is missing"});
  }
  {  // A stack of 7 experts where the keys say 8.
    test::RandomModelConfig c = test::random_qwen3moe_config();
    c.omit_tensor = "blk.0.ffn_down_exps.weight";
    GgufWriter w = test::make_random_model(c);
    const size_t n = static_cast<size_t>(c.n_ff_exp) * c.n_embd * 7;
    w.add_tensor(c.omit_tensor, GgmlType::kF32, {c.n_ff_exp, c.n_embd, 7}, f32_bytes(n, 0.1f));
    expect_refused(w, StatusCode::kFormatError,
                   {"tensor 'blk.0.ffn_down_exps.weight' has shape [48, 64, 7]",
                    "expected [48, 64, 8] (columns, rows, experts)"});
  }
  {  // More experts per token than the layer has.
    test::RandomModelConfig c = test::random_qwen3moe_config();
    c.n_expert_used = 9;
    expect_refused(test::make_random_model(c), StatusCode::kFormatError,
                   {"expert_used_count = 9 is more than expert_count = 8"});
  }
  {  // No expert keys at all.
    test::RandomModelConfig c = test::random_qwen3moe_config();
    c.n_expert = 0;
    expect_refused(test::make_random_model(c), StatusCode::kFormatError,
                   {"expert_count is missing"});
  }
}

TEST(ModelLoad, RopeFreqsOfTheWrongShapeAreRefused) {
  // 15 factors for 16 pairs.
  test::RandomModelConfig c = test::random_llama31_config();
  c.rope_freqs.pop_back();
  expect_refused(test::make_random_model(c), StatusCode::kFormatError,
                 {"tensor 'rope_freqs.weight' has shape [15]", "expected 16 elements"});
  // The right count as a matrix.
  c = test::random_llama31_config();
  c.rope_freqs.clear();
  GgufWriter w = test::make_random_model(c);
  w.add_tensor("rope_freqs.weight", GgmlType::kF32, {8, 2}, f32_bytes(16, 1.0f));
  expect_refused(w, StatusCode::kFormatError,
                 {"tensor 'rope_freqs.weight' has shape [8, 2]", "expected [16]"});
}

TEST(ModelLoad, RopeFreqsThatAreNotPositiveAndFiniteAreRefused) {
  for (float bad : {0.0f, -2.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    test::RandomModelConfig c = test::random_llama31_config();
    c.rope_freqs[5] = bad;
    expect_refused(test::make_random_model(c), StatusCode::kFormatError,
                   {"rope_freqs.weight", "at 5", "must be positive and finite"});
  }
}

// llama.cpp reads rope_freqs only in the llama architecture; elsewhere d2o refuses the file
// rather than rotate differently.
TEST(ModelLoad, RopeFreqsOutsideTheLlamaArchitectureAreRefused) {
  for (test::RandomModelConfig c : {test::random_qwen3_config(), test::random_qwen2_config()}) {
    const int head_dim = c.head_dim > 0 ? c.head_dim : c.n_embd / c.n_head;
    c.rope_freqs.assign(static_cast<size_t>(head_dim / 2), 2.0f);
    expect_refused(test::make_random_model(c), StatusCode::kUnsupported,
                   {"rope_freqs.weight", "not part of the " + c.arch + " architecture"});
  }
}

// The RoPE of a model loaded with the given extra keys (the file has none of its own).
Result<RopeParams> rope_with(const std::vector<std::pair<std::string, float>>& f32_keys,
                             const char* type) {
  GgufWriter w = test::make_random_model(test::RandomModelConfig{});
  if (type) w.add_string("llama.rope.scaling.type", type);
  for (const auto& [k, v] : f32_keys) w.add_f32(k, v);
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<Model> m, load(w));
  return m->desc().layers[0].rope;
}

// As llama.cpp: the type defaults to linear, the factor (or the older rope.scale_linear) divides
// positions unless the type is none, and a factor of 0 means none.
TEST(ModelLoad, RopeScalingKeysAreReadAsLlamaCppReadsThem) {
  struct Case {
    std::vector<std::pair<std::string, float>> keys;
    const char* type;
    float freq_scale;
  };
  const Case cases[] = {
      {{}, nullptr, 1.0f},
      {{{"llama.rope.scaling.factor", 4.0f}}, nullptr, 0.25f},
      {{{"llama.rope.scaling.factor", 4.0f}}, "linear", 0.25f},
      {{{"llama.rope.scaling.factor", 4.0f}}, "none", 1.0f},
      {{{"llama.rope.scaling.factor", 0.0f}}, "linear", 1.0f},
      {{{"llama.rope.scale_linear", 2.0f}}, nullptr, 0.5f},
      {{{"llama.rope.scale_linear", 2.0f}, {"llama.rope.scaling.factor", 8.0f}}, nullptr, 0.125f},
      {{{"llama.rope.scaling.attn_factor", 1.0f}}, nullptr, 1.0f},
  };
  for (const Case& c : cases) {
    auto r = rope_with(c.keys, c.type);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->freq_scale, c.freq_scale) << (c.type ? c.type : "(no type)");
  }
}

TEST(ModelLoad, RopeScalingThatD2oCannotHonourIsRefused) {
  for (const char* type : {"yarn", "longrope", "llama3"}) {
    auto r = rope_with({{"llama.rope.scaling.factor", 4.0f}}, type);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(r.status().message().find(std::string("rope.scaling.type '") + type + "'"),
              std::string::npos)
        << r.status().to_string();
  }
  auto r = rope_with({{"llama.rope.scaling.attn_factor", 0.5f}}, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(r.status().message().find("rope.scaling.attn_factor"), std::string::npos);
  for (float bad : {-2.0f, 1e-40f, std::numeric_limits<float>::infinity()}) {
    r = rope_with({{"llama.rope.scaling.factor", bad}}, "linear");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kFormatError);
    EXPECT_NE(r.status().message().find("rope.scaling.factor"), std::string::npos);
  }
}

}  // namespace
}  // namespace d2o
