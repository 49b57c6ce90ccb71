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

struct EngineOptions {
  int n_ubatch = 512;  // rows per micro-batch (bounds activation memory)
};

struct BatchEntry {
  Sequence* seq = nullptr;
  std::span<const TokenId> tokens;
  // Logits for the chunk's tokens from this index on (0: all); -1: only the last token.
  int logits_from = -1;
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
  Status run_ubatch(std::span<const BatchEntry> batch, std::span<const Row> rows,
                    const LogitsSink& sink);
  void ensure_rows(int n_rows);

  const Model& model_;
  ThreadPool& pool_;
  EngineOptions opts_;
  AttnScratch attn_scratch_;
  RopeParams rope_;
  EngineTimings timings_;
  int rows_cap_ = 0;
  // Activations [rows, dim].
  AlignedBuffer<float> x_, xn_, q_, k_, v_, attn_out_, gate_, up_, logits_;
  std::vector<Row> rows_;
  std::vector<int32_t> pos_tmp_;
  std::vector<int> want_;  // rows that produce logits
};

}  // namespace d2o
