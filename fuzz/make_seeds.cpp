// Writes the seed corpora of the fuzz targets into DIR/<target>/ (fuzz/corpus/ in the
// repository): GGUF files made with GgufWriter, texts, templates, specs and id lists.
//   fuzz_make_seeds DIR
// Deterministic: rerunning it rewrites the same files.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuzz_session.h"
#include "fuzz_vocabs.h"
#include "gguf/gguf_writer.h"
#include "kv/policy.h"
#include "runtime/chat_template.h"

namespace {

namespace fs = std::filesystem;
using d2o::GgmlType;
using d2o::GgufWriter;

fs::path g_root;

void put(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = g_root / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}
void put(const std::string& target, const std::string& name, const std::vector<uint8_t>& b) {
  put(target, name, std::string(b.begin(), b.end()));
}

std::vector<uint8_t> f32_bytes(size_t n) {
  std::vector<uint8_t> b(n * 4);
  for (size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(i) * 0.25f - 1.0f;
    std::memcpy(&b[i * 4], &x, 4);
  }
  return b;
}

void gguf_seeds() {
  {  // every metadata type, a few tensors of different types and shapes
    GgufWriter w;
    w.add_string("general.architecture", "llama");
    w.add_string("general.name", "seed");
    w.add_u32("llama.block_count", 2);
    w.add_i32("llama.context_length", 128);
    w.add_u64("general.file_type", 7);
    w.add_f32("llama.rope.freq_base", 10000.0f);
    w.add_bool("tokenizer.ggml.add_bos_token", true);
    w.add_string_array("tokenizer.ggml.tokens", {"a", "b", "c"});
    w.add_i32_array("tokenizer.ggml.token_type", {1, 1, 1});
    w.add_f32_array("tokenizer.ggml.scores", {0.0f, -1.0f, -2.0f});
    w.add_tensor("token_embd.weight", GgmlType::kF32, {8, 3}, f32_bytes(24));
    w.add_tensor("output_norm.weight", GgmlType::kF16, {8}, std::vector<uint8_t>(16, 0x3c));
    w.add_tensor("blk.0.attn_q.weight", GgmlType::kQ8_0, {32, 2}, std::vector<uint8_t>(68, 1));
    w.add_tensor("blk.0.ffn_up.weight", GgmlType::kQ4_0, {32, 1, 1, 2},
                 std::vector<uint8_t>(36, 0x11));
    put("fuzz_gguf", "model_v3", w.to_bytes());
    w.set_version(2);
    put("fuzz_gguf", "model_v2", w.to_bytes());
  }
  {  // another alignment
    GgufWriter w;
    w.set_alignment(64);
    w.add_tensor("a", GgmlType::kF32, {4}, f32_bytes(4));
    w.add_tensor("b", GgmlType::kF32, {2, 2}, f32_bytes(4));
    put("fuzz_gguf", "align64", w.to_bytes());
  }
  put("fuzz_gguf", "empty", GgufWriter().to_bytes());
  put("fuzz_gguf", "vocab_bpe", d2o::fuzz::bpe_vocab_writer("gpt-2").to_bytes());
  put("fuzz_gguf", "vocab_spm", d2o::fuzz::spm_vocab_writer().to_bytes());
}

std::string le32(uint32_t v) {
  return std::string{static_cast<char>(v), static_cast<char>(v >> 8), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 24)};
}

const std::vector<std::string>& texts() {
  static const std::vector<std::string> t = {
      "Hello world! The quick brown fox, it's 2024.",
      "  leading spaces\tand\ttabs\n\nnew lines  ",
      "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80 1234567890",
      "<|im_start|>user\nhi<|im_end|><tool> x",
      "bad utf-8: \xC3 \xFF\xFE \xE2\x82 \xF0\x9F",
      "for (int i = 0; i < n; ++i) { x += y[i] * 2; }",
  };
  return t;
}

