// Options and set-up shared by the subcommands that run a model.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>

#include "core/thread_pool.h"
#include "kv/policy.h"
#include "model/model.h"
#include "runtime/chat_template.h"
#include "runtime/engine.h"
#include "runtime/kv_mem_budget.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer.h"

namespace d2o::cli {

struct ModelOptions {
  std::string model;
  int threads = 0;  // 0: all cores
  int n_ctx = 0;    // 0: the model's trained context
  int n_ubatch = 512;
  std::string kv_spec = "full";
  std::string kv_type = "f16";
  std::string kv_mem_per_seq;  // --kv-mem-per-seq ("": not given)
  bool dequantize = false;     // compute with weights dequantised to F32
};

// Registers -m, -t, -c, --ubatch, --kv, --kv-type on a subcommand.
void add_model_options(CLI::App* app, ModelOptions& o, bool with_kv);

// Registers --chunk, the prompt tokens per prefill pass of `run` and `chat`
// (GenerateParams::prefill_chunk; 0: one pass).
void add_prefill_chunk_option(CLI::App* app, int& chunk);

struct SamplingOptions {
  SamplerParams params;
};
void add_sampling_options(CLI::App* app, SamplerParams& p);

// Everything a generation needs, loaded once.
struct Loaded {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;  // absent when the model has none
  std::string chat_template_error;
  std::shared_ptr<const KvPolicy> policy;
  KvType kv_type = KvType::kF16;
  int kv_full_slots = 0;  // > 0: --kv-mem-per-seq with a full cache: the most slots it may hold
  // --kv-mem-per-seq: the budget it gave, in words, for the KV report ("" without it).
  std::string kv_mem_note;
  int n_ctx = 0;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<Engine> engine;
  double load_seconds = 0;
};

// Validates options and loads model, tokenizer, policy, pool and engine.
Result<Loaded> load_all(const ModelOptions& o);

Result<KvType> parse_kv_type(const std::string& s);

// "1,2,3" -> ids, each checked against the vocabulary size.
Result<std::vector<TokenId>> parse_token_list(const std::string& s, int n_vocab);

// One-line memory summary: weights, KV (allocated vs full cache for n tokens), peak RSS.
std::string memory_summary(const Loaded& l, const Sequence& seq);

// Key and value bytes of a cache after n_tokens tokens, in its storage type: in the slots
// attention reads (a sliding-window layer's slots past its window are not), allocated, and in a
// full cache of the same storage type / of F16 (every token, the last W of a sliding layer).
struct KvBytesShares {
  double needed = 0, allocated = 0, full_same = 0, full_f16 = 0;
};
KvBytesShares kv_bytes_shares(const KvCache& c, int64_t n_tokens);

// The budget and how it was chosen (`mem_note`: Loaded::kv_mem_note), then per layer the
// budget, slots, evictions, merges, EMA threshold and density variance, then every byte the
// sequence holds: hot key and value rows, slot metadata, the policy's state, the cold tier (in
// memory and on disk), and the most the hot cache allocated at once.
void print_kv_report(std::FILE* out, const Sequence& seq, const std::string& mem_note);

}  // namespace d2o::cli
