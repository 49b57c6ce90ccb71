// Engine: runs the transformer over a batch of token chunks from one or more sequences.
//
// One call of forward() takes, per sequence, the next chunk of its tokens (a whole prompt, a piece
// of a long text, or one decoded token). Rows of all chunks are processed together through the
// weight matmuls (weights are read once per micro-batch of up to n_ubatch rows, whatever the
// number of sequences); attention runs per sequence over its own cache. After all layers, each
// sequence's KV policy compacts its cache. Logits are produced for the rows asked for and handed to
// a sink row by row, so no [n_tokens, n_vocab] matrix is ever held.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/mem.h"
#include "core/thread_pool.h"
#include "d2o/status.h"
#include "kv/attention.h"
#include "model/model.h"
#include "runtime/sequence.h"

namespace d2o {

using TokenId = int32_t;

// How attention work is spread over the thread pool when a micro-batch holds several sequences.
// Results are bit-identical whichever is chosen (attention reduces in a fixed tile order for any
// thread count); only speed differs.
enum class AttnSplit {
  // Decode rows (chunks of one token) of different sequences run in parallel, one sequence per
  // task with single-threaded attention; longer chunks are split inside the sequence over
  // (KV head, slot tile). The default: a decode step over many sequences pays one pool dispatch
  // per layer instead of three per sequence and layer.
  kAuto,
  kWithinSequence,   // every chunk split over (KV head, slot tile), one sequence after the other
  kAcrossSequences,  // every chunk one task (any length), sequences in parallel
};
const char* attn_split_name(AttnSplit s);

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
  // that ends the prompt (PassInfo::prompt_rest). Contract, checked: the chunks of one prompt
  // announce consistent counts, and when the policy reads an observation window of w queries
  // (SnapKV) the prompt's last chunk holds at least min(w, prompt length) tokens, so the window
  // lies within one pass.
  int64_t prompt_rest = 0;
};

// Receives logits: entry index in the batch, token index within that entry's chunk, and
// n_vocab floats valid only during the call.
using LogitsSink = std::function<void(int entry, int token, const float* logits)>;

// Wall-clock split of the work, accumulated over calls (for reports).
struct EngineTimings {
  double matmul_s = 0, attention_s = 0, policy_s = 0, other_s = 0;
  int64_t rows = 0;
};

class Engine {
 public:
  Engine(const Model& model, ThreadPool& pool, const EngineOptions& opts);

  const Model& model() const { return model_; }
  const EngineOptions& options() const { return opts_; }
  const RopeParams& rope() const { return rope_; }
  ThreadPool& pool() { return pool_; }

  // Runs the chunks; on success every sequence has advanced by its chunk and was compacted by its
  // policy. Errors: token ids out of range, empty chunks, a sequence twice in one batch, memory.
  Status forward(std::span<const BatchEntry> batch, const LogitsSink& sink);

  const EngineTimings& timings() const { return timings_; }
  void reset_timings() { timings_ = {}; }

 private:
  struct Row {
    int entry;
    int token;  // index within the entry's chunk
    int32_t pos;
  };
  // The rows [r0, r1) of one entry within a micro-batch.
  struct Span {
    int entry, r0, r1;
  };
  Status validate(std::span<const BatchEntry> batch) const;
  Status run_ubatch(std::span<const BatchEntry> batch, std::span<const Row> rows,
                    const LogitsSink& sink);
  // Appends the micro-batch's keys/values of layer il to every sequence and runs attention.
  Status attend_layer(int il, std::span<const BatchEntry> batch, std::span<const Row> rows);
  void ensure_rows(int n_rows);

  const Model& model_;
  ThreadPool& pool_;
  EngineOptions opts_;
  AttnScratch attn_scratch_;
  // Attention across sequences: one single-thread pool and one scratch per thread of pool_.
  std::vector<std::unique_ptr<ThreadPool>> solo_pools_;
  std::vector<AttnScratch> solo_scratch_;
  std::vector<Span> spans_;
  std::vector<int> across_;              // spans run one per task
  std::vector<Status> compact_status_;   // per batch entry
  std::vector<Status> layer_status_;     // per across-sequence span: layer-wise compaction
  std::vector<double> thread_policy_s_;  // per pool thread: layer-wise compaction seconds
  double layer_policy_s_ = 0;            // this micro-batch's layer-wise compaction wall share
  RopeParams rope_;
  EngineTimings timings_;
  int rows_cap_ = 0;
  // Activations [rows, dim].
  AlignedBuffer<float> x_, xn_, q_, k_, v_, attn_out_, gate_, up_, logits_;
  std::vector<Row> rows_;
  std::vector<int> want_;  // rows that produce logits
};

}  // namespace d2o