void vocab_seeds() {
  const auto vocabs = d2o::fuzz::all_vocabs();
  // fuzz_vocab: [length][GGUF][text]; one BPE per distinct pre-tokenizer family is plenty, the
  // fuzzer mutates the name.
  for (const char* pre : {"gpt-2", "llama-bpe", "qwen2", "smollm", "default"}) {
    GgufWriter w = d2o::fuzz::bpe_vocab_writer(pre);
    w.add_string("tokenizer.chat_template", "<|im_start|>{{ message['content'] }}<|im_end|>");
    const std::vector<uint8_t> g = w.to_bytes();
    const std::string bytes = le32(static_cast<uint32_t>(g.size())) +
                              std::string(g.begin(), g.end()) + texts()[0];
    put("fuzz_vocab", std::string("bpe-") + pre, bytes);
  }
  const std::vector<uint8_t> spm = d2o::fuzz::spm_vocab_writer().to_bytes();
  put("fuzz_vocab", "spm",
      le32(static_cast<uint32_t>(spm.size())) + std::string(spm.begin(), spm.end()) + texts()[2]);

  // fuzz_tokenizer: [vocabulary index][options][text], each text with every vocabulary.
  for (size_t v = 0; v < vocabs.size(); ++v) {
    for (size_t i = 0; i < texts().size(); ++i) {
      const uint8_t opts = i == 3 ? 3 : 0;  // the special-token text with add/parse special
      put("fuzz_tokenizer", vocabs[v].first + "-" + std::to_string(i),
          std::string{static_cast<char>(v), static_cast<char>(opts)} + texts()[i]);
    }
  }
}

// A string as FuzzedDataProvider::ConsumeRandomLengthString reads it: backslashes doubled, and
// a backslash followed by another character ends the string.
std::string fdp_string(const std::string& s) {
  std::string out;
  for (char c : s) {
    out += c;
    if (c == '\\') out += '\\';
  }
  return out + "\\ ";
}

void chat_seeds() {
  // Each family's markers as a template would contain them (see chat_template.cpp).
  const std::vector<std::pair<std::string, std::string>> templates = {
      {"chatml",
       "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
       "<|im_end|>\n{% endfor %}"},
      {"chatml_system",
       "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
       "{% endif %}<|im_start|>"},
      {"llama3", "<|start_header_id|>user<|end_header_id|>\n\n{{ c }}<|eot_id|>"},
      {"llama31", "<|start_header_id|>system<|end_header_id|>Cutting Knowledge Date<|eot_id|>"},
      {"llama2", "{{ bos_token }}[INST] <<SYS>>\n{{ s }}\n<</SYS>>\n\n{{ c }} [/INST]"},
      {"mistral", "{{ bos_token }}[INST] {{ c }} [/INST]{{ eos_token + ' ' }}"},
      {"gemma", "<start_of_turn>user\n{{ c }}<end_of_turn>\n<start_of_turn>model\n"},
      {"phi3", "<|system|>\n<|user|>\n{{ c }}<|end|>\n<|assistant|>\n"},
      {"unknown", "{{ messages }}"},
  };
  const std::string conversation = fdp_string("system") + fdp_string("Be brief.") +
                                   fdp_string("user") + fdp_string("  Hi there \xE3\x80\x80") +
                                   fdp_string("assistant") + fdp_string("Hello!") +
                                   fdp_string("user") + fdp_string("2+2?");
  for (const auto& [name, jinja] : templates) {
    put("fuzz_chat_template", name,
        fdp_string(jinja) + fdp_string("<s>") + fdp_string("</s>") + fdp_string("") +
            conversation);
  }
  for (const std::string& n : d2o::ChatTemplate::supported_names()) {
    put("fuzz_chat_template", "name_" + n,
        fdp_string("") + fdp_string("") + fdp_string("") + fdp_string(n) + conversation);
  }
}

