#include "runtime/vocab.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "runtime/unicode.h"

namespace d2o {
namespace {

// GGUF token types (tokenizer.ggml.token_type) -> attributes.
uint32_t attr_from_type(int64_t type) {
  switch (type) {
    case 1:
      return kAttrNormal;
    case 2:
      return kAttrUnknown;
    case 3:
      return kAttrControl;
    case 4:
      return kAttrUserDefined;
    case 5:
      return kAttrUnused;
    case 6:
      return kAttrByte;
    default:
      return kAttrUndefined;  // 0 (undefined) and anything unknown
  }
}

using TextList = std::initializer_list<std::string_view>;

bool is_one_of(std::string_view s, TextList list) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

// Texts by which llama.cpp recognises special tokens that the metadata does not name.
const TextList kEotTexts = {"<|eot_id|>",
                            "<|im_end|>",
                            "<|end|>",
                            "<end_of_turn>",
                            "<|endoftext|>",
                            "<|end_of_text|>",
                            "<EOT>",
                            "_<EOT>",
                            "[EOT]",
                            "<\xEF\xBD\x9C"
                            "end\xE2\x96\x81"
                            "of\xE2\x96\x81"
                            "sentence\xEF\xBD\x9C>",
                            "<end_of_utterance>"};
const TextList kFimPreTexts = {"<|fim_prefix|>",
                               "<fim-prefix>",
                               "<fim_prefix>",
                               "<\xEF\xBD\x9C"
                               "fim\xE2\x96\x81"
                               "begin\xEF\xBD\x9C>",
                               "<PRE>",
                               "\xE2\x96\x81<PRE>",
                               "<|code_prefix|>",
                               "<|prefix|>"};
const TextList kFimSufTexts = {"<|fim_suffix|>",
                               "<fim-suffix>",
                               "<fim_suffix>",
                               "<\xEF\xBD\x9C"
                               "fim\xE2\x96\x81"
                               "hole\xEF\xBD\x9C>",
                               "<SUF>",
                               "\xE2\x96\x81<SUF>",
                               "<|code_suffix|>",
                               "<|suffix|>"};
const TextList kFimMidTexts = {"<|fim_middle|>",
                               "<fim-middle>",
                               "<fim_middle>",
                               "<\xEF\xBD\x9C"
                               "fim\xE2\x96\x81"
                               "end\xEF\xBD\x9C>",
                               "<MID>",
                               "\xE2\x96\x81<MID>",
                               "<|code_middle|>",
                               "<|middle|>"};
const TextList kFimPadTexts = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
const TextList kFimRepTexts = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                               "<reponame>"};
bool is_eog_text(std::string_view s) {
  return is_one_of(s, {"<|eot_id|>",
                       "<|im_end|>",
                       "<|end|>",
                       "<|return|>",
                       "<|call|>",
                       "<|flush|>",
                       "<|calls|>",
                       "<end_of_turn>",
                       "<|endoftext|>",
                       "</s>",
                       "<|eom_id|>",
                       "<EOT>",
                       "_<EOT>",
                       "[EOT]",
                       "[EOS]",
                       "<|end_of_text|>",
                       "<end_of_utterance>",
                       "<eos>",
                       "<turn|>",
                       "<|tool_response>",
                       "<\xEF\xBD\x9C"
                       "end\xE2\x96\x81"
                       "of\xE2\x96\x81"
                       "sentence\xEF\xBD\x9C>",
                       "[e~["});
}

// Piece of a token with special tokens rendered (llama.cpp's token-to-piece cache).
std::string make_piece(const Vocab& v, TokenId id) {
  const uint32_t a = v.attr[id];
  const std::string& t = v.text[id];
  if (a & (kAttrUnknown | kAttrControl | kAttrUserDefined)) return t;
  if (a & kAttrNormal) {
    if (v.type == VocabType::kSpm || !v.byte_encode) {
      // U+2581 (lower one eighth block) stands for a space.
      std::string out;
      for (size_t i = 0; i < t.size();) {
        if (t.compare(i, 3, "\xE2\x96\x81") == 0) {
          out.push_back(' ');
          i += 3;
        } else {
          out.push_back(t[i++]);
        }
      }
      return out;
    }
    // Byte-level BPE: each character stands for one byte. A character outside the byte
    // alphabet is written the way llama.cpp writes it.
    std::vector<uint32_t> cps;
    unicode::decode_utf8_lenient(t, cps);
    std::string out;
    for (uint32_t cp : cps) {
      const int b = unicode::char_to_byte(cp);
      if (b >= 0) {
        out.push_back(static_cast<char>(b));
        continue;
      }
      std::string utf8;
      unicode::append_utf8(cp, utf8);
      out += "[UNK_BYTE_0x";
      for (unsigned char c : utf8) {
        char hex[3];
        std::snprintf(hex, sizeof(hex), "%02x", c);
        out += hex;
      }
      out += t + "]";
    }
    return out;
  }
  if (a & kAttrByte) {
    // "<0xNN>": the byte NN. A malformed byte token yields its hex digits' value or 0.
    const std::string hex = t.size() >= 5 ? t.substr(3, 2) : std::string();
    return std::string(1, static_cast<char>(std::strtol(hex.c_str(), nullptr, 16)));
  }
  return std::string();
}

Status read_special_id(const GgufFile& f, const char* key, int32_t n_vocab, TokenId& id) {
  if (id >= n_vocab) id = -1;  // a default outside this vocabulary
  const GgufValue* v = f.find(key);
  if (!v) return Status();
  if (!v->is_integer()) {
    return format_error(std::string("metadata key '") + key + "' should be an integer");
  }
  // An id outside the vocabulary is ignored (the default stays), as llama.cpp does.
  if (v->i >= 0 && v->i < n_vocab) id = static_cast<TokenId>(v->i);
  return Status();
}

}  // namespace

