// ChatTemplate vs the real Jinja templates, rendered with jinja2 by scripts/gen_chat_fixtures.py
// (tests/data/chat/expected.json): SmolLM2's, Qwen2's and Phi-3 mini's templates are recognised
// from their GGUF files; the others (ChatML, Llama 3, Llama 3.1, Llama 2, Mistral, Gemma 2,
// Phi-3.5) are chosen by name. Also: recognition markers, errors, BOS handling, Jinja's trim.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"
#include "tokenizer_test_util.h"

namespace d2o {
namespace {

std::vector<ChatMessage> to_messages(const nlohmann::json& j) {
  std::vector<ChatMessage> m;
  for (const auto& x : j) m.push_back({x.at("role").get<std::string>(), x.at("content")});
  return m;
}

// Builds the template a fixture case names; empty when its GGUF is not available here.
std::optional<ChatTemplate> build(const std::string& how, std::string* skip_reason) {
  if (how.rfind("name:", 0) == 0) {
    auto t = ChatTemplate::from_name(how.substr(5));
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    if (t.ok()) return *t;
    return std::nullopt;
  }
  std::string path;
  if (how == "gguf:smollm2") {
    path = test::smollm_path();
  } else if (!test::vocab_dir().empty()) {
    path = test::vocab_dir() + "/ggml-vocab-" + how.substr(5) + ".gguf";
  }
  if (path.empty()) {
    *skip_reason = how + " not found (set D2O_MODEL / D2O_VOCAB_DIR)";
    return std::nullopt;
  }
  auto f = GgufFile::open(path);
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  if (!f.ok()) return std::nullopt;
  auto t = ChatTemplate::from_gguf(**f);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  if (t.ok()) return *t;
  return std::nullopt;
}

TEST(ChatTemplate, MatchesJinjaRenderings) {
  const auto j = nlohmann::json::parse(
      test::read_file_bytes(std::string(D2O_TEST_DATA_DIR) + "/chat/expected.json"));
  size_t checked = 0, by_name = 0;
  std::string skipped;
  for (const auto& c : j.at("cases")) {
    const std::string id = c.at("template");
    const std::string how = c.at("build");
    by_name += how.rfind("name:", 0) == 0;
    std::string reason;
    auto t = build(how, &reason);
    if (!t) {
      if (!reason.empty()) skipped = reason;
      continue;
    }
    EXPECT_EQ(t->name(), c.at("format").get<std::string>()) << id;
    const auto messages =
        to_messages(j.at("conversations").at(c.at("conversation").get<std::string>()));
    const std::string got = t->apply(messages, c.at("add_generation_prompt").get<bool>());
    EXPECT_EQ(got, c.at("expected").get<std::string>())
        << id << " / " << c.at("conversation")
        << " / add_generation_prompt=" << c.at("add_generation_prompt");
    ++checked;
  }
  EXPECT_GE(by_name, 30u);
  EXPECT_GE(checked, by_name) << skipped;
  if (!skipped.empty()) std::printf("note: some GGUF-based cases skipped: %s\n", skipped.c_str());
}

TEST(ChatTemplate, SmolLM2DefaultSystemPromptAndEncoding) {
  const std::string path = test::smollm_path();
  if (path.empty()) GTEST_SKIP() << "SmolLM2 model not found: set D2O_MODEL";
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f.ok());
  auto t = ChatTemplate::from_gguf(**f);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->format(), ChatFormat::kChatML);
  EXPECT_EQ(t->default_system_prompt(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(t->stop_strings(), std::vector<std::string>{"<|im_end|>"});
  const std::string prompt = t->apply({{"user", "Hi"}}, true);
  EXPECT_EQ(prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // Encoded with special tokens parsed, the markers are single control tokens.
  auto tok = Tokenizer::from_gguf(**f);
  ASSERT_TRUE(tok.ok());
  EncodeOptions o;
  o.parse_special = true;
  auto ids = (*tok)->encode(prompt, o);
  ASSERT_TRUE(ids.ok());
  const TokenId im_start = *(*tok)->find_token("<|im_start|>");
  const TokenId im_end = *(*tok)->find_token("<|im_end|>");
  EXPECT_EQ(ids->front(), im_start);
  EXPECT_EQ(std::count(ids->begin(), ids->end(), im_start), 3);
  EXPECT_EQ(std::count(ids->begin(), ids->end(), im_end), 2);
  EXPECT_TRUE((*tok)->is_eog(im_end));
  EXPECT_EQ(*(*tok)->decode(*ids, true), prompt);
}

TEST(ChatTemplate, RecognitionByMarkers) {
  struct Case {
    const char* text;
    ChatFormat format;
  };
  const Case cases[] = {
      {"{{'<|im_start|>' + m['role'] + '\\n'}}", ChatFormat::kChatML},
      {"'<|start_header_id|>' + r + '<|end_header_id|>\\n\\n'", ChatFormat::kLlama3},
      {"<|start_header_id|>x<|end_header_id|> Cutting Knowledge Date: ...", ChatFormat::kLlama31},
      {"bos_token + '[INST] ' + '<<SYS>>\\n'", ChatFormat::kLlama2},
      {"{{ '[INST] ' + content + ' [/INST]' }}", ChatFormat::kMistral},
      {"'<start_of_turn>' + role", ChatFormat::kGemma},
      {"'<|user|>' + c + '<|end|>' + '<|assistant|>'", ChatFormat::kPhi3},
  };
  for (const Case& c : cases) {
    auto t = ChatTemplate::from_template(c.text, "", "");
    ASSERT_TRUE(t.ok()) << c.text << ": " << t.status().to_string();
    EXPECT_EQ(t->format(), c.format) << c.text;
  }
  // ChatML without an injected system prompt has none; a quoted one is found and unescaped.
  EXPECT_EQ(ChatTemplate::from_template("<|im_start|>", "", "")->default_system_prompt(), "");
  EXPECT_EQ(ChatTemplate::from_template("{% if messages[0]['role'] != 'system' %}{{ "
                                        "'<|im_start|>system\\nBe brief.\\nThanks<|im_end|>\\n' "
                                        "}}{% endif %}",
                                        "", "")
                ->default_system_prompt(),
            "Be brief.\nThanks");
  // Mistral v0.1: a space after each </s>.
  auto v01 = ChatTemplate::from_template(
      "{{ bos_token }}{{ '[INST] ' + c + ' [/INST]' }}{{ c + eos_token + ' ' }}", "", "");
  ASSERT_TRUE(v01.ok());
  EXPECT_EQ(v01->apply({{"user", "a"}, {"assistant", "b"}, {"user", "c"}}, true),
            "<s>[INST] a [/INST]b</s> [INST] c [/INST]");
}

TEST(ChatTemplate, Errors) {
  auto unknown = ChatTemplate::from_template("{{ messages }} <|weird|>", "", "");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(unknown.status().message().find("chatml"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("--chat-template"), std::string::npos);

  auto bad_name = ChatTemplate::from_name("vicuna");
  ASSERT_FALSE(bad_name.ok());
  EXPECT_EQ(bad_name.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_name.status().message().find("llama3"), std::string::npos);

  GgufWriter w;
  w.add_string("general.architecture", "llama");
  auto bytes = w.to_bytes();
  auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "none.gguf");
  ASSERT_TRUE(f.ok());
  auto none = ChatTemplate::from_gguf(**f);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("no chat template"), std::string::npos);

  EXPECT_EQ(ChatTemplate::supported_names().size(), 7u);
}

TEST(ChatTemplate, BosTextsAndGemmaSystem) {
  // BOS / EOS texts come from the GGUF's vocabulary.
  GgufWriter w;
  w.add_string("tokenizer.chat_template", "{{ bos_token }}'[INST] ' ' [/INST]'");
  w.add_string_array("tokenizer.ggml.tokens", {"<unk>", "<B>", "<E>"});
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  auto bytes = w.to_bytes();
  auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "m.gguf");
  ASSERT_TRUE(f.ok());
  auto t = ChatTemplate::from_gguf(**f);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->format(), ChatFormat::kMistral);
  const std::vector<ChatMessage> conv = {{"user", "q"}, {"assistant", "a"}};
  EXPECT_EQ(t->apply(conv, true), "<B>[INST] q [/INST]a<E>");
  ChatApplyOptions o;
  o.skip_bos = true;
  EXPECT_EQ(t->apply(conv, o), "[INST] q [/INST]a<E>");

  // Gemma: a system message prefixes the first user turn (Gemma 3's template); the assistant
  // is "model"; contents are trimmed.
  auto g = ChatTemplate::from_name("gemma");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->apply({{"system", "Be kind."}, {"user", " hi "}, {"assistant", "hello\n"}}, true),
            "<bos><start_of_turn>user\nBe kind.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
            "hello<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(g->stop_strings(), std::vector<std::string>{"<end_of_turn>"});
}

TEST(ChatTemplate, JinjaTrimIsPythonStrip) {
  EXPECT_EQ(jinja_trim("  a b \n"), "a b");
  EXPECT_EQ(jinja_trim("\x1c\x1f x \x1d"), "x");        // str.isspace() is true
  EXPECT_EQ(jinja_trim("\xE3\x80\x80x\xC2\xA0"), "x");  // U+3000, U+00A0
  EXPECT_EQ(jinja_trim("\xE2\x80\x8Bx\xE2\x80\x8B"), "\xE2\x80\x8Bx\xE2\x80\x8B");  // U+200B not
  EXPECT_EQ(jinja_trim(" \t\n"), "");
  EXPECT_EQ(jinja_trim(""), "");
}

}  // namespace
}  // namespace d2o
