#include "runtime/tokenizer.h"

#include "runtime/bpe.h"
#include "runtime/pretokenizer.h"
#include "runtime/unicode.h"
#include "runtime/vocab.h"

namespace d2o {
namespace {

constexpr size_t kMaxEncodeBytes = size_t{1} << 30;

// isspace() in the "C" locale, on bytes (llama.cpp strips these around lstrip/rstrip tokens).
bool is_c_space(char c) {
  return c == ' ' || (c >= '\t' && c <= '\r');
}

// Appends `text` with each space written as U+2581 (the SentencePiece and Gemma 4 convention).
void append_escaped_spaces(std::string_view text, std::string& out) {
  for (char c : text) {
    if (c == ' ') {
      out += "\xE2\x96\x81";
    } else {
      out.push_back(c);
    }
  }
}

// clean_up_tokenization_spaces, the three in-place passes of llama_detokenize.
void clean_spaces(std::string& t) {
  // 1. " ?", " !", " .", " ," lose the space.
  size_t n = t.size(), total = n ? 1 : 0;
  for (size_t i = 1; i < n; ++i) {
    const char x = t[i];
    if (t[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) --total;
    t[total++] = x;
  }
  // 2. " ' " becomes "'".
  n = total;
  total = n ? 1 : 0;
  for (size_t i = 1; i < n; ++i) {
    const char x = t[i];
    if (x == '\'' && i + 1 < n && t[i - 1] == ' ' && t[i + 1] == ' ') {
      --total;        // the space before
      t[++i] = '\0';  // and the one after (skipped)
    }
    t[total++] = x;
  }
  // 3. " 's", " 'm", " 're", " 've" lose the space (" 't", " 'd", " 'll" keep it).
  n = total;
  total = n ? 1 : 0;
  for (size_t i = 1; i < n; ++i) {
    const char x = t[i];
    if (t[i - 1] == ' ' && x == '\'' && i + 1 < n) {
      const char x1 = t[i + 1];
      if (x1 == 's' || x1 == 'm') {
        --total;
      } else if (x1 != 't' && x1 != 'd' && i + 2 < n) {
        const char x2 = t[i + 2];
        if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) --total;
      }
    }
    t[total++] = x;
  }
  t.resize(total);
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& file) {
  D2O_ASSIGN_OR_RETURN(std::string model, read_tokenizer_model(file));
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  VocabDefaults defaults;
  if (model == "gpt2" || model == "gemma4") {
    std::string pre = "default";
    if (model == "gpt2" && file.find("tokenizer.ggml.pre")) {
      D2O_ASSIGN_OR_RETURN(pre, file.get_string("tokenizer.ggml.pre"));
    }
    auto pt = model == "gemma4" ? PreTokenizer::create_gemma4() : PreTokenizer::create(pre);
    if (!pt.ok()) return pt.status().with_context(file.path());
    tok->pre_ = std::move(pt).value();
    defaults.add_bos = tok->pre_->traits().add_bos;
    defaults.clean_spaces = tok->pre_->traits().clean_spaces;
    defaults.ignore_merges = tok->pre_->traits().ignore_merges;
    defaults.byte_encode = tok->pre_->traits().byte_encode;
  }
  auto vocab = load_vocab(file, defaults);
  if (!vocab.ok()) return vocab.status().with_context(file.path());
  tok->vocab_ = std::make_unique<Vocab>(std::move(vocab).value());
  if (tok->vocab_->type == VocabType::kBpe) {
    auto merges = BpeMerges::build(*tok->vocab_, file);
    if (!merges.ok()) return merges.status().with_context(file.path());
    tok->merges_ = std::make_unique<BpeMerges>(std::move(merges).value());
  } else {
    tok->vocab_->pre.clear();
  }
  return tok;
}

std::vector<Tokenizer::Fragment> Tokenizer::partition(std::string_view text,
                                                      bool parse_special) const {
  std::vector<Fragment> frags;
  if (!text.empty()) frags.push_back({-1, 0, text.size()});
  std::vector<Fragment> next;
  for (TokenId id : vocab_->special_tokens) {
    const uint32_t attr = vocab_->attr[id];
    if (!parse_special && (attr & (kAttrControl | kAttrUnknown))) continue;
    const std::string& t = vocab_->text[id];
    // Cheap rejection: most special tokens never occur.
    if (text.find(t) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& f : frags) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      size_t off = f.offset;
      const size_t end = f.offset + f.length;
      const std::string_view window = text.substr(0, end);
      while (true) {
        const size_t m = window.find(t, off);
        if (m == std::string_view::npos) {
          if (off < end) next.push_back({-1, off, end - off});
          break;
        }
        size_t left_len = m - off;
        if (attr & kAttrLstrip) {
          while (left_len > 0 && is_c_space(text[off + left_len - 1])) --left_len;
        }
        if (left_len > 0) next.push_back({-1, off, left_len});
        next.push_back({id, 0, 0});
        size_t r = m + t.size();
        if (r >= end) break;
        if (attr & kAttrRstrip) {
          while (r < end && is_c_space(text[r])) ++r;
        }
        off = r;
      }
    }
    frags.swap(next);
  }
  return frags;
}

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text,
                                               const EncodeOptions& opts) const {
  if (text.size() > kMaxEncodeBytes) {
    return invalid_argument("text to encode is " + std::to_string(text.size()) +
                            " bytes; the limit is 1 GiB");
  }
  const Vocab& v = *vocab_;
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  if (opts.add_special && v.add_bos) out.push_back(v.bos);
  MergeScratch scratch;
  const std::vector<Fragment> frags = partition(text, opts.parse_special);
  std::string escaped;
  if (v.type == VocabType::kBpe) {
    PreTokenized words;
    for (const Fragment& f : frags) {
      if (f.token >= 0) {
        out.push_back(f.token);
        continue;
      }
      std::string_view piece = text.substr(f.offset, f.length);
      if (!v.byte_encode) {  // Gemma 4: spaces are U+2581 before splitting and merging
        escaped.clear();
        append_escaped_spaces(piece, escaped);
        piece = escaped;
      }
      D2O_RETURN_IF_ERROR(pre_->split(piece, words));
      uint32_t begin = 0;
      for (uint32_t end : words.word_ends) {
        merges_->encode_word_cached(v, std::string_view(words.text).substr(begin, end - begin),
                                    scratch, out);
        begin = end;
      }
    }
  } else {
    // SentencePiece: a space goes before the text at the start and after each special token;
    // spaces are written as U+2581.
    bool prev_special = true;
    for (const Fragment& f : frags) {
      if (f.token >= 0) {
        out.push_back(f.token);
        prev_special = true;
        continue;
      }
      escaped.clear();
      if (v.add_space_prefix && prev_special) escaped += "\xE2\x96\x81";
      append_escaped_spaces(text.substr(f.offset, f.length), escaped);
      spm_encode(v, escaped, scratch, out);
      prev_special = false;
    }
  }
  if (opts.add_special && v.add_eos) out.push_back(v.eos);
  return out;
}