Result<std::string> read_tokenizer_model(const GgufFile& file) {
  if (!file.find("tokenizer.ggml.model")) {
    return not_found(file.path() + ": no tokenizer in this GGUF (tokenizer.ggml.model is missing)");
  }
  D2O_ASSIGN_OR_RETURN(std::string model, file.get_string("tokenizer.ggml.model"));
  if (model == "gpt2" || model == "llama" || model == "gemma4") return model;
  // Kinds llama.cpp knows that d2o does not implement, named so the message says what is missing.
  std::string kind;
  if (model == "bert") kind = " (WordPiece, BERT-style encoders)";
  if (model == "t5") kind = " (SentencePiece Unigram, T5)";
  if (model == "rwkv") kind = " (RWKV's trie tokenizer)";
  if (model == "plamo2") kind = " (PLaMo 2's Aho-Corasick tokenizer)";
  return unsupported(file.path() + ": tokenizer model '" + model + "'" + kind +
                     " is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece "
                     "BPE), gemma4 (BPE over UTF-8, Gemma 4)");
}

Result<Vocab> load_vocab(const GgufFile& file, const VocabDefaults& defaults) {
  Vocab v;
  D2O_ASSIGN_OR_RETURN(v.model, read_tokenizer_model(file));
  v.type = v.model == "llama" ? VocabType::kSpm : VocabType::kBpe;
  if (v.model == "gemma4") {
    v.pre = "gemma4";  // Gemma 4 has one pre-tokenizer; the key is not read
  } else if (file.find("tokenizer.ggml.pre")) {
    D2O_ASSIGN_OR_RETURN(v.pre, file.get_string("tokenizer.ggml.pre"));
  } else {
    v.pre = "default";
  }
  if (file.find("general.name")) {
    D2O_ASSIGN_OR_RETURN(v.gguf_name, file.get_string("general.name"));
  }

  // Tokens, scores, types.
  const GgufValue* tokens = file.find("tokenizer.ggml.tokens");
  if (!tokens) return not_found(file.path() + ": tokenizer.ggml.tokens is missing");
  if (tokens->type != GgufType::kArray || tokens->array_type != GgufType::kString) {
    return format_error("tokenizer.ggml.tokens should be an array of strings");
  }
  const size_t n = tokens->strings.size();
  if (n == 0) return format_error("tokenizer.ggml.tokens is empty");
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max() / 2)) {
    return format_error("tokenizer.ggml.tokens has too many entries (" + std::to_string(n) + ")");
  }
  v.score.assign(n, 0.0f);
  if (const GgufValue* sv = file.find("tokenizer.ggml.scores")) {
    std::vector<float> scores;
    if (sv->type == GgufType::kArray && sv->array_type == GgufType::kInt32) {
      D2O_ASSIGN_OR_RETURN(std::vector<int64_t> is, file.get_int_array("tokenizer.ggml.scores"));
      scores.assign(is.begin(), is.end());
    } else {
      D2O_ASSIGN_OR_RETURN(scores, file.get_float_array("tokenizer.ggml.scores"));
    }
    if (scores.size() < n) {
      return format_error("tokenizer.ggml.scores has " + std::to_string(scores.size()) +
                          " entries for " + std::to_string(n) + " tokens");
    }
    std::copy(scores.begin(), scores.begin() + static_cast<ptrdiff_t>(n), v.score.begin());
  }
  v.attr.assign(n, kAttrNormal);
  if (file.find("tokenizer.ggml.token_type")) {
    D2O_ASSIGN_OR_RETURN(std::vector<int64_t> types,
                         file.get_int_array("tokenizer.ggml.token_type"));
    if (types.size() < n) {
      return format_error("tokenizer.ggml.token_type has " + std::to_string(types.size()) +
                          " entries for " + std::to_string(n) + " tokens");
    }
    for (size_t i = 0; i < n; ++i) v.attr[i] = attr_from_type(types[i]);
  }
  v.text.resize(n);
  v.text_to_id.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    std::string t = tokens->strings[i];
    if (t.empty()) t = "[EMPTY_" + std::to_string(i) + "]";
    v.text_to_id[t] = static_cast<TokenId>(i);
    v.text[i] = std::move(t);
  }
  const int32_t nv = v.n_vocab();

  // Flags.
  if (v.type == VocabType::kBpe) {
    v.add_space_prefix = false;
    v.clean_spaces = defaults.clean_spaces;
    v.add_bos = defaults.add_bos;
    v.ignore_merges = defaults.ignore_merges;
    v.byte_encode = defaults.byte_encode;
  } else {
    v.add_space_prefix = true;
    v.clean_spaces = false;
    v.add_bos = true;
    v.bos = 1;
    v.eos = 2;
    v.unk = 0;
  }
  D2O_ASSIGN_OR_RETURN(v.add_space_prefix,
                       file.get_bool_or("tokenizer.ggml.add_space_prefix", v.add_space_prefix));

  // Special ids.
  const struct {
    const char* key;
    TokenId* id;
  } kSpecial[] = {
      {"tokenizer.ggml.bos_token_id", &v.bos},
      {"tokenizer.ggml.eos_token_id", &v.eos},
      {"tokenizer.ggml.eot_token_id", &v.eot},
      {"tokenizer.ggml.eom_token_id", &v.eom},
      {"tokenizer.ggml.unknown_token_id", &v.unk},
      {"tokenizer.ggml.seperator_token_id", &v.sep},
      {"tokenizer.ggml.padding_token_id", &v.pad},
      {"tokenizer.ggml.mask_token_id", &v.mask},
      {"tokenizer.ggml.fim_pre_token_id", &v.fim_pre},
      {"tokenizer.ggml.fim_suf_token_id", &v.fim_suf},
      {"tokenizer.ggml.fim_mid_token_id", &v.fim_mid},
      {"tokenizer.ggml.fim_pad_token_id", &v.fim_pad},
      {"tokenizer.ggml.fim_rep_token_id", &v.fim_rep},
      {"tokenizer.ggml.fim_sep_token_id", &v.fim_sep},
      {"tokenizer.ggml.prefix_token_id", &v.fim_pre},
      {"tokenizer.ggml.suffix_token_id", &v.fim_suf},
      {"tokenizer.ggml.middle_token_id", &v.fim_mid},
  };
  for (const auto& s : kSpecial) D2O_RETURN_IF_ERROR(read_special_id(file, s.key, nv, *s.id));
  D2O_ASSIGN_OR_RETURN(v.add_bos, file.get_bool_or("tokenizer.ggml.add_bos_token", v.add_bos));
  D2O_ASSIGN_OR_RETURN(v.add_eos, file.get_bool_or("tokenizer.ggml.add_eos_token", v.add_eos));
  // Gemma 4 always starts with BOS, whatever the file says (as llama.cpp does).
  if (v.type == VocabType::kBpe && !v.byte_encode) v.add_bos = true;
  if (v.add_bos && v.bos < 0) {
    return format_error(
        "the vocabulary asks for a BOS token (tokenizer.ggml.add_bos_token) "
        "but has none (tokenizer.ggml.bos_token_id)");
  }
  if (v.add_eos && v.eos < 0) {
    return format_error(
        "the vocabulary asks for an EOS token (tokenizer.ggml.add_eos_token) "
        "but has none (tokenizer.ggml.eos_token_id)");
  }

  // Special tokens found by their text when the metadata does not name them; they are made
  // CONTROL (converters often miss it). llama.cpp takes the first match in hash-map order; the
  // first text of each list that the vocabulary has is taken here (end of turn before end of
  // text), which is what llama.cpp ends up with for Llama 3, Qwen2 and Phi-3.
  auto detect = [&](TokenId& slot, TextList texts) {
    if (slot != -1) return;
    for (std::string_view t : texts) {
      const TokenId id = v.find(t);
      if (id >= 0) {
        slot = id;
        v.attr[id] |= kAttrControl;
        return;
      }
    }
  };
  detect(v.eot, kEotTexts);
  detect(v.eom, {"<|eom_id|>"});
  detect(v.fim_pre, kFimPreTexts);
  detect(v.fim_suf, kFimSufTexts);
  detect(v.fim_mid, kFimMidTexts);
  detect(v.fim_pad, kFimPadTexts);
  detect(v.fim_rep, kFimRepTexts);
  detect(v.fim_sep, {"<|file_sep|>"});
  for (TokenId id = 0; id < nv; ++id) {
    if ((v.attr[id] & kAttrControl) && v.text[id].find("unused") != std::string::npos) {
      v.attr[id] |= kAttrUnused;
    }
  }

  // End-of-generation tokens.
  v.is_eog.assign(n, 0);
  for (TokenId id : {v.fim_pad, v.fim_rep, v.fim_sep, v.eos, v.eot, v.eom}) {
    if (id >= 0) v.is_eog[id] = 1;
  }
  for (TokenId id = 0; id < nv; ++id) {
    const std::string& t = v.text[id];
    if (is_eog_text(t)) {
      v.is_eog[id] = 1;
      v.attr[id] |= kAttrControl;
    }
    if (t == "<|channel|>" || t == "<|message|>" || t == "<|start|>" || t == "<|constrain|>") {
      v.attr[id] = kAttrUserDefined;  // gpt-oss: always rendered
    }
  }
  {
    // o200k_harmony / solar-open: "<|end|>" is not end-of-generation when "<|return|>" and
    // "<|call|>" (or "<|calls|>" and "<|flush|>") exist. gemma4 / plamo2: "</s>" is normal.
    auto eog_id = [&](std::string_view t) {
      TokenId id = v.find(t);
      return id >= 0 && v.is_eog[id] ? id : -1;
    };
    const TokenId end = eog_id("<|end|>");
    const bool has_return = eog_id("<|return|>") >= 0;
    const bool has_call = eog_id("<|call|>") >= 0 || eog_id("<|calls|>") >= 0;
    const bool has_flush = eog_id("<|flush|>") >= 0;
    if (end >= 0 && has_call && (has_return || has_flush)) {
      v.is_eog[end] = 0;
      v.attr[end] = kAttrUserDefined;
    }
    const TokenId s_end = eog_id("</s>");
    if (s_end >= 0 && (eog_id("<|tool_response>") >= 0 || eog_id("<|plamo:eos|>") >= 0)) {
      v.is_eog[s_end] = 0;
      v.attr[s_end] = kAttrNormal;
    }
  }

  // Special tokens matched as whole strings before pre-tokenization, longest first.
  for (TokenId id = 0; id < nv; ++id) {
    if (v.attr[id] & (kAttrControl | kAttrUserDefined | kAttrUnknown)) {
      v.special_tokens.push_back(id);
    }
  }
  std::stable_sort(v.special_tokens.begin(), v.special_tokens.end(),
                   [&](TokenId a, TokenId b) { return v.text[a].size() > v.text[b].size(); });

  if (v.type == VocabType::kSpm) {
    v.spm_words_independent = true;
    const std::string_view space = "\xE2\x96\x81";
    for (const std::string& t : v.text) {
      for (size_t q = t.find(space, 1); q != std::string::npos; q = t.find(space, q + 1)) {
        if (q >= 3 && std::string_view(t).substr(q - 3, 3) == space) continue;
        // The character before the space: step back over UTF-8 continuation bytes.
        size_t c = q - 1;
        while (c > 0 && (static_cast<uint8_t>(t[c]) & 0xC0) == 0x80) --c;
        const std::string glue = t.substr(c, q - c);
        if (unicode::utf8_scan(glue).length != glue.size() || !unicode::utf8_scan(glue).valid) {
          v.spm_words_independent = false;  // not UTF-8: give up on the shortcut
        } else if (std::find(v.spm_space_glue.begin(), v.spm_space_glue.end(), glue) ==
                   v.spm_space_glue.end()) {
          v.spm_space_glue.push_back(glue);
        }
      }
    }
    if (v.spm_space_glue.size() > 32) v.spm_words_independent = false;
  }

  v.piece.resize(n);
  for (TokenId id = 0; id < nv; ++id) v.piece[id] = make_piece(v, id);

  // Phi-3 (recognised by general.name, as llama.cpp does): special tokens swallow the
  // whitespace to their right when parsed, except <unk>, <s> and <|endoftext|>.
  std::string lname = v.gguf_name;
  for (char& c : lname) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lname.find("phi-3") != std::string::npos || lname.find("phi3") != std::string::npos) {
    for (TokenId id : v.special_tokens) v.attr[id] |= kAttrRstrip;
    if (TokenId id = v.find("</s>"); id >= 0) v.attr[id] |= kAttrRstrip;
    for (const char* t : {"<unk>", "<s>", "<|endoftext|>"}) {
      if (TokenId id = v.find(t); id >= 0) v.attr[id] &= ~kAttrRstrip;
    }
  }
  return v;
}

}  // namespace d2o
