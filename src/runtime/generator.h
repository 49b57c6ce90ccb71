// Text generation on one sequence: feed the prompt, then sample token by token until an
// end-of-generation token, a stop string, or the token limit. Shared by the CLI (run, chat) and
// later the server.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "d2o/status.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer.h"

namespace d2o {

struct GenerateParams {
  int n_predict = 128;  // maximum new tokens (>= 1)
  SamplerParams sampling;
  std::vector<std::string> stop;  // stop strings (not included in the output)
  bool stop_at_eog = true;        // stop at EOS / end-of-turn tokens
  int64_t max_positions = 0;      // > 0: stop (reason "context") before exceeding this
  // > 0: the prompt goes in passes of this many tokens (prefill_chunks), each but the last
  // announcing the rest (BatchEntry::prompt_rest). A fixed-budget policy (budget=,
  // --kv-mem-per-seq) compacts after each, so the cache never holds more than its budget plus
  // two chunks, whatever the prompt's length (bounded prefill), and so does a ratio policy with
  // prefill=bounded (its budget the ratio of the whole prompt); the full cache and a ratio policy
  // with prefill=exact give exactly the one-pass result (the whole prompt compressed once, after
  // the last chunk). 0: one pass, the exact prompt-then-compress of a fixed budget.
  int prefill_chunk = 0;
};

// The passes of an n-token prompt fed `chunk` tokens at a time: chunk rounded down to a multiple
// of 16 (the attention kernel's query block: passes that start on query blocks give the one
// pass's results bit for bit, tests/unit/test_chunked_prefill.cpp),
// and a last pass shorter than min_last (the policy's observation window, which must lie within
// one pass) joined to the one before it. chunk <= 0 or n <= chunk: one pass.
std::vector<int> prefill_chunks(int64_t n, int chunk, int min_last);

struct GenerateResult {
  std::vector<TokenId> tokens;  // generated tokens (the stop token excluded)
  std::string text;             // generated text, stop string excluded
  std::string stop_reason;      // "eog", "stop", "length" or "context"
  int n_prompt = 0;
  double prompt_seconds = 0;
  double decode_seconds = 0;  // time of the n_decoded forward passes
  int n_decoded = 0;          // forward passes after the prompt (one token each)
};

// Length of the longest suffix of `text` that is a proper prefix of some stop string: output
// that must be held back until the next tokens show whether a stop string follows.
size_t stop_string_holdback(std::string_view text, const std::vector<std::string>& stops);

// on_text receives output text as it becomes final (never a partial UTF-8 character, never a
// piece that may still turn out to start a stop string).
Result<GenerateResult> generate(Engine& engine, const Tokenizer& tok, Sequence& seq,
                                std::span<const TokenId> prompt, const GenerateParams& params,
                                const std::function<void(std::string_view)>& on_text);

}  // namespace d2o