void kv_spec_seeds() {
  // Each preset's canonical spec as the parser writes it, and a few variations.
  const std::vector<std::string> specs = {
      "full",           "streaming:budget=64", "streaming:ratio=0.5,sinks=2",
      "h2o:ratio=0.2",  "snapkv:budget=128",   "pyramidkv:ratio=0.3", "roco:budget=100",
      "cam:ratio=0.2",  "keydiff:budget=64",   "d2o:ratio=0.2,nm=3:1,beta=0.7"};
  for (const std::string& s : specs) {
    auto p = d2o::parse_kv_policy(s);
    if (!p.ok()) {
      std::fprintf(stderr, "seed spec '%s': %s\n", s.c_str(), p.status().to_string().c_str());
      continue;
    }
    const std::string name = s.substr(0, s.find(':'));
    put("fuzz_kv_spec", name, (*p)->spec());
    put("fuzz_kv_spec", name + "_short", s);
  }
}

void prompt_token_seeds() {
  const std::string n_vocab = "\x40\x01";  // 320 (little-endian)
  int i = 0;
  for (const char* list : {"1,2,3", "0", "319,7,  12", "-1", "1,,2", "99999999999999999999", ""}) {
    put("fuzz_prompt_tokens", "list" + std::to_string(i++), n_vocab + list);
  }
}

// fuzz_serve_request: [endpoint and variant][context - 1][JSON body], the bodies written by
// nlohmann-json as the server's own responses are. The variant byte: endpoint + 5 * (vocabulary
// + 2 * template), template = the index in ChatTemplate::supported_names(), their count = none.
void serve_request_seeds() {
  using json = nlohmann::json;
  const int n_templates = static_cast<int>(d2o::ChatTemplate::supported_names().size());
  auto put_body = [](const std::string& name, int endpoint, int vocab, int tmpl, int n_ctx,
                     const std::string& body) {
    const int b0 = endpoint + 5 * (vocab + 2 * tmpl);
    put("fuzz_serve_request", name,
        std::string{static_cast<char>(b0), static_cast<char>(n_ctx - 1)} + body);
  };
  const json conversation = json::array({{{"role", "system"}, {"content", "Be brief."}},
                                         {{"role", "user"}, {"content", "Hi there! caf\xC3\xA9"}},
                                         {{"role", "assistant"}, {"content", "Hello."}},
                                         {{"role", "user"}, {"content", "2+2?"}}});
  put_body("chat", 0, 0, 0, 256, json{{"model", "d2o"}, {"messages", conversation}}.dump());
  put_body("chat_stream", 0, 0, 0, 256,
           json{{"messages", conversation},
                {"stream", true},
                {"stream_options", {{"include_usage", true}}},
                {"max_tokens", 16},
                {"temperature", 0.7},
                {"top_p", 0.9},
                {"seed", 42}}
               .dump());
  put_body("chat_stop_list", 0, 0, 0, 128,
           json{{"messages", conversation}, {"stop", {"\n\n", "<|im_end|>"}}, {"n", 1}}.dump());
  put_body("chat_kv_session", 0, 0, 0, 200,
           json{{"messages", conversation},
                {"kv", "d2o:ratio=0.2,nm=3:1,beta=0.7"},
                {"session", "conv-1:a.b_c"},
                {"max_completion_tokens", 8}}
               .dump());
  put_body("chat_parts", 0, 1, 2, 256,
           json{{"messages",
                 json::array({{{"role", "developer"}, {"content", "Answer in French."}},
                              {{"role", "user"},
                               {"content", json::array({{{"type", "text"}, {"text", "One "}},
                                                        {{"type", "text"}, {"text", "two"}}})}},
                              {{"role", "assistant"}, {"content", nullptr}}})},
                {"temperature", nullptr}}
               .dump());
  put_body("chat_no_template", 0, 0, n_templates, 256, json{{"messages", conversation}}.dump());
  put_body("chat_too_long", 0, 0, 0, 8, json{{"messages", conversation}}.dump());
  put_body("chat_bad_role", 0, 0, 0, 256,
           json{{"messages", json::array({{{"role", "tool"}, {"content", "x"}}})}}.dump());
  put_body("completion", 1, 0, 0, 256,
           json{{"model", "d2o"}, {"prompt", "Once upon a time"}, {"max_tokens", 32},
                {"stop", "."}}.dump());
  put_body("completion_array", 1, 1, 0, 64,
           json{{"prompt", {"Hello world"}}, {"seed", -1}, {"temperature", 0},
                {"max_tokens", 70}}.dump());
  put_body("completion_big_numbers", 1, 0, 0, 256,
           json{{"prompt", "x"}, {"max_tokens", 18446744073709551615ull},
                {"seed", 9223372036854775807ll}, {"top_p", 1e-300}}.dump());
  put_body(
      "completion_echo_ids", 1, 0, 0, 64,
      json{{"prompt", {5, 6, 7, 8}}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 3}}.dump());
  put_body("completion_batch_context_end", 1, 1, 0, 128,
           json{{"prompt", json::array({"Hello world", {9, 10, 11}})},
                {"context_end", {1, 2}},
                {"logprobs", 0},
                {"max_tokens", 2}}
               .dump());
  put_body("chat_top_logprobs", 0, 0, 0, 256,
           json{{"messages", conversation}, {"logprobs", true}, {"top_logprobs", 2}}.dump());
  put_body("completion_not_object", 1, 0, 0, 256, "[\"prompt\"]");
  put_body("completion_broken", 1, 0, 0, 256, "{\"prompt\": \"x\", ");
  put_body("tokenize", 2, 0, 0, 256,
           json{{"content", "Hello <|im_start|> world"}, {"add_special", true},
                {"parse_special", true}}.dump());
  put_body("tokenize_spm", 2, 1, 0, 256, json{{"content", texts()[2]}}.dump());
  put_body("tokenize_vllm", 2, 0, 0, 256,
           json{{"prompt", "Hello <|im_end|> world"}, {"add_special_tokens", false}}.dump());
  put_body("detokenize", 3, 0, 0, 256, json{{"tokens", {1, 2, 3, 300, 385}}}.dump());
  put_body("detokenize_bad", 3, 1, 0, 256, json{{"tokens", {-1, 100000}}}.dump());
  put_body("session_id", 4, 0, 0, 256, "conv-1:a.b_c");
  put_body("session_id_bad", 4, 0, 0, 256, "bad id/..");
}

