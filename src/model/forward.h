// ModelForward: the seam between the runtime and a model's computation.
//
// The runtime (src/runtime/engine.cpp) cuts a batch of sequences' token chunks into micro-batches
// of rows and calls ModelForward::run once per micro-batch with the rows' token ids and positions,
// each sequence's span of rows with its KV cache and the attention statistics its KV policy reads,
// and the rows whose logits are wanted. run() takes the rows through every layer (embedding,
// norms, Q/K/V, RoPE, cache append, attention, feed-forward, residuals) and hands the logits back
// through ForwardHooks; it calls back once per layer and sequence when a decode row's layer may be
// compacted right after its attention. Validation, micro-batching, scheduling, compaction after
// the pass, timing and generation stay in the runtime; what a layer computes lives in
// src/model/arch_<family>.cpp, built from the pieces of src/model/blocks.h and read from the
// LayerDesc of each layer (src/model/layer_desc.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "core/thread_pool.h"
#include "d2o/status.h"
#include "kv/attention.h"
#include "model/layer_desc.h"
#include "model/model.h"

namespace d2o {

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

struct ForwardOptions {
  int max_rows = 512;  // rows per run() at most (the runtime's micro-batch size)
  AttnSplit attn_split = AttnSplit::kAuto;
};

// One sequence's rows of a micro-batch.
struct SeqRows {
  KvCache* cache = nullptr;  // the sequence's cache: each layer's keys/values are appended to it
  int r0 = 0, r1 = 0;        // its rows [r0, r1) of the micro-batch (consecutive positions)
  AttnStatsRequest stats;    // the attention statistics its KV policy reads
  // ForwardHooks::after_attention may be called for this sequence (a decode row, or the rows of
  // a turn that recalls from the cold tier).
  bool layer_hook = false;
  // The rows end a new turn of a sequence whose cache has a cold tier: before each layer's
  // attention, the last `window` rows' queries recall cold slots (kv/cold_tier.h).
  bool recall = false;
};

struct UbatchInput {
  std::span<const int32_t> tokens;  // [n] token ids, each in [0, n_vocab)
  std::span<const int32_t> pos;     // [n] positions (RoPE and the cache's slot positions)
  std::span<const SeqRows> seqs;    // in row order; their spans cover [0, n) exactly
  std::span<const int> logit_rows;  // rows whose logits are wanted, ascending
};

// What a micro-batch hands back to the runtime while it runs.
class ForwardHooks {
 public:
  // Layer il's attention for seqs[s] has just run, in a task of its own (a sequence alone in its
  // task: decode rows spread over the pool), and SeqRows::layer_hook is set. Runs on pool thread
  // `thread` (for per-thread accounting) while other sequences' tasks run, or with thread = -1 on
  // the calling thread while nothing else runs (a decode row that attended on the whole pool);
  // it may touch only that sequence (its cache, its policy state): a KV policy that allows it
  // compacts the layer here, while the layer's slots are still in the core's caches. Sequences
  // not called back for a layer are compacted after the pass as usual. An error fails the pass.
  virtual Status after_attention(int s, int il, const LayerDesc& layer, int thread) = 0;
  // Logits of rows[i] are at logits + i * n_vocab (valid during the call); rows come in
  // ascending order, at most kLogitRows at a time.
  virtual void logits(std::span<const int> rows, const float* logits) = 0;

  static constexpr int kLogitRows = 32;

 protected:
  ~ForwardHooks() = default;
};

// Wall time of the matrix products and of attention (cache append, attention, and the
// after_attention calls made inside it), accumulated by run().
struct ForwardTimings {
  double matmul_s = 0, attention_s = 0;
};

class ModelForward {
 public:
  // The forward pass of `model`'s architecture (model.hparams().arch), on `pool`. The model and
  // the pool must outlive it.
  static std::unique_ptr<ModelForward> create(const Model& model, ThreadPool& pool,
                                              const ForwardOptions& opts);
  virtual ~ModelForward() = default;

  // Runs the micro-batch `in` (at most ForwardOptions::max_rows rows, inputs as documented above,
  // validated by the caller) through all layers. On success every sequence's cache holds its
  // rows' keys and values in every layer. Errors: memory (the cache cannot grow), or an error of
  // after_attention.
  virtual Status run(const UbatchInput& in, ForwardHooks& hooks, ForwardTimings& t) = 0;
};

}  // namespace d2o