Result<std::string> Tokenizer::token_to_piece(TokenId id, bool render_special) const {
  if (id < 0 || id >= n_vocab()) {
    return invalid_argument("token id " + std::to_string(id) + " is out of range [0, " +
                            std::to_string(n_vocab()) + ")");
  }
  if (!render_special && (vocab_->attr[id] & (kAttrUnknown | kAttrControl))) return std::string();
  return vocab_->piece[id];
}

Result<std::string> Tokenizer::decode(const std::vector<TokenId>& ids, bool render_special) const {
  std::string out;
  bool strip_space = vocab_->add_space_prefix;  // only for the first token
  for (TokenId id : ids) {
    D2O_ASSIGN_OR_RETURN(std::string piece, token_to_piece(id, render_special));
    if (strip_space && !piece.empty() && piece[0] == ' ') {
      out.append(piece, 1, std::string::npos);
    } else {
      out += piece;
    }
    strip_space = false;
  }
  if (vocab_->clean_spaces) clean_spaces(out);
  return out;
}

int32_t Tokenizer::n_vocab() const {
  return vocab_->n_vocab();
}
TokenId Tokenizer::bos() const {
  return vocab_->bos;
}
TokenId Tokenizer::eos() const {
  return vocab_->eos;
}
TokenId Tokenizer::eot() const {
  return vocab_->eot;
}
bool Tokenizer::add_bos() const {
  return vocab_->add_bos;
}
bool Tokenizer::add_eos() const {
  return vocab_->add_eos;
}
const std::string& Tokenizer::model() const {
  return vocab_->model;
}
const std::string& Tokenizer::pre_tokenizer() const {
  return vocab_->pre;
}

bool Tokenizer::is_eog(TokenId id) const {
  return id >= 0 && id < n_vocab() && vocab_->is_eog[id] != 0;
}

std::vector<TokenId> Tokenizer::eog_tokens() const {
  std::vector<TokenId> ids;
  for (TokenId id = 0; id < n_vocab(); ++id) {
    if (vocab_->is_eog[id]) ids.push_back(id);
  }
  return ids;
}

bool Tokenizer::is_control(TokenId id) const {
  return id >= 0 && id < n_vocab() && (vocab_->attr[id] & kAttrControl) != 0;
}

const std::string& Tokenizer::token_text(TokenId id) const {
  if (id < 0 || id >= n_vocab()) return empty_;
  return vocab_->text[id];
}

std::optional<TokenId> Tokenizer::find_token(std::string_view text) const {
  const TokenId id = vocab_->find(text);
  if (id < 0) return std::nullopt;
  return id;
}

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool render_special)
    : tok_(tok), render_special_(render_special) {}

std::string StreamDecoder::push(TokenId id) {
  auto piece = tok_.token_to_piece(id, render_special_);
  pending_ += piece.ok() ? *piece : std::string("\xEF\xBF\xBD");
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const unicode::Utf8Step step = unicode::utf8_scan(std::string_view(pending_).substr(i));
    if (step.length == 0) break;  // incomplete character: wait for more bytes
    if (step.valid) {
      out.append(pending_, i, step.length);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += step.length;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = pending_.empty() ? std::string() : std::string("\xEF\xBF\xBD");
  pending_.clear();
  return out;
}

}  // namespace d2o