void session_seeds() {
  // Conversations of 20 tokens under each kind of policy state (none, budgets, D2O thresholds
  // and merges, shifted positions), as fuzz_session_file reads them.
  const d2o::serve::SessionFileContext ctx = d2o::fuzz::session_context();
  int i = 0;
  for (const char* spec : {"full", "h2o:budget=8", "d2o:budget=8", "streaming:budget=8,pos=shift",
                           "cam:budget=8"}) {
    auto p = d2o::parse_kv_policy(spec);
    if (!p.ok()) continue;
    d2o::KvCache cache(ctx.cache);
    d2o::PolicyState state;
    int64_t n_past = 0;
    std::vector<int32_t> tokens;
    for (int t = 0; t < 20; ++t) {
      tokens.push_back((t * 7) % 64);
      if (!d2o::fuzz::feed_token(**p, cache, state, n_past, 0.1f * static_cast<float>(t % 5) - 0.2f)
               .ok())
        std::fprintf(stderr, "seed session '%s': the policy failed\n", spec);
    }
    std::string b;
    const d2o::Status s = d2o::serve::encode_session(ctx, "seed-" + std::to_string(i),
                                                     (*p)->spec(), tokens, n_past, cache, state, b);
    if (!s.ok()) {
      std::fprintf(stderr, "seed session '%s': %s\n", spec, s.to_string().c_str());
      continue;
    }
    put("fuzz_session_file", "session" + std::to_string(i++), b);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds DIR\n");
    return 2;
  }
  g_root = argv[1];
  gguf_seeds();
  vocab_seeds();
  chat_seeds();
  kv_spec_seeds();
  prompt_token_seeds();
  serve_request_seeds();
  session_seeds();
  return 0;
}
