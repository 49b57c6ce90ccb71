// The engine as the Python package drives it, without Python: a loaded model (weights,
// tokenizer, chat template, thread pool, engine), sequences with a KV policy, generation and
// scoring. module.cpp binds these to Python; everything here returns a Status or Result, and the
// binding turns a failed one into a Python exception.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "d2o/status.h"
#include "model/model.h"
#include "runtime/chat_template.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/tokenizer.h"

namespace d2o::py {

struct ModelConfig {
  std::string path;  // a GGUF file
  int threads = 0;   // 0: all cores
  int n_ctx = 0;     // 0: the model's trained context
  int n_ubatch = 512;
};

// A sequence's cache: its policy spec and storage type, as `d2o run --kv --kv-type` take them,
// and its KV memory as `--kv-mem-per-seq` takes it ("": not given).
struct CacheConfig {
  std::string kv = "full";
  std::string kv_type = "f16";
  std::string kv_mem_per_seq;
};

// What kv_mem_per_seq chose (spec_for_kv_mem): the bytes asked as given and parsed, the slots
// per KV head and layer that fit, whether they cap a full cache (else they are the policy's
// budget=), and the KV report's note on it (kv_mem_note, as `d2o run --kv-report` prints it).
struct KvMemChoice {
  std::string asked;
  size_t bytes = 0;
  int slots = 0;
  bool full_cap = false;
  std::string note;
};

class PyModel {
 public:
  // Errors: a missing or unreadable file (kNotFound / kIoError), a malformed one (kFormatError),
  // an unsupported architecture, a bad thread count or context.
  static Result<std::unique_ptr<PyModel>> load(const ModelConfig& c);

  int n_vocab() const { return model_->hparams().n_vocab; }
  int n_ctx() const { return n_ctx_; }
  const ModelHParams& hparams() const { return model_->hparams(); }
  const Tokenizer& tokenizer() const { return *tok_; }
  Engine& engine() { return *engine_; }
  const std::string& path() const { return path_; }
  // One call into the engine at a time (the bindings lock it with the GIL released).
  std::mutex& mutex() { return mu_; }

  // The chat template's text for these messages with the assistant's turn opened, as the
  // server renders a chat request; and the strings that end the assistant's turn.
  Result<std::string> chat_text(const std::vector<ChatMessage>& messages) const;
  std::vector<std::string> chat_stops() const;

  // Every id within the vocabulary; `what` names them in the message.
  Status check_ids(std::span<const TokenId> ids, const std::string& what) const;
  // A fresh sequence with that policy and storage type (errors: a bad spec, type or memory, the
  // CLI's messages), its slots capped at the context; with kv_mem_per_seq, the policy's budget is
  // the slots that fit, or a full cache is capped at them (*mem, when given, says what was
  // chosen; it is left empty without kv_mem_per_seq).
  Result<std::unique_ptr<Sequence>> new_sequence(const CacheConfig& c,
                                                 KvMemChoice* mem = nullptr) const;

  // d2o::generate with `d2o run`'s settings: the context as the limit of positions. A full
  // cache capped by kv_mem_per_seq refuses a prompt beyond its cap before feeding any of it
  // (kResourceExhausted), and fails as `d2o run` does when decoding reaches it.
  Result<GenerateResult> generate(Sequence& seq, std::span<const TokenId> ids, GenerateParams gp,
                                  const std::function<void(std::string_view)>& on_text);

  // kv_mem_per_seq with a compressing policy (a fixed budget): the cache grows no further than
  // the policy's peak for the passes that feed n_new tokens in chunks of `chunk` (0: one pass)
  // and then decode n_gen more (KvPolicy::peak_slots_for, what the server reserves for them),
  // instead of in steps of 256 slots or more, so that it holds its budget plus about one pass at
  // its peak. Call before each generate() / score() of such a sequence.
  Status bound_growth(Sequence& seq, int64_t n_new, int64_t n_gen, int chunk) const;

  // Receives the logits of row `row` of the fed tokens (n_vocab floats, valid during the call).
  using RowFn = std::function<void(size_t row, const float* logits)>;

  // Feeds `ids` to `seq` and hands the logits of every one of them to `fn`, row by row. With
  // 0 < context_end < n the first context_end tokens are fed as a prompt of their own (a ratio
  // policy compresses them at their end, as the server's `context_end` does), then the rest;
  // each part in passes of `chunk` tokens (0: one pass; the server's --chunk is 256). An empty
  // `fn`: no logits are computed. Tokens beyond a full cache's kv_mem_per_seq cap are refused
  // before any is fed (kResourceExhausted).
  Status score(Sequence& seq, std::span<const TokenId> ids, int64_t context_end, int chunk,
               const RowFn& fn);

 private:
  Status feed(Sequence& seq, std::span<const TokenId> ids, size_t first_row, int chunk,
              const RowFn& fn);
  // Whether n more tokens fit in seq's slots when a full cache is capped below the context.
  Status check_cap(const Sequence& seq, int64_t n) const;

  std::string path_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tok_;
  std::optional<ChatTemplate> tmpl_;
  std::string tmpl_error_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Engine> engine_;
  int n_ctx_ = 0;
  std::mutex mu_;
};

}  // namespace d2o::py
