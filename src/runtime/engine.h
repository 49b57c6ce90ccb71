// Engine: runs a batch of token chunks from one or more sequences through the model.
//
// One call of forward() takes, per sequence, the next chunk of its tokens (a whole prompt, a piece
// of a long text, or one decoded token). Rows of all chunks are processed together through the
// weight matmuls (weights are read once per micro-batch of up to n_ubatch rows, whatever the
// number of sequences); attention runs per sequence over its own cache. After all layers, each
// sequence's KV policy compacts its cache. Logits are produced for the rows asked for and handed to
// a sink row by row, so no [n_tokens, n_vocab] matrix is ever held.
//
// The engine validates the batch, cuts it into micro-batches, decides what each sequence's policy
// needs from attention, runs the policies (layer by layer from ForwardHooks::after_attention, or
// after the pass) and keeps the timings; the layers themselves run in the model's ModelForward
// (src/model/forward.h), one call per micro-batch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "d2o/status.h"
#include "model/forward.h"
#include "model/model.h"
#include "runtime/sequence.h"

namespace d2o {

using TokenId = int32_t;

struct EngineOptions {
  int n_ubatch = 512;  // rows per micro-batch (bounds activation memory)
  AttnSplit attn_split = AttnSplit::kAuto;
};

struct BatchEntry {
  // logits_from value: no logits at all (a prompt chunk that is not the prompt's last).
  static constexpr int kNoLogits = -2;

  Sequence* seq = nullptr;
  std::span<const TokenId> tokens;
  // Logits for the chunk's tokens from this index on (0: all); -1: only the last token;
  // kNoLogits: none.
  int logits_from = -1;
  // Chunked prefill: tokens of the same prompt that later passes will bring (0: this chunk ends
  // the prompt, or it is a decode step). Ratio policies compact for the first time on the pass
  // that ends the prompt, or with prefill=bounded take the whole prompt's length from it
  // (PassInfo::prompt_rest). Contract, checked: the chunks of one prompt
  // announce consistent counts, and when the policy reads the attention of the last w queries
  // (StatsNeeds::window) the prompt's last chunk holds at least min(w, prompt length) tokens, so
  // the window
  // lies within one pass.
  int64_t prompt_rest = 0;
};

// Free slots a cache keeps after a compaction that removed slots (KvCache::trim's slack). A pass
// that more passes like it are expected to follow keeps room for one of them: a prompt chunk with
// more of its prompt to come, or a pass that scores its tokens (logits_from >= 0: text fed chunk
// after chunk, as `eval ppl --chunk` does). The next such pass then appends without a
// reallocation, and a compacting prompt holds its budget plus one chunk, where room for less
// would grow each layer by a quarter for every chunk and copy it twice (grown, then trimmed back)
// with both copies held for a moment. Any other pass, the one that ends a prompt or a decode
// step, keeps one slot, for the decode step that follows: so the prompt's last compaction leaves
// the cache at its decoding size in the reallocation it makes anyway, and decoding never copies
// the cache into a smaller block.
inline int slack_after_compaction(int n_tokens, bool more_alike) {
  return more_alike ? n_tokens : 1;
}

// Receives logits: entry index in the batch, token index within that entry's chunk, and
// n_vocab floats valid only during the call.
using LogitsSink = std::function<void(int entry, int token, const float* logits)>;

// Wall-clock split of the work, accumulated over calls (for reports).
struct EngineTimings {
  double matmul_s = 0, attention_s = 0, policy_s = 0, other_s = 0;
  int64_t rows = 0;
  // Of those: the prompt reconstructions' passes (KvPolicy::reconstruction_chunk), and their rows.
  double reconstruct_s = 0;
  int64_t reconstruct_rows = 0;
};

class Engine : private ForwardHooks {
 public:
  Engine(const Model& model, ThreadPool& pool, const EngineOptions& opts);

  const Model& model() const { return model_; }
  const EngineOptions& options() const { return opts_; }
  // The RoPE KV policies re-rotate kept keys with (PassInfo::rope).
  const RopeParams& rope() const { return model_.desc().policy_rope; }
  ThreadPool& pool() { return pool_; }

  // Runs the chunks; on success every sequence has advanced by its chunk and was compacted by its
  // policy. Errors: token ids out of range, empty chunks, a sequence twice in one batch, memory.
  Status forward(std::span<const BatchEntry> batch, const LogitsSink& sink);

  // What forward() does for one entry once its pass has run: advances the sequence by the
  // chunk, lets its policy compact the cache (PassInfo from the entry), and hands freed memory
  // back. Public for callers that fill a sequence's cache without a pass of their own: the
  // evaluations' shared prefill (src/eval/fork.h) copies one pass's cache into each policy's
  // sequence and finishes it here, so that the compaction after a prompt exists once.
  // layer_pool: a pool the policy may plan layers on (outside the pool's own tasks), or null.
  Status finish_pass(const BatchEntry& be, ThreadPool* layer_pool) const;
  // The end of a pass of n_tokens, compacted or not: sliding-window layers give back a long
  // prompt's slots.
  Status settle(const BatchEntry& be, int n_tokens) const;

  // The prompt's reconstruction before its first compaction, when the entry's policy asks for
  // one (KvPolicy::reconstruction_chunk; engine_reconstruct.cpp): the prompt held in
  // seq->prompt_tokens(), of which be.tokens is the last pass, fed again after itself in passes
  // of the policy's chunk; the attention every one of their queries gives each prompt slot summed
  // into the window statistics; their slots dropped. forward() runs it before finish_pass();
  // public for callers that fill a cache without a pass of their own (src/eval/fork.h).
  Status reconstruct(const BatchEntry& be);

  const EngineTimings& timings() const { return timings_; }
  void reset_timings() { timings_ = {}; }

 private:
  struct Row {
    int entry;
    int token;  // index within the entry's chunk
  };
  Status validate(std::span<const BatchEntry> batch) const;
  // Runs the micro-batch held in rows_, tokens_, pos_.
  Status run_ubatch(std::span<const BatchEntry> batch, const LogitsSink& sink);
  // The entry's tokens at positions first_pos, first_pos + 1, ..., in micro-batches.
  Status run_rows(const BatchEntry& be, int64_t first_pos, const LogitsSink& sink);

  // ForwardHooks: layer-wise compaction of a decode row's sequence, and logits to the sink.
  Status after_attention(int s, int il, const LayerDesc& layer, int thread) override;
  void logits(std::span<const int> rows, const float* logits) override;

  const Model& model_;
  ThreadPool& pool_;
  EngineOptions opts_;
  std::unique_ptr<ModelForward> forward_;
  EngineTimings timings_;
  // The micro-batch being run: its rows, their tokens and positions, one SeqRows per entry (and
  // that entry's index), the rows that produce logits; the batch and sink of the current call.
  std::vector<Row> rows_;
  std::vector<int32_t> tokens_, pos_;
  std::vector<SeqRows> seqs_;
  std::vector<int> seq_entry_;
  std::vector<int> want_;
  std::span<const BatchEntry> batch_;
  const LogitsSink* sink_ = nullptr;
  std::vector<Status> compact_status_;   // per batch entry
  std::vector<double> thread_policy_s_;  // per pool thread: layer-wise compaction seconds
  double alone_policy_s_ = 0;  // layer-wise compaction seconds with nothing running beside
  // reconstruct(): run_ubatch asks for the window over every row and nothing else; the sums.
  bool reconstructing_ = false;
  std::vector<float> recon_sum_;
};

}  // namespace d2o
